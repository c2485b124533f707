"""HuggingFace transformers: S2 attention layers and an evicting paged KV cache for ``generate``.

Importing this module imports transformers (``import s2attn`` alone never does) and registers two
attention implementations:

* ``"s2attn"``: each layer's attention through s2attn's kernels, with the layer's pattern from the
  config (:func:`configure`; a per-layer choice of dense or S2, e.g. HHST's dense first layers).
  With an :class:`S2Cache` it prefills, chunk-prefills and decodes over the paged cache that evicts
  what the pattern never reads again; with transformers' own caches (or none) it attends over the
  keys they return.
* ``"s2attn_reference"``: the same patterns through :func:`s2attn.attention_reference` on the
  dense token mask, for tests.

Left-padded batches (``tokenizer.padding_side = "left"``) work: each sequence's tokens sit at
positions 0.. of its own, so the cache and the pattern see them unpadded.

Example::

    from transformers import LlamaConfig, LlamaForCausalLM
    from s2attn.integrations import transformers as s2hf

    config = LlamaConfig(num_hidden_layers=16, ...)
    s2hf.configure(config, block_size=64, local_blocks=16, vert_stride=16, dense_layers=2)
    model = LlamaForCausalLM(config)
    cache = s2hf.S2Cache(model.config)
    out = model.generate(input_ids, past_key_values=cache, max_new_tokens=128)
    print(cache.memory_report())

Works with models whose attention modules carry ``config`` and ``layer_idx``, call
``past_key_values.update(key, value, layer_idx)`` and then the registered attention function
(Llama, Mistral, Qwen2 and the like). Beam search works: beams share the pages of their common past
(counted per page) and copy a shared page before writing into it.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

try:
    from transformers import AttentionInterface, PreTrainedConfig
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "s2attn.integrations.transformers needs HuggingFace transformers >= 5: "
        "pip install 's2attn[transformers]'"
    ) from exc

from ..attention import sparse_attention
from ..inference import MAX_DECODE_TOKENS, sparse_attention_with_kvcache
from ..inference.decode_op import static_decode_step
from ..input_checks import check_softmax_scale
from ..pattern import BlockPattern, shared_dense_pattern
from ..precision import autocast_dtype, autocast_entry, cast_inputs
from ..reference import attention_reference
from ..stack import (
    CONFIG_KEY,
    S2Settings,
    config_dense_pattern,
    config_layer_pattern,
    config_settings,
    settings_with,
    shared_s2_pattern,
    spread_dense_layers,
)
from .transformers_cache import S2Cache, S2CacheLayer

__all__ = [
    "ATTN_IMPLEMENTATION",
    "REFERENCE_IMPLEMENTATION",
    "SUPPORTED_MODEL_TYPES",
    "S2Cache",
    "S2CacheLayer",
    "attention_forward",
    "compile_layers",
    "configure",
    "layer_pattern",
    "prepare",
    "reference_attention_forward",
]

ATTN_IMPLEMENTATION = "s2attn"
REFERENCE_IMPLEMENTATION = "s2attn_reference"
# The decoder families whose attention modules take the registered attention as Llama's do
# (``config`` and ``layer_idx`` on the module, the cache updated first, no attention dropout by
# default), checked by tests: model_type -> name. GPT-2's, for one, applies dropout in training.
SUPPORTED_MODEL_TYPES = {
    "llama": "Llama",
    "mistral": "Mistral",
    "qwen2": "Qwen2",
    "qwen3": "Qwen3",
}
# Where prepare(model) binds each attention module's pattern. The attention reads it there, not
# through layer_idx: torch.compile guards on what the traced code reads, and all S2 layers share
# one pattern object, so one layer compiled on its own serves them all; read through layer_idx,
# each layer would get a graph of its own.
_PATTERN_ATTR = "s2attn_pattern"


# ------------------------------------------------------------------------------- config
def configure(
    config,
    settings: S2Settings | None = None,
    *,
    block_size: int | None = None,
    local_blocks: int | None = None,
    vert_stride: int | None = None,
    dense_layers: int | Sequence[int] | None = None,
    max_seq_len: int | None = None,
    num_dense_heads: int | None = None,
    homo_head: bool | None = None,
    head_offset: int | None = None,
    attn_implementation: str = ATTN_IMPLEMENTATION,
):
    """Make a transformers config an HHST model: some layers dense, the others S2.

    Args:
        config: a decoder config (e.g. ``LlamaConfig``); changed in place and returned.
        settings: the :class:`~s2attn.stack.S2Settings` (default: block 64, local 16 blocks,
            stride 16, two dense layers spread through the stack), of any pattern family; each
            of the keywords below that is given replaces its field.
        block_size, local_blocks, vert_stride, num_dense_heads, homo_head, head_offset: the S2
            layers' :func:`s2attn.local_stride_pattern` (GQA groups share one pattern, so the KV
            cache can evict).
        dense_layers: the dense layers' indices, or a count of dense layers, which go to the
            middle of equal slices of the stack (:func:`~s2attn.stack.spread_dense_layers`:
            2 of 16 are layers 4 and 12); a model with its dense layers first does not learn
            to retrieve from far back.
        max_seq_len: the patterns' length; defaults to ``config.max_position_embeddings``.
        attn_implementation: ``"s2attn"`` (the kernels) or ``"s2attn_reference"`` (the dense-mask
            reference).

    The choice is stored as the JSON-friendly dict ``config.s2attn`` (so it survives
    ``save_pretrained``), with ``config.s2attn["layer_types"]`` one of "dense" or "s2" per layer;
    ``S2Settings.from_config(config)`` reads it back.

    Example::

        >>> config = LlamaConfig(num_hidden_layers=4, ...)
        >>> configure(config, block_size=16, local_blocks=4, vert_stride=4, dense_layers=[0])
        >>> config.s2attn["layer_types"]
        ['dense', 's2', 's2', 's2']
    """
    text = _decoder_config(config)
    num_layers = text.num_hidden_layers
    dense_layers = _dense_layers(dense_layers, settings, num_layers)
    if attn_implementation not in (ATTN_IMPLEMENTATION, REFERENCE_IMPLEMENTATION):
        raise ValueError(
            f"attn_implementation must be {ATTN_IMPLEMENTATION!r} or "
            f"{REFERENCE_IMPLEMENTATION!r}, got {attn_implementation!r}"
        )
    settings = settings_with(
        settings,
        block_size=block_size,
        local_blocks=local_blocks,
        vert_stride=vert_stride,
        dense_layers=dense_layers,
        num_dense_heads=num_dense_heads,
        homo_head=homo_head,
        head_offset=head_offset,
    )
    entry = settings.config_entry(num_layers, max_seq_len or text.max_position_embeddings)
    # Built now, not at the first forward: it validates the settings, and a compiled forward
    # finds the patterns ready (see s2attn.pattern.shared_pattern).
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    shared_s2_pattern(entry, heads, kv_heads)
    if settings.dense_layers:
        shared_dense_pattern(kv_heads, entry["max_seq_len"], settings.block_size)
    setattr(text, CONFIG_KEY, entry)
    text._attn_implementation = attn_implementation
    return config


def _dense_layers(dense_layers, settings: S2Settings | None, num_layers: int):
    """The dense layers' indices :func:`configure` takes (None: the settings'), from indices or
    a count spread through the stack (two when neither they nor settings are given)."""
    if settings is None and dense_layers is None:
        dense_layers = 2
    if isinstance(dense_layers, int) and not isinstance(dense_layers, bool):
        return spread_dense_layers(dense_layers, num_layers)
    if dense_layers is not None and (
        isinstance(dense_layers, (bool, str)) or not isinstance(dense_layers, Sequence)
    ):
        raise TypeError(
            "configure: dense_layers must be a count of dense layers (an int) or a list of "
            f"layer indices, got {dense_layers!r}"
        )
    return dense_layers


def _decoder_config(config):
    """The decoder (text) config of a supported model family's config; raises otherwise."""
    if not isinstance(config, PreTrainedConfig):
        raise TypeError(
            "configure: config must be a transformers config object (a PreTrainedConfig such "
            f"as LlamaConfig), got {type(config).__name__}; a dict of fields becomes one as "
            "LlamaConfig(**fields)"
        )
    text = config.get_text_config(decoder=True)
    if text.model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"configure: {type(text).__name__} (model_type {text.model_type!r}) is not a "
            "supported model family; the s2attn attention runs in "
            f"{', '.join(SUPPORTED_MODEL_TYPES.values())} models (model_type "
            f"{', '.join(map(repr, SUPPORTED_MODEL_TYPES))})"
        )
    return text


