"""A model's KV caches: one paged cache per attention layer, with the memory summed over layers."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from ..pattern import BlockPattern
from .cache import PagedKVCache
from .cache_factory import paged_kv_cache

__all__ = ["ModelKVCache"]


class ModelKVCache:
    """One :class:`~.cache.PagedKVCache` per attention layer, with the memory summed over layers.

    Args:
        patterns: per layer, its pattern or None for a dense layer (an HHST model: the first few
            layers dense, the rest S2).
        Every other argument is passed to :func:`~.cache_factory.paged_kv_cache` for each layer,
        whose keywords these are (``static`` included).

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
        static: bool = False,
    ):
        if len(patterns) == 0:
            raise ValueError("patterns must name at least one layer")
        self.layers = [
            paged_kv_cache(
                p,
                batch_size=batch_size,
                num_kv_heads=num_kv_heads,
                head_dim=head_dim,
                dtype=dtype,
                device=device,
                max_seq_len=max_seq_len,
                block_size=block_size,
                num_pages=num_pages,
                static=static,
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
