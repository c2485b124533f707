"""What the Gluon kernels for Hopper (sm_90) share.

Each kernel is persistent: its programs take work items from a global counter (``item_counter``)
as they finish the previous one, in the order of ``work_item``. Inside a program, one-warp
*producer* partitions copy tiles into shared-memory rings by TMA and hand each work item's index
to two *consumer* warpgroups through ``put_item`` / ``take_item``; ``warp_specialize`` starts
them all. The forward and dQ kernels share their producer (``query_tile_producer``), and both
halves of a 128-row query tile skip or mask entries on their own (``next_run``,
``masked_scores``). On the host: TMA descriptors made without the dataclass's checks, and the
counters.
"""

from __future__ import annotations

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ...memory import build_outside_graph_pool

# Each kernel runs two consumer warpgroups, the default partition and a worker, and one or two
# one-warp producers; the producers get few registers, the consumers the rest.
_PRODUCER_WARPS = gl.constexpr(1)
_PRODUCER_REGS = gl.constexpr(24)
_CONSUMER_REGS = gl.constexpr(240)
MAX_REGS = 168  # per thread over the 12 warps: 2 x 4 x 240 + 4 x 24 (the producer's warpgroup)


@gluon.jit
def _indexed_partition(fn, index: gl.constexpr, args):
    """``fn(index, *args)``. Partitions are started through these two: ``gl.warp_specialize``
    starts only functions named in the kernel's source, not ones passed in as arguments."""
    fn(index, *args)


@gluon.jit
def _partition(fn, args):
    """``fn(*args)``."""
    fn(*args)


@gluon.jit
def warp_specialize(consumer, consumer_args, producer, producer_args, PRODUCERS: gl.constexpr):
    """Run a kernel's partitions: ``consumer(half, *consumer_args)`` on two warpgroups (half 0
    in the default partition, 1 in a worker) and ``producer`` on PRODUCERS one-warp workers:
    ``producer(*producer_args)`` for one, ``producer(stream, *producer_args)`` for each of two.

    Pass the argument tuples as literals in the call: a tuple assigned to a name inside a kernel
    turns its constexprs into tensors."""
    if PRODUCERS == 1:
        gl.warp_specialize(
            [
                (_indexed_partition, (consumer, 0, consumer_args)),
                (_indexed_partition, (consumer, 1, consumer_args)),
                (_partition, (producer, producer_args)),
            ],
            [4, _PRODUCER_WARPS],
            [_CONSUMER_REGS, _PRODUCER_REGS],
        )
    else:
        gl.warp_specialize(
            [
                (_indexed_partition, (consumer, 0, consumer_args)),
                (_indexed_partition, (consumer, 1, consumer_args)),
                (_indexed_partition, (producer, 0, producer_args)),
                (_indexed_partition, (producer, 1, producer_args)),
            ],
            [4, _PRODUCER_WARPS, _PRODUCER_WARPS],
            [_CONSUMER_REGS, _PRODUCER_REGS, _PRODUCER_REGS],
        )


