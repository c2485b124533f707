"""Warp-specialized forward for Hopper (sm_90), written in Gluon, and its launcher.

The Triton forward (``ops/triton/forward.py``) serializes QK^T -> softmax -> PV inside each
warpgroup and cannot be warp-specialized on sm_90 with Triton 3.6 (docs/design.md, #6
and 7). Gluon exposes what it needs: a one-warp *producer* partition walks the tile's entry list
and issues the bulk tensor copies (TMA) of K and V into a ring of shared-memory buffers, and the
*consumer* partition (two warpgroups, 64 query rows each) runs the MMAs asynchronously, so the
softmax of entry i runs while the tensor cores compute PV of entry i-1.

Same layouts, same results as the Triton kernel: full entries first, unmasked; then partial
entries with their bit mask, causality and key bounds. It takes the common case only
(``ops/backends.py``, the ``FORWARD`` table): dense 2-byte inputs on an sm_90 GPU, head dim
64 or 128, 128x64 layout tiles without gathered entries, no key bound to check in full entries.
Everything else runs the Triton kernel.
"""

from __future__ import annotations

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from ..launcher import Launcher
from ..layout import TileLayout
from ..options import GluonForwardConfig
from ..shapes import LOG2E, heads_per_program_group, layout_constexprs, query_tiles
from .common_sm90 import (
    MAX_REGS,
    alloc_item_slots,
    free_slots,
    item_counter,
    masked_scores,
    next_run,
    num_sms,
    query_item,
    query_tile_producer,
    ring_slot,
    store_rows_by_copy,
    take_item,
    tma_descriptor,
    warp_specialize,
    wgmma_layout,
)

__all__ = ["default_config", "forward"]


