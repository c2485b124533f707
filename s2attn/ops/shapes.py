"""What every launcher, Triton or Gluon, derives the same way from the inputs and a layout: the
sequence lengths a launch covers (packed sequences' as one :class:`Varlen`), the LSE's dtype, its
query tiles, its heads' program groups, the layout's compile-time geometry and whether keys need
bounds checks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .layout import TileLayout

__all__ = [
    "LOG2E",
    "Varlen",
    "check_k_bounds",
    "heads_per_program_group",
    "keys_need_bounds",
    "layout_constexprs",
    "lse_dtype",
    "query_tiles",
    "sequence_lengths",
]

LOG2E = 1.4426950408889634


@dataclass(frozen=True, eq=False)
class Varlen:
    """The lengths of packed sequences, flash-attn's four varlen values: int32 (batch + 1,)
    offsets of each sequence's queries and keys in packed (total, heads, dim) tensors, and the
    longest query and key runs. A call on batched tensors passes None instead."""

    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int


def sequence_lengths(
    q: torch.Tensor, k: torch.Tensor, varlen: Varlen | None
) -> tuple[bool, int, int, int]:
    """(packed, batch, seqlen_q, seqlen_k) of batched q (batch, seq_q, heads, dim), k (batch,
    seq_k, kv_heads, dim), or of packed ones with their ``varlen`` lengths."""
    if varlen is not None:
        return True, varlen.cu_seqlens_q.numel() - 1, varlen.max_seqlen_q, varlen.max_seqlen_k
    return False, q.shape[0], q.shape[1], k.shape[1]


def lse_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 LSE (and accumulators); float64 only for float64 inputs (gradcheck)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def layout_constexprs(layout: TileLayout) -> dict[str, int | bool]:
    """The layout's geometry as the kernels' constexpr arguments (Triton and Gluon alike)."""
    return dict(
        BLOCK_M=layout.block_m,
        BLOCK_N=layout.block_n,
        ROW_GROUP=layout.row_group,
        COL_GROUP=layout.col_group,
        BITS_PER_ROW=layout.bits_per_row,
        CAUSAL=layout.causal,
    )


def heads_per_program_group(num_bh: int, wanted: int) -> int:
    """The largest divisor of ``num_bh`` (batch x heads) up to ``wanted``: groups must tile it."""
    wanted = max(1, min(wanted, num_bh))
    while num_bh % wanted:
        wanted -= 1
    return wanted


def check_k_bounds(layout: TileLayout, seqlen_k: int, varlen: bool) -> bool:
    """Whether the unmasked loop over ``layout`` must still drop keys at or past seq_k (see
    :func:`keys_need_bounds`)."""
    return keys_need_bounds(layout.causal, layout.block_size, layout.block_n, seqlen_k, varlen)


def keys_need_bounds(
    causal: bool, block_size: int, block_n: int, seqlen_k: int, varlen: bool
) -> bool:
    """Whether the unmasked loop over a layout of these pattern blocks and KV tiles must still
    drop keys at or past seq_k.

    Causal full entries end before their tile's first query, so never. A bidirectional layout is
    cropped to whole pattern blocks: when seq_k ends inside a block or a KV tile, full entries
    can hold keys past it. Packed sequences end anywhere.
    """
    return not causal and (varlen or seqlen_k % max(block_n, block_size) != 0)


def query_tiles(block_m: int, seqlen_q: int, seqlen_k: int, varlen: bool) -> int:
    """Query tiles of a (batch, head) that the forward and dQ kernels walk: those holding a query
    row under bottom-right alignment; packed sequences take the longest run's count and one tile
    spare, since a run may start mid-tile."""
    if varlen:
        return -(-seqlen_q // block_m) + 1
    return (seqlen_k - 1) // block_m - (seqlen_k - seqlen_q) // block_m + 1
