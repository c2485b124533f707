"""The order in which the Gluon dK/dV kernel (``backward_sm90.py``) takes its work items: built
on the host in plain PyTorch, once per layout and shape (the launcher caches it on the layout).
"""

from __future__ import annotations

import torch

from ..layout import TileLayout

__all__ = ["dkdv_order"]


def dkdv_order(
    layout: TileLayout, batch: int, num_heads: int, num_kv_heads: int, kv_tiles: int,
    q_heads_per_pattern_head: int, heads_per_group: int | None, streams: int,
) -> torch.Tensor:
    """dK/dV work items ((b * kv_heads + kv_head) * kv_tiles + tile) in the order streams take
    them: groups of (batch, KV head) pairs, so their q and dO stay in L2, longest list first.
    A group's long lists (over twice the median) are moved ahead of the previous group's short
    ones, so the last items taken are short and no stream is left finishing a long one alone:
    the queue reads L0 L1 S0 L2 S1 ... S_last.

    ``heads_per_group`` None: pairs enough for about ``streams / 2`` long lists per group (so
    two groups' long lists about fill the streams), or 4 when no list is long. Measured on H100
    at 128k (whole backward): V16 (128 long lists per head) 58.8 ms with 1 pair vs 72.5 with 4;
    V64 (32 per head) 25.3 ms with 4 vs 26.5 with 1."""
    full = layout.full_offsets.diff().view(-1, layout.num_groups)
    partial = layout.partial_offsets.diff().view(-1, layout.num_groups)
    heads = torch.arange(num_heads, device=full.device) // q_heads_per_pattern_head
    lengths = (full + partial)[heads, :kv_tiles].view(num_kv_heads, -1, kv_tiles).sum(1)
    lengths = lengths.repeat(batch, 1).long()
    pairs = lengths.shape[0]
    long = lengths > 2 * lengths.median()
    if heads_per_group is None:
        long_per_pair = round(long.sum().item() / pairs)
        # Without long lists (e.g. a dense pattern), groups of 4 as the Triton kernel measured.
        pairs_per_group = streams // (2 * long_per_pair) if long_per_pair else 4
        heads_per_group = max(1, min(pairs, pairs_per_group))
    group = torch.arange(pairs, device=full.device)[:, None] // heads_per_group
    slot = torch.where(long, (2 * group - 1).clamp(min=0), 2 * group + 2)
    key = slot * (lengths.max() + 1) - lengths
    return key.flatten().argsort(stable=True).to(torch.int32)
