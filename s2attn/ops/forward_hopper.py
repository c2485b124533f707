"""Warp-specialized forward for Hopper (sm_90), written in Gluon.

The Triton forward (``forward.py``) serializes QK^T -> softmax -> PV inside each warpgroup and
cannot be warp-specialized on sm_90 with Triton 3.6 (benchmarks/NOTES.md, changes 6 and 7). Gluon
exposes what it needs: a one-warp *producer* partition walks the tile's entry list and issues the
bulk tensor copies (TMA) of K and V into a ring of shared-memory buffers, and the *consumer*
partition (two warpgroups, 64 query rows each) runs the MMAs asynchronously, so the softmax of
entry i runs while the tensor cores compute PV of entry i-1.

Same layouts, same results as the Triton kernel: full entries first, unmasked; then partial
entries with their bit mask, causality and key bounds. It takes the common case only (see
``supported``): dense 2-byte inputs on an sm_90 GPU, head dim 64 or 128, 128x64 layout tiles
without gathered entries, no key bound to check in full entries. Everything else runs the
Triton kernel.
"""

from __future__ import annotations

import functools
import os

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ..layout import TileLayout
from .common import device_capability, layout_constexprs, tma_allowed

__all__ = ["forward_hopper", "runs_on", "supported"]

# Producer partition: one warp, few registers; the consumers get the rest.
_PRODUCER_WARPS = gl.constexpr(1)
_PRODUCER_REGS = gl.constexpr(24)
# Two consumer partitions of one warpgroup each (the default one and a worker).
_CONSUMER_REGS = gl.constexpr(240)
_MAX_REGS = 168  # per thread over the 12 warps: 2 x 4 x 240 + 4 x 24 (the producer's warpgroup)


@gluon.constexpr_function
def _wgmma_layout(n):
    """Accumulator layout of one warpgroup's 64-row MMAs with n columns."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, n, 16])


@gluon.jit
def _free_slots(k_ready, v_ready, kv_empty, first, last):
    """Release ring positions first..last-1 that this warpgroup skips: a slot may be freed only
    once its copies have landed."""
    num_buffers: gl.constexpr = k_ready.type.shape[0]
    for c in range(first, last):
        buf = c % num_buffers
        mbarrier.wait(k_ready.index(buf), (c // num_buffers) & 1)
        mbarrier.wait(v_ready.index(buf), (c // num_buffers) & 1)
        mbarrier.arrive(kv_empty.index(buf))


@gluon.jit
def _store_rows(base, rows, values, stride_s, seqlen, layout: gl.constexpr):
    """Store (len(rows), dim) ``values`` at ``base + rows * stride_s``, rows in [0, seqlen)."""
    offs_d = gl.arange(0, values.shape[1], layout=gl.SliceLayout(0, layout))
    gl.store(
        base + rows[:, None].to(gl.int64) * stride_s + offs_d[None, :],
        values,
        mask=((rows >= 0) & (rows < seqlen))[:, None],
    )


@gluon.jit
def _entry_col(full_cols, partial_cols, full_start, partial_start, n_full, e):
    """KV tile index of the tile's ``e``-th entry: full entries first, then partial ones."""
    if e < n_full:
        n = gl.load(full_cols + full_start + e)
    else:
        n = gl.load(partial_cols + partial_start + (e - n_full))
    return n


@gluon.jit
def _put_item(item_slots, slot, t):
    """Hand work item ``t`` from a producer (one warp) to its consumers through shared memory;
    the mbarrier arrival that follows publishes it."""
    one: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    item_slots.index(slot).store(gl.full([1], t, gl.int32, layout=one))


@gluon.jit
def _item_slots(n: gl.constexpr):
    """Shared memory for ``n`` work-item indices (``_put_item``, ``_get_item``)."""
    return gl.allocate_shared_memory(gl.int32, [n, 1], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))


@gluon.jit
def _get_item(item_slots, slot):
    """The work item in ``slot``, read by a consumer warpgroup once its mbarrier has completed."""
    one: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    return gl.max(item_slots.index(slot).load(one), 0)


