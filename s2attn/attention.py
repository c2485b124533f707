"""The functional entry point: validation, then the autograd Functions over the call's plan
(eager, ``s2attn.plan``) or the registered operator (under ``torch.compile``,
``s2attn.compile``), and exact merging.

Everything a user calls goes through here; nothing above this module touches Triton.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from .compile import attention_forward, pattern_key
from .input_checks import check_cu_seqlens, check_heads, check_softmax_scale, check_tensor
from .pattern import BlockPattern
from .plan import AttentionPlan, Varlen
from .precision import autocast_entry

__all__ = ["merge_partials", "sparse_attention", "sparse_attention_qkvpacked"]

_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_MIN_HEAD_DIM, _MAX_HEAD_DIM = 16, 256


def _validate(
    q, k, v, pattern, softmax_scale, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k
):
    """Check every user input; return (packed, seq_q lengths, seq_k lengths, scale, query heads
    per pattern head)."""
    packed = _check_tensors(q, k, v, pattern, cu_seqlens_q, cu_seqlens_k)
    q_heads_per_pattern_head = check_heads(q, k, pattern.num_heads)
    if packed and torch.compiler.is_compiling():
        # Offsets are data: reading them here would break the graph. The operator reads the
        # longest lengths at run time; lengths past the pattern are not checked.
        for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
            if not isinstance(cu, torch.Tensor) or cu.dtype != torch.int32 or cu.dim() != 1:
                raise ValueError(f"{name} must be a 1-D int32 tensor for packed (3-D) inputs")
        scale = check_softmax_scale(softmax_scale, q.shape[-1])
        return packed, [max_seqlen_q], [max_seqlen_k], scale, q_heads_per_pattern_head
    if packed:
        lens_q, lens_k = _packed_lengths(
            q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k
        )
    else:
        lens_q, lens_k = [q.shape[1]], [k.shape[1]]
    for i, (sq, sk) in enumerate(zip(lens_q, lens_k)):
        if sq > sk:
            raise ValueError(
                f"sequence {i}: seq_q ({sq}) must be <= seq_k ({sk}); queries are aligned "
                "bottom-right to the keys"
            )
    if max(lens_k) > pattern.max_seq_len:
        raise ValueError(
            f"sequence length {max(lens_k)} exceeds the pattern's max_seq_len "
            f"{pattern.max_seq_len} ({pattern.num_q_blocks} x {pattern.num_kv_blocks} blocks of "
            f"{pattern.block_size})"
        )
    scale = check_softmax_scale(softmax_scale, q.shape[-1])
    return packed, lens_q, lens_k, scale, q_heads_per_pattern_head


def _check_tensors(q, k, v, pattern, cu_seqlens_q, cu_seqlens_k) -> bool:
    """Check the tensors' types, dtypes, devices and shapes and the pattern's type; return whether
    the inputs are packed (3-D)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t)
    if not isinstance(pattern, BlockPattern):
        raise TypeError(f"pattern must be an s2attn.BlockPattern, got {type(pattern).__name__}")
    if q.dtype not in _SUPPORTED_DTYPES:
        raise TypeError(
            f"q has dtype {q.dtype}; supported: float16, bfloat16, float32 "
            "(and float64, for gradcheck)"
        )
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise TypeError(f"{name} has dtype {t.dtype} but q has {q.dtype}; they must match")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}; they must match")

    packed = q.dim() == 3
    if packed:
        for name, t in (("k", k), ("v", v)):
            if t.dim() != 3:
                raise ValueError(
                    f"q is packed (total, heads, dim) but {name} has {t.dim()} dims, expected 3"
                )
    else:
        if q.dim() != 4:
            raise ValueError(
                f"q must be (batch, seq, heads, dim) or packed (total, heads, dim), "
                f"got shape {tuple(q.shape)}"
            )
        for name, t in (("k", k), ("v", v)):
            if t.dim() != 4:
                raise ValueError(
                    f"q is (batch, seq, heads, dim) but {name} has shape {tuple(t.shape)}"
                )
            if t.shape[0] != q.shape[0]:
                raise ValueError(f"{name} has batch {t.shape[0]} but q has batch {q.shape[0]}")
        if cu_seqlens_q is not None or cu_seqlens_k is not None:
            raise ValueError("cu_seqlens_q/cu_seqlens_k are only for packed (3-D) inputs")
    if k.shape != v.shape:
        raise ValueError(
            f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}"
        )
    head_dim = q.shape[-1]
    if k.shape[-1] != head_dim:
        raise ValueError(f"k/v head dim {k.shape[-1]} differs from q's {head_dim}")
    if not _MIN_HEAD_DIM <= head_dim <= _MAX_HEAD_DIM:
        raise ValueError(f"head dim must be in [{_MIN_HEAD_DIM}, {_MAX_HEAD_DIM}], got {head_dim}")
    return packed


