"""Triton backward kernels (dK/dV and dQ) over the compiled layouts, and their launchers.

Up to four launches (``ops/dispatch.py`` orders them, and has the Gluon kernels take some on
Hopper), none with atomics, so gradients are bit-identical from run to run:

1. ``row_delta`` (its kernel in ``row_delta.py``): delta = rowsum(dO * O) - dLSE per query row
   (the softmax Jacobian term; the LSE gradient enters here, since dLSE/dS = P).
2. ``_dkdv_kernel``: one program per (batch, KV head, KV tile) walks the *backward* layout (the
   query tiles that use its KV tile) for every query head of its GQA group, so the group's sum
   happens in registers rather than through atomics.
3. ``_dq_kernel``: one program per (batch, query head, query tile) walks the *forward* layout,
   gathered entries included.
4. ``_dkdv_gathered_kernel``, when the backward layout has gathered KV tiles (pattern blocks
   smaller than a KV tile): adds the far uses of lone key blocks to the dK, dV rows that pass 2
   wrote. Each key block sits in one gathered tile, so this too needs no atomics.

All walks keep the unmasked full entries apart from the masked partial ones, like the forward
pass. Probabilities are recomputed from the saved LSE; nothing of size seq x seq is stored.
"""

from __future__ import annotations

import functools
import math
from dataclasses import replace

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from ..env import tma_allowed
from ..launcher import launcher_for
from ..layout import TileLayout
from ..options import TritonBackwardConfig
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
from .row_delta import row_delta

__all__ = ["default_dkdv_config", "default_dq_config", "dkdv", "dq", "row_delta"]


@triton.jit
def _dkdv_entries(
    dk, dv, k, v,
    cols_ptr, bits_ptr, start, end,
    q_base, do_base, q_desc, do_desc, desc_b, desc_h, lse_base, delta_base,
    stride_qs, stride_qd, stride_gs, stride_gd, stride_ls,
    kv_abs, k_ok, q_offset, q_len, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    ROW_GROUP: tl.constexpr, COL_GROUP: tl.constexpr, BITS_PER_ROW: tl.constexpr,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, USE_TMA: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
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
        rows64 = rows.to(tl.int64)  # row x stride passes 2^31 in long sequences
        # Query tiles may straddle the sequence start (bottom-right alignment) or end, so rows are
        # always bounds-checked; padded rows load LSE +inf and so get probability 0.
        if USE_TMA:
            # (batch, seq, heads, dim) descriptors made on the host zero-fill past the end and
            # the head dim; the launcher uses them only when no tile starts before row 0.
            row0 = t * BLOCK_M - q_offset
            q = q_desc.load([desc_b, row0, desc_h, 0]).reshape(BLOCK_M, BLOCK_D)
            do = do_desc.load([desc_b, row0, desc_h, 0]).reshape(BLOCK_M, BLOCK_D)
        else:
            q = tl.load(
                q_base + rows64[:, None] * stride_qs + offs_d[None, :] * stride_qd,
                mask=row_ok[:, None] & d_ok[None, :], other=0.0,
            )
            do = tl.load(
                do_base + rows64[:, None] * stride_gs + offs_d[None, :] * stride_gd,
                mask=row_ok[:, None] & d_ok[None, :], other=0.0,
            )
        # A literal: compiled kernels may read only constexpr globals (the interpreter reads any).
        lse = tl.load(lse_base + rows64 * stride_ls, mask=row_ok, other=float("inf"))
        lse = lse * 1.4426950408889634
        delta = tl.load(delta_base + rows64 * stride_ls, mask=row_ok, other=0.0)
        s_t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION, out_dtype=ACC) * qk_scale
        p_t = tl.math.exp2(s_t - lse[None, :])
        if MASKED:
            # Built transposed (KV rows x query columns) to skip a register shuffle.
            keep_t = entry_keep(
                tl.load(bits_ptr + e), BLOCK_M, BLOCK_N, ROW_GROUP, COL_GROUP, BITS_PER_ROW, True
            ) & k_ok[:, None]
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
def _row_ptrs(base, start, rows, stride_s, stride_d, BLOCK_D: tl.constexpr):
    """(len(rows), BLOCK_D) pointers to rows ``rows`` of a sequence starting at row ``start`` of
    one (batch, head)'s (seq, dim) view at ``base``."""
    offs_d = tl.arange(0, BLOCK_D)
    return base + (start + rows[:, None]) * stride_s + offs_d[None, :] * stride_d


