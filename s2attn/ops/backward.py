"""Triton backward kernels (dK/dV and dQ) over the compiled layouts, and their launcher.

Three launches, none with atomics, so gradients are bit-identical from run to run:

1. ``_row_delta_kernel``: delta = rowsum(dO * O) - dLSE per query row (the softmax Jacobian term;
   the LSE gradient enters here, since dLSE/dS = P).
2. ``_dkdv_kernel``: one program per (batch, KV head, KV tile) walks the *backward* layout (the
   query tiles that use its KV tile) for every query head of its GQA group, so the group's sum
   happens in registers rather than through atomics.
3. ``_dq_kernel``: one program per (batch, query head, query tile) walks the *forward* layout.

Both walks keep the unmasked full entries apart from the masked partial ones, like the forward
pass. Probabilities are recomputed from the saved LSE; nothing of size seq x seq is stored.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..layout import TileLayout
from .common import (
    LOG2E,
    POISON_OUTPUTS,
    as_batched,
    dot_precision,
    entry_bit_positions,
    entry_keep,
    lse_strides,
    padded_head_dim,
    sequence_bounds,
)

__all__ = ["backward", "backward_tile_sizes"]


@triton.jit
def _row_delta_kernel(
    Out, dOut, dLse, Delta,
    stride_ob, stride_os, stride_oh, stride_od,
    stride_gb, stride_gs, stride_gh, stride_gd,
    stride_lb, stride_lh, stride_ls,
    seqlen, num_heads,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, HAS_DLSE: tl.constexpr,
):  # fmt: skip
    bh = tl.program_id(0)
    b = bh // num_heads
    h = bh % num_heads
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (rows < seqlen)[:, None] & (offs_d < HEAD_DIM)[None, :]
    o = tl.load(
        Out + b.to(tl.int64) * stride_ob + h * stride_oh
        + rows[:, None].to(tl.int64) * stride_os + offs_d[None, :] * stride_od,
        mask=mask, other=0.0,
    ).to(Delta.dtype.element_ty)  # fmt: skip
    do = tl.load(
        dOut + b.to(tl.int64) * stride_gb + h * stride_gh
        + rows[:, None].to(tl.int64) * stride_gs + offs_d[None, :] * stride_gd,
        mask=mask, other=0.0,
    ).to(Delta.dtype.element_ty)  # fmt: skip
    delta = tl.sum(o * do, axis=1)
    l_off = b.to(tl.int64) * stride_lb + h * stride_lh + rows.to(tl.int64) * stride_ls
    if HAS_DLSE:
        delta -= tl.load(dLse + l_off, mask=rows < seqlen, other=0.0)
    tl.store(Delta + l_off, delta, mask=rows < seqlen)


@triton.jit
def _dkdv_entries(
    dk, dv, k, v,
    cols_ptr, bits_ptr, start, end,
    q_base, do_base, lse_base, delta_base,
    stride_qs, stride_qd, stride_gs, stride_gd, stride_ls,
    kv_abs, k_ok, q_offset, q_len, bitpos_t, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """Accumulate dK, dV of one KV tile over query tiles ``start..end`` of its list.

    Works on transposed scores (KV rows x query columns) so dK and dV come out row-major.
    """
    ACC = dk.dtype
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    for e in range(start, end):
        t = tl.load(cols_ptr + e)
        q_abs = t * BLOCK_M + offs_m
        rows = q_abs - q_offset
        row_ok = (rows >= 0) & (rows < q_len)
        # Query tiles may straddle the sequence start (bottom-right alignment) or end, so rows are
        # always bounds-checked; padded rows load LSE +inf and so get probability 0.
        q = tl.load(
            q_base + rows[:, None] * stride_qs + offs_d[None, :] * stride_qd,
            mask=row_ok[:, None] & d_ok[None, :], other=0.0,
        )  # fmt: skip
        do = tl.load(
            do_base + rows[:, None] * stride_gs + offs_d[None, :] * stride_gd,
            mask=row_ok[:, None] & d_ok[None, :], other=0.0,
        )  # fmt: skip
        lse = tl.load(lse_base + rows * stride_ls, mask=row_ok, other=float("inf")) * 1.4426950408889634
        delta = tl.load(delta_base + rows * stride_ls, mask=row_ok, other=0.0)
        s_t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION, out_dtype=ACC) * qk_scale
        p_t = tl.math.exp2(s_t - lse[None, :])
        if MASKED:
            # entry_keep's test, built transposed to skip a register shuffle.
            keep_t = (((tl.load(bits_ptr + e) >> bitpos_t) & 1) != 0) & k_ok[:, None]
            if CAUSAL:
                keep_t = keep_t & (q_abs[None, :] >= kv_abs[:, None])
            # Rows that attend nothing have LSE -inf, so p_t may be inf where keep_t is False.
            p_t = tl.where(keep_t, p_t, 0.0)
        dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=DOT_PRECISION, out_dtype=ACC)
        dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION, out_dtype=ACC)
        ds_t = p_t * (dp_t - delta[None, :])
        dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=DOT_PRECISION, out_dtype=ACC)
    return dk, dv


@triton.jit
def _dkdv_kernel(
    Q, K, V, dOut, Lse, Delta, dK, dV,
    offsets_full, cols_full, offsets_partial, cols_partial, bits_partial,
    cu_seqlens_q, cu_seqlens_k,
    stride_qb, stride_qs, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_gb, stride_gs, stride_gh, stride_gd,
    stride_dkb, stride_dks, stride_dkh, stride_dkd,
    stride_dvb, stride_dvs, stride_dvh, stride_dvd,
    stride_lb, stride_lh, stride_ls,
    seqlen_q, seqlen_k, layout_tiles, qk_scale, softmax_scale,
    NUM_KV_HEADS: tl.constexpr, GQA_GROUP: tl.constexpr, PATTERN_HEAD_DIV: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ROW_GROUP: tl.constexpr, COL_GROUP: tl.constexpr, BITS_PER_ROW: tl.constexpr,
    CAUSAL: tl.constexpr, VARLEN: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    bh = tl.program_id(0)
    b = bh // NUM_KV_HEADS
    kv_head = bh % NUM_KV_HEADS
    n = tl.program_id(1)
    q_start, q_len, k_start, k_len = sequence_bounds(
        b, cu_seqlens_q, cu_seqlens_k, seqlen_q, seqlen_k, VARLEN
    )
    if n * BLOCK_N >= k_len:
        return
    q_offset = k_len - q_len
    kv_abs = n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_ok = kv_abs < k_len
    offs_d = tl.arange(0, BLOCK_D)
    kv_mask = k_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
    b64 = b.to(tl.int64)
    kh64 = kv_head.to(tl.int64)
    k = tl.load(
        K + b64 * stride_kb + k_start * stride_ks + kh64 * stride_kh
        + kv_abs[:, None] * stride_ks + offs_d[None, :] * stride_kd,
        mask=kv_mask, other=0.0,
    )  # fmt: skip
    v = tl.load(
        V + b64 * stride_vb + k_start * stride_vs + kh64 * stride_vh
        + kv_abs[:, None] * stride_vs + offs_d[None, :] * stride_vd,
        mask=kv_mask, other=0.0,
    )  # fmt: skip
    # Bit positions transposed to (KV rows, query columns).
    bitpos_t = tl.trans(entry_bit_positions(BLOCK_M, BLOCK_N, ROW_GROUP, COL_GROUP, BITS_PER_ROW))
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=Lse.dtype.element_ty)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=Lse.dtype.element_ty)
    for g in range(GQA_GROUP):
        h = kv_head * GQA_GROUP + g
        h64 = h.to(tl.int64)
        q_base = Q + b64 * stride_qb + q_start * stride_qs + h64 * stride_qh
        do_base = dOut + b64 * stride_gb + q_start * stride_gs + h64 * stride_gh
        l_off = b64 * stride_lb + h64 * stride_lh + q_start * stride_ls
        group = (h // PATTERN_HEAD_DIV) * layout_tiles + n
        dk, dv = _dkdv_entries(
            dk, dv, k, v, cols_full, bits_partial,
            tl.load(offsets_full + group), tl.load(offsets_full + group + 1),
            q_base, do_base, Lse + l_off, Delta + l_off,
            stride_qs, stride_qd, stride_gs, stride_gd, stride_ls,
            kv_abs, k_ok, q_offset, q_len, bitpos_t, qk_scale,
            HEAD_DIM, BLOCK_M, BLOCK_D, False, CAUSAL, DOT_PRECISION,
        )  # fmt: skip
        dk, dv = _dkdv_entries(
            dk, dv, k, v, cols_partial, bits_partial,
            tl.load(offsets_partial + group), tl.load(offsets_partial + group + 1),
            q_base, do_base, Lse + l_off, Delta + l_off,
            stride_qs, stride_qd, stride_gs, stride_gd, stride_ls,
            kv_abs, k_ok, q_offset, q_len, bitpos_t, qk_scale,
            HEAD_DIM, BLOCK_M, BLOCK_D, True, CAUSAL, DOT_PRECISION,
        )  # fmt: skip
    dk *= softmax_scale
    tl.store(
        dK + b64 * stride_dkb + k_start * stride_dks + kh64 * stride_dkh
        + kv_abs[:, None] * stride_dks + offs_d[None, :] * stride_dkd,
        dk.to(dK.dtype.element_ty), mask=kv_mask,
    )  # fmt: skip
    tl.store(
        dV + b64 * stride_dvb + k_start * stride_dvs + kh64 * stride_dvh
        + kv_abs[:, None] * stride_dvs + offs_d[None, :] * stride_dvd,
        dv.to(dV.dtype.element_ty), mask=kv_mask,
    )  # fmt: skip


@triton.jit
def _dq_entries(
    dq, q, do, lse, delta,
    cols_ptr, bits_ptr, start, end,
    k_base, v_base, stride_ks, stride_kd, stride_vs, stride_vd,
    rows_abs, bitpos, seq_k, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, CHECK_K_BOUNDS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """Accumulate dQ of one query tile over KV tiles ``start..end`` of its list."""
    ACC = dq.dtype
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    for e in range(start, end):
        n = tl.load(cols_ptr + e)
        cols = n * BLOCK_N + offs_n
        k_ok = cols < seq_k
        if MASKED or CHECK_K_BOUNDS:
            kv_mask = k_ok[:, None] & d_ok[None, :]
        else:
            kv_mask = d_ok[None, :]
        k = tl.load(
            k_base + cols[:, None] * stride_ks + offs_d[None, :] * stride_kd,
            mask=kv_mask, other=0.0,
        )  # fmt: skip
        v = tl.load(
            v_base + cols[:, None] * stride_vs + offs_d[None, :] * stride_vd,
            mask=kv_mask, other=0.0,
        )  # fmt: skip
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION, out_dtype=ACC) * qk_scale
        p = tl.math.exp2(s - lse[:, None])
        if MASKED:
            keep = entry_keep(tl.load(bits_ptr + e), bitpos, rows_abs, cols, k_ok, CAUSAL)
            p = tl.where(keep, p, 0.0)
        elif CHECK_K_BOUNDS:
            p = tl.where(k_ok[None, :], p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION, out_dtype=ACC)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PRECISION, out_dtype=ACC)
    return dq


@triton.jit
def _dq_kernel(
    Q, K, V, dOut, Lse, Delta, dQ,
    offsets_full, cols_full, offsets_partial, cols_partial, bits_partial,
    cu_seqlens_q, cu_seqlens_k,
    stride_qb, stride_qs, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_gb, stride_gs, stride_gh, stride_gd,
    stride_dqb, stride_dqs, stride_dqh, stride_dqd,
    stride_lb, stride_lh, stride_ls,
    seqlen_q, seqlen_k, layout_tiles, qk_scale, softmax_scale,
    NUM_HEADS: tl.constexpr, GQA_GROUP: tl.constexpr, PATTERN_HEAD_DIV: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ROW_GROUP: tl.constexpr, COL_GROUP: tl.constexpr, BITS_PER_ROW: tl.constexpr,
    CAUSAL: tl.constexpr, VARLEN: tl.constexpr, CHECK_K_BOUNDS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    bh = tl.program_id(0)
    b = bh // NUM_HEADS
    h = bh % NUM_HEADS
    q_start, q_len, k_start, k_len = sequence_bounds(
        b, cu_seqlens_q, cu_seqlens_k, seqlen_q, seqlen_k, VARLEN
    )
    q_offset = k_len - q_len
    tile = (k_len - 1) // BLOCK_M - tl.program_id(1)  # heaviest tiles first, as in the forward
    if (q_len <= 0) | (tile < q_offset // BLOCK_M):
        return
    rows_abs = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = rows_abs - q_offset
    row_ok = (rows >= 0) & (rows < q_len)
    offs_d = tl.arange(0, BLOCK_D)
    row_mask = row_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
    b64 = b.to(tl.int64)
    h64 = h.to(tl.int64)
    kh64 = (h // GQA_GROUP).to(tl.int64)
    q = tl.load(
        Q + b64 * stride_qb + (q_start + rows[:, None]) * stride_qs + h64 * stride_qh
        + offs_d[None, :] * stride_qd,
        mask=row_mask, other=0.0,
    )  # fmt: skip
    do = tl.load(
        dOut + b64 * stride_gb + (q_start + rows[:, None]) * stride_gs + h64 * stride_gh
        + offs_d[None, :] * stride_gd,
        mask=row_mask, other=0.0,
    )  # fmt: skip
    l_off = b64 * stride_lb + h64 * stride_lh + (q_start + rows) * stride_ls
    lse = tl.load(Lse + l_off, mask=row_ok, other=float("inf")) * 1.4426950408889634
    delta = tl.load(Delta + l_off, mask=row_ok, other=0.0)
    k_base = K + b64 * stride_kb + k_start * stride_ks + kh64 * stride_kh
    v_base = V + b64 * stride_vb + k_start * stride_vs + kh64 * stride_vh
    bitpos = entry_bit_positions(BLOCK_M, BLOCK_N, ROW_GROUP, COL_GROUP, BITS_PER_ROW)
    group = (h // PATTERN_HEAD_DIV) * layout_tiles + tile
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=Lse.dtype.element_ty)
    dq = _dq_entries(
        dq, q, do, lse, delta, cols_full, bits_partial,
        tl.load(offsets_full + group), tl.load(offsets_full + group + 1),
        k_base, v_base, stride_ks, stride_kd, stride_vs, stride_vd,
        rows_abs, bitpos, k_len, qk_scale,
        HEAD_DIM, BLOCK_N, BLOCK_D, False, CAUSAL, CHECK_K_BOUNDS, DOT_PRECISION,
    )  # fmt: skip
    dq = _dq_entries(
        dq, q, do, lse, delta, cols_partial, bits_partial,
        tl.load(offsets_partial + group), tl.load(offsets_partial + group + 1),
        k_base, v_base, stride_ks, stride_kd, stride_vs, stride_vd,
        rows_abs, bitpos, k_len, qk_scale,
        HEAD_DIM, BLOCK_N, BLOCK_D, True, CAUSAL, CHECK_K_BOUNDS, DOT_PRECISION,
    )  # fmt: skip
    dq *= softmax_scale
    tl.store(
        dQ + b64 * stride_dqb + (q_start + rows[:, None]) * stride_dqs + h64 * stride_dqh
        + offs_d[None, :] * stride_dqd,
        dq.to(dQ.dtype.element_ty), mask=row_mask,
    )  # fmt: skip


def backward_tile_sizes(
    head_dim: int, dtype: torch.dtype, device: torch.device
) -> tuple[tuple[int, int], tuple[int, int]]:
    """((block_m, block_n) for dK/dV, (block_m, block_n) for dQ).

    dK/dV programs hold a KV tile and its two accumulators, so their query tiles stay small;
    dQ programs hold one accumulator, so they take tall query tiles and narrow KV tiles.
    """
    if device.type != "cuda":
        return (32, 64), (64, 32)
    if dtype.itemsize > 2 or head_dim > 128:
        return (32, 64), (64, 32)
    # Measured on H100 (benchmarks/sweep_tiles.py, 32k, V16, dim 128, bf16): 64x64 tiles with
    # 4 warps and 2 stages were best for both kernels among 20 and 16 configurations.
    return (64, 64), (64, 64)


def _launch_options(head_dim: int, dtype: torch.dtype) -> dict[str, int]:
    if head_dim > 128 or dtype.itemsize > 2:
        return {"num_warps": 8, "num_stages": 1}
    return {"num_warps": 4, "num_stages": 2}


def backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    grad_lse: torch.Tensor | None,
    dkdv_layout: TileLayout,
    dq_layout: TileLayout,
    *,
    softmax_scale: float,
    pattern_head_div: int,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    dq: torch.Tensor | None = None,
    dk: torch.Tensor | None = None,
    dv: torch.Tensor | None = None,
    launch_options: tuple[dict[str, int], dict[str, int]] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of q, k, v (shapes as the inputs to :func:`s2attn.ops.forward.forward`).

    ``dkdv_layout`` is a backward (per-KV-tile) layout, ``dq_layout`` a forward one. ``dq``, ``dk``,
    ``dv`` may be given as views to write into (e.g. slices of one packed dqkv tensor).
    ``launch_options`` overrides (num_warps, num_stages) of the dK/dV and dQ kernels, for sweeps.
    """
    varlen = cu_seqlens_q is not None
    if varlen:
        batch = cu_seqlens_q.numel() - 1
        seqlen_q, seqlen_k = max_seqlen_q, max_seqlen_k
    else:
        batch, seqlen_q, seqlen_k = q.shape[0], q.shape[1], k.shape[1]
    num_heads, head_dim = q.shape[-2], q.shape[-1]
    num_kv_heads = k.shape[-2]
    dq = torch.empty_like(q) if dq is None else dq
    dk = torch.empty_like(k) if dk is None else dk
    dv = torch.empty_like(v) if dv is None else dv
    if POISON_OUTPUTS:
        for t in (dq, dk, dv):
            t.fill_(float("nan"))
    if q.numel() == 0 or k.numel() == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()

    (q4, q_st), (k4, k_st), (v4, v_st) = (as_batched(t, varlen) for t in (q, k, v))
    (o4, o_st), (g4, g_st) = as_batched(out, varlen), as_batched(grad_out, varlen)
    (dq4, dq_st), (dk4, dk_st), (dv4, dv_st) = (as_batched(t, varlen) for t in (dq, dk, dv))
    l_st = lse_strides(lse, varlen)
    cu_q = cu_seqlens_q if varlen else lse  # not read when not varlen
    cu_k = cu_seqlens_k if varlen else lse
    block_d = padded_head_dim(head_dim)
    dkdv_options, dq_options = launch_options or (_launch_options(head_dim, q.dtype),) * 2
    dot = dot_precision(q.dtype)

    delta = torch.empty_like(lse)
    rows_total = q.shape[0] if varlen else seqlen_q
    _row_delta_kernel[(q4.shape[0] * num_heads, triton.cdiv(rows_total, 64))](
        o4, g4, grad_lse if grad_lse is not None else lse, delta,
        *o_st, *g_st, *l_st, rows_total, num_heads,
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_M=64, HAS_DLSE=grad_lse is not None,
    )  # fmt: skip

    geometry = lambda lay: dict(  # noqa: E731
        BLOCK_M=lay.block_m, BLOCK_N=lay.block_n, ROW_GROUP=lay.row_group,
        COL_GROUP=lay.col_group, BITS_PER_ROW=lay.bits_per_row, CAUSAL=lay.causal,
    )  # fmt: skip
    lay = dkdv_layout
    _dkdv_kernel[(batch * num_kv_heads, math.ceil(seqlen_k / lay.block_n))](
        q4, k4, v4, g4, lse, delta, dk4, dv4,
        lay.full_offsets, lay.full_cols, lay.partial_offsets, lay.partial_cols, lay.partial_bits,
        cu_q, cu_k, *q_st, *k_st, *v_st, *g_st, *dk_st, *dv_st, *l_st,
        seqlen_q, seqlen_k, lay.num_groups, softmax_scale * LOG2E, softmax_scale,
        NUM_KV_HEADS=num_kv_heads, GQA_GROUP=num_heads // num_kv_heads,
        PATTERN_HEAD_DIV=pattern_head_div, HEAD_DIM=head_dim, BLOCK_D=block_d,
        VARLEN=varlen, DOT_PRECISION=dot, **geometry(lay), **dkdv_options,
    )  # fmt: skip
    lay = dq_layout
    if varlen:
        num_tiles = math.ceil(seqlen_q / lay.block_m) + 1
    else:
        num_tiles = (seqlen_k - 1) // lay.block_m - (seqlen_k - seqlen_q) // lay.block_m + 1
    _dq_kernel[(batch * num_heads, num_tiles)](
        q4, k4, v4, g4, lse, delta, dq4,
        lay.full_offsets, lay.full_cols, lay.partial_offsets, lay.partial_cols, lay.partial_bits,
        cu_q, cu_k, *q_st, *k_st, *v_st, *g_st, *dq_st, *l_st,
        seqlen_q, seqlen_k, lay.num_groups, softmax_scale * LOG2E, softmax_scale,
        NUM_HEADS=num_heads, GQA_GROUP=num_heads // num_kv_heads,
        PATTERN_HEAD_DIV=pattern_head_div, HEAD_DIM=head_dim, BLOCK_D=block_d,
        VARLEN=varlen, CHECK_K_BOUNDS=not lay.causal and (varlen or seqlen_k % lay.block_n != 0),
        DOT_PRECISION=dot, **geometry(lay), **dq_options,
    )  # fmt: skip
    return dq, dk, dv
