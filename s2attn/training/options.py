"""The options of ``s2attn train``, each declared once, as a field of :class:`TrainOptions` (the
run's options) or :class:`RunControls` (how this process runs it): the field's metadata holds its
flag's help, default and parsing, which of the preset's values it defaults to and its lower
bound, so that :func:`add_arguments` and the resolution walk the same declarations.

:class:`TrainOptions` is what ``run.json`` records (:meth:`TrainOptions.record`, under the names
of the command line's options) and what ``--resume`` compares with the saved run
(:meth:`TrainOptions.comparable`). :class:`RunControls` (``--out``, ``--resume``, ``--stop-at``,
``--time-limit``, ``--no-progress``, ``--data-root``) say where and how this process runs it; they
stay out of the record, but for the data directories, which it records as the corpus resolved
them (``TrainOptions.data_root``).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import operator
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..stack import S2Settings
from . import presets

__all__ = ["PRECISIONS", "RunControls", "TrainOptions", "add_arguments", "source_config"]

PRECISIONS = ("auto", "fp32", "bf16-autocast", "bf16")
# Options that change neither the trained weights nor the log, so a resumed run may differ in
# them (some are not recorded now, but runs once recorded them).
_RESUME_FREE = ("resume", "no_progress", "checkpoint_every", "stop_at", "time_limit")
# The metadata key of an option added after runs were recorded without it: the value that
# reproduces those runs (None where no single value does: validation then read the text of the
# run's own seed).
_OLDER_RUNS = "older_runs"
# The preset's S2 settings, as the options that override them are named ("s2.vert_stride").
_S2_PREFIX = "s2."


def _option(
    help: str,
    *,
    preset: str | None = None,
    at_least: int | None = None,
    **flag,
) -> dataclasses.Field:
    """A field that is also the option ``--name``: ``help`` and ``flag`` go to argparse;
    ``preset`` names the preset's attribute it defaults to when not given (``"s2.vert_stride"``);
    ``at_least`` is the lowest value it may take. ``older_runs`` (in ``flag``) sets the value of
    runs recorded before the option existed."""
    metadata = {"help": help, "flag": flag, "preset": preset, "at_least": at_least}
    if _OLDER_RUNS in flag:
        metadata[_OLDER_RUNS] = flag.pop(_OLDER_RUNS)
    return field(metadata=metadata)


def _flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def _add_fields(parser, cls) -> None:
    for f in dataclasses.fields(cls):
        if "help" in f.metadata:
            parser.add_argument(_flag_name(f.name), help=f.metadata["help"], **f.metadata["flag"])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``s2attn train``; those left unset take the preset's values."""
    _add_fields(parser, TrainOptions)
    _add_fields(parser.add_argument_group("run controls"), RunControls)


def _dense_layers(text: str) -> list[int]:
    if text.strip().lower() == "none":
        return []
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated layer indices or 'none', got {text!r}"
        ) from None


