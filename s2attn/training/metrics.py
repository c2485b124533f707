"""A training run's metrics: ``metrics.jsonl`` (one JSON object per logged step), read under the
current names whatever version wrote it, cut back to a checkpoint's step on resuming, summed up
in one line, and drawn as ``curves.png``.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch

from .checkpoints import Progress
from .run_directory import METRICS_FILE, write_atomic

__all__ = ["metrics_row", "plot_curves", "read_metrics", "run_summary", "truncate_metrics"]

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
        path = path / METRICS_FILE
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    rows = []
    for i, line in enumerate(lines):
        try:
            rows.append(metrics_row(json.loads(line)))
        except ValueError:
            if i < len(lines) - 1:
                raise ValueError(f"{path}: line {i + 1} is not JSON: {line[:80]!r}") from None
    return rows


def truncate_metrics(path: Path, last_step: int) -> None:
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
        write_atomic(path, "".join(line + "\n" for line in keep))


def plot_curves(metrics_path: Path, out_path: Path, title: str, needle_rows: bool) -> None:
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


def run_summary(metrics_path: Path, progress: Progress, device: torch.device) -> str:
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
