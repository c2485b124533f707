"""The paged KV cache: eviction never frees a block the pattern reads later, live memory is what the
pattern needs within one block per head, pages are shared across the batch, chunked prefill equals
one pass, non-KV-efficient patterns keep everything (with a warning), and bad input is refused."""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest
import torch
from helpers import DEVICE, DTYPES, assert_close, no_tensor_allocation

import s2attn
from s2attn import (
    ModelKVCache,
    attention_reference,
    paged_kv_cache,
    sparse_attention_with_kvcache,
)
from s2attn.inference.eviction import EvictionSchedule, is_dense_pattern, kv_last_use

BS = 16
MAX_LEN = 192
NB = MAX_LEN // BS


def patterns(kv_heads: int, heads: int) -> dict[str, s2attn.BlockPattern]:
    return {
        "s2": s2attn.local_stride_pattern(
            heads,
            max_seq_len=MAX_LEN,
            block_size=BS,
            local_blocks=2,
            vert_stride=4,
            num_kv_heads=kv_heads,
        ),
        "per_query_head": s2attn.local_stride_pattern(
            heads, max_seq_len=MAX_LEN, block_size=BS, local_blocks=3, vert_stride=5
        ),
        "late_runs": late_runs_pattern(heads),
    }


def late_runs_pattern(heads: int) -> s2attn.BlockPattern:
    """KV-efficient, but some blocks are first read long after they were written, and some never."""
    i = torch.arange(NB)[:, None]
    j = torch.arange(NB)[None, :]
    masks = []
    for h in range(heads):
        late = j % 3 == h % 3  # read from 4 blocks after it is written, for 4 blocks
        local = ~late & (i - j >= 0) & (i - j < 2)
        never = j % 5 == 4  # never read at all
        masks.append((local | (late & (i >= j + 4) & (i < j + 8))) & ~never)
    return s2attn.BlockPattern(torch.stack(masks), BS)


def make_cache(pattern, batch, kv_heads, dim=16, dtype=torch.float32, **kwargs):
    return paged_kv_cache(
        pattern,
        batch_size=batch,
        num_kv_heads=kv_heads,
        head_dim=dim,
        dtype=dtype,
        device=DEVICE,
        block_size=BS,
        max_seq_len=MAX_LEN,
        **kwargs,
    )


def blocks_read_from(pattern: s2attn.BlockPattern, kv_heads: int) -> torch.Tensor:
    """(kv_heads, positions + 1, blocks) bool: does any query at a position >= p read block j,
    from the token mask (any head of the KV group, any key of the block)."""
    tm = pattern.token_mask(MAX_LEN)  # (heads, q, k)
    reads = tm.view(tm.shape[0], MAX_LEN, NB, BS).any(-1)  # (heads, q, blocks)
    reads = reads.view(kv_heads, -1, MAX_LEN, NB).any(1)
    suffix = reads.flip(1).cummax(1).values.flip(1)
    return torch.cat([suffix, torch.zeros(kv_heads, 1, NB, dtype=torch.bool)], dim=1)


def rand_kv(n, kv_heads, dim, dtype=torch.float32):
    return [torch.randn(n, kv_heads, dim, device=DEVICE, dtype=dtype) for _ in range(2)]


