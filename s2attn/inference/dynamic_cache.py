"""The dynamic KV cache: pages taken from the pool as sequences enter blocks, returned when the
pattern stops reading them, shared between copies of a sequence after a beam reorder.

Beam search. :meth:`DynamicKVCache.select_sequences` makes sequences copies of others (a reorder,
a repeat, a selection) that share their pages: each page counts the table entries that hold it
and returns to the free list when the count drops to zero, and a sequence about to write into a
shared page gets its own copy of it first (:class:`~.page_pool.PagePool`).

Pool size. The default pool holds what the pattern keeps for every sequence at once, however the
cache is filled (decode steps, one long append, a prefill of the whole length); an append that a
smaller pool cannot hold raises before changing anything, naming the pages it needs.
"""

from __future__ import annotations

import math

import torch

from ..input_checks import check_int
from .cache import PagedKVCache
from .page_pool import PagePool

__all__ = ["DynamicKVCache"]

# (sequence, head, block, page) of no page at all; pages are int32, as in the page table
_NO_PAGES = (
    *(torch.zeros(0, dtype=torch.int64) for _ in range(3)),
    torch.zeros(0, dtype=torch.int32),
)


class DynamicKVCache(PagedKVCache):
    """A :class:`PagedKVCache` whose pages come and go with what the pattern reads; what
    ``paged_kv_cache(...)`` builds by default. Arguments as :class:`PagedKVCache`'s."""

    static = False

    def _make_pool(self, num_pages: int | None) -> PagePool:
        if num_pages is None:
            num_pages = self.default_num_pages()
        return self._new_pool(check_int("num_pages", num_pages))

    def _initial_table(self) -> torch.Tensor:
        shape = (self.batch_size, self.num_kv_heads, self.max_blocks)
        return torch.full(shape, -1, dtype=torch.int32)

    # ---------------------------------------------------------------------------- appends
    def _make_room(self, old: list[int], new: list[int], keep_block: list[int]) -> None:
        pool = self.pool
        if keep_block == self._keep_block and not pool.shared and self._within_blocks(old, new):
            # Most decode steps: no block entered, none left behind, no page shared. Nothing to
            # plan (the host work here is paid on every layer of every token).
            return
        # Plan everything before changing anything, so a pool too small leaves the cache as it was.
        evict_seq, evict_heads, evict_blk, released = self._evictions(keep_block)
        seq, heads, blk = self._allocations(old, new, keep_block)
        freed = pool.would_free(released).numel()
        copies = self._copies_on_write(old, new, released)
        needed = seq.numel() + copies[0].numel()
        if needed > pool.num_free + freed:
            after = self.live_pages - freed + needed
            raise RuntimeError(
                f"the KV page pool is exhausted: this append keeps {after} pages, but "
                f"num_pages={self.num_pages}; build the cache with num_pages >= {after} (the "
                f"default, {self.default_num_pages()}, holds what the pattern keeps for "
                f"{self.batch_size} sequences of up to {self.max_seq_len} tokens)"
            )
        changed: list[torch.Tensor] = []  # flat page-table indices whose entry changed
        h, nb = self.num_kv_heads, self.max_blocks
        if released.numel():
            pool.release(released)
            self._table[evict_seq, evict_heads, evict_blk] = -1
            changed.append((evict_seq * h + evict_heads) * nb + evict_blk)
        if copies[0].numel():
            at = copies  # (sequence, head, block) of each shared page written into
            self._table[at] = pool.copy_on_write(self._table[at])
            changed.append((at[0] * h + at[1]) * nb + at[2])
        if seq.numel():
            self._table[seq, heads, blk] = pool.take(seq.numel())
            changed.append((seq * h + heads) * nb + blk)
        if changed:
            idx = torch.cat(changed)
            self.page_table.view(-1)[self._upload(idx)] = self._upload(self._table.view(-1)[idx])

    def _within_blocks(self, old: list[int], new: list[int]) -> bool:
        """Whether every sequence's new tokens fall in the block that already holds its last
        token (or it has none): then no page is allocated."""
        bs = self.block_size
        return all(a == n or (a % bs and (n - 1) // bs == a // bs) for a, n in zip(old, new))

    def _evictions(
        self, keep_block: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(sequence, head, block, page) of each page whose block's last reader lies before the
        sequence's keep block, by sequence, then head, then block."""
        if not self.eviction.evicts:
            return _NO_PAGES
        # Sequences moving their keep block over the same range drop the same blocks (a batch
        # decoding in step moves together): look those up once, then read every table at once.
        moves: dict[tuple[int, int], list[int]] = {}
        for b, (before, q0) in enumerate(zip(self._keep_block, keep_block)):
            if q0 > before:
                moves.setdefault((before, q0), []).append(b)
        parts = []
        for (before, q0), seqs in moves.items():
            # Every stored block is read from its sequence's keep block on (stored only if so,
            # freed once not): what goes is what was last read in [before, q0), where held.
            heads, blocks = self.eviction.last_read_in(before, q0)
            seq = torch.tensor(seqs, dtype=torch.int64)
            pages = self._table[seq[:, None], heads, blocks]  # (sequences, blocks)
            rows, cols = (pages >= 0).nonzero(as_tuple=True)
            parts.append((seq[rows], heads[cols], blocks[cols], pages[rows, cols]))
        if not parts:
            return _NO_PAGES
        if len(parts) == 1:  # one move (a batch decoding in step): in sequence order already
            return parts[0]
        seq, heads, blocks, pages = (torch.cat(t) for t in zip(*parts))
        order = torch.argsort(seq, stable=True)  # the pool's free list takes them in this order
        return seq[order], heads[order], blocks[order], pages[order]

    def _allocations(
        self, old: list[int], new: list[int], keep_block: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(sequence, head, block) of every block the new tokens enter that some query from the
        keep block on reads: each needs a page."""
        bs = self.block_size
        seqs: list[int] = []
        blocks: list[int] = []
        for b, (a, n) in enumerate(zip(old, new)):
            if n == a:
                continue
            # The block holding position `a` already exists when `a` is inside it.
            first = a // bs if a % bs == 0 else a // bs + 1
            last = (n - 1) // bs
            seqs += [b] * (last - first + 1)
            blocks += range(first, last + 1)
        if not seqs:
            empty = torch.zeros(0, dtype=torch.int64)
            return empty, empty, empty
        # Host lists, one tensor each: a decode step enters a block or two per sequence.
        seq, blk = torch.tensor(seqs), torch.tensor(blocks)
        keep = torch.tensor([keep_block[b] for b in seqs])
        want = self.eviction.read_from(keep, blk).T  # (entries, kv_heads)
        want &= self._table[seq, :, blk] < 0
        rows, heads = want.nonzero(as_tuple=True)
        return seq[rows], heads, blk[rows]

    def _copies_on_write(
        self, old: list[int], new: list[int], released: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(sequence, head, block) of the shared pages the new tokens write into (the block
        holding each sequence's old end), counted after this append's evictions."""
        empty = _NO_PAGES[0]
        if not self.pool.shared:
            return empty, empty, empty
        refs = self.pool.holders_after(released)
        seqs = [b for b, (a, n) in enumerate(zip(old, new)) if n > a and a % self.block_size]
        if not seqs:
            return empty, empty, empty
        seq = torch.tensor(seqs, dtype=torch.int64)
        blk = torch.tensor([old[b] // self.block_size for b in seqs], dtype=torch.int64)
        pages = self._table[seq, :, blk].long()  # (sequences, kv_heads)
        rows, heads = ((pages >= 0) & (refs[pages.clamp(min=0)] > 1)).nonzero(as_tuple=True)
        # When every holder of a page writes into it, the last one keeps it.
        writers = pages[rows, heads]
        copy = torch.ones(rows.numel(), dtype=torch.bool)
        seen: dict[int, int] = {}
        for r, page in enumerate(writers.tolist()):
            seen[page] = seen.get(page, 0) + 1
            if seen[page] == refs[page]:
                copy[r] = False
        rows, heads = rows[copy], heads[copy]
        return seq[rows], heads, blk[rows]

    # ---------------------------------------------------------------------------- rewinds
    def _drop_tail(self, new: list[int]) -> None:
        bs, h, nb = self.block_size, self.num_kv_heads, self.max_blocks
        changed = []
        for b, n in enumerate(new):
            first_gone = math.ceil(n / bs)
            table = self._table[b, :, first_gone:]
            heads, blocks = (table >= 0).nonzero(as_tuple=True)
            if heads.numel():
                self.pool.release(table[heads, blocks].clone())
                table[heads, blocks] = -1
                changed.append((b * h + heads) * nb + blocks + first_gone)
        if changed:
            idx = torch.cat(changed)
            self.page_table.view(-1)[self._upload(idx)] = -1

    def _select(self, idx: torch.Tensor) -> None:
        # Copies share their pages: recount every page's holders from the new table.
        table = self._table[idx].contiguous()
        self.pool.hold_exactly(table[table >= 0])
        self._table = table
        indices = idx.tolist()
        self._lengths = [self._lengths[i] for i in indices]
        self._keep_block = [self._keep_block[i] for i in indices]
        lengths = torch.tensor(self._lengths, dtype=torch.int32)
        if len(indices) == self.batch_size:
            # In place: the device tensors keep their storage (a captured graph stays valid).
            self.page_table.copy_(table.to(self.device))
            self.seq_lens.copy_(lengths.to(self.device))
        else:
            self.batch_size = len(indices)
            self.page_table = table.to(self.device)
            self.seq_lens = lengths.to(self.device)
            self.split_counters = self._new_split_counters()

    def _reset_pages(self) -> None:
        self._table.fill_(-1)
        self.page_table.fill_(-1)
        self.pool.reset()
