"""What ``s2attn train`` decides before its output directory is touched: the options and run
controls resolved, every input checked (the layers, the memory a step needs, the data, an
``--init-from`` model), the data listed and the validation data loaded, as one :class:`RunPlan`.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from . import presets
from .data import SourceCorpus, TokenStream
from .evaluate import free_memory, needle_samples, validation_batches
from .needles import NeedleSample
from .options import RunControls, TrainOptions, source_config
from .run_directory import RUN_FILE, check_not_in_use

__all__ = ["RunPlan", "prepare", "train_stream"]

# Depths of the validation needles: evenly spread from the start (0) to the end (1) of the context.
_NEEDLE_DEPTHS = 8


@dataclass(frozen=True)
class RunPlan:
    """Everything decided before the output directory is touched."""

    options: TrainOptions
    controls: RunControls
    config: object
    device: torch.device
    train_corpus: SourceCorpus
    val_corpus: SourceCorpus
    # The training batches, checked to hold the retrieval rows; a checkpoint's state moves it
    # on when the run resumes.
    stream: TokenStream
    val_batches: list[torch.Tensor]
    val_needles: list[NeedleSample]
    # The --init-from model's weights, checked against config.
    initial_weights: dict | None

    @property
    def out(self) -> Path:
        return self.controls.out


def prepare(args: argparse.Namespace) -> RunPlan:
    """Check every input and load the validation data; writes nothing."""
    options = TrainOptions.resolve(args)
    controls = RunControls.resolve(args, options.steps)
    check_not_in_use(controls.out)
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
    train_corpus, val_corpus = _corpora(controls.data_root, options.val_fraction)
    options = options.replace(data_root=tuple(str(r) for r in train_corpus.roots))
    try:
        stream = train_stream(options, train_corpus)
    except ValueError as exc:
        raise ValueError(f"--needle-fraction / --seq-len: {exc}") from None
    initial = None
    if options.init_from is not None:
        initial = _initial_weights(options.init_from, config)
    return RunPlan(
        options=options,
        controls=controls,
        config=config,
        device=torch.device(options.device),
        train_corpus=train_corpus,
        val_corpus=val_corpus,
        stream=stream,
        val_batches=_validation_batches(options, val_corpus),
        val_needles=_validation_needles(options, val_corpus),
        initial_weights=initial,
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


def _corpora(data_root: tuple[Path, ...] | None, val_fraction: float):
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
            preset = json.loads((Path(path) / RUN_FILE).read_text())["options"]["preset"]
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


def train_stream(options: TrainOptions, corpus: SourceCorpus) -> TokenStream:
    """The training batches of ``options`` from ``corpus``, from their start."""
    return TokenStream(
        corpus,
        options.seq_len,
        options.batch_size,
        seed=options.seed,
        needle_fraction=options.needle_fraction,
        needles_per_sample=options.needles_per_sample,
        edge_fraction=options.needle_edge_fraction,
    )