@triton.jit
def _kv_row_ptrs(
    K, V, k_off, v_off, k_start, rows, stride_ks, stride_kd, stride_vs, stride_vd,
    BLOCK_D: tl.constexpr,
):
    """Pointers to rows ``rows`` of one (batch, head) of K and V (or dK and dV) at offsets
    ``k_off``, ``v_off``, of a sequence starting at row ``k_start``."""
    return (
        _row_ptrs(K + k_off, k_start, rows, stride_ks, stride_kd, BLOCK_D),
        _row_ptrs(V + v_off, k_start, rows, stride_vs, stride_vd, BLOCK_D),
    )


@triton.jit
def _kv_rows(
    K, V, k_off, v_off, k_start, rows, mask, stride_ks, stride_kd, stride_vs, stride_vd,
    BLOCK_D: tl.constexpr,
):
    """K and V rows as ``_kv_row_ptrs`` points at them; masked elements read 0."""
    k_ptrs, v_ptrs = _kv_row_ptrs(
        K, V, k_off, v_off, k_start, rows, stride_ks, stride_kd, stride_vs, stride_vd, BLOCK_D
    )
    return tl.load(k_ptrs, mask=mask, other=0.0), tl.load(v_ptrs, mask=mask, other=0.0)


@triton.jit
def _dkdv_over_group(
    k, v, offsets_full, cols_full, offsets_partial, cols_partial, bits_partial,
    list_base, list_stride, Q, dOut, Lse, Delta, Q_desc, dO_desc, b, kv_head, q_start,
    stride_qb, stride_qs, stride_qh, stride_qd, stride_gb, stride_gs, stride_gh, stride_gd,
    stride_lb, stride_lh, stride_ls, kv_abs, k_ok, q_offset, q_len, qk_scale,
    GQA_GROUP: tl.constexpr, Q_HEADS_PER_PATTERN_HEAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    ROW_GROUP: tl.constexpr, COL_GROUP: tl.constexpr, BITS_PER_ROW: tl.constexpr,
    CAUSAL: tl.constexpr, USE_TMA: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """dK, dV of one KV tile summed over the query heads of its GQA group, in registers: head h
    walks list ``list_base + (h // Q_HEADS_PER_PATTERN_HEAD) * list_stride``, full entries then
    partial ones."""
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=Lse.dtype.element_ty)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=Lse.dtype.element_ty)
    b64 = b.to(tl.int64)
    for g in range(GQA_GROUP):
        h = kv_head * GQA_GROUP + g
        h64 = h.to(tl.int64)
        q_base = Q + b64 * stride_qb + q_start * stride_qs + h64 * stride_qh
        do_base = dOut + b64 * stride_gb + q_start * stride_gs + h64 * stride_gh
        l_off = b64 * stride_lb + h64 * stride_lh + q_start * stride_ls
        group = list_base + (h // Q_HEADS_PER_PATTERN_HEAD) * list_stride
        for masked in tl.static_range(2):  # the unmasked full entries, then the partial ones
            if masked:
                offsets, cols = offsets_partial, cols_partial
            else:
                offsets, cols = offsets_full, cols_full
            dk, dv = _dkdv_entries(
                dk, dv, k, v, cols, bits_partial,
                tl.load(offsets + group), tl.load(offsets + group + 1),
                q_base, do_base, Q_desc, dO_desc, b, h, Lse + l_off, Delta + l_off,
                stride_qs, stride_qd, stride_gs, stride_gd, stride_ls,
                kv_abs, k_ok, q_offset, q_len, qk_scale,
                HEAD_DIM, BLOCK_M, BLOCK_N, BLOCK_D, ROW_GROUP, COL_GROUP, BITS_PER_ROW,
                masked == 1, CAUSAL, USE_TMA, DOT_PRECISION,
            )
    return dk, dv


@triton.jit
def _dkdv_kernel(
    Q, K, V, dOut, Lse, Delta, dK, dV,
    offsets_full, cols_full, offsets_partial, cols_partial, bits_partial,
    cu_seqlens_q, cu_seqlens_k, Q_desc, dO_desc,
    stride_qb, stride_qs, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_gb, stride_gs, stride_gh, stride_gd,
    stride_dkb, stride_dks, stride_dkh, stride_dkd,
    stride_dvb, stride_dvs, stride_dvh, stride_dvd,
    stride_lb, stride_lh, stride_ls,
    seqlen_q, seqlen_k, layout_tiles, grid_tiles, heads_per_group, qk_scale, softmax_scale,
    NUM_KV_HEADS: tl.constexpr, GQA_GROUP: tl.constexpr, Q_HEADS_PER_PATTERN_HEAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ROW_GROUP: tl.constexpr, COL_GROUP: tl.constexpr, BITS_PER_ROW: tl.constexpr,
    CAUSAL: tl.constexpr, VARLEN: tl.constexpr, DOT_PRECISION: tl.constexpr,
    USE_TMA: tl.constexpr, A_IN_REGS: tl.constexpr,
):
    # KV tiles in order (the first ones, which later stride rows use, have the longest lists).
    bh, n = program_order(tl.program_id(0), grid_tiles, heads_per_group)
    b = bh // NUM_KV_HEADS
    kv_head = bh % NUM_KV_HEADS
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
    k, v = _kv_rows(K, V, b64 * stride_kb + kh64 * stride_kh, b64 * stride_vb + kh64 * stride_vh,
                    k_start, kv_abs, kv_mask, stride_ks, stride_kd, stride_vs, stride_vd, BLOCK_D)
    if A_IN_REGS:
        # Exact no-ops the compiler keeps: MMA A operands that are not plain loads stay in
        # registers, so S^T and dP^T read only q and dO from shared memory.
        k = tl.where(kv_mask, k, 0.0)
        v = tl.where(kv_mask, v, 0.0)
    dk, dv = _dkdv_over_group(
        k, v, offsets_full, cols_full, offsets_partial, cols_partial, bits_partial,
        n, layout_tiles, Q, dOut, Lse, Delta, Q_desc, dO_desc, b, kv_head, q_start,
        stride_qb, stride_qs, stride_qh, stride_qd, stride_gb, stride_gs, stride_gh, stride_gd,
        stride_lb, stride_lh, stride_ls, kv_abs, k_ok, q_offset, q_len, qk_scale,
        GQA_GROUP, Q_HEADS_PER_PATTERN_HEAD, HEAD_DIM, BLOCK_M, BLOCK_N, BLOCK_D, ROW_GROUP,
        COL_GROUP, BITS_PER_ROW, CAUSAL, USE_TMA, DOT_PRECISION,
    )
    dk *= softmax_scale
    dk_ptrs, dv_ptrs = _kv_row_ptrs(
        dK, dV, b64 * stride_dkb + kh64 * stride_dkh, b64 * stride_dvb + kh64 * stride_dvh,
        k_start, kv_abs, stride_dks, stride_dkd, stride_dvs, stride_dvd, BLOCK_D,
    )
    tl.store(dk_ptrs, dk.to(dK.dtype.element_ty), mask=kv_mask)
    tl.store(dv_ptrs, dv.to(dV.dtype.element_ty), mask=kv_mask)


@triton.jit
def _dkdv_gathered_kernel(
    Q, K, V, dOut, Lse, Delta, dK, dV,
    tile_heads, tile_blocks, offsets_full, cols_full, offsets_partial, cols_partial, bits_partial,
    cu_seqlens_q, cu_seqlens_k, Q_desc, dO_desc,
    stride_qb, stride_qs, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_gb, stride_gs, stride_gh, stride_gd,
    stride_dkb, stride_dks, stride_dkh, stride_dkd,
    stride_dvb, stride_dvs, stride_dvh, stride_dvd,
    stride_lb, stride_lh, stride_ls,
    seqlen_q, seqlen_k, batch, qk_scale, softmax_scale,
    GQA_GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ROW_GROUP: tl.constexpr, COL_GROUP: tl.constexpr, BITS_PER_ROW: tl.constexpr,
    VARLEN: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr,
):
    """Add the far uses of gathered KV tiles (``layout.GatheredKVTiles``) to dK and dV, which the
    contiguous dK/dV pass has written: one program per (tile, batch). A tile's pattern head is
    its KV head (the launcher gathers only then), and each of its key blocks is in no other
    tile, so the read-add-write needs no atomics."""
    tile = tl.program_id(0) // batch
    b = tl.program_id(0) % batch
    kv_head = tl.load(tile_heads + tile)
    q_start, q_len, k_start, k_len = sequence_bounds(
        b, cu_seqlens_q, cu_seqlens_k, seqlen_q, seqlen_k, VARLEN
    )
    q_offset = k_len - q_len
    offs_n = tl.arange(0, BLOCK_N)
    blk = tl.load(tile_blocks + tile * BITS_PER_ROW + offs_n // COL_GROUP)
    kv_abs = blk * COL_GROUP + offs_n % COL_GROUP
    k_ok = (blk >= 0) & (kv_abs < k_len)
    if tl.max(k_ok.to(tl.int32), axis=0) == 0:  # every block past this (packed) sequence
        return
    offs_d = tl.arange(0, BLOCK_D)
    kv_mask = k_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
    b64 = b.to(tl.int64)
    kh64 = kv_head.to(tl.int64)
    k, v = _kv_rows(K, V, b64 * stride_kb + kh64 * stride_kh, b64 * stride_vb + kh64 * stride_vh,
                    k_start, kv_abs, kv_mask, stride_ks, stride_kd, stride_vs, stride_vd, BLOCK_D)
    # Every head of the group walks the tile's one list (list stride 0). Gathered entries lie
    # wholly after their keys: no causal rule, full ones unmasked.
    dk, dv = _dkdv_over_group(
        k, v, offsets_full, cols_full, offsets_partial, cols_partial, bits_partial,
        tile, 0, Q, dOut, Lse, Delta, Q_desc, dO_desc, b, kv_head, q_start,
        stride_qb, stride_qs, stride_qh, stride_qd, stride_gb, stride_gs, stride_gh, stride_gd,
        stride_lb, stride_lh, stride_ls, kv_abs, k_ok, q_offset, q_len, qk_scale,
        GQA_GROUP, 1, HEAD_DIM, BLOCK_M, BLOCK_N, BLOCK_D, ROW_GROUP, COL_GROUP,
        BITS_PER_ROW, False, USE_TMA, DOT_PRECISION,
    )
    dk_ptrs, dv_ptrs = _kv_row_ptrs(
        dK, dV, b64 * stride_dkb + kh64 * stride_dkh, b64 * stride_dvb + kh64 * stride_dvh,
        k_start, kv_abs, stride_dks, stride_dkd, stride_dvs, stride_dvd, BLOCK_D,
    )
    # The near uses' sums, already rounded to the gradient's dtype (one extra rounding of that
    # part in 2-byte dtypes; the far part, most of a stride block's sum, is rounded once).
    dk = dk * softmax_scale + tl.load(dk_ptrs, mask=kv_mask, other=0.0).to(dk.dtype)
    dv = dv + tl.load(dv_ptrs, mask=kv_mask, other=0.0).to(dv.dtype)
    tl.store(dk_ptrs, dk.to(dK.dtype.element_ty), mask=kv_mask)
    tl.store(dv_ptrs, dv.to(dV.dtype.element_ty), mask=kv_mask)


@triton.jit
def _dq_entries(
    dq, q, do, lse, delta,
    cols_ptr, bits_ptr, start, end,
    k_base, v_base, k_desc, v_desc, desc_b, desc_h, stride_ks, stride_kd, stride_vs, stride_vd,
    rows_abs, seq_k, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    ROW_GROUP: tl.constexpr, COL_GROUP: tl.constexpr, BITS_PER_ROW: tl.constexpr,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, CHECK_K_BOUNDS: tl.constexpr,
    USE_TMA: tl.constexpr, HOST_DESC: tl.constexpr, DOT_PRECISION: tl.constexpr,
    GATHER: tl.constexpr = False,
):
    """Accumulate dQ of one query tile over KV tiles ``start..end`` of its list.

    GATHER entries are gathered KV tiles, as in the forward: BITS_PER_ROW block indices per entry,
    keys loaded by pointer (always bounds-masked), and no causal rule (they lie before the tile).
    """
    ACC = dq.dtype
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    for e in range(start, end):
        if GATHER:
            blk = tl.load(cols_ptr + e * BITS_PER_ROW + offs_n // COL_GROUP)
            cols = blk * COL_GROUP + offs_n % COL_GROUP
        else:
            n = tl.load(cols_ptr + e)
            cols = n * BLOCK_N + offs_n
        k_ok = cols < seq_k
        if USE_TMA and HOST_DESC and not GATHER:
            # (batch, seq, heads, dim) descriptors made on the host: zero past seq_k and HEAD_DIM.
            k = k_desc.load([desc_b, n * BLOCK_N, desc_h, 0]).reshape(BLOCK_N, BLOCK_D)
            v = v_desc.load([desc_b, n * BLOCK_N, desc_h, 0]).reshape(BLOCK_N, BLOCK_D)
        elif USE_TMA and not GATHER:
            # The descriptors' shape (seq_k, HEAD_DIM) zero-fills past the end and the head dim.
            k = k_desc.load([n * BLOCK_N, 0])
            v = v_desc.load([n * BLOCK_N, 0])
        else:
            if MASKED or CHECK_K_BOUNDS or GATHER:
                kv_mask = k_ok[:, None] & d_ok[None, :]
            else:
                kv_mask = d_ok[None, :]
            cols64 = cols.to(tl.int64)  # position x stride passes 2^31 in long sequences
            k = tl.load(
                k_base + cols64[:, None] * stride_ks + offs_d[None, :] * stride_kd,
                mask=kv_mask, other=0.0,
            )
            v = tl.load(
                v_base + cols64[:, None] * stride_vs + offs_d[None, :] * stride_vd,
                mask=kv_mask, other=0.0,
            )
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION, out_dtype=ACC) * qk_scale
        p = tl.math.exp2(s - lse[:, None])
        if MASKED:
            keep = entry_keep(
                tl.load(bits_ptr + e), BLOCK_M, BLOCK_N, ROW_GROUP, COL_GROUP, BITS_PER_ROW, False
            ) & k_ok[None, :]
            if CAUSAL and not GATHER:
                keep = keep & (rows_abs[:, None] >= cols[None, :])
            p = tl.where(keep, p, 0.0)
        elif CHECK_K_BOUNDS or GATHER:
            p = tl.where(k_ok[None, :], p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION, out_dtype=ACC)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PRECISION, out_dtype=ACC)
    return dq


@triton.jit
def _dq_kernel(
    Q, K, V, dOut, Lse, Delta, dQ,
    offsets_full, cols_full, offsets_partial, cols_partial, bits_partial,
    g_offsets_full, g_blocks_full, g_offsets_partial, g_blocks_partial, g_bits_partial,
    cu_seqlens_q, cu_seqlens_k, K_desc, V_desc,
    stride_qb, stride_qs, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_gb, stride_gs, stride_gh, stride_gd,
    stride_dqb, stride_dqs, stride_dqh, stride_dqd,
    stride_lb, stride_lh, stride_ls,
    seqlen_q, seqlen_k, layout_tiles, grid_tiles, heads_per_group, qk_scale, softmax_scale,
    NUM_HEADS: tl.constexpr, GQA_GROUP: tl.constexpr, Q_HEADS_PER_PATTERN_HEAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ROW_GROUP: tl.constexpr, COL_GROUP: tl.constexpr, BITS_PER_ROW: tl.constexpr,
    CAUSAL: tl.constexpr, VARLEN: tl.constexpr, CHECK_K_BOUNDS: tl.constexpr,
    DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr, A_IN_REGS: tl.constexpr,
    HOST_DESC: tl.constexpr, GATHER: tl.constexpr,
):
    bh, tile_rank = program_order(tl.program_id(0), grid_tiles, heads_per_group)
    b = bh // NUM_HEADS
    h = bh % NUM_HEADS
    q_start, q_len, k_start, k_len = sequence_bounds(
        b, cu_seqlens_q, cu_seqlens_k, seqlen_q, seqlen_k, VARLEN
    )
    q_offset = k_len - q_len
    tile = (k_len - 1) // BLOCK_M - tile_rank  # heaviest tiles first, as in the forward
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
    )
    do = tl.load(
        dOut + b64 * stride_gb + (q_start + rows[:, None]) * stride_gs + h64 * stride_gh
        + offs_d[None, :] * stride_gd,
        mask=row_mask, other=0.0,
    )
    if A_IN_REGS:
        # As in dK/dV: q and dO stay in registers as MMA A operands.
        q = tl.where(row_mask, q, 0.0)
        do = tl.where(row_mask, do, 0.0)
    l_off = b64 * stride_lb + h64 * stride_lh + (q_start + rows) * stride_ls
    lse = tl.load(Lse + l_off, mask=row_ok, other=float("inf")) * 1.4426950408889634
    delta = tl.load(Delta + l_off, mask=row_ok, other=0.0)
    k_base = K + b64 * stride_kb + k_start * stride_ks + kh64 * stride_kh
    v_base = V + b64 * stride_vb + k_start * stride_vs + kh64 * stride_vh
    if USE_TMA and HOST_DESC:
        k_desc = K_desc
        v_desc = V_desc
    elif USE_TMA:
        # Packed sequences: per-sequence descriptors, made per program.
        k_desc = tl.make_tensor_descriptor(
            k_base, shape=[k_len, HEAD_DIM], strides=[stride_ks, 1], block_shape=[BLOCK_N, BLOCK_D]
        )
        v_desc = tl.make_tensor_descriptor(
            v_base, shape=[k_len, HEAD_DIM], strides=[stride_vs, 1], block_shape=[BLOCK_N, BLOCK_D]
        )
    else:
        k_desc = k_base
        v_desc = v_base
    group = (h // Q_HEADS_PER_PATTERN_HEAD) * layout_tiles + tile
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=Lse.dtype.element_ty)
    # The unmasked full entries, the partial ones, then (GATHER) gathered full and partial ones.
    for kind in tl.static_range(2 + 2 * GATHER):
        if kind == 0:
            offsets, cols = offsets_full, cols_full
        elif kind == 1:
            offsets, cols = offsets_partial, cols_partial
        elif kind == 2:
            offsets, cols = g_offsets_full, g_blocks_full
        else:
            offsets, cols = g_offsets_partial, g_blocks_partial
        dq = _dq_entries(
            dq, q, do, lse, delta, cols, g_bits_partial if kind >= 2 else bits_partial,
            tl.load(offsets + group), tl.load(offsets + group + 1),
            k_base, v_base, k_desc, v_desc, b, h // GQA_GROUP, stride_ks, stride_kd, stride_vs,
            stride_vd, rows_abs, k_len, qk_scale,
            HEAD_DIM, BLOCK_M, BLOCK_N, BLOCK_D, ROW_GROUP, COL_GROUP, BITS_PER_ROW,
            kind % 2 == 1, CAUSAL, CHECK_K_BOUNDS, USE_TMA, HOST_DESC, DOT_PRECISION, kind >= 2,
        )
    dq *= softmax_scale
    tl.store(
        dQ + b64 * stride_dqb + (q_start + rows[:, None]) * stride_dqs + h64 * stride_dqh
        + offs_d[None, :] * stride_dqd,
        dq.to(dQ.dtype.element_ty), mask=row_mask,
    )


