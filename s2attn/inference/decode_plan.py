"""What one decode step's device work reads and writes: :class:`DecodePlan`, which the cache plans
(:meth:`PagedKVCache.plan_decode_step`) and every decode path takes: the eager step, its CUDA-graph
replay (``step_graph.py``), the captured run (``capture_decode_step``) and the compiled operator
(``decode_op.py``, whose arguments are a plan's tensors and scalars).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from ..compile import pattern_key
from ..ops import dispatch
from ..ops.decode_layout import DecodeLayout, decode_layout, dense_decode_layout
from ..pattern import BlockPattern

__all__ = ["DENSE_KEY", "DecodePlan", "split_count", "step_layout"]

# The pattern key of a dense layer's cache (no pattern) in the compiled operator's arguments.
DENSE_KEY = -1


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


def split_count(
    list_lengths: Sequence[int],
    first_new: Iterable[int] | None,
    *,
    block_size: int,
    batch: int,
    num_kv_heads: int,
    device: torch.device,
) -> int:
    """The decode kernel's programs per (sequence, KV head) for a step whose new tokens start at
    positions ``first_new`` (one per sequence): from the longest list their query blocks walk
    (``list_lengths``: a decode layout's, as host ints). With ``first_new`` None, from the longest
    list of all: the count of every step of a captured or compiled run, so that one launch
    serves every length."""
    if first_new is None:
        longest = max(list_lengths)
    else:
        longest = max(list_lengths[p // block_size] for p in first_new)
    return dispatch.decode_num_splits(batch, num_kv_heads, longest, device)


@dataclass(frozen=True, eq=False)
class DecodePlan:
    """One decode step's device work over a paged cache, planned on the host.

    Attributes:
        k_pages, v_pages: (pages + 1, block_size, dim); the last page takes unstored writes.
        page_table: int32 (batch, kv_heads, max_blocks), -1 where a block has no page.
        seq_lens: int32 (batch,): each sequence's length before the step, advanced by it in place.
        split_counters: int32 (batch * kv_heads,), the decode kernel's count of finished splits,
            zero between launches; a cache's own. None: the kernel makes one per launch when it
            splits (pages held outside a cache).
        pattern: the cache's pattern, None when dense.
        layout: the pattern's decode layout on the pages' device.
        num_splits: programs per (sequence, KV head) of the decode kernel.

    A plan holds the cache's own tensors, which steps update in place: a plan stays valid from
    step to step until the cache swaps one of them (``select_sequences`` to a new batch size).
    """

    k_pages: torch.Tensor
    v_pages: torch.Tensor
    page_table: torch.Tensor
    seq_lens: torch.Tensor
    split_counters: torch.Tensor | None
    pattern: BlockPattern | None
    layout: DecodeLayout
    num_splits: int

    @property
    def held(self) -> tuple:
        """What a CUDA graph of the step reads and writes: a graph is valid while a later plan
        holds the very same objects."""
        return (
            self.k_pages,
            self.v_pages,
            self.page_table,
            self.seq_lens,
            self.layout,
            self.split_counters,
        )

    def op_arguments(self) -> tuple:
        """The plan as the compiled operator ``s2attn::static_decode`` takes it, after q, k, v:
        the cache's tensors, the pattern's key and the split count (the operator builds the plan
        again from them, :meth:`build`)."""
        key = DENSE_KEY if self.pattern is None else pattern_key(self.pattern)
        return (
            self.k_pages,
            self.v_pages,
            self.page_table,
            self.seq_lens,
            self.split_counters,
            key,
            self.num_splits,
        )

    @classmethod
    def build(
        cls,
        k_pages: torch.Tensor,
        v_pages: torch.Tensor,
        page_table: torch.Tensor,
        seq_lens: torch.Tensor,
        split_counters: torch.Tensor | None,
        pattern: BlockPattern | None,
        num_splits: int,
    ) -> DecodePlan:
        """The plan over these tensors (shapes as the attributes'), its layout the pattern's
        (cached per pattern, KV heads and device; a dense one is built, as cheap as a lookup).
        For callers that hold pages outside a :class:`PagedKVCache`, and the compiled operator,
        which holds :meth:`op_arguments`."""
        kv_heads, max_blocks = page_table.shape[1:]
        layout = step_layout(pattern, kv_heads, k_pages.shape[1], max_blocks, k_pages.device)
        return cls(
            k_pages, v_pages, page_table, seq_lens, split_counters, pattern, layout, num_splits
        )
