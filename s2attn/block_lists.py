"""The checks of a pattern given as block lists (CSR: per (head, query block) row, its sorted KV
blocks), walked a bounded chunk of rows at a time: they hold one chunk's blocks and a few tensors
of one row's or one column's length, never (heads, q_blocks, kv_blocks). A pattern built from
rules answers from them instead (:mod:`s2attn.rules`)."""

from __future__ import annotations

import torch

__all__ = [
    "check_block_lists",
    "group_union_complete",
    "head_kv_efficient",
    "head_token_pairs",
    "offsets_from_counts",
    "walk",
]

# Kept blocks per step when a check walks a pattern's lists: the step's temporaries, several int64
# tensors of this length, stay under 100 MB at any pattern size.
WALK_BLOCKS = 1 << 20


def offsets_from_counts(counts: torch.Tensor) -> torch.Tensor:
    offsets = torch.zeros(counts.numel() + 1, dtype=torch.int64)
    offsets[1:] = counts.cumsum(0)
    return offsets


def check_block_lists(
    row_offsets: torch.Tensor, cols: torch.Tensor, num_heads: int, num_kv_blocks: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-row counts, cols) as int64 CPU tensors when ``row_offsets`` and ``cols`` are lists of
    ``num_heads`` heads' rows over ``num_kv_blocks`` KV blocks; ``TypeError`` or ``ValueError``
    naming the argument otherwise."""
    for name, t in (("row_offsets", row_offsets), ("cols", cols)):
        if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.is_floating_point():
            raise TypeError(f"{name} must be a 1-D integer tensor")
    rows = row_offsets.numel() - 1
    if rows < num_heads or rows % num_heads:
        raise ValueError(
            f"row_offsets must hold num_heads * q_blocks + 1 entries, got {rows + 1} for "
            f"num_heads={num_heads}"
        )
    offsets = row_offsets.detach().to("cpu", torch.int64)
    cols = cols.detach().to("cpu", torch.int64)
    counts = offsets[1:] - offsets[:-1]
    if offsets[0] != 0 or (counts < 0).any() or offsets[-1] != cols.numel():
        raise ValueError(
            f"row_offsets must start at 0, never decrease and end at len(cols) ({cols.numel()})"
        )
    if cols.numel() and (cols.min() < 0 or cols.max() >= num_kv_blocks):
        raise ValueError(f"cols must lie in [0, num_kv_blocks={num_kv_blocks})")
    row_start = torch.zeros(cols.numel(), dtype=torch.bool)
    row_start[offsets[:-1][counts > 0]] = True
    if cols.numel() > 1 and not ((cols[1:] > cols[:-1]) | row_start[1:]).all():
        raise ValueError("each row's cols must be strictly increasing")
    return counts, cols


def walk(pattern, heads: range, stop: int):
    """The lists of ``pattern``'s ``heads`` over query blocks ``[0, stop)``, in chunks of rows
    that hold at most :data:`WALK_BLOCKS` blocks together (or one row): per chunk ``(first, end,
    blocks)``, ``blocks`` holding per head its causally visible (query block, KV block) pairs as
    int64."""
    qb, offsets, cols = pattern.num_q_blocks, pattern.row_offsets, pattern.cols
    per_row = sum(offsets[h * qb : h * qb + stop + 1].diff() for h in heads)
    ends = per_row.cumsum(0)
    first = 0
    while first < stop:
        done = int(ends[first - 1]) if first else 0
        end = max(int(torch.searchsorted(ends, done + WALK_BLOCKS, right=True)), first + 1)
        blocks = []
        for h in heads:
            rows = offsets[h * qb + first : h * qb + end + 1]
            lo, hi = int(rows[0]), int(rows[-1])
            i = first + torch.searchsorted(rows[1:], torch.arange(lo, hi), right=True)
            j = cols[lo:hi].long()
            if pattern.causal:
                keep = j <= i
                i, j = i[keep], j[keep]
            blocks.append((i, j))
        yield first, end, blocks
        first = end


def head_token_pairs(pattern, head: int, nb: int, last: int) -> int:
    """The token pairs head ``head`` keeps over the first ``nb`` blocks, the last holding
    ``last`` tokens (see :meth:`BlockPattern.kept_token_pairs`)."""
    bs, total = pattern.block_size, 0
    for _, _, [(i, j)] in walk(pattern, range(head, head + 1), nb):
        keep = j < nb  # the crop's columns; its rows are the walk's
        i, j = i[keep], j[keep]
        len_i = torch.where(i == nb - 1, last, bs)
        len_j = torch.where(j == nb - 1, last, bs)
        pairs = len_i * len_j
        if pattern.causal:
            pairs = torch.where(j == i, len_i * (len_i + 1) // 2, pairs)
        total += int(pairs.sum())
    return total


def head_kv_efficient(pattern, head: int) -> bool:
    """Whether the query blocks reading each KV block of head ``head`` form one run: per KV
    block its first and last reader and how many read it; one run when the readers fill the span
    between the first and the last."""
    qb, kb = pattern.num_q_blocks, pattern.num_kv_blocks
    low = torch.full((kb,), qb, dtype=torch.int64)
    high = torch.full((kb,), -1, dtype=torch.int64)
    readers = torch.zeros(kb, dtype=torch.int64)
    for _, _, [(i, j)] in walk(pattern, range(head, head + 1), qb):
        low.scatter_reduce_(0, j, i, "amin")
        high.scatter_reduce_(0, j, i, "amax")
        readers += torch.bincount(j, minlength=kb)
    return bool(((readers == 0) | (high - low + 1 == readers)).all())


def group_union_complete(pattern, group: range) -> bool:
    """Whether the heads of ``group`` together keep every visible block pair."""
    qb, kb = pattern.num_q_blocks, pattern.num_kv_blocks
    for first, end, blocks in walk(pattern, group, qb):
        keys = torch.cat([(i - first) * kb + j for i, j in blocks])
        covered = torch.unique(keys).numel()
        if pattern.causal:
            visible = int(torch.arange(first + 1, end + 1).clamp(max=kb).sum())
        else:
            visible = (end - first) * kb
        if covered != visible:
            return False
    return True