@pytest.mark.parametrize("kind", ["s2", "per_query_head", "late_runs"])
def test_eviction_keeps_exactly_what_the_pattern_reads(kind):
    torch.manual_seed(0)
    kv_heads, heads, dim = 2, 4, 16
    pattern = patterns(kv_heads, heads)[kind]
    assert pattern.is_kv_efficient()
    future = blocks_read_from(pattern, kv_heads)
    cache = make_cache(pattern, 2, kv_heads, dim)
    dense_k = [torch.zeros(0, kv_heads, dim, device=DEVICE) for _ in range(2)]
    # Prefill 20 and 33 tokens, then steps of 1..5 tokens up to the end, crossing every boundary.
    sizes = [[20, 33]] + [[n, n] for n in [1, 3, 5, 2, 4] * 12]
    for size in sizes:
        first = cache.lengths
        if first[1] + size[1] >= MAX_LEN:
            break
        ks = [rand_kv(n, kv_heads, dim) for n in size]
        cu = torch.tensor([0, *size], device=DEVICE).cumsum(0).to(torch.int32)
        prefill = first == [0, 0]
        keep_from = [a + n for a, n in zip(first, size)] if prefill else None
        cache.append(
            torch.cat([k for k, _ in ks]),
            torch.cat([v for _, v in ks]),
            cu_seqlens=cu,
            keep_from=keep_from,
        )
        for b in range(2):
            dense_k[b] = torch.cat([dense_k[b], ks[b][0]])
        # Every block some query from the first position still to attend on reads is present.
        table = cache.page_table.cpu()
        for b, n in enumerate(cache.lengths):
            written = math.ceil(n / BS)
            reader = keep_from[b] if prefill else first[b]
            need_now = future[:, reader, :written]
            present = table[b, :, :written] >= 0
            assert not (need_now & ~present).any(), f"{kind}: evicted a block still read ({b})"
            assert torch.equal(present, need_now), f"{kind}: holds blocks no query reads ({b})"
            if kind != "late_runs":
                # Local-stride patterns: the next position on reads all but one block per head.
                extra = (present & ~future[:, n, :written]).sum(dim=1)
                assert (extra <= 1).all(), f"{kind}: {extra.tolist()} unneeded pages ({b})"
        # The stored keys are the written ones.
        got, _, cu_k = cache.gather()
        for b in range(2):
            held = got[cu_k[b] : cu_k[b + 1]]
            stored = (table[b, 0] >= 0).repeat_interleave(BS)[: held.shape[0]].to(DEVICE)
            assert torch.equal(held[stored, 0], dense_k[b][stored, 0])
    assert cache.live_pages <= cache.needed_pages() + 2 * kv_heads
    assert cache.live_pages >= cache.needed_pages()


@pytest.mark.parametrize("kind", ["s2", "per_query_head", "late_runs", "dense"])
def test_eviction_schedule_matches_the_token_mask(kind):
    """Whether a query at query block q or later reads KV block j, for every q and j: the
    schedule's answer is the token mask's (any head of the KV group, any key of the block)."""
    kv_heads = 2
    pattern = (
        s2attn.dense_pattern(kv_heads, max_seq_len=MAX_LEN, block_size=BS)
        if kind == "dense"
        else None
    )
    pattern = pattern or patterns(kv_heads, 4)[kind]
    future = blocks_read_from(pattern, kv_heads)
    schedule = EvictionSchedule(pattern, kv_heads, NB)
    assert schedule.evicts == (kind != "dense")
    for q in range(NB):
        got = schedule.read_from(q, slice(0, NB))
        assert torch.equal(got, future[:, q * BS]), f"query block {q}"
    if kind == "dense":
        return
    # What a sequence may free when its queries move on from block a to block b: the blocks read
    # from a on but not from b on, in (head, block) order (the token mask's answer again).
    for a in range(NB):
        for b in range(a, NB + 1):
            heads, blocks = schedule.last_read_in(a, b)
            expected = future[:, a * BS] & ~future[:, b * BS]
            assert torch.equal(
                torch.stack([heads, blocks]), torch.stack(expected.nonzero(as_tuple=True))
            ), (a, b)


def test_default_pool_covers_the_peak_and_memory_report_adds_up():
    torch.manual_seed(1)
    pattern = patterns(2, 4)["s2"]
    cache = make_cache(pattern, 3, 2)
    last_use = kv_last_use(pattern, 2)
    per_head_peak = max(
        int(((last_use[g, : i + 1] >= i) & (last_use[g, : i + 1] >= torch.arange(i + 1))).sum())
        for g in range(2)
        for i in range(NB)
    )
    assert cache.num_pages <= 3 * 2 * (per_head_peak + 1)
    # A prefill stores only what later queries read; decode steps then store as they go.
    k, v = rand_kv(176, 2, 16)
    cu = torch.tensor([0, 176, 176, 352], device=DEVICE).to(torch.int32)
    cache.append(
        torch.cat([k, k[:0], k]), torch.cat([v, v[:0], v]), cu_seqlens=cu, keep_from=[176, 0, 176]
    )
    for _ in range(3):
        cache.append(*[x.new_zeros(3, 4, 2, 16) for x in (k, v)])
    assert cache.lengths == [188, 12, 188]
    report = cache.memory_report()
    assert report["live_bytes"] == cache.live_pages * cache.page_bytes
    assert report["live_bytes"] <= report["needed_bytes"] + 3 * 2 * cache.page_bytes
    assert report["dense_bytes"] == sum(cache.lengths) * 2 * 2 * 16 * 4
    assert report["live_bytes"] < report["dense_bytes"]
    assert report["capacity_bytes"] == cache.num_pages * cache.page_bytes


