"""The evicting, paged KV cache of one attention layer, and a container for a model's layers.

Storage is a pool of pages. A page holds the keys (and, in a twin pool, the values) of
``block_size`` consecutive positions of one (sequence, KV head): one pattern block. A page table
(batch, kv_heads, max_blocks) of int32 maps every KV block to its page, -1 when absent, and a free
list hands pages freed anywhere in the batch to whichever sequence needs one next.

Eviction. Before new tokens are written, each sequence names the first position whose queries
will still read the cache (``keep_from``); the layer's :class:`~.eviction.EvictionSchedule` says
which stored blocks no such query reads (their pages are freed) and which new blocks none reads
(they are never stored). For S2 patterns what stays is what the pattern still needs, within one
block per head.

Beam search. :meth:`PagedKVCache.select_sequences` makes sequences copies of others (a reorder,
a repeat, a selection) that share their pages: each page counts the table entries that hold it
and returns to the free list when the count drops to zero, and a sequence about to write into a
shared page gets its own copy of it first.

Pool size. The default pool holds what the pattern keeps for every sequence at once, however the
cache is filled (decode steps, one long append, a prefill of the whole length); an append that a
smaller pool cannot hold raises before changing anything, naming the pages it needs.

Bookkeeping (lengths, page table, free list) lives on the host and is mirrored to the device
only when it changes, i.e. when a sequence enters a new block: a decode step within a block costs
no host-device synchronisation. A static cache's decode steps may also run as one operator of
device work inside a compiled graph (``s2attn.inference.decode_op``); those advance only the
device's lengths, and the host's catch up (one sync) at the next call that reads them.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator, Sequence

import torch

from ..layout import DecodeLayout, decode_layout, dense_decode_layout
from ..ops.dispatch import supports_triton
from ..ops.triton import decode as triton_decode
from ..ops.triton.page_write import write_pages
from ..pattern import BlockPattern
from ..validation import check_cu_seqlens, check_int, check_tensor
from .eviction import EvictionSchedule

__all__ = ["DECODE_STEP_TOKENS", "ModelKVCache", "PagedKVCache"]


_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# (sequence, head, block, page) of no page at all; pages are int32, as in the page table
_NO_PAGES = (
    *(torch.zeros(0, dtype=torch.int64) for _ in range(3)),
    torch.zeros(0, dtype=torch.int32),
)
# Appends of more (token, KV head) rows than this are prefills: they filter unstored rows.
_FILTER_WRITES_ABOVE = 4096
# Batched appends of at most this many tokens per sequence (decode steps) write with one kernel.
_KERNEL_WRITES_UP_TO = 16
# Appends of at most this many tokens per sequence are decode steps: by default their own queries
# read the cache (sparse_attention_with_kvcache's decode path takes up to as many).
DECODE_STEP_TOKENS = 16


def _pool_device(device: torch.device | str | None) -> torch.device:
    """The page pools' device: ``device``, or when None the current GPU if CUDA is available,
    else the CPU. A pattern is host metadata and names no device, so it cannot decide."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device must name a torch device, got {device!r}") from exc
    if device.type == "cuda":
        # Checked here: torch's own error comes at the first allocation, as an AssertionError.
        if not torch.cuda.is_available():
            raise ValueError(
                f"device={str(device)!r}, but CUDA is not available here: pass device='cpu', or "
                "leave device out to get the GPU when there is one and the CPU otherwise"
            )
        if device.index is None:
            # Tensors report cuda:N; compare like with like.
            device = torch.device("cuda", torch.cuda.current_device())
    return device


def _host_synced(method):
    """Run :meth:`PagedKVCache.catch_up` first: the method reads the host bookkeeping, which
    compiled decode steps leave behind the device's."""

    @functools.wraps(method)
    def synced(self, *args, **kwargs):
        self.catch_up()
        return method(self, *args, **kwargs)

    return synced


