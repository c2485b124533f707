"""The paged KV cache of one attention layer: the part its two kinds share.

Storage is a :class:`~.page_pool.PagePool`. A page holds the keys (and, in a twin pool, the
values) of ``block_size`` consecutive positions of one (sequence, KV head): one pattern block. A
page table (batch, kv_heads, max_blocks) of int32 maps every KV block to its page, -1 when absent.

Two kinds share this class's reads, sizes and bookkeeping and differ in how pages are held:

* :class:`~.dynamic_cache.DynamicKVCache` takes pages from the pool as sequences enter blocks and
  returns them when the pattern stops reading them; beam reorders share pages.
* :class:`~.static_cache.StaticKVCache` fixes every block's page when it is built, so a decode
  step is device work alone (CUDA graphs, compiled decode steps).

:func:`~.cache_factory.paged_kv_cache` builds either (``static=False`` or ``True``); this module
imports neither, they import it.

Eviction. Before new tokens are written, each sequence names the first position whose queries
will still read the cache (``keep_from``); the layer's :class:`~.eviction.EvictionSchedule` says
which stored blocks no such query reads (their pages are freed) and which new blocks none reads
(they are never stored). For S2 patterns what stays is what the pattern still needs, within one
block per head.

Bookkeeping (lengths, page table) lives on the host and is mirrored to the device only when it
changes, i.e. when a sequence enters a new block: a decode step within a block costs no
host-device synchronisation. A decode step's device work (page write, device lengths, attention)
is :func:`~.decode_step.decode_step`, over the :class:`~.decode_plan.DecodePlan` the cache returns
when it has planned the step's pages (:meth:`PagedKVCache.plan_decode_step`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import torch

from ..input_checks import check_cu_seqlens, check_int
from ..ops.decode_layout import DecodeLayout
from ..ops.dispatch import supports_triton
from ..pattern import BlockPattern
from .cache_checks import (
    cache_sizes,
    check_gather_lengths,
    check_keep_from,
    check_new_tokens,
    check_sequence_indices,
    pool_device,
)
from .decode_plan import DecodePlan, split_count, step_layout
from .decode_step import MAX_DECODE_TOKENS, write_pages
from .eviction import EvictionSchedule
from .page_pool import PagePool, upload

__all__ = ["PagedKVCache"]


# Appends of more (token, KV head) rows than this are prefills: they filter unstored rows.
_FILTER_WRITES_ABOVE = 4096


def _host_synced(method):
    """Run :meth:`PagedKVCache.catch_up` first: the method reads the host bookkeeping, which
    compiled decode steps leave behind the device's."""

    @functools.wraps(method)
    def synced(self, *args, **kwargs):
        self.catch_up()
        return method(self, *args, **kwargs)

    return synced


