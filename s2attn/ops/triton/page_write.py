"""Triton page writes of a paged KV cache: a decode step's new keys and values into their pages.

One launch where the equivalent torch indexing takes a dozen; the cache (``s2attn.inference``)
uses it for batched steps of a few tokens per sequence, and torch indexing for prefills.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..launcher import Launcher

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
    NUM_NEW: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
):
    """One program per (sequence, new token, KV head): copy its key and value rows into the page
    of its block, if the block is stored."""
    bt = tl.program_id(0)
    h = tl.program_id(1)
    b = bt // NUM_NEW
    t = bt % NUM_NEW
    pos = tl.load(seq_lens + b) + t  # seq_lens: the lengths before this step
    page = tl.load(page_table + b * stride_tb + h * stride_th + (pos // PAGE_SIZE) * stride_tj)
    if page >= 0:
        page_row = page.to(tl.int64)  # a new name: compiled Triton keeps a variable's type fixed
        slot = pos % PAGE_SIZE
        offs = tl.arange(0, BLOCK_D)
        ok = offs < HEAD_DIM
        b64 = b.to(tl.int64)  # a large batch's later sequences may start past 2^31 elements
        k = tl.load(K + b64 * stride_kb + t * stride_ks + h * stride_kh + offs * stride_kd, mask=ok)
        v = tl.load(V + b64 * stride_vb + t * stride_vs + h * stride_vh + offs * stride_vd, mask=ok)
        tl.store(KPages + page_row * stride_kp + slot * stride_kn + offs * stride_kpd, k, mask=ok)
        tl.store(VPages + page_row * stride_vp + slot * stride_vn + offs * stride_vpd, v, mask=ok)


_WRITE = Launcher(_write_kernel)  # a step's launch, every layer of every token


def write_pages(
    k: torch.Tensor,
    v: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
) -> None:
    """Store new tokens' K/V, (batch, num_new, kv_heads, dim), at positions ``seq_lens[b] + t``
    of each sequence through the page table (blocks with page -1 are skipped)."""
    batch, num_new, num_kv_heads, head_dim = k.shape
    if k.numel() == 0:
        return
    _WRITE[(batch * num_new, num_kv_heads)](
        k, v, k_pages, v_pages, page_table, seq_lens,
        *k.stride(), *v.stride(), *k_pages.stride(), *v_pages.stride(), *page_table.stride(),
        NUM_NEW=num_new, HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
        PAGE_SIZE=k_pages.shape[1],
    )