def test_pages_freed_by_one_sequence_serve_another():
    torch.manual_seed(2)
    pattern = s2attn.local_stride_pattern(
        2, max_seq_len=MAX_LEN, block_size=BS, local_blocks=2, vert_stride=64, num_kv_heads=1
    )  # window only
    # Two sequences, one KV head: decoding, each holds at most 3 pages (2 local blocks and
    # block 0, which the stride keeps). Sequence 0 starts with 100 tokens stored whole; its
    # first decode step frees 4 pages, which sequence 1 (starting empty) then takes.
    cache = make_cache(pattern, 2, 1, num_pages=10)
    k, v = rand_kv(100, 1, 16)
    cu = torch.tensor([0, 100, 100], device=DEVICE).to(torch.int32)
    cache.append(k, v, cu_seqlens=cu, keep_from=[0, 0])  # its own queries read it: kept whole
    assert cache.live_pages == 7
    owners: dict[int, set[int]] = {}
    for step in range(MAX_LEN - 100):
        if step:
            cache.append(torch.stack([k[:1], k[:1]]), torch.stack([v[:1], v[:1]]))
            assert cache.live_pages <= 6
        table = cache.page_table.cpu()
        for b in range(2):
            for page in table[b, 0][table[b, 0] >= 0].tolist():
                owners.setdefault(page, set()).add(b)
    assert any(len(seqs) == 2 for seqs in owners.values()), "no page moved between sequences"
    with pytest.raises(RuntimeError, match="exhausted"):
        small = make_cache(pattern, 2, 1, num_pages=3)
        k2, v2 = rand_kv(40, 1, 16)
        small.append(torch.stack([k2, k2]), torch.stack([v2, v2]))


def test_non_kv_efficient_pattern_warns_and_keeps_everything():
    torch.manual_seed(3)
    mask = torch.ones(2, NB, NB, dtype=torch.bool).tril()
    mask[:, 5, 0] = False  # block 0: read by query blocks 0-4, not 5, again from 6: a gap
    pattern = s2attn.BlockPattern(mask, BS)
    assert not pattern.is_kv_efficient()
    with pytest.warns(UserWarning, match="not KV-efficient"):
        cache = make_cache(pattern, 1, 2, dtype=DTYPES[0])
    cache2 = make_cache(pattern, 1, 2, dtype=DTYPES[0])  # warned once per pattern
    assert not cache.kv_efficient and cache2.num_pages == 2 * NB
    k, v = rand_kv(100, 2, 16, DTYPES[0])
    out_ref_inputs = [torch.randn(1, 100, 2, 16, device=DEVICE, dtype=DTYPES[0]), k[None], v[None]]
    out = sparse_attention_with_kvcache(out_ref_inputs[0], cache, k[None], v[None])
    assert cache.live_pages == 2 * math.ceil(100 / BS)
    ref = attention_reference(*out_ref_inputs, pattern)
    assert_close(out, ref, DTYPES[0], "non-KV-efficient prefill")


@pytest.mark.parametrize("dense", ["none", "dense_pattern"])
def test_dense_layer_keeps_everything(dense):
    pattern = (
        None if dense == "none" else s2attn.dense_pattern(2, max_seq_len=MAX_LEN, block_size=BS)
    )
    cache = make_cache(pattern, 2, 2)
    assert cache.dense and cache.num_pages == 2 * 2 * NB
    k, v = rand_kv(150, 2, 16)
    cache.append(torch.stack([k, k]), torch.stack([v, v]))
    assert cache.live_pages == 2 * 2 * math.ceil(150 / BS)
    got, _, _ = cache.gather()
    assert torch.equal(got[:150], k)


def _dense_by_mask(pattern) -> bool:
    tril = torch.ones(pattern.num_q_blocks, pattern.num_kv_blocks, dtype=torch.bool).tril()
    return bool(pattern.mask[:, tril].all())


