"""Training a language model of any variant: ``python -m s2attn train`` (its options:
:mod:`s2attn.models.options`).

One run trains one variant (:data:`~s2attn.models.presets.VARIANTS`) of one preset
(:data:`~s2attn.models.presets.PRESETS`) on the offline byte-level data of
:mod:`s2attn.models.data`, and writes into its output directory:

- ``run.json``: the resolved options, the preset, the model summary (parameters, layer kinds and
  densities), what the data reads (both splits' ``describe()``), the device, library versions,
  date and git commit.
- ``metrics.jsonl``: one JSON object per logged step, every quantity named with its unit:
  ``step``, ``loss_nats`` (mean training cross-entropy since the previous row, in nats per
  token), ``train_bpb`` (the same in bits per byte: a token is a byte), ``tokens`` (input tokens
  seen so far), ``lr``, ``grad_norm`` (before clipping), ``tokens_per_s`` (training time only),
  ``elapsed_s`` (wall time since the run started, summed over resumes) and on CUDA
  ``max_mem_gib``; validation rows add ``val_bpb`` (bits per byte on fixed held-out batches) and
  ``val_needle_acc`` (retrieval accuracy, a fraction, on fixed samples at the training length).
  Runs written before the units were named call these ``loss``, ``val_loss`` and
  ``val_needle``: read rows through :func:`read_metrics` (or :func:`metrics_row`), which gives
  the current names for both.
- ``checkpoint/``: model, optimizer, schedule, data stream and RNG states, for ``--resume``.
- ``train.lock``: locked by the process training in the directory, and holding its pid.
- at the end, the model (``save_pretrained``: ``config.json`` with the S2 settings and
  ``model.safetensors``), then ``curves.png`` (drawn last, and only with matplotlib installed: a
  run without it says so at its start, and ends well without the picture).

Recipe: AdamW (fused on CUDA; betas 0.9, 0.95; weight decay 0.1 on matrices only), linear
warm-up then cosine decay to 10% of the peak learning rate, gradients clipped to norm 1.0. On
CUDA the default precision keeps float32 master weights and runs under bf16 autocast; on the CPU
everything is float32.

Resuming (``--resume``) continues from the last checkpoint exactly: on one machine the losses
after it equal those of a run that never stopped (bitwise on the CPU), and ``metrics.jsonl``
goes on where the checkpoint was taken. ``--stop-at``, ``--time-limit`` and Ctrl-C end a run
early with a checkpoint of the step just completed and print the command that finishes it
(Ctrl-C exits with status 130; a second Ctrl-C stops at once, without a checkpoint). Every
input is checked, and the data listed, before anything is written; an output directory that
holds another run, a ``--resume`` with no checkpoint to resume from, and a directory that
another ``train`` process is using (a lock on ``train.lock`` inside it) are refused.

Long context: a run at a longer ``--seq-len`` starts from a shorter run's model with
``--init-from DIR``; its patterns and RoPE table cover ``--max-seq-len`` (default ``--seq-len``).
The source must have the same architecture (layers, hidden and MLP sizes, heads, KV heads,
vocabulary: the differing fields are listed otherwise); its variant may differ, since the
variants share every weight. ``--rope-theta`` sets the RoPE base, ``--rope-scaling linear
--rope-factor F`` divides positions by F (position interpolation); unset, they are the source
model's with ``--init-from``, else the preset's (base 10000, no scaling). The saved
``config.json`` records them, so ``s2attn eval`` loads the extended model as trained. Every
metrics row also holds ``step_s`` (training seconds per step), and the run ends with a line of
its steps, tokens, training time, tokens/s, step time and peak GPU memory.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import pickle
import platform
import random
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from ..integrations import transformers as s2hf
from . import presets
from .data import NeedleSample, SourceCorpus, TokenStream, default_roots
from .dependencies import INSTALL, OPTIONAL, missing
from .evaluate import (
    free_memory,
    needle_accuracy,
    needle_samples,
    validation_batches,
    validation_bpb,
)
from .options import TrainOptions, add_arguments, comparable, source_config

try:
    import fcntl
except ImportError:  # Windows: no flock, so the output directory goes unguarded
    fcntl = None

__all__ = ["TrainOptions", "add_arguments", "metrics_row", "read_metrics", "run"]

_BETAS = (0.9, 0.95)
_WEIGHT_DECAY = 0.1
_CLIP_NORM = 1.0
_MIN_LR_RATIO = 0.1
# Depths of the validation needles: evenly spread from the start (0) to the end (1) of the context.
_NEEDLE_DEPTHS = 8
_RUN_FILE = "run.json"
_METRICS_FILE = "metrics.jsonl"
_CHECKPOINT = "checkpoint"
_LOCK_FILE = "train.lock"
_CURVES_FILE = "curves.png"
# The exit status of a command stopped by Ctrl-C (128 + SIGINT), as shells report it.
_INTERRUPTED = 130


# ------------------------------------------------------------------------------ the plan
@dataclass
class _Plan:
    """Everything decided before the output directory is touched."""

    options: TrainOptions
    config: object
    out: Path
    device: torch.device
    train_corpus: SourceCorpus
    val_corpus: SourceCorpus
    val_batches: list[torch.Tensor]
    val_needles: list[NeedleSample]
    resume_from: Path | None
    initial_weights: dict | None
    fresh: bool
    stop_at: int | None
    time_limit: float | None
    progress: bool


def _check_out_dir(out: Path, options: TrainOptions, resume: bool) -> tuple[Path | None, bool]:
    """Whether ``out`` may take this run: (checkpoint to resume from or None, fresh start).

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
        return None, True
    record_path = out / _RUN_FILE
    if not record_path.is_file():
        raise ValueError(
            f"--out {str(out)!r} is not empty and holds no {_RUN_FILE}: it is not an s2attn "
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
    checkpoint = _find_checkpoint(out)
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
    return checkpoint, False


def _prepare(args: argparse.Namespace) -> _Plan:
    """Check every input and load the validation data; writes nothing."""
    options = TrainOptions.resolve(args)
    _check_not_in_use(Path(args.out))
    num_layers = options.preset_shape.num_layers
    if options.variant in ("hhst", "local", "homo"):
        bad = [i for i in options.dense_layers if not 0 <= i < num_layers]
        if bad:
            raise ValueError(
                f"--dense-layers: {bad} out of range; preset {options.preset!r} has layers "
                f"0..{num_layers - 1}"
            )
    config = options.model_config()
    _check_step_fits(options, config)
    train_corpus, val_corpus = _corpora(args.data_root, options.val_fraction)
    options = options.replace(data_root=tuple(str(r) for r in train_corpus.roots))
    try:
        # The stream checks the retrieval rows fit in seq_len; it is built again in _train.
        _train_stream(options, train_corpus)
    except ValueError as exc:
        raise ValueError(f"--needle-fraction / --seq-len: {exc}") from None
    initial = None
    if options.init_from is not None:
        initial = _initial_weights(options.init_from, config)
    out = Path(args.out)
    resume_from, fresh = _check_out_dir(out, options, args.resume)
    return _Plan(
        options=options,
        config=config,
        out=out,
        device=torch.device(options.device),
        train_corpus=train_corpus,
        val_corpus=val_corpus,
        val_batches=_validation_batches(options, val_corpus),
        val_needles=_validation_needles(options, val_corpus),
        resume_from=resume_from,
        initial_weights=initial,
        fresh=fresh,
        stop_at=args.stop_at,
        time_limit=args.time_limit,
        progress=not args.no_progress and sys.stderr.isatty(),
    )


def _step_memory_floor(options: TrainOptions, config) -> int:
    """Bytes that one training step of ``options`` certainly needs on its device (a lower bound,
    so that no run that fits is refused): the weights with their gradients and AdamW's two
    moments, the float32 logits of a micro-batch and their gradient, and each layer's input,
    which the backward pass keeps (with gradient checkpointing too)."""
    text = config.get_text_config(decoder=True)
    tokens = options.batch_size * options.seq_len
    weight_bytes = 2 if options.precision == "bf16" else 4
    activation_bytes = 4 if options.precision == "fp32" else 2
    weights = 4 * weight_bytes * presets.parameter_count(config)
    logits = 2 * 4 * tokens * text.vocab_size
    kept = activation_bytes * tokens * text.hidden_size * text.num_hidden_layers
    return weights + logits + kept


def _check_step_fits(options: TrainOptions, config) -> None:
    """Refuse, before the data or the model are allocated, a step that cannot fit its device."""
    needed = _step_memory_floor(options, config)
    free = free_memory(options.device)
    if free is not None and needed > free:
        raise ValueError(
            f"--seq-len {options.seq_len} x --batch-size {options.batch_size}: a training step "
            f"needs at least {needed / 2**30:.3g} GiB on {options.device} (weights, gradients "
            f"and optimizer state, the logits, each layer's activations), and "
            f"{free / 2**30:.3g} GiB is free; lower --seq-len or --batch-size (--grad-accum "
            "keeps the tokens per step)"
        )


def _corpora(data_root: list[Path] | None, val_fraction: float):
    """The training and validation splits of ``--data-root`` (default: the machine's)."""
    roots = [Path(r) for r in data_root] if data_root else None
    for r in roots or ():
        if not r.is_dir():
            raise ValueError(f"--data-root {str(r)!r} is not a directory")
    try:
        train = SourceCorpus(roots, split="train", val_fraction=val_fraction)
        val = SourceCorpus(roots, split="val", val_fraction=val_fraction)
    except ValueError as exc:
        raise ValueError(f"--data-root / --val-fraction: {exc}") from None
    return train, val


def _validation_batches(options: TrainOptions, corpus: SourceCorpus) -> list[torch.Tensor]:
    if not options.val_batches:
        return []
    return validation_batches(
        corpus, options.seq_len, options.batch_size, options.val_batches, options.val_seed
    )


def _validation_needles(options: TrainOptions, corpus: SourceCorpus) -> list[NeedleSample]:
    if not options.val_needles:
        return []
    count = min(_NEEDLE_DEPTHS, options.val_needles)
    depths = [i / max(count - 1, 1) for i in range(count)]
    try:
        grid = needle_samples(
            corpus, options.seq_len, depths, options.val_needles // count, options.val_seed
        )
    except ValueError as exc:
        raise ValueError(f"--val-needles (0 turns them off): {exc}") from None
    return [s for group in grid.values() for s in group]


# ---------------------------------------------------------------------------------- lock
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


def _check_not_in_use(out: Path) -> None:
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
    however it ends: the kernel drops the lock, so a killed run leaves no stale lock), and
    write this process's pid into the lock file for the next one to name."""
    # "a": create the file without emptying it, so the holder's pid stays readable.
    handle = (out / _LOCK_FILE).open("a")
    if fcntl is None:
        return handle
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        raise _in_use(out) from None
    handle.truncate(0)
    handle.write(f"{os.getpid()}\n")
    handle.flush()
    return handle


