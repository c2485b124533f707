"""Layouts against the pattern they compile: rebuild the token-level mask from the entries (full
ones all kept, partial ones by their bits) and compare it with ``BlockPattern.token_mask``."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import no_tensor_allocation

import s2attn.pattern as pattern_module
from s2attn import BlockPattern, local_stride_pattern
from s2attn.ops.decode_layout import group_block_mask
from s2attn.ops.layout import MAX_ENTRY_BITS, TileLayout, backward_layout, forward_layout

# (block_size, block_m, block_n): Merge-Q (block_m > block_size), split blocks (block_n <
# block_size), packed blocks (block_n > block_size), and all 64 bits of an entry (16 / 128x128).
GEOMETRIES = [
    (16, 16, 16),
    (16, 64, 32),
    (16, 128, 64),
    (16, 128, 128),
    (16, 32, 128),
    (32, 64, 32),
    (32, 16, 64),
    (64, 128, 64),
    (64, 64, 32),
    (64, 16, 128),
    (128, 64, 32),
    (128, 128, 128),
    (128, 128, 16),
]


def _patterns(block_size: int) -> list[BlockPattern]:
    nb = max(3, 352 // block_size)  # not a multiple of most tiles: the last tile is ragged
    torch.manual_seed(block_size)
    random_mask = torch.rand(3, nb, nb) < 0.4
    return [
        BlockPattern(random_mask, block_size, causal=True),
        BlockPattern(random_mask, block_size, causal=False),
        local_stride_pattern(
            3, max_seq_len=nb * block_size, block_size=block_size, local_blocks=2, vert_stride=3
        ),
        local_stride_pattern(
            3,
            max_seq_len=nb * block_size,
            block_size=block_size,
            local_blocks=1,
            vert_stride=2,
            causal=False,
        ),
    ]


def _entries(layout: TileLayout, transpose: bool) -> list[tuple[int, int, int, int, bool]]:
    """Every entry as (head, q tile, kv tile, bits, full); bits are -1 ("all") for full ones."""
    out = []
    for full, offsets, cols in (
        (True, layout.full_offsets, layout.full_cols),
        (False, layout.partial_offsets, layout.partial_cols),
    ):
        offsets, cols = offsets.tolist(), cols.tolist()
        bits = layout.partial_bits.tolist()
        assert len(offsets) == layout.num_heads * layout.num_groups + 1
        assert offsets[0] == 0 and offsets[-1] == len(cols)
        for key in range(layout.num_heads * layout.num_groups):
            h, group = divmod(key, layout.num_groups)
            for e in range(offsets[key], offsets[key + 1]):
                t, n = (cols[e], group) if transpose else (group, cols[e])
                out.append((h, t, n, -1 if full else bits[e], full))
    return out


def _rebuild(layout: TileLayout, entries, heads: int, num_q_tiles: int, num_kv_tiles: int):
    """The token-level keep mask (heads, q tiles * block_m, kv tiles * block_n) before causality."""
    bm, bn = layout.block_m, layout.block_n
    rg, cg, per_row = layout.row_group, layout.col_group, layout.bits_per_row
    m = torch.zeros(heads, num_q_tiles * bm, num_kv_tiles * bn, dtype=torch.bool)
    for h, t, n, bits, full in entries:
        tile = m[h, t * bm : (t + 1) * bm, n * bn : (n + 1) * bn]
        if full:
            tile[:] = True
            continue
        for a in range(bm // rg):
            for b in range(per_row):
                if (bits >> (a * per_row + b)) & 1:
                    tile[a * rg : (a + 1) * rg, b * cg : (b + 1) * cg] = True
    return m


def _assert_token_mask(m: torch.Tensor, p: BlockPattern, what) -> None:
    """A rebuilt (heads, >= L, >= L) mask: nothing past the pattern's L tokens and, once causality
    is applied, exactly the pattern's token mask."""
    L = p.max_seq_len
    assert not m[:, L:].any() and not m[:, :, L:].any(), "entry past the pattern"
    m = m[:, :L, :L]
    if p.causal:
        m = m & torch.ones(L, L, dtype=torch.bool).tril()
    assert torch.equal(m, p.token_mask(L)), what


