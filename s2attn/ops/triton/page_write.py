"""Triton page writes of a paged KV cache: a decode step's new keys and values into their pages.

One launch where the equivalent torch indexing takes a dozen; the cache (``s2attn.inference``)
uses it for batched steps of a few tokens per sequence, and torch indexing for prefills.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..launcher import Launcher
from .common import next_power_of_2

__all__ = ["write_pages"]


@triton.jit
def _write_kernel(
    K,
    V,
    KPages,
    VPages,
    page_table,
    seq_lens,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_kd,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_vd,
    stride_kp,
    stride_kn,
    stride_kpd,
    stride_vp,
    stride_vn,
    stride_vpd,
    stride_tb,
    stride_th,
    stride_tj,
    max_blocks,
    NUM_NEW: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    ROWS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    ADVANCE: tl.constexpr,
):
    """One program per sequence: copy the key and value rows of its every (new token, KV head)
    into the page of its block, if the block is stored, all rows at once; with ``ADVANCE``, then
    move the sequence's length past them. The program that reads a sequence's length is the only
    one that writes it, so no other program sees it half-way."""
    b = tl.program_id(0)
    start = tl.load(seq_lens + b)  # the length before this step
    r = tl.arange(0, ROWS)
    live = r < NUM_NEW * NUM_KV_HEADS
    t = r // NUM_KV_HEADS
    h = r % NUM_KV_HEADS
    pos = start + t
    # A position past the table has no page: reading its entry would take the next head's first
    # page and write there. The static cache refuses such a step (on the device, in the step's
    # first layer); here it is skipped so no layer writes outside its own pages meanwhile.
    live = live & (pos // PAGE_SIZE < max_blocks)
    page = tl.load(
        page_table + b * stride_tb + h * stride_th + (pos // PAGE_SIZE) * stride_tj,
        mask=live,
        other=-1,
    )
    page_row = page.to(tl.int64)  # pools past 2^31 elements
    slot = pos % PAGE_SIZE
    offs = tl.arange(0, BLOCK_D)
    m = (live & (page >= 0))[:, None] & (offs < HEAD_DIM)[None, :]
    b64 = b.to(tl.int64)  # a large batch's later sequences may start past 2^31 elements
    k_src = K + b64 * stride_kb + t[:, None] * stride_ks + h[:, None] * stride_kh
    v_src = V + b64 * stride_vb + t[:, None] * stride_vs + h[:, None] * stride_vh
    k = tl.load(k_src + offs[None, :] * stride_kd, mask=m)
    v = tl.load(v_src + offs[None, :] * stride_vd, mask=m)
    k_dst = KPages + page_row[:, None] * stride_kp + slot[:, None] * stride_kn
    v_dst = VPages + page_row[:, None] * stride_vp + slot[:, None] * stride_vn
    tl.store(k_dst + offs[None, :] * stride_kpd, k, mask=m)
    tl.store(v_dst + offs[None, :] * stride_vpd, v, mask=m)
    if ADVANCE:
        tl.store(seq_lens + b, start + NUM_NEW)


_WRITE = Launcher(_write_kernel)  # a step's launch, every layer of every token


def write_pages(
    k: torch.Tensor,
    v: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    advance: bool = False,
) -> None:
    """Store new tokens' K/V, (batch, num_new, kv_heads, dim), at positions ``seq_lens[b] + t``
    of each sequence through the page table (blocks with page -1, and positions past the table's
    last block, are skipped); with ``advance``, also add ``num_new`` to ``seq_lens`` in the same
    launch."""
    batch, num_new, num_kv_heads, head_dim = k.shape
    if k.numel() == 0:
        if advance:
            seq_lens.add_(num_new)
        return
    _WRITE[(batch,)](
        k, v, k_pages, v_pages, page_table, seq_lens,
        *k.stride(), *v.stride(), *k_pages.stride(), *v_pages.stride(), *page_table.stride(),
        page_table.shape[2], NUM_NEW=num_new, NUM_KV_HEADS=num_kv_heads,
        ROWS=next_power_of_2(num_new * num_kv_heads),
        HEAD_DIM=head_dim, BLOCK_D=next_power_of_2(head_dim),
        PAGE_SIZE=k_pages.shape[1], ADVANCE=advance,
    )