# What must agree between an --init-from model and the run's: every weight's shape follows
# from them. The attention pattern, lengths and RoPE settings may differ.
_ARCHITECTURE = (
    "num_hidden_layers",
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "tie_word_embeddings",
)


def _initial_weights(path: str, config) -> dict:
    """The state dict saved in ``path`` (by ``save_pretrained``), checked against a model of
    ``config``: the same architecture, parameter names and shapes (a tied output head may be
    absent)."""
    from safetensors.torch import load_file

    source = source_config(path).get_text_config(decoder=True)
    target = config.get_text_config(decoder=True)
    differ = [
        f"{name} {getattr(source, name, None)} there, {getattr(target, name, None)} here"
        for name in _ARCHITECTURE
        if getattr(source, name, None) != getattr(target, name, None)
    ]
    if differ:
        trained = ""
        try:
            preset = json.loads((Path(path) / _RUN_FILE).read_text())["options"]["preset"]
            trained = f" ({preset})"
        except (OSError, ValueError, KeyError, TypeError):
            pass  # a model saved by other means: no run record to name its preset
        raise ValueError(
            f"--init-from {path!r} holds another architecture: {'; '.join(differ)}. "
            f"Use the --preset it was trained with{trained}"
        )
    weights = Path(path) / "model.safetensors"
    if not weights.is_file():
        raise ValueError(
            f"--init-from {path!r}: no model.safetensors there (a directory this command saved "
            "its final model into)"
        )
    presets.check_weights_file(weights, f"--init-from {path!r}")
    state = load_file(str(weights))
    with torch.device("meta"):
        expected = {k: v.shape for k, v in presets.build_model(config).state_dict().items()}
    optional = {"lm_head.weight"} if config.tie_word_embeddings else set()
    missing = sorted(set(expected) - set(state) - optional)
    extra = sorted(set(state) - set(expected))
    wrong = sorted(k for k in set(state) & set(expected) if state[k].shape != expected[k])
    if missing or extra or wrong:
        raise ValueError(
            f"--init-from {path!r}: its weights do not fit this model (missing {missing[:3]}, "
            f"unexpected {extra[:3]}, other shapes {wrong[:3]}); use the same --preset"
        )
    return state


