"""Warp-specialized backward kernels for Hopper (sm_90), written in Gluon: dQ and dK/dV, and
their launchers.

dQ walks the forward layout exactly as the forward does (``forward_sm90.py``), so it shares that
kernel's producer partition and work-item order (``common_sm90.py``): a one-warp producer copies
q and dO of each query tile and the K/V tiles of its entries into shared-memory rings; two
consumer warpgroups (64 query rows each) compute, per entry,

    S = q K^T,  dP = dO V^T,  P = exp2(S * scale * log2(e) - LSE * log2(e)),
    dS = P * (dP - delta),    dQ += dS K,

with the two score MMAs of entry i issued right after dQ's MMA of entry i-1, so the elementwise
work of one entry runs under the tensor-core work of the next. No softmax rescaling: the LSE is
known. Each query row is in exactly one work item, so the kernel also computes the row's
delta = rowsum(dO * O) - dLSE itself (the producer copies O with q and dO) and writes it, with
LSE * log2(e), for the dK/dV pass that runs after it: no separate pass over O and dO. Same cases
as the Gluon forward at head dim 128, plus dO and O that qualify for bulk copies
(``ops/backends.py``, the ``DQ`` table); the Triton dQ kernel takes the rest (at dim 64
this kernel measured no faster).

dK/dV: see the section below.
"""

from __future__ import annotations

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ...memory import build_outside_graph_pool
from ..launcher import Launcher
from ..layout import TileLayout
from ..options import GluonDkdvConfig, GluonDqConfig
from ..shapes import LOG2E, heads_per_program_group, layout_constexprs, query_tiles
from .common_sm90 import (
    MAX_REGS,
    alloc_item_slots,
    entry_col,
    entry_list,
    free_slots,
    get_item,
    item_counter,
    leave_counter_at_zero,
    masked_scores,
    next_run,
    num_sms,
    put_item,
    query_item,
    query_tile_producer,
    ring_slot,
    store_rows,
    take_item,
    tma_descriptor,
    unchecked_descriptor,
    warp_specialize,
    wgmma_layout,
)
from .dkdv_queue_sm90 import dkdv_order

__all__ = ["default_dkdv_config", "default_dq_config", "dkdv", "dq"]