def _packed_lengths(
    q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k
) -> tuple[list[int], list[int]]:
    """The packed sequences' query and key lengths, from checked offsets and bounds."""
    cq = check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.shape[0], q.device)
    ck = check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, k.shape[0], q.device)
    if len(cq) != len(ck):
        raise ValueError(
            f"cu_seqlens_q has {len(cq) - 1} sequences but cu_seqlens_k has {len(ck) - 1}"
        )
    lens_q = [b - a for a, b in zip(cq, cq[1:])]
    lens_k = [b - a for a, b in zip(ck, ck[1:])]
    for name, given, lens in (
        ("max_seqlen_q", max_seqlen_q, lens_q),
        ("max_seqlen_k", max_seqlen_k, lens_k),
    ):
        if given is not None and given < max(lens):
            raise ValueError(f"{name}={given} is below the longest sequence, {max(lens)}")
    return lens_q, lens_k


def _traced_call(
    q, k, v, pattern, scale, q_heads_per_pattern_head, packed, cu_q, cu_k, max_q, max_k
) -> tuple[torch.Tensor, torch.Tensor]:
    """The validated call as ``torch.compile`` traces it: one registered operator
    (``s2attn.compile``), which runs the call's plan (the kernels, or the block-by-block
    reference where no Triton backend runs), with the pattern as a constant key and the packed
    lengths as the operator's own arguments (a compiled varlen call may leave the longest
    lengths to run time).

    Eager calls skip the operator's dispatch (some microseconds of host time per call) and apply
    the autograd Functions below to the same plan."""
    return attention_forward(
        q,
        k,
        v,
        pattern_key(pattern),
        scale,
        q_heads_per_pattern_head,
        cu_q,
        cu_k,
        max_q if packed else None,
        max_k if packed else None,
    )