@gluon.jit
def _take_item(q_ready, item_slots, j):
    """The consumers' ``j``-th work item (>= num_items past the last): waits for its q slot
    (one per slot of ``q_ready``, taken in turn), which carries the index ``_producer`` put."""
    q_slots: gl.constexpr = q_ready.type.shape[0]
    mbarrier.wait(q_ready.index(j % q_slots), (j // q_slots) & 1)
    return _get_item(item_slots, j % q_slots)


@gluon.jit
def _leave_counter_at_zero(counter, t, num_items, TAKERS_PER_PROGRAM: gl.constexpr):
    """Called by each taker (a producer loop) with the index ``t >= num_items`` that ended its
    loop. Every taker stops at its first such index, so a launch adds exactly num_items + takers
    to ``counter``; the taker that made the last add knows that no other will touch it and puts
    it back to zero for the next launch on the stream (``item_counter``)."""
    takers = gl.num_programs(0) * TAKERS_PER_PROGRAM
    if t == num_items + takers - 1:
        gl.atomic_add(counter, -(num_items + takers))


@gluon.jit
def _work_item(
    t, full_offsets, partial_offsets, seqlen_k, layout_tiles, grid_tiles, heads_per_group,
    NUM_HEADS: gl.constexpr, PATTERN_HEAD_DIV: gl.constexpr, BLOCK_M: gl.constexpr,
):  # fmt: skip
    """(b, h, tile, full_start, n_full, partial_start, n_total) of work item ``t``.

    Items are ordered as the Triton kernel's programs (ops/common.py ``program_order``): one
    group of heads at a time, so their K and V stay in L2, heaviest tile first. Programs take
    them in that order from a global counter as they finish the previous one, so the last items
    taken are light ones and no program is left finishing a heavy item alone (taking every
    grid-th item instead left programs 3% apart in work at 32k and 6-8% at 8k)."""
    per_group = heads_per_group * grid_tiles
    rank = t % per_group
    bh = (t // per_group) * heads_per_group + rank % heads_per_group
    h = bh % NUM_HEADS
    tile = (seqlen_k - 1) // BLOCK_M - rank // heads_per_group
    full_start, n_full, partial_start, n_total = _entry_list(
        full_offsets, partial_offsets, h, tile, layout_tiles, PATTERN_HEAD_DIV
    )
    return bh // NUM_HEADS, h, tile, full_start, n_full, partial_start, n_total


@gluon.jit
def _entry_list(
    full_offsets, partial_offsets, h, tile, layout_tiles, PATTERN_HEAD_DIV: gl.constexpr
):
    """(full_start, n_full, partial_start, n_total) of head ``h``'s list for layout tile ``tile``
    (a query tile in forward layouts, a KV tile in backward ones)."""
    group = (h // PATTERN_HEAD_DIV) * layout_tiles + tile
    full_start = gl.load(full_offsets + group)
    n_full = gl.load(full_offsets + group + 1) - full_start
    partial_start = gl.load(partial_offsets + group)
    n_total = n_full + gl.load(partial_offsets + group + 1) - partial_start
    return full_start, n_full, partial_start, n_total


@gluon.jit
def _producer(
    q_desc, k_desc, v_desc, q_bufs, k_bufs, v_bufs, q_ready, q_empty, k_ready, v_ready, kv_empty,
    full_offsets, full_cols, partial_offsets, partial_cols,
    seqlen_q, seqlen_k, layout_tiles, grid_tiles, heads_per_group, num_items, counter, item_slots,
    NUM_HEADS: gl.constexpr, GQA_GROUP: gl.constexpr, PATTERN_HEAD_DIV: gl.constexpr,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, ENTRIES: gl.constexpr,
    do_desc=None, do_bufs=None, o_desc=None, o_bufs=None, WITH_GRAD: gl.constexpr = False,
):  # fmt: skip
    """Takes work items from ``counter`` and walks their entries, copying q (and dO and O,
    WITH_GRAD: the dQ kernel) and K/V tiles into the rings as soon as the consumers free a slot:
    the next tile's loads overlap this tile's end. Each q slot carries its item's index to the
    consumers; past the last item it carries an index >= num_items. A K/V slot holds ENTRIES
    consecutive entries; past the list's end it repeats the last one (finite data, masked out by
    the consumers)."""
    num_buffers: gl.constexpr = k_bufs.type.shape[0]
    q_slots: gl.constexpr = q_bufs.type.shape[0]
    q_offset = seqlen_k - seqlen_q
    c = 0  # K/V ring position, across work items
    j = 0  # work items taken
    t = gl.atomic_add(counter, 1)
    while t < num_items:
        b, h, tile, full_start, n_full, partial_start, n_total = _work_item(
            t, full_offsets, partial_offsets, seqlen_k, layout_tiles, grid_tiles,
            heads_per_group, NUM_HEADS, PATTERN_HEAD_DIV, BLOCK_M,
        )  # fmt: skip
        # Slots start free: the first pass waits on the phase before the barrier's first.
        slot = j % q_slots
        ready = q_ready.index(slot)
        mbarrier.wait(q_empty.index(slot), ((j // q_slots) & 1) ^ 1)
        _put_item(item_slots, slot, t)
        q_row = tile * BLOCK_M - q_offset
        if WITH_GRAD:
            mbarrier.expect(ready, 3 * q_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(do_desc, [b, q_row, h, 0], ready, do_bufs.index(slot))
            tma.async_copy_global_to_shared(o_desc, [b, q_row, h, 0], ready, o_bufs.index(slot))
        else:
            mbarrier.expect(ready, q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [b, q_row, h, 0], ready, q_bufs.index(slot))
        kv_head = h // GQA_GROUP
        for step in range(gl.cdiv(n_total, ENTRIES)):
            buf = c % num_buffers
            mbarrier.wait(kv_empty.index(buf), ((c // num_buffers) & 1) ^ 1)
            mbarrier.expect(k_ready.index(buf), ENTRIES * k_desc.block_type.nbytes)
            mbarrier.expect(v_ready.index(buf), ENTRIES * v_desc.block_type.nbytes)
            for sub in gl.static_range(ENTRIES):
                e = gl.minimum(step * ENTRIES + sub, n_total - 1)
                n = _entry_col(full_cols, partial_cols, full_start, partial_start, n_full, e)
                tma.async_copy_global_to_shared(
                    k_desc, [b, n * BLOCK_N, kv_head, 0], k_ready.index(buf),
                    k_bufs.index(buf).slice(sub * BLOCK_N, BLOCK_N, dim=1),
                )  # fmt: skip
                tma.async_copy_global_to_shared(
                    v_desc, [b, n * BLOCK_N, kv_head, 0], v_ready.index(buf),
                    v_bufs.index(buf).slice(sub * BLOCK_N, BLOCK_N, dim=1),
                )  # fmt: skip
            c += 1
        j += 1
        t = gl.atomic_add(counter, 1)
    _leave_counter_at_zero(counter, t, num_items, 1)
    slot = j % q_slots
    mbarrier.wait(q_empty.index(slot), ((j // q_slots) & 1) ^ 1)
    _put_item(item_slots, slot, t)
    mbarrier.arrive(q_ready.index(slot))


@gluon.jit
def _entries_reaching(
    partial_cols, partial_start, n_full, n_total, last_row, BLOCK_N: gl.constexpr,
    CAUSAL: gl.constexpr,
):  # fmt: skip
    """The length of the tile's list once trailing causal entries that start after ``last_row``
    (wholly masked for rows up to it) are dropped."""
    n_mine = n_total
    if CAUSAL:
        more = n_mine > n_full
        while more:
            n = gl.load(partial_cols + partial_start + (n_mine - 1 - n_full))
            above = n * BLOCK_N > last_row
            n_mine = gl.where(above, n_mine - 1, n_mine)
            more = above & (n_mine > n_full)
    return n_mine


@gluon.jit
def _entry_bits(partial_bits, partial_start, n_full, n_total, e):
    """An entry's bit matrix: all ones for a full entry, none past the list's end."""
    if e < n_full:
        bits = gl.full([], -1, gl.int64)
    elif e < n_total:
        bits = gl.load(partial_bits + partial_start + (e - n_full))
    else:
        bits = gl.full([], 0, gl.int64)
    return bits


@gluon.jit
def _masked_scores(
    s, step, full_cols, partial_cols, partial_bits, full_start, partial_start, n_full, n_total,
    rows_abs, seq_k, s_layout: gl.constexpr, ROWS: gl.constexpr, BLOCK_N: gl.constexpr,
    ENTRIES: gl.constexpr, ROW_START: gl.constexpr, ROW_GROUP: gl.constexpr,
    COL_GROUP: gl.constexpr, BITS_PER_ROW: gl.constexpr, CAUSAL: gl.constexpr,
):  # fmt: skip
    """Scores of a step holding a partial entry (or running past the list's end): each entry's
    bit mask, key bounds and (when CAUSAL) causality, for ROWS rows from row ROW_START of the
    layout tile. Column c belongs to the step's (c // BLOCK_N)-th entry."""
    offs_c = gl.arange(0, ENTRIES * BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    local_rows = ROW_START + gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout))
    # Each row's bits are shifted out once per row, so the per-element test is 32-bit.
    shift = ((local_rows // ROW_GROUP) * BITS_PER_ROW).to(gl.int64)
    row_mask: gl.constexpr = (1 << BITS_PER_ROW) - 1
    col_bit = (offs_c % BLOCK_N) // COL_GROUP
    e0 = step * ENTRIES
    n0 = _entry_col(full_cols, partial_cols, full_start, partial_start, n_full, e0)
    bits0 = _entry_bits(partial_bits, partial_start, n_full, n_total, e0)
    row_bits = (((bits0 >> shift) & row_mask).to(gl.int32))[:, None]
    if ENTRIES == 1:
        n_c = n0
    else:
        last = gl.minimum(e0 + 1, n_total - 1)
        n1 = _entry_col(full_cols, partial_cols, full_start, partial_start, n_full, last)
        bits1 = _entry_bits(partial_bits, partial_start, n_full, n_total, e0 + 1)
        first = offs_c < BLOCK_N
        n_c = gl.where(first, n0, n1)
        row_bits1 = (((bits1 >> shift) & row_mask).to(gl.int32))[:, None]
        row_bits = gl.where(first[None, :], row_bits, row_bits1)
    cols = n_c * BLOCK_N + offs_c % BLOCK_N
    keep = ((row_bits >> col_bit[None, :]) & 1) != 0
    keep = keep & (cols < seq_k)[None, :]
    if CAUSAL:
        keep = keep & (rows_abs[:, None] >= cols[None, :])
    return gl.where(keep, s, float("-inf"))


@gluon.jit
def _entry_for_rows(
    partial_cols, partial_bits, partial_start, n_full, n_total, e, first_row, seq_k,
    ROWS: gl.constexpr, BLOCK_N: gl.constexpr, ROW_START: gl.constexpr,
    ROW_GROUP: gl.constexpr, BITS_PER_ROW: gl.constexpr, CAUSAL: gl.constexpr,
):  # fmt: skip
    """(seen, masked) of the tile's ``e``-th entry for ROWS rows from row ROW_START of the
    layout tile (absolute position ``first_row``): whether any of them sees one of its keys,
    and whether their scores need ``_masked_scores``. A partial entry is often whole or empty
    for one warpgroup's half of the tile (the local window's first block, seen by the first
    pattern block of rows only; the diagonal tile below the second half's rows)."""
    seen = e < n_total
    masked = e >= n_full
    if masked & seen:
        i = partial_start + (e - n_full)
        lo = gl.load(partial_cols + i) * BLOCK_N
        # This warpgroup's bits: the rows of its row groups (one group may span both halves).
        FIRST_GROUP: gl.constexpr = ROW_START // ROW_GROUP
        GROUPS: gl.constexpr = (ROWS + ROW_GROUP - 1) // ROW_GROUP
        ALL: gl.constexpr = (1 << (GROUPS * BITS_PER_ROW)) - 1
        mine = (gl.load(partial_bits + i) >> (FIRST_GROUP * BITS_PER_ROW)) & ALL
        seen = (mine != 0) & (lo < seq_k)
        masked = (mine != ALL) | (lo + BLOCK_N > seq_k)
        if CAUSAL:
            seen = seen & (lo <= first_row + ROWS - 1)
            masked = masked | (lo + BLOCK_N - 1 > first_row)
    return seen, masked


@gluon.jit
def _step_for_rows(
    step, partial_cols, partial_bits, partial_start, n_full, n_total, first_row, seq_k,
    ROWS: gl.constexpr, BLOCK_N: gl.constexpr, ENTRIES: gl.constexpr, ROW_START: gl.constexpr,
    ROW_GROUP: gl.constexpr, BITS_PER_ROW: gl.constexpr, CAUSAL: gl.constexpr,
):  # fmt: skip
    """(seen, masked) of a step (entries step * ENTRIES...) for the rows of
    ``_entry_for_rows``. Steps of two entries are seen while they hold one and masked when one
    is partial: a pair is rarely unseen or whole for one half of the tile, and testing both
    cost more than it saved at dim 64 (benchmarks/NOTES.md, change 35)."""
    if ENTRIES == 1:
        seen, masked = _entry_for_rows(
            partial_cols, partial_bits, partial_start, n_full, n_total, step, first_row, seq_k,
            ROWS, BLOCK_N, ROW_START, ROW_GROUP, BITS_PER_ROW, CAUSAL,
        )  # fmt: skip
    else:
        seen = step * ENTRIES < n_total
        masked = (step + 1) * ENTRIES > n_full
    return seen, masked


@gluon.jit
def _next_run(
    step, limit, held, partial_cols, partial_bits, partial_start, n_full, n_total, first_row,
    seq_k, ROWS: gl.constexpr, BLOCK_N: gl.constexpr, ENTRIES: gl.constexpr,
    ROW_START: gl.constexpr, ROW_GROUP: gl.constexpr, BITS_PER_ROW: gl.constexpr,
    CAUSAL: gl.constexpr, NUM_BUFFERS: gl.constexpr,
):  # fmt: skip
    """(the next step from ``step`` on, below ``limit``, to run, or ``limit``; whether it is
    masked) while the warpgroup holds step ``held``'s ring slot for its pending MMA (none held:
    ``held`` >= ``limit``). Unseen steps are skipped up to NUM_BUFFERS - 1 steps past ``held``:
    the step after that one would need ``held``'s slot refilled, so that one runs (masked) and
    frees it."""
    go = step < limit
    masked = go
    while go:
        seen, masked = _step_for_rows(
            step, partial_cols, partial_bits, partial_start, n_full, n_total, first_row, seq_k,
            ROWS, BLOCK_N, ENTRIES, ROW_START, ROW_GROUP, BITS_PER_ROW, CAUSAL,
        )  # fmt: skip
        run = seen | (step - held >= NUM_BUFFERS - 1)
        masked = masked | (seen == 0)
        step = gl.where(run, step, step + 1)
        go = (run == 0) & (step < limit)
    return step, masked


@gluon.jit
def _softmax_step(
    q, k_bufs, v_bufs, k_ready, v_ready, kv_empty, pos, held_pos, p, acc, m_i, l_i, masked,
    step, full_cols, partial_cols, partial_bits, full_start, partial_start, n_full, n_total,
    rows_abs, seq_k, qk_scale, s_zero, ROWS: gl.constexpr, BLOCK_N: gl.constexpr,
    ENTRIES: gl.constexpr, ROW_START: gl.constexpr, ROW_GROUP: gl.constexpr,
    COL_GROUP: gl.constexpr, BITS_PER_ROW: gl.constexpr, CAUSAL: gl.constexpr,
):  # fmt: skip
    """One step of the online softmax at ring position ``pos``: its QK^T runs beside the PV of
    the step held at ``held_pos`` (whose slot it then frees). Returns (p, acc, m_i, l_i)."""
    num_buffers: gl.constexpr = k_bufs.type.shape[0]
    keys: gl.constexpr = k_bufs.type.shape[2]
    head_dim: gl.constexpr = k_bufs.type.shape[4]
    s_layout: gl.constexpr = s_zero.type.layout
    o_layout: gl.constexpr = acc.type.layout
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    prev = held_pos % num_buffers
    buf = pos % num_buffers
    mbarrier.wait(k_ready.index(buf), (pos // num_buffers) & 1)
    mbarrier.wait(v_ready.index(prev), (held_pos // num_buffers) & 1)
    p_op = gl.convert_layout(p.to(k_bufs.dtype), p_layout)
    k = k_bufs.index(buf).reshape([keys, head_dim])
    s = warpgroup_mma(q, k.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    v = v_bufs.index(prev).reshape([keys, head_dim])
    acc = warpgroup_mma(p_op, v, acc, is_async=True)
    # QK^T of this step is done when at most the PV just issued is still running.
    s = warpgroup_mma_wait(1, deps=[s])
    if masked:
        s = _masked_scores(
            s, step, full_cols, partial_cols, partial_bits, full_start, partial_start, n_full,
            n_total, rows_abs, seq_k, s_layout, ROWS, BLOCK_N, ENTRIES, ROW_START, ROW_GROUP,
            COL_GROUP, BITS_PER_ROW, CAUSAL,
        )  # fmt: skip
    m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
    m_ref = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - m_ref)
    p = gl.exp2(s * qk_scale - m_ref[:, None])
    l_i = l_i * alpha + gl.sum(p, 1)
    acc = warpgroup_mma_wait(0, deps=[acc])
    mbarrier.arrive(kv_empty.index(prev))
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
    return p, acc, m_new, l_i


@gluon.jit
def _consumer(
    work, HALF: gl.constexpr, NUM_HEADS: gl.constexpr, PATTERN_HEAD_DIV: gl.constexpr,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
    ROW_GROUP: gl.constexpr, COL_GROUP: gl.constexpr, BITS_PER_ROW: gl.constexpr,
    CAUSAL: gl.constexpr, Q_IN_REGS: gl.constexpr, ENTRIES: gl.constexpr,
):  # fmt: skip
    """One warpgroup: for each work item, the online softmax of query rows HALF * ROWS.. of the
    tile over its entries, ENTRIES at a step, then the normalized output and LSE of those rows.
    The two warpgroups share the K/V ring but never wait for each other: each frees a slot on
    its own (the empty barriers count two)."""
    (
        q_bufs, k_bufs, v_bufs, q_ready, q_empty, k_ready, v_ready, kv_empty, item_slots, Out, Lse,
        full_offsets, full_cols, partial_offsets, partial_cols, partial_bits,
        stride_ob, stride_os, stride_oh, stride_lb, stride_lh, stride_ls,
        seqlen_q, seqlen_k, layout_tiles, grid_tiles, heads_per_group, num_items, qk_scale,
    ) = work  # fmt: skip
    ROWS: gl.constexpr = BLOCK_M // 2
    KEYS: gl.constexpr = ENTRIES * BLOCK_N  # keys per step
    num_buffers: gl.constexpr = k_bufs.type.shape[0]
    dtype: gl.constexpr = q_bufs.dtype
    s_layout: gl.constexpr = _wgmma_layout(KEYS)
    o_layout: gl.constexpr = _wgmma_layout(HEAD_DIM)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    q_offset = seqlen_k - seqlen_q
    s_zero = gl.zeros([ROWS, KEYS], gl.float32, layout=s_layout)
    c = 0  # K/V ring position, across work items
    j = 0  # work items taken
    t = _take_item(q_ready, item_slots, 0)
    while t < num_items:
        b, h, tile, full_start, n_full, partial_start, n_total = _work_item(
            t, full_offsets, partial_offsets, seqlen_k, layout_tiles, grid_tiles,
            heads_per_group, NUM_HEADS, PATTERN_HEAD_DIV, BLOCK_M,
        )  # fmt: skip
        n_steps = gl.cdiv(n_total, ENTRIES)
        q_row0 = tile * BLOCK_M + HALF * ROWS  # absolute position of this warpgroup's first row
        # Causal: partial entries that start after this warpgroup's last row (the upper diagonal
        # KV tile, for the first half of the rows) are wholly masked for it: it skips the steps
        # made only of those, and just frees their slots.
        n_mine = _entries_reaching(
            partial_cols, partial_start, n_full, n_total, q_row0 + ROWS - 1, BLOCK_N, CAUSAL
        )
        my_steps = gl.cdiv(n_mine, ENTRIES)
        rows_abs = q_row0 + gl.arange(0, ROWS, layout=row_s)
        m_i = gl.full([ROWS], float("-inf"), gl.float32, layout=row_s)
        l_i = gl.full([ROWS], 0.0, gl.float32, layout=row_s)
        acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, layout=o_layout)
        q_view = q_bufs.index(j % 2).reshape([BLOCK_M, HEAD_DIM]).slice(HALF * ROWS, ROWS)
        if Q_IN_REGS:
            # QK^T then reads only K from shared memory.
            q = q_view.load(gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2))
        else:
            q = q_view
        # Steps that no row of this warpgroup sees are skipped (their slots just freed); the
        # others are masked only where an entry is partial for these rows.
        first, masked = _next_run(
            my_steps * 0, my_steps, my_steps, partial_cols, partial_bits, partial_start, n_full,
            n_total, q_row0, seqlen_k, ROWS, BLOCK_N, ENTRIES, HALF * ROWS, ROW_GROUP,
            BITS_PER_ROW, CAUSAL, num_buffers,
        )  # fmt: skip
        _free_slots(k_ready, v_ready, kv_empty, c, c + first)
        if first < my_steps:
            # The first step: scores and softmax; its PV is issued with the next step's QK^T.
            buf = (c + first) % num_buffers
            mbarrier.wait(k_ready.index(buf), ((c + first) // num_buffers) & 1)
            k = k_bufs.index(buf).reshape([KEYS, HEAD_DIM])
            s = warpgroup_mma(q, k.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            s = warpgroup_mma_wait(0, deps=[s])
            if masked:
                s = _masked_scores(
                    s, first, full_cols, partial_cols, partial_bits, full_start, partial_start,
                    n_full, n_total, rows_abs, seqlen_k, s_layout, ROWS, BLOCK_N, ENTRIES,
                    HALF * ROWS, ROW_GROUP, COL_GROUP, BITS_PER_ROW, CAUSAL,
                )  # fmt: skip
            m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
            # A row with nothing visible so far keeps m = -inf; subtract 0 instead of NaN.
            m_ref = gl.where(m_new == float("-inf"), 0.0, m_new)
            p = gl.exp2(s * qk_scale - m_ref[:, None])
            l_i = gl.sum(p, 1)
            m_i = m_new

            held = first  # the step whose PV is pending
            # Steps made of full entries only, then the rest, which may be skipped or masked. Two
            # loops: one with a branch around the step slowed the forward by 2-8% and made
            # ptxas serialize the dQ kernel's MMAs (NOTES 35).
            full_end = gl.maximum(gl.minimum(n_full // ENTRIES, my_steps), first + 1)
            for step in range(first + 1, full_end):
                p, acc, m_i, l_i = _softmax_step(
                    q, k_bufs, v_bufs, k_ready, v_ready, kv_empty, c + step, c + held, p, acc,
                    m_i, l_i, False, step, full_cols, partial_cols, partial_bits, full_start,
                    partial_start, n_full, n_total, rows_abs, seqlen_k, qk_scale, s_zero, ROWS,
                    BLOCK_N, ENTRIES, HALF * ROWS, ROW_GROUP, COL_GROUP, BITS_PER_ROW, CAUSAL,
                )  # fmt: skip
                held = step
            step, masked = _next_run(
                full_end, my_steps, held, partial_cols, partial_bits, partial_start, n_full,
                n_total, q_row0, seqlen_k, ROWS, BLOCK_N, ENTRIES, HALF * ROWS, ROW_GROUP,
                BITS_PER_ROW, CAUSAL, num_buffers,
            )  # fmt: skip
            while step < my_steps:
                _free_slots(k_ready, v_ready, kv_empty, c + held + 1, c + step)  # skipped
                p, acc, m_i, l_i = _softmax_step(
                    q, k_bufs, v_bufs, k_ready, v_ready, kv_empty, c + step, c + held, p, acc,
                    m_i, l_i, masked, step, full_cols, partial_cols, partial_bits, full_start,
                    partial_start, n_full, n_total, rows_abs, seqlen_k, qk_scale, s_zero, ROWS,
                    BLOCK_N, ENTRIES, HALF * ROWS, ROW_GROUP, COL_GROUP, BITS_PER_ROW, CAUSAL,
                )  # fmt: skip
                held = step
                step, masked = _next_run(
                    step + 1, my_steps, held, partial_cols, partial_bits, partial_start,
                    n_full, n_total, q_row0, seqlen_k, ROWS, BLOCK_N, ENTRIES, HALF * ROWS,
                    ROW_GROUP, BITS_PER_ROW, CAUSAL, num_buffers,
                )  # fmt: skip

            last = (c + held) % num_buffers
            mbarrier.wait(v_ready.index(last), ((c + held) // num_buffers) & 1)
            v = v_bufs.index(last).reshape([KEYS, HEAD_DIM])
            acc = warpgroup_mma(gl.convert_layout(p.to(dtype), p_layout), v, acc, is_async=True)
            acc = warpgroup_mma_wait(0, deps=[acc])
            mbarrier.arrive(kv_empty.index(last))
            first = held + 1  # steps from here on are skipped
        _free_slots(k_ready, v_ready, kv_empty, c + first, c + n_steps)
        mbarrier.arrive(q_empty.index(j % 2))
        c += n_steps

        # Rows that attend nothing: output 0 and LSE -inf, never 0/0.
        empty = l_i == 0.0
        lse = (m_i + gl.log2(gl.where(empty, 1.0, l_i))) * 0.6931471805599453  # natural log
        lse = gl.where(empty, float("-inf"), lse)
        inv_l = gl.convert_layout(1.0 / gl.where(empty, 1.0, l_i), row_o)
        out = (acc * inv_l[:, None]).to(dtype)
        rows = q_row0 - q_offset + gl.arange(0, ROWS, layout=row_o)
        o_base = Out + b.to(gl.int64) * stride_ob + h.to(gl.int64) * stride_oh
        _store_rows(o_base, rows, out, stride_os, seqlen_q, o_layout)
        l_rows = q_row0 - q_offset + gl.arange(0, ROWS, layout=row_s)
        l_base = Lse + b.to(gl.int64) * stride_lb + h.to(gl.int64) * stride_lh
        gl.store(l_base + l_rows * stride_ls, lse, mask=(l_rows >= 0) & (l_rows < seqlen_q))
        j += 1
        t = _take_item(q_ready, item_slots, j)


@gluon.jit
def _forward_kernel(
    q_desc, k_desc, v_desc, Out, Lse, counter,
    full_offsets, full_cols, partial_offsets, partial_cols, partial_bits,
    stride_ob, stride_os, stride_oh, stride_lb, stride_lh, stride_ls,
    seqlen_q, seqlen_k, layout_tiles, grid_tiles, heads_per_group, num_items, qk_scale,
    NUM_HEADS: gl.constexpr, GQA_GROUP: gl.constexpr, PATTERN_HEAD_DIV: gl.constexpr,
    HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    ROW_GROUP: gl.constexpr, COL_GROUP: gl.constexpr, BITS_PER_ROW: gl.constexpr,
    CAUSAL: gl.constexpr, NUM_BUFFERS: gl.constexpr, Q_IN_REGS: gl.constexpr,
    ENTRIES: gl.constexpr,
):  # fmt: skip
    """Persistent: each program takes work items (head, query tile) from ``counter`` (zero at
    launch) until none is left."""
    dtype: gl.constexpr = q_desc.dtype
    q_bufs = gl.allocate_shared_memory(dtype, [2] + q_desc.block_type.shape, q_desc.layout)
    # A ring slot holds ENTRIES KV tiles one after another: (1, ENTRIES * BLOCK_N, 1, dim).
    kv_shape: gl.constexpr = [NUM_BUFFERS, 1, ENTRIES * BLOCK_N, 1, HEAD_DIM]
    k_bufs = gl.allocate_shared_memory(dtype, kv_shape, k_desc.layout)
    v_bufs = gl.allocate_shared_memory(dtype, kv_shape, v_desc.layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [NUM_BUFFERS, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [NUM_BUFFERS, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [NUM_BUFFERS, 1], mbarrier.MBarrierLayout())
    item_slots = _item_slots(2)
    for i in gl.static_range(2):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=2)  # one release per consumer warpgroup
    for i in gl.static_range(NUM_BUFFERS):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(kv_empty.index(i), count=2)

    # The consumers' shared arguments travel as one tuple, their constexprs apart: a tuple built
    # by concatenation inside a kernel turns its constexprs into tensors.
    work = (
        q_bufs, k_bufs, v_bufs, q_ready, q_empty, k_ready, v_ready, kv_empty, item_slots, Out, Lse,
        full_offsets, full_cols, partial_offsets, partial_cols, partial_bits,
        stride_ob, stride_os, stride_oh, stride_lb, stride_lh, stride_ls,
        seqlen_q, seqlen_k, layout_tiles, grid_tiles, heads_per_group, num_items, qk_scale,
    )  # fmt: skip
    gl.warp_specialize(
        [
            (
                _consumer,
                (
                    work, 0, NUM_HEADS, PATTERN_HEAD_DIV, BLOCK_M, BLOCK_N, HEAD_DIM, ROW_GROUP,
                    COL_GROUP, BITS_PER_ROW, CAUSAL, Q_IN_REGS, ENTRIES,
                ),
            ),
            (
                _consumer,
                (
                    work, 1, NUM_HEADS, PATTERN_HEAD_DIV, BLOCK_M, BLOCK_N, HEAD_DIM, ROW_GROUP,
                    COL_GROUP, BITS_PER_ROW, CAUSAL, Q_IN_REGS, ENTRIES,
                ),
            ),
            (
                _producer,
                (
                    q_desc, k_desc, v_desc, q_bufs, k_bufs, v_bufs, q_ready, q_empty, k_ready,
                    v_ready, kv_empty, full_offsets, full_cols, partial_offsets, partial_cols,
                    seqlen_q, seqlen_k, layout_tiles, grid_tiles, heads_per_group, num_items,
                    counter, item_slots, NUM_HEADS, GQA_GROUP, PATTERN_HEAD_DIV, BLOCK_M, BLOCK_N,
                    ENTRIES,
                ),
            ),
        ],
        [4, _PRODUCER_WARPS],
        [_CONSUMER_REGS, _PRODUCER_REGS],
    )  # fmt: skip


_ENABLED = os.environ.get("S2ATTN_HOPPER_FORWARD", "1") != "0"


def supported(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: TileLayout, *, varlen: bool,
    check_k_bounds: bool, softmax_scale: float,
) -> bool:  # fmt: skip
    """Whether this kernel takes the call; the Triton kernel takes every other."""
    if varlen or not runs_on(q):
        return False
    if (layout.block_m, layout.block_n) != (128, 64) or layout.gather_width:
        return False
    if check_k_bounds or softmax_scale <= 0 or layout.bits_per_row >= 32:
        return False
    return tma_allowed(q.device, q, k, v)


def runs_on(q: torch.Tensor) -> bool:
    """Whether the Gluon kernels (this module's and ops/backward_hopper.py's) may run on q's
    device and dtype: an sm_90 GPU, fp16 or bf16, head dim 64 or 128, not disabled by
    ``S2ATTN_HOPPER_FORWARD=0``. Each kernel adds its own conditions."""
    if not _ENABLED or q.device.type != "cuda" or device_capability(q.device) != (9, 0):
        return False
    return q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] in (64, 128)


def _descriptor(t: torch.Tensor, rows: int) -> TensorDescriptor:
    """A (batch, seq, heads, dim) bulk-copy descriptor with (1, rows, 1, dim) blocks.

    Built without the dataclass's own checks: ``supported`` already checked alignment and
    strides, and those checks cost more host time than the launch at short sequences."""
    return _unchecked_descriptor(
        t, list(t.shape), [1, rows, 1, t.shape[-1]], _smem_layout(rows, t.shape[-1], t.dtype)
    )


def _unchecked_descriptor(
    base: torch.Tensor, shape: list[int], block: list[int], layout: gl.NVMMASharedLayout
) -> TensorDescriptor:
    """A TensorDescriptor over ``base`` (its strides) without the dataclass's checks; callers
    check alignment and strides first."""
    desc = TensorDescriptor.__new__(TensorDescriptor)
    desc.__dict__.update(
        base=base, shape=shape, strides=list(base.stride()), block_shape=block, layout=layout,
        padding="zero",
    )  # fmt: skip
    return desc


@functools.cache
def _smem_layout(rows: int, head_dim: int, dtype: torch.dtype) -> gl.NVMMASharedLayout:
    element = gl.bfloat16 if dtype == torch.bfloat16 else gl.float16
    return gl.NVMMASharedLayout.get_default_for([1, rows, 1, head_dim], element)


def default_options(head_dim: int) -> dict[str, int | bool]:
    """Launch options per head dim, measured on H100 (benchmarks/NOTES.md, change 11).

    Dim 128: one entry per step, q in registers, a ring of 4 KV tiles. Dim 64: the MMAs are half
    as long against the same softmax work, so two entries (128 keys) per step win (+9% at 32k);
    at dim 128 those spill or slow down.
    """
    if head_dim <= 64:
        return {"entries_per_step": 2, "num_buffers": 3, "q_in_regs": True}
    return {"entries_per_step": 1, "num_buffers": 4, "q_in_regs": True}


def forward_hopper(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    layout: TileLayout, *, softmax_scale: float, pattern_head_div: int, num_tiles: int,
    heads_per_group: int, **options: int | bool,
) -> None:  # fmt: skip
    """Fill ``out`` (like q) and ``lse`` (batch, heads, seq_q) for batched inputs.

    ``options`` override ``default_options``: num_buffers (ring slots), entries_per_step,
    q_in_regs and persistent (one program per SM, else one per work item).
    """
    from .common import LOG2E

    options = {"persistent": True, **default_options(q.shape[-1]), **options}
    batch, seqlen_q, num_heads, head_dim = q.shape
    seqlen_k = k.shape[1]
    num_items = batch * num_heads * num_tiles
    grid = min(num_items, _num_sms(q.device)) if options["persistent"] else num_items
    _forward_kernel[(grid,)](
        _descriptor(q, layout.block_m), _descriptor(k, layout.block_n),
        _descriptor(v, layout.block_n), out, lse, item_counter(q.device),
        layout.full_offsets, layout.full_cols,
        layout.partial_offsets, layout.partial_cols, layout.partial_bits,
        out.stride(0), out.stride(1), out.stride(2), *lse.stride(),
        seqlen_q, seqlen_k, layout.num_groups, num_tiles, heads_per_group, num_items,
        softmax_scale * LOG2E,
        NUM_HEADS=num_heads,
        GQA_GROUP=num_heads // k.shape[-2],
        PATTERN_HEAD_DIV=pattern_head_div,
        HEAD_DIM=head_dim,
        **layout_constexprs(layout),
        NUM_BUFFERS=options["num_buffers"],
        Q_IN_REGS=options["q_in_regs"],
        ENTRIES=options["entries_per_step"],
        num_warps=4,
        maxnreg=_MAX_REGS,
    )  # fmt: skip


def item_counter(device: torch.device) -> torch.Tensor:
    """The int32 from which a launch's programs take their work items: zero at launch.

    Each launch leaves it at zero again (``_leave_counter_at_zero``), so one buffer serves every
    launch on a stream, which run one after another, and no fill kernel runs per launch (host
    time at short sequences). Each stream has its own, since launches on two streams may run at
    once; a launch captured in a CUDA graph gets a fresh one, which the graph keeps for its
    replays alone. Buffers are never freed: a kernel on their stream may still be using them.
    """
    if torch.cuda.is_current_stream_capturing():
        return torch.zeros(1, dtype=torch.int32, device=device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (index, torch._C._cuda_getCurrentRawStream(index))
    counter = _COUNTERS.get(key)
    if counter is None:
        counter = _COUNTERS[key] = torch.zeros(1, dtype=torch.int32, device=device)
    return counter


_COUNTERS: dict[tuple[int, int], torch.Tensor] = {}


@functools.cache
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count