def layer_pattern(config, layer_idx: int) -> BlockPattern | None:
    """The pattern of layer ``layer_idx`` under :func:`configure`'s settings, None when dense
    (:func:`s2attn.stack.config_layer_pattern`)."""
    return config_layer_pattern(config, layer_idx)


def prepare(model_or_config) -> None:
    """Build every layer's pattern now, so that ``torch.compile(model, fullgraph=True)`` only
    reads them (building one is Python work the compiler cannot trace).

    :func:`configure` already builds them; a config restored by ``from_pretrained`` gets them on
    its first forward, or here. Takes a model or its config. Given a model, it also binds each
    attention module of the config's layers to its pattern, which :func:`compile_layers` needs.
    """
    config = getattr(model_or_config, "config", model_or_config)
    text = config.get_text_config(decoder=True)
    for layer in range(len(config_settings(text)[1]["layer_types"])):
        _attention_pattern(text, layer)
    if isinstance(model_or_config, torch.nn.Module):
        for module in model_or_config.modules():
            if getattr(module, "config", None) is text and hasattr(module, "layer_idx"):
                setattr(module, _PATTERN_ATTR, _attention_pattern(text, module.layer_idx))


def compile_layers(model: torch.nn.Module, **options) -> None:
    """Compile each decoder layer of ``model`` on its own, in place (``torch.compile`` options
    as ``nn.Module.compile`` takes them); the rest of the model stays eager.

    Every S2 layer shares one compiled graph and every dense layer another, so the compiler
    builds two layer graphs however deep the model is, where a whole-model graph grows with the
    depth. The state dict keeps its keys. Calls :func:`prepare` on the model first.

    Shapes are static (``dynamic=False``) unless ``options`` say otherwise: all layers run one
    ``forward``, so with automatic dynamic shapes the second kind of layer turns its pattern's
    key symbolic, and a validation at another length the sequence dimension, and training then
    runs those generic graphs.
    """
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise ValueError(f"{type(model).__name__} has no decoder layer list to compile")
    prepare(model)
    options = {"dynamic": False, **options}
    for layer in layers:
        layer.compile(**options)