class _SparseAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, plan: AttentionPlan):
        out, lse = plan.forward(q, k, v)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan = plan
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    @once_differentiable  # no double backward: asking for one raises instead of giving zeros
    def backward(ctx, grad_out, grad_lse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ctx.plan.backward(grad_out, grad_lse, q, k, v, out, lse)
        return dq, dk, dv, None


class _PackedQKVFunction(torch.autograd.Function):
    """q, k, v as slices of one (..., 3, heads, dim) tensor; the gradient comes back as one tensor
    of that shape, written slice by slice by the kernels (no concatenation copy)."""

    @staticmethod
    def forward(ctx, qkv, plan: AttentionPlan):
        q, k, v = qkv.unbind(-3)
        out, lse = plan.forward(q, k, v)
        ctx.save_for_backward(qkv, out, lse)
        ctx.plan = plan
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    @once_differentiable  # no double backward: asking for one raises instead of giving zeros
    def backward(ctx, grad_out, grad_lse):
        qkv, out, lse = ctx.saved_tensors
        dqkv = torch.empty_like(qkv)
        dq, dk, dv = dqkv.unbind(-3)
        ctx.plan.backward(grad_out, grad_lse, *qkv.unbind(-3), out, lse, dq=dq, dk=dk, dv=dv)
        return dqkv, None


@autocast_entry("q", "k", "v")
def sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pattern: BlockPattern,
    *,
    softmax_scale: float | None = None,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Block-sparse attention under ``pattern``, by a Triton kernel that skips the dropped blocks.

    Args:
        q: (batch, seq_q, heads, dim), or packed (total_q, heads, dim) with ``cu_seqlens_q``.
            float16, bfloat16 or float32 (see *Precision* below); dim from 16 to 256. Any strides
            (e.g. slices of a packed qkv tensor) are read in place.
        k, v: (batch, seq_k, kv_heads, dim), or packed (total_k, kv_heads, dim); ``heads`` must be a
            multiple of ``kv_heads`` (GQA/MQA). Same dtype and device as q (outside autocast).
        pattern: a :class:`s2attn.BlockPattern` with ``heads`` or ``kv_heads`` heads, covering
            ``seq_k`` (its top-left corner serves shorter sequences).
        softmax_scale: defaults to ``1 / sqrt(dim)``.
        cu_seqlens_q, cu_seqlens_k: int32 (batch + 1,) cumulative sequence lengths of packed
            inputs.
        max_seqlen_q, max_seqlen_k: optional bounds on the packed lengths (checked if given).
        return_lse: also return the float32 natural-log LSE per row.

    Queries are aligned bottom-right when seq_q < seq_k (the last query sees the last key). A row
    that attends nothing gets output 0 and LSE -inf.

    Precision: inside a ``torch.autocast`` region for the inputs' device, q, k and v are cast to
    the region's dtype (float16 or bfloat16) as ``scaled_dot_product_attention``'s are (float64
    stays), so their dtypes may differ there; the output comes back in the region's dtype and
    gradients reach float32 inputs in float32. Outside autocast, float32 inputs take the float32
    kernels, which multiply in exact IEEE float32 on CUDA cores (TF32 would cost three decimal
    digits), not on tensor cores: on a GPU they run some 20x slower than bfloat16 or float16.
    Train with bfloat16 weights, or float32 weights under ``torch.autocast``.

    Returns:
        ``out`` shaped like q, in q's dtype (the autocast dtype inside a region); with
        ``return_lse`` also the float32 ``lse`` (batch, heads, seq_q), or (heads, total_q) for
        packed inputs.

    Example::

        >>> pattern = s2attn.local_stride_pattern(
        ...     32, max_seq_len=8192, block_size=64, local_blocks=16, vert_stride=16
        ... )
        >>> q, k, v = (torch.randn(1, 8192, 32, 128, device="cuda", dtype=torch.bfloat16)
        ...            for _ in range(3))
        >>> out = s2attn.sparse_attention(q, k, v, pattern)
    """
    # Under autocast (the decorator) the inputs arrive cast, before validation: mixed dtypes
    # are then fine, as for SDPA.
    packed, lens_q, lens_k, scale, q_heads_per_pattern_head = _validate(
        q, k, v, pattern, softmax_scale, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k
    )
    if torch.compiler.is_compiling():
        out, lse = _traced_call(
            q,
            k,
            v,
            pattern,
            scale,
            q_heads_per_pattern_head,
            packed,
            cu_seqlens_q,
            cu_seqlens_k,
            max_seqlen_q,
            max_seqlen_k,
        )
    else:
        lengths = Varlen(cu_seqlens_q, cu_seqlens_k, max(lens_q), max(lens_k)) if packed else None
        plan = AttentionPlan(pattern, scale, q_heads_per_pattern_head, lengths)
        out, lse = _SparseAttentionFunction.apply(q, k, v, plan)
    return (out, lse) if return_lse else out


@autocast_entry("qkv")
def sparse_attention_qkvpacked(
    qkv: torch.Tensor,
    pattern: BlockPattern,
    *,
    softmax_scale: float | None = None,
    cu_seqlens: torch.Tensor | None = None,
    max_seqlen: int | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """:func:`sparse_attention` on a packed qkv tensor, whose gradient comes back packed.

    Args:
        qkv: (batch, seq, 3, heads, dim), or (total, 3, heads, dim) with ``cu_seqlens``; q, k, v
            are read in place from its three slices.
        pattern, softmax_scale, return_lse: as for :func:`sparse_attention`.
        cu_seqlens, max_seqlen: int32 (batch + 1,) cumulative lengths for packed sequences, and an
            optional bound on the longest.

    Returns ``out`` (batch, seq, heads, dim) or (total, heads, dim), and with ``return_lse`` the
    LSE. ``qkv.grad`` is written by the backward kernels slice by slice, with no concatenation.
    Under ``torch.autocast`` qkv is cast to the region's dtype, as in :func:`sparse_attention`,
    and its gradient comes back in qkv's own dtype.

    Example::

        >>> qkv = torch.randn(2, 4096, 3, 16, 128, device="cuda", dtype=torch.bfloat16,
        ...                   requires_grad=True)
        >>> out = s2attn.sparse_attention_qkvpacked(qkv, pattern)
        >>> out.sum().backward()
    """
    # Under autocast the cast made one new packed tensor, so the kernels still write its gradient
    # slice by slice, and the cast's backward takes it to qkv's dtype.
    check_tensor("qkv", qkv)
    if qkv.dim() not in (4, 5) or qkv.shape[-3] != 3:
        raise ValueError(
            "qkv must be (batch, seq, 3, heads, dim) or packed (total, 3, heads, dim), "
            f"got shape {tuple(qkv.shape)}"
        )
    q, k, v = qkv.unbind(-3)
    packed, lens_q, lens_k, scale, q_heads_per_pattern_head = _validate(
        q, k, v, pattern, softmax_scale, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen
    )
    if torch.compiler.is_compiling():
        # The gradient comes back as three tensors that autograd stacks into qkv's (a copy the
        # eager path's slice-by-slice writes avoid).
        out, lse = _traced_call(
            q,
            k,
            v,
            pattern,
            scale,
            q_heads_per_pattern_head,
            packed,
            cu_seqlens,
            cu_seqlens,
            max_seqlen,
            max_seqlen,
        )
    else:
        lengths = Varlen(cu_seqlens, cu_seqlens, max(lens_q), max(lens_k)) if packed else None
        plan = AttentionPlan(pattern, scale, q_heads_per_pattern_head, lengths)
        out, lse = _PackedQKVFunction.apply(qkv, plan)
    return (out, lse) if return_lse else out


def merge_partials(
    outs: list[torch.Tensor] | tuple[torch.Tensor, ...],
    lses: list[torch.Tensor] | tuple[torch.Tensor, ...],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge attention results computed over disjoint KV chunks into the result over their union.

    Args:
        outs: outputs of the chunks, each (batch, seq_q, heads, dim) or packed
            (total_q, heads, dim).
        lses: their float32 LSEs, each (batch, heads, seq_q) or (heads, total_q), as returned by
            ``sparse_attention(..., return_lse=True)``.

    Returns ``(out, lse)``: out in the dtype of ``outs``, lse float32. Rows that attend nothing in
    every chunk keep output 0 and LSE -inf. Differentiable.

    Example::

        >>> # Split the pattern's KV blocks into two disjoint patterns over the same keys:
        >>> first = torch.arange(pattern.num_kv_blocks) < pattern.num_kv_blocks // 2
        >>> p1 = s2attn.BlockPattern(pattern.mask & first, pattern.block_size)
        >>> p2 = s2attn.BlockPattern(pattern.mask & ~first, pattern.block_size)
        >>> o1, l1 = sparse_attention(q, k, v, p1, return_lse=True)
        >>> o2, l2 = sparse_attention(q, k, v, p2, return_lse=True)
        >>> out, lse = merge_partials([o1, o2], [l1, l2])  # == sparse_attention(q, k, v, pattern)
    """
    if len(outs) == 0 or len(outs) != len(lses):
        raise ValueError(
            f"need one LSE per output and at least one of each, got {len(outs)} outs and "
            f"{len(lses)} lses"
        )
    for i, (o, lse) in enumerate(zip(outs, lses)):
        if o.shape != outs[0].shape:
            raise ValueError(
                f"outs[{i}] has shape {tuple(o.shape)}, outs[0] {tuple(outs[0].shape)}"
            )
        expected = (
            (o.shape[1], o.shape[0]) if o.dim() == 3 else (o.shape[0], o.shape[2], o.shape[1])
        )
        if o.dim() not in (3, 4) or tuple(lse.shape) != expected:
            raise ValueError(
                f"lses[{i}] has shape {tuple(lse.shape)}; for an output of shape "
                f"{tuple(o.shape)} expected {expected}"
            )
    stacked = torch.stack([lse.float() for lse in lses])
    # Rows empty everywhere: logsumexp's gradient there is exp(-inf - -inf) = NaN even when unused,
    # so take it over zeros and put -inf back; subtract 0 so exp(-inf - 0) = 0 weights, not NaN.
    empty = (stacked == float("-inf")).all(dim=0)
    lse = torch.logsumexp(stacked.masked_fill(empty, 0.0), dim=0).masked_fill(empty, float("-inf"))
    weights = torch.exp(stacked - lse.masked_fill(empty, 0.0))
    out = sum(w.transpose(-1, -2).unsqueeze(-1) * o.float() for w, o in zip(weights, outs))
    return out.to(outs[0].dtype), lse