@pytest.mark.parametrize("block_size, block_m, block_n", GEOMETRIES)
def test_forward_layout_rebuilds_the_token_mask(block_size, block_m, block_n):
    for p in _patterns(block_size):
        layout = forward_layout(p, block_m, block_n)
        L = p.max_seq_len
        nq, nk = math.ceil(L / block_m), math.ceil(L / block_n)
        assert layout.num_groups == nq and layout.num_heads == p.num_heads
        assert (layout.block_m, layout.block_n, layout.causal) == (block_m, block_n, p.causal)
        entries = _entries(layout, transpose=False)
        # Each (head, q tile, kv tile) appears once, in full or in partial.
        assert len({e[:3] for e in entries}) == len(entries) == layout.num_entries
        counts = torch.zeros(p.num_heads * nq, dtype=torch.int64)
        for h, t, *_ in entries:
            counts[h * nq + t] += 1
        assert layout.max_entries == counts.max().item()

        rebuilt = _rebuild(layout, entries, p.num_heads, nq, nk)
        _assert_token_mask(rebuilt, p, (p, block_m, block_n))


@pytest.mark.parametrize("block_size, block_m, block_n", GEOMETRIES)
def test_full_entries_need_no_mask(block_size, block_m, block_n):
    for p in _patterns(block_size):
        token = p.token_mask(p.max_seq_len)
        visible = p.effective_block_mask()
        layout = forward_layout(p, block_m, block_n)
        for h, t, n, bits, full in _entries(layout, transpose=False):
            region = token[h, t * block_m : (t + 1) * block_m, n * block_n : (n + 1) * block_n]
            if full:
                # Every row keeps every key, causality included, and the tile lies inside.
                assert region.shape == (block_m, block_n) and region.all(), (h, t, n)
            else:
                assert bits != 0
        if p.causal:
            # An entry is only listed when a kept block touches the tile's visible part, so
            # causal patterns whose blocks are all visible never list dead entries.
            clean = BlockPattern(visible, block_size, causal=True)
            for h, t, n, _, _ in _entries(forward_layout(clean, block_m, block_n), False):
                region = token[h, t * block_m : (t + 1) * block_m, n * block_n : (n + 1) * block_n]
                assert region.any(), (h, t, n)


def test_full_and_partial_split_on_a_dense_causal_pattern():
    # 128 tokens, 32-row tiles and 32-key tiles: tiles below the diagonal are full, the diagonal
    # ones partial (causal masking), nothing above.
    p = BlockPattern(torch.ones(1, 8, 8, dtype=torch.bool), block_size=16)
    layout = forward_layout(p, 32, 32)
    assert layout.full_offsets.tolist() == [0, 0, 1, 3, 6]
    assert layout.full_cols.tolist() == [0, 0, 1, 0, 1, 2]
    assert layout.partial_offsets.tolist() == [0, 1, 2, 3, 4]
    assert layout.partial_cols.tolist() == [0, 1, 2, 3]
    assert layout.partial_bits.tolist() == [0b1111] * 4


@pytest.mark.parametrize("block_size, block_m, block_n", GEOMETRIES)
def test_backward_layout_holds_the_forward_entries(block_size, block_m, block_n):
    for p in _patterns(block_size):
        fwd = _entries(forward_layout(p, block_m, block_n), transpose=False)
        layout = backward_layout(p, block_m, block_n)
        assert layout.num_groups == math.ceil(p.max_seq_len / block_n)
        bwd = _entries(layout, transpose=True)
        assert sorted(bwd) == sorted(fwd)
        # Within one KV tile the query tiles come in order.
        for cols, offsets in (
            (layout.full_cols, layout.full_offsets),
            (layout.partial_cols, layout.partial_offsets),
        ):
            o = offsets.tolist()
            for a, b in zip(o, o[1:]):
                assert cols[a:b].tolist() == sorted(cols[a:b].tolist())