@gluon.jit
def _dq_step(
    q, do, k_bufs, v_bufs, k_ready, v_ready, kv_empty, pos, held_pos, ds, acc, lse, delta,
    masked, e, full_cols, partial_cols, partial_bits, full_start, partial_start, n_full,
    n_total, rows_abs, seq_k, qk_scale, s_zero, ROWS: gl.constexpr, BLOCK_N: gl.constexpr,
    ROW_START: gl.constexpr, ROW_GROUP: gl.constexpr, COL_GROUP: gl.constexpr,
    BITS_PER_ROW: gl.constexpr, CAUSAL: gl.constexpr,
):
    """One entry at ring position ``pos``: its score MMAs run beside the dQ MMA of the entry
    held at ``held_pos`` (whose dS is ``ds``; the MMA frees its slot). Returns (this entry's
    dS, acc)."""
    num_buffers: gl.constexpr = k_bufs.type.shape[0]
    head_dim: gl.constexpr = k_bufs.type.shape[-1]
    s_layout: gl.constexpr = s_zero.type.layout
    ds_layout: gl.constexpr = gl.DotOperandLayout(
        operand_index=0, parent=acc.type.layout, k_width=2
    )
    buf, phase = ring_slot(pos, num_buffers)
    prev, _ = ring_slot(held_pos, num_buffers)
    # dS travels between steps in the scores' layout and becomes an MMA operand here, as the
    # forward's P does.
    ds_op = gl.convert_layout(ds, ds_layout)
    mbarrier.wait(k_ready.index(buf), phase)
    k = k_bufs.index(buf).reshape([BLOCK_N, head_dim])
    s = warpgroup_mma(q, k.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    mbarrier.wait(v_ready.index(buf), phase)
    v = v_bufs.index(buf).reshape([BLOCK_N, head_dim])
    dp = warpgroup_mma(do, v.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    k_prev = k_bufs.index(prev).reshape([BLOCK_N, head_dim])
    acc = warpgroup_mma(ds_op, k_prev, acc, is_async=True)
    # The score MMAs are done when at most the dQ MMA just issued still runs.
    s, dp = warpgroup_mma_wait(1, deps=[s, dp])
    if masked:
        s = masked_scores(
            s, e, full_cols, partial_cols, partial_bits, full_start, partial_start, n_full,
            n_total, rows_abs, seq_k, s_layout, ROWS, BLOCK_N, 1, ROW_START, ROW_GROUP,
            COL_GROUP, BITS_PER_ROW, CAUSAL,
        )
    p = gl.exp2(s * qk_scale - lse[:, None])
    ds = (p * (dp - delta[:, None])).to(k_bufs.dtype)
    acc = warpgroup_mma_wait(0, deps=[acc])
    mbarrier.arrive(kv_empty.index(prev))
    return ds, acc


@gluon.jit
def _dq_consumer(
    HALF: gl.constexpr, work, NUM_HEADS: gl.constexpr, BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
    ROW_GROUP: gl.constexpr, COL_GROUP: gl.constexpr, BITS_PER_ROW: gl.constexpr,
    CAUSAL: gl.constexpr, HAS_DLSE: gl.constexpr, HAS_STATS: gl.constexpr,
):
    """One warpgroup: dQ of query rows HALF * ROWS.. of each of the program's query tiles. q and
    dO are MMA operands from registers, so per entry the MMAs read only K and V from shared
    memory, whose bandwidth bounds this kernel; the tile's slot is free once they are loaded."""
    (
        q_bufs, do_bufs, o_bufs, k_bufs, v_bufs, q_ready, q_empty, k_ready, v_ready, kv_empty,
        item_slots, dQ, Lse, dLse, Delta, Stats, full_cols, partial_cols, partial_bits,
        stride_qb, stride_qs, stride_qh, stride_lb, stride_lh, stride_ls, stride_dlb, stride_dlh,
        stride_dls, stats_seq, seqlen_q, seqlen_k, num_items, qk_scale, softmax_scale,
    ) = work
    ROWS: gl.constexpr = BLOCK_M // 2
    num_buffers: gl.constexpr = k_bufs.type.shape[0]
    dtype: gl.constexpr = q_bufs.dtype
    s_layout: gl.constexpr = wgmma_layout(BLOCK_N)
    o_layout: gl.constexpr = wgmma_layout(HEAD_DIM)
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2)
    ds_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    q_slots: gl.constexpr = q_bufs.type.shape[0]
    q_offset = seqlen_k - seqlen_q
    s_zero = gl.zeros([ROWS, BLOCK_N], gl.float32, layout=s_layout)
    c = 0  # K/V ring position, across work items
    j = 0  # work items taken
    t = take_item(q_ready, item_slots, 0)
    while t < num_items:
        slot = j % q_slots
        b, h, tile, full_start, n_full, partial_start, n_total, n_mine = query_item(
            item_slots, slot, HALF
        )
        q_row0 = tile * BLOCK_M + HALF * ROWS  # absolute position of this warpgroup's first row
        rows_abs = q_row0 + gl.arange(0, ROWS, layout=row_s)
        rows = rows_abs - q_offset
        row_ok = (rows >= 0) & (rows < seqlen_q)
        l_off = b.to(gl.int64) * stride_lb + h.to(gl.int64) * stride_lh + rows * stride_ls
        lse = gl.load(Lse + l_off, mask=row_ok, other=float("inf")) * 1.4426950408889634
        acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, layout=o_layout)
        q = q_bufs.index(slot).reshape([BLOCK_M, HEAD_DIM]).slice(HALF * ROWS, ROWS).load(a_layout)
        do = do_bufs.index(slot).reshape([BLOCK_M, HEAD_DIM]).slice(HALF * ROWS, ROWS)
        do = do.load(a_layout)
        o = o_bufs.index(slot).reshape([BLOCK_M, HEAD_DIM]).slice(HALF * ROWS, ROWS)
        delta = gl.sum(o.load(a_layout).to(gl.float32) * do.to(gl.float32), axis=1)
        mbarrier.arrive(q_empty.index(slot))  # read: the next tile's copies may start
        delta = gl.convert_layout(delta, row_s)
        if HAS_DLSE:
            # dLSE comes from autograd in any layout (e.g. expanded by lse.sum()): its strides.
            dl_off = b.to(gl.int64) * stride_dlb + h.to(gl.int64) * stride_dlh + rows * stride_dls
            delta -= gl.load(dLse + dl_off, mask=row_ok, other=0.0)
        gl.store(Delta + l_off, delta, mask=row_ok)
        if HAS_STATS:
            s_off = (b * NUM_HEADS + h).to(gl.int64) * 2 * stats_seq + rows
            gl.store(Stats + s_off, lse, mask=row_ok)
            gl.store(Stats + stats_seq + s_off, delta, mask=row_ok)
        # Rows past the sequence and rows that attend nothing (LSE -inf) take LSE +inf, so
        # every P of theirs is exp2(-inf) = 0, never NaN.
        lse = gl.where(lse == float("-inf"), float("inf"), lse)
        # Entries that no row of this warpgroup sees are skipped, as in the forward.
        first, masked = next_run(
            n_mine * 0, n_mine, n_mine, partial_cols, partial_bits, partial_start, n_full,
            n_total, q_row0, seqlen_k, ROWS, BLOCK_N, 1, HALF * ROWS, ROW_GROUP, BITS_PER_ROW,
            CAUSAL, num_buffers,
        )
        free_slots(k_ready, v_ready, kv_empty, c, c + first)
        if first < n_mine:
            # The first entry: dS only; its dQ MMA is issued behind the next entry's score MMAs.
            buf, phase = ring_slot(c + first, num_buffers)
            mbarrier.wait(k_ready.index(buf), phase)
            k = k_bufs.index(buf).reshape([BLOCK_N, HEAD_DIM])
            s = warpgroup_mma(q, k.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            mbarrier.wait(v_ready.index(buf), phase)
            v = v_bufs.index(buf).reshape([BLOCK_N, HEAD_DIM])
            dp = warpgroup_mma(do, v.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            s, dp = warpgroup_mma_wait(0, deps=[s, dp])
            if masked:
                s = masked_scores(
                    s, first, full_cols, partial_cols, partial_bits, full_start, partial_start,
                    n_full, n_total, rows_abs, seqlen_k, s_layout, ROWS, BLOCK_N, 1,
                    HALF * ROWS, ROW_GROUP, COL_GROUP, BITS_PER_ROW, CAUSAL,
                )
            p = gl.exp2(s * qk_scale - lse[:, None])
            ds = (p * (dp - delta[:, None])).to(dtype)
            held = first  # the entry whose dQ MMA is pending
            # Full entries, then the rest, which may be skipped or masked (two loops, as in the
            # forward).
            full_end = gl.maximum(gl.minimum(n_full, n_mine), first + 1)
            for e in range(first + 1, full_end):
                ds, acc = _dq_step(
                    q, do, k_bufs, v_bufs, k_ready, v_ready, kv_empty, c + e, c + held, ds, acc,
                    lse, delta, False, e, full_cols, partial_cols, partial_bits, full_start,
                    partial_start, n_full, n_total, rows_abs, seqlen_k, qk_scale, s_zero, ROWS,
                    BLOCK_N, HALF * ROWS, ROW_GROUP, COL_GROUP, BITS_PER_ROW, CAUSAL,
                )
                held = e
            e, masked = next_run(
                full_end, n_mine, held, partial_cols, partial_bits, partial_start, n_full,
                n_total, q_row0, seqlen_k, ROWS, BLOCK_N, 1, HALF * ROWS, ROW_GROUP,
                BITS_PER_ROW, CAUSAL, num_buffers,
            )
            while e < n_mine:
                free_slots(k_ready, v_ready, kv_empty, c + held + 1, c + e)  # skipped
                ds, acc = _dq_step(
                    q, do, k_bufs, v_bufs, k_ready, v_ready, kv_empty, c + e, c + held, ds, acc,
                    lse, delta, masked, e, full_cols, partial_cols, partial_bits, full_start,
                    partial_start, n_full, n_total, rows_abs, seqlen_k, qk_scale, s_zero, ROWS,
                    BLOCK_N, HALF * ROWS, ROW_GROUP, COL_GROUP, BITS_PER_ROW, CAUSAL,
                )
                held = e
                e, masked = next_run(
                    e + 1, n_mine, held, partial_cols, partial_bits, partial_start, n_full,
                    n_total, q_row0, seqlen_k, ROWS, BLOCK_N, 1, HALF * ROWS, ROW_GROUP,
                    BITS_PER_ROW, CAUSAL, num_buffers,
                )
            last, _ = ring_slot(c + held, num_buffers)
            k_last = k_bufs.index(last).reshape([BLOCK_N, HEAD_DIM])
            acc = warpgroup_mma(gl.convert_layout(ds, ds_layout), k_last, acc, is_async=True)
            acc = warpgroup_mma_wait(0, deps=[acc])
            mbarrier.arrive(kv_empty.index(last))
            first = held + 1  # entries from here on are skipped
        free_slots(k_ready, v_ready, kv_empty, c + first, c + n_total)
        c += n_total

        out_rows = q_row0 - q_offset + gl.arange(0, ROWS, layout=row_o)
        base = dQ + b.to(gl.int64) * stride_qb + h.to(gl.int64) * stride_qh
        store_rows(base, out_rows, (acc * softmax_scale).to(dtype), stride_qs, seqlen_q, o_layout)
        j += 1
        t = take_item(q_ready, item_slots, j)


@gluon.jit
def _dq_kernel(
    q_desc, do_desc, o_desc, k_desc, v_desc, dQ, Lse, dLse, Delta, Stats, counter,
    full_offsets, full_cols, partial_offsets, partial_cols, partial_bits,
    stride_qb, stride_qs, stride_qh, stride_lb, stride_lh, stride_ls,
    stride_dlb, stride_dlh, stride_dls, stats_seq,
    seqlen_q, seqlen_k, layout_tiles, grid_tiles, heads_per_group, num_items, qk_scale,
    softmax_scale,
    NUM_HEADS: gl.constexpr, GQA_GROUP: gl.constexpr, Q_HEADS_PER_PATTERN_HEAD: gl.constexpr,
    HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    ROW_GROUP: gl.constexpr, COL_GROUP: gl.constexpr, BITS_PER_ROW: gl.constexpr,
    CAUSAL: gl.constexpr, NUM_BUFFERS: gl.constexpr, HAS_DLSE: gl.constexpr,
    HAS_STATS: gl.constexpr,
):
    """Persistent: each program takes work items (head, query tile) from ``counter`` (zero at
    launch) until none is left. q, dO and O have one slot each: the consumers take them into
    registers at the tile's start, so the next tile's copies have the whole tile to land."""
    dtype: gl.constexpr = q_desc.dtype
    tile_shape: gl.constexpr = [1] + q_desc.block_type.shape
    q_bufs = gl.allocate_shared_memory(dtype, tile_shape, q_desc.layout)
    do_bufs = gl.allocate_shared_memory(dtype, tile_shape, do_desc.layout)
    o_bufs = gl.allocate_shared_memory(dtype, tile_shape, o_desc.layout)
    kv_shape: gl.constexpr = [NUM_BUFFERS] + k_desc.block_type.shape
    k_bufs = gl.allocate_shared_memory(dtype, kv_shape, k_desc.layout)
    v_bufs = gl.allocate_shared_memory(dtype, kv_shape, v_desc.layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [NUM_BUFFERS, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [NUM_BUFFERS, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [NUM_BUFFERS, 1], mbarrier.MBarrierLayout())
    item_slots = alloc_item_slots(1)
    mbarrier.init(q_ready.index(0), count=1)
    mbarrier.init(q_empty.index(0), count=2)  # one release per consumer warpgroup
    for i in gl.static_range(NUM_BUFFERS):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(kv_empty.index(i), count=2)

    # One tuple of shared arguments, constexprs apart (see forward_sm90.py).
    work = (
        q_bufs, do_bufs, o_bufs, k_bufs, v_bufs, q_ready, q_empty, k_ready, v_ready, kv_empty,
        item_slots, dQ, Lse, dLse, Delta, Stats, full_cols, partial_cols, partial_bits,
        stride_qb, stride_qs, stride_qh, stride_lb, stride_lh, stride_ls, stride_dlb, stride_dlh,
        stride_dls, stats_seq, seqlen_q, seqlen_k, num_items, qk_scale, softmax_scale,
    )
    warp_specialize(
        _dq_consumer,
        (
            work, NUM_HEADS, BLOCK_M, BLOCK_N, HEAD_DIM, ROW_GROUP, COL_GROUP, BITS_PER_ROW,
            CAUSAL, HAS_DLSE, HAS_STATS,
        ),
        query_tile_producer,
        (
            q_desc, k_desc, v_desc, q_bufs, k_bufs, v_bufs, q_ready, q_empty, k_ready, v_ready,
            kv_empty, full_offsets, full_cols, partial_offsets, partial_cols, seqlen_q, seqlen_k,
            layout_tiles, grid_tiles, heads_per_group, num_items, counter, item_slots, NUM_HEADS,
            GQA_GROUP, Q_HEADS_PER_PATTERN_HEAD, BLOCK_M, BLOCK_N, 1, CAUSAL, do_desc, do_bufs,
            o_desc, o_bufs, True,
        ),
        1,
    )


_DQ = Launcher(_dq_kernel)  # repeat launches skip Triton's binding (see forward_sm90.py)


def default_dq_config() -> GluonDqConfig:
    """The measured dQ launch: a ring of 3 K/V slots, persistent programs, one head's tiles at a
    time."""
    return GluonDqConfig(num_buffers=3, persistent=True, heads_per_group=1)


def dq(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    grad_lse: torch.Tensor | None,
    delta: torch.Tensor,
    stats: torch.Tensor | None,
    dq: torch.Tensor,
    layout: TileLayout,
    *,
    softmax_scale: float,
    q_heads_per_pattern_head: int,
    config: GluonDqConfig,
) -> None:
    """Fill ``dq`` (like q) and ``delta`` (like ``lse``: (batch, heads, seq_q)) for batched
    inputs on a 128x64 forward layout; with ``stats`` also the dK/dV kernel's row statistics (see
    ``dkdv``). ``config``'s fields left None take ``default_dq_config``."""
    batch, seqlen_q, num_heads, head_dim = q.shape
    config = config.over(default_dq_config())
    num_tiles = query_tiles(layout.block_m, seqlen_q, k.shape[1], False)
    num_items = batch * num_heads * num_tiles
    grid = min(num_items, num_sms(q.device)) if config.persistent else num_items
    heads_per_group = heads_per_program_group(batch * num_heads, config.heads_per_group)
    _DQ[(grid,)](
        tma_descriptor(q, layout.block_m), tma_descriptor(grad_out, layout.block_m),
        tma_descriptor(out, layout.block_m), tma_descriptor(k, layout.block_n),
        tma_descriptor(v, layout.block_n), dq, lse, lse if grad_lse is None else grad_lse, delta,
        delta if stats is None else stats, item_counter(q.device),
        layout.full_offsets, layout.full_cols,
        layout.partial_offsets, layout.partial_cols, layout.partial_bits,
        dq.stride(0), dq.stride(1), dq.stride(2), *lse.stride(),
        *(lse if grad_lse is None else grad_lse).stride(),
        0 if stats is None else stats.shape[-1],
        seqlen_q, k.shape[1], layout.num_groups, num_tiles, heads_per_group, num_items,
        softmax_scale * LOG2E, softmax_scale,
        NUM_HEADS=num_heads,
        GQA_GROUP=num_heads // k.shape[-2],
        Q_HEADS_PER_PATTERN_HEAD=q_heads_per_pattern_head,
        HEAD_DIM=head_dim,
        **layout_constexprs(layout),
        NUM_BUFFERS=config.num_buffers,
        HAS_DLSE=grad_lse is not None,
        HAS_STATS=stats is not None,
        num_warps=4,
        maxnreg=MAX_REGS,
    )


# ------------------------------------------------------------------------------------- dK/dV
# A work item is (batch, KV head, KV tile of BLOCK_N keys) of the backward layout; its entries are
# the query tiles that read the KV tile, for every query head of the KV head's GQA group in turn,
# so the group's sum stays in registers. Each program runs two independent *streams* of items,
# each a one-warp producer and a one-warpgroup consumer with their own buffers: the two consumers
# share the tensor cores, one's MMAs running while the other does elementwise work.
#
# Lists are very uneven (a stride tile's list spans the sequence, a local tile's is a window), so
# streams take items from a global counter as they finish, in ``dkdv_order``: a group of heads at
# a time, longest list first. Full entries are walked from the last query tile down: the long
# lists of a head all end at its last tile, so items started together read the same q and dO
# tiles at about the same time, from L2.


@gluon.jit
def _dkdv_item(order, t, kv_tiles, NUM_KV_HEADS: gl.constexpr):
    """(b, kv_head, kv_tile) of the ``t``-th item in ``order``."""
    item = gl.load(order + t)
    bkv = item // kv_tiles
    return bkv // NUM_KV_HEADS, bkv % NUM_KV_HEADS, item % kv_tiles


@gluon.jit
def _dkdv_producer(
    STREAM: gl.constexpr, q_desc, do_desc, k_desc, v_desc, stats_desc, q_bufs, do_bufs, k_bufs,
    v_bufs, stats_bufs, kv_ready, kv_empty, qd_ready, qd_empty, item_slots, counter, order,
    full_offsets, full_cols, partial_offsets, partial_cols, kv_tiles, layout_tiles, num_items,
    NUM_HEADS: gl.constexpr, NUM_KV_HEADS: gl.constexpr,
    GQA_GROUP: gl.constexpr, Q_HEADS_PER_PATTERN_HEAD: gl.constexpr, BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
):
    """Takes items from the counter; copies each item's K and V tiles, then q, dO and the row
    statistics (LSE * log2(e), delta) of every query tile in its lists into the stream's ring.
    Past the last item it hands the consumer an index >= num_items."""
    num_buffers: gl.constexpr = q_bufs.type.shape[0] // 2
    c = 0
    j = 0
    t = gl.atomic_add(counter, 1)
    while t < num_items:
        b, kv_head, n = _dkdv_item(order, t, kv_tiles, NUM_KV_HEADS)
        # The K/V slot starts free: the first wait is on the phase before the barrier's first.
        mbarrier.wait(kv_empty.index(STREAM), (j & 1) ^ 1)
        put_item(item_slots, STREAM, t)
        mbarrier.expect(kv_ready.index(STREAM), 2 * k_desc.block_type.nbytes)
        kv_at = [b, n * BLOCK_N, kv_head, 0]
        tma.async_copy_global_to_shared(k_desc, kv_at, kv_ready.index(STREAM), k_bufs.index(STREAM))
        tma.async_copy_global_to_shared(v_desc, kv_at, kv_ready.index(STREAM), v_bufs.index(STREAM))
        for g in range(GQA_GROUP):
            h = kv_head * GQA_GROUP + g
            full_start, n_full, partial_start, n_total = entry_list(
                full_offsets, partial_offsets, h, n, layout_tiles, Q_HEADS_PER_PATTERN_HEAD
            )
            for e in range(n_total):
                slot, phase = ring_slot(c, num_buffers)
                buf = STREAM * num_buffers + slot
                mbarrier.wait(qd_empty.index(buf), phase ^ 1)
                # Full entries from the last one down (see above), then the partial ones.
                at = gl.where(e < n_full, n_full - 1 - e, e)
                m = entry_col(full_cols, partial_cols, full_start, partial_start, n_full, at)
                mbarrier.expect(
                    qd_ready.index(buf),
                    2 * q_desc.block_type.nbytes + stats_desc.block_type.nbytes,
                )
                q_at = [b, m * BLOCK_M, h, 0]
                tma.async_copy_global_to_shared(
                    q_desc, q_at, qd_ready.index(buf), q_bufs.index(buf)
                )
                tma.async_copy_global_to_shared(
                    do_desc, q_at, qd_ready.index(buf), do_bufs.index(buf)
                )
                tma.async_copy_global_to_shared(
                    stats_desc, [b * NUM_HEADS + h, 0, m * BLOCK_M], qd_ready.index(buf),
                    stats_bufs.index(buf),
                )
                c += 1
        j += 1
        t = gl.atomic_add(counter, 1)
    leave_counter_at_zero(counter, t, num_items, 2)  # two streams per program
    mbarrier.wait(kv_empty.index(STREAM), (j & 1) ^ 1)
    put_item(item_slots, STREAM, t)
    mbarrier.arrive(kv_ready.index(STREAM))


@gluon.jit
def _stat_row(stats, i: gl.constexpr, s_layout: gl.constexpr):
    """Row ``i`` of a (2, BLOCK_M) statistics tile in shared memory, as a vector along the
    columns of ``s_layout`` (a shared-memory view cannot drop to rank 1: load one row as a
    (1, BLOCK_M) tile and reduce the unit axis)."""
    return gl.sum(stats.slice(i, 1, dim=0).load(s_layout), 0)


@gluon.jit
def _masked_probs_t(
    p_t, bits, kv_abs, q_abs, s_layout: gl.constexpr, ROW_GROUP: gl.constexpr,
    COL_GROUP: gl.constexpr, BITS_PER_ROW: gl.constexpr, CAUSAL: gl.constexpr,
):
    """Transposed probabilities (keys x queries) of a partial entry, zero where its bit mask or
    causality drops the pair (LSE may be -inf there, so p_t may be inf: never multiplied)."""
    BLOCK_N: gl.constexpr = p_t.shape[0]
    BLOCK_M: gl.constexpr = p_t.shape[1]
    shift = ((gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, s_layout)) // ROW_GROUP)
             * BITS_PER_ROW).to(gl.int64)
    row_bits = ((bits >> shift) & ((1 << BITS_PER_ROW) - 1)).to(gl.int32)
    col_bit = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, s_layout)) // COL_GROUP
    keep = ((row_bits[None, :] >> col_bit[:, None]) & 1) != 0
    if CAUSAL:
        keep = keep & (q_abs[None, :] >= kv_abs[:, None])
    return gl.where(keep, p_t, 0.0)


@gluon.jit
def _dkdv_consumer(
    STREAM: gl.constexpr, work, NUM_KV_HEADS: gl.constexpr, GQA_GROUP: gl.constexpr,
    Q_HEADS_PER_PATTERN_HEAD: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    HEAD_DIM: gl.constexpr, ROW_GROUP: gl.constexpr, COL_GROUP: gl.constexpr,
    BITS_PER_ROW: gl.constexpr, CAUSAL: gl.constexpr,
):
    """One warpgroup: dK and dV of each of its stream's KV tiles, on transposed scores (keys x
    queries) so both come out row-major. Per entry, the two score MMAs run together; P is
    computed while dP^T runs, and dS while dV's MMA runs."""
    (
        q_bufs, do_bufs, k_bufs, v_bufs, stats_bufs, kv_ready, kv_empty, qd_ready, qd_empty,
        dk_desc, dv_desc, order, full_offsets, full_cols, partial_offsets, partial_cols,
        partial_bits, kv_tiles, layout_tiles, num_items, qk_scale, softmax_scale, item_slots,
    ) = work
    num_buffers: gl.constexpr = q_bufs.type.shape[0] // 2
    dtype: gl.constexpr = q_bufs.dtype
    s_layout: gl.constexpr = wgmma_layout(BLOCK_M)
    o_layout: gl.constexpr = wgmma_layout(HEAD_DIM)
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    s_zero = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=s_layout)
    c = 0
    j = 0
    mbarrier.wait(kv_ready.index(STREAM), 0)
    t = get_item(item_slots, STREAM)
    while t < num_items:
        b, kv_head, n = _dkdv_item(order, t, kv_tiles, NUM_KV_HEADS)
        kv_abs = n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, s_layout))
        dk = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, layout=o_layout)
        dv = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, layout=o_layout)
        k = k_bufs.index(STREAM).reshape([BLOCK_N, HEAD_DIM])
        v = v_bufs.index(STREAM).reshape([BLOCK_N, HEAD_DIM])
        for g in range(GQA_GROUP):
            h = kv_head * GQA_GROUP + g
            full_start, n_full, partial_start, n_total = entry_list(
                full_offsets, partial_offsets, h, n, layout_tiles, Q_HEADS_PER_PATTERN_HEAD
            )
            for e in range(n_total):
                slot, phase = ring_slot(c, num_buffers)
                buf = STREAM * num_buffers + slot
                mbarrier.wait(qd_ready.index(buf), phase)
                q = q_bufs.index(buf).reshape([BLOCK_M, HEAD_DIM])
                do = do_bufs.index(buf).reshape([BLOCK_M, HEAD_DIM])
                stats = stats_bufs.index(buf).reshape([2, BLOCK_M])
                s_t = warpgroup_mma(k, q.permute((1, 0)), s_zero, use_acc=False, is_async=True)
                dp_t = warpgroup_mma(v, do.permute((1, 0)), s_zero, use_acc=False, is_async=True)
                s_t = warpgroup_mma_wait(1, deps=[s_t])
                lse = _stat_row(stats, 0, s_layout)
                p_t = gl.exp2(s_t * qk_scale - lse[None, :])
                if e >= n_full:
                    m = gl.load(partial_cols + partial_start + (e - n_full))
                    q_abs = m * BLOCK_M + gl.arange(0, BLOCK_M, layout=col_s)
                    p_t = _masked_probs_t(
                        p_t, gl.load(partial_bits + partial_start + (e - n_full)), kv_abs,
                        q_abs, s_layout, ROW_GROUP, COL_GROUP, BITS_PER_ROW, CAUSAL,
                    )
                dv = warpgroup_mma(gl.convert_layout(p_t.to(dtype), op_layout), do, dv,
                                   is_async=True)
                # dP^T is done when at most dV's MMA, issued after it, still runs.
                dp_t = warpgroup_mma_wait(1, deps=[dp_t])
                delta = _stat_row(stats, 1, s_layout)
                ds_t = gl.convert_layout((p_t * (dp_t - delta[None, :])).to(dtype), op_layout)
                dk = warpgroup_mma(ds_t, q, dk, is_async=True)
                dv, dk = warpgroup_mma_wait(0, deps=[dv, dk])
                mbarrier.arrive(qd_empty.index(buf))
                c += 1
        # dK and dV leave by bulk copy through the item's K/V slot (its MMAs are done), which
        # goes back to the producer once the copies have read it: 64 rows of stores from
        # registers took as long as two forward entries each.
        k_slot = k_bufs.index(STREAM)
        v_slot = v_bufs.index(STREAM)
        k_slot.reshape([BLOCK_N, HEAD_DIM]).store((dk * softmax_scale).to(dtype))
        v_slot.reshape([BLOCK_N, HEAD_DIM]).store(dv.to(dtype))
        fence_async_shared()
        gl.thread_barrier()
        tma.async_copy_shared_to_global(dk_desc, [b, n * BLOCK_N, kv_head, 0], k_slot)
        tma.async_copy_shared_to_global(dv_desc, [b, n * BLOCK_N, kv_head, 0], v_slot)
        tma.store_wait(0)
        mbarrier.arrive(kv_empty.index(STREAM))
        j += 1
        mbarrier.wait(kv_ready.index(STREAM), j & 1)
        t = get_item(item_slots, STREAM)