@pytest.mark.filterwarnings("ignore:.*the pattern is dense:UserWarning")
def test_dense_pattern_is_told_from_rules_and_lists_as_by_the_mask():
    """A cache keeps everything for a pattern that keeps every visible block, whether built
    dense, dense by its rules (a window over everything, stride 1, every head dense), cropped to
    where its window covers all, or given as a mask; one missing block makes it sparse."""
    seq, bs = 512, 64
    lsp = functools.partial(s2attn.local_stride_pattern, 4, max_seq_len=seq, block_size=bs)
    tril = torch.ones(8, 8, dtype=torch.bool).tril().expand(4, 8, 8).clone()
    holed = tril.clone()
    holed[2, 5, 1] = False
    cases = {
        "dense": s2attn.dense_pattern(4, max_seq_len=seq, block_size=bs),
        "window over all": lsp(local_blocks=8, vert_stride=4),
        "stride 1": lsp(local_blocks=2, vert_stride=1),
        "every head dense": lsp(local_blocks=2, vert_stride=3, num_dense_heads=4),
        "some heads dense": lsp(local_blocks=2, vert_stride=3, num_dense_heads=2),
        "sparse": lsp(local_blocks=2, vert_stride=3),
        "cropped into its window": lsp(local_blocks=3, vert_stride=8).crop(3),
        "cropped past it": lsp(local_blocks=3, vert_stride=8).crop(6),
        "mask": s2attn.BlockPattern(tril, bs, causal=True),
        "mask with a hole": s2attn.BlockPattern(holed, bs, causal=True),
    }
    got = {name: is_dense_pattern(p) for name, p in cases.items()}
    assert got == {name: _dense_by_mask(p) for name, p in cases.items()}
    dense = [name for name, is_dense in got.items() if is_dense]
    assert dense == ["dense", "window over all", "stride 1", "every head dense"] + [
        "cropped into its window",
        "mask",
    ]


def test_dense_pattern_check_reads_the_rules_alone(monkeypatch):
    """At 1M tokens and 32 heads (16,384 blocks a head) the rules answer without a tensor: the
    blocks themselves would be 143 million coordinates."""
    pattern = s2attn.local_stride_pattern(
        32, max_seq_len=2**20, block_size=64, local_blocks=16, vert_stride=32
    )
    with no_tensor_allocation(monkeypatch):
        assert not is_dense_pattern(pattern)
        assert is_dense_pattern(s2attn.dense_pattern(32, max_seq_len=2**20, block_size=64))


@pytest.mark.parametrize("filter_writes", [False, True])
def test_chunked_prefill_equals_one_pass(filter_writes, monkeypatch):
    if filter_writes:  # the path long prompts take: unstored rows dropped before the write
        monkeypatch.setattr(s2attn.inference.cache, "_FILTER_WRITES_ABOVE", 0)
    torch.manual_seed(4)
    heads, kv_heads, dim, dtype = 4, 2, 16, DTYPES[0]
    pattern = patterns(kv_heads, heads)["s2"]
    lens = [70, 45]
    qs = [torch.randn(n, heads, dim, device=DEVICE, dtype=dtype) for n in lens]
    ks = [torch.randn(n, kv_heads, dim, device=DEVICE, dtype=dtype) for n in lens]
    vs = [torch.randn(n, kv_heads, dim, device=DEVICE, dtype=dtype) for n in lens]

    def cu(counts):
        return torch.tensor([0, *counts], device=DEVICE).cumsum(0).to(torch.int32)

    one = make_cache(pattern, 2, kv_heads, dim, dtype)
    out_one = sparse_attention_with_kvcache(
        torch.cat(qs), one, torch.cat(ks), torch.cat(vs), cu_seqlens_q=cu(lens)
    )
    ref = attention_reference(
        torch.cat(qs),
        torch.cat(ks),
        torch.cat(vs),
        pattern,
        cu_seqlens_q=cu(lens),
        cu_seqlens_k=cu(lens),
    )
    assert_close(out_one, ref, dtype, "one-pass prefill")

    chunked = make_cache(pattern, 2, kv_heads, dim, dtype)
    starts, outs = [0, 0], [[], []]
    for chunk in ([30, 0], [25, 20], [15, 25]):  # bottom-right aligned on each past
        pick = [slice(s, s + n) for s, n in zip(starts, chunk)]
        q, k, v = (torch.cat([x[p] for x, p in zip(xs, pick)]) for xs in (qs, ks, vs))
        out = sparse_attention_with_kvcache(q, chunked, k, v, cu_seqlens_q=cu(chunk))
        for b, (o, n) in enumerate(zip(out.split(chunk), chunk)):
            outs[b].append(o)
            starts[b] += n
    out_chunked = torch.cat([torch.cat(o) for o in outs])
    assert_close(out_chunked, out_one.double(), dtype, "chunked vs one-pass")
    assert chunked.lengths == one.lengths
    assert chunked.live_pages == one.live_pages == one.needed_pages()
    for a, b in zip(chunked.gather(), one.gather()):
        assert torch.equal(a, b)
    # A batched chunk of 20 more tokens after the varlen past, then the caches still agree.
    q = torch.randn(2, 20, heads, dim, device=DEVICE, dtype=dtype)
    k, v = (torch.randn(2, 20, kv_heads, dim, device=DEVICE, dtype=dtype) for _ in range(2))
    assert torch.equal(
        sparse_attention_with_kvcache(q, chunked, k, v), sparse_attention_with_kvcache(q, one, k, v)
    )


