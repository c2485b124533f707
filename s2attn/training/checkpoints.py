"""A training run's checkpoint: the model, optimizer, schedule, data stream and RNG states, and
the counters of :class:`Progress`, in ``checkpoint/`` of the run's directory.

A save writes a temporary directory and swaps it in, so that a crash at any point leaves one
complete checkpoint behind; a load names the damaged file, or the changed training data, that
keeps a run from going on.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import random
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from .data import TokenStream

__all__ = [
    "CHECKPOINT",
    "Progress",
    "find_checkpoint",
    "load_checkpoint",
    "save_checkpoint",
    "saved_step",
]

CHECKPOINT = "checkpoint"
_STATE_FILE = "state.pt"
_PROGRESS_FILE = "progress.json"


@dataclass
class Progress:
    """Counters a checkpoint carries besides the tensors' states."""

    step: int = 0
    tokens: int = 0
    elapsed_s: float = 0.0
    # The running sums of the current metrics row (losses since the last row was written).
    row_loss: float = 0.0
    row_steps: int = 0
    row_tokens: int = 0
    row_train_s: float = 0.0


def find_checkpoint(out: Path) -> Path | None:
    """The complete checkpoint in the run directory ``out``, or None."""
    # checkpoint.old exists only if a save stopped between its two renames.
    for name in (CHECKPOINT, CHECKPOINT + ".old"):
        if (out / name / _STATE_FILE).is_file():
            return out / name
    return None


def saved_step(checkpoint: Path) -> int:
    """The step that ``checkpoint`` was taken after."""
    return json.loads((checkpoint / _PROGRESS_FILE).read_text())["progress"]["step"]


def save_checkpoint(
    out: Path,
    model,
    optimizer,
    scheduler,
    stream: TokenStream,
    progress: Progress,
    device: torch.device,
) -> None:
    """Write the checkpoint to a temporary directory, then swap it in: a crash at any point
    leaves one complete checkpoint behind."""
    tmp, final, old = out / (CHECKPOINT + ".tmp"), out / CHECKPOINT, out / (CHECKPOINT + ".old")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    rng = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if device.type == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state(device)
    state = {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "rng": rng,
    }
    torch.save(state, tmp / _STATE_FILE)
    (tmp / _PROGRESS_FILE).write_text(
        json.dumps(
            {"progress": dataclasses.asdict(progress), "stream": stream.state_dict()}, indent=1
        )
    )
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)


def load_checkpoint(
    path: Path, model, optimizer, scheduler, stream: TokenStream, device: torch.device
) -> Progress:
    """Load the checkpoint ``path`` into the objects given, and the RNG states; raises
    ``ValueError`` naming the damaged file, or the changed data, that keeps the run from going
    on."""
    state_file, progress_file = path / _STATE_FILE, path / _PROGRESS_FILE
    try:
        state = torch.load(state_file, map_location=device, weights_only=True)
    except (RuntimeError, EOFError, OSError, pickle.UnpicklingError) as exc:
        raise ValueError(_damaged(state_file, exc)) from None
    if not isinstance(state, dict) or not {"model", "optimizer", "scheduler", "rng"} <= set(state):
        raise ValueError(_damaged(state_file, "no model, optimizer, schedule and RNG states"))
    try:
        saved = json.loads(progress_file.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(_damaged(progress_file, exc)) from None
    if not isinstance(saved, dict) or not {"progress", "stream"} <= set(saved):
        raise ValueError(_damaged(progress_file, "no progress and data stream states"))
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    try:
        stream.load_state_dict(saved["stream"])
    except ValueError as exc:
        roots = ", ".join(str(r) for r in stream.corpus.roots)
        raise ValueError(
            f"cannot resume from {path}: the training data changed ({exc}): files under "
            f"{roots} were added, removed or resized since the run started, so it cannot go on "
            "as it began; restore them, or start a new run"
        ) from None
    torch.set_rng_state(state["rng"]["torch"].cpu())
    random.setstate(_as_tuple(state["rng"]["python"]))
    if device.type == "cuda" and "cuda" in state["rng"]:
        torch.cuda.set_rng_state(state["rng"]["cuda"].cpu(), device)
    return Progress(**saved["progress"])


def _damaged(file: Path, exc: BaseException | str) -> str:
    reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return (
        f"cannot resume from {file}: the file is damaged or truncated ({reason}); the run "
        "cannot go on from this checkpoint"
    )


def _as_tuple(value):
    return tuple(_as_tuple(v) for v in value) if isinstance(value, (list, tuple)) else value
