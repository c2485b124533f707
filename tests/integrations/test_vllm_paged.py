"""S2 attention over vLLM's paged KV cache layout (s2attn.integrations.vllm_paged), without vLLM:
a cache laid out as vLLM's head-major pages with a shuffled block table, filled through a slot
mapping, read by the PyTorch path (any step) and the Triton decode kernel (GPU, or the CPU under
the interpreter), against the dense-mask reference on the contiguous keys. Pages the pattern
does not keep hold NaN, so a path that read one would fail."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from helpers import DEVICE, DTYPES, assert_close

from s2attn import attention_reference, local_stride_pattern
from s2attn.integrations.vllm_paged import (
    DecodeBuffers,
    StripeLayout,
    kv_head_pages,
    mixed_decodes,
    paged_attention_torch,
    paged_decode_triton,
    paged_prefill,
    split_kv_cache,
    stripe_layout,
    stripe_pages,
    write_decode_kv,
    write_kv,
    write_stripes,
)
from s2attn.ops.decode_layout import group_block_mask
from s2attn.ops.dispatch import supports_triton

HEADS, KV_HEADS, DIM = 4, 2, 32


def make_cache(lengths, page, dtype, seed=0):
    """vLLM's cache for requests of ``lengths`` tokens, each request's pages scattered over a
    shuffled block table; returns the cache, the table, and each request's contiguous k, v."""
    gen = torch.Generator().manual_seed(seed)
    width = max(-(-n // page) for n in lengths) + 1
    num_blocks = len(lengths) * width + 8  # spare blocks that no request owns
    kv_cache = torch.full((num_blocks, KV_HEADS, page, 2 * DIM), float("nan"), dtype=dtype)
    kv_cache = kv_cache.to(DEVICE)
    # Block 0 is vLLM's null block, which no request owns (padding writes land there).
    free = torch.randperm(num_blocks - 1, generator=gen) + 1
    block_table = free[: len(lengths) * width].view(len(lengths), width).to(torch.int32)
    keys, values = [], []
    for r, n in enumerate(lengths):
        k = torch.randn(n, KV_HEADS, DIM, generator=gen).to(DEVICE, dtype)
        v = torch.randn(n, KV_HEADS, DIM, generator=gen).to(DEVICE, dtype)
        pos = torch.arange(n)
        slots = block_table[r, pos // page].to(torch.int64) * page + pos % page
        slots = torch.cat([slots, torch.tensor([-1, -1])])  # vLLM pads the batch with -1
        pad = torch.zeros(2, KV_HEADS, DIM, dtype=dtype, device=DEVICE)
        write_kv(torch.cat([k, pad]), torch.cat([v, pad]), kv_cache, slots.to(DEVICE))
        keys.append(k)
        values.append(v)
    return kv_cache, block_table.to(DEVICE), keys, values


def poison_unread_pages(kv_cache, block_table, lengths, num_new, pattern):
    """NaN in every page of a (request, KV head) whose KV block no new query of it keeps;
    returns how many pages that poisoned."""
    key_cache, value_cache = split_kv_cache(kv_cache)
    page, block = key_cache.shape[2], pattern.block_size
    masks = group_block_mask(pattern, KV_HEADS)
    poisoned = 0
    for r, (n, new) in enumerate(zip(lengths, num_new)):
        q_blocks = slice((n - new) // block, (n - 1) // block + 1)
        for h in range(KV_HEADS):
            kept = masks[h, :, q_blocks].any(dim=0).any(dim=0)
            for j in range(-(-n // block)):
                if not kept[j]:
                    for p in range(j * block // page, (j + 1) * block // page):
                        key_cache[block_table[r, p], h] = float("nan")
                        value_cache[block_table[r, p], h] = float("nan")
                        poisoned += 1
    return poisoned


def reference(q_rows, keys, values, num_new, pattern, scale):
    """Each request's new queries (its last positions) over its contiguous keys, in float64."""
    outs, start = [], 0
    for k, v, new in zip(keys, values, num_new):
        q = q_rows[start : start + new].double()[None]
        outs.append(
            attention_reference(
                q, k.double()[None], v.double()[None], pattern, softmax_scale=scale
            )[0]
        )
        start += new
    return torch.cat(outs)


@pytest.mark.parametrize("path", [paged_attention_torch, paged_prefill], ids=["torch", "prefill"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page", [16, 32])
def test_paged_paths_match_reference(path, dtype, page):
    """A step mixing a prefill, chunks after a past and decodes, pages of 16 under 32-blocks,
    through the PyTorch path and through sparse_attention (the forward kernel on a GPU); pages no
    new query keeps hold NaN."""
    pattern = local_stride_pattern(
        HEADS, max_seq_len=512, block_size=32, local_blocks=2, vert_stride=3, num_kv_heads=KV_HEADS
    )
    lengths, num_new = [200, 300, 161, 97, 64], [200, 45, 1, 1, 33]
    kv_cache, table, keys, values = make_cache(lengths, page, dtype)
    assert poison_unread_pages(kv_cache, table, lengths, num_new, pattern) > 0
    q = torch.randn(sum(num_new), HEADS, DIM, generator=torch.Generator().manual_seed(1))
    q = q.to(DEVICE, dtype)
    starts = [0, *torch.tensor(num_new).cumsum(0).tolist()]
    scale = 1 / math.sqrt(DIM)
    got = path(q, kv_cache, kv_head_pages(table, KV_HEADS), starts, lengths, pattern, scale)
    want = reference(q, keys, values, num_new, pattern, scale)
    assert_close(got, want.to(got.dtype), dtype, f"vLLM layout, {path.__name__}")


@pytest.mark.skipif(not supports_triton(torch.device(DEVICE)), reason="needs the Triton kernels")
@pytest.mark.parametrize("dtype", DTYPES)
def test_mixed_step_sends_single_token_requests_to_the_decode_kernel(dtype):
    """A GPU's prefill step: its requests of one new token through the decode kernel, the rest
    through paged_prefill (which leaves their rows alone); together the reference, with the pages
    no new query keeps poisoned."""
    pattern = local_stride_pattern(
        HEADS, max_seq_len=512, block_size=32, local_blocks=2, vert_stride=3, num_kv_heads=KV_HEADS
    )
    lengths, num_new = [200, 300, 161, 97, 64], [200, 45, 1, 1, 33]
    kv_cache, table, keys, values = make_cache(lengths, 32, dtype)
    poison_unread_pages(kv_cache, table, lengths, num_new, pattern)
    q = torch.randn(sum(num_new), HEADS, DIM, generator=torch.Generator().manual_seed(1))
    q = q.to(DEVICE, dtype)
    starts = [0, *torch.tensor(num_new).cumsum(0).tolist()]
    scale = 1 / math.sqrt(DIM)
    pages = kv_head_pages(table, KV_HEADS)
    mixed = mixed_decodes(starts, lengths, KV_HEADS, DEVICE)
    assert mixed.host == {2, 3} and mixed.tokens.tolist() == [starts[2], starts[3]]
    assert mixed.seq_lens.tolist() == [161, 97] and mixed.positions.tolist() == [160, 96]
    assert mixed.requests.tolist() == [2, 3] and mixed.seq_lens.dtype == torch.int32
    assert mixed_decodes(list(starts), list(lengths), KV_HEADS, DEVICE) is mixed  # other groups
    out = torch.full_like(q, float("nan"))
    out[mixed.tokens] = paged_decode_triton(
        q[mixed.tokens], kv_cache, mixed.batch(pages), pattern, scale
    )
    paged_prefill(q, kv_cache, pages, starts, lengths, pattern, scale, skip=mixed.host, out=out)
    want = reference(q, keys, values, num_new, pattern, scale)
    assert_close(out, want.to(out.dtype), dtype, "a mixed step")
    assert mixed_decodes([0, 5, 9], [5, 9], KV_HEADS, DEVICE) is None
    again = mixed_decodes(starts, [n + 1 for n in lengths], KV_HEADS, DEVICE)
    assert again is not mixed and again.seq_lens.tolist() == [162, 98]


@pytest.mark.skipif(not supports_triton(torch.device(DEVICE)), reason="needs the Triton kernels")
@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_decode_over_vllm_pages_matches_reference(dtype):
    """A batch padded as vLLM pads a CUDA graph's (requests of length 0 on the null block): the
    real requests match the reference, and every batch reads the buffers' own counters (a
    captured graph reads their address)."""
    pattern = local_stride_pattern(
        HEADS, max_seq_len=512, block_size=32, local_blocks=2, vert_stride=3, num_kv_heads=KV_HEADS
    )
    lengths = [300, 33, 161, 512]
    kv_cache, table, keys, values = make_cache(lengths, 32, dtype)
    assert poison_unread_pages(kv_cache, table, lengths, [1] * len(lengths), pattern) > 0
    padded = torch.cat([table, torch.zeros_like(table[:2])])
    seq_lens = torch.tensor([*lengths, 0, 0], dtype=torch.int32, device=DEVICE)
    buffers = DecodeBuffers(8, KV_HEADS, torch.device(DEVICE))
    earlier = buffers.batch(padded.flip(0), seq_lens.flip(0))
    batch = buffers.batch(padded, seq_lens)
    assert batch.split_counters.data_ptr() == earlier.split_counters.data_ptr()
    assert batch.split_counters.data_ptr() == buffers.split_counters.data_ptr()
    assert torch.equal(batch.page_table, kv_head_pages(padded, KV_HEADS))
    assert batch.seq_lens.tolist() == [*lengths, 1, 1]
    q = torch.randn(len(lengths) + 2, HEADS, DIM, generator=torch.Generator().manual_seed(1))
    q = q.to(DEVICE, dtype)
    scale = 1 / math.sqrt(DIM)
    got = paged_decode_triton(q, kv_cache, batch, pattern, scale)[: len(lengths)]
    want = reference(q, keys, values, [1] * len(lengths), pattern, scale)
    assert_close(got, want.to(got.dtype), dtype, "Triton decode over vLLM pages")


def test_decode_buffers_refuse_a_batch_past_their_size():
    buffers = DecodeBuffers(2, KV_HEADS, torch.device(DEVICE))
    lengths = torch.ones(3, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="a step of 3 requests exceeds the decode buffers' 2"):
        buffers.batch(torch.zeros(3, 4, dtype=torch.int32, device=DEVICE), lengths)


@pytest.mark.skipif(not supports_triton(torch.device(DEVICE)), reason="needs the Triton kernels")
@pytest.mark.parametrize("width", [7, 300, 600], ids=["narrow", "two-programs", "three-programs"])
def test_decode_batches_compose_the_tables_stripe_pages_does(width):
    """DecodeBuffers.batch's one launch against the torch composition, on random tables wider and
    narrower than one program's blocks, with stripes apart and without; a padding request
    (length 0) reads as length 1 from vLLM's null block, whatever its row of the tables holds."""
    gen = torch.Generator().manual_seed(width)
    requests, period = 5, 4
    window = torch.randint(0, 10_000, (requests, width), generator=gen, dtype=torch.int32)
    stripe_table = torch.randint(0, 10_000, (requests, -(-width // period)), generator=gen)
    stripe_table = stripe_table.to(torch.int32)
    seq_lens = torch.tensor([0, 1, 64, 900, 5], dtype=torch.int32)
    window, stripe_table, seq_lens = (t.to(DEVICE) for t in (window, stripe_table, seq_lens))
    stripes = StripeLayout(period, (3, 0))
    offsets = stripes.offsets_on(DEVICE)
    buffers = DecodeBuffers(8, KV_HEADS, torch.device(DEVICE))
    batch = buffers.batch(window, seq_lens, stripe_table, stripes, offsets)
    null = kv_head_pages(torch.zeros_like(window[:1]), KV_HEADS)
    want = stripe_pages(window, stripe_table, period, offsets)
    assert torch.equal(batch.page_table[1:], want[1:])
    assert torch.equal(batch.page_table[:1], null)
    assert batch.seq_lens.tolist() == [1, 1, 64, 900, 5]
    assert batch.positions.tolist() == [0, 0, 63, 899, 4]
    union = buffers.batch(window, seq_lens)
    assert torch.equal(union.page_table[1:], kv_head_pages(window[1:], KV_HEADS))
    assert torch.equal(union.page_table[:1], null)


def test_padding_slots_write_only_the_null_block():
    """vLLM's -1 slots land in block 0, which no request owns; every other page is as written."""
    kv_cache, table, keys, _ = make_cache([40, 70], 16, torch.float32)
    before = kv_cache.clone()
    k = torch.randn(3, KV_HEADS, DIM, device=DEVICE)
    write_kv(k, k, kv_cache, torch.tensor([-1, -1, -1], device=DEVICE))
    assert torch.equal(kv_cache[1:].nan_to_num(7.0), before[1:].nan_to_num(7.0))
    # Which of the duplicate writes lands is unspecified on a GPU.
    assert any(torch.equal(split_kv_cache(kv_cache)[0][0, :, 0], row) for row in k)


def test_triton_decode_needs_page_equal_to_block():
    pattern = local_stride_pattern(
        HEADS, max_seq_len=512, block_size=32, local_blocks=2, vert_stride=3, num_kv_heads=KV_HEADS
    )
    kv_cache, table, _, _ = make_cache([40], 16, torch.float32)
    q = torch.zeros(1, HEADS, DIM, device=DEVICE)
    seq_lens = torch.tensor([40], dtype=torch.int32, device=DEVICE)
    batch = DecodeBuffers(1, KV_HEADS, torch.device(DEVICE)).batch(table, seq_lens)
    with pytest.raises(ValueError, match="page .16 tokens. to equal the pattern's block .32."):
        paged_decode_triton(q, kv_cache, batch, pattern, 1.0)


@pytest.mark.parametrize("path", [paged_attention_torch, paged_prefill], ids=["torch", "prefill"])
def test_paged_paths_refuse_requests_past_the_pattern(path):
    pattern = local_stride_pattern(
        HEADS, max_seq_len=64, block_size=32, local_blocks=1, vert_stride=3, num_kv_heads=KV_HEADS
    )
    kv_cache, table, _, _ = make_cache([80], 16, torch.float32)
    q = torch.zeros(1, HEADS, DIM, device=DEVICE)
    with pytest.raises(ValueError, match="past the pattern's max_seq_len 64"):
        path(q, kv_cache, kv_head_pages(table, KV_HEADS), [0, 1], [80], pattern, 1.0)


def test_split_kv_cache_checks_the_shape():
    with pytest.raises(ValueError, match="2 \\* head_dim"):
        split_kv_cache(torch.zeros(4, 2, 16, 33))


def striped_pattern():
    """Blocks of 32, a local window of 2, stride 4 over 2 KV heads: stripe_cache's pattern."""
    return local_stride_pattern(
        HEADS, max_seq_len=512, block_size=32, local_blocks=2, vert_stride=4, num_kv_heads=KV_HEADS
    )


def stripe_cache(dtype, lengths=(300, 161)):
    """Two requests of ``lengths`` as a layer whose KV heads keep their stripes apart stores
    them (KV heads 0 and 1 keep blocks 0 and 3 of every 4 apart): every token
    in the window group's pages, each head's stripe blocks also in the stripe group's pages (one
    per period of 4 blocks, from the spare blocks), then NaN in the window pages of every head's
    stripe blocks, which that head must read from its stripe pages."""
    pattern = striped_pattern()
    stripes = stripe_layout(pattern, KV_HEADS, 4)
    offsets = stripes.offsets_on(DEVICE)
    lengths = list(lengths)
    kv_cache, window_table, keys, values = make_cache(lengths, 32, dtype)
    spare = sorted(set(range(1, kv_cache.shape[0])) - set(window_table.flatten().tolist()))
    stripe_table = torch.tensor(spare[:6], dtype=torch.int32, device=DEVICE).view(2, 3)
    for r, n in enumerate(lengths):
        pos = torch.arange(n, device=DEVICE)
        slots = stripe_table[r, pos // 128].to(torch.int64) * 128 + pos % 128
        write_stripes(keys[r], values[r], kv_cache, slots, 4, offsets)
    key_cache, value_cache = split_kv_cache(kv_cache)
    for r, n in enumerate(lengths):
        for h, offset in enumerate(stripes.offsets):
            for j in range(offset, -(-n // 32), 4):
                key_cache[window_table[r, j], h] = float("nan")
                value_cache[window_table[r, j], h] = float("nan")
    table = stripe_pages(window_table, stripe_table, 4, offsets)
    return pattern, stripes, kv_cache, table, keys, values, lengths, window_table, stripe_table


def test_stripe_offsets_are_each_kv_heads_stripe_residue():
    pattern = striped_pattern()
    stripes = stripe_layout(pattern, KV_HEADS, 4)
    masks = group_block_mask(pattern, KV_HEADS)
    last = pattern.num_q_blocks - 1
    for h, offset in enumerate(stripes.offsets):
        read_at_end = masks[h, :, last].any(dim=0).nonzero().flatten().tolist()
        far = [j for j in read_at_end if j < last - 2]  # behind the local window
        assert far and all(j % 4 == offset for j in far)


@pytest.mark.parametrize("dtype", DTYPES)
def test_kv_heads_read_their_stripes_from_the_stripe_pages(dtype):
    """Per KV head page tables (stripe_pages) over a cache written by write_kv and write_stripes:
    the PyTorch path, and the Triton decode kernel where it runs, match the reference though
    every head's stripe blocks are NaN in the window pages."""
    pattern, _, kv_cache, table, keys, values, lengths, *_ = stripe_cache(dtype)
    q = torch.randn(len(lengths), HEADS, DIM, generator=torch.Generator().manual_seed(3))
    q = q.to(DEVICE, dtype)
    scale = 1 / math.sqrt(DIM)
    want = reference(q, keys, values, [1] * len(lengths), pattern, scale)
    got = paged_attention_torch(q, kv_cache, table, [0, 1, 2], lengths, pattern, scale)
    assert_close(got, want.to(got.dtype), dtype, "stripe pages, PyTorch path")
    if supports_triton(torch.device(DEVICE)):
        seq_lens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
        batch = DecodeBuffers(2, KV_HEADS, torch.device(DEVICE)).batch(
            torch.zeros(2, table.shape[2], dtype=torch.int32, device=DEVICE), seq_lens
        )
        batch = dataclasses.replace(batch, page_table=table)
        got = paged_decode_triton(q, kv_cache, batch, pattern, scale)
        assert_close(got, want.to(got.dtype), dtype, "stripe pages, Triton decode")


@pytest.mark.skipif(not supports_triton(torch.device(DEVICE)), reason="needs the Triton kernels")
@pytest.mark.parametrize("stripes", [False, True], ids=["union", "stripes"])
def test_decode_writes_land_where_the_decode_reads(stripes):
    """write_decode_kv stores each request's newest token through the step's per-KV-head table
    (with stripes apart, a head's stripe block in its stripe page): with those rows poisoned
    first, attention through the same table matches the reference, and nothing but those rows
    and the null block (the padding request's) changes."""
    dtype = torch.float32
    if stripes:
        pattern, _, kv_cache, table, keys, values, lengths, *_ = stripe_cache(dtype)
    else:
        pattern = striped_pattern()
        lengths = [300, 161]
        kv_cache, window_table, keys, values = make_cache(lengths, 32, dtype)
        table = kv_head_pages(window_table, KV_HEADS)
    key_cache, value_cache = split_kv_cache(kv_cache)
    k_pages, v_pages = key_cache.flatten(0, 1), value_cache.flatten(0, 1)
    targets = set()
    for r, n in enumerate(lengths):
        for h in range(KV_HEADS):
            page, row = int(table[r, h, (n - 1) // 32]), (n - 1) % 32
            k_pages[page, row] = v_pages[page, row] = float("nan")
            targets.add((page, row))
    padded = torch.cat([table, kv_head_pages(torch.zeros_like(table[:1, 0]), KV_HEADS)])
    seq_lens = torch.tensor([*lengths, 0], dtype=torch.int32, device=DEVICE)
    batch = DecodeBuffers(3, KV_HEADS, torch.device(DEVICE)).batch(
        torch.zeros_like(padded[:, 0]), seq_lens
    )
    batch = dataclasses.replace(batch, page_table=padded)
    assert batch.positions.tolist() == [lengths[0] - 1, lengths[1] - 1, 0]
    before = kv_cache.clone()
    junk = torch.randn(1, KV_HEADS, DIM, device=DEVICE)
    new_k = torch.cat([torch.stack([k[-1] for k in keys]), junk])
    new_v = torch.cat([torch.stack([v[-1] for v in values]), junk])
    write_decode_kv(new_k, new_v, kv_cache, batch)

    for now, then in zip(split_kv_cache(kv_cache), split_kv_cache(before)):
        changed = (now.nan_to_num(7.0) != then.nan_to_num(7.0)).any(dim=-1)  # (block, h, row)
        for block, h, row in changed.nonzero().tolist():
            assert block == 0 or (block * KV_HEADS + h, row) in targets
    q = torch.randn(len(lengths), HEADS, DIM, generator=torch.Generator().manual_seed(3))
    q = q.to(DEVICE, dtype)
    scale = 1 / math.sqrt(DIM)
    want = reference(q, keys, values, [1] * len(lengths), pattern, scale)
    got = paged_attention_torch(q, kv_cache, table, [0, 1, 2], lengths, pattern, scale)
    assert_close(got, want.to(got.dtype), dtype, "decode writes through the step's table")


def test_prefill_builds_a_patterns_mask_once(monkeypatch):
    """Every S2 layer of a model shares its pattern, and each prefill chunk asks for its mask:
    built once per pattern (it takes seconds at 128k)."""
    import s2attn.integrations.vllm_paged as vllm_paged

    pattern = local_stride_pattern(
        HEADS, max_seq_len=512, block_size=32, local_blocks=2, vert_stride=3, num_kv_heads=KV_HEADS
    )
    built = []
    build = vllm_paged.group_block_mask
    monkeypatch.setattr(vllm_paged, "group_block_mask", lambda *a: built.append(a) or build(*a))
    kv_cache, table, _, _ = make_cache([96], 32, torch.float32)
    pages = kv_head_pages(table, KV_HEADS)
    q = torch.randn(32, HEADS, DIM, device=DEVICE)
    for _ in range(3):
        paged_attention_torch(q, kv_cache, pages, [0, 32], [96], pattern, 1.0)
    assert len(built) == 1