def test_crop_and_reset():
    pattern = patterns(2, 4)["s2"]
    cache = make_cache(pattern, 2, 2)
    k, v = rand_kv(50, 2, 16)
    cache.append(torch.stack([k, k]), torch.stack([v, v]), keep_from=[50, 50])
    pages = cache.live_pages
    cache.append(*[x.new_zeros(2, 20, 2, 16) for x in (k, v)], keep_from=[50, 50])
    cache.crop(20)
    assert cache.lengths == [50, 50] and cache.live_pages == pages
    assert cache.seq_lens.tolist() == [50, 50]
    with pytest.raises(ValueError, match="already evicted"):
        cache.crop(40)
    cache.reset()
    assert cache.lengths == [0, 0] and cache.live_pages == 0
    assert (cache.page_table == -1).all()


def test_model_cache_sums_its_layers():
    pattern = patterns(2, 4)["s2"]
    caches = ModelKVCache(
        [None, pattern, pattern],
        batch_size=1,
        num_kv_heads=2,
        head_dim=16,
        dtype=torch.float32,
        device=DEVICE,
        max_seq_len=MAX_LEN,
        block_size=BS,
    )
    k, v = rand_kv(100, 2, 16)
    for layer in caches:
        layer.append(k[None], v[None], keep_from=[100])
    assert len(caches) == 3 and caches[0].dense and not caches[1].dense
    assert caches.live_bytes() == sum(layer.live_bytes() for layer in caches)
    assert caches.memory_report()["dense_bytes"] == caches.dense_bytes() == 3 * 100 * 2 * 2 * 16 * 4
    assert caches[1].live_bytes() < caches[0].live_bytes()


def test_bad_inputs_name_the_argument():
    pattern = patterns(2, 4)["s2"]
    kw = dict(batch_size=1, num_kv_heads=2, head_dim=16, device=DEVICE)
    with pytest.raises(ValueError, match="batch_size"):
        paged_kv_cache(pattern, **{**kw, "batch_size": 0})
    with pytest.raises(TypeError, match="dtype"):
        paged_kv_cache(pattern, **kw, dtype=torch.int8)
    with pytest.raises(TypeError, match="pattern"):
        paged_kv_cache("local", **kw)
    with pytest.raises(ValueError, match="causal"):
        paged_kv_cache(s2attn.BlockPattern(torch.ones(2, 4, 4, dtype=torch.bool), BS, False), **kw)
    with pytest.raises(ValueError, match="not a multiple of num_kv_heads"):
        paged_kv_cache(pattern, **{**kw, "num_kv_heads": 3})
    with pytest.raises(ValueError, match="max_seq_len"):
        paged_kv_cache(pattern, **kw, max_seq_len=MAX_LEN + 1)
    with pytest.raises(ValueError, match="block_size"):
        paged_kv_cache(pattern, **kw, block_size=32)
    with pytest.raises(ValueError, match="block_size and max_seq_len"):
        paged_kv_cache(None, **kw)
    cache = paged_kv_cache(pattern, **kw, dtype=torch.float32)
    k = torch.zeros(1, 4, 2, 16, device=DEVICE)
    with pytest.raises(TypeError, match="k has dtype"):
        cache.append(k.half(), k.half())
    with pytest.raises(ValueError, match="differ in shape"):
        cache.append(k, k[:, :2])
    with pytest.raises(ValueError, match="kv_heads=2"):
        cache.append(k[:, :, :1], k[:, :, :1])
    with pytest.raises(ValueError, match="cu_seqlens"):
        cache.append(k[0], k[0], cu_seqlens=torch.tensor([0, 3], dtype=torch.int32))
    with pytest.raises(ValueError, match="keep_from"):
        cache.append(k, k, keep_from=[5])
    with pytest.raises(ValueError, match="max_seq_len"):
        big = torch.zeros(1, MAX_LEN + 1, 2, 16, device=DEVICE)
        cache.append(big, big)
    assert cache.lengths == [0] and cache.live_pages == 0


