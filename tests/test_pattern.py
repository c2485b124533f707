"""BlockPattern: construction, masks, density, slicing; the builders against their definition; the
KV-efficiency and union-completeness checks. Pure metadata on the CPU: no kernels run here."""

from __future__ import annotations

import collections
import contextlib
import functools
import itertools
import math
import warnings

import numpy as np
import pytest
import torch
from helpers import HANG_GUARD_S, no_tensor_allocation

import s2attn.pattern as pattern_module
from s2attn import BlockPattern, block_lists, dense_pattern, local_stride_pattern
from s2attn.rules import LocalStrideRule


def _causal_blocks(n: int) -> torch.Tensor:
    return torch.ones(n, n, dtype=torch.bool).tril()


# ------------------------------------------------------------------------------ construction
def test_mask_must_be_a_bool_tensor():
    with pytest.raises(TypeError, match="mask"):
        BlockPattern([[[True]]], block_size=16)
    with pytest.raises(TypeError, match="mask"):
        BlockPattern(torch.ones(1, 2, 2, dtype=torch.int32), block_size=16)


@pytest.mark.parametrize("shape", [(2, 2), (1, 2, 2, 2), (0, 2, 2), (1, 0, 2)])
def test_mask_must_be_nonempty_3d(shape):
    with pytest.raises(ValueError, match="mask"):
        BlockPattern(torch.ones(shape, dtype=torch.bool), block_size=16)


@pytest.mark.parametrize("block_size", [0, 8, 15, 24, 48, 100, -16])
def test_block_size_must_be_a_power_of_two_of_at_least_16(block_size):
    with pytest.raises(ValueError, match="block_size"):
        BlockPattern(torch.ones(1, 2, 2, dtype=torch.bool), block_size=block_size)


@pytest.mark.parametrize("block_size", [16.0, True, "16", torch.tensor(16.0), torch.tensor([16])])
def test_block_size_must_be_an_integer(block_size):
    with pytest.raises(TypeError, match="block_size must be an integer"):
        BlockPattern(torch.ones(1, 2, 2, dtype=torch.bool), block_size=block_size)


def test_causal_must_be_a_bool():
    with pytest.raises(TypeError, match="causal"):
        BlockPattern(torch.ones(1, 2, 2, dtype=torch.bool), block_size=16, causal=1)


def test_pattern_copies_the_mask_and_reports_its_shape():
    mask = torch.rand(3, 4, 5) < 0.5
    p = BlockPattern(mask, block_size=32, causal=False)
    expected = mask.clone()
    mask.fill_(False)
    assert torch.equal(p.mask, expected)
    assert (p.num_heads, p.num_q_blocks, p.num_kv_blocks) == (3, 4, 5)
    assert p.max_seq_len == 4 * 32


# ------------------------------------------------------------------------------------ density
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("seq_len", [None, 1, 17, 100])
def test_dense_pattern_has_density_one(causal, seq_len):
    p = BlockPattern(torch.ones(2, 8, 8, dtype=torch.bool), block_size=16, causal=causal)
    assert p.density(seq_len) == pytest.approx(1.0)
    assert dense_pattern(3, max_seq_len=100, block_size=16, causal=causal).density(
        seq_len
    ) == pytest.approx(1.0)


def test_density_small_case_by_hand():
    # Head 0 keeps only its diagonal blocks, head 1 only the block below the diagonal.
    mask = torch.zeros(2, 2, 2, dtype=torch.bool)
    mask[0, 0, 0] = mask[0, 1, 1] = True
    mask[1, 1, 0] = True
    p = BlockPattern(mask, block_size=16, causal=True)
    # seq 32: each diagonal block holds 16 * 17 / 2 = 136 visible pairs, the one below 256.
    visible = 136 + 136 + 256
    assert p.density(32) == pytest.approx((272 + 256) / (2 * visible))
    assert p.kept_token_pairs(32) == 272 + 256
    # seq 20: blocks of 16 and 4 tokens: diagonals 136 and 10 pairs, the block below 4 * 16.
    assert p.density(20) == pytest.approx((146 + 64) / (2 * (136 + 10 + 64)))
    assert p.kept_token_pairs(20) == 146 + 64
    # Bidirectional: every block pair is visible in full.
    q = BlockPattern(mask, block_size=16, causal=False)
    assert q.density(32) == pytest.approx((512 + 256) / (2 * 1024))


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("seq_len", [1, 16, 45, 96])
def test_density_counts_token_mask_pairs(causal, seq_len):
    torch.manual_seed(seq_len)
    p = BlockPattern(torch.rand(3, 6, 6) < 0.4, block_size=16, causal=causal)
    kept = p.token_mask(seq_len).sum().item()
    visible = seq_len * (seq_len + 1) // 2 if causal else seq_len * seq_len
    assert p.kept_token_pairs(seq_len) == kept
    assert p.density(seq_len) == pytest.approx(kept / (3 * visible))


def test_density_rejects_lengths_past_the_pattern():
    """Past the pattern there are no blocks to weigh: the token count refuses too."""
    for p in (
        dense_pattern(1, max_seq_len=64, block_size=16),
        BlockPattern(torch.ones(1, 4, 4, dtype=torch.bool), block_size=16),
    ):
        for check in (p.density, p.kept_token_pairs):
            with pytest.raises(ValueError, match="seq_len"):
                check(65)
            with pytest.raises(ValueError, match="seq_len"):
                check(0)