def _initial_model(plan: _Plan):
    """The model a run starts from: fresh weights of its seed, or (not resuming) the --init-from
    model's. Every S2 and RoPE setting lives in the config, so the weights carry over between
    lengths and between variants of one preset; the tied head is the embedding, loaded with it."""
    model = presets.build_model(plan.config, seed=plan.options.seed)
    if plan.initial_weights is not None and plan.resume_from is None:
        result = model.load_state_dict(plan.initial_weights, strict=False)
        tied = {"lm_head.weight"} if plan.config.tie_word_embeddings else set()
        missing = sorted(set(result.missing_keys) - tied)
        if missing or result.unexpected_keys:
            raise ValueError(
                f"--init-from: weights missing {missing[:3]}, unexpected "
                f"{result.unexpected_keys[:3]}"
            )
    return model


def _train_stream(options: TrainOptions, corpus: SourceCorpus) -> TokenStream:
    return TokenStream(
        corpus,
        options.seq_len,
        options.batch_size,
        seed=options.seed,
        needle_fraction=options.needle_fraction,
        needles_per_sample=options.needles_per_sample,
        edge_fraction=options.needle_edge_fraction,
    )


# ------------------------------------------------------------------------- run record
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


def _run_record(plan: _Plan) -> dict:
    import transformers
    import triton

    device = plan.device
    if device.type == "cuda":
        device_name = torch.cuda.get_device_name(device)
    else:
        processor = platform.processor() or platform.machine()
        device_name = f"cpu ({processor}, {torch.get_num_threads()} threads)"
    command = None
    if sys.argv[1:2] == ["train"]:
        command = "python -m s2attn train " + " ".join(sys.argv[2:])
    return {
        "options": plan.options.record(),
        "preset": dataclasses.asdict(plan.options.preset_shape),
        "model": presets.model_summary(plan.config, plan.options.seq_len),
        "data": {"train": plan.train_corpus.describe(), "val": plan.val_corpus.describe()},
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


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


# --------------------------------------------------------------------- optimizer, schedule
def _optimizer(model: torch.nn.Module, lr: float, device: torch.device) -> torch.optim.AdamW:
    # Decay matrices (projections, the tied embedding) only: decaying norms' gains pulls them to
    # zero for no regularising benefit.
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    other = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": _WEIGHT_DECAY},
        {"params": other, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=lr, betas=_BETAS, fused=device.type == "cuda")


def lr_factor(step: int, steps: int, warmup_steps: int) -> float:
    """The learning rate of optimizer step ``step`` (0-based) as a fraction of the peak: linear
    warm-up over ``warmup_steps``, then a cosine from 1 down to 0.1 at the last step."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    decay_steps = max(steps - warmup_steps - 1, 1)
    progress = min((step - warmup_steps) / decay_steps, 1.0)
    return _MIN_LR_RATIO + (1 - _MIN_LR_RATIO) * 0.5 * (1 + math.cos(math.pi * progress))


# --------------------------------------------------------------------------- checkpoints
@dataclass
class _Progress:
    """Counters a checkpoint carries besides the tensors' states."""

    step: int = 0
    tokens: int = 0
    elapsed_s: float = 0.0
    # The running sums of the current metrics row (losses since the last row was written).
    row_loss: float = 0.0
    row_steps: int = 0
    row_tokens: int = 0
    row_train_s: float = 0.0


def _find_checkpoint(out: Path) -> Path | None:
    # checkpoint.old exists only if a save stopped between its two renames.
    for name in (_CHECKPOINT, _CHECKPOINT + ".old"):
        if (out / name / "state.pt").is_file():
            return out / name
    return None


def _save_checkpoint(
    out: Path,
    model,
    optimizer,
    scheduler,
    stream: TokenStream,
    progress: _Progress,
    device: torch.device,
) -> None:
    """Write the checkpoint to a temporary directory, then swap it in: a crash at any point
    leaves one complete checkpoint behind."""
    tmp, final, old = out / (_CHECKPOINT + ".tmp"), out / _CHECKPOINT, out / (_CHECKPOINT + ".old")
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
    torch.save(state, tmp / "state.pt")
    (tmp / "progress.json").write_text(
        json.dumps(
            {"progress": dataclasses.asdict(progress), "stream": stream.state_dict()}, indent=1
        )
    )
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)


