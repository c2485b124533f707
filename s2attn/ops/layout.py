"""Pattern -> the tile layouts of the attention passes (forward, dK/dV, dQ).

A kernel program works on a *tile*: ``block_m`` query rows at absolute positions
``[t * block_m, (t + 1) * block_m)`` against KV *tiles* of ``block_n`` keys. Tile sizes are
independent of the pattern's ``block_size``:

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

A decode step's lists over a paged KV cache are :mod:`s2attn.ops.decode_layout`'s.
"""

from __future__ import annotations

import dataclasses
import math
import weakref
from dataclasses import dataclass, field

import torch

from ..memory import build_outside_graph_pool
from ..pattern import BlockPattern

__all__ = [
    "MAX_ENTRY_BITS",
    "GatheredKVTiles",
    "TileLayout",
    "backward_layout",
    "cache_device",
    "csr_offsets",
    "forward_layout",
]

MAX_ENTRY_BITS = 64


@dataclass(frozen=True)
class GatheredKVTiles:
    """dK/dV's gathered KV tiles (backward layouts built with ``gather=True``, block_size <
    block_n).

    Each tile packs ``width`` = block_n / block_size key blocks of one pattern head that are not
    contiguous (lone stride blocks), so that their far query tiles do not drag 3/4 masked-out keys
    through every dK/dV step. It lists the query tiles that use its blocks *far*: through an entry
    of the contiguous layout that uses at most half its KV tile's blocks and (causal) lies wholly
    after the KV tile, so gathered entries need no causal rule. Those entries are dropped from the
    contiguous lists; every (head, query tile, key block) pair is in exactly one of the two. The
    gathered tiles' sums are added to dK/dV after the contiguous pass has written them.

    Lists are CSR over tiles (longest first), entries as in ``TileLayout``: query tile indices,
    full ones apart from partial ones, whose bit column b stands for the tile's b-th block.
    """

    width: int
    heads: torch.Tensor  # int32 (tiles,): the pattern head of each tile
    blocks: torch.Tensor  # int32 (tiles * width,): key block of each slot, -1 for an empty one
    full_offsets: torch.Tensor  # int32 (tiles + 1,)
    full_cols: torch.Tensor  # int32, query tile indices
    partial_offsets: torch.Tensor  # int32 (tiles + 1,)
    partial_cols: torch.Tensor  # int32
    partial_bits: torch.Tensor  # int64
    max_entries: int

    @property
    def num_tiles(self) -> int:
        return self.heads.numel()

    @property
    def num_entries(self) -> int:
        return self.full_cols.numel() + self.partial_cols.numel()