def _module_pattern(module) -> BlockPattern:
    """The attention module's pattern: the one :func:`prepare` bound to it, else its layer's."""
    pattern = getattr(module, _PATTERN_ATTR, None)
    if pattern is None:
        pattern = _attention_pattern(module.config, module.layer_idx)
    return pattern


def _attention_pattern(config, layer_idx: int) -> BlockPattern:
    """The layer's pattern for attention over explicit keys: dense layers get a dense one."""
    pattern = config_layer_pattern(config, layer_idx)
    return config_dense_pattern(config) if pattern is None else pattern


# ------------------------------------------------------------------------------ padding
def _real_counts(mask: torch.Tensor | None, length: int) -> list[int] | None:
    """Real (unpadded) tokens among the last ``length`` columns of a left-padded 2-D mask per
    row; None when there is no padding there."""
    if mask is None:
        return None
    if mask.dim() != 2:
        raise ValueError(f"s2attn expects a 2-D padding mask, got shape {tuple(mask.shape)}")
    tail = mask[:, -length:].to(torch.int8)
    if bool(tail.all()):
        return None
    if bool((tail[:, 1:] < tail[:, :-1]).any()):
        raise ValueError("s2attn supports left padding only: set tokenizer.padding_side = 'left'")
    return tail.sum(dim=1).tolist()


