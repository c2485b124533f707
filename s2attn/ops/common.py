"""Pieces every kernel shares: where a program's sequence lies, an entry's mask, launch strides."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634

# Tests set this so that every output element starts as NaN: one a kernel fails to write fails.
POISON_OUTPUTS = os.environ.get("S2ATTN_POISON_OUTPUTS") == "1"


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
def entry_bit_positions(
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ROW_GROUP: tl.constexpr,
    COL_GROUP: tl.constexpr, BITS_PER_ROW: tl.constexpr,
):  # fmt: skip
    """(BLOCK_M, BLOCK_N) int64: which bit of an entry's packed bit matrix covers each element."""
    rows = tl.arange(0, BLOCK_M) // ROW_GROUP
    cols = tl.arange(0, BLOCK_N) // COL_GROUP
    return (rows[:, None] * BITS_PER_ROW + cols[None, :]).to(tl.int64)


@triton.jit
def entry_keep(bits, bitpos, rows_abs, cols_abs, k_ok, CAUSAL: tl.constexpr):
    """(BLOCK_M, BLOCK_N) bool for a partial entry: its bit mask, key bounds, causality."""
    keep = (((bits >> bitpos) & 1) != 0) & k_ok[None, :]
    if CAUSAL:
        keep = keep & (rows_abs[:, None] >= cols_abs[None, :])
    return keep


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


def lse_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 LSE (and accumulators); float64 only for float64 inputs (gradcheck)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def padded_head_dim(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))