class PagedKVCache:
    """Paged K/V storage of one attention layer that frees what its pattern never reads again:
    what both kinds share. Build one with :func:`~s2attn.inference.cache_factory.paged_kv_cache`
    (``static=`` picks the kind) or with the kind's class, which take these arguments.

    Args:
        pattern: the layer's causal :class:`s2attn.BlockPattern` (one head per KV head, or one per
            query head: a KV block then lives as long as any head of its group reads it), or None
            for a dense layer.
        batch_size: sequences held; each has its own length.
        num_kv_heads, head_dim: K/V shape per token.
        dtype: of the page pools (float16, bfloat16 or float32).
        device: of the page pools; None (the default): the current GPU when CUDA is available,
            else the CPU.
        max_seq_len: the longest sequence; defaults to the pattern's. Required when dense.
        block_size: tokens per page; the pattern's block size (required when dense).
        num_pages: pages in the pool (per K and per V). Defaults to the most the pattern ever
            needs at once for ``batch_size`` sequences, plus one page per (sequence, KV head) for
            a block being entered (:meth:`default_num_pages`); a dense layer gets every block.
            Give fewer when sequences are known to be short: pages are shared across the batch.
            An append the pool cannot hold raises, naming the pages it needs.

    Attributes read by the kernels: ``k_pages``/``v_pages`` (num_pages + 1, block_size, head_dim),
    whose last page absorbs writes that are not stored; ``page_table`` int32 (batch, kv_heads,
    max_blocks); ``seq_lens`` int32 (batch,). ``eviction``: the :class:`EvictionSchedule` that
    decides which pages to free and which blocks to store; ``pool``: the :class:`PagePool`.

    Example::

        >>> pattern = s2attn.local_stride_pattern(
        ...     32, max_seq_len=131072, block_size=64, local_blocks=16, vert_stride=64,
        ...     num_kv_heads=8
        ... )
        >>> cache = s2attn.paged_kv_cache(pattern, batch_size=16, num_kv_heads=8, head_dim=128,
        ...                               dtype=torch.bfloat16, device="cuda")
        >>> out = s2attn.sparse_attention_with_kvcache(q, cache, k, v)  # prefill, then decode
        >>> cache.memory_report()["live_bytes"]
    """

    def __init__(
        self,
        pattern: BlockPattern | None,
        *,
        batch_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str | None = None,
        max_seq_len: int | None = None,
        block_size: int | None = None,
        num_pages: int | None = None,
    ):
        if type(self) is PagedKVCache:
            raise TypeError(
                "PagedKVCache is what the two kinds of cache share: build one with "
                "s2attn.paged_kv_cache(pattern, ..., static=False or True), or with the kind's "
                "class (DynamicKVCache, StaticKVCache)"
            )
        sizes = cache_sizes(
            pattern,
            batch_size=batch_size,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            dtype=dtype,
            max_seq_len=max_seq_len,
            block_size=block_size,
        )
        self.pattern = pattern
        self.batch_size = sizes.batch_size
        self.num_kv_heads = sizes.num_kv_heads
        self.head_dim = sizes.head_dim
        self.dtype = dtype
        self.device = pool_device(device)
        self.block_size = sizes.block_size
        self.max_seq_len = sizes.max_seq_len
        self.max_blocks = nb = math.ceil(self.max_seq_len / self.block_size)
        self.eviction = EvictionSchedule(pattern, self.num_kv_heads, nb)
        # The kind's class holds its pages its own way.
        self.pool = self._make_pool(num_pages)
        self.num_pages = self.pool.num_pages
        self._table = self._initial_table()
        self.page_table = self._table.to(self.device)
        self.seq_lens = torch.zeros(self.batch_size, dtype=torch.int32, device=self.device)
        self._lengths = [0] * self.batch_size
        # Per sequence: the query block from which on its queries still read the cache.
        self._keep_block = [0] * self.batch_size
        self._layout: DecodeLayout | None = None
        self._list_lengths: list[int] = []  # the layout's list_lengths, as host ints
        # Made here, not on first use, so that a compiled step only reads it.
        self.split_counters = self._new_split_counters()
        # Decode plans by split count, and the split count of every step of a captured run as
        # (batch size, count): a plan is built again only when the cache swaps its tensors.
        self._plans: dict[int, DecodePlan] = {}
        self._run_splits = (0, 0)
        self._built()
        # Eager decode steps captured as CUDA graphs, by step shape (inference/step_graph.py).
        self.step_graphs: dict = {}
        # The last eager decode step's inputs, as they passed their checks, and its scale: a step
        # of the same inputs skips the checks (inference/attention.py).
        self._checked_step: tuple | None = None

    # The kind's own: its pool and first page table, and how it holds pages as the cache changes.
    static: bool

    def _make_pool(self, num_pages: int | None) -> PagePool:
        raise NotImplementedError

    def _built(self) -> None:
        """The end of construction: what the kind makes of the finished cache."""

    def _initial_table(self) -> torch.Tensor:
        raise NotImplementedError

    def _make_room(self, old: list[int], new: list[int], keep_block: list[int]) -> None:
        """Before an append's write: give the new blocks pages and free those left behind."""
        raise NotImplementedError

    def _drop_tail(self, new: list[int]) -> None:
        """A crop to ``new`` lengths: pages of the dropped blocks."""
        raise NotImplementedError

    def _select(self, idx: torch.Tensor) -> None:
        """select_sequences on validated indices."""
        raise NotImplementedError

    def _reset_pages(self) -> None:
        raise NotImplementedError

    def _check_crop_pages(self, num_tokens: int) -> None:
        """Raise when the kind's pages no longer hold what a crop would expose."""

    def _stored(
        self, pages: torch.Tensor, seq: torch.Tensor, blk: torch.Tensor, keep_block
    ) -> torch.Tensor:
        """Whether each (token, KV head) of ``pages`` (its page, -1 for none) is stored."""
        return pages >= 0

    def _new_pool(self, num_pages: int) -> PagePool:
        return PagePool(
            num_pages,
            block_size=self.block_size,
            head_dim=self.head_dim,
            dtype=self.dtype,
            device=self.device,
        )

    @property
    def k_pages(self) -> torch.Tensor:
        return self.pool.k_pages

    @property
    def v_pages(self) -> torch.Tensor:
        return self.pool.v_pages

    # ---------------------------------------------------------------------------- sizes
    @property
    def dense(self) -> bool:
        """Whether the layer reads every block to the end (no pattern, or an all-dense one)."""
        return self.eviction.dense

    @property
    def kv_efficient(self) -> bool:
        """Whether the pattern lets the cache evict (a block's readers form one run)."""
        return self.eviction.kv_efficient

    @property
    @_host_synced
    def lengths(self) -> list[int]:
        """Tokens held per sequence (evicted ones included)."""
        return list(self._lengths)

    @_host_synced
    def check_room(self, num_new: int) -> None:
        """Raise ``ValueError`` unless every sequence can take ``num_new`` more tokens within
        ``max_seq_len``, naming the length the first one that cannot would need. A compiled
        decode step checks nothing on the host, so call this outside it, before the step (one
        host sync when compiled steps ran since the last check)."""
        check_int("num_new", num_new, 0)
        self._check_fits([n + num_new for n in self._lengths])

    def _check_fits(self, new: list[int]) -> None:
        for b, n in enumerate(new):
            if n > self.max_seq_len:
                raise ValueError(
                    f"sequence {b} would hold {n} tokens, past the cache's max_seq_len "
                    f"{self.max_seq_len}"
                )

    def catch_up(self) -> None:
        """Bring the host bookkeeping up to the device's lengths after compiled decode steps
        (static caches only; see :meth:`StaticKVCache.follow_device_steps`). Public methods call
        it first; nothing to do for a dynamic cache."""

    @property
    def live_pages(self) -> int:
        return self.pool.live

    @property
    def page_bytes(self) -> int:
        """Bytes of one page of K plus its page of V."""
        return self.pool.page_bytes

    def live_bytes(self) -> int:
        """K/V bytes in pages that hold data now."""
        return self.live_pages * self.page_bytes

    def capacity_bytes(self) -> int:
        """K/V bytes of the whole pool."""
        return self.num_pages * self.page_bytes

    @_host_synced
    def dense_bytes(self) -> int:
        """K/V bytes a dense cache of the current lengths would hold."""
        per_token = 2 * self.num_kv_heads * self.head_dim * self.k_pages.element_size()
        return sum(self._lengths) * per_token

    @_host_synced
    def needed_pages(self) -> int:
        """Pages the pattern needs from here on: per sequence and KV head, the blocks holding
        tokens that some query at the next position or later reads."""
        total = 0
        for n in self._lengths:
            if n == 0:
                continue
            last = (n - 1) // self.block_size
            total += int(self.eviction.read_from(n // self.block_size, slice(0, last + 1)).sum())
        return total

    @_host_synced
    def memory_report(self) -> dict[str, int]:
        """Live, needed, dense-equivalent and pool sizes, in bytes and pages."""
        return {
            "live_bytes": self.live_bytes(),
            "needed_bytes": self.needed_pages() * self.page_bytes,
            "dense_bytes": self.dense_bytes(),
            "capacity_bytes": self.capacity_bytes(),
            "live_pages": self.live_pages,
            "free_pages": self.pool.num_free,
            "tokens": sum(self._lengths),
        }

    @property
    def decode_layout(self) -> DecodeLayout:
        """The decode kernel's lists for this cache's pattern, built once on its device."""
        if self._layout is None:
            layout = step_layout(
                self.pattern, self.num_kv_heads, self.block_size, self.max_blocks, self.device
            )
            self._list_lengths = layout.list_lengths.tolist()
            self._layout = layout
        return self._layout

    def _new_split_counters(self) -> torch.Tensor:
        """The decode kernel's count of finished splits per (sequence, KV head), zero between
        launches; its atomics index it, so it follows the batch size. One per cache: its steps
        launch in order on one stream, so they can share it."""
        n = self.batch_size * self.num_kv_heads
        return torch.zeros(n, dtype=torch.int32, device=self.device)

    @_host_synced
    def decode_plan(
        self, num_new: int | None = None, *, num_splits: int | None = None
    ) -> DecodePlan:
        """The plan of a decode step over the cache as it is (the step's pages planned already).

        Its split count: ``num_splits`` when given; else, for a step of ``num_new`` tokens, from
        the longest list the step's query blocks walk; else (``num_new`` None) from the longest
        list of all, so that one launch, captured or compiled, serves every length. Host data
        alone: no sync."""
        return self._decode_plan(num_new, num_splits)

    def _decode_plan(self, num_new: int | None, num_splits: int | None) -> DecodePlan:
        # The eager step's host half calls this after its own catch-up: one per step.
        if num_splits is None:
            num_splits = self._num_splits(num_new)
        plan = self._plans.get(num_splits)
        if plan is None or not (
            plan.page_table is self.page_table
            and plan.seq_lens is self.seq_lens
            and plan.split_counters is self.split_counters
        ):
            if plan is not None:  # the cache swapped its tensors: every plan is stale
                self._plans.clear()
            plan = self._plans[num_splits] = DecodePlan(
                k_pages=self.k_pages,
                v_pages=self.v_pages,
                page_table=self.page_table,
                seq_lens=self.seq_lens,
                split_counters=self.split_counters,
                pattern=self.pattern,
                layout=self.decode_layout,
                num_splits=num_splits,
            )
        return plan

    def _num_splits(self, num_new: int | None) -> int:
        """The decode kernel's programs per (sequence, KV head): see :meth:`decode_plan`."""
        if num_new is None and self._run_splits[0] == self.batch_size:
            return self._run_splits[1]
        layout = self.decode_layout  # first use: its host lists too
        splits = split_count(
            self._list_lengths,
            None if num_new is None else (n - num_new for n in self._lengths),
            block_size=self.block_size,
            batch=self.batch_size,
            num_kv_heads=layout.num_kv_heads,
            device=self.device,
        )
        if num_new is None:
            self._run_splits = (self.batch_size, splits)
        return splits

    # --------------------------------------------------------------------------- writes
    def _new_token_counts(
        self, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor | None
    ) -> list[int]:
        check_new_tokens(k, v, self.k_pages, self.page_table, cu_seqlens)
        if cu_seqlens is None:
            return [k.shape[1]] * self.batch_size
        cu = check_cu_seqlens("cu_seqlens", cu_seqlens, k.shape[0], k.device, self.batch_size)
        return [b - a for a, b in zip(cu, cu[1:])]

    @_host_synced
    def append(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        cu_seqlens: torch.Tensor | None = None,
        keep_from: Sequence[int] | None = None,
    ) -> None:
        """Write new keys and values at the end of each sequence, evicting first.

        Args:
            k, v: (batch, num_new, kv_heads, dim), or packed (total, kv_heads, dim) with
                ``cu_seqlens``; the cache's dtype and device.
            cu_seqlens: (batch + 1,) offsets of each sequence's new tokens in packed k/v.
            keep_from: per sequence, the first position whose queries will still read the cache.
                Pages no such query reads are freed, and new blocks none reads are not stored.
                Defaults to each sequence's first new position for a decode step (at most
                ``MAX_DECODE_TOKENS`` new tokens per sequence, whose queries then read the
                cache), and to each sequence's new end for a longer append (filling the cache:
                only later queries read it), so one append of ``max_seq_len`` tokens fits the
                default pool. Pass each sequence's first new position to keep a long append
                whole for its own queries; the pool must then hold it.

        Raises ``RuntimeError`` naming the pages needed when the pool cannot hold what the append
        keeps; the cache is then left as it was.
        """
        counts, new, keep_block = self._plan_append(k, v, cu_seqlens, keep_from)
        self._write(k, v, counts, cu_seqlens, keep_block)
        self._lengths = new
        self._keep_block = keep_block
        if cu_seqlens is None:
            self.seq_lens += counts[0]
        else:
            self.seq_lens += upload(torch.tensor(counts, dtype=torch.int32), self.device)

    @_host_synced
    def plan_decode_step(
        self, k: torch.Tensor, v: torch.Tensor, *, num_splits: int | None = None
    ) -> DecodePlan:
        """The host half of a decode step of ``k``, ``v`` (batch, num_new, kv_heads, dim), at
        most ``MAX_DECODE_TOKENS`` new tokens: evict, give the new blocks pages, take the new
        host lengths; return the step's plan (:meth:`decode_plan` of ``num_new``). The device
        half (page write, device lengths, attention) is
        :func:`s2attn.inference.decode_step.decode_step` of that plan, which must follow at
        once."""
        if k.dim() == 4 and k.shape[1] > MAX_DECODE_TOKENS:
            raise ValueError(
                f"a decode step holds at most {MAX_DECODE_TOKENS} new tokens, got {k.shape[1]}"
            )
        _, self._lengths, self._keep_block = self._plan_append(k, v, None, None)
        return self._decode_plan(k.shape[1], num_splits)

    @_host_synced
    def _plan_checked_decode_step(
        self, num_new: int, *, num_splits: int | None, whole_run: bool
    ) -> DecodePlan:
        """:meth:`plan_decode_step` for ``num_new`` new tokens per sequence whose k and v passed
        the step's checks already (``sparse_attention_with_kvcache``'s). ``whole_run``: the plan
        of a step replayed from a CUDA graph, whose split count serves every length."""
        counts = [num_new] * self.batch_size
        _, self._lengths, self._keep_block = self._plan(counts, None)
        return self._decode_plan(None if whole_run else num_new, num_splits)

    def _plan_append(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_seqlens: torch.Tensor | None,
        keep_from: Sequence[int] | None,
    ) -> tuple[list[int], list[int], list[int]]:
        """Check an append, make room for it; return the new tokens, lengths and keep blocks
        per sequence."""
        return self._plan(self._new_token_counts(k, v, cu_seqlens), keep_from)

    def _plan(
        self, counts: list[int], keep_from: Sequence[int] | None
    ) -> tuple[list[int], list[int], list[int]]:
        """Make room for ``counts`` new tokens per sequence (checked k and v); return them, the
        new lengths and keep blocks per sequence."""
        old = self._lengths
        new = [a + n for a, n in zip(old, counts)]
        self._check_fits(new)
        if keep_from is None:
            keep_from = old if max(counts) <= MAX_DECODE_TOKENS else new
        else:
            check_keep_from(keep_from, new)
        bs = self.block_size
        keep_block = [max(pos // bs, kb) for pos, kb in zip(keep_from, self._keep_block)]
        self._make_room(old, new, keep_block)
        return counts, new, keep_block

    def default_num_pages(self) -> int:
        """The default pool: the most the pattern keeps at once for ``batch_size`` sequences of
        up to ``max_seq_len`` tokens, decoded or filled by appends of any length."""
        return self.batch_size * self.eviction.peak_blocks_per_sequence()

    def _upload(self, t: torch.Tensor) -> torch.Tensor:
        return upload(t, self.device)

    def _token_index(
        self, counts: list[int], cu_seqlens: torch.Tensor | None, start: list[int] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(sequence, position) of each token, on the device, for batched or packed tokens at
        ``start`` (default: each sequence's current end)."""
        dev = self.device
        base = (
            self.seq_lens.to(torch.int64)
            if start is None
            else torch.tensor(start, dtype=torch.int64).to(dev)
        )
        total = sum(counts)
        if cu_seqlens is None:
            n = counts[0]
            seq = torch.arange(self.batch_size, device=dev).repeat_interleave(n)
            pos = base[seq] + torch.arange(n, device=dev).repeat(self.batch_size)
            return seq, pos
        count_t = torch.tensor(counts, dtype=torch.int64).to(dev)
        seq = torch.repeat_interleave(
            torch.arange(self.batch_size, device=dev), count_t, output_size=total
        )
        offsets = torch.cumsum(count_t, 0) - count_t
        pos = torch.arange(total, device=dev) - offsets[seq] + base[seq]
        return seq, pos

    def _slots(
        self, seq: torch.Tensor, pos: torch.Tensor, keep_block: Sequence[int] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Flat pool rows (tokens, kv_heads) of each token's K/V, and whether it is stored
        (``keep_block``: per sequence, the first query block still served; default: the
        current one)."""
        bs = self.block_size
        heads = torch.arange(self.num_kv_heads, device=self.device)
        blk = (pos // bs)[:, None]
        pages = self.page_table[seq[:, None], heads[None, :], blk].to(torch.int64)
        stored = self._stored(pages, seq, blk, keep_block)
        rows = torch.where(stored, pages * bs + (pos % bs)[:, None], self.pool.spare * bs)
        return rows, stored

    def _write(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        counts: list[int],
        cu_seqlens: torch.Tensor | None,
        keep_block: Sequence[int] | None = None,
    ) -> None:
        if sum(counts) == 0:
            return
        if cu_seqlens is None and counts[0] <= MAX_DECODE_TOKENS and supports_triton(self.device):
            # A decode step: one launch (self.seq_lens still holds the old lengths).
            write_pages(k, v, self.decode_plan(), advance=False)
            return
        seq, pos = self._token_index(counts, cu_seqlens)
        rows, stored = self._slots(seq, pos, keep_block)
        rows, stored = rows.reshape(-1), stored.reshape(-1)
        d = self.head_dim
        k, v = k.reshape(-1, d), v.reshape(-1, d)
        if rows.numel() > _FILTER_WRITES_ABOVE:
            # A prefill: most of the prompt is not stored. Drop those rows (one host sync)
            # rather than funnel millions of writes into one spare row.
            keep = stored.nonzero().squeeze(1)
            rows, k, v = rows[keep], k[keep], v[keep]
        # Blocks that are not stored write into the spare last page, which nothing reads.
        self.k_pages.view(-1, d).index_copy_(0, rows, k)
        self.v_pages.view(-1, d).index_copy_(0, rows, v)

    # ---------------------------------------------------------------------------- reads
    @_host_synced
    def gather(
        self, lengths: Sequence[int] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The first ``lengths[b]`` tokens of each sequence as packed dense K and V.

        Returns ``(k, v, cu_seqlens)``: k/v (sum(lengths), kv_heads, dim) with evicted tokens
        as zeros, cu_seqlens int32 (batch + 1,) on the device. For chunked prefill (the past of a
        chunk) and for tests; it materialises what the cache avoids holding, so use it sparingly.
        """
        lengths = self.lengths if lengths is None else list(lengths)
        check_gather_lengths(lengths, self._lengths)
        cu = torch.tensor([0, *lengths], dtype=torch.int64).cumsum(0).to(torch.int32)
        cu = cu.to(self.device)
        seq, pos = self._token_index(lengths, cu, start=[0] * self.batch_size)
        rows, stored = self._slots(seq, pos)
        d = self.head_dim
        zero = torch.zeros((), dtype=self.dtype, device=self.device)
        k = torch.where(stored[..., None], self.k_pages.view(-1, d)[rows], zero)
        v = torch.where(stored[..., None], self.v_pages.view(-1, d)[rows], zero)
        return k, v, cu

    # ------------------------------------------------------------------------- rewinds
    @_host_synced
    def check_crop(self, num_tokens: int) -> None:
        """Raise ``ValueError`` unless :meth:`crop` of ``num_tokens`` would succeed."""
        check_int("num_tokens", num_tokens, 0)
        if num_tokens > min(self._lengths):
            raise ValueError(
                f"num_tokens={num_tokens} exceeds the shortest sequence's "
                f"{min(self._lengths)} tokens"
            )
        if not self.eviction.evicts:
            return  # every block is held to the end
        self._check_crop_pages(num_tokens)
        bs = self.block_size
        for b, n in enumerate(self._lengths):
            if n - num_tokens < self._keep_block[b] * bs:
                raise ValueError(
                    f"cannot crop sequence {b} to {n - num_tokens} tokens: blocks its queries "
                    f"there read are already evicted (it can be cropped to "
                    f"{self._keep_block[b] * bs} tokens or more)"
                )

    @_host_synced
    def crop(self, num_tokens: int) -> None:
        """Drop the last ``num_tokens`` tokens of every sequence (rejected speculative tokens).

        Works wherever the blocks a query at the cropped-to position reads are still held:
        back to the start of the oldest query block the cache still serves. Cropping further
        raises ``ValueError`` and leaves the cache as it was.
        """
        self.check_crop(num_tokens)
        new = [n - num_tokens for n in self._lengths]
        self._drop_tail(new)
        self._lengths = new
        self.seq_lens -= num_tokens

    @_host_synced
    def select_sequences(self, indices: Sequence[int] | torch.Tensor) -> None:
        """Make sequence ``i`` a copy of sequence ``indices[i]``, for every ``i``: beam search's
        reorder (``indices`` a permutation with repeats), a repeat (each index several times) or a
        selection (fewer). The batch size becomes ``len(indices)``; the pool stays.

        Copies share their pages (each page counts its holders); a sequence that then writes into
        a shared page gets its own copy of it first, and pages no sequence holds any more are
        freed. Raises ``ValueError`` and changes nothing when an index is out of range.
        """
        indices = check_sequence_indices(indices, self.batch_size)
        idx = torch.tensor(indices, dtype=torch.int64)
        self._select(idx)

    @_host_synced
    def reset(self) -> None:
        """Empty every sequence and return every page to the pool."""
        self._reset_pages()
        self._lengths = [0] * self.batch_size
        self._keep_block = [0] * self.batch_size
        self.seq_lens.zero_()

    @_host_synced
    def __repr__(self) -> str:
        kind = "dense" if self.dense else ("S2" if self.kv_efficient else "no eviction")
        return (
            f"{type(self).__name__}({kind}, batch={self.batch_size}, kv_heads={self.num_kv_heads}, "
            f"dim={self.head_dim}, block={self.block_size}, pages={self.live_pages}/"
            f"{self.num_pages}, lengths={self._lengths})"
        )