def _pack(x: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """(batch, seq, ...) -> (sum(counts), ...): the last counts[b] rows of each sequence."""
    return torch.cat([x[b, x.shape[1] - n :] for b, n in enumerate(counts)])


def _unpack(x: torch.Tensor, counts: list[int], seq: int) -> torch.Tensor:
    out = x.new_zeros(len(counts), seq, *x.shape[1:])
    start = 0
    for b, n in enumerate(counts):
        out[b, seq - n :] = x[start : start + n]
        start += n
    return out


def _cu(counts: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor([0, *counts], dtype=torch.int64).cumsum(0).to(torch.int32).to(device)


def _padding_segments(mask: torch.Tensor, seq: int) -> torch.Tensor:
    """int32 offsets (2 * batch + 1,) that cut a left-padded batch, flattened to (batch * seq)
    rows, into two packed sequences per row: its padding (perhaps empty), then its real tokens.

    Computed on the device with fixed shapes, so nothing waits for the GPU and a compiled graph
    holds it; the real tokens keep their positions from their own first token, as if packed."""
    batch = mask.shape[0]
    starts = torch.arange(batch, dtype=torch.int32, device=mask.device) * seq
    pads = seq - mask.sum(dim=1, dtype=torch.int32)
    cuts = torch.stack([starts, starts + pads], dim=1).flatten()
    return torch.cat([cuts, cuts.new_full((1,), batch * seq)])


def _attend_padded(fn, q, k, v, pattern, mask, scale):
    """Attention over a left-padded batch with the context's own length (training, prefill),
    in place: no rows are gathered, and the padding's rows come back as zeros."""
    batch, seq = q.shape[:2]
    cu = _padding_segments(mask, seq)
    # Bounds given, so that the packed call reads no offsets on the host (the reference reads
    # them anyway and takes none).
    bounds = {"max_seqlen_q": seq, "max_seqlen_k": seq} if fn is sparse_attention else {}
    out = fn(
        q.reshape(batch * seq, *q.shape[2:]),
        k.reshape(batch * seq, *k.shape[2:]),
        v.reshape(batch * seq, *v.shape[2:]),
        pattern,
        softmax_scale=scale,
        cu_seqlens_q=cu,
        cu_seqlens_k=cu,
        **bounds,
    )
    return out.view(q.shape) * mask[:, :, None, None].to(out.dtype)


def _attend_context(fn, q, k, v, pattern, mask, scale):
    """Attention over explicit keys (the whole context), unpadding left-padded rows."""
    if mask is not None and torch.compiler.is_compiling() and q.shape[1] == k.shape[1]:
        # Nothing is read on the host while tracing: a mask is taken as padding, unchecked.
        return _attend_padded(fn, q, k, v, pattern, mask[:, -k.shape[1] :], scale)
    q_counts = _real_counts(mask, q.shape[1])
    k_counts = _real_counts(mask, k.shape[1])
    if q_counts is None and k_counts is None:
        return fn(q, k, v, pattern, softmax_scale=scale)
    if q.shape[1] == k.shape[1]:
        return _attend_padded(fn, q, k, v, pattern, mask[:, -k.shape[1] :], scale)
    q_counts = q_counts or [q.shape[1]] * q.shape[0]
    k_counts = k_counts or [k.shape[1]] * k.shape[0]
    out = fn(
        _pack(q, q_counts),
        _pack(k, k_counts),
        _pack(v, k_counts),
        pattern,
        softmax_scale=scale,
        cu_seqlens_q=_cu(q_counts, q.device),
        cu_seqlens_k=_cu(k_counts, q.device),
    )
    return _unpack(out, q_counts, q.shape[1])


# ------------------------------------------------------------------- attention functions
def _check_module(module, dropout: float) -> None:
    if dropout and module.training:
        raise NotImplementedError("s2attn attention does not implement attention dropout")


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The ``"s2attn"`` attention implementation.

    query (batch, heads, seq, dim); key/value (batch, kv_heads, seq_k, dim): with an
    :class:`S2Cache` only this step's tokens (the cache holds the rest), else the whole context.
    Returns (batch, seq, heads, dim) and no attention weights. Under ``torch.autocast`` (where
    Llama hands over float32 q/k/v from its float32 rotary embedding) the entry points it calls
    cast them to the region's dtype, and the output comes back in it.
    """
    _check_module(module, dropout)
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    layer: S2CacheLayer | None = getattr(key, "_s2attn_cache_layer", None)
    if layer is None:
        pattern = _module_pattern(module)
        return _attend_context(sparse_attention, q, k, v, pattern, attention_mask, scaling), None
    layer.take_step()
    if layer.static and torch.compiler.is_compiling() and q.shape[1] <= MAX_DECODE_TOKENS:
        return _compiled_decode(layer, q, k, v, scaling), None
    paged = layer.paged
    counts = _real_counts(attention_mask, q.shape[1]) if q.shape[1] > 1 else None
    if counts is None:
        return sparse_attention_with_kvcache(q, paged, k, v, softmax_scale=scaling), None
    out = sparse_attention_with_kvcache(
        _pack(q, counts),
        paged,
        _pack(k, counts),
        _pack(v, counts),
        softmax_scale=scaling,
        cu_seqlens_q=_cu(counts, q.device),
    )
    return _unpack(out, counts, q.shape[1]), None


def _compiled_decode(layer: S2CacheLayer, q, k, v, scaling: float | None) -> torch.Tensor:
    """A decode step inside a compiled graph: one operator of device work alone (see
    ``s2attn.inference.decode_op``), so the graph serves every step, replayed or not. The
    cache's host lengths follow the device's from then on (``PagedKVCache.catch_up``). Dtypes
    follow ``sparse_attention_with_kvcache``'s rule: cast to the cache's under autocast, the
    output back to the region's; refused when they differ outside it.

    Only the layer that stores tokens first checks on the device that the step fits (two
    launches; once per step, not per layer). The others need no check of their own: every
    forward hands each layer the same tokens (``update`` refuses a layer whose tokens were not
    stored) and every edit (crop, reorder, reset) goes to all layers through :class:`S2Cache`,
    so the layers' lengths move in lockstep; and the first layer runs first in every step, so a
    step past the cache fails before any layer writes."""
    paged = layer.paged
    region = autocast_dtype(q)
    if region is not None:
        q, k, v = cast_inputs(paged.dtype, q.device.type, q, k, v)
    out = static_decode_step(
        q.contiguous(),
        paged,
        k,
        v,
        softmax_scale=check_softmax_scale(scaling, q.shape[-1]),
        check_room=layer.checks_room,
    )
    return out if region is None else out.to(region)


def reference_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The ``"s2attn_reference"`` implementation: the layer's pattern on the dense token mask,
    over the whole context a transformers cache returns (not for :class:`S2Cache`). Under
    ``torch.autocast`` it casts as ``"s2attn"`` does: q/k/v to the region's dtype, computed in
    float32 with autocast off, the output in the region's dtype."""
    _check_module(module, dropout)
    if getattr(key, "_s2attn_cache_layer", None) is not None:
        raise ValueError(f"{REFERENCE_IMPLEMENTATION!r} needs a cache that returns every key")
    return _reference_attention(module, query, key, value, attention_mask, scaling), None


@autocast_entry("query", "key", "value")
def _reference_attention(module, query, key, value, attention_mask, scaling) -> torch.Tensor:
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    pattern = _module_pattern(module)
    return _attend_context(attention_reference, q, k, v, pattern, attention_mask, scaling)


LLAMA_ARCHITECTURE = "LlamaForCausalLM"
# The architecture an HHST checkpoint declares (see _saving_attention_choice).
HHST_ARCHITECTURE = "S2LlamaForCausalLM"


def _saving_attention_choice(to_dict):
    """Wrap ``PreTrainedConfig.to_dict`` so that a config carrying s2attn settings also writes its
    attention implementation (``"attn_implementation"``), which transformers reads back when it
    loads the config. transformers itself never serializes that choice; without this, a model
    saved with ``save_pretrained`` would come back from ``from_pretrained`` with SDPA layers."""

    @functools.wraps(to_dict)
    def with_attention_choice(self) -> dict:
        out = to_dict(self)
        chosen = self.__dict__.get("_attn_implementation_internal")
        if CONFIG_KEY in out and chosen in (ATTN_IMPLEMENTATION, REFERENCE_IMPLEMENTATION):
            out["attn_implementation"] = chosen
        unnamed_llama = out.get("architectures") is None and out.get("model_type") == "llama"
        if CONFIG_KEY in out and (
            unnamed_llama or out.get("architectures") == [LLAMA_ARCHITECTURE]
        ):
            # Servers that pick the model by this name (vLLM) then refuse an HHST checkpoint
            # without s2attn's plugin, rather than serve it as a dense Llama: a different model.
            # A config saved alone names nothing, and vLLM would take it for its own Llama.
            # transformers picks the class by model_type and ignores it.
            out["architectures"] = [HHST_ARCHITECTURE]
        return out

    with_attention_choice.s2attn_wrapped = True
    return with_attention_choice


def padding_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    *args,
    attention_mask: torch.Tensor | None = None,
    **kwargs,
):
    """The mask hook: transformers' flash-attention one (the 2-D padding mask, or None when
    nothing is padded), except under ``torch.compile``, where whether anything is padded is data
    and a branch on it would break the graph: there the 2-D mask goes to the attention as is.

    A static cache asks for masks of its fixed length (``kv_length`` past the mask's): the mask is
    then left-padded with padding to that length, so a compiled decode step sees one shape at
    every step (a growing one would retrace, and re-record CUDA graphs, per token). Left padding
    leaves what the attention reads unchanged: the real tokens at the end of each row. Such a
    mask is always handed on, even without padding, because deciding would read it on the host
    at every step."""
    if attention_mask is not None and attention_mask.dim() == 2:
        missing = kv_length - attention_mask.shape[-1]
        if missing > 0:
            pad = attention_mask.new_zeros(attention_mask.shape[0], missing)
            return torch.cat([pad, attention_mask], dim=1)
    if attention_mask is not None and torch.compiler.is_compiling():
        return attention_mask[:, -kv_length:]
    return flash_attention_mask(
        batch_size, q_length, kv_length, *args, attention_mask=attention_mask, **kwargs
    )


def register() -> None:
    """Register both implementations (done on import; idempotent). The padding-mask hook hands
    the attention a 2-D mask only when some token is padding. Configs made by :func:`configure`
    save their attention choice, so ``from_pretrained`` restores the S2 layers with no extra call
    once this module is imported."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, attention_forward)
    AttentionInterface.register(REFERENCE_IMPLEMENTATION, reference_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, padding_mask)
    AttentionMaskInterface.register(REFERENCE_IMPLEMENTATION, padding_mask)
    if not getattr(PreTrainedConfig.to_dict, "s2attn_wrapped", False):
        PreTrainedConfig.to_dict = _saving_attention_choice(PreTrainedConfig.to_dict)


register()