@gluon.constexpr_function
def wgmma_layout(n):
    """Accumulator layout of one warpgroup's 64-row MMAs with n columns."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, n, 16])


@gluon.jit
def ring_slot(pos, n: gl.constexpr):
    """(slot, mbarrier phase) of ring position ``pos`` (never negative) in a ring of ``n``
    slots. Unsigned: a signed ``%`` and ``//`` make ptxas round toward zero, a handful of
    uniform instructions per split, and each MMA step splits two or three positions."""
    u = pos.to(gl.uint32)
    return (u % n).to(gl.int32), ((u // n) & 1).to(gl.int32)


@gluon.jit
def free_slots(k_ready, v_ready, kv_empty, first, last):
    """Release ring positions first..last-1 that this warpgroup skips: a slot may be freed only
    once its copies have landed."""
    num_buffers: gl.constexpr = k_ready.type.shape[0]
    for c in range(first, last):
        buf, phase = ring_slot(c, num_buffers)
        mbarrier.wait(k_ready.index(buf), phase)
        mbarrier.wait(v_ready.index(buf), phase)
        mbarrier.arrive(kv_empty.index(buf))


@gluon.jit
def store_rows(base, rows, values, stride_s, seqlen, layout: gl.constexpr):
    """Store (len(rows), dim) ``values`` at ``base + rows * stride_s``, rows in [0, seqlen)."""
    offs_d = gl.arange(0, values.shape[1], layout=gl.SliceLayout(0, layout))
    gl.store(
        base + rows[:, None].to(gl.int64) * stride_s + offs_d[None, :],
        values,
        mask=((rows >= 0) & (rows < seqlen))[:, None],
    )


@gluon.jit
def store_rows_by_copy(desc, tile_smem, ROW_START: gl.constexpr, b, h, first_row, values, base,
                       stride_s, seqlen, layout: gl.constexpr):
    """Store (rows, dim) ``values`` as rows ``first_row``.. of (batch b, head h) by one bulk copy
    through rows ROW_START.. of ``tile_smem``, a (1, tile rows, 1, dim) buffer that no copy is
    reading; rows past ``seqlen`` are clipped by ``desc``. 64 rows of stores from registers took
    as long as two forward entries. A bulk store may not start before row 0 (on an H100 it
    faults: an illegal instruction), so rows from a negative ``first_row`` (only a bottom-right
    aligned call's first tile) go from registers to ``base + row * stride_s``, rows in [0,
    seqlen)."""
    rows: gl.constexpr = values.shape[0]
    if first_row >= 0:
        staged = tile_smem.reshape([tile_smem.type.shape[1], values.shape[1]])
        staged.slice(ROW_START, rows).store(values)
        fence_async_shared()
        gl.thread_barrier()  # every thread's rows are in shared memory before the copy reads
        rows_smem = tile_smem.slice(ROW_START, rows, dim=1)
        tma.async_copy_shared_to_global(desc, [b, first_row, h, 0], rows_smem)
    else:
        offs = first_row + gl.arange(0, rows, layout=gl.SliceLayout(1, layout))
        store_rows(base, offs, values, stride_s, seqlen, layout)


@gluon.jit
def entry_col(full_cols, partial_cols, full_start, partial_start, n_full, e):
    """KV tile index of the tile's ``e``-th entry: full entries first, then partial ones."""
    if e < n_full:
        n = gl.load(full_cols + full_start + e)
    else:
        n = gl.load(partial_cols + partial_start + (e - n_full))
    return n


# A work item's slot in shared memory holds its index and, for query tiles, what the producer
# read of its list (``put_query_item``), so the consumers start without global loads of their own.
_ITEM_FIELDS = gl.constexpr(16)  # index, b, h, tile, 4 list fields, 2 lengths; a power of two


@gluon.jit
def put_item(item_slots, slot, t):
    """Hand work item ``t`` from a producer (one warp) to its consumers through shared memory;
    the mbarrier arrival that follows publishes it."""
    one: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    item_slots.index(slot).slice(0, 1).store(gl.full([1], t, gl.int32, layout=one))


@gluon.jit
def put_query_item(
    item_slots, slot, t, b, h, tile, full_start, n_full, partial_start, n_total, n_mine_0,
    n_mine_1,
):
    """``put_item`` of a query tile's item with its list (``work_item``) and each half's
    ``entries_reaching``: ``query_item`` reads them back."""
    one: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    k = gl.arange(0, _ITEM_FIELDS, layout=one)
    record = gl.where(k == 0, t, 0) + gl.where(k == 1, b, 0) + gl.where(k == 2, h, 0)
    record += gl.where(k == 3, tile, 0) + gl.where(k == 4, full_start, 0)
    record += gl.where(k == 5, n_full, 0) + gl.where(k == 6, partial_start, 0)
    record += gl.where(k == 7, n_total, 0) + gl.where(k == 8, n_mine_0, 0)
    record += gl.where(k == 9, n_mine_1, 0)
    item_slots.index(slot).store(record)


@gluon.jit
def alloc_item_slots(n: gl.constexpr):
    """Shared memory for ``n`` work items (``put_item``, ``put_query_item``)."""
    layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])  # of a slot, once indexed
    return gl.allocate_shared_memory(gl.int32, [n, _ITEM_FIELDS], layout)


@gluon.jit
def _item_field(item_slots, slot, k: gl.constexpr):
    one: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    return gl.max(item_slots.index(slot).slice(k, 1).load(one), 0)


@gluon.jit
def get_item(item_slots, slot):
    """The work item in ``slot``, read by a consumer warpgroup once its mbarrier has completed."""
    return _item_field(item_slots, slot, 0)


