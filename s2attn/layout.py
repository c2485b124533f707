"""Pattern -> kernel layouts.

A kernel program works on a *tile*: ``block_m`` query rows at absolute positions
``[t * block_m, (t + 1) * block_m)`` against KV *tiles* of ``block_n`` keys. Tile sizes are independent
of the pattern's ``block_size``:

* ``block_m > block_size`` is Merge-Q: one tile holds several query blocks and walks the union of
  their KV blocks, loading each KV tile once.
* ``block_n < block_size`` splits a pattern block over several KV tiles; ``block_n > block_size``
  packs several pattern blocks into one KV tile.

Every (query tile, KV tile) pair that any row uses is an *entry*. Its fine structure is a bit
matrix of ``rows_per_tile x cols_per_tile`` sub-blocks (one bit per pattern block inside the
tile pair), packed into an int64. An entry is *full* when every bit is set and, for causal
patterns, every key lies at or before the tile's first query; the kernel runs those through an
unmasked loop. The others are *partial* and carry their bits for the masked loop.

The forward layout lists entries per (head, query tile); the backward layout (dK/dV) lists the
same entries per (head, KV tile). Both are CSR: ``offsets`` of length ``heads * tiles + 1`` and
the entries' other coordinate (and bits) in order. Layouts are cached per pattern, tile sizes and
device.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass

import torch

from .pattern import BlockPattern

__all__ = ["TileLayout", "forward_layout", "backward_layout", "MAX_ENTRY_BITS"]

MAX_ENTRY_BITS = 64


@dataclass(frozen=True)
class TileLayout:
    """Entries of a pattern grouped along one axis (CSR), split into full and partial ones.

    For the forward layout the grouping axis is the query tile and ``*_cols`` hold KV tile indices;
    for the backward layout it is the KV tile and ``*_cols`` hold query tile indices.
    """

    block_m: int
    block_n: int
    causal: bool
    num_heads: int
    num_groups: int  # query tiles (forward) or KV tiles (backward) per head
    row_group: int  # query rows covered by one bit
    col_group: int  # keys covered by one bit
    bits_per_row: int  # bits per sub-row of an entry's bit matrix
    full_offsets: torch.Tensor  # int32 (heads * num_groups + 1,)
    full_cols: torch.Tensor  # int32
    partial_offsets: torch.Tensor  # int32 (heads * num_groups + 1,)
    partial_cols: torch.Tensor  # int32
    partial_bits: torch.Tensor  # int64, one bit matrix per partial entry
    max_entries: int  # the longest list (full + partial) of any group

    @property
    def num_entries(self) -> int:
        return self.full_cols.numel() + self.partial_cols.numel()


def _entry_geometry(block_size: int, block_m: int, block_n: int) -> tuple[int, int, int, int]:
    for name, value in (("block_m", block_m), ("block_n", block_n)):
        if value < 16 or value & (value - 1):
            raise ValueError(f"{name} must be a power of two >= 16, got {value}")
    row_group = min(block_size, block_m)
    col_group = min(block_size, block_n)
    rows, cols = block_m // row_group, block_n // col_group
    if rows * cols > MAX_ENTRY_BITS:
        raise ValueError(
            f"tile {block_m}x{block_n} over block_size {block_size} needs {rows * cols} mask bits "
            f"per entry; at most {MAX_ENTRY_BITS} fit"
        )
    return row_group, col_group, rows, cols


def _tile_entries(
    pattern: BlockPattern, block_m: int, block_n: int, device: torch.device, num_blocks: int | None
):
    """All entries of the pattern as coordinate lists (head, q tile, kv tile, bits, full)."""
    bs = pattern.block_size
    row_group, col_group, rows, cols = _entry_geometry(bs, block_m, block_n)
    mask = pattern.mask if num_blocks is None else pattern.mask[:, :num_blocks, :num_blocks]
    mask = mask.to(device)
    heads, qb, kb = mask.shape
    num_q_tiles = math.ceil(qb * bs / block_m)
    num_kv_tiles = math.ceil(kb * bs / block_n)

    # Pad the block mask so that both axes split evenly into tiles.
    qb_pad = math.ceil(num_q_tiles * block_m / bs)
    kb_pad = math.ceil(num_kv_tiles * block_n / bs)
    padded = torch.zeros(heads, qb_pad, kb_pad, dtype=torch.bool, device=device)
    padded[:, :qb, :kb] = mask

    # Coarse occupancy (head, q tile, kv tile): does any bit of the entry hold?
    if block_m >= bs:
        coarse = padded.view(heads, num_q_tiles, block_m // bs, kb_pad).any(dim=2)
    else:
        coarse = padded.repeat_interleave(bs // block_m, dim=1)[:, :num_q_tiles]
    if block_n >= bs:
        coarse = coarse.view(heads, num_q_tiles, num_kv_tiles, block_n // bs).any(dim=3)
    else:
        coarse = coarse.repeat_interleave(bs // block_n, dim=2)[:, :, :num_kv_tiles]
    q_tile = torch.arange(num_q_tiles, device=device)
    kv_tile = torch.arange(num_kv_tiles, device=device)
    if pattern.causal:
        # Entries whose first key lies after the tile's last query are never visible.
        coarse &= kv_tile[None, :] * block_n <= (q_tile[:, None] + 1) * block_m - 1
    h, t, n = coarse.nonzero(as_tuple=True)

    bits = torch.zeros(h.shape, dtype=torch.int64, device=device)
    for a in range(rows):
        block_row = (t * block_m + a * row_group) // bs
        for b in range(cols):
            block_col = (n * block_n + b * col_group) // bs
            bit = padded[h, block_row, block_col].to(torch.int64)
            bits |= bit << (a * cols + b)
    all_bits = -1 if rows * cols == 64 else (1 << (rows * cols)) - 1
    full = bits == all_bits
    if pattern.causal:
        full &= (n + 1) * block_n - 1 <= t * block_m
    geometry = dict(row_group=row_group, col_group=col_group, bits_per_row=cols)
    return h, t, n, bits, full, num_q_tiles, num_kv_tiles, geometry


def _csr(group: torch.Tensor, num_groups: int) -> torch.Tensor:
    counts = torch.bincount(group, minlength=num_groups)
    offsets = torch.zeros(num_groups + 1, dtype=torch.int64, device=group.device)
    offsets[1:] = counts.cumsum(0)
    return offsets.to(torch.int32)


def _build(
    pattern: BlockPattern,
    block_m: int,
    block_n: int,
    device: torch.device,
    transpose: bool,
    num_blocks: int | None,
) -> TileLayout:
    h, t, n, bits, full, num_q_tiles, num_kv_tiles, geometry = _tile_entries(
        pattern, block_m, block_n, device, num_blocks
    )
    if transpose:
        num_groups, key, col = num_kv_tiles, h * num_kv_tiles + n, t
        order = torch.argsort(key * num_q_tiles + t)  # nonzero() sorted by (h, t, n)
        key, col, bits, full = key[order], col[order], bits[order], full[order]
    else:
        num_groups, key, col = num_q_tiles, h * num_q_tiles + t, n
    total = pattern.num_heads * num_groups
    partial = ~full
    counts = torch.bincount(key, minlength=total)
    return TileLayout(
        block_m=block_m,
        block_n=block_n,
        causal=pattern.causal,
        num_heads=pattern.num_heads,
        num_groups=num_groups,
        full_offsets=_csr(key[full], total),
        full_cols=col[full].to(torch.int32).contiguous(),
        partial_offsets=_csr(key[partial], total),
        partial_cols=col[partial].to(torch.int32).contiguous(),
        partial_bits=bits[partial].contiguous(),
        max_entries=int(counts.max().item()) if counts.numel() else 0,
        **geometry,
    )


# Layouts live as long as their pattern. A pattern keeps a handful: one per tile shape and device,
# more only for bidirectional patterns run at several lengths (see ``num_blocks``).
_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_MAX_LAYOUTS_PER_PATTERN = 16


def _cached(
    pattern: BlockPattern,
    block_m: int,
    block_n: int,
    device: torch.device | str,
    transpose: bool,
    num_blocks: int | None,
) -> TileLayout:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    per_pattern = _CACHE.setdefault(pattern, {})
    key = (block_m, block_n, str(device), transpose, num_blocks)
    if key not in per_pattern:
        if len(per_pattern) >= _MAX_LAYOUTS_PER_PATTERN:
            per_pattern.pop(next(iter(per_pattern)))
        per_pattern[key] = _build(pattern, block_m, block_n, device, transpose, num_blocks)
    return per_pattern[key]


def forward_layout(
    pattern: BlockPattern,
    block_m: int,
    block_n: int,
    device: torch.device | str = "cpu",
    num_blocks: int | None = None,
) -> TileLayout:
    """Per (head, query tile): the KV tiles to visit, full ones apart from partial ones.

    ``num_blocks`` crops the pattern to its top-left corner first. Causal callers leave it None:
    a causal tile never lists KV tiles past its own queries, so one layout serves every length.
    Bidirectional callers pass the blocks their longest sequence needs, so that tiles do not walk
    KV blocks past the end.
    """
    return _cached(pattern, block_m, block_n, device, False, num_blocks)


def backward_layout(
    pattern: BlockPattern,
    block_m: int,
    block_n: int,
    device: torch.device | str = "cpu",
    num_blocks: int | None = None,
) -> TileLayout:
    """Per (head, KV tile): the query tiles that use it, for the dK/dV pass."""
    return _cached(pattern, block_m, block_n, device, True, num_blocks)
