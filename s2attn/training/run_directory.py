"""A training run's output directory: what it holds (``run.json``, ``metrics.jsonl``,
``checkpoint/``, ``train.lock``, at the end the model and ``curves.png``), whether a directory may
take a run, the lock that keeps a second ``s2attn train`` out of it, and the run's record.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from . import presets
from .checkpoints import find_checkpoint
from .options import TrainOptions, comparable

try:
    import fcntl
except ImportError:  # Windows: no flock, so the output directory goes unguarded
    fcntl = None

__all__ = [
    "CURVES_FILE",
    "METRICS_FILE",
    "RUN_FILE",
    "check_not_in_use",
    "claim",
    "run_record",
    "write_atomic",
]

RUN_FILE = "run.json"
METRICS_FILE = "metrics.jsonl"
CURVES_FILE = "curves.png"
_LOCK_FILE = "train.lock"


def _check_out_dir(out: Path, options: TrainOptions, resume: bool) -> Path | None:
    """Whether ``out`` may take this run: the checkpoint to resume from, or None to start afresh.

    Reads only; raises ``ValueError`` for a file, a directory of something else, another run,
    this run again without ``--resume``, and ``--resume`` with no checkpoint to resume from."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {str(out)!r} is a file, not a directory")
    # A lock file alone is what a run killed before writing anything leaves.
    if not out.exists() or all(p.name == _LOCK_FILE for p in out.iterdir()):
        if resume:
            raise ValueError(
                f"--resume: nothing to resume in {str(out)!r} (no run there); leave out --resume "
                "to start one"
            )
        return None
    record_path = out / RUN_FILE
    if not record_path.is_file():
        raise ValueError(
            f"--out {str(out)!r} is not empty and holds no {RUN_FILE}: it is not an s2attn "
            "training run; choose a new or empty directory"
        )
    try:
        saved = json.loads(record_path.read_text())["options"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(
            f"{record_path} is not a readable run record ({exc}); choose a new or empty --out"
        ) from None
    mine = json.loads(json.dumps(options.comparable()))
    theirs = comparable(saved)
    if mine != theirs:
        keys = sorted(set(mine) | set(theirs))
        diff = ", ".join(
            f"{k}: saved {theirs.get(k)!r}, now {mine.get(k)!r}"
            for k in keys
            if mine.get(k) != theirs.get(k)
        )
        hint = "choose another directory"
        if mine.get("data_root") != theirs.get("data_root") and theirs.get("data_root"):
            # Runs of earlier versions read site-packages by default.
            roots = " ".join(f"--data-root {shlex.quote(str(r))}" for r in theirs["data_root"])
            hint = f"to resume on its data, pass {roots}; or choose another directory"
        raise ValueError(f"--out {str(out)!r} holds a different run ({diff}); {hint}")
    checkpoint = find_checkpoint(out)
    if checkpoint is None:
        # Starting over in place would discard the metrics it logged: the user decides.
        raise ValueError(
            f"--out {str(out)!r} holds this run but no checkpoint: it stopped before its first "
            "one, so there is nothing to resume; delete the directory to start over, or choose "
            "another"
        )
    if not resume:
        raise ValueError(
            f"--out {str(out)!r} already holds this run; pass --resume to continue it, or "
            "choose another directory"
        )
    return checkpoint


def claim(out: Path, options: TrainOptions, resume: bool):
    """Create and lock ``out`` for this run: returns the lock (held until it is closed) and the
    checkpoint to resume from (None: a fresh start). A refusal (``ValueError``, as for
    :func:`_check_out_dir`, or the directory in use) leaves ``out`` as it found it."""
    created = next((p for p in reversed([out, *out.parents]) if not p.exists()), None)
    had_lock = (out / _LOCK_FILE).exists()
    out.mkdir(parents=True, exist_ok=True)
    lock = None
    try:
        lock = _lock(out)
        # Under the lock, so that no other process writes into out between the check and the run.
        checkpoint = _check_out_dir(out, options, resume)
    except ValueError:
        if lock is not None:
            lock.close()
        if created is not None:
            shutil.rmtree(created, ignore_errors=True)
        elif not had_lock and lock is not None:
            (out / _LOCK_FILE).unlink(missing_ok=True)
        raise
    # The pid for the next process to name; written once the run is sure to go ahead.
    lock.truncate(0)
    lock.write(f"{os.getpid()}\n")
    lock.flush()
    return lock, checkpoint


def _in_use(out: Path) -> ValueError:
    try:
        pid = (out / _LOCK_FILE).read_text().strip()
    except OSError:
        pid = ""
    holder = f"pid {pid}" if pid.isdigit() else "a process that is starting"
    return ValueError(
        f"--out {str(out)!r} is in use by another `s2attn train` ({holder}); wait for it to end "
        "or stop it (Ctrl-C saves a checkpoint), or choose another directory"
    )


def check_not_in_use(out: Path) -> None:
    """Raise ``ValueError`` if a live process holds the lock of ``out``; reads only."""
    path = out / _LOCK_FILE
    if fcntl is None or not path.is_file():
        return
    with path.open("rb") as f:
        try:
            # A shared lock is refused only while the holder's exclusive one stands; closing the
            # file lets go of it.
            fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            raise _in_use(out) from None


def _lock(out: Path):
    """Lock ``out`` for this process until the returned file is closed (or the process ends,
    however it ends: the kernel drops the lock, so a killed run leaves no stale lock)."""
    # "a": create the file without emptying it, so the holder's pid stays readable.
    handle = (out / _LOCK_FILE).open("a")
    if fcntl is None:
        return handle
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        raise _in_use(out) from None
    return handle


def _git_commit() -> str | None:
    root = Path(__file__).resolve().parents[2]
    try:
        commit = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"],
            check=True,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            check=True,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return commit + ("-dirty" if dirty else "") if commit else None


def run_record(options: TrainOptions, config, corpora: dict, device: torch.device) -> dict:
    """What ``run.json`` holds: the options, the preset, the model's summary, what the data
    splits read (``corpora``: the corpus of each split), the device, the library versions, the
    date, the git commit and the command."""
    import transformers
    import triton

    if device.type == "cuda":
        device_name = torch.cuda.get_device_name(device)
    else:
        processor = platform.processor() or platform.machine()
        device_name = f"cpu ({processor}, {torch.get_num_threads()} threads)"
    command = None
    if sys.argv[1:2] == ["train"]:
        command = "python -m s2attn train " + " ".join(sys.argv[2:])
    return {
        "options": options.record(),
        "preset": dataclasses.asdict(options.preset_shape),
        "model": presets.model_summary(config, options.seq_len),
        "data": {split: corpus.describe() for split, corpus in corpora.items()},
        "device": device_name,
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "triton": triton.__version__,
        },
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "git_commit": _git_commit(),
        "command": command,
    }


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
