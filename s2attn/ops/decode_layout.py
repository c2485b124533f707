"""Pattern -> the decode layout: per (KV head, query block), the KV blocks a decode step reads from
a paged KV cache, one list for the query heads of a GQA group; and the GQA group's view of a
pattern that a KV cache's eviction schedule reads.

A decode step has a few new query tokens per sequence (speculative decoding: up to a block's
worth), read against a paged KV cache. One decode program serves one (sequence, KV head): its
rows are the query heads of the GQA group times the new tokens, so each KV page is read once for
the whole group. The new tokens span at most two query blocks, i and i + 1 (block_size >= 16 >=
new tokens), so the list of (KV head, query block i) is the union over the group's pattern heads
and over query blocks i and i + 1, with one bit per (pattern head, i or i + 1) on partial entries.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from ..memory import build_outside_graph_pool
from ..pattern import BlockPattern, check_dense_view
from .layout import MAX_ENTRY_BITS, cache_device, csr_offsets

__all__ = [
    "DecodeLayout",
    "check_kv_heads",
    "decode_layout",
    "dense_decode_layout",
    "group_block_mask",
]


@dataclass(frozen=True)
class DecodeLayout:
    """Per (KV head, query block i): the KV blocks a decode step walks, full apart from partial.

    An entry is *full* when every pattern head of the KV head's group keeps the block for query
    blocks i and i + 1 and the block lies wholly before query block i (no mask at all). The
    others are *partial* and carry ``partial_bits``: bit ``2 * r + d`` is set when pattern head
    ``r`` of the group keeps the block for query block ``i + d``. Partial entries of one list come
    in two runs: first those query block i uses (up to ``partial_mid``), then those only query
    block i + 1 uses, which a step walks only when its new tokens straddle the two blocks.

    ``dense`` layouts list nothing: every block up to the query's is full, the query's own block
    (and the next) partial, and the kernel computes the list from the query position.
    """

    block_size: int
    num_kv_heads: int
    num_q_blocks: int
    heads_per_kv_head: int  # pattern heads per KV head (bit rows); 1 when the group shares one
    dense: bool
    full_offsets: torch.Tensor  # int32 (num_kv_heads * num_q_blocks + 1,)
    full_cols: torch.Tensor  # int32, KV block indices
    partial_offsets: torch.Tensor  # int32 (num_kv_heads * num_q_blocks + 1,)
    partial_mid: torch.Tensor  # int32 (num_kv_heads * num_q_blocks,)
    partial_cols: torch.Tensor  # int32
    partial_bits: torch.Tensor  # int64
    list_lengths: torch.Tensor  # int64 on the CPU (num_q_blocks,): longest list over KV heads

    @property
    def max_seq_len(self) -> int:
        return self.num_q_blocks * self.block_size


def group_block_mask(
    pattern: BlockPattern, num_kv_heads: int, *, max_bytes: int | None = None
) -> torch.Tensor:
    """(num_kv_heads, heads_per_kv_head, q_blocks, kv_blocks): the effective mask per GQA group,
    with the group axis collapsed to 1 when every head of every group shares one pattern.

    What a KV cache sees of a pattern: the decode layout lists it, and the cache's eviction
    schedule (``s2attn.inference.eviction``) reads each KV block's last use from it. Dense, so
    it raises ``ValueError`` before allocating when the view, the visibility mask and the
    comparison of the group's heads (``(2 * heads + 1) * q_blocks * kv_blocks`` bytes) would
    exceed ``max_bytes`` (default :data:`s2attn.pattern.DENSE_VIEW_LIMIT`)."""
    check_kv_heads(pattern, num_kv_heads)
    heads, q_blocks, kv_blocks = pattern.num_heads, pattern.num_q_blocks, pattern.num_kv_blocks
    check_dense_view(
        f"group_block_mask(num_kv_heads={num_kv_heads})",
        (2 * heads + 1) * q_blocks * kv_blocks,
        max_bytes,
        "decode_layout(pattern, num_kv_heads) lists the same blocks in memory proportional to "
        "them, and s2attn.inference.eviction.kv_last_use gives each block's last use",
    )
    m = pattern.effective_block_mask(max_bytes=max_bytes)
    m = m.view(num_kv_heads, heads // num_kv_heads, *m.shape[1:])
    if m.shape[1] > 1 and bool((m == m[:, :1]).all()):
        m = m[:, :1]
    return m


def check_kv_heads(pattern: BlockPattern, num_kv_heads: int) -> None:
    """Raise ``ValueError`` unless a KV cache of ``num_kv_heads`` heads can serve ``pattern``."""
    if not isinstance(num_kv_heads, int) or num_kv_heads < 1:
        raise ValueError(f"num_kv_heads must be a positive integer, got {num_kv_heads!r}")
    if pattern.num_heads % num_kv_heads:
        raise ValueError(
            f"the pattern's {pattern.num_heads} heads are not a multiple of num_kv_heads "
            f"({num_kv_heads}); give one pattern per query head or per KV head"
        )
    if not pattern.causal:
        raise ValueError("decoding and KV caching need a causal pattern, got causal=False")


def _group_heads(pattern: BlockPattern, num_kv_heads: int) -> int:
    """Distinct pattern heads per KV head: the group's heads, or 1 when every head of every group
    keeps the same blocks as its group's first."""
    per = pattern.num_heads // num_kv_heads
    if per == 1:
        return 1
    rows = pattern.num_q_blocks
    offsets, cols = pattern.row_offsets, pattern.cols
    for g in range(num_kv_heads):
        lead = g * per * rows
        first = cols[offsets[lead] : offsets[lead + rows]]
        counts = torch.diff(offsets[lead : lead + rows + 1])
        for r in range(1, per):
            row = lead + r * rows
            if not torch.equal(torch.diff(offsets[row : row + rows + 1]), counts) or not (
                torch.equal(cols[offsets[row] : offsets[row + rows]], first)
            ):
                return per
    return 1