def _load_checkpoint(
    path: Path, model, optimizer, scheduler, stream: TokenStream, device: torch.device
) -> _Progress:
    state_file, progress_file = path / "state.pt", path / "progress.json"
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
    return _Progress(**saved["progress"])


def _damaged(file: Path, exc: BaseException | str) -> str:
    reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return (
        f"cannot resume from {file}: the file is damaged or truncated ({reason}); the run "
        "cannot go on from this checkpoint"
    )


def _as_tuple(value):
    return tuple(_as_tuple(v) for v in value) if isinstance(value, (list, tuple)) else value


# ------------------------------------------------------------------------------ metrics
# Names that runs logged before every metric carried its unit, and what they are called now.
_OLD_METRIC_NAMES = {"loss": "loss_nats", "val_loss": "val_bpb", "val_needle": "val_needle_acc"}


def metrics_row(row: dict) -> dict:
    """One row of a ``metrics.jsonl`` under the current names (``loss_nats``, ``val_bpb``,
    ``val_needle_acc``), whether an older version wrote it (``loss``, ``val_loss``,
    ``val_needle``) or this one; the values are unchanged (``val_loss`` was bits per byte).

    Example::

        metrics_row({"step": 10, "loss": 2.1, "val_loss": 3.0})
        # {"step": 10, "loss_nats": 2.1, "val_bpb": 3.0}
    """
    return {_OLD_METRIC_NAMES.get(key, key): value for key, value in row.items()}


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """The rows of a run's ``metrics.jsonl`` (a path to the file or to the run's directory),
    each through :func:`metrics_row`. A torn last line, from a run killed while writing it, is
    left out."""
    path = Path(path)
    if path.is_dir():
        path = path / _METRICS_FILE
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    rows = []
    for i, line in enumerate(lines):
        try:
            rows.append(metrics_row(json.loads(line)))
        except ValueError:
            if i < len(lines) - 1:
                raise ValueError(f"{path}: line {i + 1} is not JSON: {line[:80]!r}") from None
    return rows


