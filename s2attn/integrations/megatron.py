"""Megatron-core: an S2 core-attention module and GPT layer specs with HHST layers.

Importing this module imports megatron-core (``import s2attn`` alone never does). Megatron builds
its layers from ``ModuleSpec``s; :func:`get_hhst_layer_spec` returns the local (Transformer-Engine
free) GPT layer spec with :class:`S2CoreAttention` as every layer's ``core_attention``. The module
reads its (global, 1-based) ``layer_number`` to pick its pattern: the S2 pattern, or a dense one in
the layers named dense. One spec thus serves every layer under pipeline parallelism, and dense
layers also run s2attn's kernels (a dense pattern): Megatron's own ``DotProductAttention``
materialises the (batch, heads, seq, seq) scores, needs CUDA and refuses packed sequences.

Example::

    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig
    from s2attn.integrations import megatron as s2mc

    config = TransformerConfig(num_layers=16, hidden_size=2048, num_attention_heads=16,
                               num_query_groups=4, attention_dropout=0.0, bf16=True, ...)
    spec = s2mc.get_hhst_layer_spec(config, max_seq_len=32768, dense_layers=[0, 8],
                                    block_size=64, local_blocks=16, vert_stride=16)
    model = GPTModel(config, spec, vocab_size=32000, max_sequence_length=32768)

Tensor parallelism: tensor-parallel rank ``r`` of ``t`` holds query heads
``[r * heads / t, (r + 1) * heads / t)`` (also when Megatron replicates KV heads because there are
fewer KV heads than ranks), and takes that head range of the layer's pattern, so the model computes
the same function at every tensor-parallel size. Packed sequences (``PackedSeqParams`` with
``qkv_format="thd"``) run s2attn's varlen path. Masks: causal attention (``AttnMaskType.causal``,
``causal_bottom_right``, ``padding_causal`` with packed sequences) with no mask tensor or with
exactly the causal mask (Megatron's convention: True marks a masked-out pair), and bidirectional
attention (``no_mask``, or ``padding`` with no mask tensor). Anything else (a padding mask, an
arbitrary dense mask, attention bias, attention dropout in training, sliding windows, softmax
offsets, packed sequences under context parallelism) raises an error naming it rather than
being ignored.

Context parallelism: Megatron gives context-parallel rank ``r`` of ``W`` chunks ``r`` and
``2W - 1 - r`` of the sequence's ``2W``, the layout :mod:`s2attn.distributed` takes, so each S2
layer runs :func:`s2attn.distributed.context_parallel_attention` over the context-parallel group:
a rank receives only the K/V tokens its pattern rows read.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import weakref
from collections.abc import Sequence

import torch

try:
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.attention import SelfAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.module import MegatronModule
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_config import TransformerConfig
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "s2attn.integrations.megatron needs megatron-core >= 0.16: pip install 's2attn[megatron]'"
    ) from exc

from ..attention import sparse_attention
from ..distributed import context_parallel_attention, shard
from ..pattern import BlockPattern, dense_pattern
from ..reference import attention_reference
from ..stack import S2Settings, settings_with

__all__ = [
    "S2CoreAttention",
    "S2Settings",
    "get_hhst_layer_spec",
    "layer_pattern",
    "tp_head_range",
]

_CAUSAL_TYPES = (AttnMaskType.causal, AttnMaskType.causal_bottom_right, AttnMaskType.padding_causal)
_BIDIRECTIONAL_TYPES = (AttnMaskType.no_mask, AttnMaskType.padding)
_SUPPORTED_TYPES = _CAUSAL_TYPES + _BIDIRECTIONAL_TYPES


def tp_head_range(num_heads: int, tp_rank: int, tp_size: int) -> slice:
    """The query heads tensor-parallel rank ``tp_rank`` of ``tp_size`` holds, as a slice.

    Megatron splits the heads into ``tp_size`` consecutive equal ranges; a head count that does not
    divide by ``tp_size`` raises ``ValueError``.
    """
    if not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"tp_size must be an integer >= 1, got {tp_size!r}")
    if not isinstance(tp_rank, int) or not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank must be an integer in [0, {tp_size}), got {tp_rank!r}")
    if num_heads % tp_size:
        raise ValueError(
            f"the pattern's {num_heads} heads do not divide by the tensor-parallel size "
            f"{tp_size}: every rank must hold the same number of heads"
        )
    per_rank = num_heads // tp_size
    return slice(tp_rank * per_rank, (tp_rank + 1) * per_rank)


@functools.lru_cache(maxsize=32)
def _full_pattern(
    settings: S2Settings,
    max_seq_len: int,
    dense: bool,
    num_heads: int,
    num_kv_heads: int,
    causal: bool,
) -> BlockPattern:
    if dense:
        return dense_pattern(
            num_heads, max_seq_len=max_seq_len, block_size=settings.block_size, causal=causal
        )
    return settings.pattern(
        num_heads, max_seq_len=max_seq_len, num_kv_heads=num_kv_heads, causal=causal
    )


@functools.lru_cache(maxsize=64)
def _rank_pattern(
    settings: S2Settings,
    max_seq_len: int,
    dense: bool,
    num_heads: int,
    num_kv_heads: int,
    causal: bool,
    tp_rank: int,
    tp_size: int,
) -> BlockPattern:
    # Cached so that every layer of a kind on a rank holds the same object, and with it one set of
    # compiled layouts (the layout cache is keyed on the pattern object).
    heads = tp_head_range(num_heads, tp_rank, tp_size)
    full = _full_pattern(settings, max_seq_len, dense, num_heads, num_kv_heads, causal)
    return full if tp_size == 1 else full[heads]


def layer_pattern(
    settings: S2Settings,
    layer_number: int,
    num_heads: int,
    num_kv_heads: int,
    *,
    max_seq_len: int,
    causal: bool = True,
    tp_rank: int = 0,
    tp_size: int = 1,
) -> BlockPattern:
    """The pattern of Megatron layer ``layer_number`` (1-based) for one tensor-parallel rank.

    Returns a pattern over the rank's ``num_heads / tp_size`` query heads: the rank's head range
    of the S2 pattern (or of a dense pattern in ``settings.dense_layers``, 0-based indices: layer
    index ``layer_number - 1``) built for all heads over ``max_seq_len`` tokens.
    """
    if not isinstance(settings, S2Settings):
        raise TypeError(f"settings must be an S2Settings, got {type(settings).__name__}")
    if not isinstance(layer_number, int) or layer_number < 1:
        raise ValueError(f"layer_number must be an integer >= 1 (1-based), got {layer_number!r}")
    dense = (layer_number - 1) in settings.dense_layers
    return _rank_pattern(
        settings, max_seq_len, dense, num_heads, num_kv_heads, causal, tp_rank, tp_size
    )


def _cp_group(pg_collection, size: int):
    """The context-parallel group of ``size`` ranks, as Megatron's SelfAttention sees it."""
    group = getattr(pg_collection, "cp", None) if pg_collection is not None else None
    if group is None and parallel_state.model_parallel_is_initialized():
        group = parallel_state.get_context_parallel_group()
    if group is None or group.size() != size:
        raise ValueError(
            f"config.context_parallel_size={size}, but no context-parallel group of that size is "
            "set up (parallel_state.initialize_model_parallel(context_parallel_size=...) or "
            "pg_collection.cp)"
        )
    return group


