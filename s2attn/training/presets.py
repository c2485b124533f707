"""The HHST model: a Llama-style causal LM whose layers are dense or S2, chosen from its config.

A model is an ordinary transformers ``LlamaForCausalLM`` (RMSNorm, RoPE, SwiGLU, GQA) whose
config carries s2attn's settings (:func:`s2attn.integrations.transformers.configure`), so it
saves with ``save_pretrained`` and loads with ``from_pretrained`` as S2 again. The variants
compared in the experiments differ only in their attention, never in their parameters:

=========  ====================================================================================
dense      every layer dense (PyTorch SDPA)
hhst       the preset's dense layers (or ``dense_layers``), every other layer S2 with its heads
           staggered over the stride's residues, so the heads together cover every block
s2         every layer S2, staggered
local      the dense layers of ``hhst``, the others a local window alone, widened to the S2
           layers' density at the training length
homo       the dense layers of ``hhst``, the others S2 with every head on the same stripes
=========  ====================================================================================
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from ..integrations import transformers as s2hf
from ..stack import S2Settings
from .vocab import VOCAB_SIZE

__all__ = [
    "PRESETS",
    "ROPE_SCALINGS",
    "VARIANTS",
    "Preset",
    "build_model",
    "model_config",
    "model_summary",
    "parameter_count",
    "rope_settings",
    "variant_settings",
]

VARIANTS = ("dense", "hhst", "s2", "local", "homo")
# RoPE position schemes: "none" rotates by the positions themselves (base ``rope_theta``);
# "linear" divides the positions by ``rope_factor`` (position interpolation).
ROPE_SCALINGS = ("none", "linear")
# transformers >= 5 takes the RoPE settings as one ``rope_parameters`` dict; before, as
# ``rope_theta`` and a ``rope_scaling`` dict.
_ROPE_PARAMETERS = "rope_parameters" in inspect.signature(LlamaConfig.__init__).parameters


@dataclass(frozen=True)
class Preset:
    """A model shape, its S2 pattern and the training recipe that goes with it."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    seq_len: int
    s2: S2Settings
    batch_size: int
    steps: int
    lr: float
    warmup_steps: int
    val_every: int
    val_batches: int
    needle_fraction: float
    needles_per_sample: int = 4
    needle_edge_fraction: float = 0.0
    answer_weight: float = 1.0
    vocab_size: int = VOCAB_SIZE
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


PRESETS: dict[str, Preset] = {
    # Trains on a CPU in well under two minutes (S2 layers through the exact reference there).
    "tiny": Preset(
        num_layers=2,
        hidden_size=64,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=176,
        seq_len=256,
        s2=S2Settings(block_size=16, local_blocks=2, vert_stride=2, dense_layers=(0,)),
        batch_size=8,
        steps=60,
        lr=3e-3,
        warmup_steps=10,
        val_every=20,
        val_batches=2,
        needle_fraction=0.25,
    ),
    # The quality experiment on one H100: 6 layers (1 dense = 1/6), 4k tokens, 64-token blocks,
    # a 256-token window and every 8th block, staggered over the 8 KV heads, so each S2 layer's
    # heads together cover every block while each keeps 22% of the pairs at 4k (a local window
    # at that density spans 512 tokens). ~19M parameters. Half the rows are retrieval samples,
    # one needle each, its answer weighted 10x. The dense layer is the middle one (3): with it
    # first, HHST had not begun to retrieve after a 1k -> 4k curriculum on which the middle
    # placement retrieved 97% at 4k (H100, 2026-11-24): copying needs a previous-token head
    # below the layer that copies, and only a dense layer copies from anywhere. A tenth of the
    # needles sit at the very start or end of the context: with uniform depths alone every
    # model, dense too, retrieved 75-95% at depth 1 (H100, 2026-11-25), a placement training
    # almost never showed it.
    "small": Preset(
        num_layers=6,
        hidden_size=512,
        num_heads=8,
        num_kv_heads=8,
        intermediate_size=1408,
        seq_len=4096,
        s2=S2Settings(block_size=64, local_blocks=4, vert_stride=8, dense_layers=(3,)),
        batch_size=8,
        steps=2000,
        lr=1e-3,
        warmup_steps=100,
        val_every=250,
        val_batches=8,
        needle_fraction=0.5,
        needles_per_sample=1,
        needle_edge_fraction=0.1,
        answer_weight=10.0,
    ),
    # The long-context model a size up (~113M parameters): 12 layers of hidden 768, 12 heads of
    # 64, one KV head per query head (a GQA group shares one pattern, so fewer KV heads than the
    # stride's 8 residues would leave blocks no head reads). The small preset's S2 pattern, and
    # its share of dense layers (2 of 12), both in the middle: copying needs S2 layers below the
    # dense layer that copies.
    "medium": Preset(
        num_layers=12,
        hidden_size=768,
        num_heads=12,
        num_kv_heads=12,
        intermediate_size=3072,
        seq_len=4096,
        s2=S2Settings(block_size=64, local_blocks=4, vert_stride=8, dense_layers=(4, 8)),
        batch_size=8,
        steps=2000,
        lr=6e-4,
        warmup_steps=200,
        val_every=250,
        val_batches=8,
        needle_fraction=0.5,
        needles_per_sample=1,
        needle_edge_fraction=0.1,
        answer_weight=10.0,
    ),
}


