"""The static KV cache: every (sequence, KV head, block) has a fixed page, decided when the cache
is built from the pattern, so that no step changes the page table.

A decode step is then only device work on tensors updated in place (the page write, the decode
kernel, the lengths), which a CUDA graph captures and replays as sequences grow
(:func:`s2attn.capture_decode_step`), or one operator inside a compiled graph
(``s2attn.inference.decode_op``). Blocks read only near their own position share a ring of pages,
reused as the window moves; blocks read longer (stripes, and everything of a dense layer) get a
page each (:meth:`StaticKVCache.static_plan`).

Compiled decode steps advance only the device's lengths; the host's catch up (one sync) at the
next call that reads them (:meth:`StaticKVCache.catch_up`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from ..input_checks import check_int
from .cache import PagedKVCache, _host_synced
from .decode_step import MAX_DECODE_TOKENS
from .page_pool import PagePool

__all__ = ["StaticKVCache"]


class StaticKVCache(PagedKVCache):
    """A :class:`PagedKVCache` of fixed pages; what ``paged_kv_cache(..., static=True)`` builds.
    Arguments as :class:`PagedKVCache`'s, without ``num_pages`` (the plan sizes the pool).
    Appends must be decode steps or keep only what later queries read (as
    ``sparse_attention_with_kvcache`` does); beam reorders keep the batch size.

    ``step_plan``: the :class:`~.decode_plan.DecodePlan` of every decode step that serves all
    lengths (the compiled operator's and a captured run's): the cache's tensors never change.

    Example::

        >>> cache = s2attn.paged_kv_cache(pattern, batch_size=8, num_kv_heads=8, head_dim=128,
        ...                               device="cuda", static=True)
        >>> cache.static_plan()["ring"]
    """

    static = True

    def _make_pool(self, num_pages: int | None) -> PagePool:
        if num_pages is not None:
            raise ValueError("a static cache sizes its own pool: leave num_pages out")
        self._ring, self._slots_per_head, self._slot_of_block = self._page_plan()
        pool = self._new_pool(self.batch_size * self.num_kv_heads * self._slots_per_head)
        pool.hold_all()
        self._last_use = self.eviction.last_use.to(self.device)
        # Tokens per step of compiled decode steps, set once one is traced: those advance the
        # device's lengths alone, and catch_up brings the host's along.
        self._device_step: int | None = None
        return pool

    def _built(self) -> None:
        # Every step's plan, built here, outside any compiled graph, which then only reads it:
        # the tensors stay (edits change them in place), the split count is the whole run's.
        self.step_plan = self.decode_plan()

    def _initial_table(self) -> torch.Tensor:
        # (sequence, KV head) pairs own consecutive runs of `slots` pages.
        slots = self._slots_per_head
        owner = torch.arange(self.batch_size * self.num_kv_heads, dtype=torch.int32)
        base = owner.view(self.batch_size, self.num_kv_heads, 1) * slots
        return torch.where(self._slot_of_block >= 0, self._slot_of_block + base, -1)

    def _page_plan(self) -> tuple[int, int, torch.Tensor]:
        """A static cache's plan: (ring pages per KV head, pages per (sequence, KV head), the
        page of each (KV head, block) within its sequence's pages, int32 (kv_heads, blocks), -1
        for blocks no query reads).

        A block read by queries up to ``span`` blocks after its own is live, during a decode step,
        while the step's blocks run from it to ``span + 1`` blocks later. Blocks with ``span <=
        ring - 2`` therefore fit a ring of ``ring`` pages (block j in page ``j % ring``): no two
        of them are live at once. The others get a page each after the ring. The ring size
        minimises the pages per KV head."""
        nb = self.max_blocks
        last_use = self.eviction.last_use
        blocks = torch.arange(nb)
        read = last_use >= blocks  # blocks no query reads are never stored
        span = torch.where(read, (last_use - blocks).clamp(max=nb), -1)
        # Pages with a ring of r: r + (blocks whose span exceeds r - 2), the most over KV heads.
        spans = span.sort(dim=1).values
        reads = read.sum(dim=1)
        rings = torch.arange(2, nb + 2)
        bounds = (rings - 2).expand(len(spans), -1).contiguous()
        beyond = reads[:, None] - torch.searchsorted(spans, bounds, right=True)
        costs = torch.cat([reads.max()[None], rings + beyond.amax(dim=0)])
        best = int(costs.argmin())
        ring = 0 if best == 0 else int(rings[best - 1])
        own = read & (span > ring - 2) if ring else read
        slot = torch.where(own, ring + own.cumsum(dim=1) - 1, blocks % max(ring, 1))
        slot = torch.where(read, slot, -1).to(torch.int32)
        return ring, int(costs[best]), slot

    def static_plan(self) -> dict[str, int]:
        """The page plan: ``ring`` pages per (sequence, KV head) shared by the blocks read only
        near their own position, ``pages_per_head`` in all, and the pool's ``num_pages``."""
        return {
            "ring": self._ring,
            "pages_per_head": self._slots_per_head,
            "num_pages": self.num_pages,
        }

    # ------------------------------------------------------------------ device-only steps
    def follow_device_steps(self, num_new: int) -> None:
        """From now on, decode steps of ``num_new`` tokens may run as device work alone (the
        compiled operator ``s2attn::static_decode``), advancing only the device's lengths: the
        host's follow them at the next call that reads them (:meth:`catch_up`)."""
        self._device_step = check_int("num_new", num_new)

    def catch_up(self) -> None:
        """Bring the host bookkeeping up to the device's lengths after compiled decode steps:
        one host sync, and nothing at all for a cache no compiled step ran on. Public methods
        call it first."""
        if self._device_step is None:
            return
        lengths = self.seq_lens.tolist()
        if lengths == self._lengths:
            return
        bs, step = self.block_size, self._device_step
        # A decode step keeps its own queries' blocks: from the block of its first new token on.
        self._keep_block = [
            max(keep, (n - step) // bs) for n, keep in zip(lengths, self._keep_block)
        ]
        self._lengths = lengths

    @contextlib.contextmanager
    def host_state_kept(self) -> Iterator[None]:
        """Restore the host bookkeeping (lengths, keep blocks) on exit: capturing a CUDA graph
        runs a step's host code without its device work."""
        self.catch_up()
        lengths, keep = list(self._lengths), list(self._keep_block)
        try:
            yield
        finally:
            self._lengths, self._keep_block = lengths, keep

    @_host_synced
    def advance(self, num_new: int) -> None:
        """Account on the host for a decode step of ``num_new`` tokens per sequence whose device
        work (page write, lengths) already ran: a step replayed from a CUDA graph (see
        :func:`s2attn.capture_decode_step`, which calls this on every replay)."""
        check_int("num_new", num_new)
        if num_new > MAX_DECODE_TOKENS:
            raise ValueError(f"num_new must be a decode step (<= {MAX_DECODE_TOKENS} tokens)")
        new = [n + num_new for n in self._lengths]
        if max(new) > self.max_seq_len:
            raise ValueError(
                f"a sequence would hold {max(new)} tokens, past the cache's max_seq_len "
                f"{self.max_seq_len}"
            )
        bs = self.block_size
        self._keep_block = [max(n // bs, k) for n, k in zip(self._lengths, self._keep_block)]
        self._lengths = new

    # -------------------------------------------------------------------- the kind's own
    def _make_room(self, old: list[int], new: list[int], keep_block: list[int]) -> None:
        bs = self.block_size
        for b, (n, keep) in enumerate(zip(new, keep_block)):
            # The ring holds the blocks that later queries read only if they are the newest
            # ones: queries of at most the last two blocks.
            if n and (n - 1) // bs - keep > 1 and self._ring:
                raise ValueError(
                    f"a static cache cannot keep sequence {b}'s new blocks {keep}..{(n - 1) // bs} "
                    "for their own queries (its ring holds a decode step's); append with "
                    "keep_from at the new end (the queries already ran), or use static=False"
                )

    def _stored(self, pages, seq, blk, keep_block) -> torch.Tensor:
        # The table names a page for every block, also those whose ring page has moved on to a
        # newer block: there a block is stored only while a query from the sequence's keep
        # block on reads it.
        keep = self._keep_block if keep_block is None else keep_block
        keep = torch.tensor(keep, dtype=torch.int64, device=self.device)[seq]
        heads = torch.arange(self.num_kv_heads, device=self.device)
        return (pages >= 0) & (self._last_use[heads[None, :], blk] >= keep[:, None])

    def _check_crop_pages(self, num_tokens: int) -> None:
        if not self._ring:
            return
        bs = self.block_size
        for b, n in enumerate(self._lengths):
            # Ring pages of blocks a query there reads hold newer blocks once the sequence
            # has gone two blocks past.
            if n and (n - 1) // bs > (n - num_tokens) // bs + 1:
                raise ValueError(
                    f"cannot crop sequence {b} to {n - num_tokens} tokens: a static cache's "
                    "ring pages of the blocks its queries there read hold newer blocks (it "
                    f"can be cropped to {((n - 1) // bs - 1) * bs} tokens or more)"
                )

    def _drop_tail(self, new: list[int]) -> None:
        pass  # the table stays: the pages of dropped tokens are written again later

    def _select(self, idx: torch.Tensor) -> None:
        # Each sequence owns a fixed run of pages: copy the runs (no sharing, no table change).
        if len(idx) != self.batch_size:
            raise ValueError(
                f"a static cache keeps its batch size ({self.batch_size}); got "
                f"{len(idx)} indices (build it with the batch size it will hold)"
            )
        self.pool.copy_runs(idx, self.batch_size)
        self._lengths = [self._lengths[i] for i in idx.tolist()]
        self._keep_block = [self._keep_block[i] for i in idx.tolist()]
        self.seq_lens.copy_(self.seq_lens[idx.to(self.device)])

    def _reset_pages(self) -> None:
        pass  # the table stays; new tokens overwrite the pages
