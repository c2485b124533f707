"""The checks at a paged KV cache's boundary: the arguments that build one, the new tokens an
append or a decode step writes, and the arguments of its edits (``keep_from``, a beam reorder's
indices, a gather's lengths). Each raises an exception naming the argument and the value it
expected, before the cache changes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..input_checks import check_int, check_tensor
from ..pattern import BlockPattern

__all__ = [
    "CacheSizes",
    "cache_sizes",
    "check_gather_lengths",
    "check_keep_from",
    "check_new_tokens",
    "check_sequence_indices",
    "pool_device",
]

_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class CacheSizes:
    """A cache's sizes as Python ints, checked against each other and against its pattern."""

    batch_size: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    max_seq_len: int


def cache_sizes(
    pattern: BlockPattern | None,
    *,
    batch_size: object,
    num_kv_heads: object,
    head_dim: object,
    dtype: torch.dtype,
    max_seq_len: object,
    block_size: object,
) -> CacheSizes:
    """The sizes of a cache of ``pattern`` (None: dense) built with these arguments, and a check
    of its pool's ``dtype``: the block size is the pattern's, ``max_seq_len`` defaults to the
    pattern's; a dense cache needs both."""
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
        _check_pattern(pattern, num_kv_heads)
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
    return CacheSizes(batch_size, num_kv_heads, head_dim, block_size, max_seq_len)


def _check_pattern(pattern: object, num_kv_heads: int) -> None:
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


def pool_device(device: torch.device | str | None) -> torch.device:
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


def check_new_tokens(
    k: object,
    v: object,
    k_pages: torch.Tensor,
    page_table: torch.Tensor,
    cu_seqlens: torch.Tensor | None,
) -> None:
    """Check new keys and values against a cache of these pages and page table: its dtype and
    device, (batch, num_new, kv_heads, dim), or packed (total, kv_heads, dim) with
    ``cu_seqlens``. The cache's facts come from its tensors, which a compiled graph guards on
    anyway, not from its attributes."""
    dtype, device = k_pages.dtype, k_pages.device
    batch, tail = page_table.shape[0], (page_table.shape[1], k_pages.shape[-1])
    for name, t in (("k", k), ("v", v)):
        check_tensor(name, t)
        if t.dtype != dtype:
            raise TypeError(f"{name} has dtype {t.dtype} but the cache holds {dtype}")
        if t.device != device:
            raise ValueError(f"{name} is on {t.device} but the cache is on {device}")
    if k.shape != v.shape:
        raise ValueError(f"k and v differ in shape: {tuple(k.shape)} vs {tuple(v.shape)}")
    if cu_seqlens is None:
        if k.dim() != 4 or k.shape[0] != batch or tuple(k.shape[2:]) != tail:
            raise ValueError(
                f"k must be (batch={batch}, num_new, kv_heads={tail[0]}, dim={tail[1]}), got "
                f"{tuple(k.shape)}; packed inputs need cu_seqlens"
            )
    elif k.dim() != 3 or tuple(k.shape[1:]) != tail:
        raise ValueError(
            f"packed k must be (total, kv_heads={tail[0]}, dim={tail[1]}), got {tuple(k.shape)}"
        )


def check_keep_from(keep_from: Sequence[int], new: list[int]) -> None:
    """``keep_from``: per sequence, a position from 0 to its ``new`` length."""
    if len(keep_from) != len(new):
        raise ValueError(f"keep_from needs one position per sequence, got {len(keep_from)}")
    for b, pos in enumerate(keep_from):
        if not isinstance(pos, int) or not 0 <= pos <= new[b]:
            raise ValueError(
                f"keep_from[{b}] must be an integer in [0, {new[b]}] (the sequence's new "
                f"length), got {pos!r}"
            )


def check_sequence_indices(indices: Sequence[int] | torch.Tensor, batch_size: int) -> list[int]:
    """A beam reorder's ``indices`` (a 1-D integer tensor or a sequence of ints, each a sequence
    of the batch) as a list."""
    if isinstance(indices, torch.Tensor):
        if indices.dim() != 1 or indices.dtype.is_floating_point or indices.is_complex():
            raise ValueError(
                f"indices must be a 1-D integer tensor, got {indices.dtype} of shape "
                f"{tuple(indices.shape)}"
            )
        indices = indices.tolist()
    indices = list(indices)
    if not indices or any(not isinstance(i, int) or not 0 <= i < batch_size for i in indices):
        raise ValueError(
            f"indices must be a non-empty list of sequences in [0, {batch_size}), got {indices}"
        )
    return indices


def check_gather_lengths(lengths: list[int], held: list[int]) -> None:
    """A gather's ``lengths``: per sequence, at most the tokens it holds (``held``)."""
    if len(lengths) != len(held) or any(not 0 <= n <= m for n, m in zip(lengths, held)):
        raise ValueError(
            f"lengths must give 0 <= n <= the held length per sequence ({held}), got {lengths}"
        )