# Measured on H100 (benchmarks/tuning/sweep_kernels.py and sweep_tiles.py, 32k, V16, dim 128,
# bf16; docs/design.md): 64x64 tiles with 4 warps and 2 stages were best for both kernels
# among 20 and 16 configurations; TMA loads help both; dK/dV is fastest with 4 heads interleaved,
# dQ with one at a time. A_IN_REGS (MMA A operands kept in registers) measured slower in both.


@functools.cache
def default_dkdv_config(head_dim: int, dtype: torch.dtype) -> TritonBackwardConfig:
    """The measured launch of the dK/dV kernels for a head dim and dtype."""
    return _default_config(head_dim, dtype, heads_per_group=4)


@functools.cache
def default_dq_config(head_dim: int, dtype: torch.dtype, block_m: int) -> TritonBackwardConfig:
    """The measured launch of the dQ kernel for a head dim, dtype and query tile height."""
    config = _default_config(head_dim, dtype, heads_per_group=1)
    if block_m > 64:
        return replace(config, num_warps=8)  # 128-row tiles (sm_90 layouts) spill at 4 warps
    return config


def _default_config(
    head_dim: int, dtype: torch.dtype, heads_per_group: int
) -> TritonBackwardConfig:
    wide = head_dim > 128 or dtype.itemsize > 2
    return TritonBackwardConfig(
        num_warps=8 if wide else 4,
        num_stages=1 if wide else 2,
        use_tma=True,
        heads_per_group=heads_per_group,
        a_in_regs=False,
    )