@gluon.jit
def _softmax_step(
    q, k_bufs, v_bufs, k_ready, v_ready, kv_empty, pos, held_pos, p, acc, m_i, l_i, masked,
    step, full_cols, partial_cols, partial_bits, full_start, partial_start, n_full, n_total,
    rows_abs, seq_k, qk_scale, s_zero, ROWS: gl.constexpr, BLOCK_N: gl.constexpr,
    ENTRIES: gl.constexpr, ROW_START: gl.constexpr, ROW_GROUP: gl.constexpr,
    COL_GROUP: gl.constexpr, BITS_PER_ROW: gl.constexpr, CAUSAL: gl.constexpr,
):
    """One step of the online softmax at ring position ``pos``: its QK^T runs beside the PV of
    the step held at ``held_pos`` (whose slot it then frees). Returns (p, acc, m_i, l_i)."""
    num_buffers: gl.constexpr = k_bufs.type.shape[0]
    keys: gl.constexpr = k_bufs.type.shape[2]
    head_dim: gl.constexpr = k_bufs.type.shape[4]
    s_layout: gl.constexpr = s_zero.type.layout
    o_layout: gl.constexpr = acc.type.layout
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    buf, phase = ring_slot(pos, num_buffers)
    prev, held_phase = ring_slot(held_pos, num_buffers)
    mbarrier.wait(k_ready.index(buf), phase)
    mbarrier.wait(v_ready.index(prev), held_phase)
    p_op = gl.convert_layout(p.to(k_bufs.dtype), p_layout)
    k = k_bufs.index(buf).reshape([keys, head_dim])
    s = warpgroup_mma(q, k.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    v = v_bufs.index(prev).reshape([keys, head_dim])
    acc = warpgroup_mma(p_op, v, acc, is_async=True)
    # QK^T of this step is done when at most the PV just issued is still running.
    s = warpgroup_mma_wait(1, deps=[s])
    if masked:
        s = masked_scores(
            s, step, full_cols, partial_cols, partial_bits, full_start, partial_start, n_full,
            n_total, rows_abs, seq_k, s_layout, ROWS, BLOCK_N, ENTRIES, ROW_START, ROW_GROUP,
            COL_GROUP, BITS_PER_ROW, CAUSAL,
        )
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
    HALF: gl.constexpr, work, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    HEAD_DIM: gl.constexpr,
    ROW_GROUP: gl.constexpr, COL_GROUP: gl.constexpr, BITS_PER_ROW: gl.constexpr,
    CAUSAL: gl.constexpr, Q_IN_REGS: gl.constexpr, ENTRIES: gl.constexpr,
):
    """One warpgroup: for each work item, the online softmax of query rows HALF * ROWS.. of the
    tile over its entries, ENTRIES at a step, then the normalized output and LSE of those rows.
    The two warpgroups share the K/V ring but never wait for each other: each frees a slot on
    its own (the empty barriers count two)."""
    (
        q_bufs, k_bufs, v_bufs, q_ready, q_empty, k_ready, v_ready, kv_empty, item_slots, o_desc,
        Out, Lse, full_cols, partial_cols, partial_bits, stride_ob, stride_os, stride_oh,
        stride_lb, stride_lh, stride_ls, seqlen_q, seqlen_k, num_items, qk_scale,
    ) = work
    ROWS: gl.constexpr = BLOCK_M // 2
    KEYS: gl.constexpr = ENTRIES * BLOCK_N  # keys per step
    num_buffers: gl.constexpr = k_bufs.type.shape[0]
    dtype: gl.constexpr = q_bufs.dtype
    s_layout: gl.constexpr = wgmma_layout(KEYS)
    o_layout: gl.constexpr = wgmma_layout(HEAD_DIM)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    q_offset = seqlen_k - seqlen_q
    s_zero = gl.zeros([ROWS, KEYS], gl.float32, layout=s_layout)
    c = 0  # K/V ring position, across work items
    j = 0  # work items taken
    t = take_item(q_ready, item_slots, 0)
    while t < num_items:
        slot = j % 2
        # Causal: partial entries that start after this warpgroup's last row (the upper diagonal
        # KV tile, for the first half of the rows) are wholly masked for it (n_mine drops them):
        # it skips the steps made only of those, and just frees their slots.
        b, h, tile, full_start, n_full, partial_start, n_total, n_mine = query_item(
            item_slots, slot, HALF
        )
        n_steps = gl.cdiv(n_total, ENTRIES)
        q_row0 = tile * BLOCK_M + HALF * ROWS  # absolute position of this warpgroup's first row
        my_steps = gl.cdiv(n_mine, ENTRIES)
        rows_abs = q_row0 + gl.arange(0, ROWS, layout=row_s)
        m_i = gl.full([ROWS], float("-inf"), gl.float32, layout=row_s)
        l_i = gl.full([ROWS], 0.0, gl.float32, layout=row_s)
        acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, layout=o_layout)
        q_view = q_bufs.index(slot).reshape([BLOCK_M, HEAD_DIM]).slice(HALF * ROWS, ROWS)
        if Q_IN_REGS:
            # QK^T then reads only K from shared memory.
            q = q_view.load(gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2))
        else:
            q = q_view
        if j > 0:
            # The previous item's output has been read out of its q slot by now (it left by bulk
            # copy): the producer may refill the slot.
            tma.store_wait(0)
            mbarrier.arrive(q_empty.index(1 - slot))
        # Steps that no row of this warpgroup sees are skipped (their slots just freed); the
        # others are masked only where an entry is partial for these rows.
        first, masked = next_run(
            my_steps * 0, my_steps, my_steps, partial_cols, partial_bits, partial_start, n_full,
            n_total, q_row0, seqlen_k, ROWS, BLOCK_N, ENTRIES, HALF * ROWS, ROW_GROUP,
            BITS_PER_ROW, CAUSAL, num_buffers,
        )
        free_slots(k_ready, v_ready, kv_empty, c, c + first)
        if first < my_steps:
            # The first step: scores and softmax; its PV is issued with the next step's QK^T.
            buf, phase = ring_slot(c + first, num_buffers)
            mbarrier.wait(k_ready.index(buf), phase)
            k = k_bufs.index(buf).reshape([KEYS, HEAD_DIM])
            s = warpgroup_mma(q, k.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            s = warpgroup_mma_wait(0, deps=[s])
            if masked:
                s = masked_scores(
                    s, first, full_cols, partial_cols, partial_bits, full_start, partial_start,
                    n_full, n_total, rows_abs, seqlen_k, s_layout, ROWS, BLOCK_N, ENTRIES,
                    HALF * ROWS, ROW_GROUP, COL_GROUP, BITS_PER_ROW, CAUSAL,
                )
            m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
            # A row with nothing visible so far keeps m = -inf; subtract 0 instead of NaN.
            m_ref = gl.where(m_new == float("-inf"), 0.0, m_new)
            p = gl.exp2(s * qk_scale - m_ref[:, None])
            l_i = gl.sum(p, 1)
            m_i = m_new

            held = first  # the step whose PV is pending
            # Steps made of full entries only, then the rest, which may be skipped or masked. Two
            # loops: one with a branch around the step slowed the forward by 2-8% and made
            # ptxas serialize the dQ kernel's MMAs (docs/design.md, #35).
            full_end = gl.maximum(gl.minimum(n_full // ENTRIES, my_steps), first + 1)
            for step in range(first + 1, full_end):
                p, acc, m_i, l_i = _softmax_step(
                    q, k_bufs, v_bufs, k_ready, v_ready, kv_empty, c + step, c + held, p, acc,
                    m_i, l_i, False, step, full_cols, partial_cols, partial_bits, full_start,
                    partial_start, n_full, n_total, rows_abs, seqlen_k, qk_scale, s_zero, ROWS,
                    BLOCK_N, ENTRIES, HALF * ROWS, ROW_GROUP, COL_GROUP, BITS_PER_ROW, CAUSAL,
                )
                held = step
            step, masked = next_run(
                full_end, my_steps, held, partial_cols, partial_bits, partial_start, n_full,
                n_total, q_row0, seqlen_k, ROWS, BLOCK_N, ENTRIES, HALF * ROWS, ROW_GROUP,
                BITS_PER_ROW, CAUSAL, num_buffers,
            )
            while step < my_steps:
                free_slots(k_ready, v_ready, kv_empty, c + held + 1, c + step)  # skipped
                p, acc, m_i, l_i = _softmax_step(
                    q, k_bufs, v_bufs, k_ready, v_ready, kv_empty, c + step, c + held, p, acc,
                    m_i, l_i, masked, step, full_cols, partial_cols, partial_bits, full_start,
                    partial_start, n_full, n_total, rows_abs, seqlen_k, qk_scale, s_zero, ROWS,
                    BLOCK_N, ENTRIES, HALF * ROWS, ROW_GROUP, COL_GROUP, BITS_PER_ROW, CAUSAL,
                )
                held = step
                step, masked = next_run(
                    step + 1, my_steps, held, partial_cols, partial_bits, partial_start,
                    n_full, n_total, q_row0, seqlen_k, ROWS, BLOCK_N, ENTRIES, HALF * ROWS,
                    ROW_GROUP, BITS_PER_ROW, CAUSAL, num_buffers,
                )

            last, phase = ring_slot(c + held, num_buffers)
            mbarrier.wait(v_ready.index(last), phase)
            v = v_bufs.index(last).reshape([KEYS, HEAD_DIM])
            acc = warpgroup_mma(gl.convert_layout(p.to(dtype), p_layout), v, acc, is_async=True)
            acc = warpgroup_mma_wait(0, deps=[acc])
            mbarrier.arrive(kv_empty.index(last))
            first = held + 1  # steps from here on are skipped
        free_slots(k_ready, v_ready, kv_empty, c + first, c + n_steps)
        c += n_steps

        # Rows that attend nothing: output 0 and LSE -inf, never 0/0.
        empty = l_i == 0.0
        lse = (m_i + gl.log2(gl.where(empty, 1.0, l_i))) * 0.6931471805599453  # natural log
        lse = gl.where(empty, float("-inf"), lse)
        inv_l = gl.convert_layout(1.0 / gl.where(empty, 1.0, l_i), row_o)
        # The output leaves through this warpgroup's rows of the item's q slot, which the
        # producer refills only once the copy has read them (released with the next item).
        store_rows_by_copy(
            o_desc, q_bufs.index(slot), HALF * ROWS, b, h, q_row0 - q_offset,
            (acc * inv_l[:, None]).to(dtype),
            Out + b.to(gl.int64) * stride_ob + h.to(gl.int64) * stride_oh, stride_os, seqlen_q,
            o_layout,
        )
        l_rows = q_row0 - q_offset + gl.arange(0, ROWS, layout=row_s)
        l_base = Lse + b.to(gl.int64) * stride_lb + h.to(gl.int64) * stride_lh
        gl.store(l_base + l_rows * stride_ls, lse, mask=(l_rows >= 0) & (l_rows < seqlen_q))
        j += 1
        t = take_item(q_ready, item_slots, j)
    tma.store_wait(0)


@gluon.jit
def _forward_kernel(
    q_desc, k_desc, v_desc, o_desc, Out, Lse, counter,
    full_offsets, full_cols, partial_offsets, partial_cols, partial_bits,
    stride_ob, stride_os, stride_oh, stride_lb, stride_lh, stride_ls,
    seqlen_q, seqlen_k, layout_tiles, grid_tiles, heads_per_group, num_items, qk_scale,
    NUM_HEADS: gl.constexpr, GQA_GROUP: gl.constexpr, Q_HEADS_PER_PATTERN_HEAD: gl.constexpr,
    HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    ROW_GROUP: gl.constexpr, COL_GROUP: gl.constexpr, BITS_PER_ROW: gl.constexpr,
    CAUSAL: gl.constexpr, NUM_BUFFERS: gl.constexpr, Q_IN_REGS: gl.constexpr,
    ENTRIES: gl.constexpr,
):
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
    item_slots = alloc_item_slots(2)
    for i in gl.static_range(2):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=2)  # one release per consumer warpgroup
    for i in gl.static_range(NUM_BUFFERS):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(kv_empty.index(i), count=2)

    # The consumers' shared arguments travel as one tuple, their constexprs apart: a tuple assigned
    # to a name inside a kernel turns its constexprs into tensors.
    work = (
        q_bufs, k_bufs, v_bufs, q_ready, q_empty, k_ready, v_ready, kv_empty, item_slots, o_desc,
        Out, Lse, full_cols, partial_cols, partial_bits, stride_ob, stride_os, stride_oh,
        stride_lb, stride_lh, stride_ls, seqlen_q, seqlen_k, num_items, qk_scale,
    )
    warp_specialize(
        _consumer,
        (
            work, BLOCK_M, BLOCK_N, HEAD_DIM, ROW_GROUP, COL_GROUP, BITS_PER_ROW, CAUSAL,
            Q_IN_REGS, ENTRIES,
        ),
        query_tile_producer,
        (
            q_desc, k_desc, v_desc, q_bufs, k_bufs, v_bufs, q_ready, q_empty, k_ready, v_ready,
            kv_empty, full_offsets, full_cols, partial_offsets, partial_cols, seqlen_q, seqlen_k,
            layout_tiles, grid_tiles, heads_per_group, num_items, counter, item_slots, NUM_HEADS,
            GQA_GROUP, Q_HEADS_PER_PATTERN_HEAD, BLOCK_M, BLOCK_N, ENTRIES, CAUSAL,
        ),
        1,
    )


# Repeat launches skip Triton's per-call binding: an 8k fwd+bwd is about as long on the host as on
# the GPU (docs/design.md, Host time).
_FORWARD = Launcher(_forward_kernel)


@functools.cache
def default_config(head_dim: int) -> GluonForwardConfig:
    """The measured launch per head dim (H100, docs/design.md, #11).

    Dim 128: one entry per step, q in registers, a ring of 4 KV tiles. Dim 64: the MMAs are half
    as long against the same softmax work, so two entries (128 keys) per step win (+9% at 32k);
    at dim 128 those spill or slow down. Persistent programs, one head's tiles at a time.
    """
    if head_dim <= 64:
        entries, buffers = 2, 3
    else:
        entries, buffers = 1, 4
    return GluonForwardConfig(
        num_buffers=buffers,
        entries_per_step=entries,
        q_in_regs=True,
        persistent=True,
        heads_per_group=1,
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
    config: GluonForwardConfig,
) -> None:
    """Fill ``out`` (like q) and ``lse`` (batch, heads, seq_q) for batched q (batch, seq_q, heads,
    dim), k and v (batch, seq_k, kv_heads, dim), on a 128x64 forward layout. ``config``'s fields
    left None take ``default_config``."""
    batch, seqlen_q, num_heads, head_dim = q.shape
    seqlen_k = k.shape[1]
    config = config.over(default_config(head_dim))
    num_tiles = query_tiles(layout.block_m, seqlen_q, seqlen_k, False)
    num_items = batch * num_heads * num_tiles
    grid = min(num_items, num_sms(q.device)) if config.persistent else num_items
    heads_per_group = heads_per_program_group(batch * num_heads, config.heads_per_group)
    _FORWARD[(grid,)](
        tma_descriptor(q, layout.block_m), tma_descriptor(k, layout.block_n),
        tma_descriptor(v, layout.block_n), tma_descriptor(out, layout.block_m // 2), out, lse,
        item_counter(q.device), layout.full_offsets, layout.full_cols,
        layout.partial_offsets, layout.partial_cols, layout.partial_bits,
        out.stride(0), out.stride(1), out.stride(2), *lse.stride(),
        seqlen_q, seqlen_k, layout.num_groups, num_tiles, heads_per_group, num_items,
        softmax_scale * LOG2E,
        NUM_HEADS=num_heads,
        GQA_GROUP=num_heads // k.shape[-2],
        Q_HEADS_PER_PATTERN_HEAD=q_heads_per_pattern_head,
        HEAD_DIM=head_dim,
        **layout_constexprs(layout),
        NUM_BUFFERS=config.num_buffers,
        Q_IN_REGS=config.q_in_regs,
        ENTRIES=config.entries_per_step,
        num_warps=4,
        maxnreg=MAX_REGS,
    )