@pytest.mark.parametrize("num_blocks", [1, 3, 5])
def test_num_blocks_crops_like_the_pattern(num_blocks):
    p = local_stride_pattern(
        2, max_seq_len=320, block_size=32, local_blocks=1, vert_stride=3, causal=False
    )
    for build in (forward_layout, backward_layout):
        cropped = _entries(build(p, 64, 32, num_blocks=num_blocks), build is backward_layout)
        expected = _entries(build(p.crop(num_blocks), 64, 32), build is backward_layout)
        assert sorted(cropped) == sorted(expected)


def test_layouts_are_cached_per_pattern_tiles_and_direction():
    p = local_stride_pattern(2, max_seq_len=256, block_size=16, local_blocks=2, vert_stride=3)
    a = forward_layout(p, 64, 32)
    assert forward_layout(p, 64, 32) is a
    assert forward_layout(p, 64, 32, "cpu") is a
    assert forward_layout(p, 32, 32) is not a
    assert backward_layout(p, 64, 32) is not a
    assert backward_layout(p, 64, 32) is backward_layout(p, 64, 32)
    assert forward_layout(p, 64, 32, num_blocks=4) is not a
    # Keyed on the pattern object: an equal pattern builds its own (equal) layout.
    twin = BlockPattern(p.mask, p.block_size, p.causal)
    b = forward_layout(twin, 64, 32)
    assert b is not a and torch.equal(b.full_cols, a.full_cols)


@pytest.mark.parametrize(
    "block_m, block_n, match",
    [
        (8, 32, "block_m"),
        (48, 32, "block_m"),
        (0, 32, "block_m"),
        (64, 24, "block_n"),
        (64, 8, "block_n"),
        (256, 128, "bits"),
        (128, 256, "bits"),
    ],
)
def test_invalid_tile_sizes_raise(block_m, block_n, match):
    p = local_stride_pattern(2, max_seq_len=512, block_size=16, local_blocks=2, vert_stride=3)
    with pytest.raises(ValueError, match=match):
        forward_layout(p, block_m, block_n)
    with pytest.raises(ValueError, match=match):
        backward_layout(p, block_m, block_n)
    assert MAX_ENTRY_BITS == 64


# ------------------------------------------------------------------------------ gathered entries
GATHER_GEOMETRIES = [g for g in GEOMETRIES if g[0] < g[2]] + [(16, 64, 64), (32, 128, 64)]


