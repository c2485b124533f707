"""What a call of :func:`.context_parallel_attention` moves and holds, in
bytes, per rank, from each rank's own receive plan; and an all-gather's, to compare."""

from __future__ import annotations

import torch

from ..pattern import BlockPattern
from .plan import receive_plan

__all__ = [
    "communication_bytes",
    "context_parallel_bytes",
    "context_parallel_kv_bytes",
    "rank_bytes_received",
    "rank_kv_bytes",
]


def rank_bytes_received(
    pattern: BlockPattern,
    batch: int,
    seq: int,
    kv_heads: int,
    dim: int,
    itemsize: int,
    world: int,
    rank: int,
) -> int:
    """Bytes of K and V rank ``rank`` receives in one forward, from its own receive plan."""
    received = receive_plan(pattern, seq, world, rank, kv_heads).tokens_received()
    return 2 * batch * dim * itemsize * received


def rank_kv_bytes(
    pattern: BlockPattern,
    batch: int,
    seq: int,
    kv_heads: int,
    dim: int,
    itemsize: int,
    world: int,
    rank: int,
) -> int:
    """Bytes of K and V rank ``rank`` holds in one forward, from its own receive plan."""
    if world == 1:  # sparse_attention on the rank's own K and V
        return 2 * batch * seq * kv_heads * dim * itemsize
    plan = receive_plan(pattern, seq, world, rank, kv_heads)
    rows = seq // world * kv_heads + plan.tokens_received() + plan.key_rows()
    return 2 * batch * dim * itemsize * rows


def context_parallel_bytes(
    pattern: BlockPattern,
    batch: int,
    seq: int,
    kv_heads: int,
    dim: int,
    dtype: torch.dtype,
    world_size: int,
) -> list[int]:
    """Bytes of K and V each rank receives in one forward of :func:`.context_parallel_attention`
    (the backward sends as many back): only the tokens its queries read, per KV head. Compare
    with :func:`communication_bytes`, an all-gather's."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    sizes = (pattern, batch, seq, kv_heads, dim, itemsize, world_size)
    return [rank_bytes_received(*sizes, r) for r in range(world_size)]


def context_parallel_kv_bytes(
    pattern: BlockPattern,
    batch: int,
    seq: int,
    kv_heads: int,
    dim: int,
    dtype: torch.dtype,
    world_size: int,
) -> list[int]:
    """Bytes of K and V each rank holds in one forward of :func:`.context_parallel_attention`:
    its shard, the tokens it receives and its two chunks' compact keys (see
    :mod:`s2attn.distributed`). A dense pattern's last chunk needs the whole sequence; an S2
    pattern's, the blocks it reads."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    sizes = (pattern, batch, seq, kv_heads, dim, itemsize, world_size)
    return [rank_kv_bytes(*sizes, r) for r in range(world_size)]


def communication_bytes(
    batch: int, seq: int, kv_heads: int, dim: int, dtype: torch.dtype, world_size: int
) -> int:
    """Bytes each rank would receive for K and V in one forward from an all-gather of the whole
    sequence; :func:`context_parallel_bytes` gives what it does receive."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * batch * seq * kv_heads * dim * itemsize * (world_size - 1) // world_size