def _tp_rank_and_size(pg_collection) -> tuple[int, int]:
    """The tensor-parallel group's (rank, size), as Megatron's SelfAttention sees it."""
    group = getattr(pg_collection, "tp", None) if pg_collection is not None else None
    if group is None and parallel_state.model_parallel_is_initialized():
        group = parallel_state.get_tensor_model_parallel_group()
    if group is None:
        return 0, 1  # no model parallelism set up: a single process holds every head
    return group.rank(), group.size()


def _check_config(config: TransformerConfig) -> None:
    """Refuse the config's attention options that S2CoreAttention does not implement."""
    softmax_type = getattr(config, "softmax_type", "vanilla")
    if softmax_type != "vanilla":
        raise NotImplementedError(
            f"S2CoreAttention supports config.softmax_type='vanilla' only, got {softmax_type!r}"
        )
    if getattr(config, "window_size", None) is not None:
        raise NotImplementedError(
            f"S2CoreAttention does not take config.window_size={config.window_size}: "
            "the S2 pattern's local window is S2Settings.local_blocks"
        )
    if getattr(config, "qk_clip", False):
        raise NotImplementedError("S2CoreAttention does not report attention logits for qk_clip")


def _is_causal(attn_mask_type: AttnMaskType) -> bool:
    """Whether a supported mask type is causal; NotImplementedError naming the others."""
    if attn_mask_type in _CAUSAL_TYPES:
        return True
    if attn_mask_type in _BIDIRECTIONAL_TYPES:
        return False
    raise NotImplementedError(
        f"S2CoreAttention cannot express attn_mask_type={attn_mask_type} as a block "
        f"pattern; supported: {', '.join(t.name for t in _SUPPORTED_TYPES)}"
    )