def variant_settings(
    preset: Preset, variant: str, *, seq_len: int, max_seq_len: int, s2: S2Settings | None = None
) -> S2Settings | None:
    """The S2 settings of ``variant`` (None for ``dense``), from ``s2`` (default: the preset's).

    ``local`` keeps the dense layers and replaces the S2 pattern by a local window alone, as wide
    as makes its density at ``seq_len`` closest to the S2 pattern's there."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; choose one of {list(VARIANTS)}")
    s2 = preset.s2 if s2 is None else s2
    if variant == "dense":
        return None
    if variant == "s2":
        return s2.replace(dense_layers=())
    if variant == "homo":
        return s2.replace(homo_head=True)
    if variant == "local":
        heads, kv_heads = preset.num_heads, preset.num_kv_heads
        target = s2.pattern(heads, max_seq_len=seq_len, num_kv_heads=kv_heads).density()
        blocks = _local_blocks_at_density(s2.block_size, heads, kv_heads, seq_len, target)
        return _local_only(s2, blocks, max_seq_len)
    return s2


def _local_only(s2: S2Settings, local_blocks: int, max_seq_len: int) -> S2Settings:
    # A stride longer than the sequence, shifted so that no stripe lands on a block: the window
    # alone is left.
    return s2.replace(
        local_blocks=local_blocks,
        vert_stride=-(-max_seq_len // s2.block_size) + 1,
        homo_head=True,
        head_offset=1,
    )


def _local_blocks_at_density(
    block_size: int, heads: int, kv_heads: int, seq_len: int, target: float
) -> int:
    """The local window (in blocks) whose density at ``seq_len`` is closest to ``target``.

    A wider window keeps more pairs, so the density rises with the window: bisect for the
    narrowest window at or above ``target`` and take it or the one below, whichever is closer
    (the narrower on a tie). Each density costs a pattern of (heads, blocks, blocks): a scan of
    every width would build thousands of them at long lengths."""
    window = S2Settings(block_size=block_size, dense_layers=())

    def density(blocks: int) -> float:
        local = _local_only(window, blocks, seq_len)
        return local.pattern(heads, max_seq_len=seq_len, num_kv_heads=kv_heads).density()

    lo, hi = 1, -(-seq_len // block_size)
    while lo < hi:
        mid = (lo + hi) // 2
        if density(mid) < target:
            lo = mid + 1
        else:
            hi = mid
    if lo > 1 and abs(density(lo - 1) - target) <= abs(density(lo) - target):
        return lo - 1
    return lo


def model_config(
    preset: Preset | str,
    variant: str,
    *,
    seq_len: int | None = None,
    max_seq_len: int | None = None,
    s2: S2Settings | None = None,
    rope_theta: float | None = None,
    rope_scaling: str = "none",
    rope_factor: float = 1.0,
) -> LlamaConfig:
    """The transformers config of ``variant`` at ``preset``'s shape.

    Args:
        preset: a :data:`PRESETS` name or a :class:`Preset`.
        variant: one of :data:`VARIANTS`.
        seq_len: the training length (the local variant matches the S2 density there); defaults
            to the preset's.
        max_seq_len: the longest sequence the model's patterns (and RoPE table) cover; defaults
            to ``seq_len``. Longer inputs raise a clear error in the S2 layers.
        s2: the S2 settings that ``variant`` starts from (:func:`variant_settings`); defaults to
            the preset's.
        rope_theta: the RoPE base; defaults to the preset's.
        rope_scaling, rope_factor: one of :data:`ROPE_SCALINGS`; with ``"linear"``, positions
            are divided by ``rope_factor`` (>= 1) before the rotation.
    """
    if isinstance(preset, str):
        if preset not in PRESETS:
            raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
        preset = PRESETS[preset]
    seq_len = seq_len or preset.seq_len
    max_seq_len = max_seq_len or seq_len
    if max_seq_len < seq_len:
        raise ValueError(f"max_seq_len ({max_seq_len}) is below seq_len ({seq_len})")
    settings = variant_settings(preset, variant, seq_len=seq_len, max_seq_len=max_seq_len, s2=s2)
    rope = _rope_arguments(
        preset.rope_theta if rope_theta is None else rope_theta, rope_scaling, rope_factor
    )
    config = LlamaConfig(
        vocab_size=preset.vocab_size,
        hidden_size=preset.hidden_size,
        intermediate_size=preset.intermediate_size,
        num_hidden_layers=preset.num_layers,
        num_attention_heads=preset.num_heads,
        num_key_value_heads=preset.num_kv_heads,
        head_dim=preset.head_dim,
        max_position_embeddings=max_seq_len,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        attn_implementation="sdpa",
        **rope,
    )
    if settings is not None:
        s2hf.configure(config, settings, max_seq_len=max_seq_len)
    return config


def _rope_arguments(theta: float, scaling: str, factor: float) -> dict:
    """``LlamaConfig`` keyword arguments for these RoPE settings, in the installed transformers'
    form."""
    if not (isinstance(theta, (int, float)) and math.isfinite(theta) and theta > 0):
        raise ValueError(f"rope_theta must be a positive number, got {theta!r}")
    if scaling not in ROPE_SCALINGS:
        raise ValueError(f"rope_scaling must be one of {list(ROPE_SCALINGS)}, got {scaling!r}")
    if not (isinstance(factor, (int, float)) and math.isfinite(factor) and factor >= 1):
        raise ValueError(f"rope_factor must be a number >= 1, got {factor!r}")
    if scaling == "none" and factor != 1:
        raise ValueError(f"rope_factor {factor} needs rope_scaling 'linear'")
    theta = float(theta)
    if _ROPE_PARAMETERS:
        parameters = {"rope_type": "default", "rope_theta": theta}
        if scaling == "linear":
            parameters.update(rope_type="linear", factor=float(factor))
        return {"rope_parameters": parameters}
    legacy: dict = {"rope_theta": theta}
    if scaling == "linear":
        legacy["rope_scaling"] = {"rope_type": "linear", "factor": float(factor)}
    return legacy


def rope_settings(config) -> dict:
    """The RoPE settings of a model config (any transformers version), as
    ``{"rope_theta": float, "rope_scaling": "none" | "linear", "rope_factor": float}``.

    Raises ``ValueError`` for a scheme other than plain RoPE and linear interpolation."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    parameters = getattr(text, "rope_parameters", None) or {}
    legacy = getattr(text, "rope_scaling", None) or {}
    theta = parameters.get("rope_theta", getattr(text, "rope_theta", None))
    scheme = parameters if "rope_type" in parameters else legacy
    kind = scheme.get("rope_type", scheme.get("type", "default"))
    if kind not in ("default", "linear"):
        raise ValueError(f"RoPE type {kind!r} is not supported here (only default and linear)")
    return {
        "rope_theta": float(theta if theta is not None else 10000.0),
        "rope_scaling": "linear" if kind == "linear" else "none",
        "rope_factor": float(scheme.get("factor", 1.0)) if kind == "linear" else 1.0,
    }


