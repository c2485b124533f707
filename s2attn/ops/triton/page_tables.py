"""Triton composition of a decode step's per-KV-head page table from a paged cache's block tables.

A cache whose pages hold every KV head of a block (vLLM's) is read by the decode kernel through
pages of one (block, KV head) pair: page ``block * kv_heads + h``. Where each KV head keeps its
stripe blocks (one block per period of ``period`` blocks, at its own offset) in a second table's
pages, head ``h`` reads block ``j`` from that table's entry of ``j``'s period when ``j % period ==
offsets[h]``. One launch per step writes the whole table and the step's lengths, where torch
indexing takes a dozen small kernels; it holds no host sync, so a CUDA graph can capture it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..launcher import Launcher
from .common import next_power_of_2

__all__ = ["decode_page_tables"]

# Blocks of one request one program composes.
_BLOCK_J = 256


@triton.jit
def _tables_kernel(
    window,
    stripes,
    offsets,
    seq_lens,
    table,
    lengths,
    positions,
    stride_wr,
    stride_wj,
    stride_sr,
    stride_sj,
    stride_tr,
    stride_th,
    stride_tj,
    width,
    stripe_width,
    period,
    NUM_KV_HEADS: tl.constexpr,
    STRIPES: tl.constexpr,
    BLOCK_J: tl.constexpr,
):
    """Program (request r, chunk c of its blocks): the table's entries of those blocks for every
    KV head; chunk 0 also writes r's length (at least 1) and its new token's position. A padding
    request (length 0) gets block 0, vLLM's null block, everywhere, whatever its table row holds:
    its one position read and its token written land there."""
    r = tl.program_id(0)
    c = tl.program_id(1)
    j = c * BLOCK_J + tl.arange(0, BLOCK_J)
    n = tl.load(seq_lens + r)
    live = j < tl.where(n > 0, width, 0)  # a padding request reads no table entry
    r64 = r.to(tl.int64)
    block = tl.load(window + r64 * stride_wr + j * stride_wj, mask=live, other=0)
    if STRIPES:
        period_of = tl.minimum(j // period, stripe_width - 1)
        stripe = tl.load(stripes + r64 * stride_sr + period_of * stride_sj, mask=live, other=0)
    for h in tl.static_range(NUM_KV_HEADS):
        page = block
        if STRIPES:
            page = tl.where(j % period == tl.load(offsets + h), stripe, block)
        dst = table + r64 * stride_tr + h * stride_th + j * stride_tj
        tl.store(dst, page * NUM_KV_HEADS + h, mask=j < width)
    if c == 0:
        n = tl.maximum(n, 1)
        tl.store(lengths + r, n)
        tl.store(positions + r, n - 1)


_TABLES = Launcher(_tables_kernel)  # every decode step of every KV-cache group


def decode_page_tables(
    window_table: torch.Tensor,
    seq_lens: torch.Tensor,
    num_kv_heads: int,
    stripe_table: torch.Tensor | None = None,
    period: int = 0,
    offsets: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A decode step's int32 (requests, kv_heads, width) page table over the flattened
    (block, KV head) pages, each request's int32 length (``seq_lens`` raised to at least 1) and
    its new token's position (the length less 1).

    Args:
        window_table: int32 (requests, width), each request's block of each position block.
        seq_lens: (requests,) lengths with the new token (0 for padding requests, whose rows
            of the table read vLLM's null block 0).
        num_kv_heads: KV heads per block.
        stripe_table: int32 (requests, periods), the block of each period of each KV head's
            stripes; with ``period`` (in blocks) and ``offsets`` (int64 (num_kv_heads,), each
            head's stripe block within a period). None: every head reads ``window_table``.
    """
    requests, width = window_table.shape
    device = window_table.device
    table = torch.empty(requests, num_kv_heads, width, dtype=torch.int32, device=device)
    lengths = torch.empty(requests, dtype=torch.int32, device=device)
    positions = torch.empty(requests, dtype=torch.int32, device=device)
    if requests == 0:
        return table, lengths, positions
    stripes = stripe_table is not None
    if stripes and (period < 1 or offsets is None or offsets.shape != (num_kv_heads,)):
        raise ValueError("a stripe table needs its period and one offset per KV head")
    source = stripe_table if stripes else window_table
    _TABLES[(requests, triton.cdiv(width, _BLOCK_J))](
        window_table, source, offsets if stripes else seq_lens, seq_lens, table, lengths,
        positions, *window_table.stride(), *source.stride(), *table.stride(), width,
        source.shape[1], max(period, 1), NUM_KV_HEADS=num_kv_heads, STRIPES=stripes,
        BLOCK_J=min(_BLOCK_J, next_power_of_2(width)),
    )
    return table, lengths, positions