@dataclass(frozen=True)
class TileLayout:
    """Entries of a pattern grouped along one axis (CSR), split into full and partial ones.

    For the forward layout the grouping axis is the query tile and ``*_cols`` hold KV tile indices;
    for the backward layout it is the KV tile and ``*_cols`` hold query tile indices.
    """

    block_m: int
    block_n: int
    block_size: int  # the pattern's; full entries may run to the end of a block, past seq_k
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
    max_entries: int  # the longest list (full + partial + gathered) of any group
    # Gathered entries (forward layouts built with ``gather=True`` when block_size < block_n):
    # each holds ``gather_width`` = block_n / block_size pattern blocks that need not be
    # contiguous; ``gather_*_blocks`` lists their block indices, ``gather_width`` per entry (a
    # padding slot repeats a block of its entry and has no bits). Bit matrices as for partial
    # entries, bit column b standing for the entry's b-th block. 0 and None: no gathered entries.
    gather_width: int = 0
    gather_full_offsets: torch.Tensor | None = None  # int32 (heads * num_groups + 1,)
    gather_full_blocks: torch.Tensor | None = None  # int32 (entries * gather_width,)
    gather_partial_offsets: torch.Tensor | None = None  # int32 (heads * num_groups + 1,)
    gather_partial_blocks: torch.Tensor | None = None  # int32 (entries * gather_width,)
    gather_partial_bits: torch.Tensor | None = None  # int64, one bit matrix per entry
    # Backward layouts built with ``gather=True``: the lone key blocks' far uses (None: none).
    gathered_kv: GatheredKVTiles | None = None
    # Tensors kernels derive from the layout (e.g. the Gluon dK/dV kernel's item order), kept
    # here so they are computed once per layout, not per call.
    derived: dict = field(default_factory=dict, init=False, compare=False, repr=False)

    @property
    def num_entries(self) -> int:
        n = self.full_cols.numel() + self.partial_cols.numel()
        if self.gather_width:
            n += (self.gather_full_blocks.numel() + self.gather_partial_blocks.numel()) // (
                self.gather_width
            )
        if self.gathered_kv is not None:
            n += self.gathered_kv.num_entries
        return n


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
    """All entries of the pattern as coordinate lists (head, q tile, kv tile, bits, full), sorted
    by (head, q tile, kv tile).

    Built from the pattern's kept blocks one head at a time, so the work and memory follow the
    kept blocks (no (heads, q blocks, kv blocks) intermediate): each kept block sets its bit in
    the entry of the tile pair holding it."""
    bs = pattern.block_size
    row_group, col_group, rows, cols = _entry_geometry(bs, block_m, block_n)
    qb = pattern.num_q_blocks if num_blocks is None else num_blocks
    kb = pattern.num_kv_blocks if num_blocks is None else num_blocks
    num_q_tiles = math.ceil(qb * bs / block_m)
    num_kv_tiles = math.ceil(kb * bs / block_n)
    # A block covers `q_split` query tiles (block_m < bs) or a tile holds `q_per` blocks.
    q_per, q_split = max(block_m // bs, 1), max(bs // block_m, 1)
    k_per, k_split = max(block_n // bs, 1), max(bs // block_n, 1)
    all_bits = -1 if rows * cols == 64 else (1 << (rows * cols)) - 1
    parts = []
    for head in range(pattern.num_heads):
        _, i, j = pattern.block_coordinates(num_blocks, heads=slice(head, head + 1), device=device)
        if q_split > 1:  # one entry per query tile of the block, its bit row 0
            i = i.repeat_interleave(q_split)
            j = j.repeat_interleave(q_split)
            t = i * q_split + torch.arange(q_split, device=device).repeat(i.numel() // q_split)
            a = torch.zeros_like(t)
        else:
            t, a = i // q_per, i % q_per
        if k_split > 1:
            t, a = t.repeat_interleave(k_split), a.repeat_interleave(k_split)
            j = j.repeat_interleave(k_split)
            n = j * k_split + torch.arange(k_split, device=device).repeat(j.numel() // k_split)
            b = torch.zeros_like(n)
        else:
            n, b = j // k_per, j % k_per
        if pattern.causal:
            # Entries whose first key lies after the tile's last query are never visible.
            seen = n * block_n <= (t + 1) * block_m - 1
            t, n, a, b = t[seen], n[seen], a[seen], b[seen]
        # Each kept block owns one bit of its entry: the sum of the bits is their union.
        key, entry = torch.unique(t * num_kv_tiles + n, return_inverse=True)
        bits = torch.zeros(key.numel(), dtype=torch.int64, device=device)
        bits.index_add_(0, entry, torch.ones_like(a) << (a * cols + b))
        t, n = key // num_kv_tiles, key % num_kv_tiles
        full = bits == all_bits
        if pattern.causal:
            full &= (n + 1) * block_n - 1 <= t * block_m
        parts.append((torch.full_like(t, head), t, n, bits, full))
    h, t, n, bits, full = (torch.cat(column) for column in zip(*parts))
    geometry = dict(row_group=row_group, col_group=col_group, bits_per_row=cols)
    return h, t, n, bits, full, num_q_tiles, num_kv_tiles, geometry


def csr_offsets(group: torch.Tensor, num_groups: int) -> torch.Tensor:
    """int32 CSR offsets (num_groups + 1,) of entries whose list indices are ``group``."""
    return _csr_from_counts(torch.bincount(group, minlength=num_groups))


def _csr_from_counts(counts: torch.Tensor) -> torch.Tensor:
    """int32 CSR offsets (len(counts) + 1,) of lists of these lengths."""
    offsets = torch.zeros(counts.numel() + 1, dtype=torch.int64, device=counts.device)
    offsets[1:] = counts.cumsum(0)
    return offsets.to(torch.int32)


def _lone_blocks(t, n, bits, block_m, block_n, block_size, causal):
    """Which entries to gather, the rule both directions share: (bit matrix (entries, rows,
    width) of bools, the blocks each entry uses (entries, width), and the entries to gather).

    Tiles that use more than half their blocks stay contiguous (bulk copies, one entry), and so
    do causal tiles that reach past the query tile's first row: gathered entries never need the
    causal rule, only their bits."""
    width = block_n // block_size
    rows = block_m // min(block_size, block_m)
    shifts = torch.arange(rows * width, device=bits.device, dtype=torch.int64)
    bitmat = ((bits[:, None] >> shifts[None, :]) & 1).view(-1, rows, width).bool()
    col_used = bitmat.any(dim=1)
    lone = col_used.sum(dim=1) <= width // 2
    if causal:
        lone &= (n + 1) * block_n - 1 <= t * block_m  # every key before the tile's first query
    return bitmat, col_used, lone


def _exclusive_cumsum(counts: torch.Tensor) -> torch.Tensor:
    starts = torch.zeros_like(counts)
    starts[1:] = counts.cumsum(0)[:-1]
    return starts


def _gather(h, t, n, bits, full, num_q_tiles, block_m, block_n, block_size, causal):
    """Split the entries that use at most half their pattern blocks into single blocks and
    pack each (head, query tile)'s blocks, ``block_n / block_size`` at a time, into gathered
    entries: blocks every row keeps (and sees whole, when causal) apart from the others, so that
    the former make full gathered entries.

    Causal layouts gather only KV tiles wholly before the query tile, so gathered entries need
    no causal mask. Returns the contiguous entries kept (h, t, n, bits, full) and the gathered
    ones as (key, blocks (entries, width), bits, full), sorted by key = head * num_q_tiles + tile.
    """
    device = h.device
    width = block_n // block_size
    rows = block_m // min(block_size, block_m)
    bitmat, col_used, lone = _lone_blocks(t, n, bits, block_m, block_n, block_size, causal)
    contiguous = ~lone
    keep = (h[contiguous], t[contiguous], n[contiguous], bits[contiguous], full[contiguous])

    sparse = lone.nonzero(as_tuple=True)[0]
    e, b = col_used[sparse].nonzero(as_tuple=True)  # sorted by (entry, block): by (h, t, j)
    e = sparse[e]
    key = h[e] * num_q_tiles + t[e]
    j = n[e] * width + b
    row_bits = bitmat[e, :, b]  # (items, rows)
    item_full = row_bits.all(dim=1)
    if causal:
        item_full &= (j + 1) * block_size - 1 <= t[e] * block_m
    # Group (key, partial?): full-able blocks packed apart from the others.
    gkey = key * 2 + (~item_full).to(torch.int64)
    order = torch.argsort(gkey, stable=True)
    gkey, j, row_bits, item_full = gkey[order], j[order], row_bits[order], item_full[order]
    counts = torch.bincount(gkey, minlength=1) if gkey.numel() else gkey.new_zeros(1)
    rank = torch.arange(gkey.numel(), device=device) - _exclusive_cumsum(counts)[gkey]
    entries_per = (counts + width - 1) // width
    base = _exclusive_cumsum(entries_per)
    ge = base[gkey] + rank // width
    slot = rank % width
    num_g = int(entries_per.sum().item())

    blocks = torch.full((num_g, width), -1, dtype=torch.int64, device=device)
    blocks[ge, slot] = j
    blocks = torch.where(blocks < 0, blocks[:, :1], blocks)  # padding repeats the first block
    a = torch.arange(rows, device=device, dtype=torch.int64)
    contrib = (row_bits.to(torch.int64) << (a[None, :] * width + slot[:, None])).sum(dim=1)
    gbits = torch.zeros(num_g, dtype=torch.int64, device=device).index_add_(0, ge, contrib)
    filled = torch.zeros(num_g, dtype=torch.int64, device=device).index_add_(
        0, ge, torch.ones_like(ge)
    )
    gkey_of = torch.zeros(num_g, dtype=torch.int64, device=device)
    gkey_of[ge] = gkey
    any_partial = torch.zeros(num_g, dtype=torch.int64, device=device).index_add_(
        0, ge, (~item_full).to(torch.int64)
    )
    gfull = (filled == width) & (any_partial == 0)
    return keep, (gkey_of // 2, blocks, gbits, gfull)


def _gather_kv(
    h, t, n, bits, num_heads, num_q_tiles, num_kv_tiles, block_m, block_n, block_size, causal
):
    """Split the far entries that use at most half their KV tile's blocks out of a backward
    layout's entries (h, q tile t, KV tile n, bits) and pack their key blocks, ``block_n /
    block_size`` of one head at a time, into gathered KV tiles (``GatheredKVTiles``).

    Returns the mask of entries kept contiguous, and the gathered tiles (None when none)."""
    device = h.device
    width = block_n // block_size
    rows = block_m // min(block_size, block_m)
    bitmat, col_used, far = _lone_blocks(t, n, bits, block_m, block_n, block_size, causal)
    if not far.any():
        return torch.ones_like(far), None
    far_entries = far.nonzero(as_tuple=True)[0]
    e, b = col_used[far_entries].nonzero(as_tuple=True)
    e = far_entries[e]
    row_bits = bitmat[e, :, b]  # (items, rows): which row groups of query tile t[e] use the block
    blocks_per_head = num_kv_tiles * width
    block_key = h[e] * blocks_per_head + n[e] * width + b

    # One slot per (head, key block). A head's blocks fill its tiles in order of how many far
    # query tiles use them, so each tile holds blocks whose lists mostly coincide (full entries):
    # neighbouring stride blocks together, the local window's edge blocks (a few uses) apart.
    keys, item_slot = torch.unique(block_key, return_inverse=True)
    uses = torch.bincount(item_slot, minlength=keys.numel())
    key_head = keys // blocks_per_head
    most = int(uses.max().item())
    order = torch.argsort((key_head * (most + 1) + most - uses) * blocks_per_head + keys)
    position = torch.empty_like(order)
    position[order] = torch.arange(keys.numel(), device=device)
    per_head = torch.bincount(key_head, minlength=num_heads)
    rank = position - _exclusive_cumsum(per_head)[key_head]
    tiles_per_head = (per_head + width - 1) // width
    tile_of = _exclusive_cumsum(tiles_per_head)[key_head] + rank // width
    slot_of = rank % width
    num_tiles = int(tiles_per_head.sum().item())
    blocks = torch.full((num_tiles, width), -1, dtype=torch.int64, device=device)
    blocks[tile_of, slot_of] = keys % blocks_per_head
    heads = torch.repeat_interleave(torch.arange(num_heads, device=device), tiles_per_head)

    # Entries (tile, query tile): each item sets its slot's bit column.
    tile, slot = tile_of[item_slot], slot_of[item_slot]
    a = torch.arange(rows, device=device, dtype=torch.int64)
    contrib = (row_bits.to(torch.int64) << (a[None, :] * width + slot[:, None])).sum(dim=1)
    entry_keys, entry_of = torch.unique(tile * num_q_tiles + t[e], return_inverse=True)
    entry_bits = torch.zeros(entry_keys.numel(), dtype=torch.int64, device=device)
    entry_bits.index_add_(0, entry_of, contrib)  # disjoint bits: the sum is their union
    entry_tile, entry_col = entry_keys // num_q_tiles, entry_keys % num_q_tiles
    all_bits = -1 if rows * width == 64 else (1 << (rows * width)) - 1
    entry_full = entry_bits == all_bits

    # Longest lists first: the grid's first programs take them, short ones fill the tail.
    lengths = torch.bincount(entry_tile, minlength=num_tiles)
    order = torch.argsort(-lengths, stable=True)
    new_index = torch.empty_like(order)
    new_index[order] = torch.arange(num_tiles, device=device)
    entry_tile = new_index[entry_tile]
    sort = torch.argsort(entry_tile * num_q_tiles + entry_col)
    entry_tile, entry_col = entry_tile[sort], entry_col[sort]
    entry_bits, entry_full = entry_bits[sort], entry_full[sort]
    partial = ~entry_full
    gathered = GatheredKVTiles(
        width=width,
        heads=heads[order].to(torch.int32).contiguous(),
        blocks=blocks[order].to(torch.int32).reshape(-1).contiguous(),
        full_offsets=csr_offsets(entry_tile[entry_full], num_tiles),
        full_cols=entry_col[entry_full].to(torch.int32).contiguous(),
        partial_offsets=csr_offsets(entry_tile[partial], num_tiles),
        partial_cols=entry_col[partial].to(torch.int32).contiguous(),
        partial_bits=entry_bits[partial].contiguous(),
        max_entries=int(lengths.max().item()),
    )
    return ~far, gathered


def _build(
    pattern: BlockPattern,
    block_m: int,
    block_n: int,
    device: torch.device,
    transpose: bool,
    num_blocks: int | None,
    gather: bool = False,
) -> TileLayout:
    h, t, n, bits, full, num_q_tiles, num_kv_tiles, geometry = _tile_entries(
        pattern, block_m, block_n, device, num_blocks
    )
    # The tile geometry every gathering step needs besides the entries.
    tiles = (block_m, block_n, pattern.block_size, pattern.causal)
    gathered = {}
    if gather and not transpose and pattern.block_size < block_n:
        (h, t, n, bits, full), (g_key, g_blocks, g_bits, g_full) = _gather(
            h, t, n, bits, full, num_q_tiles, *tiles
        )
        width = block_n // pattern.block_size
        total_g = pattern.num_heads * num_q_tiles
        gathered = dict(
            gather_width=width,
            gather_full_offsets=csr_offsets(g_key[g_full], total_g),
            gather_full_blocks=g_blocks[g_full].to(torch.int32).reshape(-1).contiguous(),
            gather_partial_offsets=csr_offsets(g_key[~g_full], total_g),
            gather_partial_blocks=g_blocks[~g_full].to(torch.int32).reshape(-1).contiguous(),
            gather_partial_bits=g_bits[~g_full].contiguous(),
        )
    gathered_kv = None
    if gather and transpose and pattern.block_size < block_n:
        keep, gathered_kv = _gather_kv(
            h, t, n, bits, pattern.num_heads, num_q_tiles, num_kv_tiles, *tiles
        )
        h, t, n, bits, full = h[keep], t[keep], n[keep], bits[keep], full[keep]
    if transpose:
        num_groups, key, col = num_kv_tiles, h * num_kv_tiles + n, t
        order = torch.argsort(key * num_q_tiles + t)  # nonzero() sorted by (h, t, n)
        key, col, bits, full = key[order], col[order], bits[order], full[order]
    else:
        num_groups, key, col = num_q_tiles, h * num_q_tiles + t, n
    total = pattern.num_heads * num_groups
    partial = ~full
    counts = torch.bincount(key, minlength=total)
    if gathered:
        counts = counts + torch.bincount(g_key, minlength=total)
    return TileLayout(
        block_m=block_m,
        block_n=block_n,
        block_size=pattern.block_size,
        causal=pattern.causal,
        num_heads=pattern.num_heads,
        num_groups=num_groups,
        full_offsets=csr_offsets(key[full], total),
        full_cols=col[full].to(torch.int32).contiguous(),
        partial_offsets=csr_offsets(key[partial], total),
        partial_cols=col[partial].to(torch.int32).contiguous(),
        partial_bits=bits[partial].contiguous(),
        max_entries=int(counts.max().item()) if counts.numel() else 0,
        **geometry,
        **gathered,
        gathered_kv=gathered_kv,
    )


def cache_device(device: torch.device | str) -> torch.device:
    """The device a layout cache keys on: "cuda" as the current CUDA device, so that one layout is
    not built twice under two names."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


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
    gather: bool = False,
) -> TileLayout:
    device = cache_device(device)
    per_pattern = _CACHE.setdefault(pattern, {})
    key = (block_m, block_n, str(device), transpose, num_blocks, gather)
    if key not in per_pattern:
        if len(per_pattern) >= _MAX_LAYOUTS_PER_PATTERN:
            per_pattern.pop(next(iter(per_pattern)))
        # One head at a time, then joined: the working memory is one head's entries.
        per_pattern[key] = build_outside_graph_pool(device, lambda: _join_heads([
            _build(pattern[h : h + 1], block_m, block_n, device, transpose, num_blocks, gather)
            for h in range(pattern.num_heads)
        ]))  # fmt: skip
    return per_pattern[key]


def _join_offsets(parts: list[torch.Tensor]) -> torch.Tensor:
    """CSR offsets of lists laid one after another."""
    return _csr_from_counts(torch.cat([torch.diff(offsets.to(torch.int64)) for offsets in parts]))


def _join_heads(layouts: list[TileLayout]) -> TileLayout:
    """The layout of all heads from one-head layouts (head h's lists after head h - 1's): what
    one build over all heads gives."""
    first = layouts[0]
    fields = {}
    for name in ("full", "partial", "gather_full", "gather_partial"):
        offsets = [getattr(lay, f"{name}_offsets") for lay in layouts]
        if offsets[0] is None:
            continue
        fields[f"{name}_offsets"] = _join_offsets(offsets)
    for name in ("full_cols", "partial_cols", "partial_bits", "gather_full_blocks",
                 "gather_partial_blocks", "gather_partial_bits"):  # fmt: skip
        parts = [getattr(lay, name) for lay in layouts]
        if parts[0] is not None:
            fields[name] = torch.cat(parts)
    tiles = [(h, lay.gathered_kv) for h, lay in enumerate(layouts) if lay.gathered_kv is not None]
    return dataclasses.replace(
        first,
        num_heads=len(layouts),
        max_entries=max(lay.max_entries for lay in layouts),
        gathered_kv=_join_gathered_kv(tiles) if tiles else None,
        **fields,
    )


def _join_gathered_kv(parts: list[tuple[int, GatheredKVTiles]]) -> GatheredKVTiles:
    """Gathered KV tiles of several heads as one set, longest lists first (ties in head order,
    as one build over all heads orders them)."""
    device = parts[0][1].heads.device
    heads = torch.cat([torch.full_like(g.heads, h) for h, g in parts])
    blocks = torch.cat([g.blocks.view(g.num_tiles, g.width) for _, g in parts])
    full_offsets = _join_offsets([g.full_offsets for _, g in parts])
    partial_offsets = _join_offsets([g.partial_offsets for _, g in parts])
    full_cols = torch.cat([g.full_cols for _, g in parts])
    partial_cols = torch.cat([g.partial_cols for _, g in parts])
    partial_bits = torch.cat([g.partial_bits for _, g in parts])
    lengths = torch.diff(full_offsets.long()) + torch.diff(partial_offsets.long())
    order = torch.argsort(-lengths, stable=True)

    def reorder(offsets, *columns):
        """Each tile's run of entries, in the new tile order, and the new offsets."""
        counts = torch.diff(offsets.long())[order]
        starts = offsets[:-1].long()[order]
        index = torch.repeat_interleave(starts, counts) + (
            torch.arange(int(counts.sum()), device=device)
            - torch.repeat_interleave(_exclusive_cumsum(counts), counts)
        )
        return _csr_from_counts(counts), *(column[index] for column in columns)

    full_offsets, full_cols = reorder(full_offsets, full_cols)
    partial_offsets, partial_cols, partial_bits = reorder(
        partial_offsets, partial_cols, partial_bits
    )
    return GatheredKVTiles(
        width=parts[0][1].width,
        heads=heads[order].contiguous(),
        blocks=blocks[order].reshape(-1).contiguous(),
        full_offsets=full_offsets,
        full_cols=full_cols.contiguous(),
        partial_offsets=partial_offsets,
        partial_cols=partial_cols.contiguous(),
        partial_bits=partial_bits.contiguous(),
        max_entries=max(g.max_entries for _, g in parts),
    )


def forward_layout(
    pattern: BlockPattern,
    block_m: int,
    block_n: int,
    device: torch.device | str = "cpu",
    num_blocks: int | None = None,
    gather: bool = False,
) -> TileLayout:
    """Per (head, query tile): the KV tiles to visit, full ones apart from partial ones.

    ``num_blocks`` crops the pattern to its top-left corner first. Causal callers leave it None:
    a causal tile never lists KV tiles past its own queries, so one layout serves every length.
    Bidirectional callers pass the blocks their longest sequence needs, so that tiles do not walk
    KV blocks past the end.

    ``gather`` (block_size < block_n only; otherwise ignored): KV tiles that use at most half
    their pattern blocks are split, and each tile's leftover blocks packed into *gathered*
    entries of block_n / block_size blocks each (``TileLayout.gather_*``), so that lone stride
    blocks do not drag 3/4 masked-out keys with them. The Triton forward and dQ kernels read
    them (the Gluon ones take layouts without)."""
    return _cached(pattern, block_m, block_n, device, False, num_blocks, gather)


def backward_layout(
    pattern: BlockPattern,
    block_m: int,
    block_n: int,
    device: torch.device | str = "cpu",
    num_blocks: int | None = None,
    gather: bool = False,
) -> TileLayout:
    """Per (head, KV tile): the query tiles that use it, for the dK/dV pass.

    ``gather`` (block_size < block_n only; otherwise ignored): the far uses of lone key blocks
    move to gathered KV tiles (``TileLayout.gathered_kv``)."""
    return _cached(pattern, block_m, block_n, device, True, num_blocks, gather)
