"""Pieces the Triton kernels share: where a program's sequence lies, the programs' order, an
entry's mask; and on the host, (batch, seq, heads, dim) views, LSE strides and dtypes."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

if TYPE_CHECKING:
    from ..layout import TileLayout

@triton.jit
def sequence_bounds(b, cu_seqlens_q, cu_seqlens_k, seqlen_q, seqlen_k, VARLEN: tl.constexpr):
    """(q_start, q_len, k_start, k_len) of sequence ``b``: from cu_seqlens when packed."""
    if VARLEN:
        q_start = tl.load(cu_seqlens_q + b).to(tl.int64)
        q_len = (tl.load(cu_seqlens_q + b + 1) - q_start).to(tl.int32)
        k_start = tl.load(cu_seqlens_k + b).to(tl.int64)
        k_len = (tl.load(cu_seqlens_k + b + 1) - k_start).to(tl.int32)
    else:
        q_start = tl.zeros([], dtype=tl.int64)
        q_len = seqlen_q
        k_start = tl.zeros([], dtype=tl.int64)
        k_len = seqlen_k
    return q_start, q_len, k_start, k_len


@triton.jit
def program_order(pid, grid_tiles, heads_per_group):
    """(batch * head, tile rank) of program ``pid`` in a 1-D grid of heads x ``grid_tiles``.

    Programs run roughly in pid order, so this order decides which tiles share L2 at a time:
    ``heads_per_group`` heads at a time, their tiles interleaved, rank 0 (the heaviest) first.
    One head's K and V (16 MB at 32k tokens, dim 128, bf16) fit in L2; every head's tiles side by
    side (the order of a (heads, tiles) grid) touch all heads' K and V at once, which do not.
    Measured (H100, forward, 32k, V16): L2 hit rate 67% -> 85%, DRAM traffic halved, 7-10% faster.
    """
    per_group = heads_per_group * grid_tiles
    rank = pid % per_group
    return (pid // per_group) * heads_per_group + rank % heads_per_group, rank // heads_per_group


@triton.jit
def entry_keep(
    bits, ROWS: tl.constexpr, COLS: tl.constexpr, ROW_GROUP: tl.constexpr,
    COL_GROUP: tl.constexpr, BITS_PER_ROW: tl.constexpr, TRANSPOSED: tl.constexpr,
):
    """A partial entry's bit for each element: (ROWS, COLS) bool, or (COLS, ROWS) when TRANSPOSED.

    Each row's slice of the packed bit matrix is shifted out once per row (ROWS 64-bit shifts),
    so the per-element test is 32-bit, or none at all when a row holds one bit (then the result
    is (ROWS, 1) and broadcasts). Key bounds and causality are the caller's.
    """
    shift = ((tl.arange(0, ROWS) // ROW_GROUP) * BITS_PER_ROW).to(tl.int64)
    if BITS_PER_ROW == 1:
        row_keep = ((bits >> shift) & 1) != 0
        if TRANSPOSED:
            return row_keep[None, :]
        else:
            return row_keep[:, None]
    else:
        if BITS_PER_ROW < 32:
            row_bits = ((bits >> shift) & ((1 << BITS_PER_ROW) - 1)).to(tl.int32)
            col_bit = tl.arange(0, COLS) // COL_GROUP
        else:
            row_bits = bits >> shift
            col_bit = (tl.arange(0, COLS) // COL_GROUP).to(tl.int64)
        if TRANSPOSED:
            return ((row_bits[None, :] >> col_bit[:, None]) & 1) != 0
        else:
            return ((row_bits[:, None] >> col_bit[None, :]) & 1) != 0


def gathered_lists(layout: TileLayout) -> tuple[torch.Tensor, ...]:
    """A forward layout's gathered entries as kernel arguments (full offsets and blocks, partial
    offsets, blocks and bits); without any, tensors that stand in unread."""
    if not layout.gather_width:
        return (layout.full_offsets,) * 5
    return (
        layout.gather_full_offsets, layout.gather_full_blocks, layout.gather_partial_offsets,
        layout.gather_partial_blocks, layout.gather_partial_bits,
    )


def as_batched(t: torch.Tensor, varlen: bool) -> tuple[torch.Tensor, tuple[int, ...]]:
    """A (batch, seq, heads, dim) view and its strides; packed tensors get batch stride 0, since
    kernels find each sequence through cu_seqlens."""
    if varlen:
        t = t.unsqueeze(0)
        return t, (0, *t.stride()[1:])
    return t, t.stride()


def lse_strides(lse: torch.Tensor, varlen: bool) -> tuple[int, int, int]:
    """(batch, head, seq) strides of an LSE-shaped tensor: (batch, heads, seq) or (heads, total)."""
    return (0, *lse.stride()) if varlen else lse.stride()


def dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs get exact fp32 products; tf32 would cost them three decimal digits.
    return "ieee" if dtype.itemsize > 2 else "tf32"


def next_power_of_2(n: int) -> int:
    """The least power of two at least ``n`` (1 for ``n <= 1``), for host code run on every
    launch: ``triton.next_power_of_2`` is a constexpr function, whose calls cost microseconds."""
    return 1 << max(0, n - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for host code (``triton.cdiv`` is a constexpr function too)."""
    return -(-a // b)


def padded_head_dim(head_dim: int) -> int:
    return max(16, next_power_of_2(head_dim))
