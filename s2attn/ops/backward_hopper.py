"""Warp-specialized dQ kernel for Hopper (sm_90), written in Gluon.

dQ walks the forward layout exactly as the forward does (ops/forward_hopper.py), so it shares that
kernel's producer partition and work-item order: a one-warp producer copies q and dO of each query
tile and the K/V tiles of its entries into shared-memory rings; two consumer warpgroups (64 query
rows each) compute, per entry,

    S = q K^T,  dP = dO V^T,  P = exp2(S * scale * log2(e) - LSE * log2(e)),
    dS = P * (dP - delta),    dQ += dS K,

with the two score MMAs of entry i issued right after dQ's MMA of entry i-1, so the elementwise
work of one entry runs under the tensor-core work of the next. No softmax rescaling: the LSE is
known. Same cases as the Gluon forward (``forward_hopper.supported``) at head dim 128, plus a dO
that qualifies for bulk copies; the Triton dQ kernel takes the rest (at dim 64 this kernel measured
no faster).
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from ..layout import TileLayout
from .forward_hopper import (
    _CONSUMER_REGS,
    _MAX_REGS,
    _PRODUCER_REGS,
    _PRODUCER_WARPS,
    _descriptor,
    _entries_reaching,
    _free_slots,
    _masked_scores,
    _num_sms,
    _producer,
    _snake_order,
    _store_rows,
    _wgmma_layout,
    _work_item,
)

__all__ = ["dq_hopper"]


@gluon.jit
def _dq_consumer(
    work, HALF: gl.constexpr, NUM_HEADS: gl.constexpr, PATTERN_HEAD_DIV: gl.constexpr,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
    ROW_GROUP: gl.constexpr, COL_GROUP: gl.constexpr, BITS_PER_ROW: gl.constexpr,
    CAUSAL: gl.constexpr,
):  # fmt: skip
    """One warpgroup: dQ of query rows HALF * ROWS.. of each of the program's query tiles."""
    (
        q_bufs, do_bufs, k_bufs, v_bufs, q_ready, q_empty, k_ready, v_ready, kv_empty, dQ, Lse,
        Delta, full_offsets, full_cols, partial_offsets, partial_cols, partial_bits,
        stride_qb, stride_qs, stride_qh, stride_lb, stride_lh, stride_ls,
        seqlen_q, seqlen_k, layout_tiles, grid_tiles, heads_per_group, num_items, snake, qk_scale,
        softmax_scale,
    ) = work  # fmt: skip
    ROWS: gl.constexpr = BLOCK_M // 2
    num_buffers: gl.constexpr = k_bufs.type.shape[0]
    dtype: gl.constexpr = q_bufs.dtype
    s_layout: gl.constexpr = _wgmma_layout(BLOCK_N)
    o_layout: gl.constexpr = _wgmma_layout(HEAD_DIM)
    ds_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    pid = gl.program_id(0)
    num_programs = gl.num_programs(0)
    q_offset = seqlen_k - seqlen_q
    s_zero = gl.zeros([ROWS, BLOCK_N], gl.float32, layout=s_layout)
    c = 0  # K/V ring position, across work items
    for t in range(pid, num_items, num_programs):
        j = (t - pid) // num_programs
        item = _snake_order(t, num_programs, num_items, snake)
        b, h, tile, full_start, n_full, partial_start, n_total = _work_item(
            item, full_offsets, partial_offsets, seqlen_k, layout_tiles, grid_tiles,
            heads_per_group, NUM_HEADS, PATTERN_HEAD_DIV, BLOCK_M,
        )  # fmt: skip
        q_row0 = tile * BLOCK_M + HALF * ROWS  # absolute position of this warpgroup's first row
        rows_abs = q_row0 + gl.arange(0, ROWS, layout=row_s)
        rows = rows_abs - q_offset
        row_ok = (rows >= 0) & (rows < seqlen_q)
        l_off = b.to(gl.int64) * stride_lb + h.to(gl.int64) * stride_lh + rows * stride_ls
        # Rows past the sequence and rows that attend nothing (LSE -inf) take LSE +inf, so
        # every P of theirs is exp2(-inf) = 0, never NaN.
        lse = gl.load(Lse + l_off, mask=row_ok, other=float("inf"))
        lse = gl.where(lse == float("-inf"), float("inf"), lse) * 1.4426950408889634
        delta = gl.load(Delta + l_off, mask=row_ok, other=0.0)
        acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, layout=o_layout)
        n_mine = _entries_reaching(
            partial_cols, partial_start, n_full, n_total, q_row0 + ROWS - 1, BLOCK_N, CAUSAL
        )
        mbarrier.wait(q_ready.index(j % 2), (j // 2) & 1)
        q = q_bufs.index(j % 2).reshape([BLOCK_M, HEAD_DIM]).slice(HALF * ROWS, ROWS)
        do = do_bufs.index(j % 2).reshape([BLOCK_M, HEAD_DIM]).slice(HALF * ROWS, ROWS)
        if n_mine > 0:
            # Entry 0: dS only; its dQ MMA is issued behind entry 1's score MMAs.
            buf = c % num_buffers
            mbarrier.wait(k_ready.index(buf), (c // num_buffers) & 1)
            k = k_bufs.index(buf).reshape([BLOCK_N, HEAD_DIM])
            s = warpgroup_mma(q, k.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            mbarrier.wait(v_ready.index(buf), (c // num_buffers) & 1)
            v = v_bufs.index(buf).reshape([BLOCK_N, HEAD_DIM])
            dp = warpgroup_mma(do, v.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            s, dp = warpgroup_mma_wait(0, deps=[s, dp])
            if n_full == 0:
                s = _masked_scores(
                    s, 0, full_cols, partial_cols, partial_bits, full_start, partial_start,
                    n_full, n_total, rows_abs, seqlen_k, s_layout, ROWS, BLOCK_N, 1,
                    HALF * ROWS, ROW_GROUP, COL_GROUP, BITS_PER_ROW, CAUSAL,
                )  # fmt: skip
            p = gl.exp2(s * qk_scale - lse[:, None])
            ds_op = gl.convert_layout((p * (dp - delta[:, None])).to(dtype), ds_layout)
            for e in range(1, n_mine):
                buf = (c + e) % num_buffers
                prev = (c + e - 1) % num_buffers
                phase = ((c + e) // num_buffers) & 1
                mbarrier.wait(k_ready.index(buf), phase)
                k = k_bufs.index(buf).reshape([BLOCK_N, HEAD_DIM])
                s = warpgroup_mma(q, k.permute((1, 0)), s_zero, use_acc=False, is_async=True)
                mbarrier.wait(v_ready.index(buf), phase)
                v = v_bufs.index(buf).reshape([BLOCK_N, HEAD_DIM])
                dp = warpgroup_mma(do, v.permute((1, 0)), s_zero, use_acc=False, is_async=True)
                k_prev = k_bufs.index(prev).reshape([BLOCK_N, HEAD_DIM])
                acc = warpgroup_mma(ds_op, k_prev, acc, is_async=True)
                # The score MMAs are done when at most the dQ MMA just issued still runs.
                s, dp = warpgroup_mma_wait(1, deps=[s, dp])
                if e >= n_full:
                    s = _masked_scores(
                        s, e, full_cols, partial_cols, partial_bits, full_start, partial_start,
                        n_full, n_total, rows_abs, seqlen_k, s_layout, ROWS, BLOCK_N, 1,
                        HALF * ROWS, ROW_GROUP, COL_GROUP, BITS_PER_ROW, CAUSAL,
                    )  # fmt: skip
                p = gl.exp2(s * qk_scale - lse[:, None])
                ds = (p * (dp - delta[:, None])).to(dtype)
                acc = warpgroup_mma_wait(0, deps=[acc])
                mbarrier.arrive(kv_empty.index(prev))
                ds_op = gl.convert_layout(ds, ds_layout)
            last = (c + n_mine - 1) % num_buffers
            k_last = k_bufs.index(last).reshape([BLOCK_N, HEAD_DIM])
            acc = warpgroup_mma(ds_op, k_last, acc, is_async=True)
            acc = warpgroup_mma_wait(0, deps=[acc])
            mbarrier.arrive(kv_empty.index(last))
        _free_slots(k_ready, v_ready, kv_empty, c + n_mine, c + n_total)
        mbarrier.arrive(q_empty.index(j % 2))
        c += n_total

        out_rows = q_row0 - q_offset + gl.arange(0, ROWS, layout=row_o)
        base = dQ + b.to(gl.int64) * stride_qb + h.to(gl.int64) * stride_qh
        _store_rows(base, out_rows, (acc * softmax_scale).to(dtype), stride_qs, seqlen_q, o_layout)


@gluon.jit
def _dq_kernel(
    q_desc, do_desc, k_desc, v_desc, dQ, Lse, Delta,
    full_offsets, full_cols, partial_offsets, partial_cols, partial_bits,
    stride_qb, stride_qs, stride_qh, stride_lb, stride_lh, stride_ls,
    seqlen_q, seqlen_k, layout_tiles, grid_tiles, heads_per_group, num_items, snake, qk_scale,
    softmax_scale,
    NUM_HEADS: gl.constexpr, GQA_GROUP: gl.constexpr, PATTERN_HEAD_DIV: gl.constexpr,
    HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    ROW_GROUP: gl.constexpr, COL_GROUP: gl.constexpr, BITS_PER_ROW: gl.constexpr,
    CAUSAL: gl.constexpr, NUM_BUFFERS: gl.constexpr,
):  # fmt: skip
    """Persistent: each program takes work items (head, query tile) pid, pid + grid, ..."""
    dtype: gl.constexpr = q_desc.dtype
    q_bufs = gl.allocate_shared_memory(dtype, [2] + q_desc.block_type.shape, q_desc.layout)
    do_bufs = gl.allocate_shared_memory(dtype, [2] + do_desc.block_type.shape, do_desc.layout)
    kv_shape: gl.constexpr = [NUM_BUFFERS] + k_desc.block_type.shape
    k_bufs = gl.allocate_shared_memory(dtype, kv_shape, k_desc.layout)
    v_bufs = gl.allocate_shared_memory(dtype, kv_shape, v_desc.layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [NUM_BUFFERS, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [NUM_BUFFERS, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [NUM_BUFFERS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=2)  # one release per consumer warpgroup
    for i in gl.static_range(NUM_BUFFERS):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(kv_empty.index(i), count=2)

    # One tuple of shared arguments, constexprs apart (see ops/forward_hopper.py).
    work = (
        q_bufs, do_bufs, k_bufs, v_bufs, q_ready, q_empty, k_ready, v_ready, kv_empty, dQ, Lse,
        Delta, full_offsets, full_cols, partial_offsets, partial_cols, partial_bits,
        stride_qb, stride_qs, stride_qh, stride_lb, stride_lh, stride_ls,
        seqlen_q, seqlen_k, layout_tiles, grid_tiles, heads_per_group, num_items, snake, qk_scale,
        softmax_scale,
    )  # fmt: skip
    gl.warp_specialize(
        [
            (
                _dq_consumer,
                (
                    work, 0, NUM_HEADS, PATTERN_HEAD_DIV, BLOCK_M, BLOCK_N, HEAD_DIM, ROW_GROUP,
                    COL_GROUP, BITS_PER_ROW, CAUSAL,
                ),
            ),
            (
                _dq_consumer,
                (
                    work, 1, NUM_HEADS, PATTERN_HEAD_DIV, BLOCK_M, BLOCK_N, HEAD_DIM, ROW_GROUP,
                    COL_GROUP, BITS_PER_ROW, CAUSAL,
                ),
            ),
            (
                _producer,
                (
                    q_desc, k_desc, v_desc, q_bufs, k_bufs, v_bufs, q_ready, q_empty, k_ready,
                    v_ready, kv_empty, full_offsets, full_cols, partial_offsets, partial_cols,
                    seqlen_q, seqlen_k, layout_tiles, grid_tiles, heads_per_group, num_items, snake,
                    NUM_HEADS, GQA_GROUP, PATTERN_HEAD_DIV, BLOCK_M, BLOCK_N, 1, do_desc,
                    do_bufs, True,
                ),
            ),
        ],
        [4, _PRODUCER_WARPS],
        [_CONSUMER_REGS, _PRODUCER_REGS],
    )  # fmt: skip


def dq_hopper(
    grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    lse: torch.Tensor, delta: torch.Tensor, dq: torch.Tensor, layout: TileLayout, *,
    softmax_scale: float, pattern_head_div: int, num_tiles: int, num_buffers: int = 3,
    persistent: bool = True, snake: bool = True,
) -> None:  # fmt: skip
    """Fill ``dq`` (like q) for batched inputs; ``lse`` and ``delta`` are (batch, heads, seq_q)."""
    from .common import LOG2E

    batch, seqlen_q, num_heads, head_dim = q.shape
    num_items = batch * num_heads * num_tiles
    grid = min(num_items, _num_sms(q.device)) if persistent else num_items
    _dq_kernel[(grid,)](
        _descriptor(q, layout.block_m), _descriptor(grad_out, layout.block_m),
        _descriptor(k, layout.block_n), _descriptor(v, layout.block_n), dq, lse, delta,
        layout.full_offsets, layout.full_cols,
        layout.partial_offsets, layout.partial_cols, layout.partial_bits,
        dq.stride(0), dq.stride(1), dq.stride(2), *lse.stride(),
        seqlen_q, k.shape[1], layout.num_groups, num_tiles, 1, num_items, int(snake),
        softmax_scale * LOG2E, softmax_scale,
        NUM_HEADS=num_heads,
        GQA_GROUP=num_heads // k.shape[-2],
        PATTERN_HEAD_DIV=pattern_head_div,
        HEAD_DIM=head_dim,
        BLOCK_M=layout.block_m,
        BLOCK_N=layout.block_n,
        ROW_GROUP=layout.row_group,
        COL_GROUP=layout.col_group,
        BITS_PER_ROW=layout.bits_per_row,
        CAUSAL=layout.causal,
        NUM_BUFFERS=num_buffers,
        num_warps=4,
        maxnreg=_MAX_REGS,
    )  # fmt: skip
