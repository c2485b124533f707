"""A rank's plan of the exchange: which K/V rows it reads from each rank, and how each of its two
query chunks lays out its compact keys.

Communication. A rank receives only the K/V tokens its queries read, per KV head (the blocks
its two chunks' query blocks keep under that head's pattern heads, up to each chunk's end under a
causal pattern). A rank plans from its own chunks' rows of the pattern alone
(:func:`receive_plan`) and learns what to send from the others' requests, exchanged when the
plan is first built (:func:`exchange_plan`; each call's agreement check tells every rank whether
any lacks its plan, so all build together).

Memory. A rank never lays K and V out over the whole sequence. Each chunk is computed against
*compact* keys: per KV head, the far blocks its heads read (padded with zero blocks to the
longest head's list), then the tokens from the chunk's first block to its end, with the chunk's
rows of the pattern renumbered onto them (:class:`Chunk`).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..pattern import BlockPattern
from .collectives import all_to_all, comm_device

__all__ = [
    "Chunk",
    "ExchangePlan",
    "ReceivePlan",
    "cached_exchange_plan",
    "exchange_plan",
    "receive_plan",
]


def _owners(seq: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For every global position: the rank whose shard holds it, and its index in that shard."""
    chunk = seq // (2 * world)
    pos = torch.arange(seq)
    c = pos // chunk
    late = c >= world
    owner = torch.where(late, 2 * world - 1 - c, c)
    local = pos - c * chunk + late.long() * chunk
    return owner, local


@dataclass(frozen=True)
class _ChunkReads:
    """What one query chunk ``[start, end)`` reads, per KV head ``g``: ``far[g]``, the KV blocks
    outside its own blocks ``[first, last]`` that its pattern heads keep (ascending; under a
    causal pattern only blocks before ``first``), and ``rows[h]``, each walked pattern head's
    (:func:`_walked_heads`) kept (query block, KV block) pairs of the chunk's rows (causally
    visible blocks only)."""

    start: int
    end: int
    first: int
    last: int
    far: list[torch.Tensor]
    rows: list[tuple[torch.Tensor, torch.Tensor]]
    reads_first: list[bool]  # whether KV head g reads block `first` (its tokens before `start`)


def _walked_heads(pattern: BlockPattern, kv_heads: int) -> range:
    """The pattern heads whose rows a chunk's plan walks: all of them, or one per KV head when
    each GQA group's heads share one rule (a builder's pattern with ``num_kv_heads``): the
    compact pattern then has one head per KV head, and the plan costs a group's size less."""
    per_kv = pattern.num_heads // kv_heads
    rules = pattern.rules
    if per_kv > 1 and rules is not None:
        if all(len(set(rules[g * per_kv : (g + 1) * per_kv])) == 1 for g in range(kv_heads)):
            return range(0, pattern.num_heads, per_kv)
    return range(pattern.num_heads)