class S2CoreAttention(MegatronModule):
    """S2 block-sparse attention as the ``core_attention`` submodule of Megatron's SelfAttention.

    Built by Megatron from a ``ModuleSpec`` (see :func:`get_hhst_layer_spec`) with the arguments
    of its ``DotProductAttention`` plus:

    * ``s2``: the :class:`~s2attn.stack.S2Settings` (the S2 pattern, the dense layers' 0-based
      indices; Megatron's ``layer_number`` is 1-based).
    * ``max_seq_len``: the longest sequence the patterns cover (per packed sequence).
    * ``num_query_groups``: the model's KV heads. Megatron hands core attention a config whose
      ``num_query_groups`` is raised to the tensor-parallel size when there are fewer KV heads
      than ranks; the patterns' GQA grouping follows this number instead, so the model is the
      same function at every tensor-parallel size. None: the config's.
    * ``reference``: compute with :func:`s2attn.attention_reference` on the dense token mask
      instead of the kernels (exact and slow: for tests).

    Holds no weights.

    ``forward(query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
    packed_seq_params=None)`` takes Megatron's layouts:

    * sbhd: query (seq_q, batch, heads, dim), key/value (seq_k, batch, kv_heads, dim) -> output
      (seq_q, batch, heads * dim); queries sit bottom-right when seq_q < seq_k.
    * thd (``packed_seq_params.qkv_format == "thd"``): query (total_q, heads, dim), key/value
      (total_k, kv_heads, dim) with ``cu_seqlens_q``/``cu_seqlens_kv`` (the ``*_padded`` offsets
      when given, causal only: padding sits at the end of each sequence, where causal rows never
      see it) -> output (total_q, heads * dim). Tokens past the last offset get output 0.

    ``heads``/``kv_heads`` are this tensor-parallel rank's. float16, bfloat16 or float32.
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection=None,
        *,
        s2: S2Settings,
        max_seq_len: int,
        num_query_groups: int | None = None,
        reference: bool = False,
    ):
        super().__init__(config=config)
        if not isinstance(s2, S2Settings):
            raise TypeError(f"s2 must be an S2Settings, got {type(s2).__name__}")
        if attention_type != "self":
            raise NotImplementedError(
                "S2CoreAttention supports self-attention only, got "
                f"attention_type={attention_type!r}"
            )
        # Megatron's context parallelism gives rank r chunks r and 2W - 1 - r of the sequence's
        # 2W, the layout s2attn.distributed takes: each rank receives only the K/V its pattern
        # rows read.
        self.cp_group = None
        if config.context_parallel_size != 1:
            self.cp_group = _cp_group(pg_collection, config.context_parallel_size)
        _check_config(config)
        causal = _is_causal(attn_mask_type)

        self.s2 = s2
        self.reference = reference
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.softmax_scale = softmax_scale  # None: 1 / sqrt(head dim), as DotProductAttention
        # apply_query_key_layer_scaling divides the scale by layer_number and multiplies the
        # scores back in fp32 inside Megatron's softmax: the same softmax, so it is not applied.
        self.dropout_p = (
            config.attention_dropout if attention_dropout is None else attention_dropout
        )
        self.tp_rank, self.tp_size = _tp_rank_and_size(pg_collection)
        num_heads = config.num_attention_heads
        num_kv_heads = num_query_groups or config.num_query_groups or num_heads
        self.is_dense = (self.layer_number - 1) in s2.dense_layers
        self.pattern = layer_pattern(
            s2,
            self.layer_number,
            num_heads,
            num_kv_heads,
            max_seq_len=max_seq_len,
            causal=causal,
            tp_rank=self.tp_rank,
            tp_size=self.tp_size,
        )
        # The last attention_mask tensor found to be exactly causal, and its version: Megatron
        # passes one mask to every layer, so it is compared with the causal mask once per step.
        self._checked_mask: weakref.ref | None = None
        self._checked_version = -1

    def extra_repr(self) -> str:
        kind = "dense" if self.is_dense else "s2"
        return (
            f"layer_number={self.layer_number}, {kind}, tp_rank={self.tp_rank}/{self.tp_size}, "
            f"{self.pattern!r}"
        )

    # --------------------------------------------------------------------------- masks
    def _check_mask(
        self, mask: torch.Tensor, causal: bool, seq_q: int, seq_k: int, sharded: bool = False
    ) -> None:
        """Accept a mask tensor only when it adds nothing to the pattern's own masking. With
        ``sharded`` (context parallelism) the queries are this rank's shard of the keys."""
        if not isinstance(mask, torch.Tensor):
            raise TypeError(f"attention_mask must be a torch.Tensor or None, got {type(mask)}")
        if mask.dtype != torch.bool:
            raise NotImplementedError(
                f"S2CoreAttention takes boolean attention masks (True = masked out), got an "
                f"attention_mask of dtype {mask.dtype}"
            )
        if mask.dim() != 4 or tuple(mask.shape[-2:]) != (seq_q, seq_k):
            raise ValueError(
                f"attention_mask must be (batch or 1, heads or 1, {seq_q}, {seq_k}), got shape "
                f"{tuple(mask.shape)}"
            )
        if (
            self._checked_mask is not None
            and self._checked_mask() is mask
            and self._checked_version == mask._version
        ):
            return
        q_pos = torch.arange(seq_q, device=mask.device) + (seq_k - seq_q)
        if sharded:
            q_pos = shard(torch.arange(seq_k, device=mask.device), self.cp_group, seq_dim=0)
        k_pos = torch.arange(seq_k, device=mask.device)
        expected = k_pos[None, :] > q_pos[:, None] if causal else torch.zeros_like(mask[0, 0])
        if not torch.equal(mask, expected.expand_as(mask)):
            what = "the causal mask" if causal else "an all-False mask (no masking)"
            raise NotImplementedError(
                f"S2CoreAttention got an attention_mask that is not {what}: padding or arbitrary "
                "dense masks cannot be expressed as a block pattern and are not ignored; pack "
                "variable-length sequences with PackedSeqParams(qkv_format='thd') instead"
            )
        self._checked_mask = weakref.ref(mask)
        self._checked_version = mask._version

    def _resolve_causal(self, attn_mask_type: AttnMaskType, seq_q: int) -> None:
        causal = _is_causal(attn_mask_type)
        # A single query at the last position sees every key either way (Megatron's inference
        # switches decode steps to no_mask).
        if causal != self.pattern.causal and seq_q > 1:
            built = "causal" if self.pattern.causal else "bidirectional"
            raise NotImplementedError(
                f"this S2CoreAttention was built {built} (attn_mask_type={self.attn_mask_type}), "
                f"but forward got attn_mask_type={attn_mask_type}"
            )

    # --------------------------------------------------------------------------- forward
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
    ) -> torch.Tensor:
        """Attention over Megatron's layouts (see the class docstring); returns (seq_q, batch,
        heads * dim), or (total_q, heads * dim) for packed sequences."""
        if attention_bias is not None:
            raise NotImplementedError("S2CoreAttention does not support attention_bias")
        if self.training and self.dropout_p > 0:
            raise NotImplementedError(
                f"S2CoreAttention has no attention dropout, got p={self.dropout_p} in training: "
                "set TransformerConfig(attention_dropout=0.0)"
            )
        attn_mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        packed = packed_seq_params is not None
        if packed and packed_seq_params.qkv_format != "thd":
            raise NotImplementedError(
                "S2CoreAttention takes packed_seq_params with qkv_format='thd' only, got "
                f"{packed_seq_params.qkv_format!r}"
            )
        if packed and attention_mask is not None:
            raise NotImplementedError(
                "S2CoreAttention takes no attention_mask with packed sequences: cu_seqlens and "
                "the pattern define the masking"
            )
        expected_dims = 3 if packed else 4
        for name, t in (("query", query), ("key", key), ("value", value)):
            if packed and t.dim() == 4 and t.shape[1] == 1:
                continue  # (t, 1, heads, dim): the batch axis Megatron squeezes
            if t.dim() != expected_dims:
                layout = "(total, heads, dim)" if packed else "(seq, batch, heads, dim)"
                raise ValueError(f"{name} must be {layout}, got shape {tuple(t.shape)}")
        heads = query.shape[-2]
        if heads != self.pattern.num_heads:
            raise ValueError(
                f"query has {heads} heads but this rank's pattern has {self.pattern.num_heads} "
                f"(tensor-parallel rank {self.tp_rank} of {self.tp_size})"
            )
        attend = attention_reference if self.reference else sparse_attention
        if packed:
            if self.cp_group is not None:
                # Raised before any collective: every rank of the group gets the same pack, so
                # every rank refuses and none waits for the others.
                raise NotImplementedError(
                    "S2CoreAttention does not take packed sequences (packed_seq_params with "
                    "qkv_format='thd') under context parallelism (context-parallel size "
                    f"{self.cp_group.size()}): s2attn.distributed splits whole sequences over "
                    "the ranks and has no varlen path; run packed sequences with "
                    "context_parallel_size=1, or give equal-length sequences as batch rows"
                )
            return self._forward_packed(
                attend, query, key, value, attn_mask_type, packed_seq_params
            )

        seq_q, seq_k = query.shape[0], key.shape[0]
        self._resolve_causal(attn_mask_type, seq_q)
        if self.cp_group is not None:
            return self._forward_context_parallel(query, key, value, attention_mask)
        if attention_mask is not None:
            self._check_mask(attention_mask, self.pattern.causal, seq_q, seq_k)
        # (seq, batch, heads, dim) -> (batch, seq, heads, dim): a view, read in place by the kernel.
        out = attend(
            query.transpose(0, 1),
            key.transpose(0, 1),
            value.transpose(0, 1),
            self.pattern,
            softmax_scale=self.softmax_scale,
        )
        return out.transpose(0, 1).reshape(seq_q, query.shape[1], -1)

    def _forward_context_parallel(self, query, key, value, attention_mask):
        """This rank's shard of the sequence (Megatron's load-balanced layout) through
        :func:`s2attn.distributed.context_parallel_attention`; a mask tensor must be the causal
        (or, bidirectional, the empty) mask's rows of this rank's queries."""
        local, batch = query.shape[0], query.shape[1]
        if attention_mask is not None:
            seq = local * self.cp_group.size()
            self._check_mask(attention_mask, self.pattern.causal, local, seq, sharded=True)
        out = context_parallel_attention(
            query.transpose(0, 1),
            key.transpose(0, 1),
            value.transpose(0, 1),
            self.pattern,
            group=self.cp_group,
            softmax_scale=self.softmax_scale,
        )
        return out.transpose(0, 1).reshape(local, batch, -1)

    def _forward_packed(self, attend, query, key, value, attn_mask_type, params):
        query, key, value = (t.squeeze(1) if t.dim() == 4 else t for t in (query, key, value))
        self._resolve_causal(attn_mask_type, 2)  # packed: never a lone decode query
        if params.cu_seqlens_q is None or params.cu_seqlens_kv is None:
            raise ValueError("packed_seq_params needs cu_seqlens_q and cu_seqlens_kv")
        # With padded offsets each sequence owns its padding, at its end: causal rows never see
        # it, and the padding rows' own outputs are not used. Bidirectional rows would see it.
        cu_q, cu_k = params.cu_seqlens_q_padded, params.cu_seqlens_kv_padded
        padded = any(
            p is not None and not torch.equal(p, u)
            for p, u in ((cu_q, params.cu_seqlens_q), (cu_k, params.cu_seqlens_kv))
        )
        if padded and not self.pattern.causal:
            raise NotImplementedError(
                "S2CoreAttention takes padded packed sequences (cu_seqlens_*_padded) with causal "
                "attention only: bidirectional rows would attend the padding"
            )
        cu_q = params.cu_seqlens_q if cu_q is None else cu_q
        cu_k = params.cu_seqlens_kv if cu_k is None else cu_k
        cu_q = cu_q.to(device=query.device, dtype=torch.int32)
        cu_k = cu_k.to(device=query.device, dtype=torch.int32)
        total_q, total_k = int(cu_q[-1]), int(cu_k[-1])
        if total_q > query.shape[0] or total_k > key.shape[0]:
            raise ValueError(
                f"cu_seqlens end at {total_q} queries / {total_k} keys, beyond the packed "
                f"tensors' {query.shape[0]} / {key.shape[0]} tokens"
            )
        # Megatron may pad the pack past the last sequence (to a multiple of the TP size): those
        # tokens belong to no sequence and get output 0.
        out = attend(
            query[:total_q],
            key[:total_k],
            value[:total_k],
            self.pattern,
            softmax_scale=self.softmax_scale,
            cu_seqlens_q=cu_q,
            cu_seqlens_k=cu_k,
        )
        out = out.reshape(total_q, -1)
        if total_q < query.shape[0]:
            out = torch.cat([out, out.new_zeros(query.shape[0] - total_q, out.shape[1])])
        return out