@gluon.jit
def _dkdv_kernel(
    q_desc, do_desc, k_desc, v_desc, stats_desc, dk_desc, dv_desc, counter, order,
    full_offsets, full_cols, partial_offsets, partial_cols, partial_bits,
    kv_tiles, layout_tiles, num_items, qk_scale, softmax_scale,
    NUM_HEADS: gl.constexpr, NUM_KV_HEADS: gl.constexpr, Q_HEADS_PER_PATTERN_HEAD: gl.constexpr,
    HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    ROW_GROUP: gl.constexpr, COL_GROUP: gl.constexpr, BITS_PER_ROW: gl.constexpr,
    CAUSAL: gl.constexpr, NUM_BUFFERS: gl.constexpr,
):
    """Persistent: two streams per program, taking items from ``counter`` (zero at launch)."""
    dtype: gl.constexpr = q_desc.dtype
    GQA_GROUP: gl.constexpr = NUM_HEADS // NUM_KV_HEADS
    # Stream s owns K/V slot s and ring slots s * NUM_BUFFERS ...
    ring: gl.constexpr = 2 * NUM_BUFFERS
    q_bufs = gl.allocate_shared_memory(dtype, [ring] + q_desc.block_type.shape, q_desc.layout)
    do_bufs = gl.allocate_shared_memory(dtype, [ring] + do_desc.block_type.shape, do_desc.layout)
    stats_bufs = gl.allocate_shared_memory(
        gl.float32, [ring] + stats_desc.block_type.shape, stats_desc.layout
    )
    k_bufs = gl.allocate_shared_memory(dtype, [2] + k_desc.block_type.shape, k_desc.layout)
    v_bufs = gl.allocate_shared_memory(dtype, [2] + v_desc.block_type.shape, v_desc.layout)
    kv_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    qd_ready = gl.allocate_shared_memory(gl.int64, [ring, 1], mbarrier.MBarrierLayout())
    qd_empty = gl.allocate_shared_memory(gl.int64, [ring, 1], mbarrier.MBarrierLayout())
    item_slots = alloc_item_slots(2)  # one per stream
    for i in gl.static_range(2):
        mbarrier.init(kv_ready.index(i), count=1)
        mbarrier.init(kv_empty.index(i), count=1)
    for i in gl.static_range(ring):
        mbarrier.init(qd_ready.index(i), count=1)
        mbarrier.init(qd_empty.index(i), count=1)

    # One tuple of shared arguments, constexprs apart (see forward_sm90.py).
    work = (
        q_bufs, do_bufs, k_bufs, v_bufs, stats_bufs, kv_ready, kv_empty, qd_ready, qd_empty,
        dk_desc, dv_desc, order, full_offsets, full_cols, partial_offsets, partial_cols,
        partial_bits, kv_tiles, layout_tiles, num_items, qk_scale, softmax_scale, item_slots,
    )
    warp_specialize(
        _dkdv_consumer,
        (
            work, NUM_KV_HEADS, GQA_GROUP, Q_HEADS_PER_PATTERN_HEAD, BLOCK_M, BLOCK_N, HEAD_DIM,
            ROW_GROUP, COL_GROUP, BITS_PER_ROW, CAUSAL,
        ),
        _dkdv_producer,
        (
            q_desc, do_desc, k_desc, v_desc, stats_desc, q_bufs, do_bufs, k_bufs, v_bufs,
            stats_bufs, kv_ready, kv_empty, qd_ready, qd_empty, item_slots, counter, order,
            full_offsets, full_cols, partial_offsets, partial_cols, kv_tiles, layout_tiles,
            num_items, NUM_HEADS, NUM_KV_HEADS, GQA_GROUP, Q_HEADS_PER_PATTERN_HEAD, BLOCK_M,
            BLOCK_N,
        ),
        2,
    )


