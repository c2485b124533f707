"""The page pool of one layer's KV cache: the pages, and which of them are held.

A page holds the keys (and, in a twin pool, the values) of ``block_size`` consecutive positions of
one (sequence, KV head). Pages are handed out from a free list (a stack) and counted per holder:
after a beam reorder several page-table entries may hold one page, which returns to the free list
when its count drops to zero, and a holder about to write into a shared page gets a copy of its
own first (copy on write). One extra page past the last takes the writes of blocks that are not
stored, so a write never needs a branch.

The bookkeeping (free list, counts) lives on the host; the pages on the pool's device.
"""

from __future__ import annotations

import torch

__all__ = ["PagePool", "upload"]


def upload(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device`` without stalling the host: a copy from pageable memory waits
    for the GPU to finish all queued work (every new block of a decode step would stall the
    pipeline), one from pinned memory is queued like a kernel. The pinned buffer comes from
    PyTorch's caching host allocator, which keeps it until the copy ran."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


class PagePool:
    """``num_pages`` pages of K and of V, (block_size, head_dim) each, with a free list and a
    holder count per page.

    Attributes read by the kernels: ``k_pages``/``v_pages`` (num_pages + 1, block_size, head_dim);
    the last page (``spare``) absorbs writes that are not stored.

    Example::

        >>> pool = PagePool(8, block_size=16, head_dim=64, dtype=torch.float16, device="cpu")
        >>> pages = pool.take(3)  # each held once
        >>> pool.release(pages[:1])  # its count drops to zero: free again
        >>> pool.num_free
        6
    """

    def __init__(
        self,
        num_pages: int,
        *,
        block_size: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ):
        if not isinstance(num_pages, int) or num_pages < 1:
            raise ValueError(f"num_pages must be a positive integer, got {num_pages!r}")
        self.num_pages = num_pages
        self.device = torch.device(device)
        shape = (num_pages + 1, block_size, head_dim)
        self.k_pages = torch.zeros(shape, dtype=dtype, device=self.device)
        self.v_pages = torch.zeros(shape, dtype=dtype, device=self.device)
        self._free = torch.arange(num_pages - 1, -1, -1, dtype=torch.int32)  # a stack
        self._num_free = num_pages
        self._refs = torch.zeros(num_pages, dtype=torch.int32)
        self._shared = False  # whether any page may have two holders: only then is it checked

    # --------------------------------------------------------------------------- state
    @property
    def spare(self) -> int:
        """The page that takes writes of blocks that are not stored; nothing reads it."""
        return self.num_pages

    @property
    def num_free(self) -> int:
        return self._num_free

    @property
    def live(self) -> int:
        """Pages held by at least one holder."""
        return self.num_pages - self._num_free

    @property
    def shared(self) -> bool:
        """Whether some page may have several holders (copy on write is then checked)."""
        return self._shared

    @property
    def page_bytes(self) -> int:
        """Bytes of one page of K plus its page of V."""
        return 2 * self.k_pages[0].numel() * self.k_pages.element_size()

    def holders(self) -> torch.Tensor:
        """int32 (num_pages,): how many holders each page has (a copy)."""
        return self._refs.clone()

    def free_pages(self) -> list[int]:
        """The free pages, in the order :meth:`take` hands them out last to first."""
        return self._free[: self._num_free].tolist()

    # ------------------------------------------------------------------------ holding
    def take(self, n: int) -> torch.Tensor:
        """``n`` free pages, int32, each now held once. The caller checks :attr:`num_free`."""
        if n > self._num_free:
            raise RuntimeError(f"the page pool has {self._num_free} free pages, {n} asked for")
        self._num_free -= n
        pages = self._free[self._num_free : self._num_free + n].clone()
        self._refs[pages.long()] = 1
        return pages

    def would_free(self, pages: torch.Tensor) -> torch.Tensor:
        """The pages among ``pages`` (with repeats) whose count dropping by one per mention
        frees them."""
        if not self._shared:  # each page has one holder: skip the host work on the decode path
            return pages.long()
        unique, mentions = pages.long().unique(return_counts=True)
        return unique[self._refs[unique] == mentions]

    def release(self, pages: torch.Tensor) -> None:
        """Drop one holder per mention in ``pages``; free those no one holds any more."""
        if pages.numel() == 0:
            return
        gone = self.would_free(pages).to(torch.int32)
        self._refs.index_add_(0, pages.long(), torch.full_like(pages, -1))
        n = gone.numel()
        self._free[self._num_free : self._num_free + n] = gone
        self._num_free += n

    def holders_after(self, released: torch.Tensor) -> torch.Tensor:
        """The holder counts once ``released`` (with repeats) each lost one holder."""
        refs = self._refs.clone()
        refs.index_add_(0, released.long(), torch.full_like(released, -1))
        return refs

    def copy_on_write(self, pages: torch.Tensor) -> torch.Tensor:
        """For each shared page in ``pages``, a fresh page holding a copy of it, which takes over
        one of its holders; returns the fresh pages (int32)."""
        fresh = self.take(pages.numel())
        self._refs.index_add_(0, pages.long(), torch.full_like(pages, -1))
        src, dst = upload(pages.long(), self.device), upload(fresh.long(), self.device)
        self.k_pages[dst] = self.k_pages[src]
        self.v_pages[dst] = self.v_pages[src]
        return fresh

    def hold_exactly(self, held: torch.Tensor) -> None:
        """Recount from scratch: ``held`` lists every holder's page (with repeats); the others
        are free. Pages keep their contents."""
        refs = torch.bincount(held.long(), minlength=self.num_pages).to(torch.int32)
        free = (refs == 0).nonzero().squeeze(1).flip(0).to(torch.int32)
        self._refs = refs
        self._shared = bool((refs > 1).any())
        self._free[: free.numel()] = free
        self._num_free = free.numel()

    def hold_all(self) -> None:
        """Every page held for good (a static cache's fixed plan): nothing is free."""
        self._refs.fill_(1)
        self._num_free = 0
        self._shared = False

    def reset(self) -> None:
        """Every page free again (contents stay; they are written before they are read)."""
        self._free = torch.arange(self.num_pages - 1, -1, -1, dtype=torch.int32)
        self._num_free = self.num_pages
        self._refs.zero_()
        self._shared = False

    def copy_runs(self, sources: torch.Tensor, num_runs: int) -> None:
        """Split the pages (spare aside) into ``num_runs`` equal runs and make run ``i`` a copy of
        run ``sources[i]``, on the device."""
        on_device = sources.to(self.device)
        for pages in (self.k_pages, self.v_pages):
            runs = pages[:-1].view(num_runs, -1, *pages.shape[1:])
            runs.copy_(runs[on_device])