def _dense_layer_indices(dense_layers: int | Sequence[int], num_layers: int) -> tuple[int, ...]:
    if isinstance(dense_layers, bool):
        raise TypeError(
            f"dense_layers must be a count or a list of layer indices, got {dense_layers}"
        )
    if isinstance(dense_layers, int):
        if not 0 <= dense_layers <= num_layers:
            raise ValueError(f"dense_layers must be in [0, {num_layers}], got {dense_layers}")
        return tuple(range(dense_layers))
    indices = tuple(sorted(set(dense_layers)))
    if any(
        not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < num_layers for i in indices
    ):
        raise ValueError(
            f"dense_layers must be 0-based layer indices in [0, {num_layers}), got {dense_layers}"
        )
    return indices


def get_hhst_layer_spec(
    config: TransformerConfig,
    *,
    max_seq_len: int,
    settings: S2Settings | None = None,
    dense_layers: int | Sequence[int] | None = None,
    block_size: int | None = None,
    local_blocks: int | None = None,
    vert_stride: int | None = None,
    num_dense_heads: int | None = None,
    homo_head: bool | None = None,
    head_offset: int | None = None,
    base_spec: ModuleSpec | None = None,
    reference: bool = False,
) -> ModuleSpec:
    """A GPT layer spec whose attention is S2 in every layer but the dense ones (HHST).

    Args:
        config: the model's ``TransformerConfig`` (layers, heads, KV heads, tensor-parallel size,
            normalization, qk_layernorm are read from it).
        max_seq_len: the longest sequence (per packed sequence) the patterns cover.
        settings: the :class:`~s2attn.stack.S2Settings`, of any pattern family (default: block
            64, local 16 blocks, stride 16, the first two layers dense); each of the keywords
            below that is given replaces its field.
        dense_layers: 0-based indices of the dense layers, or a count of dense layers from the
            first; the others are S2.
        block_size, local_blocks, vert_stride, num_dense_heads, homo_head, head_offset: the S2
            layers' :func:`s2attn.local_stride_pattern`.
        base_spec: the layer spec whose ``core_attention`` is replaced (copied, not changed);
            defaults to Megatron's local spec ``get_gpt_layer_local_spec`` with the config's
            normalization and qk_layernorm.
        reference: run :func:`s2attn.attention_reference` instead of the kernels (tests).

    Returns a ``ModuleSpec`` for ``GPTModel(config, spec, ...)``. Everything is validated here,
    before any layer is built: the patterns, the layer indices, and that the heads divide by
    ``config.tensor_model_parallel_size``.

    Example::

        >>> spec = get_hhst_layer_spec(config, max_seq_len=8192, dense_layers=[0, 8])
        >>> model = GPTModel(config, spec, vocab_size=32000, max_sequence_length=8192)
    """
    if not isinstance(config, TransformerConfig):
        raise TypeError(f"config must be a megatron TransformerConfig, got {type(config).__name__}")
    if settings is None and dense_layers is None:
        dense_layers = 2
    if dense_layers is not None:
        dense_layers = _dense_layer_indices(dense_layers, config.num_layers)
    settings = settings_with(
        settings,
        dense_layers=dense_layers,
        block_size=block_size,
        local_blocks=local_blocks,
        vert_stride=vert_stride,
        num_dense_heads=num_dense_heads,
        homo_head=homo_head,
        head_offset=head_offset,
    )
    settings.layer_types(config.num_layers)  # the dense layers lie in the stack
    num_kv_heads = config.num_query_groups or config.num_attention_heads
    heads, tp_size = config.num_attention_heads, config.tensor_model_parallel_size
    # Built now: bad settings fail here, not in a layer.
    for dense, rank in itertools.product((False, True), range(tp_size)):
        _rank_pattern(settings, max_seq_len, dense, heads, num_kv_heads, True, rank, tp_size)
    params = {
        "s2": settings,
        "max_seq_len": max_seq_len,
        "num_query_groups": num_kv_heads,
        "reference": reference,
    }
    return _with_core_attention(
        base_spec, config, ModuleSpec(module=S2CoreAttention, params=params)
    )


