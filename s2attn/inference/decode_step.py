"""One decode step's device work over a paged KV cache, as its :class:`~.decode_plan.DecodePlan`
says: write the new keys and values into their pages, advance the lengths, attend the new queries
to the pages the pattern keeps.

Every decode path runs :func:`decode_step`: the eager call (``sparse_attention_with_kvcache``,
after the cache planned the step's pages on the host), the CUDA-graph capture of that call
(``capture_decode_step``) and the compiled operator (``s2attn::static_decode``, whose page table
is fixed). It touches no host state, so a graph that records it serves every step. The page write
(:func:`write_pages`) and the attention (:func:`attend`) are also what a cache's small append and
a read of the cache as it is run. The kernels are
chosen through :mod:`s2attn.ops.dispatch`; where no Triton backend runs, the plain-PyTorch
reference over pages (:func:`s2attn.ops.cpu.paged_attention`) computes the same.
"""

from __future__ import annotations

import weakref

import torch

from ..ops import dispatch
from ..ops.cpu import paged_attention as paged_attention_reference
from ..ops.cpu import write_pages as write_pages_reference
from ..ops.dispatch import supports_triton
from ..pattern import BlockPattern
from .decode_plan import DecodePlan

__all__ = ["MAX_DECODE_TOKENS", "attend", "decode_step", "runs_kernels", "write_pages"]

# Per pattern: its dense block mask, which the reference path reads (small models only).
_MASKS: weakref.WeakKeyDictionary[BlockPattern, torch.Tensor] = weakref.WeakKeyDictionary()

# New tokens per sequence a decode step takes: they then span at most two query blocks. A cache
# keeps such an append's blocks for the append's own queries.
MAX_DECODE_TOKENS = 16


def runs_kernels(device: torch.device) -> bool:
    """Whether :func:`decode_step` on ``device`` launches the Triton kernels (else it runs the
    plain-PyTorch reference, which reads lengths back on the host)."""
    return supports_triton(device)


def write_pages(k: torch.Tensor, v: torch.Tensor, plan: DecodePlan, *, advance: bool) -> None:
    """Write ``k``, ``v`` (batch, num_new, kv_heads, dim) at positions ``seq_lens[b] + t`` through
    the plan's page table (blocks without a page are not stored); with ``advance``, add
    ``num_new`` to ``seq_lens`` (in the same launch on the kernels' path)."""
    if runs_kernels(k.device):
        dispatch.write_pages(
            k, v, plan.k_pages, plan.v_pages, plan.page_table, plan.seq_lens, advance=advance
        )
        return
    write_pages_reference(k, v, plan.k_pages, plan.v_pages, plan.page_table, plan.seq_lens)
    if advance:
        plan.seq_lens.add_(k.shape[1])


def attend(
    q: torch.Tensor, plan: DecodePlan, *, softmax_scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The decode kernel: ``q`` (batch, num_new, heads, dim), the last ``num_new`` tokens of each
    sequence (``seq_lens`` includes them), over the pages the plan's layout lists. Returns
    ``(out, lse)``: out like q, lse float32 (batch, heads, num_new)."""
    return dispatch.decode(
        q,
        plan.k_pages,
        plan.v_pages,
        plan.page_table,
        plan.seq_lens,
        plan.layout,
        softmax_scale=softmax_scale,
        num_splits=plan.num_splits,
        split_counters=plan.split_counters,
    )


def decode_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: DecodePlan,
    *,
    softmax_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step, device work alone.

    Args:
        q: (batch, num_new, heads, dim), ``num_new <= MAX_DECODE_TOKENS``.
        k, v: (batch, num_new, kv_heads, dim), written at positions ``seq_lens[b] + t`` through
            the page table (blocks without a page are not stored).
        plan: the cache's plan of the step; its ``seq_lens`` advance by ``num_new`` in place.
        softmax_scale: the score scale.

    Returns ``(out, lse)``: out like q, lse float32 (batch, heads, num_new).
    """
    # Written at the old lengths, which the same launch then advances: two launches a step.
    write_pages(k, v, plan, advance=True)
    if runs_kernels(q.device):
        return attend(q, plan, softmax_scale=softmax_scale)
    max_blocks = plan.page_table.shape[2]
    if plan.pattern is None:
        mask = torch.ones(1, max_blocks, max_blocks, dtype=torch.bool)
    else:
        if plan.pattern not in _MASKS:
            _MASKS[plan.pattern] = plan.pattern.mask
        mask = _MASKS[plan.pattern][:, :max_blocks, :max_blocks]
    batch, num_new = q.shape[:2]
    lengths = plan.seq_lens.tolist()
    out, lse = paged_attention_reference(
        q.reshape(batch * num_new, *q.shape[2:]),
        plan.k_pages,
        plan.v_pages,
        plan.page_table,
        [b * num_new for b in range(batch + 1)],
        lengths,
        mask,
        block_size=plan.k_pages.shape[1],
        softmax_scale=softmax_scale,
    )
    lse = lse.view(q.shape[2], batch, num_new).transpose(0, 1)
    return out.view(q.shape), lse