def check_weights_file(path: Path, what: str) -> None:
    """Raise ``ValueError`` naming ``path`` (and ``what`` asked for it) unless it is a whole
    safetensors file: its header readable and its tensors covering the file exactly, which a
    truncated or partly written file fails. Reads the header only."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt"):
            pass
    except (SafetensorError, OSError) as exc:
        raise ValueError(
            f"{what}: {path} is not a whole safetensors file ({exc}): damaged, or cut short "
            "while it was written or copied"
        ) from None


def parameter_count(config) -> int:
    """Parameters of a model of ``config`` (the output head tied to the embedding)."""
    text = config.get_text_config(decoder=True)
    h, f, v = text.hidden_size, text.intermediate_size, text.vocab_size
    head_dim = getattr(text, "head_dim", None) or h // text.num_attention_heads
    q = text.num_attention_heads * head_dim
    kv = text.num_key_value_heads * head_dim
    per_layer = 2 * h * q + 2 * h * kv + 3 * h * f + 2 * h
    untied = 0 if text.tie_word_embeddings else v * h
    return text.num_hidden_layers * per_layer + v * h + h + untied


def build_model(config: LlamaConfig, *, seed: int = 0) -> LlamaForCausalLM:
    """A freshly initialised model of ``config``; the same seed gives the same weights for every
    variant (they have the same parameters)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return LlamaForCausalLM(config)


def model_summary(config: LlamaConfig, seq_len: int | None = None) -> dict:
    """Parameters, layer kinds and the S2 layers' density at ``seq_len`` (JSON-friendly)."""
    text = config.get_text_config(decoder=True)
    seq_len = seq_len or text.max_position_embeddings
    settings = getattr(text, "s2attn", None)
    layer_types = settings["layer_types"] if settings else ["dense"] * text.num_hidden_layers
    densities = []
    for i in range(len(layer_types)):
        pattern = s2hf.layer_pattern(text, i) if settings else None
        densities.append(1.0 if pattern is None else round(pattern.density(seq_len), 4))
    return {
        "parameters": parameter_count(config),
        "layer_types": layer_types,
        "layer_density": densities,
        "mean_density": round(sum(densities) / len(densities), 4),
        "seq_len": seq_len,
        "rope": rope_settings(text),
        "s2attn": settings,
    }