def _truncate_metrics(path: Path, last_step: int) -> None:
    """Keep the rows up to ``last_step`` (a resumed run writes the later ones again); a torn
    last line from a crash goes too. A log that ends at ``last_step`` is left as it is."""
    if not path.exists():
        return
    lines = path.read_text().splitlines()
    keep = []
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and row.get("step", math.inf) <= last_step:
            keep.append(line)
    if keep != lines:
        _write_atomic(path, "".join(line + "\n" for line in keep))


def _plot_curves(metrics_path: Path, out_path: Path, title: str, needle_rows: bool) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics_path)
    train = [(r["tokens"], r["train_bpb"]) for r in rows if "train_bpb" in r]
    val = [(r["tokens"], r["val_bpb"]) for r in rows if "val_bpb" in r]
    needle = [(r["tokens"], r["val_needle_acc"]) for r in rows if "val_needle_acc" in r]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 3.8))
    fig.subplots_adjust(left=0.07, right=0.98, bottom=0.14, top=0.92, wspace=0.25)
    if train:
        ax.plot(
            *zip(*train), lw=1, label="train (incl. retrieval rows)" if needle_rows else "train"
        )
    if val:
        ax.plot(*zip(*val), "o-", label="validation", ms=3)
    ax.set_xlabel("tokens")
    ax.set_ylabel("bits per byte")
    ax.set_title(title, fontsize=10)
    if train or val:  # a run stopped before its first row has nothing to label
        ax.legend()
    ax.grid(alpha=0.3)
    if needle:
        bx.plot(*zip(*needle), "o-", color="C2", ms=3)
    bx.set_ylim(-0.05, 1.05)
    bx.set_xlabel("tokens")
    bx.set_ylabel("needle accuracy (validation)")
    bx.grid(alpha=0.3)
    fig.savefig(out_path, dpi=110)
    plt.close(fig)


def _run_summary(metrics_path: Path, progress: _Progress, device: torch.device) -> str:
    """One line on the run so far, over all its processes: steps and tokens, and from the logged
    rows the training seconds (steps only: validation and checkpoints left out), tokens/s,
    seconds per step and peak GPU memory."""
    rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "tokens_per_s" in r]
    line = f"summary: {progress.step} steps, {progress.tokens} tokens"
    if not rows:
        return line
    train_s, tokens = 0.0, 0
    for r in rows:
        train_s += (r["tokens"] - tokens) / max(r["tokens_per_s"], 1e-9)
        tokens = r["tokens"]
    peak = max((r["max_mem_gib"] for r in rows if "max_mem_gib" in r), default=None)
    memory = "n/a on the CPU"
    if device.type == "cuda":
        memory = f"{max(peak or 0.0, torch.cuda.max_memory_allocated(device) / 2**30):.2f} GiB"
    step_s = train_s / max(rows[-1]["step"], 1)
    return (
        f"{line}; {train_s:.1f} s of training steps (to step {rows[-1]['step']}), "
        f"{tokens / max(train_s, 1e-9):.4g} tokens/s, {step_s:.3g} s/step, "
        f"peak GPU memory {memory}"
    )


def _save_model(model, out: Path) -> None:
    """``save_pretrained`` without transformers' one-shard progress bar in the run's output."""
    from transformers.utils import logging as hf_logging

    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(out)
    finally:
        if shown:
            hf_logging.enable_progress_bar()


def _resume_command(plan: _Plan) -> str:
    """The command that finishes this run: ``--out DIR --resume`` and every option that does
    not take its default value (``--resume`` refuses options that differ from the run's)."""
    opts = plan.options
    flags = []
    for key, value in opts.record().items():
        if key in ("data_root", "init_from") or value is None or value is False:
            continue
        flag = "--" + key.replace("_", "-")
        if value is True:
            flags.append([flag])
        elif isinstance(value, list):
            flags.append([flag, ",".join(str(v) for v in value) or "none"])
        else:
            flags.append([flag, str(value)])
    parser = argparse.ArgumentParser()
    add_arguments(parser)

    def resolved(chosen: list[list[str]]) -> TrainOptions:
        argv = ["--out", str(plan.out), *(token for flag in chosen for token in flag)]
        return TrainOptions.resolve(parser.parse_args(argv))

    # Leave out, one at a time, every option that the remaining ones resolve to anyway (some
    # only once another is gone: --max-seq-len before --seq-len).
    want, kept = resolved(flags), list(flags)
    for flag in flags:
        fewer = [f for f in kept if f is not flag]
        try:
            if resolved(fewer) == want:
                kept = fewer
        except ValueError:
            pass
    if list(opts.data_root) != [str(r) for r in default_roots()]:
        kept += [["--data-root", root] for root in opts.data_root]
    if opts.init_from is not None:
        kept.append(["--init-from", opts.init_from])
    command = ["python", "-m", "s2attn", "train", "--out", str(plan.out), "--resume"]
    return shlex.join(command + [token for flag in kept for token in flag])