def _chunk_reads(pattern: BlockPattern, start: int, end: int, kv_heads: int) -> _ChunkReads:
    b = pattern.block_size
    first, last = start // b, (end - 1) // b
    heads = _walked_heads(pattern, kv_heads)
    rows = []
    read = torch.zeros(kv_heads, pattern.num_kv_blocks, dtype=torch.bool)  # per KV head
    for n, h in enumerate(heads):
        i, j = pattern.row_blocks(h, first, last + 1)
        if pattern.causal:  # blocks past the chunk's end are never visible to it
            i, j = i[j <= last], j[j <= last]
        rows.append((i, j))
        read[n // (len(heads) // kv_heads), j] = True
    far = read.clone()
    far[:, first : last + 1] = False
    far = [f.nonzero().flatten() for f in far]
    return _ChunkReads(start, end, first, last, far, rows, read[:, first].tolist())


def _positions_read(reads: _ChunkReads, g: int, block: int, seq: int) -> torch.Tensor:
    """The global key positions a chunk reads under KV head ``g`` outside ``[start, end)``."""
    far = (reads.far[g][:, None] * block + torch.arange(block)).flatten()
    far = far[far < seq]
    if reads.reads_first[g]:  # the first block's tokens before the chunk (an unaligned start)
        far = torch.cat([far, torch.arange(reads.first * block, reads.start)])
    return far


@dataclass(frozen=True)
class Chunk:
    """One of a rank's two query chunks, computed against compact keys: per KV head, the far
    blocks it reads (zero blocks pad every head to the longest list), then every token from the
    chunk's first block's start to its end. Under a causal pattern the far blocks all precede
    the chunk and the tail keeps absolute spacing, so the kernels' causal rule (queries aligned
    bottom-right) is the original one; under a bidirectional one nothing depends on the order.

    ``gather``: (keys, kv_heads) rows of the rank's store (own rows, received rows, a zero row)
    that make up those keys; ``pattern``: the chunk's rows of the pattern over them, in the last
    query rows of a square pattern."""

    start: int
    end: int
    gather: torch.Tensor
    pattern: BlockPattern


@dataclass(frozen=True)
class ReceivePlan:
    """One rank's side of the exchange, which it works out alone: what it reads from each rank
    and how it lays out its keys.

    A rank's *rows* are its shard's (token, KV head) pairs, ``local_index * kv_heads + g``.
    ``requests[s]``: the rows of rank ``s``'s shard this rank reads, by KV head, then position.
    The rank's store is its own rows, then the received ones (by source rank, in request order),
    then one zero row; each chunk's keys gather from it."""

    requests: list[torch.Tensor]
    chunks: tuple[Chunk, Chunk]

    def tokens_received(self) -> int:
        """Token rows (one KV head each) this rank receives, K or V alone."""
        return sum(int(r.numel()) for r in self.requests)

    def key_rows(self) -> int:
        """Rows (token, KV head) of the compact keys of both chunks: what the rank holds of K (or
        V) beyond its own shard and the rows it receives."""
        return sum(c.gather.numel() for c in self.chunks)


@dataclass(frozen=True)
class ExchangePlan:
    """A rank's whole exchange, on its device: ``send``, the rows of its shard the other ranks
    read (their requests), joined by destination rank, ``send_counts[d]`` of them for rank
    ``d``; ``recv[s]``, how many rows it receives from rank ``s``; and its chunks' compact keys.
    Joined once here, so that no call concatenates them again."""

    send: torch.Tensor
    send_counts: list[int]
    recv: list[int]
    chunks: tuple[Chunk, Chunk]


# Per pattern: each rank's receive plans (host) and exchange plans (device), keyed by (seq,
# world, rank, kv_heads[, device]).
_RECEIVE: weakref.WeakKeyDictionary[BlockPattern, dict] = weakref.WeakKeyDictionary()
_PLANS: weakref.WeakKeyDictionary[BlockPattern, dict] = weakref.WeakKeyDictionary()


def receive_plan(
    pattern: BlockPattern, seq: int, world: int, rank: int, kv_heads: int
) -> ReceivePlan:
    """Rank ``rank``'s receive plan, from its own two chunks' rows of the pattern alone."""
    cache = _RECEIVE.setdefault(pattern, {})
    key = (seq, world, rank, kv_heads)
    if key in cache:
        return cache[key]
    chunk = seq // (2 * world)
    reads = [
        _chunk_reads(pattern, c * chunk, (c + 1) * chunk, kv_heads)
        for c in (rank, 2 * world - 1 - rank)
    ]
    owner, local = _owners(seq, world)
    # The store's rows: own rows first, then what each rank sends, by KV head and position.
    row_of = torch.full((kv_heads, seq), -1, dtype=torch.int64)
    mine = (owner == rank).nonzero().flatten()
    for g in range(kv_heads):
        row_of[g, mine] = local[mine] * kv_heads + g
    wanted = []
    for g in range(kv_heads):
        pos = torch.cat([_positions_read(r, g, pattern.block_size, seq) for r in reads]).unique()
        pos = pos[owner[pos] != rank]
        wanted.append([pos[owner[pos] == s] for s in range(world)])
    requests, start = [], seq // world * kv_heads
    for s in range(world):
        for g in range(kv_heads):
            pos = wanted[g][s]
            row_of[g, pos] = start + torch.arange(pos.numel())
            start += pos.numel()
        requests.append(torch.cat([local[wanted[g][s]] * kv_heads + g for g in range(kv_heads)]))
    chunks = tuple(_compact_chunk(pattern, r, row_of, start) for r in reads)
    cache[key] = ReceivePlan(requests, chunks)
    return cache[key]


def _compact_chunk(pattern: BlockPattern, reads: _ChunkReads, row_of: torch.Tensor, zero: int):
    """A :class:`Chunk` from its reads; ``row_of`` (kv_heads, seq): each position's store row
    per KV head, or -1 where the rank has nothing (never read)."""
    b, kv_heads = pattern.block_size, len(reads.far)
    blocks = max(int(f.numel()) for f in reads.far)  # the padded far blocks per KV head
    tail = reads.last - reads.first + 1
    keys = blocks * b + reads.end - reads.first * b
    gather = torch.full((keys, kv_heads), zero, dtype=torch.int64)
    for g, far in enumerate(reads.far):
        pos = torch.cat(
            [
                (far[:, None] * b + torch.arange(b)).flatten(),
                torch.arange(reads.first * b, reads.end),
            ]
        )
        slots = torch.cat([torch.arange(far.numel() * b), torch.arange(blocks * b, keys)])
        rows = row_of[g, pos.clamp(max=row_of.shape[1] - 1)]
        rows = torch.where((pos < row_of.shape[1]) & (rows >= 0), rows, zero)
        gather[slots, g] = rows
    # The chunk's rows over the compact keys: row `first + n` is query block `blocks + n`; a far
    # block maps to its index in its KV head's list, a block of the chunk's own to the tail.
    q_blocks = blocks + tail
    heads = len(reads.rows)  # the compact pattern's: the walked heads
    heads_per_kv = heads // kv_heads
    keys_of = []
    for h, (i, j) in enumerate(reads.rows):
        far = reads.far[h // heads_per_kv]
        own = (j >= reads.first) & (j <= reads.last)
        col = torch.where(own, blocks + j - reads.first, torch.searchsorted(far, j))
        keys_of.append((h * q_blocks + blocks + i - reads.first) * q_blocks + col)
    # By row, then column. Causal rows stay sorted (far blocks precede the chunk and keep their
    # order); a bidirectional row's far blocks past the chunk now precede its own.
    order = torch.cat(keys_of)
    if not pattern.causal:
        order = order.sort().values
    row, col = order // q_blocks, order % q_blocks
    counts = torch.bincount(row, minlength=heads * q_blocks)
    offsets = torch.zeros(counts.numel() + 1, dtype=torch.int64)
    offsets[1:] = counts.cumsum(0)
    compact = BlockPattern.from_block_lists(
        offsets,
        col,
        num_heads=heads,
        num_kv_blocks=q_blocks,
        block_size=b,
        causal=pattern.causal,
    )
    return Chunk(reads.start, reads.end, gather, compact)


def cached_exchange_plan(
    pattern, seq: int, world: int, rank: int, kv_heads: int, device
) -> ExchangePlan | None:
    """The rank's exchange plan if it was built before (see :func:`exchange_plan`), else None."""
    return _PLANS.get(pattern, {}).get(_plan_key(seq, world, rank, kv_heads, device))


def _plan_key(seq: int, world: int, rank: int, kv_heads: int, device) -> tuple:
    return seq, world, rank, kv_heads, str(device)


def exchange_plan(
    pattern: BlockPattern,
    seq: int,
    world: int,
    rank: int,
    kv_heads: int,
    device: torch.device,
    group,
) -> ExchangePlan:
    """The rank's exchange plan, its index tensors on ``device``, built collectively: each rank
    sends every other its requests (one ``all_to_all_single`` of counts, one of rows), so no rank
    walks another's rows of the pattern. Every rank of the group calls it together:
    :func:`.context_parallel_attention` decides by its agreement check, so that a rank holding a
    cached plan still takes part when another does not."""
    mine = receive_plan(pattern, seq, world, rank, kv_heads)
    comm = comm_device(group)
    counts = [int(r.numel()) for r in mine.requests]
    theirs = torch.empty(world, dtype=torch.int64, device=comm)
    dist.all_to_all_single(theirs, torch.tensor(counts, device=comm), group=group)
    sizes = theirs.tolist()
    asked = all_to_all(torch.cat(mine.requests).to(comm), counts, sizes, group)
    plan = ExchangePlan(
        asked.to(device),
        sizes,
        counts,
        tuple(Chunk(c.start, c.end, c.gather.to(device), c.pattern) for c in mine.chunks),
    )
    _PLANS.setdefault(pattern, {})[_plan_key(seq, world, rank, kv_heads, device)] = plan
    return plan