# --------------------------------------------------------------------------------- token mask
def _token_mask_by_hand(mask, block_size, causal, seq_q, seq_k):
    heads = mask.shape[0]
    out = torch.zeros(heads, seq_q, seq_k, dtype=torch.bool)
    for h, t, s in itertools.product(range(heads), range(seq_q), range(seq_k)):
        pos = t + seq_k - seq_q  # bottom-right alignment
        keep = bool(mask[h, pos // block_size, s // block_size])
        out[h, t, s] = keep and (not causal or pos >= s)
    return out


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("seq_q, seq_k", [(40, 40), (1, 40), (7, 33), (24, 48), (16, 16)])
def test_token_mask_matches_a_hand_built_mask(causal, seq_q, seq_k):
    torch.manual_seed(seq_q * 100 + seq_k)
    mask = torch.rand(2, 3, 3) < 0.5
    p = BlockPattern(mask, block_size=16, causal=causal)
    expected = _token_mask_by_hand(mask, 16, causal, seq_q, seq_k)
    assert torch.equal(p.token_mask(seq_q, seq_k), expected)


def test_token_mask_aligns_queries_bottom_right():
    p = dense_pattern(1, max_seq_len=64, block_size=16, causal=True)
    m = p.token_mask(2, 10)[0]
    # Query 0 sits at position 8, query 1 at position 9: the last query sees every key.
    assert m[0].tolist() == [True] * 9 + [False]
    assert m[1].all()


def test_token_mask_rejects_bad_lengths():
    p = dense_pattern(1, max_seq_len=64, block_size=16)
    with pytest.raises(ValueError, match="seq_q"):
        p.token_mask(10, 5)
    with pytest.raises(ValueError, match="max_seq_len"):
        p.token_mask(65)
    with pytest.raises(ValueError, match="seq_q"):
        p.token_mask(0, 5)


# ------------------------------------------------------------------- slicing, crop, printing
def test_head_slice():
    mask = torch.rand(6, 4, 4) < 0.5
    p = BlockPattern(mask, block_size=32, causal=False)
    sub = p[2:5]
    assert torch.equal(sub.mask, mask[2:5])
    assert (sub.block_size, sub.causal) == (32, False)
    assert torch.equal(p[::2].mask, mask[::2])
    with pytest.raises(TypeError, match="slice"):
        p[0]
    with pytest.raises(ValueError, match="no heads"):
        p[4:4]


def test_crop():
    mask = torch.rand(2, 5, 5) < 0.5
    p = BlockPattern(mask, block_size=16)
    c = p.crop(3)
    assert torch.equal(c.mask, mask[:, :3, :3])
    assert c.max_seq_len == 48
    assert torch.equal(c.token_mask(40), p.token_mask(40))
    for bad in (0, 6):
        with pytest.raises(ValueError, match="num_blocks"):
            p.crop(bad)


def test_draw_and_repr():
    mask = torch.tensor([[[1, 0, 0], [0, 1, 1], [1, 0, 1]]], dtype=torch.bool)
    assert BlockPattern(mask, 16, causal=True).draw() == "#\n.#\n#.#"
    assert BlockPattern(mask, 16, causal=False).draw() == "#..\n.##\n#.#"
    assert BlockPattern(mask, 16).draw(max_blocks=2) == "#\n.#"
    r = repr(local_stride_pattern(4, max_seq_len=256, block_size=16, local_blocks=2, vert_stride=4))
    assert r.startswith("BlockPattern(heads=4, q_blocks=16, kv_blocks=16, block_size=16")
    assert "density=" in r


# ------------------------------------------------------------------------------------ builders
def _local_stride_by_definition(
    h,
    i,
    j,
    *,
    group_size,
    num_sparse_groups,
    local_blocks,
    vert_stride,
    homo_head,
    head_offset,
    causal,
):
    """DESIGN.md's definition, one entry at a time."""
    g = h // group_size
    if g >= num_sparse_groups:  # dense: every visible block
        return j <= i or not causal
    local = 0 <= i - j < local_blocks if causal else abs(i - j) < local_blocks
    shift = head_offset + (0 if homo_head else g)
    stripe = (j + shift) % vert_stride == 0 and (j <= i or not causal)
    return local or stripe


@pytest.mark.parametrize(
    "num_heads, max_seq_len, block_size, local_blocks, vert_stride, kwargs",
    [
        (4, 160, 16, 2, 3, {}),
        (4, 160, 16, 2, 3, {"causal": False}),
        (3, 300, 32, 1, 4, {"head_offset": 2}),
        (8, 512, 64, 2, 5, {"num_kv_heads": 2}),
        (8, 512, 64, 3, 2, {"num_kv_heads": 4, "num_dense_heads": 2, "causal": False}),
        (6, 250, 16, 4, 3, {"num_dense_heads": 1}),
        (4, 200, 16, 1, 3, {"homo_head": True, "head_offset": 1}),
        (2, 128, 128, 1, 1, {}),
    ],
)
def test_local_stride_pattern_matches_its_definition(
    num_heads, max_seq_len, block_size, local_blocks, vert_stride, kwargs
):
    nb = math.ceil(max_seq_len / block_size)
    one_block = (
        pytest.warns(UserWarning, match="one block") if nb == 1 else contextlib.nullcontext()
    )
    with one_block:
        p = local_stride_pattern(
            num_heads,
            max_seq_len=max_seq_len,
            block_size=block_size,
            local_blocks=local_blocks,
            vert_stride=vert_stride,
            **kwargs,
        )
    assert p.mask.shape == (num_heads, nb, nb)
    assert p.block_size == block_size and p.causal == kwargs.get("causal", True)
    group_size = num_heads // kwargs.get("num_kv_heads", num_heads)
    definition = dict(
        group_size=group_size,
        num_sparse_groups=(num_heads - kwargs.get("num_dense_heads", 0)) // group_size,
        local_blocks=local_blocks,
        vert_stride=vert_stride,
        homo_head=kwargs.get("homo_head", False),
        head_offset=kwargs.get("head_offset", 0),
        causal=kwargs.get("causal", True),
    )
    mask = p.mask  # built on each access: once, not per block (1536 builds hung a loaded machine)
    for h, i, j in itertools.product(range(num_heads), range(nb), range(nb)):
        expected = _local_stride_by_definition(h, i, j, **definition)
        assert bool(mask[h, i, j]) == expected, (h, i, j)


def test_local_stride_pattern_is_sparse_and_not_trivial():
    p = local_stride_pattern(4, max_seq_len=1024, block_size=16, local_blocks=2, vert_stride=4)
    assert 0.1 < p.density() < 0.5
    # Different heads attend different stripes.
    assert not torch.equal(p.mask[0], p.mask[1])


def test_gqa_groups_share_one_pattern():
    p = local_stride_pattern(
        8, max_seq_len=512, block_size=32, local_blocks=2, vert_stride=4, num_kv_heads=2
    )
    mask = p.mask
    for g in range(2):
        for h in range(4 * g, 4 * g + 4):
            assert torch.equal(mask[h], mask[4 * g])
    assert not torch.equal(mask[0], mask[4])


def test_dense_heads_come_last():
    p = local_stride_pattern(
        6, max_seq_len=512, block_size=32, local_blocks=2, vert_stride=4, num_dense_heads=2
    )
    lower = torch.ones(p.num_q_blocks, p.num_kv_blocks, dtype=torch.bool).tril()
    assert torch.equal(p.mask[4:], lower.expand(2, -1, -1))  # every visible block
    assert not (p.mask[:4] == lower).all(dim=(1, 2)).any()


@pytest.mark.parametrize(
    "kwargs, arg",
    [
        ({"num_kv_heads": 3}, "num_kv_heads"),
        ({"num_dense_heads": 5}, "num_dense_heads"),
        ({"num_dense_heads": 1, "num_kv_heads": 2}, "num_dense_heads"),
        ({"num_dense_heads": -1}, "num_dense_heads"),
        ({"local_blocks": 0}, "local_blocks"),
        ({"vert_stride": 0}, "vert_stride"),
        ({"block_size": 24}, "block_size"),
        ({"max_seq_len": 0}, "max_seq_len"),
        ({"num_heads": 0}, "num_heads"),
    ],
)
def test_local_stride_pattern_rejects_bad_arguments(kwargs, arg):
    args = dict(num_heads=4, max_seq_len=256, block_size=16, local_blocks=2, vert_stride=4)
    args.update(kwargs)
    with pytest.raises(ValueError, match=arg):
        local_stride_pattern(**args)


@pytest.mark.parametrize("causal", [True, False])
def test_dense_pattern(causal):
    p = dense_pattern(3, max_seq_len=100, block_size=32, causal=causal)
    every = torch.ones(3, 4, 4, dtype=torch.bool)
    assert torch.equal(p.mask, every.tril() if causal else every)  # every visible block
    assert p.causal == causal and p.max_seq_len == 128
    expected = torch.ones(3, 100, 100, dtype=torch.bool)
    assert torch.equal(p.token_mask(100), expected.tril() if causal else expected)
    assert p.is_kv_efficient() and p.is_union_complete()
    with pytest.raises(ValueError, match="block_size"):
        dense_pattern(3, max_seq_len=100, block_size=8)


# ------------------------------------------------------------------------------- properties
def test_relative_stride_pattern_is_not_kv_efficient():
    nb, stride = 12, 3
    i = torch.arange(nb)[:, None]
    j = torch.arange(nb)[None, :]
    relative = ((i - j) % stride == 0) & (j <= i)
    assert not BlockPattern(relative[None], block_size=16).is_kv_efficient()


def test_kv_efficiency_on_hand_made_patterns():
    mask = _causal_blocks(4)[None].clone()
    assert BlockPattern(mask, 16).is_kv_efficient()
    mask[0, 2, 0] = False  # KV block 0 used by query blocks 0, 1 and 3: two runs
    assert not BlockPattern(mask, 16).is_kv_efficient()
    mask[0, 3, 0] = False  # now 0 and 1 only: one run
    assert BlockPattern(mask, 16).is_kv_efficient()
    # Blocks above the diagonal are causally invisible and do not break a run.
    hidden = torch.tensor([[[1, 0], [1, 1]]], dtype=torch.bool)
    hidden_above = torch.tensor([[[1, 1], [1, 1]]], dtype=torch.bool)
    assert BlockPattern(hidden, 16).is_kv_efficient()
    assert BlockPattern(hidden_above, 16).is_kv_efficient()


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize(
    "num_heads, local_blocks, vert_stride, kwargs",
    [
        (4, 2, 4, {}),
        (8, 1, 5, {}),
        (2, 3, 7, {"homo_head": True}),
        (8, 2, 4, {"num_kv_heads": 2}),
        (6, 1, 3, {"num_dense_heads": 2, "head_offset": 5}),
    ],
)
def test_absolute_stride_patterns_are_kv_efficient(
    causal, num_heads, local_blocks, vert_stride, kwargs
):
    p = local_stride_pattern(
        num_heads,
        max_seq_len=1024,
        block_size=16,
        local_blocks=local_blocks,
        vert_stride=vert_stride,
        causal=causal,
        **kwargs,
    )
    assert p.is_kv_efficient()


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize(
    "num_heads, vert_stride, head_offset", [(4, 4, 0), (8, 4, 0), (5, 3, 2), (16, 16, 7), (7, 7, 1)]
)
def test_staggered_heads_are_union_complete(causal, num_heads, vert_stride, head_offset):
    p = local_stride_pattern(
        num_heads,
        max_seq_len=2048,
        block_size=16,
        local_blocks=1,
        vert_stride=vert_stride,
        head_offset=head_offset,
        causal=causal,
    )
    assert p.is_union_complete()
    # Union completeness means the token masks together cover every visible pair.
    covered = p.token_mask(400).any(dim=0)
    visible = torch.ones(400, 400, dtype=torch.bool)
    assert torch.equal(covered, visible.tril() if causal else visible)


@pytest.mark.parametrize("causal", [True, False])
def test_too_few_or_homogeneous_heads_are_not_union_complete(causal):
    args = dict(max_seq_len=2048, block_size=16, local_blocks=2, vert_stride=4, causal=causal)
    assert not local_stride_pattern(4, homo_head=True, **args).is_union_complete()
    assert not local_stride_pattern(3, **args).is_union_complete()
    # A window that covers the whole context needs no stripes.
    full_window = dict(args, local_blocks=128)
    with pytest.warns(UserWarning, match="local_blocks=128 covers all 128 blocks"):
        assert local_stride_pattern(4, homo_head=True, **full_window).is_union_complete()


def test_union_completeness_per_gqa_group():
    # Stripes staggered across all 8 heads: complete together, but no group of 4 is.
    across = local_stride_pattern(8, max_seq_len=1024, block_size=16, local_blocks=1, vert_stride=8)
    assert across.is_union_complete()
    assert not across.is_union_complete(num_kv_heads=2)
    # Staggered within each group of 4: every group is complete on its own.
    within = BlockPattern(
        torch.cat(
            [
                local_stride_pattern(
                    4, max_seq_len=1024, block_size=16, local_blocks=1, vert_stride=4
                ).mask
            ]
            * 2
        ),
        block_size=16,
    )
    assert within.is_union_complete(num_kv_heads=2)
    assert within.is_union_complete(num_kv_heads=1)
    # One pattern per KV group (the builder's GQA mode) covers only one residue per group.
    shared = local_stride_pattern(
        8, max_seq_len=1024, block_size=16, local_blocks=1, vert_stride=4, num_kv_heads=2
    )
    assert not shared.is_union_complete(num_kv_heads=2)
    with pytest.raises(ValueError, match="num_kv_heads"):
        within.is_union_complete(num_kv_heads=3)


def test_from_block_lists_round_trip_and_bad_lists():
    """A pattern rebuilt from its own lists equals it (mask, checks, layouts); malformed lists
    raise naming what is wrong."""
    p = local_stride_pattern(
        4,
        max_seq_len=1024,
        block_size=16,
        local_blocks=3,
        vert_stride=5,
        num_kv_heads=2,
        num_dense_heads=2,
    )
    q = BlockPattern.from_block_lists(
        p.row_offsets, p.cols, num_heads=4, num_kv_blocks=p.num_kv_blocks, block_size=16
    )
    assert torch.equal(q.mask, p.mask) and q.num_kept_blocks == p.num_kept_blocks
    assert q.density() == p.density() and q.is_kv_efficient()
    assert q.is_union_complete() and not q.is_union_complete(2)  # group 0 alone: one stripe
    one = dict(num_heads=1, num_kv_blocks=2, block_size=64)
    small = BlockPattern.from_block_lists(torch.tensor([0, 1, 3]), torch.tensor([0, 0, 1]), **one)
    assert small.mask.tolist() == [[[True, False], [True, True]]]
    bad = [
        ((torch.tensor([0, 1, 3]), torch.tensor([0, 1, 0])), "strictly increasing"),
        ((torch.tensor([0, 2, 1]), torch.tensor([0])), "never decrease"),
        ((torch.tensor([0, 1, 2]), torch.tensor([0, 2])), r"\[0, num_kv_blocks=2\)"),
        ((torch.tensor([0, 1]), torch.tensor([0.0])), "integer"),
        ((torch.tensor([0, 1, 2, 3]), torch.tensor([0, 0, 1])), "num_heads \\* q_blocks"),
    ]
    for (offsets, cols), match in bad:
        kwargs = dict(one, num_heads=2) if "num_heads" in match else one
        with pytest.raises((ValueError, TypeError), match=match):
            BlockPattern.from_block_lists(offsets, cols, **kwargs)


@pytest.mark.parametrize(
    "num_heads, max_seq_len, block_size, local_blocks, vert_stride, kwargs",
    [
        (4, 160, 16, 2, 3, {}),
        (4, 160, 16, 2, 3, {"causal": False}),
        (3, 300, 32, 1, 4, {"head_offset": -2}),
        (8, 512, 64, 2, 5, {"num_kv_heads": 2}),
        (8, 512, 64, 3, 2, {"num_kv_heads": 4, "num_dense_heads": 2, "causal": False}),
        (6, 250, 16, 4, 3, {"num_dense_heads": 1}),
        (4, 200, 16, 1, 3, {"homo_head": True, "head_offset": 1}),
    ],
)
def test_rule_patterns_equal_their_lists(
    num_heads, max_seq_len, block_size, local_blocks, vert_stride, kwargs
):
    """A builder's pattern keeps its rules; every view of it (lists, coordinates on a device,
    head slices, crops, counts, checks) and the layouts built from it equal those of the same
    pattern given as a dense mask, and the layouts never build its whole lists."""
    from s2attn.ops.layout import backward_layout, forward_layout

    rule = local_stride_pattern(
        num_heads,
        max_seq_len=max_seq_len,
        block_size=block_size,
        local_blocks=local_blocks,
        vert_stride=vert_stride,
        **kwargs,
    )
    fresh = local_stride_pattern(
        num_heads,
        max_seq_len=max_seq_len,
        block_size=block_size,
        local_blocks=local_blocks,
        vert_stride=vert_stride,
        **kwargs,
    )
    lists = BlockPattern(fresh.mask, block_size, causal=fresh.causal)
    nb = lists.num_q_blocks

    tiles = [(16, 16), (64, 32), (128, 64)]
    for m, n in tiles:
        for build in (forward_layout, backward_layout):
            got, want = build(rule, m, n), build(lists, m, n)
            for name, value in vars(want).items():
                if isinstance(value, torch.Tensor):
                    assert torch.equal(getattr(got, name), value), (build.__name__, m, n, name)
    assert rule._lists is None  # only one head's blocks at a time, never the whole lists
    assert len(rule.rules) == num_heads and lists.rules is None
    assert rule.num_kept_blocks == lists.num_kept_blocks
    for heads in (slice(None), slice(1, 3), slice(0, num_heads, 2)):
        if heads.step is None:  # coordinates take head ranges
            for crop in (None, 1, nb // 2 + 1, nb + 3):
                got = rule.block_coordinates(crop, heads, device="cpu")
                want = lists.block_coordinates(crop, heads)
                assert all(torch.equal(a, b) for a, b in zip(got, want)), (heads, crop)
        assert torch.equal(rule[heads].mask, lists[heads].mask)
        assert rule[heads]._lists is None
    for crop in (1, nb // 2 + 1, nb):
        assert torch.equal(rule.crop(crop).mask, lists.crop(crop).mask)
        assert torch.equal(rule.crop(crop)[1:2].mask, lists.crop(crop)[1:2].mask)
    for seq in (block_size, max_seq_len // 2 + 1, max_seq_len):
        assert rule.density(seq) == lists.density(seq)
    h, i, j = lists.block_coordinates()
    for head in range(num_heads):
        for first, stop in ((0, nb), (1, nb // 2 + 1), (nb - 1, nb), (2, 2)):
            picked = (h == head) & (i >= first) & (i < stop)
            for pattern in (rule, lists):
                got = pattern.row_blocks(head, first, stop)
                assert torch.equal(got[0], i[picked]) and torch.equal(got[1], j[picked])
    with pytest.raises(ValueError, match="outside the pattern"):
        rule.row_blocks(num_heads, 0, 1)
    with pytest.raises(ValueError, match="outside the pattern"):
        lists.row_blocks(0, 1, nb + 1)
    assert rule._lists is None
    # The whole lists, once asked for, are the mask's.
    assert torch.equal(rule.row_offsets, lists.row_offsets)
    assert torch.equal(rule.cols, lists.cols)
    assert rule.is_kv_efficient() == lists.is_kv_efficient()
    assert rule.is_union_complete() == lists.is_union_complete()
    assert torch.equal(rule[1:3].mask, lists[1:3].mask)  # from the built lists now


# ---------------------------------------------------------------------------- integer arguments
BUILDER_ARGS = dict(max_seq_len=256, block_size=16, local_blocks=2, vert_stride=4)
INTEGRAL = [np.int64, np.int32, torch.tensor, lambda n: torch.tensor(n, dtype=torch.int32)]


@pytest.mark.parametrize("integral", INTEGRAL, ids=["np.int64", "np.int32", "tensor", "int32"])
def test_builders_take_any_integral_type(integral):
    """numpy and torch integer scalars and 0-d integer tensors build the pattern of the same plain
    ints, which it holds as Python ints (its rules, its block size: no tensor or numpy scalar
    leaks into the layouts or the caches keyed on them)."""
    want = local_stride_pattern(4, num_kv_heads=2, num_dense_heads=2, head_offset=1, **BUILDER_ARGS)
    got = local_stride_pattern(
        integral(4),
        **{name: integral(value) for name, value in BUILDER_ARGS.items()},
        num_kv_heads=integral(2),
        num_dense_heads=integral(2),
        head_offset=integral(1),
    )
    assert got.rules == want.rules and torch.equal(got.mask, want.mask)
    assert type(got.block_size) is int and type(got.num_heads) is int
    assert all(type(x) is int for rule in got.rules for x in vars(rule).values())
    dense = dense_pattern(integral(3), max_seq_len=integral(100), block_size=integral(32))
    assert torch.equal(dense.mask, dense_pattern(3, max_seq_len=100, block_size=32).mask)
    masked = BlockPattern(want.mask, block_size=integral(16))
    assert type(masked.block_size) is int and torch.equal(masked.mask, want.mask)
    lists = BlockPattern.from_block_lists(
        torch.tensor([0, 1, 3]),
        torch.tensor([0, 0, 1]),
        num_heads=integral(1),
        num_kv_blocks=integral(2),
        block_size=integral(64),
    )
    assert lists.mask.tolist() == [[[True, False], [True, True]]]


@pytest.mark.parametrize("integral", INTEGRAL, ids=["np.int64", "np.int32", "tensor", "int32"])
def test_pattern_methods_take_any_integral_type(integral):
    p = local_stride_pattern(4, **BUILDER_ARGS)
    assert torch.equal(p.crop(integral(5)).mask, p.crop(5).mask)
    assert p.crop(integral(5)).num_q_blocks == 5
    assert p.density(integral(100)) == p.density(100)
    assert p.kept_token_pairs(integral(100)) == p.kept_token_pairs(100)
    assert torch.equal(p.token_mask(integral(40), integral(70)), p.token_mask(40, 70))
    assert p.draw(integral(1), max_blocks=integral(5)) == p.draw(1, max_blocks=5)
    got = p.block_coordinates(integral(5), slice(integral(1), integral(3)))
    assert all(torch.equal(a, b) for a, b in zip(got, p.block_coordinates(5, slice(1, 3))))
    got = p.row_blocks(integral(2), integral(3), integral(9))
    assert all(torch.equal(a, b) for a, b in zip(got, p.row_blocks(2, 3, 9)))
    assert torch.equal(p[integral(1) : integral(3)].mask, p[1:3].mask)
    assert p.is_union_complete(integral(1)) == p.is_union_complete(1)


NOT_INTEGERS = [True, 4.0, "4", torch.tensor(4.0), torch.tensor(True), np.float64(4)]
NOT_INTEGER_IDS = ["bool", "float", "str", "float-tensor", "bool-tensor", "np.float64"]


@pytest.mark.parametrize("bad", NOT_INTEGERS, ids=NOT_INTEGER_IDS)
@pytest.mark.parametrize(
    "arg",
    [
        "num_heads",
        "max_seq_len",
        "block_size",
        "local_blocks",
        "vert_stride",
        "num_kv_heads",
        "num_dense_heads",
        "head_offset",
    ],
)
def test_builders_refuse_non_integers_by_name(arg, bad):
    """A bool, a float (even a whole one) or a string is a slip, not a count: a TypeError that
    names the argument, never a pattern built from a truncated or coerced value."""
    args = dict(num_heads=4, **BUILDER_ARGS, num_kv_heads=2, num_dense_heads=0, head_offset=0)
    args[arg] = bad
    with pytest.raises(TypeError, match=f"{arg} must be an integer"):
        local_stride_pattern(**args)
    if arg in ("num_heads", "max_seq_len", "block_size"):
        args = dict(num_heads=4, max_seq_len=256, block_size=16)
        args[arg] = bad
        with pytest.raises(TypeError, match=f"{arg} must be an integer"):
            dense_pattern(**args)


@pytest.mark.parametrize("bad", NOT_INTEGERS, ids=NOT_INTEGER_IDS)
def test_pattern_methods_refuse_non_integers_by_name(bad):
    p = local_stride_pattern(4, **BUILDER_ARGS)
    calls = [
        ("num_blocks", lambda: p.crop(bad)),
        ("seq_len", lambda: p.density(bad)),
        ("seq_len", lambda: p.kept_token_pairs(bad)),
        ("seq_q", lambda: p.token_mask(bad, 64)),
        ("seq_k", lambda: p.token_mask(32, bad)),
        ("head", lambda: p.draw(bad)),
        ("max_blocks", lambda: p.draw(0, max_blocks=bad)),
        ("num_blocks", lambda: p.block_coordinates(bad)),
        ("head", lambda: p.row_blocks(bad, 0, 2)),
        ("first", lambda: p.row_blocks(0, bad, 2)),
        ("stop", lambda: p.row_blocks(0, 0, bad)),
        ("num_kv_heads", lambda: p.is_union_complete(bad)),
    ]
    for name, call in calls:
        with pytest.raises(TypeError, match=f"{name} must be an integer"):
            call()
    with pytest.raises(TypeError, match="causal must be a bool"):
        local_stride_pattern(4, **BUILDER_ARGS, causal=1)
    with pytest.raises(TypeError, match="homo_head must be a bool"):
        local_stride_pattern(4, **BUILDER_ARGS, homo_head=1)
    with pytest.raises(TypeError, match="causal must be a bool"):
        dense_pattern(4, max_seq_len=256, block_size=16, causal=1)


def test_builders_take_every_argument_after_the_head_count_by_keyword():
    """Four integers in a row are easy to swap; a swap must fail, not build another pattern."""
    with pytest.raises(TypeError, match="positional"):
        local_stride_pattern(32, 64, 8192, 16, 16)
    with pytest.raises(TypeError, match="positional"):
        dense_pattern(32, 8192, 64)


# ------------------------------------------------------------------------ effectively dense
@pytest.mark.parametrize(
    "kwargs, reason",
    [
        (
            dict(max_seq_len=2048, block_size=16, local_blocks=300, vert_stride=4),
            "local_blocks=300 covers all 128 blocks: the pattern is dense",
        ),
        (
            dict(max_seq_len=2048, block_size=16, local_blocks=4, vert_stride=1),
            "vert_stride=1 keeps every block: the pattern is dense",
        ),
        (
            dict(max_seq_len=128, block_size=128, local_blocks=1, vert_stride=4),
            "block_size=128 holds the whole sequence in one block: the pattern is dense",
        ),
        (
            dict(max_seq_len=2048, block_size=16, local_blocks=127, vert_stride=4, homo_head=True),
            "local_blocks=127 of 128 blocks leaves out only block 0, which every head's stripes",
        ),
        (
            dict(
                max_seq_len=2048,
                block_size=16,
                local_blocks=127,
                vert_stride=127,
                causal=False,
                homo_head=True,
            ),
            "leaves out only blocks 0 and 127",
        ),
        (
            dict(max_seq_len=2048, block_size=16, local_blocks=2, vert_stride=4, num_dense_heads=4),
            "num_dense_heads=4 makes every head dense: the pattern is dense",
        ),
    ],
    ids=["window", "stride-1", "one-block", "one-left-out", "bidir-two-left-out", "dense-heads"],
)
def test_pattern_that_is_dense_after_all_is_flagged(kwargs, reason):
    """Sparse arguments that keep every block cost what dense attention costs, and more: the
    builder warns with the reason, and the pattern's summary says so."""
    with pytest.warns(UserWarning, match=reason.replace("(", r"\(")) as caught:
        p = local_stride_pattern(4, **kwargs)
    assert len(caught) == 1
    assert caught[0].filename == __file__  # points at the caller's line
    assert p.density() == 1.0
    if "num_dense_heads" not in kwargs:  # dense heads are dense by their rules
        assert str(caught[0].message) == f"{p.dense_reason}: the pattern is dense"
        assert f"effectively dense: {p.dense_reason}" in repr(p)


def test_a_length_between_two_blocks_warns_with_both_numbers():
    """max_seq_len=1000 at blocks of 64 gives a pattern of 16 blocks, 1024 tokens: said, once,
    at the caller's line; a whole number of blocks says nothing."""
    args = dict(block_size=64, local_blocks=2, vert_stride=4)
    with pytest.warns(UserWarning) as caught:
        p = local_stride_pattern(4, max_seq_len=1000, **args)
    assert [str(w.message) for w in caught] == [
        "max_seq_len=1000 is not a multiple of block_size=64: the pattern covers 1024 tokens "
        "(16 blocks)"
    ]
    assert caught[0].filename == __file__
    assert p.num_q_blocks == 16
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert local_stride_pattern(4, max_seq_len=1024, **args).num_q_blocks == 16


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("heads, complete", [(2, False), (4, False), (16, True)])
def test_a_stride_past_the_blocks_warns_unless_the_heads_still_cover(heads, complete, causal):
    """vert_stride=16 over 8 blocks: each head keeps at most one stripe, so only as many heads
    as the stride (every residue) cover every block; fewer leave blocks no head attends, and
    the builder says so."""
    args = dict(max_seq_len=512, block_size=64, local_blocks=2, vert_stride=16, causal=causal)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        p = local_stride_pattern(heads, **args)
    assert p.is_union_complete() == complete
    expected = [
        "vert_stride=16 exceeds the 8 blocks of max_seq_len=512 (block_size=64): some visible "
        "blocks lie on no head's stripe, so the pattern is not union complete"
    ]
    assert [str(w.message) for w in caught] == ([] if complete else expected)
    assert all(w.filename == __file__ for w in caught)


def test_sparse_and_dense_patterns_do_not_warn():
    """dense_pattern is dense by request; a sparse pattern, even one with a dense head (the
    last window one block short, head 0's stripes on block 0) is sparse, and a crop to a few
    blocks is an internal view: none warns or says 'effectively dense'."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        patterns = [
            dense_pattern(4, max_seq_len=2048, block_size=16),
            dense_pattern(4, max_seq_len=100, block_size=128, causal=False),
            local_stride_pattern(
                4, max_seq_len=2048, block_size=16, local_blocks=127, vert_stride=4
            ),
            local_stride_pattern(4, **BUILDER_ARGS),
            local_stride_pattern(4, **BUILDER_ARGS, num_dense_heads=2),
        ]
        cropped = patterns[-1].crop(2)
    for p in patterns:
        assert p.dense_reason is None and "effectively dense" not in repr(p)
    assert patterns[2].density() < 1.0
    assert cropped.density() == 1.0 and "effectively dense" in repr(cropped)


@pytest.mark.parametrize("causal", [True, False])
def test_dense_check_from_the_rules_agrees_with_the_density(causal):
    """The check reads the rules, never the blocks (patterns reach millions of tokens); over every
    small case it flags exactly the patterns whose density is the dense one."""
    flagged = 0
    for nb, local_blocks, vert_stride in itertools.product(range(1, 7), range(1, 8), range(1, 5)):
        for head_offset in range(vert_stride):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                p = local_stride_pattern(
                    1,
                    max_seq_len=nb * 16,
                    block_size=16,
                    local_blocks=local_blocks,
                    vert_stride=vert_stride,
                    head_offset=head_offset,
                    causal=causal,
                )
            dense = p.density() == 1.0
            case = (nb, local_blocks, vert_stride, head_offset)
            assert (p.dense_reason is not None) == dense, case
            dense_warnings = [w for w in caught if "the pattern is dense" in str(w.message)]
            assert len(dense_warnings) == int(dense), case
            flagged += dense
    assert 0 < flagged


def test_dense_check_is_cheap_at_millions_of_tokens():
    """At 4M tokens the rules give the answer without building any block list."""
    with pytest.warns(UserWarning, match="vert_stride=1"):
        p = local_stride_pattern(
            32, max_seq_len=2**22, block_size=64, local_blocks=16, vert_stride=1
        )
    assert p._lists is None
    sparse = local_stride_pattern(
        32, max_seq_len=2**22, block_size=64, local_blocks=16, vert_stride=16
    )
    assert sparse.dense_reason is None and sparse._lists is None


# ------------------------------------------------------------------ checks against the mask
# The checks read a builder's rules or walk a pattern's lists; these oracles read the dense mask,
# as the checks once did, and must agree with them everywhere.
@functools.cache
def _visible_token_pairs_per_block(block_size: int, causal: bool, seq: int) -> torch.Tensor:
    """(blocks, blocks): the token pairs of one sequence that each block pair holds, causally
    visible, counted token by token."""
    pos = torch.arange(seq)
    pairs = torch.ones(seq, seq, dtype=torch.int64)
    if causal:
        pairs = (pos[:, None] >= pos[None, :]).long()
    nb = -(-seq // block_size)
    per_block = torch.zeros(nb, nb, dtype=torch.int64)
    per_block.index_put_((pos[:, None] // block_size, pos[None, :] // block_size), pairs, True)
    return per_block


def _oracle_token_pairs(mask: torch.Tensor, block_size: int, causal: bool, seq: int) -> int:
    per_block = _visible_token_pairs_per_block(block_size, causal, seq)
    nb = per_block.shape[0]
    return int((mask[:, :nb, :nb] * per_block).sum())


def _oracle_visible(mask: torch.Tensor, causal: bool) -> torch.Tensor:
    _, qb, kb = mask.shape
    if not causal:
        return mask
    return mask & (torch.arange(kb)[None, :] <= torch.arange(qb)[:, None])


def _oracle_kv_efficient(mask: torch.Tensor, causal: bool) -> bool:
    m = _oracle_visible(mask, causal)
    readers = m.sum(1)
    rows = torch.arange(m.shape[1])[None, :, None]
    first = torch.where(m, rows, m.shape[1]).amin(1)
    last = torch.where(m, rows, -1).amax(1)
    return bool(((readers == 0) | (last - first + 1 == readers)).all())


def _oracle_union_complete(mask: torch.Tensor, causal: bool, groups: int) -> bool:
    heads, qb, kb = mask.shape
    covered = _oracle_visible(mask, causal).view(groups, heads // groups, qb, kb).any(1)
    return bool((covered | ~_oracle_visible(torch.ones(1, qb, kb, dtype=torch.bool), causal)).all())


def _assert_checks_equal_the_mask(p: BlockPattern, mask: torch.Tensor, case) -> None:
    heads, qb, kb = mask.shape
    bs, causal = p.block_size, p.causal
    assert torch.equal(p.kept_blocks_per_head(), mask.sum((1, 2))), case
    assert p.num_kept_blocks == int(mask.sum()), case
    longest = min(qb, kb) * bs
    for seq in {1, bs - 1, bs, bs + 1, longest // 2 + 3, longest - 1, longest} - {0}:
        if not 0 < seq <= longest:
            continue
        kept = _oracle_token_pairs(mask, bs, causal, seq)
        assert p.kept_token_pairs(seq) == kept, (case, seq)
        visible = seq * (seq + 1) // 2 if causal else seq * seq
        assert p.density(seq) == kept / (visible * heads), (case, seq)
    assert p.is_kv_efficient() == _oracle_kv_efficient(mask, causal), case
    for groups in (g for g in range(1, heads + 1) if heads % g == 0):
        want = _oracle_union_complete(mask, causal, groups)
        assert p.is_union_complete(groups) == want, (case, groups)
    assert p.is_union_complete() == _oracle_union_complete(mask, causal, 1), case


def _definition_mask(num_heads, nb, **definition) -> torch.Tensor:
    """:func:`_local_stride_by_definition` over every entry at once."""
    h = torch.arange(num_heads)[:, None, None]
    i = torch.arange(nb)[None, :, None]
    j = torch.arange(nb)[None, None, :]
    g = h // definition["group_size"]
    causal = definition["causal"]
    visible = (j <= i) | (not causal)
    window = definition["local_blocks"]
    local = ((i - j >= 0) & (i - j < window)) if causal else ((i - j).abs() < window)
    shift = definition["head_offset"] + (0 if definition["homo_head"] else g)
    stripe = ((j + shift) % definition["vert_stride"] == 0) & visible
    dense = g >= definition["num_sparse_groups"]
    return torch.where(dense, visible, local | stripe)


def test_checks_from_the_rules_equal_the_mask_on_fuzzed_builders():
    """Random builder arguments, crops and head slices: every check read from the rules equals
    the dense-mask answer, and none builds the lists."""
    rng = np.random.default_rng(43)
    outcomes = collections.Counter()
    for case in range(300):
        num_kv_heads = int(rng.choice([1, 2, 3, 4]))
        group_size = int(rng.choice([1, 2]))
        num_heads = num_kv_heads * group_size
        gqa = bool(rng.integers(2)) or group_size == 1
        block_size = int(rng.choice([16, 32]))
        nb_full = int(rng.integers(1, 24))
        max_seq_len = int(rng.integers((nb_full - 1) * block_size + 1, nb_full * block_size + 1))
        dense_groups = int(rng.integers(0, num_kv_heads + 1)) if rng.random() < 0.3 else 0
        kwargs = dict(
            max_seq_len=max_seq_len,
            block_size=block_size,
            local_blocks=int(rng.integers(1, 8)),
            vert_stride=int(rng.integers(1, 9)),
            num_kv_heads=num_kv_heads if gqa else None,
            num_dense_heads=dense_groups * (group_size if gqa else 1),
            homo_head=bool(rng.random() < 0.2),
            head_offset=int(rng.integers(-9, 10)),
            causal=bool(rng.integers(2)),
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # patterns that are dense after all are fuzzed too
            p = local_stride_pattern(num_heads, **kwargs)
        groups = num_kv_heads if gqa else num_heads
        mask = _definition_mask(
            num_heads,
            p.num_q_blocks,
            group_size=num_heads // groups,
            num_sparse_groups=groups - kwargs["num_dense_heads"] // (num_heads // groups),
            local_blocks=kwargs["local_blocks"],
            vert_stride=kwargs["vert_stride"],
            homo_head=kwargs["homo_head"],
            head_offset=kwargs["head_offset"],
            causal=kwargs["causal"],
        )
        views = [(p, mask)]
        crop = int(rng.integers(1, p.num_q_blocks + 1))
        views.append((p.crop(crop), mask[:, :crop, :crop]))
        first = int(rng.integers(0, num_heads))
        stop = int(rng.integers(first + 1, num_heads + 1))
        views.append((p[first:stop], mask[first:stop]))
        views.append((p[first:stop].crop(crop), mask[first:stop, :crop, :crop]))
        for view, want in views:
            _assert_checks_equal_the_mask(view, want, (case, kwargs, crop, first, stop))
            assert view._lists is None
            outcomes[view.is_union_complete(), view.density() == 1.0] += 1
    assert len(outcomes) == 3  # complete and not, dense and not (dense is complete)


def test_checks_of_dense_patterns_equal_the_mask():
    for causal, max_seq_len, heads in itertools.product((True, False), (1, 16, 17, 100), (1, 3)):
        p = dense_pattern(heads, max_seq_len=max_seq_len, block_size=16, causal=causal)
        nb = p.num_q_blocks
        mask = torch.ones(heads, nb, nb, dtype=torch.bool)
        if causal:
            mask = mask.tril()
        _assert_checks_equal_the_mask(p, mask, (causal, max_seq_len, heads))


def _random_kv_efficient_mask(rng, heads, qb, kb) -> torch.Tensor:
    """Per head and KV block one run of query blocks, sometimes broken by a gap."""
    mask = torch.zeros(heads, qb, kb, dtype=torch.bool)
    for h, j in itertools.product(range(heads), range(kb)):
        a, b = sorted(rng.integers(0, qb + 1, size=2))
        mask[h, a:b, j] = True
        if rng.random() < 0.02 and b - a > 2:
            mask[h, int(rng.integers(a + 1, b - 1)), j] = False
    return mask


@pytest.mark.parametrize("walk_blocks", [3, 1 << 20])
def test_checks_of_block_lists_equal_the_mask(monkeypatch, walk_blocks):
    """Random user block lists, square or not, walked in small chunks of rows (a few blocks per
    step, rows split between steps) or whole: every check equals the dense-mask answer."""
    monkeypatch.setattr(block_lists, "WALK_BLOCKS", walk_blocks)
    rng = np.random.default_rng(7)
    outcomes = collections.Counter()
    for case in range(120):
        heads = int(rng.choice([1, 2, 4, 6]))
        qb, kb = (int(n) for n in rng.integers(1, 12, size=2))
        causal = bool(rng.integers(2))
        if case % 3 == 0:
            mask = _random_kv_efficient_mask(rng, heads, qb, kb)
        else:
            mask = torch.from_numpy(rng.random((heads, qb, kb)) < rng.choice([0.3, 0.8, 0.97]))
        if not mask.any(dim=(1, 2)).all() and rng.random() < 0.5:
            mask[:, 0, 0] = True
        block_size = int(rng.choice([16, 32]))
        offsets = torch.zeros(heads * qb + 1, dtype=torch.int64)
        offsets[1:] = mask.reshape(-1, kb).sum(1).cumsum(0)
        cols = mask.reshape(-1, kb).nonzero()[:, 1]
        p = BlockPattern.from_block_lists(
            offsets, cols, num_heads=heads, num_kv_blocks=kb, block_size=block_size, causal=causal
        )
        _assert_checks_equal_the_mask(p, mask, case)
        _assert_checks_equal_the_mask(BlockPattern(mask, block_size, causal=causal), mask, case)
        outcomes[p.is_kv_efficient(), p.is_union_complete()] += 1
    assert len(outcomes) == 4


def test_checks_at_millions_of_tokens_run_in_bounded_memory():
    """Every check of two 32-head patterns at 4M tokens, in a fresh process: well under 1 GB of
    host memory past the imports (the dense mask would be 16 TB; lists, gigabytes). Their time
    is benchmarks/pattern_checks.py's to measure."""
    code = """
import resource
import s2attn
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
for stride in (32, 64):
    p = s2attn.local_stride_pattern(
        32, max_seq_len=4194304, block_size=64, local_blocks=16, vert_stride=stride
    )
    assert 0 < p.density() < 0.1 and p.kept_token_pairs(4194304 - 5) > 0
    assert p.is_kv_efficient() and p.is_union_complete() == (stride == 32)
    assert not p.is_union_complete(8)
    assert p.num_kept_blocks == int(p.kept_blocks_per_head().sum()) > 0
    assert p[8:16].density() > 0 and p.crop(1000).is_union_complete() == (stride == 32)
    assert p._lists is None
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024)
"""
    import os
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=HANG_GUARD_S
    )
    assert out.returncode == 0, out.stderr
    mib = float(out.stdout)
    assert mib < 1024, mib


# ---------------------------------------------------------------- dense views, bounded memory
def _small_patterns():
    torch.manual_seed(0)
    yield BlockPattern(torch.rand(3, 5, 7) < 0.5, block_size=16)
    yield BlockPattern(torch.rand(2, 6, 6) < 0.5, block_size=16, causal=False)
    yield local_stride_pattern(4, max_seq_len=200, block_size=16, local_blocks=2, vert_stride=3)


# (the view, its bytes by the documented formula, what the error suggests instead); a view is
# called with max_bytes, None meaning the module's DENSE_VIEW_LIMIT.
def _token_mask_bytes(p, seq_q, seq_k):
    nb = -(-seq_k // p.block_size)
    causal = seq_q * seq_k if p.causal else 0
    return p.num_heads * (nb * nb + seq_q * nb + seq_q * seq_k) + causal


_DENSE_VIEWS = {
    "mask": (
        lambda p, max_bytes: p.mask,
        lambda p: p.num_heads * p.num_q_blocks * p.num_kv_blocks,
        "row_blocks",
    ),
    "effective_block_mask": (
        lambda p, max_bytes: p.effective_block_mask(max_bytes=max_bytes),
        lambda p: (p.num_heads + 1) * p.num_q_blocks * p.num_kv_blocks,
        "row_blocks",
    ),
    "token_mask": (
        lambda p, max_bytes: p.token_mask(40, 70, max_bytes=max_bytes),
        lambda p: _token_mask_bytes(p, 40, 70),
        "sparse_attention",
    ),
    "draw": (
        lambda p, max_bytes: p.draw(1, max_blocks=4, max_bytes=max_bytes),
        lambda p: 2 * 4 * (4 + 1),
        "smaller max_blocks",
    ),
}


@pytest.mark.parametrize(
    "view, by_argument",
    # A property takes no max_bytes: the mask's limit is the module's alone.
    [
        (view, by)
        for view in sorted(_DENSE_VIEWS)
        for by in (True, False)
        if view != "mask" or not by
    ],
)
def test_dense_views_refuse_past_their_limit_before_allocating(monkeypatch, view, by_argument):
    build, needed_of, instead = _DENSE_VIEWS[view]
    for p in _small_patterns():
        needed = needed_of(p)
        expected = build(p, None)
        for limit in (needed - 1, needed):
            if not by_argument:
                monkeypatch.setattr(pattern_module, "DENSE_VIEW_LIMIT", limit)
            max_bytes = limit if by_argument else None
            if limit < needed:
                with no_tensor_allocation(monkeypatch):
                    with pytest.raises(ValueError, match=f"{needed:,} bytes") as err:
                        build(p, max_bytes)
                assert f"limit of {limit:,} bytes" in str(err.value) and instead in str(err.value)
            else:
                got = build(p, max_bytes)
                assert got == expected if view == "draw" else torch.equal(got, expected)
        monkeypatch.undo()
    # The views are what they were: the limit only refuses.
    mask = torch.tensor([[[1, 0], [1, 1]], [[1, 1], [0, 1]]], dtype=torch.bool)
    p = BlockPattern(mask, block_size=16)
    assert torch.equal(p.effective_block_mask(), mask.tril())
    assert torch.equal(p.token_mask(32), _token_mask_by_hand(mask, 16, True, 32, 32))


def test_max_bytes_is_checked_by_name():
    p = dense_pattern(1, max_seq_len=64, block_size=16)
    with pytest.raises(ValueError, match="max_bytes"):
        p.token_mask(16, max_bytes=-1)
    with pytest.raises(TypeError, match="max_bytes"):
        p.effective_block_mask(max_bytes=1.5)


def test_dense_views_of_millions_of_tokens_refuse_at_once(monkeypatch):
    """At 4M tokens, the default limit refuses every dense view before it allocates (the mask
    alone would be 137 GB), builds no lists on the way, and draws from the drawn corner alone."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        p = local_stride_pattern(
            32, max_seq_len=4194304, block_size=64, local_blocks=16, vert_stride=32
        )
    with no_tensor_allocation(monkeypatch):
        with pytest.raises(ValueError, match="137,438,953,472 bytes"):
            _ = p.mask
        with pytest.raises(ValueError, match="DENSE_VIEW_LIMIT"):
            p.effective_block_mask()
        with pytest.raises(ValueError, match="token_mask"):
            p.token_mask(4194304)
        with pytest.raises(ValueError, match="token_mask"):
            p.token_mask(1, 4194304)  # one query row: still 32 heads of 65536^2 blocks
        with pytest.raises(ValueError, match="max_blocks"):
            p.draw(max_blocks=1 << 16)
    assert p._lists is None

    generated = []
    row_lists = LocalStrideRule.row_lists
    monkeypatch.setattr(
        LocalStrideRule,
        "row_lists",
        lambda rule, nb, *args, **kwargs: (
            generated.append(nb) or row_lists(rule, nb, *args, **kwargs)
        ),
    )
    small = local_stride_pattern(
        32, max_seq_len=64 * 64, block_size=64, local_blocks=16, vert_stride=32
    )
    for head in (0, 5):
        assert p.draw(head) == small.draw(head)
    assert generated and max(generated) == 64 and p._lists is None