class PagedKVCache:
    """Paged K/V storage of one attention layer that frees what its pattern never reads again.

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
        static: give every (sequence, KV head, block) a fixed page, decided here from the
            pattern, so that no step changes the page table: a decode step is then only device
            work on tensors updated in place (the page write, the decode kernel, the lengths),
            which a CUDA graph captures and replays as sequences grow. Blocks read only near
            their own position share a ring of pages, reused as the window moves; blocks read
            longer (stripes, and everything of a dense layer) get a page each. The pool holds
            about what the dynamic cache peaks at (see :meth:`static_plan`); ``num_pages`` is
            not taken. Appends must be decode steps or keep only what later queries read (as
            ``sparse_attention_with_kvcache`` does); beam reorders keep the batch size.

    Attributes read by the kernels: ``k_pages``/``v_pages`` (num_pages + 1, block_size, head_dim),
    whose last page absorbs writes that are not stored; ``page_table`` int32 (batch, kv_heads,
    max_blocks); ``seq_lens`` int32 (batch,). ``eviction``: the :class:`EvictionSchedule` that
    decides which pages to free and which blocks to store.

    Example::

        >>> pattern = s2attn.local_stride_pattern(
        ...     32, max_seq_len=131072, block_size=64, local_blocks=16, vert_stride=64,
        ...     num_kv_heads=8
        ... )
        >>> cache = s2attn.PagedKVCache(pattern, batch_size=16, num_kv_heads=8, head_dim=128,
        ...                             dtype=torch.bfloat16, device="cuda")
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
        static: bool = False,
    ):
        batch_size = check_int("batch_size", batch_size)
        num_kv_heads = check_int("num_kv_heads", num_kv_heads)
        head_dim = check_int("head_dim", head_dim)
        if max_seq_len is not None:
            max_seq_len = check_int("max_seq_len", max_seq_len)
        if dtype not in _SUPPORTED_DTYPES:
            raise TypeError(f"dtype must be float16, bfloat16 or float32, got {dtype}")
        if pattern is None:
            if block_size is None or max_seq_len is None:
                raise ValueError("a dense cache (pattern=None) needs block_size and max_seq_len")
            block_size = check_int("block_size", block_size, 16)
            if block_size & (block_size - 1):
                raise ValueError(f"block_size must be a power of two, got {block_size}")
        else:
            if not isinstance(pattern, BlockPattern):
                raise TypeError(
                    f"pattern must be an s2attn.BlockPattern or None, got {type(pattern).__name__}"
                )
            if not pattern.causal:
                raise ValueError("a KV cache needs a causal pattern, got causal=False")
            if pattern.num_heads % num_kv_heads:
                raise ValueError(
                    f"the pattern's {pattern.num_heads} heads are not a multiple of "
                    f"num_kv_heads ({num_kv_heads})"
                )
            if block_size is not None and block_size != pattern.block_size:
                raise ValueError(
                    f"block_size={block_size} differs from the pattern's {pattern.block_size}"
                )
            block_size = pattern.block_size
            if max_seq_len is None:
                max_seq_len = pattern.max_seq_len
            elif max_seq_len > pattern.max_seq_len:
                raise ValueError(
                    f"max_seq_len={max_seq_len} exceeds the pattern's {pattern.max_seq_len}"
                )
        max_seq_len = check_int("max_seq_len", max_seq_len)

        self.pattern = pattern
        self.batch_size = batch_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = _pool_device(device)
        self.block_size = block_size
        self.max_seq_len = max_seq_len
        self.max_blocks = nb = math.ceil(max_seq_len / block_size)
        self.eviction = EvictionSchedule(pattern, num_kv_heads, nb)
        if not isinstance(static, bool):
            raise TypeError(f"static must be a bool, got {static!r}")
        self.static = static
        if static:
            if num_pages is not None:
                raise ValueError("a static cache sizes its own pool: leave num_pages out")
            self._ring, slots, static_pages = self._static_slots()
            num_pages = batch_size * num_kv_heads * slots

        if num_pages is None:
            num_pages = self.default_num_pages()
        self.num_pages = num_pages = check_int("num_pages", num_pages)
        # One extra page at the end takes the writes of blocks that are not stored.
        shape = (num_pages + 1, block_size, head_dim)
        self.k_pages = torch.zeros(shape, dtype=dtype, device=self.device)
        self.v_pages = torch.zeros(shape, dtype=dtype, device=self.device)
        self.page_table = torch.full(
            (batch_size, num_kv_heads, nb), -1, dtype=torch.int32, device=self.device
        )
        self.seq_lens = torch.zeros(batch_size, dtype=torch.int32, device=self.device)
        self._table = torch.full((batch_size, num_kv_heads, nb), -1, dtype=torch.int32)
        self._free = torch.arange(num_pages - 1, -1, -1, dtype=torch.int32)  # a stack
        self._num_free = num_pages
        # Sequences share pages after a reorder (beam search): each page counts its table entries,
        # and returns to the free list when the count drops to zero.
        self._refs = torch.zeros(num_pages, dtype=torch.int32)
        self._shared = False  # whether any page may be shared: only then is copy-on-write checked
        self._lengths = [0] * batch_size
        # Per sequence: the query block from which on its queries still read the cache.
        self._keep_block = [0] * batch_size
        self._layout: DecodeLayout | None = None
        self._list_lengths: list[int] = []  # the layout's list_lengths, as host ints
        self._split_counters: torch.Tensor | None = None
        # Tokens per step of compiled decode steps (s2attn.inference.decode_op), set once one is
        # traced: those advance the device's lengths alone, and catch_up brings the host's along.
        self._device_step: int | None = None
        if static:
            # (sequence, KV head) pairs own consecutive runs of `slots` pages.
            owner = torch.arange(batch_size * num_kv_heads, dtype=torch.int32)
            base = owner.view(batch_size, num_kv_heads, 1) * slots
            table = torch.where(static_pages >= 0, static_pages + base, -1)
            self._table.copy_(table)
            self.page_table.copy_(table.to(self.device))
            self._free = self._free[:0]
            self._num_free = 0
            self._last_use = self.eviction.last_use.to(self.device)

    def _static_slots(self) -> tuple[int, int, torch.Tensor]:
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
        """A static cache's page plan: ``ring`` pages per (sequence, KV head) shared by the blocks
        read only near their own position, ``pages_per_head`` in all, and the pool's
        ``num_pages``."""
        if not self.static:
            raise ValueError("static_plan describes a static cache (static=True)")
        per_head = self.num_pages // (self.batch_size * self.num_kv_heads)
        return {"ring": self._ring, "pages_per_head": per_head, "num_pages": self.num_pages}

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

    def catch_up(self) -> None:
        """Bring the host bookkeeping up to the device's lengths after compiled decode steps
        (``s2attn.inference.decode_op``), which advance only the device's: one host sync, and
        nothing at all for a cache no compiled step ran on. Public methods call it first."""
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

    @property
    def live_pages(self) -> int:
        return self.num_pages - self._num_free

    @property
    def page_bytes(self) -> int:
        """Bytes of one page of K plus its page of V."""
        return 2 * self.block_size * self.head_dim * self.k_pages.element_size()

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
            "free_pages": self._num_free,
            "tokens": sum(self._lengths),
        }

    @property
    def decode_layout(self) -> DecodeLayout:
        """The decode kernel's lists for this cache's pattern, built once on its device."""
        if self._layout is None:
            if self.dense:
                layout = dense_decode_layout(
                    self.block_size, self.num_kv_heads, self.max_blocks, self.device
                )
            else:
                layout = decode_layout(self.pattern, self.num_kv_heads, self.device)
            self._list_lengths = layout.list_lengths.tolist()
            self._layout = layout
        return self._layout

    @property
    def split_counters(self) -> torch.Tensor:
        """The decode kernel's count of finished splits per (sequence, KV head), zero between
        launches. One per cache: its steps launch in order on one stream, so they can share it."""
        if self._split_counters is None:
            n = self.batch_size * self.num_kv_heads
            self._split_counters = torch.zeros(n, dtype=torch.int32, device=self.device)
        return self._split_counters

    @_host_synced
    def decode_num_splits(self, num_new: int) -> int:
        """Programs per (sequence, KV head) for a decode step of ``num_new`` tokens whose keys
        are in the cache already: from the longest list the step's query blocks walk (host data,
        no sync)."""
        layout = self.decode_layout
        bs, lists = self.block_size, self._list_lengths
        longest = max(lists[(n - num_new) // bs] for n in self._lengths)
        return triton_decode.decode_num_splits(
            self.batch_size, layout.num_kv_heads, longest, self.device
        )

    # --------------------------------------------------------------------------- writes
    def _new_token_counts(
        self, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor | None
    ) -> list[int]:
        for name, t in (("k", k), ("v", v)):
            check_tensor(name, t)
            if t.dtype != self.dtype:
                raise TypeError(f"{name} has dtype {t.dtype} but the cache holds {self.dtype}")
            if t.device != self.device:
                raise ValueError(f"{name} is on {t.device} but the cache is on {self.device}")
        if k.shape != v.shape:
            raise ValueError(f"k and v differ in shape: {tuple(k.shape)} vs {tuple(v.shape)}")
        tail = (self.num_kv_heads, self.head_dim)
        if cu_seqlens is None:
            if k.dim() != 4 or k.shape[0] != self.batch_size or tuple(k.shape[2:]) != tail:
                raise ValueError(
                    f"k must be (batch={self.batch_size}, num_new, kv_heads={tail[0]}, "
                    f"dim={tail[1]}), got {tuple(k.shape)}; packed inputs need cu_seqlens"
                )
            return [k.shape[1]] * self.batch_size
        if k.dim() != 3 or tuple(k.shape[1:]) != tail:
            raise ValueError(
                f"packed k must be (total, kv_heads={tail[0]}, dim={tail[1]}), got {tuple(k.shape)}"
            )
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
                ``DECODE_STEP_TOKENS`` new tokens per sequence, whose queries then read the
                cache), and to each sequence's new end for a longer append (filling the cache:
                only later queries read it), so one append of ``max_seq_len`` tokens fits the
                default pool. Pass each sequence's first new position to keep a long append
                whole for its own queries; the pool must then hold it.

        Raises ``RuntimeError`` naming the pages needed when the pool cannot hold what the append
        keeps; the cache is then left as it was.
        """
        counts = self._new_token_counts(k, v, cu_seqlens)
        old = self._lengths
        new = [a + n for a, n in zip(old, counts)]
        if max(new) > self.max_seq_len:
            b = max(range(self.batch_size), key=new.__getitem__)
            raise ValueError(
                f"sequence {b} would hold {new[b]} tokens, past the cache's max_seq_len "
                f"{self.max_seq_len}"
            )
        if keep_from is None:
            keep_from = old if max(counts) <= DECODE_STEP_TOKENS else new
        else:
            self._check_keep_from(keep_from, new)
        bs = self.block_size
        keep_block = [max(pos // bs, kb) for pos, kb in zip(keep_from, self._keep_block)]

        if self.static:
            self._append_static(k, v, counts, cu_seqlens, old, new, keep_block)
            return
        if keep_block == self._keep_block and not self._shared and self._within_blocks(old, new):
            # Most decode steps: no block entered, none left behind, no page shared. Nothing to
            # plan, so write at once (the host work here is paid on every layer of every token).
            self._store(k, v, counts, cu_seqlens, new, keep_block)
            return
        # Plan everything before changing anything, so a pool too small leaves the cache as it was.
        evict_seq, evict_heads, evict_blk, released = self._evictions(keep_block)
        seq, heads, blk = self._allocations(old, new, keep_block)
        freed = self._would_free(released).numel()
        copies = self._copies_on_write(old, new, released)
        needed = seq.numel() + copies[0].numel()
        if needed > self._num_free + freed:
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
            self._release(released)
            self._table[evict_seq, evict_heads, evict_blk] = -1
            changed.append((evict_seq * h + evict_heads) * nb + evict_blk)
        if copies[0].numel():
            self._copy_pages(*copies, changed)
        if seq.numel():
            pages = self._pop_free(seq.numel())
            self._table[seq, heads, blk] = pages
            self._refs[pages.long()] = 1
            changed.append((seq * h + heads) * nb + blk)
        if changed:
            idx = torch.cat(changed)
            self.page_table.view(-1)[self._upload(idx)] = self._upload(self._table.view(-1)[idx])
        self._store(k, v, counts, cu_seqlens, new, keep_block)

    def _check_keep_from(self, keep_from: Sequence[int], new: list[int]) -> None:
        if len(keep_from) != self.batch_size:
            raise ValueError(f"keep_from needs one position per sequence, got {len(keep_from)}")
        for b, pos in enumerate(keep_from):
            if not isinstance(pos, int) or not 0 <= pos <= new[b]:
                raise ValueError(
                    f"keep_from[{b}] must be an integer in [0, {new[b]}] (the sequence's new "
                    f"length), got {pos!r}"
                )

    def _within_blocks(self, old: list[int], new: list[int]) -> bool:
        """Whether every sequence's new tokens fall in the block that already holds its last
        token (or it has none): then no page is allocated."""
        bs = self.block_size
        return all(a == n or (a % bs and (n - 1) // bs == a // bs) for a, n in zip(old, new))

    def _store(self, k, v, counts, cu_seqlens, new, keep_block) -> None:
        """Write the new tokens and take the new lengths, on the host and the device."""
        self._write(k, v, counts, cu_seqlens, keep_block if self.static else None)
        self._lengths = new
        self._keep_block = keep_block
        if cu_seqlens is None:
            self.seq_lens += counts[0]
        else:
            self.seq_lens += self._upload(torch.tensor(counts, dtype=torch.int32))

    @_host_synced
    def advance(self, num_new: int) -> None:
        """Account on the host for a decode step of ``num_new`` tokens per sequence whose device
        work (page write, lengths) already ran: a step replayed from a CUDA graph (static caches
        only; see :func:`s2attn.capture_decode_step`, which calls this on every replay)."""
        if not self.static:
            raise ValueError("advance is for static caches (static=True), whose table is fixed")
        check_int("num_new", num_new)
        if num_new > DECODE_STEP_TOKENS:
            raise ValueError(f"num_new must be a decode step (<= {DECODE_STEP_TOKENS} tokens)")
        new = [n + num_new for n in self._lengths]
        if max(new) > self.max_seq_len:
            raise ValueError(
                f"a sequence would hold {max(new)} tokens, past the cache's max_seq_len "
                f"{self.max_seq_len}"
            )
        bs = self.block_size
        self._keep_block = [max(n // bs, k) for n, k in zip(self._lengths, self._keep_block)]
        self._lengths = new

    def _append_static(self, k, v, counts, cu_seqlens, old, new, keep_block) -> None:
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
        self._store(k, v, counts, cu_seqlens, new, keep_block)

    def _upload(self, t: torch.Tensor) -> torch.Tensor:
        """A host tensor on the cache's device without stalling the host: a copy from pageable
        memory waits for the GPU to finish all queued work (every new block of a decode step
        would stall the pipeline), one from pinned memory is queued like a kernel. The pinned
        buffer comes from PyTorch's caching host allocator, which keeps it until the copy ran."""
        if self.device.type != "cuda":
            return t.to(self.device)
        return t.pin_memory().to(self.device, non_blocking=True)

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
        seq, heads, blocks, pages = (torch.cat(t) for t in zip(*parts))
        order = torch.argsort(seq, stable=True)  # the pool's free list takes them in this order
        return seq[order], heads[order], blocks[order], pages[order]

    def _allocations(
        self, old: list[int], new: list[int], keep_block: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(sequence, head, block) of every block the new tokens enter that some query from the
        keep block on reads: each needs a page."""
        bs = self.block_size
        seqs, blocks = [], []
        for b, (a, n) in enumerate(zip(old, new)):
            if n == a:
                continue
            # The block holding position `a` already exists when `a` is inside it.
            first = a // bs if a % bs == 0 else a // bs + 1
            last = (n - 1) // bs
            if first <= last:
                seqs.append(torch.full((last - first + 1,), b, dtype=torch.int64))
                blocks.append(torch.arange(first, last + 1))
        if not seqs:
            empty = torch.zeros(0, dtype=torch.int64)
            return empty, empty, empty
        seq, blk = torch.cat(seqs), torch.cat(blocks)
        keep = torch.tensor(keep_block, dtype=torch.int64)[seq]
        want = self.eviction.read_from(keep, blk).T  # (entries, kv_heads)
        want &= self._table[seq, :, blk] < 0
        rows, heads = want.nonzero(as_tuple=True)
        return seq[rows], heads, blk[rows]

    def default_num_pages(self) -> int:
        """The default pool: the most the pattern keeps at once for ``batch_size`` sequences of
        up to ``max_seq_len`` tokens, decoded or filled by appends of any length."""
        return self.batch_size * self.eviction.peak_blocks_per_sequence()

    def _would_free(self, pages: torch.Tensor) -> torch.Tensor:
        """The pages among ``pages`` (with repeats) whose count dropping by one per mention
        frees them."""
        if not self._shared:  # each page has one holder: skip the host work on the decode path
            return pages.long()
        unique, mentions = pages.long().unique(return_counts=True)
        return unique[self._refs[unique] == mentions]

    def _release(self, pages: torch.Tensor) -> None:
        """Drop one reference per mention in ``pages``; free those no sequence holds any more."""
        if pages.numel() == 0:
            return
        gone = self._would_free(pages)
        self._refs.index_add_(0, pages.long(), torch.full_like(pages, -1))
        self._push_free(gone.to(torch.int32))

    def _copies_on_write(
        self, old: list[int], new: list[int], released: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(sequence, head, block) of the shared pages the new tokens write into (the block
        holding each sequence's old end), counted after this append's evictions."""
        empty = torch.zeros(0, dtype=torch.int64)
        if not self._shared:
            return empty, empty, empty
        refs = self._refs.clone()
        refs.index_add_(0, released.long(), torch.full_like(released, -1))
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

    def _copy_pages(
        self, seq: torch.Tensor, heads: torch.Tensor, blk: torch.Tensor, changed: list
    ) -> None:
        """Give each (sequence, head, block) its own copy of the shared page it holds there."""
        src = self._table[seq, heads, blk]
        dst = self._pop_free(seq.numel())
        self._refs.index_add_(0, src.long(), torch.full_like(src, -1))
        self._refs[dst.long()] = 1
        self._table[seq, heads, blk] = dst
        s, d = self._upload(src.long()), self._upload(dst.long())
        self.k_pages[d] = self.k_pages[s]
        self.v_pages[d] = self.v_pages[s]
        changed.append((seq * self.num_kv_heads + heads) * self.max_blocks + blk)

    def _pop_free(self, n: int) -> torch.Tensor:
        self._num_free -= n
        return self._free[self._num_free : self._num_free + n].clone()

    def _push_free(self, pages: torch.Tensor) -> None:
        n = pages.numel()
        self._free[self._num_free : self._num_free + n] = pages
        self._num_free += n

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
        """Flat pool rows (tokens, kv_heads) of each token's K/V, and whether it is stored.

        A static cache's table names a page for every block, also those whose ring page has
        moved on to a newer block: there a block is stored only while a query from the
        sequence's keep block on (``keep_block``, default: the current one) reads it."""
        bs = self.block_size
        heads = torch.arange(self.num_kv_heads, device=self.device)
        blk = (pos // bs)[:, None]
        pages = self.page_table[seq[:, None], heads[None, :], blk].to(torch.int64)
        stored = pages >= 0
        if self.static:
            keep = self._keep_block if keep_block is None else keep_block
            keep = torch.tensor(keep, dtype=torch.int64, device=self.device)[seq]
            stored &= self._last_use[heads[None, :], blk] >= keep[:, None]
        rows = torch.where(stored, pages * bs + (pos % bs)[:, None], self.num_pages * bs)
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
        if (
            cu_seqlens is None
            and counts[0] <= _KERNEL_WRITES_UP_TO
            and supports_triton(self.device)
        ):
            # A decode step: one launch (self.seq_lens still holds the old lengths).
            write_pages(k, v, self.k_pages, self.v_pages, self.page_table, self.seq_lens)
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
        if len(lengths) != self.batch_size or any(
            not 0 <= n <= m for n, m in zip(lengths, self._lengths)
        ):
            raise ValueError(
                f"lengths must give 0 <= n <= the held length per sequence "
                f"({self._lengths}), got {lengths}"
            )
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
        bs = self.block_size
        if self.static and self._ring:
            for b, n in enumerate(self._lengths):
                # Ring pages of blocks a query there reads hold newer blocks once the sequence
                # has gone two blocks past.
                if n and (n - 1) // bs > (n - num_tokens) // bs + 1:
                    raise ValueError(
                        f"cannot crop sequence {b} to {n - num_tokens} tokens: a static cache's "
                        "ring pages of the blocks its queries there read hold newer blocks (it "
                        f"can be cropped to {((n - 1) // bs - 1) * bs} tokens or more)"
                    )
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
        bs, h, nb = self.block_size, self.num_kv_heads, self.max_blocks
        new = [n - num_tokens for n in self._lengths]
        if self.static:  # the table stays: the pages of dropped tokens are written again later
            self._lengths = new
            self.seq_lens -= num_tokens
            return
        changed = []
        for b, n in enumerate(new):
            first_gone = math.ceil(n / bs)
            table = self._table[b, :, first_gone:]
            heads, blocks = (table >= 0).nonzero(as_tuple=True)
            if heads.numel():
                self._release(table[heads, blocks].clone())
                table[heads, blocks] = -1
                changed.append((b * h + heads) * nb + blocks + first_gone)
        if changed:
            idx = torch.cat(changed)
            self.page_table.view(-1)[self._upload(idx)] = -1
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
        if isinstance(indices, torch.Tensor):
            if indices.dim() != 1 or indices.dtype.is_floating_point or indices.is_complex():
                raise ValueError(
                    f"indices must be a 1-D integer tensor, got {indices.dtype} of shape "
                    f"{tuple(indices.shape)}"
                )
            indices = indices.tolist()
        indices = list(indices)
        if not indices or any(
            not isinstance(i, int) or not 0 <= i < self.batch_size for i in indices
        ):
            raise ValueError(
                f"indices must be a non-empty list of sequences in [0, {self.batch_size}), "
                f"got {indices}"
            )
        idx = torch.tensor(indices, dtype=torch.int64)
        if self.static:
            self._select_static(idx)
            return
        table = self._table[idx].contiguous()
        held = table[table >= 0].long()
        refs = torch.bincount(held, minlength=self.num_pages).to(torch.int32)
        free = (refs == 0).nonzero().squeeze(1).flip(0).to(torch.int32)
        self._refs = refs
        self._shared = bool((refs > 1).any())
        self._free[: free.numel()] = free
        self._num_free = free.numel()
        self._table = table
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

    def _select_static(self, idx: torch.Tensor) -> None:
        # Each sequence owns a fixed run of pages: copy the runs (no sharing, no table change).
        if len(idx) != self.batch_size:
            raise ValueError(
                f"a static cache keeps its batch size ({self.batch_size}); got "
                f"{len(idx)} indices (build it with the batch size it will hold)"
            )
        on_device = idx.to(self.device)
        for pages in (self.k_pages, self.v_pages):
            runs = pages[:-1].view(self.batch_size, -1, *pages.shape[1:])
            runs.copy_(runs[on_device])
        self._lengths = [self._lengths[i] for i in idx.tolist()]
        self._keep_block = [self._keep_block[i] for i in idx.tolist()]
        self.seq_lens.copy_(self.seq_lens[on_device])

    @_host_synced
    def reset(self) -> None:
        """Empty every sequence and return every page to the pool."""
        if self.static:  # the table stays; new tokens overwrite the pages
            self._lengths = [0] * self.batch_size
            self._keep_block = [0] * self.batch_size
            self.seq_lens.zero_()
            return
        self._table.fill_(-1)
        self.page_table.fill_(-1)
        self._free = torch.arange(self.num_pages - 1, -1, -1, dtype=torch.int32)
        self._num_free = self.num_pages
        self._refs.zero_()
        self._shared = False
        self._lengths = [0] * self.batch_size
        self._keep_block = [0] * self.batch_size
        self.seq_lens.zero_()

    @_host_synced
    def __repr__(self) -> str:
        kind = "dense" if self.dense else ("S2" if self.kv_efficient else "no eviction")
        return (
            f"PagedKVCache({kind}, batch={self.batch_size}, kv_heads={self.num_kv_heads}, "
            f"dim={self.head_dim}, block={self.block_size}, pages={self.live_pages}/"
            f"{self.num_pages}, lengths={self._lengths})"
        )


class ModelKVCache:
    """One :class:`PagedKVCache` per attention layer, with the memory summed over layers.

    Args:
        patterns: per layer, its pattern or None for a dense layer (an HHST model: the first few
            layers dense, the rest S2).
        Every other argument is passed to each layer's :class:`PagedKVCache`.

    Example::

        >>> s2 = s2attn.local_stride_pattern(
        ...     32, max_seq_len=32768, block_size=64, local_blocks=16, vert_stride=16,
        ...     num_kv_heads=8
        ... )
        >>> caches = s2attn.ModelKVCache([None, None] + [s2] * 14, batch_size=1, num_kv_heads=8,
        ...                              head_dim=128, max_seq_len=32768, block_size=64)
        >>> caches[5].append(k, v)
    """

    def __init__(
        self,
        patterns: Sequence[BlockPattern | None],
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
        if len(patterns) == 0:
            raise ValueError("patterns must name at least one layer")
        self.layers = [
            PagedKVCache(
                p,
                batch_size=batch_size,
                num_kv_heads=num_kv_heads,
                head_dim=head_dim,
                dtype=dtype,
                device=device,
                max_seq_len=max_seq_len,
                block_size=block_size,
                num_pages=num_pages,
            )
            for p in patterns
        ]

    def __len__(self) -> int:
        return len(self.layers)

    def __getitem__(self, index: int) -> PagedKVCache:
        return self.layers[index]

    def __iter__(self) -> Iterator[PagedKVCache]:
        return iter(self.layers)

    def live_bytes(self) -> int:
        return sum(layer.live_bytes() for layer in self.layers)

    def capacity_bytes(self) -> int:
        return sum(layer.capacity_bytes() for layer in self.layers)

    def dense_bytes(self) -> int:
        return sum(layer.dense_bytes() for layer in self.layers)

    def memory_report(self) -> dict[str, int]:
        """The layers' :meth:`PagedKVCache.memory_report` entries, summed."""
        total: dict[str, int] = {}
        for layer in self.layers:
            for key, value in layer.memory_report().items():
                total[key] = total.get(key, 0) + value
        return total

    def crop(self, num_tokens: int) -> None:
        """Every layer's :meth:`PagedKVCache.crop`; when one layer cannot, none is cropped."""
        for layer in self.layers:
            layer.check_crop(num_tokens)
        for layer in self.layers:
            layer.crop(num_tokens)

    def reset(self) -> None:
        for layer in self.layers:
            layer.reset()
