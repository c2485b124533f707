"""The options of ``s2attn train``: the command line, and :class:`TrainOptions`, the run's options
resolved once from it, the preset and an ``--init-from`` model.

:class:`TrainOptions` is what ``run.json`` records (:meth:`TrainOptions.record`, under the names
of the command line's options) and what ``--resume`` compares with the saved run
(:meth:`TrainOptions.comparable`); options that change neither the weights nor the log
(``--resume``, ``--stop-at``, ``--time-limit``, ``--no-progress``) stay out of it.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from ..stack import S2Settings
from . import presets

__all__ = ["PRECISIONS", "TrainOptions", "add_arguments", "source_config"]

PRECISIONS = ("auto", "fp32", "bf16-autocast", "bf16")
# Options that change neither the trained weights nor the log, so a resumed run may differ in
# them (some are not recorded now, but runs once recorded them).
_RESUME_FREE = ("resume", "no_progress", "checkpoint_every", "stop_at", "time_limit")
# Options added after runs were recorded without them: the value that reproduces those runs
# (None where no single value does: validation then read the text of the run's own seed).
_ADDED_OPTIONS = {
    "needle_edge_fraction": 0.0,
    "val_seed": None,
    "rope_theta": 10000.0,
    "rope_scaling": "none",
    "rope_factor": 1.0,
    "compile": False,
    "compile_layers": False,
}


# --------------------------------------------------------------------------- arguments
def _dense_layers(text: str) -> list[int]:
    if text.strip().lower() == "none":
        return []
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated layer indices or 'none', got {text!r}"
        ) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``s2attn train``; those left unset take the preset's values."""
    add = parser.add_argument
    add(
        "--preset",
        default="tiny",
        help=f"model shape and recipe: one of {', '.join(presets.PRESETS)} (default tiny)",
    )
    add(
        "--variant",
        default="hhst",
        help=f"attention per layer: one of {', '.join(presets.VARIANTS)} (default hhst)",
    )
    add(
        "--out",
        type=Path,
        required=True,
        help="output directory: new or empty, or this run's own with --resume",
    )
    add(
        "--resume",
        action="store_true",
        help="continue the run in --out from its last checkpoint (same options)",
    )
    add("--steps", type=int, help="optimizer steps")
    add(
        "--init-from",
        type=Path,
        help="start from the weights of a model this command saved (same preset and variant; "
        "e.g. one trained at a shorter --seq-len), with a fresh optimizer and schedule",
    )
    add("--seq-len", type=int, help="training context length in tokens")
    add(
        "--rope-theta",
        type=float,
        help="RoPE base (default: the --init-from model's, else the preset's, 10000)",
    )
    add(
        "--rope-scaling",
        choices=presets.ROPE_SCALINGS,
        help="RoPE position scheme: none, or linear (positions divided by --rope-factor: "
        "position interpolation); default: the --init-from model's, else none",
    )
    add(
        "--rope-factor",
        type=float,
        help="divisor of the positions under --rope-scaling linear (>= 1)",
    )
    add(
        "--max-seq-len",
        type=int,
        help="length the S2 patterns and RoPE table cover (default --seq-len); set it higher to "
        "evaluate the model beyond its training length",
    )
    add("--batch-size", type=int, help="sequences per micro-batch")
    add("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    add("--lr", type=float, help="peak learning rate")
    add("--warmup-steps", type=int, help="linear warm-up steps before the cosine decay")
    add(
        "--dense-layers",
        type=_dense_layers,
        help="dense layers of hhst/local/homo: comma-separated indices, or 'none' "
        "(dense and s2 ignore it)",
    )
    add("--vert-stride", type=int, help="S2 vertical stride in blocks")
    add("--local-blocks", type=int, help="S2 local window in blocks")
    add("--device", choices=("cpu", "cuda"), help="default: cuda if available")
    add(
        "--precision",
        choices=PRECISIONS,
        default="auto",
        help="auto: float32 weights under bf16 autocast on CUDA, float32 on the CPU; bf16: "
        "bf16 weights and optimizer state",
    )
    add(
        "--gradient-checkpointing",
        action="store_true",
        help="recompute activations in the backward pass (less memory, ~30%% more time)",
    )
    add(
        "--compile",
        action="store_true",
        help="compile the model with torch.compile (Inductor): faster steps once compiled; the "
        "first steps and the first validation include the compilation",
    )
    add(
        "--compile-layers",
        action="store_true",
        help="compile each decoder layer on its own, with static shapes, instead of the whole "
        "model: the S2 layers share one graph and the dense layers another, however deep the "
        "model",
    )
    add(
        "--seed",
        type=int,
        default=0,
        help="initial weights and batch order (default 0)",
    )
    add(
        "--val-seed",
        type=int,
        default=0,
        help="which held-out text and needles validation reads (default 0); kept apart from "
        "--seed so that runs of several seeds are measured on the same text",
    )
    add("--needle-fraction", type=float, help="share of training rows that are retrieval samples")
    add(
        "--needles-per-sample",
        type=int,
        help="needles planted in each retrieval row, each asked for at its end",
    )
    add(
        "--needle-edge-fraction",
        type=float,
        help="share of needles planted at the very start or end of the context instead of a "
        "uniform depth (a uniform depth almost never tests the first tokens)",
    )
    add(
        "--answer-weight",
        type=float,
        help="weight of the needle answers' tokens in the training loss (1: plain LM loss)",
    )
    add(
        "--data-root",
        action="append",
        type=Path,
        help="directory of source files to train on (repeatable; default: the standard library, "
        "which no package install changes)",
    )
    add(
        "--val-fraction",
        type=float,
        default=0.05,
        help="share of files (by path hash) in the validation split (default 0.05)",
    )
    add("--val-every", type=int, help="validate every N steps (0: only at the end)")
    add("--val-batches", type=int, help="held-out batches per validation (0: none)")
    add(
        "--val-needles",
        type=int,
        default=32,
        help="retrieval samples per validation, at depths spread over [0, 1] (default 32)",
    )
    add("--log-every", type=int, default=10, help="write a metrics row every N steps")
    add(
        "--checkpoint-every",
        type=int,
        default=0,
        help="checkpoint every N steps (0: only at the end or when stopping)",
    )
    add(
        "--stop-at",
        type=int,
        help="stop after this step with a checkpoint, as if interrupted; finish with --resume",
    )
    add(
        "--time-limit",
        type=float,
        help="stop with a checkpoint once this many seconds have passed in this process",
    )
    add(
        "--no-progress",
        action="store_true",
        help="no progress bar (it shows only when stderr is a terminal)",
    )


# ------------------------------------------------------------------------------- options
@dataclass(frozen=True)
class TrainOptions:
    """A run's options with the preset's defaults filled in; see ``add_arguments`` for each."""

    preset: str
    variant: str
    steps: int
    seq_len: int
    max_seq_len: int
    batch_size: int
    grad_accum: int
    lr: float
    warmup_steps: int
    dense_layers: tuple[int, ...]
    vert_stride: int
    local_blocks: int
    device: str
    precision: str
    gradient_checkpointing: bool
    compile: bool
    compile_layers: bool
    seed: int
    val_seed: int
    needle_fraction: float
    needles_per_sample: int
    needle_edge_fraction: float
    answer_weight: float
    init_from: str | None
    rope_theta: float
    rope_scaling: str
    rope_factor: float
    # The data directories as the corpus resolved them (None until then).
    data_root: tuple[str, ...] | None
    val_fraction: float
    val_every: int
    val_batches: int
    val_needles: int
    log_every: int
    checkpoint_every: int

    @classmethod
    def resolve(cls, args: argparse.Namespace) -> TrainOptions:
        """The options of ``args``, checked; raises ``ValueError`` naming the option at fault."""
        if args.preset not in presets.PRESETS:
            raise ValueError(
                f"--preset: unknown preset {args.preset!r}; choose one of {sorted(presets.PRESETS)}"
            )
        if args.variant not in presets.VARIANTS:
            raise ValueError(
                f"--variant: unknown variant {args.variant!r}; "
                f"choose one of {list(presets.VARIANTS)}"
            )
        preset = presets.PRESETS[args.preset]
        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        if device == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda: no CUDA device is available")
        precision = args.precision
        if precision == "auto":
            precision = "bf16-autocast" if device == "cuda" else "fp32"

        def pick(value, default):
            return default if value is None else value

        seq_len = pick(args.seq_len, preset.seq_len)
        options = cls(
            preset=args.preset,
            variant=args.variant,
            steps=pick(args.steps, preset.steps),
            seq_len=seq_len,
            max_seq_len=pick(args.max_seq_len, seq_len),
            batch_size=pick(args.batch_size, preset.batch_size),
            grad_accum=args.grad_accum,
            lr=float(pick(args.lr, preset.lr)),
            warmup_steps=pick(args.warmup_steps, preset.warmup_steps),
            dense_layers=tuple(pick(args.dense_layers, preset.s2.dense_layers)),
            vert_stride=pick(args.vert_stride, preset.s2.vert_stride),
            local_blocks=pick(args.local_blocks, preset.s2.local_blocks),
            device=device,
            precision=precision,
            gradient_checkpointing=bool(args.gradient_checkpointing),
            compile=bool(args.compile),
            compile_layers=bool(args.compile_layers),
            seed=args.seed,
            val_seed=args.val_seed,
            needle_fraction=float(pick(args.needle_fraction, preset.needle_fraction)),
            needles_per_sample=pick(args.needles_per_sample, preset.needles_per_sample),
            needle_edge_fraction=float(
                pick(args.needle_edge_fraction, preset.needle_edge_fraction)
            ),
            answer_weight=float(pick(args.answer_weight, preset.answer_weight)),
            init_from=None if args.init_from is None else str(Path(args.init_from).resolve()),
            **_rope_options(args, preset),
            data_root=None,
            val_fraction=float(args.val_fraction),
            val_every=pick(args.val_every, preset.val_every),
            val_batches=pick(args.val_batches, preset.val_batches),
            val_needles=args.val_needles,
            log_every=args.log_every,
            checkpoint_every=args.checkpoint_every,
        )
        options._check()
        _check_stops(args, options.steps)
        return options

    def _check(self) -> None:
        positive = ("steps", "seq_len", "max_seq_len", "batch_size", "grad_accum")
        positive += ("vert_stride", "local_blocks", "log_every", "needles_per_sample")
        for name in positive:
            _at_least(name, getattr(self, name), 1)
        for name in ("warmup_steps", "val_every", "val_batches", "val_needles"):
            _at_least(name, getattr(self, name), 0)
        _at_least("checkpoint_every", self.checkpoint_every, 0)
        if not self.answer_weight >= 0 or not math.isfinite(self.answer_weight):
            raise ValueError(f"--answer-weight must be >= 0, got {self.answer_weight}")
        if self.compile and self.compile_layers:
            raise ValueError(
                "--compile and --compile-layers are two ways to compile the model; give one"
            )
        if not self.lr > 0 or not math.isfinite(self.lr):
            raise ValueError(f"--lr must be a positive number, got {self.lr}")
        if self.seq_len > self.max_seq_len:
            raise ValueError(
                f"--seq-len {self.seq_len} exceeds --max-seq-len {self.max_seq_len}: the S2 "
                "layers' patterns (and the RoPE table) would not cover the training context; "
                "raise --max-seq-len"
            )

    def replace(self, **changes) -> TrainOptions:
        return dataclasses.replace(self, **changes)

    @property
    def preset_shape(self) -> presets.Preset:
        """The :class:`~s2attn.models.presets.Preset` named by ``preset``."""
        return presets.PRESETS[self.preset]

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.grad_accum * self.seq_len

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        return torch.bfloat16 if self.precision == "bf16-autocast" else None

    def s2(self) -> S2Settings:
        """The S2 settings the variant starts from: the preset's, with these options'."""
        return self.preset_shape.s2.replace(
            dense_layers=self.dense_layers,
            vert_stride=self.vert_stride,
            local_blocks=self.local_blocks,
        )

    def model_config(self):
        """The transformers config of the run's model."""
        return presets.model_config(
            self.preset_shape,
            self.variant,
            seq_len=self.seq_len,
            max_seq_len=self.max_seq_len,
            s2=self.s2(),
            rope_theta=self.rope_theta,
            rope_scaling=self.rope_scaling,
            rope_factor=self.rope_factor,
        )

    def record(self) -> dict:
        """The options as ``run.json`` records them (JSON-friendly: tuples as lists)."""
        return {
            k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()
        }

    def comparable(self) -> dict:
        """What must agree with a saved run's options for ``--resume``."""
        return comparable(self.record())


def comparable(record: dict) -> dict:
    """The options of a ``run.json`` record that ``--resume`` compares, with the options added
    since older runs were recorded filled in."""
    return {**_ADDED_OPTIONS, **{k: v for k, v in record.items() if k not in _RESUME_FREE}}


def _at_least(name: str, value: int | float, minimum: int) -> None:
    if value < minimum:
        raise ValueError(f"--{name.replace('_', '-')} must be >= {minimum}, got {value}")


def _check_stops(args: argparse.Namespace, steps: int) -> None:
    """The options that end this process early: not recorded, but checked with the rest."""
    if args.stop_at is not None:
        _at_least("stop_at", args.stop_at, 1)
        if args.stop_at > steps:
            raise ValueError(
                f"--stop-at {args.stop_at} is beyond --steps {steps}: the run would end before it"
            )
    if args.time_limit is not None and not args.time_limit > 0:
        raise ValueError(
            f"--time-limit must be a positive number of seconds, got {args.time_limit}"
        )


def _rope_options(args: argparse.Namespace, preset: presets.Preset) -> dict:
    """The run's RoPE settings: those given, the rest the --init-from model's (so that a phase
    extended from it keeps its positions unless told otherwise), else the preset's."""
    inherited = {"rope_theta": preset.rope_theta, "rope_scaling": "none", "rope_factor": 1.0}
    if args.init_from is not None:
        try:
            inherited = presets.rope_settings(source_config(args.init_from))
        except ValueError as exc:
            raise ValueError(f"--init-from {str(args.init_from)!r}: {exc}") from None
    theta = inherited["rope_theta"] if args.rope_theta is None else args.rope_theta
    scaling = args.rope_scaling or inherited["rope_scaling"]
    factor = args.rope_factor
    if factor is None:
        factor = inherited["rope_factor"] if scaling == inherited["rope_scaling"] else None
    if not (math.isfinite(theta) and theta > 0):
        raise ValueError(f"--rope-theta must be a positive number, got {theta}")
    if scaling == "none":
        if factor not in (None, 1.0):
            raise ValueError(f"--rope-factor {factor} needs --rope-scaling linear")
        factor = 1.0
    elif factor is None:
        raise ValueError("--rope-scaling linear needs --rope-factor (the positions' divisor)")
    elif not (math.isfinite(factor) and factor >= 1):
        raise ValueError(f"--rope-factor must be a number >= 1, got {factor}")
    return {"rope_theta": float(theta), "rope_scaling": scaling, "rope_factor": float(factor)}


def source_config(path: Path | str):
    """The config of the model saved in ``path`` (by ``save_pretrained``)."""
    from transformers import LlamaConfig

    for name in ("model.safetensors", "config.json"):
        if not (Path(path) / name).is_file():
            raise ValueError(
                f"--init-from {str(path)!r}: no {name} there (a directory this command saved "
                "its final model into)"
            )
    return LlamaConfig.from_pretrained(path)