def _host_descriptors(use: bool, a: torch.Tensor, b: torch.Tensor, rows: int) -> tuple:
    """TMA descriptors of two (batch, seq, heads, dim) tensors, ``rows`` x dim blocks; when not
    used, the tensors themselves stand in (the kernel does not read them)."""
    if not use:
        return a, b
    block = [1, rows, 1, padded_head_dim(a.shape[-1])]
    return tuple(TensorDescriptor(t, list(t.shape), list(t.stride()), block) for t in (a, b))


def dkdv(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
    layout: TileLayout,
    *,
    softmax_scale: float,
    q_heads_per_pattern_head: int,
    varlen: Varlen | None,
    config: TritonBackwardConfig,
    contiguous: bool = True,
) -> None:
    """Fill ``dk`` and ``dv`` (like k) on a backward layout: the contiguous pass, then the
    gathered KV tiles' far uses when the layout has them. ``contiguous=False`` launches only the
    latter, on dK and dV that another kernel wrote. Shapes as :func:`s2attn.ops.dispatch.backward`
    takes them; ``config``'s fields left None take ``default_dkdv_config``."""
    gathered = layout.gathered_kv
    if not contiguous and gathered is None:
        return
    packed, batch, seqlen_q, seqlen_k = sequence_lengths(q, k, varlen)
    num_heads, head_dim, num_kv_heads = q.shape[-2], q.shape[-1], k.shape[-2]
    if gathered is not None and layout.num_heads != num_kv_heads:
        raise ValueError(
            "gathered KV tiles need one pattern head per KV head: build the dK/dV layout "
            "without gather for patterns over the query heads of a GQA group"
        )
    config = config.over(default_dkdv_config(head_dim, q.dtype))
    # Query tiles start before row 0 when there are fewer queries than keys (bottom-right
    # alignment); tensor descriptors take them only when none can.
    use_tma = (
        config.use_tma
        and not packed
        and seqlen_q == seqlen_k
        and tma_allowed(q.device, q, grad_out)
    )
    q_desc, do_desc = _host_descriptors(use_tma, q, grad_out, layout.block_m)
    (q4, q_st), (k4, k_st), (v4, v_st) = (as_batched(t, packed) for t in (q, k, v))
    (g4, g_st), (dk4, dk_st), (dv4, dv_st) = (as_batched(t, packed) for t in (grad_out, dk, dv))
    l_st = lse_strides(lse, packed)
    cu_q = varlen.cu_seqlens_q if packed else lse  # not read when not packed
    cu_k = varlen.cu_seqlens_k if packed else lse
    block_d = padded_head_dim(head_dim)
    dot = dot_precision(q.dtype)
    if contiguous:
        kv_tiles = math.ceil(seqlen_k / layout.block_n)
        group = heads_per_program_group(batch * num_kv_heads, config.heads_per_group)
        launcher_for(_dkdv_kernel)[(batch * num_kv_heads * kv_tiles,)](
            q4, k4, v4, g4, lse, delta, dk4, dv4,
            layout.full_offsets, layout.full_cols, layout.partial_offsets, layout.partial_cols,
            layout.partial_bits, cu_q, cu_k, q_desc, do_desc,
            *q_st, *k_st, *v_st, *g_st, *dk_st, *dv_st, *l_st,
            seqlen_q, seqlen_k, layout.num_groups, kv_tiles, group, softmax_scale * LOG2E,
            softmax_scale,
            NUM_KV_HEADS=num_kv_heads, GQA_GROUP=num_heads // num_kv_heads,
            Q_HEADS_PER_PATTERN_HEAD=q_heads_per_pattern_head, HEAD_DIM=head_dim,
            BLOCK_D=block_d, VARLEN=packed, DOT_PRECISION=dot, **layout_constexprs(layout),
            USE_TMA=use_tma, A_IN_REGS=config.a_in_regs,
            num_warps=config.num_warps, num_stages=config.num_stages,
        )
    if gathered is not None:
        g = gathered
        launcher_for(_dkdv_gathered_kernel)[(g.num_tiles * batch,)](
            q4, k4, v4, g4, lse, delta, dk4, dv4,
            g.heads, g.blocks, g.full_offsets, g.full_cols, g.partial_offsets, g.partial_cols,
            g.partial_bits, cu_q, cu_k, q_desc, do_desc,
            *q_st, *k_st, *v_st, *g_st, *dk_st, *dv_st, *l_st,
            seqlen_q, seqlen_k, batch, softmax_scale * LOG2E, softmax_scale,
            GQA_GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_D=block_d,
            BLOCK_M=layout.block_m, BLOCK_N=layout.block_n, ROW_GROUP=layout.row_group,
            COL_GROUP=layout.col_group, BITS_PER_ROW=layout.bits_per_row, VARLEN=packed,
            DOT_PRECISION=dot, USE_TMA=use_tma,
            num_warps=config.num_warps, num_stages=config.num_stages,
        )


