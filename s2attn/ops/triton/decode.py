"""Triton decode kernel: a few new query tokens per sequence against a paged KV cache; its launcher.

One program serves one (sequence, KV head, split). Its rows are the query heads of the KV head's
GQA group times the new tokens (row ``r`` is token ``r // group``, head ``r % group`` of the group),
so every K/V page it loads serves the whole group. It walks its share (split-K) of the decode
layout's list for the query block of the sequence's first new token, in one loop: the full
entries (every head keeps all of the block), then the partial ones with the entry's per-head bits
and the causal rule (which also hides the unwritten end of the last page). A KV block is one page
of ``block_size`` tokens, found through the page table.

With one split, the program writes the output directly. With more, each writes its normalised
partial output and natural-log LSE, and the last of a (sequence, KV head)'s programs to finish
(counted by an atomic) combines them exactly, in the same launch: at long contexts and small
batches there are too few (sequence, KV head) pairs to fill the GPU otherwise.

The kernels know layouts, page tables and strides, never patterns. The cache's page writes are
in ``page_write.py``.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ..decode_layout import DecodeLayout
from ..env import POISON_OUTPUTS
from ..launcher import Launcher
from ..options import TritonDecodeConfig
from ..shapes import LOG2E, lse_dtype
from .common import cdiv, dot_precision, next_power_of_2, padded_head_dim

__all__ = ["MAX_DECODE_ROWS", "decode", "decode_num_splits", "default_config"]

# Rows of one program (query heads of a GQA group x new tokens): more would spill registers.
MAX_DECODE_ROWS = 128
# Rows x splits of partial outputs the merge loads per step: (4 rows of a GQA group of 4, 16
# splits, 128) float32 is 64 registers a thread at 4 warps.
MERGE_ROWS_X_SPLITS = 64


@triton.jit
def _attend_page(
    acc, l_i, m_i, q, j, page, bits, K, V, stride_kp, stride_kn, stride_kd, stride_vp, stride_vn,
    stride_vd, row_pos, bitpos, ctx_len, qk_scale, offs_n, offs_d, d_ok,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr, MASKED: tl.constexpr, DENSE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Online softmax over KV block ``j``, held in page ``page`` (int64); ``bits`` is the entry's
    per-head bit matrix (read only for MASKED lists that are not DENSE)."""
    ACC = acc.dtype
    k_page = K + page * stride_kp
    v_page = V + page * stride_vp
    if MASKED:
        if DENSE:
            row_keep = bitpos >= 0
        else:
            row_keep = ((bits >> bitpos) & 1) != 0
    # A page wider than the KV tile is read in BLOCK_N-wide slices.
    for c in tl.static_range(PAGE_SIZE // BLOCK_N):
        slots = c * BLOCK_N + offs_n
        k_ptrs = k_page + slots[None, :] * stride_kn + offs_d[:, None] * stride_kd
        v_ptrs = v_page + slots[:, None] * stride_vn + offs_d[None, :] * stride_vd
        if MASKED:
            k_pos = j * PAGE_SIZE + slots
            k_ok = k_pos < ctx_len
            kt = tl.load(k_ptrs, mask=k_ok[None, :] & d_ok[:, None], other=0.0)
            v = tl.load(v_ptrs, mask=k_ok[:, None] & d_ok[None, :], other=0.0)
        elif BLOCK_D == HEAD_DIM:
            kt = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
        else:
            kt = tl.load(k_ptrs, mask=d_ok[:, None], other=0.0)
            v = tl.load(v_ptrs, mask=d_ok[None, :], other=0.0)
        s = tl.dot(q, kt, input_precision=DOT_PRECISION, out_dtype=ACC) * qk_scale
        if MASKED:
            keep = row_keep[:, None] & (k_pos[None, :] <= row_pos[:, None])
            s = tl.where(keep, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            # A row with nothing visible so far keeps m = -inf; subtract 0 to avoid NaN.
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_ref = m_new
        alpha = tl.math.exp2(m_i - m_ref)
        p = tl.math.exp2(s - m_ref[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(
            p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION, out_dtype=ACC
        )
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _attend_pages(
    acc, l_i, m_i, q, cols_ptr, bits_ptr, start, end, pages_ptr, stride_tj, K, V,
    stride_kp, stride_kn, stride_kd, stride_vp, stride_vn, stride_vd, row_pos, bitpos, ctx_len,
    qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr, MASKED: tl.constexpr, DENSE: tl.constexpr,
    DOT_PRECISION: tl.constexpr, PREFETCH: tl.constexpr,
):
    """Online softmax over entries ``start..end`` of one list; each entry is one page.

    DENSE lists are implicit: entry ``e`` is KV block ``e`` and every bit is set. MASKED entries
    apply their bits and causality, and load nothing past the context (the last page's tail is
    unwritten, and 0 * NaN would poison the row).

    PREFETCH = 0 reads each entry's list item, then its page id, then the page: three dependent
    round trips per page. PREFETCH = W reads W entries' items (and bits) in one round trip and
    their page ids in a second, so the per-entry loop waits only on the page's own loads, which
    the pipeline can issue ahead (a batch-1 program walks a few pages and is latency bound).
    """
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    # ``bits`` is bound in every entry's iteration: a name bound before a loop and rebound in it
    # is loop-carried and must keep its type.
    if PREFETCH == 0:
        for e in range(start, end):
            if DENSE:
                j = e
            else:
                j = tl.load(cols_ptr + e)
            page = tl.load(pages_ptr + j * stride_tj).to(tl.int64)
            if MASKED and not DENSE:
                bits = tl.load(bits_ptr + e)
            else:
                bits = 0
            acc, l_i, m_i = _attend_page(
                acc, l_i, m_i, q, j, page, bits, K, V, stride_kp, stride_kn, stride_kd,
                stride_vp, stride_vn, stride_vd, row_pos, bitpos, ctx_len, qk_scale,
                offs_n, offs_d, d_ok,
                HEAD_DIM, BLOCK_D, BLOCK_N, PAGE_SIZE, MASKED, DENSE, DOT_PRECISION,
            )
    else:
        lanes = tl.arange(0, PREFETCH)
        for e0 in range(start, end, PREFETCH):
            ents = e0 + lanes
            e_ok = ents < end
            if DENSE:
                cols = ents
            else:
                cols = tl.load(cols_ptr + ents, mask=e_ok, other=0)
            if MASKED and not DENSE:
                all_bits = tl.load(bits_ptr + ents, mask=e_ok, other=0)
            pages = tl.load(pages_ptr + cols * stride_tj, mask=e_ok, other=0).to(tl.int64)
            # Triton cannot index a tensor by a run-time lane: a one-hot sum picks it instead.
            for i in range(0, tl.minimum(end - e0, PREFETCH)):
                lane = lanes == i
                page = tl.sum(tl.where(lane, pages, 0))
                if MASKED and not DENSE:
                    j = tl.sum(tl.where(lane, cols, 0))
                    bits = tl.sum(tl.where(lane, all_bits, 0))
                else:
                    j = e0 + i  # read only by MASKED, where DENSE entry e is block e
                    bits = 0
                acc, l_i, m_i = _attend_page(
                    acc, l_i, m_i, q, j, page, bits, K, V, stride_kp, stride_kn, stride_kd,
                    stride_vp, stride_vn, stride_vd, row_pos, bitpos, ctx_len, qk_scale,
                    offs_n, offs_d, d_ok,
                    HEAD_DIM, BLOCK_D, BLOCK_N, PAGE_SIZE, MASKED, DENSE, DOT_PRECISION,
                )
    return acc, l_i, m_i


@triton.jit
def _entry(full_cols, partial_cols, partial_bits, full_start, num_full, part_start, e, ok,
           DENSE: tl.constexpr):
    """KV block and bits of entries ``e`` (scalar or vector) of a split's walk: the full list's
    ``num_full`` entries, then the partial ones. A full entry's bits are all set (every head
    keeps it, and it lies wholly before the new tokens, so the causal rule keeps every key)."""
    if DENSE:
        # Implicit lists: full entries are blocks 0 .. q_block - 1, partial ones the rest.
        col = e
        bits = e * 0 - 1
    else:
        is_full = e < num_full
        at = part_start + e - num_full
        col_f = tl.load(full_cols + full_start + e, mask=ok & is_full, other=0)
        col_p = tl.load(partial_cols + at, mask=ok & (e >= num_full), other=0)
        bits_p = tl.load(partial_bits + at, mask=ok & (e >= num_full), other=0)
        col = tl.where(is_full, col_f, col_p)
        bits = tl.where(is_full, -1, bits_p)
    return col, bits


@triton.jit
def _attend_entries(
    acc, l_i, m_i, q, full_cols, partial_cols, partial_bits, full_start, num_full, part_start,
    lo, hi, pages_ptr, stride_tj, K, V, stride_kp, stride_kn, stride_kd, stride_vp, stride_vn,
    stride_vd, row_pos, bitpos, ctx_len, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr, DENSE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    PREFETCH: tl.constexpr,
):
    """Online softmax over entries ``lo..hi`` of a split's walk (full entries, then partial ones;
    see :func:`_entry`), each one page, masked by its bits and causality.

    A split walks its share of both lists in one loop: at batch 1 a split holds one to a few
    pages, and a loop of its own for each list (:func:`_attend_pages`) cost a second chain of
    dependent loads (list entry -> page id -> page) in the splits that hold both kinds. A full
    entry goes through the masks, which keep all of it. One program for all of a list (large
    batches) walks each list on its own instead: there the masks on every page and the choice
    of list per entry cost about a tenth of the time (H100, 32k, batch 64). The two walks share
    their shape but not their code: one function with a constexpr choice of lists spills more
    in the one-program walk, which then takes 8% longer (H100, 32k, batch 64: 141 against
    130 us at V64, 283 against 262 at V16).

    PREFETCH = 0 reads each entry's list item, then its page id, then the page: three dependent
    round trips per page. PREFETCH = W reads W entries' items (and bits) in one round trip and
    their page ids in a second, so the per-entry loop waits only on the page's own loads.
    """
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    if PREFETCH == 0:
        for e in range(lo, hi):
            j, bits = _entry(
                full_cols, partial_cols, partial_bits, full_start, num_full, part_start, e, True,
                DENSE,
            )
            page = tl.load(pages_ptr + j * stride_tj).to(tl.int64)
            acc, l_i, m_i = _attend_page(
                acc, l_i, m_i, q, j, page, bits, K, V, stride_kp, stride_kn, stride_kd,
                stride_vp, stride_vn, stride_vd, row_pos, bitpos, ctx_len, qk_scale,
                offs_n, offs_d, d_ok,
                HEAD_DIM, BLOCK_D, BLOCK_N, PAGE_SIZE, True, DENSE, DOT_PRECISION,
            )
    else:
        lanes = tl.arange(0, PREFETCH)
        for e0 in range(lo, hi, PREFETCH):
            ents = e0 + lanes
            e_ok = ents < hi
            cols, all_bits = _entry(
                full_cols, partial_cols, partial_bits, full_start, num_full, part_start, ents,
                e_ok, DENSE,
            )
            pages = tl.load(pages_ptr + cols * stride_tj, mask=e_ok, other=0).to(tl.int64)
            # Triton cannot index a tensor by a run-time lane: a one-hot sum picks it instead.
            for i in range(0, tl.minimum(hi - e0, PREFETCH)):
                lane = lanes == i
                page = tl.sum(tl.where(lane, pages, 0))
                j = tl.sum(tl.where(lane, cols, 0))
                bits = tl.sum(tl.where(lane, all_bits, 0))
                acc, l_i, m_i = _attend_page(
                    acc, l_i, m_i, q, j, page, bits, K, V, stride_kp, stride_kn, stride_kd,
                    stride_vp, stride_vn, stride_vd, row_pos, bitpos, ctx_len, qk_scale,
                    offs_n, offs_d, d_ok,
                    HEAD_DIM, BLOCK_D, BLOCK_N, PAGE_SIZE, True, DENSE, DOT_PRECISION,
                )
    return acc, l_i, m_i


@triton.jit
def _decode_kernel(
    Q,
    K,
    V,
    Out,
    Lse,
    OutSplit,
    LseSplit,
    Counters,
    page_table,
    seq_lens,
    full_offsets,
    full_cols,
    partial_offsets,
    partial_mid,
    partial_cols,
    partial_bits,
    stride_qb,
    stride_qs,
    stride_qh,
    stride_qd,
    stride_kp,
    stride_kn,
    stride_kd,
    stride_vp,
    stride_vn,
    stride_vd,
    stride_tb,
    stride_th,
    stride_tj,
    stride_ob,
    stride_os,
    stride_oh,
    stride_od,
    stride_lb,
    stride_lh,
    stride_ls,
    num_q_blocks,
    qk_scale,
    num_splits,
    NUM_KV_HEADS: tl.constexpr,
    NUM_NEW: tl.constexpr,
    GQA_GROUP: tl.constexpr,
    HEADS_PER_BIT: tl.constexpr,
    SPLIT: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    DENSE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    MAX_SPLITS: tl.constexpr,
    MERGE_M: tl.constexpr,
    MERGE_CHUNK: tl.constexpr,
    PREFETCH: tl.constexpr,
):
    pid = tl.program_id(0)
    b = pid // NUM_KV_HEADS
    g = pid % NUM_KV_HEADS
    split = tl.program_id(1)

    # The new tokens are the last NUM_NEW of the context, at absolute positions ctx - NUM_NEW ...
    ctx_len = tl.load(seq_lens + b)
    first = ctx_len - NUM_NEW
    q_block = first // PAGE_SIZE
    straddle = (ctx_len - 1) // PAGE_SIZE > q_block

    rows = tl.arange(0, BLOCK_M)
    t = rows // GQA_GROUP
    hg = rows % GQA_GROUP
    row_ok = t < NUM_NEW
    row_pos = first + t
    # Bit 2 * r + d of a partial entry: pattern head r of the group, query block q_block + d.
    bitpos = (hg // HEADS_PER_BIT) * 2 + (row_pos // PAGE_SIZE - q_block)
    bitpos = tl.where(row_ok, bitpos, 0).to(tl.int64)
    h = g * GQA_GROUP + hg
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    q = tl.load(
        Q + b.to(tl.int64) * stride_qb + t[:, None] * stride_qs + h[:, None] * stride_qh
        + offs_d[None, :] * stride_qd,
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )

    if DENSE:
        full_start = 0
        full_end = q_block
        part_start = q_block
        part_end = q_block + 1 + straddle.to(tl.int32)
    else:
        key = g * num_q_blocks + q_block
        full_start = tl.load(full_offsets + key)
        full_end = tl.load(full_offsets + key + 1)
        part_start = tl.load(partial_offsets + key)
        # Entries only the next query block reads matter only when the new tokens reach it.
        part_end = tl.where(
            straddle, tl.load(partial_offsets + key + 1), tl.load(partial_mid + key)
        )
    pages_ptr = page_table + b.to(tl.int64) * stride_tb + g.to(tl.int64) * stride_th
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if SPLIT:  # this split's share of the walk: the full list, then the partial one
        num_full = full_end - full_start
        num_entries = num_full + part_end - part_start
        chunk = tl.cdiv(num_entries, num_splits)
        lo = split * chunk
        acc, l_i, m_i = _attend_entries(
            acc, l_i, m_i, q, full_cols, partial_cols, partial_bits, full_start, num_full,
            part_start, lo, tl.minimum(lo + chunk, num_entries), pages_ptr, stride_tj, K, V,
            stride_kp, stride_kn, stride_kd, stride_vp, stride_vn, stride_vd, row_pos, bitpos,
            ctx_len, qk_scale,
            HEAD_DIM, BLOCK_D, BLOCK_N, PAGE_SIZE, DENSE, DOT_PRECISION, PREFETCH,
        )
    else:
        acc, l_i, m_i = _attend_pages(
            acc, l_i, m_i, q, full_cols, partial_bits, full_start, full_end, pages_ptr,
            stride_tj, K, V, stride_kp, stride_kn, stride_kd, stride_vp, stride_vn, stride_vd,
            row_pos, bitpos, ctx_len, qk_scale,
            HEAD_DIM, BLOCK_D, BLOCK_N, PAGE_SIZE, False, DENSE, DOT_PRECISION, PREFETCH,
        )
        acc, l_i, m_i = _attend_pages(
            acc, l_i, m_i, q, partial_cols, partial_bits, part_start, part_end, pages_ptr,
            stride_tj, K, V, stride_kp, stride_kn, stride_kd, stride_vp, stride_vn, stride_vd,
            row_pos, bitpos, ctx_len, qk_scale,
            HEAD_DIM, BLOCK_D, BLOCK_N, PAGE_SIZE, True, DENSE, DOT_PRECISION, PREFETCH,
        )

    # Rows that attend nothing (in this split): output 0 and LSE -inf, never 0/0.
    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = (m_i + tl.math.log2(tl.where(empty, 1.0, l_i))) * 0.6931471805599453  # natural log
    lse = tl.where(empty, float("-inf"), lse)
    if not SPLIT:
        out_ptrs = (
            Out + b.to(tl.int64) * stride_ob + t[:, None] * stride_os + h[:, None] * stride_oh
            + offs_d[None, :] * stride_od
        )
        tl.store(out_ptrs, out.to(Out.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
        tl.store(Lse + b.to(tl.int64) * stride_lb + h * stride_lh + t * stride_ls, lse, mask=row_ok)
    else:
        # Scratch (batch, new, heads, splits, dim), contiguous: a row's splits lie in one run.
        row = (b.to(tl.int64) * NUM_NEW + t) * (NUM_KV_HEADS * GQA_GROUP) + h
        tl.store(
            OutSplit + (row * num_splits + split)[:, None] * HEAD_DIM + offs_d[None, :],
            out,
            mask=row_ok[:, None] & d_ok[None, :],
        )
        tl.store(LseSplit + row * num_splits + split, lse, mask=row_ok)
        # The last of a (sequence, KV head)'s splits to finish merges them all, so a step is one
        # launch (a merge kernel of its own cost a second launch's host time on every layer).
        # Every thread's stores come before the counter's release (the barrier, then the atomic
        # at GPU scope); the last program's acquire comes before its loads, which bypass L1.
        tl.debug_barrier()
        arrived = tl.atomic_add(Counters + pid, 1, sem="acq_rel", scope="gpu")
        if arrived == num_splits - 1:
            # The merge has no dot, so it takes only the group's real rows (BLOCK_M pads them
            # to the dot's 16): more splits per round trip to L2.
            m_rows = tl.arange(0, MERGE_M)
            m_t = m_rows // GQA_GROUP
            m_h = g * GQA_GROUP + m_rows % GQA_GROUP
            m_ok = m_t < NUM_NEW
            m_row = (b.to(tl.int64) * NUM_NEW + m_t) * (NUM_KV_HEADS * GQA_GROUP) + m_h
            merged, merged_lse = _merge_splits(
                OutSplit, LseSplit, m_row, m_ok, offs_d, d_ok, num_splits, HEAD_DIM, MERGE_M,
                BLOCK_D, MAX_SPLITS, MERGE_CHUNK,
            )
            m_out = (
                Out + b.to(tl.int64) * stride_ob + m_t[:, None] * stride_os
                + m_h[:, None] * stride_oh + offs_d[None, :] * stride_od
            )
            tl.store(m_out, merged.to(Out.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])
            tl.store(
                Lse + b.to(tl.int64) * stride_lb + m_h * stride_lh + m_t * stride_ls,
                merged_lse,
                mask=m_ok,
            )
            tl.store(Counters + pid, 0)  # every split has arrived: ready for the next launch


@triton.jit
def _merge_splits(
    OutSplit, LseSplit, row, row_ok, offs_d, d_ok, num_splits,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
    MAX_SPLITS: tl.constexpr, MERGE_CHUNK: tl.constexpr,
):
    """The exact LSE-weighted sum of ``row``'s splits, in a fixed order (deterministic whichever
    program merges): (out float32 (BLOCK_M, BLOCK_D), natural-log lse (BLOCK_M,)).

    Loads are vectors over splits: every LSE at once, then MERGE_CHUNK partial outputs per step,
    so the merge waits on 1 + num_splits / MERGE_CHUNK round trips to L2, not 2 * num_splits (at
    batch 1 the merge was most of the kernel's time)."""
    row_ok2 = row_ok[:, None]
    offs_s = tl.arange(0, MAX_SPLITS)
    lse_all = tl.load(
        LseSplit + row[:, None] * num_splits + offs_s[None, :],
        mask=row_ok2 & (offs_s < num_splits)[None, :], other=float("-inf"), cache_modifier=".cg",
    )
    m = tl.max(lse_all, 1)
    m_ref = tl.where(m == float("-inf"), 0.0, m)
    denom = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    offs_c = tl.arange(0, MERGE_CHUNK)
    for s0 in range(0, num_splits, MERGE_CHUNK):
        split = s0 + offs_c
        ok = row_ok2 & (split < num_splits)[None, :]  # (BLOCK_M, MERGE_CHUNK)
        at = row[:, None] * num_splits + split[None, :]
        # The chunk's LSEs again, beside its outputs in the same round trip: picking columns of
        # lse_all would take a masked reduction per split instead.
        lse_c = tl.load(LseSplit + at, mask=ok, other=float("-inf"), cache_modifier=".cg")
        o = tl.load(
            OutSplit + at[:, :, None] * HEAD_DIM + offs_d[None, None, :],
            mask=ok[:, :, None] & d_ok[None, None, :], other=0.0, cache_modifier=".cg",
        )
        w = tl.exp(lse_c - m_ref[:, None])
        acc += tl.sum(w[:, :, None] * o, 1)
        denom += tl.sum(w, 1)
    empty = denom == 0.0
    out = acc / tl.where(empty, 1.0, denom)[:, None]
    lse = tl.where(empty, float("-inf"), m_ref + tl.log(tl.where(empty, 1.0, denom)))
    return out, lse


# A decode step's launches cost more host time than their GPU work: skip Triton's binding when
# the arguments repeat (every step of a layer, as the cache's tensors are updated in place).
_DECODE = Launcher(_decode_kernel)


@functools.cache
def _num_sms(index: int | None) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


# Few (sequence, KV head) pairs (batch 1 or 2 of a GQA model) and lists that MAX_SPLITS splits of
# FEW_PAIRS_PAGES pages hold: FEW_PAIRS_SPLITS splits, more where those would hold more than
# FEW_PAIRS_PAGES pages. H100, batch 1, 8 KV heads, CUDA-graph replays: lists of 18-49 pages
# were fastest at 12-17 splits, 145 pages at 48 (14.0 us; 33 splits 15.5). A dense layer's 2048
# pages at 128k, in a compiled 7B step, took 0.18 ms at 33 splits and 0.21 at 64: bandwidth.
FEW_PAIRS_SPLITS = 16
FEW_PAIRS_PAGES = 3
MAX_SPLITS = 64


def decode_num_splits(
    batch: int, num_kv_heads: int, longest_list: int, device: torch.device
) -> int:
    """How many programs share one (sequence, KV head)'s list of pages (split-K).

    Many pairs: aim for 2 programs per SM, each split holding at least 4 pages. A decode program
    mostly waits on dependent loads (list entry, page id, page), and a second resident program
    hides that latency; more splits cost more in the merge than they save (H100 sweep, 128k
    context, batch 16, 8 KV heads, V64: 2 splits 0.072 ms, 5 splits 0.080 ms, CUDA-graph
    replays).

    Few pairs (when 2 programs per SM would take ``FEW_PAIRS_SPLITS`` splits or more) and a list
    of at most ``MAX_SPLITS * FEW_PAIRS_PAGES`` pages: a program is then a chain of dependent
    loads per page, not bandwidth, so splits hold 1-3 pages: ``FEW_PAIRS_SPLITS`` of them, or
    more where those would hold over ``FEW_PAIRS_PAGES``. Never more splits than pages or
    ``MAX_SPLITS``. Under the interpreter: one split.
    """
    if device.type != "cuda":
        return 1
    want = cdiv(2 * _num_sms(device.index), batch * num_kv_heads)
    if want >= FEW_PAIRS_SPLITS and longest_list <= MAX_SPLITS * FEW_PAIRS_PAGES:
        splits = max(FEW_PAIRS_SPLITS, cdiv(longest_list, FEW_PAIRS_PAGES))
    else:
        splits = min(want, cdiv(longest_list, 4))
    return max(1, min(splits, longest_list, MAX_SPLITS))


@functools.cache
def default_config(block_size: int) -> TritonDecodeConfig:
    """The launch for pages of ``block_size`` tokens.

    Each iteration is a chain of dependent loads (list entry -> page id -> page): a deep pipeline
    issues the next entries' index loads while this page's K/V arrive. 4 warps suffice for a
    16-row tile. H100 sweep (bench_decode.py --sweep, 128k, batch 16, V64): 4 warps, 4 stages,
    64-key tiles were best of 120 launches. Prefetching page ids (``prefetch_entries``) stays
    off: at batch 1 it came within 0.2 us of not prefetching (H200 sweep, 32k and 128k).
    """
    return TritonDecodeConfig(
        num_warps=4, num_stages=4, block_n=min(block_size, 64), prefetch_entries=0
    )


def _decode_outputs(
    q: torch.Tensor, num_kv_heads: int, num_splits: int, split_counters: torch.Tensor | None
) -> tuple[torch.Tensor, ...]:
    """``decode``'s outputs (out, lse), its splits' partial outputs and LSEs, and the split
    counters (``split_counters``, or zeros when None); with one split, the last three are ``lse``
    standing in (the kernel does not touch them)."""
    batch, num_new, num_heads, head_dim = q.shape
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((batch, num_heads, num_new), dtype=lse_dtype(q.dtype), device=q.device)
    split_shape = (batch, num_new, num_heads, num_splits)
    if num_splits > 1:
        out_split = torch.empty((*split_shape, head_dim), dtype=torch.float32, device=q.device)
        lse_split = torch.empty(split_shape, dtype=torch.float32, device=q.device)
        if split_counters is None:
            split_counters = torch.zeros(batch * num_kv_heads, dtype=torch.int32, device=q.device)
    else:
        out_split = lse_split = split_counters = lse  # not read or written
    if POISON_OUTPUTS:
        for t in (out, lse, out_split, lse_split):
            t.fill_(float("nan"))
    return out, lse, out_split, lse_split, split_counters


def _checked_config(block_size: int, config: TritonDecodeConfig | None) -> TritonDecodeConfig:
    """``config`` over :func:`default_config`'s for pages of ``block_size`` tokens, its tile and
    prefetch depth checked."""
    defaults = default_config(block_size)
    config = defaults if config is None else config.over(defaults)
    block_n = config.block_n
    if block_size % block_n:
        raise ValueError(f"block_n={block_n} must divide the page size {block_size}")
    prefetch = config.prefetch_entries
    if prefetch < 0 or prefetch & (prefetch - 1):
        raise ValueError(f"prefetch_entries={prefetch} must be 0 or a power of two")
    return config


def decode(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    layout: DecodeLayout,
    *,
    softmax_scale: float,
    num_splits: int = 1,
    split_counters: torch.Tensor | None = None,
    config: TritonDecodeConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the decode kernel on validated inputs.

    Args:
        q: (batch, num_new, heads, dim): the new tokens' queries, the last ``num_new`` positions of
            each sequence. Any strides.
        k_pages, v_pages: (num_pages, block_size, dim): the page pools; page ``p`` holds the keys of
            ``block_size`` consecutive positions of one (sequence, KV head).
        page_table: int32 (batch, kv_heads, max_blocks): the page of each KV block, -1 if absent.
            Every block the layout lists for a query must be present.
        seq_lens: int32 (batch,): context length of each sequence, new tokens included (they are
            already in the pages).
        layout: the decode layout, over ``kv_heads`` KV heads and pages of ``block_size``.
        softmax_scale: the score scale.
        num_splits: programs per (sequence, KV head); see :func:`decode_num_splits`.
        split_counters: int32, at least ``batch * kv_heads`` zeros on q's device, for
            ``num_splits > 1``: each (sequence, KV head)'s count of finished splits, which the
            kernel leaves at zero again. A caller that launches in order (a cache's steps) keeps
            one; None allocates zeros for this call.
        config: launch settings for tuning sweeps; the fields left None take
            :func:`default_config`'s.

    Returns ``out`` like q in q's dtype and ``lse`` float32 (batch, heads, num_new).
    """
    batch, num_new, num_heads, head_dim = q.shape
    num_kv_heads = page_table.shape[1]
    group = num_heads // num_kv_heads
    out, lse, out_split, lse_split, split_counters = _decode_outputs(
        q, num_kv_heads, num_splits, split_counters
    )
    if out.numel() == 0:
        return out, lse

    block_size = layout.block_size
    config = _checked_config(block_size, config)
    merge_m = next_power_of_2(group * num_new)
    block_m = max(16, merge_m)  # a dot's rows: at least 16
    _DECODE[(batch * num_kv_heads, num_splits)](
        q, k_pages, v_pages, out, lse, out_split, lse_split, split_counters, page_table, seq_lens,
        layout.full_offsets, layout.full_cols, layout.partial_offsets, layout.partial_mid,
        layout.partial_cols, layout.partial_bits,
        *q.stride(), *k_pages.stride(), *v_pages.stride(), *page_table.stride(),
        *out.stride(), *lse.stride(),
        layout.num_q_blocks, softmax_scale * LOG2E, num_splits,
        NUM_KV_HEADS=num_kv_heads,
        NUM_NEW=num_new,
        GQA_GROUP=group,
        HEADS_PER_BIT=group // layout.heads_per_kv_head,
        SPLIT=num_splits > 1,
        HEAD_DIM=head_dim,
        BLOCK_D=padded_head_dim(head_dim),
        BLOCK_M=block_m,
        BLOCK_N=config.block_n,
        PAGE_SIZE=block_size,
        DENSE=layout.dense,
        DOT_PRECISION=dot_precision(q.dtype),
        MAX_SPLITS=next_power_of_2(num_splits),
        MERGE_M=merge_m,
        MERGE_CHUNK=min(next_power_of_2(num_splits), max(1, MERGE_ROWS_X_SPLITS // merge_m)),
        PREFETCH=config.prefetch_entries,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return out, lse