def test_page_write_reads_new_tokens_past_2_31_elements():
    """The decode step's page write takes the new K/V at any strides: sequence 2 of a batch
    2^30 elements apart (views into a buffer never filled, virtual memory on the CPU) sits at
    2^31, which needs 64-bit offsets, or its token is read from elsewhere."""
    from s2attn.ops.triton.page_write import write_pages

    dtype, dim, page, batch = DTYPES[0], 16, 16, 3
    buf = torch.empty((batch - 1) * 2**30 + 2 * dim, dtype=dtype, device=DEVICE)
    k, v = (
        buf.as_strided((batch, 1, 1, dim), (2**30, dim, dim, 1), storage_offset=i * dim)
        for i in range(2)
    )
    gen = torch.Generator().manual_seed(0)
    for t in (k, v):
        t.copy_(torch.randn(t.shape, generator=gen).to(DEVICE, dtype))
    k_pages, v_pages = (torch.zeros(batch, page, dim, dtype=dtype, device=DEVICE) for _ in "kv")
    page_table = torch.arange(batch, dtype=torch.int32, device=DEVICE).view(batch, 1, 1)
    seq_lens = torch.tensor([3, 5, 7], dtype=torch.int32, device=DEVICE)
    write_pages(k, v, k_pages, v_pages, page_table, seq_lens)
    for b, pos in enumerate(seq_lens.tolist()):
        assert torch.equal(k_pages[b, pos], k[b, 0, 0]) and torch.equal(v_pages[b, pos], v[b, 0, 0])
    assert k_pages.count_nonzero() == v_pages.count_nonzero() == batch * dim


@pytest.mark.parametrize("advance", [False, True])
@pytest.mark.parametrize("num_new", [1, 3])
def test_page_write_matches_the_reference_and_advances_in_its_launch(num_new, advance):
    """Every (new token, KV head) row lands in its block's page, across a block boundary, with
    3 KV heads (rows not a power of two) and a block that has no page (skipped); with advance
    the lengths move past the new tokens in the same launch, else they stay."""
    from s2attn.ops.cpu import write_pages as write_pages_reference
    from s2attn.ops.triton.page_write import write_pages

    dtype, dim, page, batch, kv_heads, blocks = DTYPES[0], 16, 4, 2, 3, 4
    gen = torch.Generator().manual_seed(num_new)
    k, v = (
        torch.randn(batch, num_new, kv_heads, dim, generator=gen).to(DEVICE, dtype) for _ in "kv"
    )
    pages = batch * kv_heads * blocks
    table = torch.arange(pages, dtype=torch.int32).view(batch, kv_heads, blocks)
    table[1, 2, 1] = -1  # sequence 1's third KV head keeps no block 1
    table = table.to(DEVICE)
    seq_lens = torch.tensor([2, 3], dtype=torch.int32, device=DEVICE)  # crossing into block 1
    # One spare page past the pool: where the reference puts writes to blocks without a page.
    k_pages, v_pages = (torch.zeros(pages + 1, page, dim, dtype=dtype, device=DEVICE) for _ in "kv")
    want_k, want_v = k_pages.clone(), v_pages.clone()
    write_pages_reference(k, v, want_k, want_v, table, seq_lens.clone())
    lens = seq_lens.clone()
    write_pages(k, v, k_pages, v_pages, table, lens, advance=advance)
    assert torch.equal(k_pages[:-1], want_k[:-1]) and torch.equal(v_pages[:-1], want_v[:-1])
    assert not k_pages[-1].any()  # a block without a page is not written anywhere
    assert lens.tolist() == (seq_lens + num_new if advance else seq_lens).tolist()