_DKDV = Launcher(_dkdv_kernel)


@functools.cache
def _stats_layout() -> gl.NVMMASharedLayout:
    return gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=3)


def row_stats_descriptor(stats: torch.Tensor, seqlen: int, block_m: int) -> TensorDescriptor:
    """Bulk-copy descriptor of the (batch * heads, 2, padded seq) float32 row statistics, with
    (1, 2, block_m) blocks; rows past ``seqlen`` read as zeros."""
    return unchecked_descriptor(
        stats, [stats.shape[0], 2, seqlen], [1, 2, block_m], _stats_layout()
    )


def default_dkdv_config() -> GluonDkdvConfig:
    """The measured dK/dV launch: two ring slots per stream (three do not fit at dim 128; at dim
    64 four measured slower on H100), work-queue groups chosen per pattern (``dkdv_order``)."""
    return GluonDkdvConfig(num_buffers=2, heads_per_group=None)


def dkdv(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    stats: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
    layout: TileLayout,
    *,
    softmax_scale: float,
    q_heads_per_pattern_head: int,
    config: GluonDkdvConfig,
) -> None:
    """Fill ``dk`` and ``dv`` (like k) for batched inputs, on a 64x64
    backward layout; ``stats`` as ``row_stats_descriptor`` takes it. ``config``'s fields left
    None take ``default_dkdv_config``."""
    batch, seqlen_q, num_heads, head_dim = q.shape
    seqlen_k, num_kv_heads = k.shape[1], k.shape[2]
    config = config.over(default_dkdv_config())
    kv_tiles = -(-seqlen_k // layout.block_n)
    num_items = batch * num_kv_heads * kv_tiles
    grid = min(-(-num_items // 2), num_sms(q.device))
    key = ("dkdv_order", batch, num_heads, num_kv_heads, kv_tiles, q_heads_per_pattern_head,
           config.heads_per_group, 2 * grid)
    order = layout.derived.get(key)
    if order is None:
        order = layout.derived[key] = build_outside_graph_pool(
            q.device, lambda: dkdv_order(layout, *key[1:])
        )
    counter = item_counter(q.device)
    _DKDV[(grid,)](
        tma_descriptor(q, layout.block_m), tma_descriptor(grad_out, layout.block_m),
        tma_descriptor(k, layout.block_n), tma_descriptor(v, layout.block_n),
        row_stats_descriptor(stats, seqlen_q, layout.block_m), tma_descriptor(dk, layout.block_n),
        tma_descriptor(dv, layout.block_n), counter, order,
        layout.full_offsets, layout.full_cols,
        layout.partial_offsets, layout.partial_cols, layout.partial_bits,
        kv_tiles, layout.num_groups, num_items, softmax_scale * LOG2E, softmax_scale,
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        Q_HEADS_PER_PATTERN_HEAD=q_heads_per_pattern_head,
        HEAD_DIM=head_dim,
        **layout_constexprs(layout),
        NUM_BUFFERS=config.num_buffers,
        num_warps=4,
        maxnreg=MAX_REGS,
    )