def _with_core_attention(
    base_spec: ModuleSpec | None, config: TransformerConfig, core: ModuleSpec
) -> ModuleSpec:
    """A copy of ``base_spec`` (default: Megatron's local GPT layer spec for ``config``) whose
    self-attention's core attention is ``core``."""
    if base_spec is None:
        base_spec = get_gpt_layer_local_spec(
            normalization=config.normalization, qk_layernorm=config.qk_layernorm
        )
    attention = getattr(getattr(base_spec, "submodules", None), "self_attention", None)
    if not (
        isinstance(attention, ModuleSpec)
        and isinstance(attention.module, type)
        and issubclass(attention.module, SelfAttention)
        and attention.submodules is not None
    ):
        raise ValueError(
            "base_spec must be a transformer layer spec whose self_attention is a ModuleSpec of "
            f"Megatron's SelfAttention, got {attention!r}"
        )
    spec = _copy_spec(base_spec)
    spec.submodules.self_attention.submodules.core_attention = core
    return spec


def _copy_spec(spec: ModuleSpec) -> ModuleSpec:
    """Copy the spec tree down to the core attention (module classes themselves are shared)."""
    attention = spec.submodules.self_attention
    submodules = dataclasses.replace(spec.submodules)
    submodules.self_attention = dataclasses.replace(
        attention,
        params=dict(attention.params),
        submodules=dataclasses.replace(attention.submodules),
    )
    return dataclasses.replace(spec, submodules=submodules)
