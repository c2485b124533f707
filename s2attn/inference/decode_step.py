"""One decode step's device work over a paged KV cache: write the new keys and values into their
pages, advance the lengths, attend the new queries to the pages the pattern keeps.

Every decode path runs this one function: the eager call (``sparse_attention_with_kvcache``,
after the cache planned the step's pages on the host), the CUDA-graph capture of that call
(``capture_decode_step``) and the compiled operator (``s2attn::static_decode``, whose page table
is fixed). It touches no host state, so a graph that records it serves every step. The kernels are
chosen through :mod:`s2attn.ops.dispatch`; where no Triton backend runs, the plain-PyTorch
reference over pages (:func:`s2attn.reference.paged_attention_reference`) computes the same.
"""

from __future__ import annotations

import weakref

import torch

from ..layout import DecodeLayout, decode_layout, dense_decode_layout
from ..ops import dispatch
from ..ops.cpu import paged_attention as paged_attention_reference
from ..ops.cpu import write_pages as write_pages_reference
from ..ops.dispatch import supports_triton
from ..pattern import BlockPattern

__all__ = ["MAX_DECODE_TOKENS", "decode_step", "runs_kernels", "step_layout"]

# Per pattern: its dense block mask, which the reference path reads (small models only).
_MASKS: weakref.WeakKeyDictionary[BlockPattern, torch.Tensor] = weakref.WeakKeyDictionary()

# New tokens per sequence a decode step takes: they then span at most two query blocks. A cache
# keeps such an append's blocks for the append's own queries.
MAX_DECODE_TOKENS = 16


def step_layout(
    pattern: BlockPattern | None,
    num_kv_heads: int,
    block_size: int,
    max_blocks: int,
    device: torch.device,
) -> DecodeLayout:
    """The decode kernel's lists for a cache of ``pattern`` (None: dense)."""
    if pattern is None:
        return dense_decode_layout(block_size, num_kv_heads, max_blocks, device)
    return decode_layout(pattern, num_kv_heads, device)


def runs_kernels(device: torch.device) -> bool:
    """Whether :func:`decode_step` on ``device`` launches the Triton kernels (else it runs the
    plain-PyTorch reference, which reads lengths back on the host)."""
    return supports_triton(device)


def decode_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    pattern: BlockPattern | None,
    *,
    softmax_scale: float,
    num_splits: int,
    layout: DecodeLayout | None = None,
    split_counters: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step, device work alone.

    Args:
        q: (batch, num_new, heads, dim), ``num_new <= MAX_DECODE_TOKENS``.
        k, v: (batch, num_new, kv_heads, dim), written at positions ``seq_lens[b] + t`` through
            the page table (blocks without a page are not stored).
        k_pages, v_pages: (pages + 1, block_size, dim); the last page takes unstored writes.
        page_table: int32 (batch, kv_heads, max_blocks), -1 where a block has no page.
        seq_lens: int32 (batch,), advanced by ``num_new`` in place.
        pattern: the cache's pattern, None when dense.
        softmax_scale, num_splits, split_counters: the decode kernel's (see ``dispatch.decode``).
        layout: the pattern's decode layout when the caller holds it (else looked up).

    Returns ``(out, lse)``: out like q, lse float32 (batch, heads, num_new).
    """
    kv_heads, max_blocks = page_table.shape[1:]
    block_size = k_pages.shape[1]
    if not runs_kernels(q.device):
        write_pages_reference(k, v, k_pages, v_pages, page_table, seq_lens)
        seq_lens.add_(q.shape[1])
        if pattern is None:
            mask = torch.ones(1, max_blocks, max_blocks, dtype=torch.bool)
        else:
            if pattern not in _MASKS:
                _MASKS[pattern] = pattern.mask
            mask = _MASKS[pattern][:, :max_blocks, :max_blocks]
        batch, num_new = q.shape[:2]
        lengths = seq_lens.tolist()
        out, lse = paged_attention_reference(
            q.reshape(batch * num_new, *q.shape[2:]),
            k_pages,
            v_pages,
            page_table,
            [b * num_new for b in range(batch + 1)],
            lengths,
            mask,
            block_size=block_size,
            softmax_scale=softmax_scale,
        )
        lse = lse.view(q.shape[2], batch, num_new).transpose(0, 1)
        return out.view(q.shape), lse
    if layout is None:
        layout = step_layout(pattern, kv_heads, block_size, max_blocks, q.device)
    # Written at the old lengths, which the same launch then advances: two launches a step.
    dispatch.write_pages(k, v, k_pages, v_pages, page_table, seq_lens, advance=True)
    return dispatch.decode(
        q,
        k_pages,
        v_pages,
        page_table,
        seq_lens,
        layout,
        softmax_scale=softmax_scale,
        num_splits=num_splits,
        split_counters=split_counters,
    )