@gluon.jit
def query_item(item_slots, slot, HALF: gl.constexpr):
    """(b, h, tile, full_start, n_full, partial_start, n_total, n_mine) of the query tile item in
    ``slot``, as ``put_query_item`` put them; n_mine is half ``HALF``'s."""
    return (
        _item_field(item_slots, slot, 1), _item_field(item_slots, slot, 2),
        _item_field(item_slots, slot, 3), _item_field(item_slots, slot, 4),
        _item_field(item_slots, slot, 5), _item_field(item_slots, slot, 6),
        _item_field(item_slots, slot, 7), _item_field(item_slots, slot, 8 + HALF),
    )


@gluon.jit
def take_item(q_ready, item_slots, j):
    """The consumers' ``j``-th work item (>= num_items past the last): waits for its q slot
    (one per slot of ``q_ready``, taken in turn), which carries the index that
    ``query_tile_producer`` put."""
    q_slots: gl.constexpr = q_ready.type.shape[0]
    mbarrier.wait(q_ready.index(j % q_slots), (j // q_slots) & 1)
    return get_item(item_slots, j % q_slots)


@gluon.jit
def leave_counter_at_zero(counter, t, num_items, TAKERS_PER_PROGRAM: gl.constexpr):
    """Called by each taker (a producer loop) with the index ``t >= num_items`` that ended its
    loop. Every taker stops at its first such index, so a launch adds exactly num_items + takers
    to ``counter``; the taker that made the last add knows that no other will touch it and puts
    it back to zero for the next launch on the stream (``item_counter``)."""
    takers = gl.num_programs(0) * TAKERS_PER_PROGRAM
    if t == num_items + takers - 1:
        gl.atomic_add(counter, -(num_items + takers))


@gluon.jit
def work_item(
    t, full_offsets, partial_offsets, seqlen_k, layout_tiles, grid_tiles, heads_per_group,
    NUM_HEADS: gl.constexpr, Q_HEADS_PER_PATTERN_HEAD: gl.constexpr, BLOCK_M: gl.constexpr,
):
    """(b, h, tile, full_start, n_full, partial_start, n_total) of work item ``t``.

    Items are ordered as the Triton kernel's programs (ops/triton/common.py ``program_order``): one
    group of heads at a time, so their K and V stay in L2, heaviest tile first. Programs take
    them in that order from a global counter as they finish the previous one, so the last items
    taken are light ones and no program is left finishing a heavy item alone (taking every
    grid-th item instead left programs 3% apart in work at 32k and 6-8% at 8k)."""
    per_group = heads_per_group * grid_tiles
    rank = t % per_group
    bh = (t // per_group) * heads_per_group + rank % heads_per_group
    h = bh % NUM_HEADS
    tile = (seqlen_k - 1) // BLOCK_M - rank // heads_per_group
    full_start, n_full, partial_start, n_total = entry_list(
        full_offsets, partial_offsets, h, tile, layout_tiles, Q_HEADS_PER_PATTERN_HEAD
    )
    return bh // NUM_HEADS, h, tile, full_start, n_full, partial_start, n_total


@gluon.jit
def entry_list(
    full_offsets, partial_offsets, h, tile, layout_tiles, Q_HEADS_PER_PATTERN_HEAD: gl.constexpr
):
    """(full_start, n_full, partial_start, n_total) of head ``h``'s list for layout tile ``tile``
    (a query tile in forward layouts, a KV tile in backward ones)."""
    group = (h // Q_HEADS_PER_PATTERN_HEAD) * layout_tiles + tile
    full_start = gl.load(full_offsets + group)
    n_full = gl.load(full_offsets + group + 1) - full_start
    partial_start = gl.load(partial_offsets + group)
    n_total = n_full + gl.load(partial_offsets + group + 1) - partial_start
    return full_start, n_full, partial_start, n_total


@gluon.jit
def query_tile_producer(
    q_desc, k_desc, v_desc, q_bufs, k_bufs, v_bufs, q_ready, q_empty, k_ready, v_ready, kv_empty,
    full_offsets, full_cols, partial_offsets, partial_cols,
    seqlen_q, seqlen_k, layout_tiles, grid_tiles, heads_per_group, num_items, counter, item_slots,
    NUM_HEADS: gl.constexpr, GQA_GROUP: gl.constexpr, Q_HEADS_PER_PATTERN_HEAD: gl.constexpr,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, ENTRIES: gl.constexpr, CAUSAL: gl.constexpr,
    do_desc=None, do_bufs=None, o_desc=None, o_bufs=None, WITH_GRAD: gl.constexpr = False,
):
    """Takes work items from ``counter`` and walks their entries, copying q (and dO and O,
    WITH_GRAD: the dQ kernel) and K/V tiles into the rings as soon as the consumers free a slot:
    the next tile's loads overlap this tile's end. Each q slot carries its item's index to the
    consumers (past the last item, an index >= num_items), with its list and the length each half
    of the tile walks (``entries_reaching``): this warp reads them long before the consumers
    start the item, which would otherwise wait on those loads. A K/V slot holds ENTRIES
    consecutive entries; past the list's end it repeats the last one (finite data, masked out by
    the consumers)."""
    num_buffers: gl.constexpr = k_bufs.type.shape[0]
    q_slots: gl.constexpr = q_bufs.type.shape[0]
    q_offset = seqlen_k - seqlen_q
    c = 0  # K/V ring position, across work items
    j = 0  # work items taken
    t = gl.atomic_add(counter, 1)
    while t < num_items:
        b, h, tile, full_start, n_full, partial_start, n_total = work_item(
            t, full_offsets, partial_offsets, seqlen_k, layout_tiles, grid_tiles,
            heads_per_group, NUM_HEADS, Q_HEADS_PER_PATTERN_HEAD, BLOCK_M,
        )
        # Slots start free: the first pass waits on the phase before the barrier's first.
        slot = j % q_slots
        ready = q_ready.index(slot)
        rows: gl.constexpr = BLOCK_M // 2
        last_row_0 = tile * BLOCK_M + rows - 1
        n_mine_0 = entries_reaching(
            partial_cols, partial_start, n_full, n_total, last_row_0, BLOCK_N, CAUSAL
        )
        n_mine_1 = entries_reaching(
            partial_cols, partial_start, n_full, n_total, last_row_0 + rows, BLOCK_N, CAUSAL
        )
        mbarrier.wait(q_empty.index(slot), ((j // q_slots) & 1) ^ 1)
        put_query_item(
            item_slots, slot, t, b, h, tile, full_start, n_full, partial_start, n_total,
            n_mine_0, n_mine_1,
        )
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
            buf, phase = ring_slot(c, num_buffers)
            mbarrier.wait(kv_empty.index(buf), phase ^ 1)
            mbarrier.expect(k_ready.index(buf), ENTRIES * k_desc.block_type.nbytes)
            mbarrier.expect(v_ready.index(buf), ENTRIES * v_desc.block_type.nbytes)
            for sub in gl.static_range(ENTRIES):
                e = gl.minimum(step * ENTRIES + sub, n_total - 1)
                n = entry_col(full_cols, partial_cols, full_start, partial_start, n_full, e)
                tma.async_copy_global_to_shared(
                    k_desc, [b, n * BLOCK_N, kv_head, 0], k_ready.index(buf),
                    k_bufs.index(buf).slice(sub * BLOCK_N, BLOCK_N, dim=1),
                )
                tma.async_copy_global_to_shared(
                    v_desc, [b, n * BLOCK_N, kv_head, 0], v_ready.index(buf),
                    v_bufs.index(buf).slice(sub * BLOCK_N, BLOCK_N, dim=1),
                )
            c += 1
        j += 1
        t = gl.atomic_add(counter, 1)
    leave_counter_at_zero(counter, t, num_items, 1)
    slot = j % q_slots
    mbarrier.wait(q_empty.index(slot), ((j // q_slots) & 1) ^ 1)
    put_item(item_slots, slot, t)
    mbarrier.arrive(q_ready.index(slot))


@gluon.jit
def entries_reaching(
    partial_cols, partial_start, n_full, n_total, last_row, BLOCK_N: gl.constexpr,
    CAUSAL: gl.constexpr,
):
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
def masked_scores(
    s, step, full_cols, partial_cols, partial_bits, full_start, partial_start, n_full, n_total,
    rows_abs, seq_k, s_layout: gl.constexpr, ROWS: gl.constexpr, BLOCK_N: gl.constexpr,
    ENTRIES: gl.constexpr, ROW_START: gl.constexpr, ROW_GROUP: gl.constexpr,
    COL_GROUP: gl.constexpr, BITS_PER_ROW: gl.constexpr, CAUSAL: gl.constexpr,
):
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
    n0 = entry_col(full_cols, partial_cols, full_start, partial_start, n_full, e0)
    bits0 = _entry_bits(partial_bits, partial_start, n_full, n_total, e0)
    row_bits = (((bits0 >> shift) & row_mask).to(gl.int32))[:, None]
    if ENTRIES == 1:
        n_c = n0
    else:
        last = gl.minimum(e0 + 1, n_total - 1)
        n1 = entry_col(full_cols, partial_cols, full_start, partial_start, n_full, last)
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
):
    """(seen, masked) of the tile's ``e``-th entry for ROWS rows from row ROW_START of the
    layout tile (absolute position ``first_row``): whether any of them sees one of its keys,
    and whether their scores need ``masked_scores``. A partial entry is often whole or empty
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
):
    """(seen, masked) of a step (entries step * ENTRIES...) for the rows of
    ``_entry_for_rows``. Steps of two entries are seen while they hold one and masked when one
    is partial: a pair is rarely unseen or whole for one half of the tile, and testing both
    cost more than it saved at dim 64 (docs/design.md, #35)."""
    if ENTRIES == 1:
        seen, masked = _entry_for_rows(
            partial_cols, partial_bits, partial_start, n_full, n_total, step, first_row, seq_k,
            ROWS, BLOCK_N, ROW_START, ROW_GROUP, BITS_PER_ROW, CAUSAL,
        )
    else:
        seen = step * ENTRIES < n_total
        masked = (step + 1) * ENTRIES > n_full
    return seen, masked


@gluon.jit
def next_run(
    step, limit, held, partial_cols, partial_bits, partial_start, n_full, n_total, first_row,
    seq_k, ROWS: gl.constexpr, BLOCK_N: gl.constexpr, ENTRIES: gl.constexpr,
    ROW_START: gl.constexpr, ROW_GROUP: gl.constexpr, BITS_PER_ROW: gl.constexpr,
    CAUSAL: gl.constexpr, NUM_BUFFERS: gl.constexpr,
):
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
        )
        run = seen | (step - held >= NUM_BUFFERS - 1)
        masked = masked | (seen == 0)
        step = gl.where(run, step, step + 1)
        go = (run == 0) & (step < limit)
    return step, masked


def tma_descriptor(t: torch.Tensor, rows: int) -> TensorDescriptor:
    """A (batch, seq, heads, dim) bulk-copy descriptor with (1, rows, 1, dim) blocks.

    Built without the dataclass's own checks: ``supported`` already checked alignment and
    strides, and those checks cost more host time than the launch at short sequences."""
    return unchecked_descriptor(
        t, list(t.shape), [1, rows, 1, t.shape[-1]], _smem_layout(rows, t.shape[-1], t.dtype)
    )


def unchecked_descriptor(
    base: torch.Tensor, shape: list[int], block: list[int], layout: gl.NVMMASharedLayout
) -> TensorDescriptor:
    """A TensorDescriptor over ``base`` (its strides) without the dataclass's checks; callers
    check alignment and strides first."""
    desc = TensorDescriptor.__new__(TensorDescriptor)
    desc.__dict__.update(
        base=base, shape=shape, strides=list(base.stride()), block_shape=block, layout=layout,
        padding="zero",
    )
    return desc


@functools.cache
def _smem_layout(rows: int, head_dim: int, dtype: torch.dtype) -> gl.NVMMASharedLayout:
    element = gl.bfloat16 if dtype == torch.bfloat16 else gl.float16
    return gl.NVMMASharedLayout.get_default_for([1, rows, 1, head_dim], element)



def item_counter(device: torch.device) -> torch.Tensor:
    """The int32 from which a launch's programs take their work items: zero at launch.

    Each launch leaves it at zero again (``leave_counter_at_zero``), so one buffer serves every
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
        counter = _COUNTERS[key] = build_outside_graph_pool(
            device, lambda: torch.zeros(1, dtype=torch.int32, device=device)
        )
    return counter


_COUNTERS: dict[tuple[int, int], torch.Tensor] = {}


@functools.cache
def num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count

