"""The choice between the two kinds of paged KV cache: :func:`paged_kv_cache`.

It sits above both kinds (and :mod:`.cache`, which they share), so that the shared part never
imports the kinds that build on it.
"""

from __future__ import annotations

import torch

from ..pattern import BlockPattern
from .cache import PagedKVCache
from .dynamic_cache import DynamicKVCache
from .static_cache import StaticKVCache

__all__ = ["paged_kv_cache"]


def paged_kv_cache(
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
) -> PagedKVCache:
    """The paged KV cache of one attention layer, of the kind ``static`` names.

    Args:
        static: False (the default): a :class:`~.dynamic_cache.DynamicKVCache`, which takes and
            frees pages as sequences grow. True: a :class:`~.static_cache.StaticKVCache`, which
            gives every (sequence, KV head, block) a fixed page, decided here from the pattern,
            so that no step changes the page table: a decode step is then only device work on
            tensors updated in place (the page write, the decode kernel, the lengths), which a
            CUDA graph captures and replays as sequences grow. Blocks read only near their own
            position share a ring of pages, reused as the window moves; blocks read longer
            (stripes, and everything of a dense layer) get a page each. The pool holds about
            what the dynamic cache peaks at (see :meth:`StaticKVCache.static_plan`);
            ``num_pages`` is not taken. Appends must be decode steps or keep only what later
            queries read (as ``sparse_attention_with_kvcache`` does); beam reorders keep the
            batch size.
        The others: as :class:`~.cache.PagedKVCache`'s.

    Example::

        >>> cache = s2attn.paged_kv_cache(pattern, batch_size=8, num_kv_heads=8, head_dim=128,
        ...                               device="cuda", static=True)
        >>> type(cache).__name__
        'StaticKVCache'
    """
    if not isinstance(static, bool):
        raise TypeError(f"static must be a bool, got {static!r}")
    kind = StaticKVCache if static else DynamicKVCache
    return kind(
        pattern,
        batch_size=batch_size,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        dtype=dtype,
        device=device,
        max_seq_len=max_seq_len,
        block_size=block_size,
        num_pages=num_pages,
    )
