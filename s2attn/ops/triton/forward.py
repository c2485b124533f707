"""Triton forward kernel for block-sparse attention over a compiled layout, and its launcher.

One program computes one query tile (``BLOCK_M`` rows at absolute positions) of one (batch, head).
It walks the tile's KV tiles from the forward layout in two loops chosen at compile time: the
*full* entries with no mask at all, then the *partial* entries with the entry's bit mask, the
causal rule and the key bounds. Layouts built with ``gather=True`` add gathered entries (several
non-contiguous pattern blocks in one KV tile, loaded by pointer): full ones after the full loop,
partial ones after the partial loop; causal layouts gather only blocks wholly before the tile,
so those need their bits but not the causal rule. Scores live in base 2 (``exp2``), scaled once by
``softmax_scale * log2(e)``; the LSE is written in natural log.

The kernel knows layouts and strides only, never patterns.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from ..env import tma_allowed
from ..launcher import launcher_for
from ..layout import TileLayout
from ..options import TritonForwardConfig
from ..shapes import (
    LOG2E,
    Varlen,
    check_k_bounds,
    heads_per_program_group,
    layout_constexprs,
    query_tiles,
    sequence_lengths,
)
from .common import (
    as_batched,
    dot_precision,
    entry_keep,
    gathered_lists,
    lse_strides,
    padded_head_dim,
    program_order,
    sequence_bounds,
)

__all__ = ["default_config", "forward"]


@triton.jit
def _kv_rows(
    k_base, v_base, cols, seq_k, stride_ks, stride_kd, stride_vs, stride_vd,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BOUNDS: tl.constexpr,
):
    """K transposed (BLOCK_D, len(cols)) and V (len(cols), BLOCK_D) at key positions ``cols``
    through pointer loads; zero past the head dim and, when BOUNDS, at or past seq_k."""
    k_ok = cols < seq_k
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    cols64 = cols.to(tl.int64)  # position x stride passes 2^31 in long sequences
    k_ptrs = k_base + cols64[None, :] * stride_ks + offs_d[:, None] * stride_kd
    v_ptrs = v_base + cols64[:, None] * stride_vs + offs_d[None, :] * stride_vd
    # Only the loads that can run past seq_k or the padded head dim carry a mask.
    if BOUNDS:
        if BLOCK_D == HEAD_DIM:
            kt = tl.load(k_ptrs, mask=k_ok[None, :], other=0.0)
            v = tl.load(v_ptrs, mask=k_ok[:, None], other=0.0)
        else:
            kt = tl.load(k_ptrs, mask=k_ok[None, :] & d_ok[:, None], other=0.0)
            v = tl.load(v_ptrs, mask=k_ok[:, None] & d_ok[None, :], other=0.0)
    else:
        if BLOCK_D == HEAD_DIM:
            kt = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
        else:
            kt = tl.load(k_ptrs, mask=d_ok[:, None], other=0.0)
            v = tl.load(v_ptrs, mask=d_ok[None, :], other=0.0)
    return kt, v


@triton.jit
def _kv_tile(
    k_base, v_base, k_desc, v_desc, desc_b, desc_h, n, seq_k,
    stride_ks, stride_kd, stride_vs, stride_vd,
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BOUNDS: tl.constexpr, USE_TMA: tl.constexpr, HOST_DESC: tl.constexpr,
):
    """K transposed and V of KV tile ``n``, by bulk tensor copy (USE_TMA) or pointer loads."""
    if USE_TMA and HOST_DESC:
        # (batch, seq, heads, dim) descriptors made on the host: zero past seq_k and HEAD_DIM.
        kt = tl.trans(k_desc.load([desc_b, n * BLOCK_N, desc_h, 0]).reshape(BLOCK_N, BLOCK_D))
        v = v_desc.load([desc_b, n * BLOCK_N, desc_h, 0]).reshape(BLOCK_N, BLOCK_D)
    elif USE_TMA:
        # The descriptors' shape (seq_k, HEAD_DIM) zero-fills past both without a mask.
        kt = tl.trans(k_desc.load([n * BLOCK_N, 0]))
        v = v_desc.load([n * BLOCK_N, 0])
    else:
        kt, v = _kv_rows(
            k_base, v_base, n * BLOCK_N + tl.arange(0, BLOCK_N), seq_k,
            stride_ks, stride_kd, stride_vs, stride_vd, HEAD_DIM, BLOCK_D, BOUNDS,
        )
    return kt, v


@triton.jit
def _softmax_step(
    acc, l_i, m_i, s, v, qk_scale,
    MAY_BE_EMPTY: tl.constexpr, POS_SCALE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """One online-softmax update with a (masked) score tile ``s``: unscaled when POS_SCALE (the
    row max is scaled once per row and ``exp2(s * qk_scale - m)`` is one FMA per element),
    already scaled otherwise."""
    row_max = tl.max(s, 1)
    if POS_SCALE:
        row_max = row_max * qk_scale
    m_new = tl.maximum(m_i, row_max)
    if MAY_BE_EMPTY:
        # A row with nothing visible so far keeps m = -inf; subtract 0 instead to avoid NaN.
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_ref = m_new
    alpha = tl.math.exp2(m_i - m_ref)
    if POS_SCALE:
        p = tl.math.exp2(s * qk_scale - m_ref[:, None])
    else:
        p = tl.math.exp2(s - m_ref[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(
        p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION, out_dtype=acc.dtype
    )
    return acc, l_i, m_new


@triton.jit
def _attend_entries(
    acc, l_i, m_i, q, cols_ptr, bits_ptr, start, end,
    k_base, v_base, k_desc, v_desc, desc_b, desc_h, stride_ks, stride_kd, stride_vs, stride_vd,
    rows_abs, seq_k, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    ROW_GROUP: tl.constexpr, COL_GROUP: tl.constexpr, BITS_PER_ROW: tl.constexpr,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, CHECK_K_BOUNDS: tl.constexpr,
    POS_SCALE: tl.constexpr, USE_TMA: tl.constexpr, HOST_DESC: tl.constexpr, PAIR: tl.constexpr,
    DOT_PRECISION: tl.constexpr, GATHER: tl.constexpr = False,
):
    """Online softmax over the entries ``start..end`` of one tile's list.

    GATHER entries are gathered KV tiles: ``cols_ptr`` holds BITS_PER_ROW pattern block indices
    per entry (blocks of COL_GROUP keys), loaded by pointer at their own positions.

    MASKED entries apply their bit mask, causality and key bounds; the unmasked loop applies
    nothing unless CHECK_K_BOUNDS (bidirectional tiles whose last KV tile may straddle seq_k).
    PAIR (unmasked loop, pointer loads) gathers two entries' KV tiles into one 2*BLOCK_N-wide
    tile: wider MMAs and half the accumulator rescales, without the waste of 2*BLOCK_N-wide
    layout tiles on the pattern's lone stride blocks. Off by default: it needs 8 warps to fit
    and measured slower on H100 (docs/design.md).
    """
    ACC = acc.dtype
    if PAIR and not GATHER:
        offs_2n = tl.arange(0, 2 * BLOCK_N)
        pair_end = start + (end - start) // 2 * 2
        for e in range(start, pair_end, 2):
            n0 = tl.load(cols_ptr + e)
            n1 = tl.load(cols_ptr + e + 1)
            cols = tl.where(offs_2n < BLOCK_N, n0 * BLOCK_N + offs_2n, (n1 - 1) * BLOCK_N + offs_2n)
            kt, v = _kv_rows(
                k_base, v_base, cols, seq_k, stride_ks, stride_kd, stride_vs, stride_vd,
                HEAD_DIM, BLOCK_D, CHECK_K_BOUNDS,
            )
            s = tl.dot(q, kt, input_precision=DOT_PRECISION, out_dtype=ACC)
            if not POS_SCALE:
                s = s * qk_scale
            if CHECK_K_BOUNDS:
                s = tl.where((cols < seq_k)[None, :], s, float("-inf"))
            acc, l_i, m_i = _softmax_step(
                acc, l_i, m_i, s, v, qk_scale, CHECK_K_BOUNDS, POS_SCALE, DOT_PRECISION
            )
        start = pair_end
    offs_n = tl.arange(0, BLOCK_N)
    for e in range(start, end):
        if GATHER:
            blk = tl.load(cols_ptr + e * BITS_PER_ROW + offs_n // COL_GROUP)
            cols = blk * COL_GROUP + offs_n % COL_GROUP
            # Always bounds-masked loads and scores: with unmasked loads at addresses from the
            # loaded block indices, causal outputs came out wrong on H100 (Triton 3.6; the
            # interpreter was exact), while the masked form of the same loop was exact.
            kt, v = _kv_rows(
                k_base, v_base, cols, seq_k, stride_ks, stride_kd, stride_vs, stride_vd,
                HEAD_DIM, BLOCK_D, True,
            )
        else:
            n = tl.load(cols_ptr + e)
            kt, v = _kv_tile(
                k_base, v_base, k_desc, v_desc, desc_b, desc_h, n, seq_k,
                stride_ks, stride_kd, stride_vs, stride_vd,
                HEAD_DIM, BLOCK_N, BLOCK_D, MASKED or CHECK_K_BOUNDS, USE_TMA, HOST_DESC,
            )
            cols = n * BLOCK_N + offs_n
        s = tl.dot(q, kt, input_precision=DOT_PRECISION, out_dtype=ACC)
        if not POS_SCALE:
            s = s * qk_scale
        if MASKED:
            keep = entry_keep(
                tl.load(bits_ptr + e), BLOCK_M, BLOCK_N, ROW_GROUP, COL_GROUP, BITS_PER_ROW, False
            ) & (cols < seq_k)[None, :]
            if CAUSAL:
                keep = keep & (rows_abs[:, None] >= cols[None, :])
            s = tl.where(keep, s, float("-inf"))
        elif CHECK_K_BOUNDS or GATHER:
            s = tl.where((cols < seq_k)[None, :], s, float("-inf"))
        acc, l_i, m_i = _softmax_step(
            acc, l_i, m_i, s, v, qk_scale, MASKED or CHECK_K_BOUNDS or GATHER, POS_SCALE,
            DOT_PRECISION,
        )
    return acc, l_i, m_i


@triton.jit
def _forward_kernel(
    Q,
    K,
    V,
    Out,
    Lse,
    full_offsets,
    full_cols,
    partial_offsets,
    partial_cols,
    partial_bits,
    gather_full_offsets,
    gather_full_blocks,
    gather_partial_offsets,
    gather_partial_blocks,
    gather_partial_bits,
    cu_seqlens_q,
    cu_seqlens_k,
    K_desc,
    V_desc,
    stride_qb,
    stride_qs,
    stride_qh,
    stride_qd,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_kd,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_vd,
    stride_ob,
    stride_os,
    stride_oh,
    stride_od,
    stride_lb,
    stride_lh,
    stride_ls,
    seqlen_q,
    seqlen_k,
    layout_tiles,
    grid_tiles,
    heads_per_group,
    qk_scale,
    NUM_HEADS: tl.constexpr,
    GQA_GROUP: tl.constexpr,
    Q_HEADS_PER_PATTERN_HEAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ROW_GROUP: tl.constexpr,
    COL_GROUP: tl.constexpr,
    BITS_PER_ROW: tl.constexpr,
    CAUSAL: tl.constexpr,
    VARLEN: tl.constexpr,
    CHECK_K_BOUNDS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    POS_SCALE: tl.constexpr,
    USE_TMA: tl.constexpr,
    PAIR: tl.constexpr,
    Q_IN_REGS: tl.constexpr,
    HOST_DESC: tl.constexpr,
    GATHER: tl.constexpr,
):
    bh, tile_rank = program_order(tl.program_id(0), grid_tiles, heads_per_group)
    b = bh // NUM_HEADS
    h = bh % NUM_HEADS
    q_start, q_len, k_start, k_len = sequence_bounds(
        b, cu_seqlens_q, cu_seqlens_k, seqlen_q, seqlen_k, VARLEN
    )
    # Queries are aligned bottom-right: query row r sits at absolute position r + q_offset.
    q_offset = k_len - q_len
    # Heaviest tiles first: program 0 takes the last tile, whose causal list is the longest.
    tile = (k_len - 1) // BLOCK_M - tile_rank
    if (q_len <= 0) | (tile < q_offset // BLOCK_M):
        return

    rows_abs = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = rows_abs - q_offset
    row_ok = (rows >= 0) & (rows < q_len)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM

    kv_head = h // GQA_GROUP
    q_base = Q + b.to(tl.int64) * stride_qb + q_start * stride_qs + h.to(tl.int64) * stride_qh
    k_base = K + b.to(tl.int64) * stride_kb + k_start * stride_ks + kv_head.to(tl.int64) * stride_kh
    v_base = V + b.to(tl.int64) * stride_vb + k_start * stride_vs + kv_head.to(tl.int64) * stride_vh
    # Row x stride passes 2^31 elements beyond 2^31 / (heads x dim) tokens (1M at 32 x 128).
    rows64 = rows.to(tl.int64)
    q = tl.load(
        q_base + rows64[:, None] * stride_qs + offs_d[None, :] * stride_qd,
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    if Q_IN_REGS:
        # An exact no-op the compiler cannot drop: a dot operand that is not a plain load stays
        # in registers, so the QK^T MMAs read only K from shared memory (half the traffic).
        q = tl.where(row_ok[:, None], q, 0.0)

    group = (h // Q_HEADS_PER_PATTERN_HEAD) * layout_tiles + tile
    if USE_TMA and HOST_DESC:
        k_desc = K_desc
        v_desc = V_desc
    elif USE_TMA:
        # Bulk tensor copies (TMA) for K and V; the launcher checks the strides allow them.
        # Made per program here, since packed sequences need per-sequence bounds.
        k_desc = tl.make_tensor_descriptor(
            k_base, shape=[k_len, HEAD_DIM], strides=[stride_ks, 1], block_shape=[BLOCK_N, BLOCK_D]
        )
        v_desc = tl.make_tensor_descriptor(
            v_base, shape=[k_len, HEAD_DIM], strides=[stride_vs, 1], block_shape=[BLOCK_N, BLOCK_D]
        )
    else:
        k_desc = k_base
        v_desc = v_base

    # Accumulate in the LSE's dtype: float32, or float64 for float64 inputs.
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=Lse.dtype.element_ty)
    l_i = tl.zeros([BLOCK_M], dtype=Lse.dtype.element_ty)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=Lse.dtype.element_ty)
    acc, l_i, m_i = _attend_entries(
        acc, l_i, m_i, q, full_cols, partial_bits,
        tl.load(full_offsets + group), tl.load(full_offsets + group + 1),
        k_base, v_base, k_desc, v_desc, b, kv_head, stride_ks, stride_kd, stride_vs, stride_vd,
        rows_abs, k_len, qk_scale,
        HEAD_DIM, BLOCK_M, BLOCK_N, BLOCK_D, ROW_GROUP, COL_GROUP, BITS_PER_ROW,
        False, CAUSAL, CHECK_K_BOUNDS, POS_SCALE, USE_TMA, HOST_DESC, PAIR, DOT_PRECISION,
    )
    if GATHER:
        acc, l_i, m_i = _attend_entries(
            acc, l_i, m_i, q, gather_full_blocks, gather_partial_bits,
            tl.load(gather_full_offsets + group), tl.load(gather_full_offsets + group + 1),
            k_base, v_base, k_desc, v_desc, b, kv_head, stride_ks, stride_kd, stride_vs, stride_vd,
            rows_abs, k_len, qk_scale,
            HEAD_DIM, BLOCK_M, BLOCK_N, BLOCK_D, ROW_GROUP, COL_GROUP, BITS_PER_ROW,
            False, CAUSAL, CHECK_K_BOUNDS, POS_SCALE, USE_TMA, HOST_DESC, False, DOT_PRECISION,
            True,
        )
    acc, l_i, m_i = _attend_entries(
        acc, l_i, m_i, q, partial_cols, partial_bits,
        tl.load(partial_offsets + group), tl.load(partial_offsets + group + 1),
        k_base, v_base, k_desc, v_desc, b, kv_head, stride_ks, stride_kd, stride_vs, stride_vd,
        rows_abs, k_len, qk_scale,
        HEAD_DIM, BLOCK_M, BLOCK_N, BLOCK_D, ROW_GROUP, COL_GROUP, BITS_PER_ROW,
        True, CAUSAL, CHECK_K_BOUNDS, POS_SCALE, USE_TMA, HOST_DESC, False, DOT_PRECISION,
    )
    if GATHER:
        acc, l_i, m_i = _attend_entries(
            acc, l_i, m_i, q, gather_partial_blocks, gather_partial_bits,
            tl.load(gather_partial_offsets + group), tl.load(gather_partial_offsets + group + 1),
            k_base, v_base, k_desc, v_desc, b, kv_head, stride_ks, stride_kd, stride_vs, stride_vd,
            rows_abs, k_len, qk_scale,
            HEAD_DIM, BLOCK_M, BLOCK_N, BLOCK_D, ROW_GROUP, COL_GROUP, BITS_PER_ROW,
            True, False, CHECK_K_BOUNDS, POS_SCALE, USE_TMA, HOST_DESC, False, DOT_PRECISION,
            True,
        )

    # Rows that attend nothing: output 0 and LSE -inf, never 0/0.
    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = (m_i + tl.math.log2(tl.where(empty, 1.0, l_i))) * 0.6931471805599453  # natural log
    lse = tl.where(empty, float("-inf"), lse)
    o_base = Out + b.to(tl.int64) * stride_ob + q_start * stride_os + h.to(tl.int64) * stride_oh
    tl.store(
        o_base + rows64[:, None] * stride_os + offs_d[None, :] * stride_od,
        out.to(Out.dtype.element_ty),
        mask=row_ok[:, None] & d_ok[None, :],
    )
    l_base = Lse + b.to(tl.int64) * stride_lb + h.to(tl.int64) * stride_lh + q_start * stride_ls
    tl.store(l_base + rows64 * stride_ls, lse, mask=row_ok)


@functools.cache
def default_config(head_dim: int, dtype: torch.dtype) -> TritonForwardConfig:
    """The measured launch for a head dim and dtype (docs/design.md has the measurements).

    H100, 32k, V16, dim 128, bf16 (benchmarks/tuning/sweep_tiles.py): 4 warps and 2 stages beat
    8 warps / 3 stages by 10% at 128x64 tiles; deeper pipelines lost. K/V through bulk tensor
    copies: +8% at 32k, with descriptors made once on the host. One head's tiles at a time
    (``program_order``): +7-10% at 32k. Pairs of KV tiles per step (``pair``) and q as a register
    operand (``q_in_regs``) measured no faster and stay off.
    """
    wide = head_dim > 128 or dtype.itemsize > 2
    return TritonForwardConfig(
        num_warps=8 if wide else 4,
        num_stages=2,
        use_tma=True,
        host_desc=True,
        heads_per_group=1,
        pair=False,
        q_in_regs=False,
    )


def forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    layout: TileLayout,
    *,
    softmax_scale: float,
    q_heads_per_pattern_head: int,
    varlen: Varlen | None,
    config: TritonForwardConfig,
) -> None:
    """Fill ``out`` (like q) and ``lse`` on a forward layout; shapes as
    :func:`s2attn.ops.dispatch.forward` takes them. ``config``'s fields left None take
    ``default_config``."""
    packed, batch, seqlen_q, seqlen_k = sequence_lengths(q, k, varlen)
    num_heads, head_dim = q.shape[-2], q.shape[-1]
    config = config.over(default_config(head_dim, q.dtype))
    block_m, block_n = layout.block_m, layout.block_n
    num_tiles = query_tiles(block_m, seqlen_q, seqlen_k, packed)
    if packed:
        cu_q, cu_k = varlen.cu_seqlens_q, varlen.cu_seqlens_k
    else:
        cu_q = cu_k = lse  # not read when not packed
    (q4, q_strides), (k4, k_strides) = as_batched(q, packed), as_batched(k, packed)
    (v4, v_strides), (o4, o_strides) = as_batched(v, packed), as_batched(out, packed)
    heads_per_group = heads_per_program_group(batch * num_heads, config.heads_per_group)
    use_tma = config.use_tma and tma_allowed(q.device, k, v)
    # Host-made descriptors spare each program building its own; packed sequences need the
    # per-sequence bounds of in-kernel ones.
    host_desc = config.host_desc and use_tma and not packed
    if host_desc:
        block = [1, block_n, 1, padded_head_dim(head_dim)]
        k_desc = TensorDescriptor(k, list(k.shape), list(k.stride()), block)
        v_desc = TensorDescriptor(v, list(v.shape), list(v.stride()), block)
    else:
        k_desc = v_desc = k  # not read
    launcher_for(_forward_kernel)[(batch * num_heads * num_tiles,)](
        q4, k4, v4, o4, lse,
        layout.full_offsets, layout.full_cols,
        layout.partial_offsets, layout.partial_cols, layout.partial_bits,
        *gathered_lists(layout), cu_q, cu_k, k_desc, v_desc,
        *q_strides, *k_strides, *v_strides, *o_strides, *lse_strides(lse, packed),
        seqlen_q, seqlen_k, layout.num_groups, num_tiles, heads_per_group, softmax_scale * LOG2E,
        NUM_HEADS=num_heads,
        GQA_GROUP=num_heads // k.shape[-2],
        Q_HEADS_PER_PATTERN_HEAD=q_heads_per_pattern_head,
        HEAD_DIM=head_dim,
        BLOCK_D=padded_head_dim(head_dim),
        **layout_constexprs(layout),
        VARLEN=packed,
        CHECK_K_BOUNDS=check_k_bounds(layout, seqlen_k, packed),
        DOT_PRECISION=dot_precision(q.dtype),
        POS_SCALE=softmax_scale > 0,
        USE_TMA=use_tma,
        PAIR=config.pair,
        Q_IN_REGS=config.q_in_regs,
        HOST_DESC=host_desc,
        GATHER=layout.gather_width > 0,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
