"""The eviction schedule of a KV cache: from which query block on each KV block is never read
again, derived from the layer's pattern.

Every (KV head, KV block) has a last query block that reads it (:func:`kv_last_use`, the union
over the query heads of the GQA group). Once every query still to come lies past that block, the
cache may free its page; a block that no query still to come reads need not be stored at all.
Because S2 patterns are KV-efficient (a block's readers form one run), what stays is exactly what
the pattern still needs: for the local-stride pattern, the local window plus the stripes. Dense
layers (``pattern=None`` or an all-dense pattern) keep everything. Patterns that are not
KV-efficient work but evict nothing, with a warning.

The schedule is pure metadata on the CPU; :class:`s2attn.inference.cache.PagedKVCache` asks it
which pages to free and which to fill.
"""

from __future__ import annotations

import warnings
import weakref

import torch

from ..ops.decode_layout import check_kv_heads
from ..pattern import BlockPattern

__all__ = ["EvictionSchedule", "is_dense_pattern", "kv_last_use"]

# "Never evicted": a last use past any query block.
_NEVER = torch.iinfo(torch.int64).max
_WARNED: weakref.WeakSet = weakref.WeakSet()
# Per pattern and KV heads: (dense, KV-efficient, last use). Every layer of a model shares its
# pattern, and at 128k these take a second each.
_FACTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def kv_last_use(pattern: BlockPattern, num_kv_heads: int) -> torch.Tensor:
    """The last query block that reads each KV block: int64 (num_kv_heads, kv_blocks), on the CPU.

    A KV head's block is read by every query head of its GQA group, so this is the maximum over the
    group; -1 marks a block no query ever reads. Once every query of a sequence lies past a block's
    last use, no later query reads it (whatever the pattern): a KV cache may drop it. KV-efficient
    patterns make that drop cost nothing, since the uses of a block form one run.

    Example::

        >>> p = local_stride_pattern(
        ...     32, max_seq_len=8192, block_size=64, local_blocks=16, vert_stride=16,
        ...     num_kv_heads=8
        ... )
        >>> kv_last_use(p, 8)[0, :3]  # block 0 is a stripe of KV head 0, read to the end
        tensor([127,  16,  17])
    """
    check_kv_heads(pattern, num_kv_heads)
    last = torch.full((num_kv_heads, pattern.num_kv_blocks), -1, dtype=torch.int64)
    per = pattern.num_heads // num_kv_heads
    for head in range(pattern.num_heads):  # one head at a time: memory of one head's blocks
        _, i, j = pattern.block_coordinates(heads=slice(head, head + 1))
        seen = j <= i  # the causally visible blocks
        last[head // per].scatter_reduce_(0, j[seen], i[seen], "amax")
    return last


def is_dense_pattern(pattern: BlockPattern) -> bool:
    """True when a causal pattern keeps every visible block of every head. A builder's pattern
    answers from its rules (its kept token pairs against the visible ones, in closed form, at any
    length); one given by a mask or lists, one head's blocks at a time."""
    qb, kb = pattern.num_q_blocks, pattern.num_kv_blocks
    if pattern.causal and pattern.rules is not None and qb == kb:
        # Every visible block holds visible pairs, so all pairs are kept only if all blocks are.
        seq = pattern.max_seq_len
        return pattern.kept_token_pairs(seq) == seq * (seq + 1) // 2 * pattern.num_heads
    visible = int(torch.clamp(torch.arange(1, qb + 1), max=kb).sum())
    for h in range(pattern.num_heads):
        _, i, j = pattern.block_coordinates(heads=slice(h, h + 1))
        if int((j <= i).sum()) != visible:
            return False
    return True


def _pattern_facts(pattern: BlockPattern, num_kv_heads: int) -> tuple[bool, bool, torch.Tensor]:
    per_pattern = _FACTS.setdefault(pattern, {})
    if num_kv_heads not in per_pattern:
        dense = is_dense_pattern(pattern)
        efficient = dense or pattern.is_kv_efficient()
        last_use = None if dense or not efficient else kv_last_use(pattern, num_kv_heads)
        per_pattern[num_kv_heads] = (dense, efficient, last_use)
    return per_pattern[num_kv_heads]


class EvictionSchedule:
    """When each KV block of one layer's cache stops being read.

    Args:
        pattern: the layer's causal pattern (one head per KV head or per query head), or None
            for a dense layer. Checked by the caller.
        num_kv_heads: KV heads of the cache.
        num_blocks: KV blocks per sequence the cache holds at most (its pattern's or fewer).

    Attributes: ``dense`` (every block is read to the end), ``kv_efficient`` (the pattern's
    readers of a block form one run; when not, nothing is evicted), ``last_use`` int64
    (num_kv_heads, num_blocks) on the CPU: the last query block that reads each block, -1 for
    none, the int64 maximum when the block is never evicted.
    """

    def __init__(self, pattern: BlockPattern | None, num_kv_heads: int, num_blocks: int):
        if pattern is None:
            self.dense, self.kv_efficient, last_use = True, True, None
        else:
            self.dense, self.kv_efficient, last_use = _pattern_facts(pattern, num_kv_heads)
        if last_use is None:
            last_use = torch.full((num_kv_heads, num_blocks), _NEVER, dtype=torch.int64)
            if not self.kv_efficient and pattern not in _WARNED:
                _WARNED.add(pattern)
                warnings.warn(
                    "the pattern is not KV-efficient (a KV block's readers do not form one run): "
                    "the KV cache keeps every block and evicts nothing",
                    stacklevel=3,  # the caller that built the cache
                )
        else:
            last_use = last_use[:, :num_blocks].contiguous()
        self.last_use = last_use
        self.num_kv_heads = num_kv_heads
        self.num_blocks = num_blocks
        # last_use flattened and sorted, built at the first eviction (see last_read_in)
        self._by_last_use: torch.Tensor | None = None
        self._sorted_last_use: torch.Tensor | None = None

    @property
    def evicts(self) -> bool:
        """Whether any block is ever freed before its sequence is."""
        return not self.dense and self.kv_efficient

    def last_read_in(self, first: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(heads, blocks) of the KV blocks whose last reader is a query block in
        ``[first, stop)``, in (head, block) order: what a sequence may free when its queries
        move on from ``first`` to ``stop``. The cost is that of the blocks found, not of the
        sequence's length (a decode step pays it in every layer)."""
        if self._by_last_use is None:
            flat = self.last_use.flatten()
            self._by_last_use = torch.argsort(flat, stable=True)
            self._sorted_last_use = flat[self._by_last_use]
        bounds = torch.tensor([first, stop], dtype=torch.int64)
        lo, hi = torch.searchsorted(self._sorted_last_use, bounds).tolist()
        flat_index = self._by_last_use[lo:hi].sort().values
        return flat_index // self.num_blocks, flat_index % self.num_blocks

    def read_from(
        self, from_block: int | torch.Tensor, blocks: torch.Tensor | slice
    ) -> torch.Tensor:
        """Whether some query block at ``from_block`` or later reads each of ``blocks``: bool
        (num_kv_heads, len(blocks)); ``from_block`` an int or one per block. Blocks for which
        this is False may be freed, or left unstored, once every query still to come lies at
        ``from_block`` or later."""
        return self.last_use[:, blocks] >= from_block

    def peak_blocks_per_sequence(self) -> int:
        """Blocks one sequence holds at most: max over query blocks q of the blocks j <= q still
        read from q on, plus one for the block the newest tokens enter, summed over KV heads."""
        nb = self.num_blocks
        if not self.evicts:
            return self.num_kv_heads * nb
        lu = self.last_use
        stored = lu >= torch.arange(nb)[None, :]  # blocks nobody reads are never stored
        # Block j is held while the query block runs over [j, last_use]: a difference array.
        diff = torch.zeros(self.num_kv_heads, nb + 1, dtype=torch.int64)
        starts = torch.arange(nb).expand_as(lu)
        ends = lu.clamp(max=nb - 1) + 1
        diff.scatter_add_(1, starts, stored.to(torch.int64))
        diff.scatter_add_(1, torch.where(stored, ends, nb), -stored.to(torch.int64))
        live = diff.cumsum(1)[:, :nb]
        return int((live.amax(dim=1) + 1).clamp(max=nb).sum())