# ------------------------------------------------------------------------------- options
@dataclass(frozen=True)
class TrainOptions:
    """A run's options with the preset's defaults filled in; each field's help says what it is."""

    preset: str = _option(
        f"model shape and recipe: one of {', '.join(presets.PRESETS)} (default tiny)",
        default="tiny",
    )
    variant: str = _option(
        f"attention per layer: one of {', '.join(presets.VARIANTS)} (default hhst)",
        default="hhst",
    )
    steps: int = _option("optimizer steps", type=int, preset="steps", at_least=1)
    seq_len: int = _option(
        "training context length in tokens", type=int, preset="seq_len", at_least=1
    )
    max_seq_len: int = _option(
        "length the S2 patterns and RoPE table cover (default --seq-len); set it higher to "
        "evaluate the model beyond its training length",
        type=int,
        at_least=1,
    )
    batch_size: int = _option(
        "sequences per micro-batch", type=int, preset="batch_size", at_least=1
    )
    grad_accum: int = _option("micro-batches per optimizer step", type=int, default=1, at_least=1)
    lr: float = _option("peak learning rate", type=float, preset="lr")
    warmup_steps: int = _option(
        "linear warm-up steps before the cosine decay",
        type=int,
        preset="warmup_steps",
        at_least=0,
    )
    dense_layers: tuple[int, ...] = _option(
        "dense layers of hhst/local/homo: comma-separated indices, or 'none' "
        "(dense and s2 ignore it)",
        type=_dense_layers,
        preset=_S2_PREFIX + "dense_layers",
    )
    vert_stride: int = _option(
        "S2 vertical stride in blocks",
        type=int,
        preset=_S2_PREFIX + "vert_stride",
        at_least=1,
    )
    local_blocks: int = _option(
        "S2 local window in blocks",
        type=int,
        preset=_S2_PREFIX + "local_blocks",
        at_least=1,
    )
    device: str = _option("default: cuda if available", choices=("cpu", "cuda"))
    precision: str = _option(
        "auto: float32 weights under bf16 autocast on CUDA, float32 on the CPU; bf16: "
        "bf16 weights and optimizer state",
        choices=PRECISIONS,
        default="auto",
    )
    gradient_checkpointing: bool = _option(
        "recompute activations in the backward pass (less memory, ~30%% more time)",
        action="store_true",
    )
    compile: bool = _option(
        "compile the model with torch.compile (Inductor): faster steps once compiled; the "
        "first steps and the first validation include the compilation",
        action="store_true",
        older_runs=False,
    )
    compile_layers: bool = _option(
        "compile each decoder layer on its own, with static shapes, instead of the whole "
        "model: the S2 layers share one graph and the dense layers another, however deep the "
        "model",
        action="store_true",
        older_runs=False,
    )
    seed: int = _option("initial weights and batch order (default 0)", type=int, default=0)
    val_seed: int = _option(
        "which held-out text and needles validation reads (default 0); kept apart from "
        "--seed so that runs of several seeds are measured on the same text",
        type=int,
        default=0,
        older_runs=None,
    )
    needle_fraction: float = _option(
        "share of training rows that are retrieval samples",
        type=float,
        preset="needle_fraction",
    )
    needles_per_sample: int = _option(
        "needles planted in each retrieval row, each asked for at its end",
        type=int,
        preset="needles_per_sample",
        at_least=1,
    )
    needle_edge_fraction: float = _option(
        "share of needles planted at the very start or end of the context instead of a "
        "uniform depth (a uniform depth almost never tests the first tokens)",
        type=float,
        preset="needle_edge_fraction",
        older_runs=0.0,
    )
    answer_weight: float = _option(
        "weight of the needle answers' tokens in the training loss (1: plain LM loss)",
        type=float,
        preset="answer_weight",
    )
    init_from: str | None = _option(
        "start from the weights of a model this command saved (same preset and variant; "
        "e.g. one trained at a shorter --seq-len), with a fresh optimizer and schedule",
        type=Path,
    )
    rope_theta: float = _option(
        "RoPE base (default: the --init-from model's, else the preset's, 10000)",
        type=float,
        older_runs=10000.0,
    )
    rope_scaling: str = _option(
        "RoPE position scheme: none, or linear (positions divided by --rope-factor: "
        "position interpolation); default: the --init-from model's, else none",
        choices=presets.ROPE_SCALINGS,
        older_runs="none",
    )
    rope_factor: float = _option(
        "divisor of the positions under --rope-scaling linear (>= 1)",
        type=float,
        older_runs=1.0,
    )
    # The data directories as the corpus resolved them (None until then); the option that
    # names them is RunControls.data_root.
    data_root: tuple[str, ...] | None
    val_fraction: float = _option(
        "share of files (by path hash) in the validation split (default 0.05)",
        type=float,
        default=0.05,
    )
    val_every: int = _option(
        "validate every N steps (0: only at the end)",
        type=int,
        preset="val_every",
        at_least=0,
    )
    val_batches: int = _option(
        "held-out batches per validation (0: none)",
        type=int,
        preset="val_batches",
        at_least=0,
    )
    val_needles: int = _option(
        "retrieval samples per validation, at depths spread over [0, 1] (default 32)",
        type=int,
        default=32,
        at_least=0,
    )
    log_every: int = _option("write a metrics row every N steps", type=int, default=10, at_least=1)
    checkpoint_every: int = _option(
        "checkpoint every N steps (0: only at the end or when stopping)",
        type=int,
        default=0,
        at_least=0,
    )

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
        given = {}
        for f in dataclasses.fields(cls):
            value = getattr(args, f.name, None) if "help" in f.metadata else None
            if value is None and f.metadata.get("preset"):
                value = operator.attrgetter(f.metadata["preset"])(preset)
            given[f.name] = _as_field_type(f, value)
        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        if device == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda: no CUDA device is available")
        precision = args.precision
        if precision == "auto":
            precision = "bf16-autocast" if device == "cuda" else "fp32"

        def pick(name, default):
            return default if given[name] is None else given[name]

        options = cls(
            **{
                **given,
                "max_seq_len": pick("max_seq_len", given["seq_len"]),
                "device": device,
                "precision": precision,
                "init_from": None
                if args.init_from is None
                else str(Path(args.init_from).resolve()),
                **_rope_options(args, preset),
            }
        )
        options._check()
        return options

    def _check(self) -> None:
        _check_bounds(self)
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
        """The :class:`~s2attn.training.presets.Preset` named by ``preset``."""
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
            **{
                f.metadata["preset"].removeprefix(_S2_PREFIX): getattr(self, f.name)
                for f in dataclasses.fields(self)
                if (f.metadata.get("preset") or "").startswith(_S2_PREFIX)
            }
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

    def flags(self) -> list[list[str]]:
        """The command-line options that give these options, one list per option (the data
        directories and ``--init-from`` left out: they are paths, which the caller places)."""
        flags = []
        for key, value in self.record().items():
            if key in ("data_root", "init_from") or value is None or value is False:
                continue
            if value is True:
                flags.append([_flag_name(key)])
            elif isinstance(value, list):
                flags.append([_flag_name(key), ",".join(str(v) for v in value) or "none"])
            else:
                flags.append([_flag_name(key), str(value)])
        return flags