def _build_decode(pattern: BlockPattern, num_kv_heads: int, device: torch.device) -> DecodeLayout:
    """Per KV head, from its pattern heads' block lists: each kept visible block (i, j) of
    pattern head r sets bit 2r of entry (i, j) and bit 2r + 1 of entry (i - 1, j)."""
    check_kv_heads(pattern, num_kv_heads)
    rows = _group_heads(pattern, num_kv_heads)
    if 2 * rows > MAX_ENTRY_BITS:
        raise ValueError(
            f"a decode entry holds one bit per (pattern head of a GQA group, query block); "
            f"{rows} distinct pattern heads per KV head need {2 * rows} > {MAX_ENTRY_BITS}"
        )
    nq, nk = pattern.num_q_blocks, pattern.num_kv_blocks
    per = pattern.num_heads // num_kv_heads
    keys, all_bits_list = [], []
    for g in range(num_kv_heads):
        parts_key, parts_bit = [], []
        for r in range(rows):
            _, i, j = pattern.block_coordinates(heads=slice(g * per + r, g * per + r + 1))
            seen = j <= i
            i, j = i[seen], j[seen]
            later = i > 0  # block i's use is also listed under block i - 1, as its next block
            parts_key += [i * nk + j, (i[later] - 1) * nk + j[later]]
            parts_bit += [torch.full_like(i, 1 << (2 * r)), torch.full_like(j[later], 2 << (2 * r))]
        key, entry = torch.unique(torch.cat(parts_key), return_inverse=True)
        bits = torch.zeros(key.numel(), dtype=torch.int64)
        bits.index_add_(0, entry, torch.cat(parts_bit))  # disjoint bits: the sum is their union
        keys.append(key + g * nq * nk)
        all_bits_list.append(bits)
    key, bits = torch.cat(keys).to(device), torch.cat(all_bits_list).to(device)
    g, i, j = key // (nq * nk), (key // nk) % nq, key % nk
    all_bits = -1 if 2 * rows == 64 else (1 << (2 * rows)) - 1
    # j < i: the block ends before query block i starts, so every new token sees all of it.
    full = (bits == all_bits) & (j < i)
    even = sum(1 << (2 * r) for r in range(rows))
    used_by_lo = (bits & even) != 0
    key = g * nq + i
    partial = ~full
    p_key, p_lo = key[partial], used_by_lo[partial]
    # Within a list: the entries query block i uses, then those only block i + 1 uses.
    order = torch.argsort(p_key * 2 + (~p_lo).to(torch.int64), stable=True)
    total = num_kv_heads * nq
    partial_offsets = csr_offsets(p_key, total)
    lo_counts = torch.bincount(p_key[p_lo], minlength=total)
    counts = torch.bincount(key, minlength=total).view(num_kv_heads, nq)
    return DecodeLayout(
        block_size=pattern.block_size,
        num_kv_heads=num_kv_heads,
        num_q_blocks=nq,
        heads_per_kv_head=rows,
        dense=False,
        full_offsets=csr_offsets(key[full], total),
        full_cols=j[full].to(torch.int32).contiguous(),
        partial_offsets=partial_offsets,
        partial_mid=(partial_offsets[:-1].to(torch.int64) + lo_counts).to(torch.int32),
        partial_cols=j[partial][order].to(torch.int32).contiguous(),
        partial_bits=bits[partial][order].contiguous(),
        list_lengths=counts.amax(dim=0).cpu(),
    )


_DECODE_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def decode_layout(
    pattern: BlockPattern, num_kv_heads: int, device: torch.device | str = "cpu"
) -> DecodeLayout:
    """Per (KV head, query block): the KV blocks a decode step reads (``s2attn.ops.triton.decode``).

    ``pattern`` has one head per KV head or one per query head (a multiple of ``num_kv_heads``);
    query heads of one GQA group are merged into one list with per-head bits. Cached per pattern,
    KV heads and device.

    Example::

        >>> p = local_stride_pattern(
        ...     32, max_seq_len=131072, block_size=64, local_blocks=16, vert_stride=64,
        ...     num_kv_heads=8
        ... )
        >>> decode_layout(p, 8, "cuda").list_lengths[-1]  # blocks read at the end of the context
        tensor(48)
    """
    device = cache_device(device)
    per_pattern = _DECODE_CACHE.setdefault(pattern, {})
    key = (num_kv_heads, str(device))
    if key not in per_pattern:
        per_pattern[key] = build_outside_graph_pool(
            device, lambda: _build_decode(pattern, num_kv_heads, device)
        )
    return per_pattern[key]


def dense_decode_layout(
    block_size: int, num_kv_heads: int, num_q_blocks: int, device: torch.device | str = "cpu"
) -> DecodeLayout:
    """The decode layout of dense causal attention: no lists, every earlier block is read."""
    empty = torch.zeros(0, dtype=torch.int32, device=device)
    return DecodeLayout(
        block_size=block_size,
        num_kv_heads=num_kv_heads,
        num_q_blocks=num_q_blocks,
        heads_per_kv_head=1,
        dense=True,
        full_offsets=empty,
        full_cols=empty,
        partial_offsets=empty,
        partial_mid=empty,
        partial_cols=empty,
        partial_bits=empty.to(torch.int64),
        list_lengths=torch.arange(num_q_blocks, dtype=torch.int64) + 2,
    )