def _rebuild_gathered(layout: TileLayout, heads: int, num_q_tiles: int, seq: int):
    """The token mask of every entry, contiguous and gathered, and the entry count per tile.

    Gathered entries of causal layouts must not need the causal rule: each block ends at or
    before the tile's first query."""
    bm, bn, w = layout.block_m, layout.block_n, layout.gather_width
    rg, bs = layout.row_group, layout.block_size
    num_kv_tiles = math.ceil(seq / bn) + 1
    m = _rebuild(layout, _entries(layout, False), heads, num_q_tiles, num_kv_tiles)
    counts = torch.zeros(heads * num_q_tiles, dtype=torch.int64)
    for key in range(heads * num_q_tiles):
        counts[key] += layout.full_offsets[key + 1] - layout.full_offsets[key]
        counts[key] += layout.partial_offsets[key + 1] - layout.partial_offsets[key]
    for full, offsets, blocks in (
        (True, layout.gather_full_offsets, layout.gather_full_blocks),
        (False, layout.gather_partial_offsets, layout.gather_partial_blocks),
    ):
        offsets, blocks = offsets.tolist(), blocks.view(-1, w).tolist()
        bits = layout.gather_partial_bits.tolist()
        assert offsets[0] == 0 and offsets[-1] == len(blocks)
        for key in range(heads * num_q_tiles):
            h, t = divmod(key, num_q_tiles)
            counts[key] += offsets[key + 1] - offsets[key]
            for e in range(offsets[key], offsets[key + 1]):
                assert full or bits[e] != 0
                for b, j in enumerate(blocks[e]):
                    if layout.causal:  # wholly visible: the kernel applies no causal rule
                        assert (j + 1) * bs - 1 <= t * bm
                    for a in range(bm // rg):
                        if full or (bits[e] >> (a * w + b)) & 1:
                            r0 = t * bm + a * rg
                            m[h, r0 : r0 + rg, j * bs : (j + 1) * bs] = True
    return m, counts


@pytest.mark.parametrize("block_size, block_m, block_n", GATHER_GEOMETRIES)
def test_gathered_forward_layout_rebuilds_the_token_mask(block_size, block_m, block_n):
    for p in _patterns(block_size):
        plain = forward_layout(p, block_m, block_n)
        layout = forward_layout(p, block_m, block_n, gather=True)
        assert layout is not plain and layout.gather_width == block_n // block_size
        L = p.max_seq_len
        nq = math.ceil(L / block_m)
        m, counts = _rebuild_gathered(layout, p.num_heads, nq, L)
        assert layout.max_entries == counts.max().item()
        _assert_token_mask(m, p, (p, block_m, block_n))


def test_gathered_entries_pack_lone_stride_blocks():
    # Block 16, 128x64 tiles: the stride blocks before the local window (every 4th block) fill
    # gathered entries of 4, full ones, instead of one 64-key tile each.
    p = local_stride_pattern(1, max_seq_len=4096, block_size=16, local_blocks=8, vert_stride=4)
    plain = forward_layout(p, 128, 64)
    layout = forward_layout(p, 128, 64, gather=True)
    assert layout.num_entries < plain.num_entries / 2
    blocks = layout.gather_full_blocks.view(-1, 4)
    assert blocks.numel() and (blocks >= 0).all()
    # The last tile's full gathered entries hold distinct blocks, all before the tile.
    last = layout.num_groups - 1
    o = layout.gather_full_offsets.tolist()
    rows = blocks[o[last] : o[last + 1]]
    assert rows.numel() and rows.unique().numel() == rows.numel()
    assert (rows < last * 128 // 16).all()


def test_gather_is_ignored_when_blocks_fill_the_kv_tile():
    p = local_stride_pattern(2, max_seq_len=512, block_size=64, local_blocks=2, vert_stride=3)
    layout = forward_layout(p, 128, 64, gather=True)
    assert layout.gather_width == 0 and layout.num_entries == forward_layout(p, 128, 64).num_entries


# -------------------------------------------------------------------- gathered KV tiles (dK/dV)
def _coverage_with_gathered_kv(layout: TileLayout, heads: int, num_q_tiles: int, seq: int):
    """How often each (head, query, key) pair is covered by the contiguous entries and the
    gathered KV tiles together (dK/dV sums must see each once), and the gathered tiles' list
    lengths. Gathered entries of causal layouts must not need the causal rule."""
    g = layout.gathered_kv
    bm, rg, bs, w = layout.block_m, layout.row_group, layout.block_size, g.width
    num_kv_tiles = math.ceil(seq / layout.block_n) + 1
    cover = _rebuild(layout, _entries(layout, True), heads, num_q_tiles, num_kv_tiles)
    cover = cover.to(torch.int8)
    blocks, tile_heads = g.blocks.view(-1, w).tolist(), g.heads.tolist()
    assert len(blocks) == g.num_tiles
    for full, offsets, cols in (
        (True, g.full_offsets.tolist(), g.full_cols.tolist()),
        (False, g.partial_offsets.tolist(), g.partial_cols.tolist()),
    ):
        bits = g.partial_bits.tolist()
        assert offsets[0] == 0 and offsets[-1] == len(cols) and len(offsets) == g.num_tiles + 1
        for tile in range(g.num_tiles):
            h = tile_heads[tile]
            for e in range(offsets[tile], offsets[tile + 1]):
                t = cols[e]
                assert full or bits[e] != 0
                for b, j in enumerate(blocks[tile]):
                    if j < 0:  # an empty slot has no bits
                        assert not full
                        assert not any((bits[e] >> (a * w + b)) & 1 for a in range(bm // rg))
                        continue
                    for a in range(bm // rg):
                        if full or (bits[e] >> (a * w + b)) & 1:
                            if layout.causal:  # wholly visible: the kernel applies no causal rule
                                assert (j + 1) * bs - 1 <= t * bm
                            r0 = t * bm + a * rg
                            cover[h, r0 : r0 + rg, j * bs : (j + 1) * bs] += 1
    # One slot per (head, block): no block sits in two tiles of its head.
    keys = [(tile_heads[i], j) for i, row in enumerate(blocks) for j in row if j >= 0]
    assert len(keys) == len(set(keys))
    counts = g.full_offsets.diff() + g.partial_offsets.diff()
    assert g.max_entries == counts.max().item()
    assert counts.tolist() == sorted(counts.tolist(), reverse=True), "longest lists first"
    return cover


@pytest.mark.parametrize(
    "block_size, block_m, block_n", [(16, 32, 64), (16, 64, 64), (32, 64, 64), (16, 16, 128)]
)
def test_gathered_kv_tiles_cover_each_pair_once(block_size, block_m, block_n):
    for p in _patterns(block_size):
        plain = backward_layout(p, block_m, block_n)
        layout = backward_layout(p, block_m, block_n, gather=True)
        assert layout is not plain and plain.gathered_kv is None
        L = p.max_seq_len
        nq = math.ceil(L / block_m)
        if layout.gathered_kv is None:
            assert layout.num_entries == plain.num_entries
            continue
        cover = _coverage_with_gathered_kv(layout, p.num_heads, nq, L)
        assert cover.max() <= 1, "a (query, key) pair summed twice"
        _assert_token_mask(cover.bool(), p, (p, block_m, block_n))


def test_gathered_kv_tiles_pack_lone_stride_blocks():
    # Block 16, 64x64 tiles: far from the diagonal each stride block (every 4th) used to cost a
    # whole 64-key entry per query tile; gathered, four stride blocks share one full entry.
    p = local_stride_pattern(1, max_seq_len=4096, block_size=16, local_blocks=8, vert_stride=4)
    plain = backward_layout(p, 64, 64)
    layout = backward_layout(p, 64, 64, gather=True)
    g = layout.gathered_kv
    assert layout.num_entries < plain.num_entries / 2
    assert g.full_cols.numel() > 4 * g.partial_cols.numel()
    used = g.blocks[g.blocks >= 0]
    assert (g.blocks >= 0).sum() > g.blocks.numel() - 4  # at most the last tile has empty slots
    assert (used % 4 == 0).all()  # the pattern's stride blocks


def test_gather_kv_is_ignored_when_blocks_fill_the_kv_tile():
    p = local_stride_pattern(2, max_seq_len=512, block_size=64, local_blocks=2, vert_stride=3)
    layout = backward_layout(p, 64, 64, gather=True)
    assert layout.gathered_kv is None
    assert layout.num_entries == backward_layout(p, 64, 64).num_entries


def test_group_block_mask_refuses_past_its_limit_before_allocating(monkeypatch):
    """(2 * heads + 1) * q_blocks * kv_blocks bytes: refused one byte short, before any tensor
    exists, by argument or by the module's limit; built at exactly that."""
    torch.manual_seed(0)
    masks = torch.rand(4, 6, 6) < 0.5
    p = BlockPattern(masks, block_size=16)
    expected = masks.tril().view(2, 2, 6, 6)
    needed = (2 * 4 + 1) * 6 * 6
    assert torch.equal(group_block_mask(p, 2, max_bytes=needed), expected)
    with no_tensor_allocation(monkeypatch):
        with pytest.raises(ValueError, match=f"{needed:,} bytes.*decode_layout"):
            group_block_mask(p, 2, max_bytes=needed - 1)
    monkeypatch.setattr(pattern_module, "DENSE_VIEW_LIMIT", needed - 1)
    with no_tensor_allocation(monkeypatch):
        with pytest.raises(ValueError, match=f"limit of {needed - 1:,} bytes"):
            group_block_mask(p, 2)
    monkeypatch.setattr(pattern_module, "DENSE_VIEW_LIMIT", needed)
    assert torch.equal(group_block_mask(p, 2), expected)
    # Heads that repeat their group's first collapse to one per group, as before.
    shared = BlockPattern(masks[::2].repeat_interleave(2, dim=0), block_size=16)
    assert torch.equal(group_block_mask(shared, 2), masks[::2].tril()[:, None])