def _as_field_type(f: dataclasses.Field, value):
    """``value`` as ``f`` holds it: a preset's int learning rate as a float, a list as a tuple."""
    if value is None:
        return None
    if str(f.type) in ("float", str(float)):
        return float(value)
    if str(f.type).startswith("tuple"):
        return tuple(value)
    return value


def comparable(record: dict) -> dict:
    """The options of a ``run.json`` record that ``--resume`` compares, with the options added
    since older runs were recorded filled in."""
    added = {
        f.name: f.metadata[_OLDER_RUNS]
        for f in dataclasses.fields(TrainOptions)
        if _OLDER_RUNS in f.metadata
    }
    return {**added, **{k: v for k, v in record.items() if k not in _RESUME_FREE}}


def _check_bounds(options) -> None:
    """Raise ``ValueError`` for the first field of ``options`` below its ``at_least``."""
    for f in dataclasses.fields(options):
        minimum, value = f.metadata.get("at_least"), getattr(options, f.name)
        if minimum is not None and value is not None and value < minimum:
            raise ValueError(f"{_flag_name(f.name)} must be >= {minimum}, got {value}")


# -------------------------------------------------------------------------- run controls
@dataclass(frozen=True)
class RunControls:
    """How this process runs the training: where it writes, whether it resumes, when it stops
    early, what it shows and which directories it reads (``TrainOptions.data_root`` records
    them as the corpus resolves them)."""

    out: Path = _option(
        "output directory: new or empty, or this run's own with --resume",
        type=Path,
        required=True,
    )
    resume: bool = _option(
        "continue the run in --out from its last checkpoint (same options)",
        action="store_true",
    )
    stop_at: int | None = _option(
        "stop after this step with a checkpoint, as if interrupted; finish with --resume",
        type=int,
        at_least=1,
    )
    time_limit: float | None = _option(
        "stop with a checkpoint once this many seconds have passed in this process",
        type=float,
    )
    no_progress: bool = _option(
        "no progress bar (it shows only when stderr is a terminal)",
        action="store_true",
    )
    data_root: tuple[Path, ...] | None = _option(
        "directory of source files to train on (repeatable; default: the standard library, "
        "which no package install changes)",
        action="append",
        type=Path,
    )

    @classmethod
    def resolve(cls, args: argparse.Namespace, steps: int) -> RunControls:
        """The controls of ``args`` for a run of ``steps`` steps, checked; raises
        ``ValueError`` naming the option at fault."""
        values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)}
        controls = cls(
            **{
                **values,
                "out": Path(values["out"]),
                "resume": bool(values["resume"]),
                "no_progress": bool(values["no_progress"]),
                "data_root": None if not values["data_root"] else tuple(values["data_root"]),
            }
        )
        _check_bounds(controls)
        if controls.stop_at is not None and controls.stop_at > steps:
            raise ValueError(
                f"--stop-at {controls.stop_at} is beyond --steps {steps}: the run would end "
                "before it"
            )
        if controls.time_limit is not None and not controls.time_limit > 0:
            raise ValueError(
                f"--time-limit must be a positive number of seconds, got {controls.time_limit}"
            )
        return controls

    @property
    def progress(self) -> bool:
        """Whether to show a progress bar."""
        return not self.no_progress and sys.stderr.isatty()


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