class _CtrlC:
    """Ctrl-C while entered (in the main thread, where Python handles signals): the first asks
    the training loop to stop after the step in progress, with a checkpoint; a second one
    raises ``KeyboardInterrupt`` at once."""

    def __init__(self) -> None:
        self.requested = False
        self._previous = None
        self._installed = False

    def __enter__(self) -> _CtrlC:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
            self._installed = True
        return self

    def __exit__(self, *exc) -> None:
        if self._installed:
            signal.signal(signal.SIGINT, self._previous)

    def _handle(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        # os.write, not print: the handler may run in the middle of a print to the same stream.
        os.write(
            2,
            b"\ns2attn train: stopping after this step, with a checkpoint (Ctrl-C again to stop "
            b"at once, without one)\n",
        )


# ------------------------------------------------------------------------------ training
def run(args: argparse.Namespace) -> int:
    """``s2attn train``: train one run into ``args.out``. Raises ``ValueError`` for bad input
    before anything is written. Returns 0, also when ``--stop-at`` / ``--time-limit`` stopped
    the run early, and 130 when Ctrl-C did (the message says how to finish it)."""
    started = time.perf_counter()
    try:
        plan = _prepare(args)
    except KeyboardInterrupt:
        print("\ns2attn train: interrupted; nothing was written", file=sys.stderr)
        return _INTERRUPTED
    absent = missing(OPTIONAL)
    if absent:
        print(
            f"s2attn train: warning: {' and '.join(absent)}: the run trains and saves its model, "
            f"but draws no {_CURVES_FILE} ({INSTALL})",
            file=sys.stderr,
        )
    lock = None
    try:
        plan.out.mkdir(parents=True, exist_ok=True)
        lock = _lock(plan.out)
        with _CtrlC() as ctrl_c:
            # Another process may have written to --out since _prepare looked.
            plan.resume_from, plan.fresh = _check_out_dir(plan.out, plan.options, not plan.fresh)
            return _train(plan, started, ctrl_c)
    except KeyboardInterrupt:
        checkpoint = _find_checkpoint(plan.out)
        if checkpoint is None:
            where = "no checkpoint was written"
        else:
            step = json.loads((checkpoint / "progress.json").read_text())["progress"]["step"]
            where = f"the checkpoint of step {step} continues with:\n  {_resume_command(plan)}"
        print(f"\ns2attn train: interrupted; {where}", file=sys.stderr)
        return _INTERRUPTED
    finally:
        if lock is not None:
            lock.close()


@dataclass
class _State:
    """What training changes: the model, its optimizer and schedule, the data stream, the
    counters, and the running loss of the current metrics row (on the device, so that a step
    does not wait for the GPU)."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    stream: TokenStream
    progress: _Progress
    row_loss: torch.Tensor
    # Wall time of the run before this process started, and when this process started.
    elapsed_base: float
    started: float

    def elapsed(self) -> float:
        return self.elapsed_base + time.perf_counter() - self.started


@dataclass
class _Stop:
    """When the run stops: the last step this process trains, and why if before ``--steps``."""

    last: int
    reason: str | None = None

    def at(self, step: int, reason: str) -> None:
        self.last, self.reason = step, reason


def _train(plan: _Plan, started: float, ctrl_c: _CtrlC) -> int:
    from tqdm.auto import tqdm

    opts = plan.options
    state = _set_up(plan, started)
    progress = state.progress
    stop = _Stop(min(opts.steps, plan.stop_at) if plan.stop_at else opts.steps)
    _print_start(plan, progress.step)
    if ctrl_c.requested:
        stop.at(progress.step, "Ctrl-C")
        if plan.resume_from is None:
            # Stopped before its first step: a checkpoint of step 0 makes the run resumable.
            _checkpoint(plan, state)
    bar = tqdm(
        total=opts.steps,
        initial=progress.step,
        unit="step",
        file=sys.stderr,
        dynamic_ncols=True,
        mininterval=1.0,
        disable=not plan.progress,
    )
    with (plan.out / _METRICS_FILE).open("a") as log, bar:
        while progress.step < stop.last:
            t0 = time.perf_counter()
            lr, grad_norm = _step(plan, state)
            step = progress.step
            validating = step == opts.steps or bool(opts.val_every and step % opts.val_every == 0)
            if step % opts.log_every == 0 or validating:
                row = _metrics_row(plan, state, lr, grad_norm, t0)
                if validating:
                    _validate(plan, state.model, row)
                _log(plan, state, row, log, bar, validating)
            else:
                progress.row_train_s += time.perf_counter() - t0
            bar.update()
            _check_stop(plan, stop, step, ctrl_c, started)
            if step == stop.last or (opts.checkpoint_every and step % opts.checkpoint_every == 0):
                _checkpoint(plan, state)
    return _finish(plan, state, stop)


def _set_up(plan: _Plan, started: float) -> _State:
    """Write the run's record (a fresh run), seed, build the model, optimizer, schedule and data
    stream, and load the checkpoint when resuming."""
    opts, out, device = plan.options, plan.out, plan.device
    metrics_path = out / _METRICS_FILE
    if plan.fresh:
        _write_atomic(out / _RUN_FILE, json.dumps(_run_record(plan), indent=2) + "\n")
        metrics_path.write_text("")
        shutil.rmtree(out / _CHECKPOINT, ignore_errors=True)
    torch.manual_seed(opts.seed)
    random.seed(opts.seed)
    model = _initial_model(plan)
    if opts.precision == "bf16":
        model.to(torch.bfloat16)
    model.to(device)
    if opts.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    # In place: the state dict keeps its keys, so checkpoints and saved models are the
    # uncompiled model's. The S2 layers are custom operators Inductor calls as they are.
    if opts.compile_layers:
        s2hf.compile_layers(model)
    elif opts.compile:
        model.compile()
    optimizer = _optimizer(model, opts.lr, device)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, opts.steps, opts.warmup_steps)
    )
    stream = _train_stream(opts, plan.train_corpus)
    progress = _Progress()
    if plan.resume_from is not None:
        progress = _load_checkpoint(plan.resume_from, model, optimizer, scheduler, stream, device)
    _truncate_metrics(metrics_path, progress.step)
    row_loss = torch.tensor(progress.row_loss, dtype=torch.float32, device=device)
    return _State(
        model, optimizer, scheduler, stream, progress, row_loss, progress.elapsed_s, started
    )


def _print_start(plan: _Plan, step: int) -> None:
    opts = plan.options
    summary = presets.model_summary(plan.config, opts.seq_len)
    layers = "".join("D" if t == "dense" else "S" for t in summary["layer_types"])
    print(
        f"s2attn train: {opts.variant} ({opts.preset}), {summary['parameters'] / 1e6:.2f}M "
        f"parameters, layers {layers} (D dense, S sparse), mean density "
        f"{summary['mean_density']}; {opts.steps} steps x {opts.tokens_per_step} tokens on "
        f"{plan.device} ({opts.precision}); "
        + (f"resuming at step {step}" if step else "starting")
        + f"; writing {plan.out}",
        flush=True,
    )


def _step(plan: _Plan, state: _State) -> tuple[float, torch.Tensor]:
    """One optimizer step over ``--grad-accum`` micro-batches; returns the step's learning rate
    and gradient norm (before clipping)."""
    opts, device, model = plan.options, plan.device, state.model
    autocast = opts.autocast_dtype
    for _ in range(opts.grad_accum):
        batch, answers = state.stream.next_batch_with_answers()
        batch = batch.to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=autocast, enabled=autocast is not None):
            logits = model(input_ids=batch[:, :-1], use_cache=False).logits
        # Cross-entropy in float32 whatever the logits' dtype: bf16 would round it.
        token_loss = F.cross_entropy(
            logits.float().flatten(0, 1), batch[:, 1:].flatten(), reduction="none"
        )
        loss = token_loss.mean()  # what is logged: the plain language-model loss
        objective = loss
        if opts.answer_weight != 1:
            # The answers are a few tokens in thousands: weighting them is what lets a small
            # model learn retrieval within a short run.
            extra = answers[:, 1:].flatten().to(device, non_blocking=True)
            weighted = (token_loss * extra).sum() / token_loss.numel()
            objective = loss + (opts.answer_weight - 1) * weighted
        (objective / opts.grad_accum).backward()
        state.row_loss += loss.detach() / opts.grad_accum
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), _CLIP_NORM)
    lr = state.optimizer.param_groups[0]["lr"]
    state.optimizer.step()
    state.scheduler.step()
    state.optimizer.zero_grad(set_to_none=True)
    progress = state.progress
    progress.step += 1
    progress.tokens += opts.tokens_per_step
    progress.row_steps += 1
    progress.row_tokens += opts.tokens_per_step
    return lr, grad_norm


def _metrics_row(plan: _Plan, state: _State, lr: float, grad_norm, t0: float) -> dict:
    """The training part of a metrics row: the means since the previous row."""
    progress = state.progress
    if plan.device.type == "cuda":
        torch.cuda.synchronize(plan.device)
    progress.row_train_s += time.perf_counter() - t0
    mean_loss = state.row_loss.item() / progress.row_steps
    if not math.isfinite(mean_loss):
        raise FloatingPointError(
            f"the training loss became {mean_loss} by step {progress.step}; lower --lr or "
            "raise --warmup-steps"
        )
    return {
        "step": progress.step,
        "loss_nats": mean_loss,
        "train_bpb": mean_loss / math.log(2),
        "tokens": progress.tokens,
        "lr": lr,
        "grad_norm": float(grad_norm),
        "tokens_per_s": progress.row_tokens / max(progress.row_train_s, 1e-9),
        "step_s": progress.row_train_s / progress.row_steps,
    }


def _validate(plan: _Plan, model, row: dict) -> None:
    """Add the held-out bits per byte and the needle accuracy to ``row``."""
    autocast = plan.options.autocast_dtype
    if plan.val_batches:
        row["val_bpb"] = validation_bpb(
            model, plan.val_batches, device=plan.device, autocast_dtype=autocast
        )
    if plan.val_needles:
        row["val_needle_acc"] = needle_accuracy(
            model,
            plan.val_needles,
            device=plan.device,
            autocast_dtype=autocast,
            batch_size=plan.options.batch_size,
        )


def _log(plan: _Plan, state: _State, row: dict, log, bar, validating: bool) -> None:
    """Write ``row`` to the metrics, show it, and start the next row's sums."""
    row["elapsed_s"] = state.elapsed()
    if plan.device.type == "cuda":
        row["max_mem_gib"] = torch.cuda.max_memory_allocated(plan.device) / 2**30
    log.write(json.dumps(row) + "\n")
    log.flush()
    loss = row["loss_nats"]
    bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{row['tokens_per_s']:.3g}", refresh=False)
    if validating:
        val = f"val {row['val_bpb']:.4f} bits/byte, " if "val_bpb" in row else ""
        needle = f"needle {row['val_needle_acc']:.2f}, " if "val_needle_acc" in row else ""
        bar.write(
            f"step {row['step']}/{plan.options.steps}: loss {loss:.4f} nats, {val}{needle}"
            f"{row['tokens_per_s']:.4g} tokens/s",
            file=sys.stdout,
        )
    state.row_loss.zero_()
    progress = state.progress
    progress.row_loss = 0.0
    progress.row_steps = progress.row_tokens = 0
    progress.row_train_s = 0.0


def _check_stop(plan: _Plan, stop: _Stop, step: int, ctrl_c: _CtrlC, started: float) -> None:
    """Stop after ``step`` once ``--time-limit`` has passed or Ctrl-C asked to."""
    over_time = plan.time_limit and time.perf_counter() - started > plan.time_limit
    if over_time and step < plan.options.steps:
        stop.at(step, f"--time-limit {plan.time_limit:g} s")
    if ctrl_c.requested and step < stop.last:
        stop.at(step, "Ctrl-C")


def _checkpoint(plan: _Plan, state: _State) -> None:
    progress = state.progress
    # The GPU's queued work belongs to the row's training time, not to the save.
    t1 = time.perf_counter()
    progress.row_loss = state.row_loss.item()
    progress.row_train_s += time.perf_counter() - t1
    progress.elapsed_s = state.elapsed()
    _save_checkpoint(
        plan.out,
        state.model,
        state.optimizer,
        state.scheduler,
        state.stream,
        progress,
        plan.device,
    )
    progress.row_loss = 0.0


def _finish(plan: _Plan, state: _State, stop: _Stop) -> int:
    """The summary, the model when the run is complete, then the curves (optional: they come
    after everything a run cannot do without); else how to finish the run."""
    opts, out, progress = plan.options, plan.out, state.progress
    metrics_path = out / _METRICS_FILE
    print(_run_summary(metrics_path, progress, plan.device), flush=True)
    complete = progress.step >= opts.steps
    if complete:
        _save_model(state.model, out)
    drawn = not missing(OPTIONAL)
    if drawn:
        title = f"{opts.variant} ({opts.preset}, seq {opts.seq_len}, seed {opts.seed})"
        _plot_curves(metrics_path, out / _CURVES_FILE, title, opts.needle_fraction > 0)
    if not complete:
        reason = stop.reason or f"--stop-at {plan.stop_at}"
        print(
            f"stopped at step {progress.step} of {opts.steps} ({reason}); checkpoint in "
            f"{out / _CHECKPOINT}; continue with:\n  {_resume_command(plan)}",
            flush=True,
        )
        return _INTERRUPTED if reason == "Ctrl-C" else 0
    made = "model, metrics and curves" if drawn else f"model and metrics (no {_CURVES_FILE})"
    print(f"done: {opts.steps} steps, {progress.tokens} tokens; {made} in {out}")
    return 0