def dq(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    dq: torch.Tensor,
    layout: TileLayout,
    *,
    softmax_scale: float,
    q_heads_per_pattern_head: int,
    varlen: Varlen | None,
    config: TritonBackwardConfig,
) -> None:
    """Fill ``dq`` (like q) on a forward layout, gathered entries included; shapes as
    :func:`s2attn.ops.dispatch.backward` takes them. ``config``'s fields left None take
    ``default_dq_config``."""
    packed, batch, seqlen_q, seqlen_k = sequence_lengths(q, k, varlen)
    num_heads, head_dim, num_kv_heads = q.shape[-2], q.shape[-1], k.shape[-2]
    config = config.over(default_dq_config(head_dim, q.dtype, layout.block_m))
    use_tma = config.use_tma and tma_allowed(q.device, k, v)
    # Descriptors made once here rather than per program; packed sequences need per-sequence
    # bounds, so the kernel makes its own there.
    host_desc = use_tma and not packed
    k_desc, v_desc = _host_descriptors(host_desc, k, v, layout.block_n)
    (q4, q_st), (k4, k_st), (v4, v_st) = (as_batched(t, packed) for t in (q, k, v))
    (g4, g_st), (dq4, dq_st) = as_batched(grad_out, packed), as_batched(dq, packed)
    cu_q = varlen.cu_seqlens_q if packed else lse  # not read when not packed
    cu_k = varlen.cu_seqlens_k if packed else lse
    num_tiles = query_tiles(layout.block_m, seqlen_q, seqlen_k, packed)
    group = heads_per_program_group(batch * num_heads, config.heads_per_group)
    launcher_for(_dq_kernel)[(batch * num_heads * num_tiles,)](
        q4, k4, v4, g4, lse, delta, dq4,
        layout.full_offsets, layout.full_cols, layout.partial_offsets, layout.partial_cols,
        layout.partial_bits, *gathered_lists(layout), cu_q, cu_k, k_desc, v_desc,
        *q_st, *k_st, *v_st, *g_st, *dq_st, *lse_strides(lse, packed),
        seqlen_q, seqlen_k, layout.num_groups, num_tiles, group, softmax_scale * LOG2E,
        softmax_scale,
        NUM_HEADS=num_heads, GQA_GROUP=num_heads // num_kv_heads,
        Q_HEADS_PER_PATTERN_HEAD=q_heads_per_pattern_head, HEAD_DIM=head_dim,
        BLOCK_D=padded_head_dim(head_dim), VARLEN=packed,
        CHECK_K_BOUNDS=check_k_bounds(layout, seqlen_k, packed),
        GATHER=layout.gather_width > 0, DOT_PRECISION=dot_precision(q.dtype),
        **layout_constexprs(layout), USE_TMA=use_tma, A_IN_REGS=config.a_in_regs,
        HOST_DESC=host_desc, num_warps=config.num_warps, num_stages=config.num_stages,
    )