def test_page_write_past_the_tables_end_writes_nowhere():
    """A token past the page table's last block (a step the static cache should have refused)
    is dropped: its entry would be the next KV head's first page, which must keep its rows; the
    tokens before it still land."""
    from s2attn.ops.triton.page_write import write_pages

    dtype, dim, page, kv_heads, blocks = DTYPES[0], 16, 4, 2, 2
    gen = torch.Generator().manual_seed(7)
    k, v = (torch.randn(1, 3, kv_heads, dim, generator=gen).to(DEVICE, dtype) for _ in "kv")
    table = torch.arange(kv_heads * blocks, dtype=torch.int32, device=DEVICE)
    table = table.view(1, kv_heads, blocks)
    seq_lens = torch.tensor([blocks * page - 1], dtype=torch.int32, device=DEVICE)
    k_pages, v_pages = (
        torch.full((kv_heads * blocks, page, dim), 7.0, dtype=dtype, device=DEVICE) for _ in "kv"
    )
    write_pages(k, v, k_pages, v_pages, table, seq_lens)
    for h in range(kv_heads):
        last = int(table[0, h, -1])
        assert torch.equal(k_pages[last, -1], k[0, 0, h]) and torch.equal(
            v_pages[last, -1], v[0, 0, h]
        )
    untouched = torch.ones(kv_heads * blocks, page, dtype=torch.bool)
    untouched[table[0, :, -1].long().cpu(), -1] = False
    assert (k_pages.cpu()[untouched] == 7.0).all() and (v_pages.cpu()[untouched] == 7.0).all()


def test_device_defaults_to_the_gpu_when_there_is_one_else_the_cpu():
    """No device named: the pools land where the machine can hold them (a pattern is host
    metadata and names none), so the same code runs on a laptop and on a GPU node; the first
    append and attention over the cache work there."""
    pattern = patterns(2, 4)["s2"]
    kw = dict(batch_size=1, num_kv_heads=2, head_dim=16, dtype=torch.float32)
    want = "cuda" if torch.cuda.is_available() else "cpu"
    cache = paged_kv_cache(pattern, **kw)
    assert cache.device.type == want
    assert all(t.device.type == want for t in (cache.k_pages, cache.page_table, cache.seq_lens))
    caches = ModelKVCache([None, pattern], **kw, max_seq_len=MAX_LEN, block_size=BS)
    assert all(layer.device.type == want for layer in caches)
    k, v = (t.to(cache.device) for t in rand_kv(40, 2, 16))
    q = torch.randn(1, 40, 4, 16, device=cache.device)
    out = sparse_attention_with_kvcache(q, cache, k[None], v[None])
    ref = attention_reference(q, k[None], v[None], pattern)
    assert_close(out, ref, torch.float32, "attention over a cache on the default device")


def test_integral_sizes_of_any_type():
    pattern = patterns(2, 4)["s2"]
    cache = paged_kv_cache(
        pattern,
        batch_size=torch.tensor(2),
        num_kv_heads=np.int64(2),
        head_dim=np.int32(16),
        max_seq_len=np.int64(MAX_LEN),
        num_pages=torch.tensor(40),
        device=DEVICE,
    )
    assert (cache.batch_size, cache.num_kv_heads, cache.head_dim) == (2, 2, 16)
    assert cache.k_pages.shape == (41, BS, 16) and cache.max_seq_len == MAX_LEN
    with pytest.raises(TypeError, match="head_dim must be an integer"):
        paged_kv_cache(pattern, batch_size=1, num_kv_heads=2, head_dim=16.0, device=DEVICE)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
@pytest.mark.parametrize("device", ["cuda", "cuda:0", torch.device("cuda")])
def test_cuda_without_cuda_is_refused_by_name(device):
    """Not torch's 'AssertionError: Torch not compiled with CUDA enabled' from deep inside."""
    pattern = patterns(2, 4)["s2"]
    kw = dict(batch_size=1, num_kv_heads=2, head_dim=16, device=device)
    with pytest.raises(ValueError, match="device=.cuda.*CUDA is not available"):
        paged_kv_cache(pattern, **kw)
    with pytest.raises(ValueError, match="device=.cuda.*CUDA is not available"):
        ModelKVCache([pattern], **kw)


def test_unknown_device_is_refused_by_name():
    pattern = patterns(2, 4)["s2"]
    with pytest.raises(ValueError, match="device must name a torch device"):
        paged_kv_cache(pattern, batch_size=1, num_kv_heads=2, head_dim=16, device="gpu")
