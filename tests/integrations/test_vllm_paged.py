"""S2 attention over vLLM's paged KV cache layout (s2attn.integrations.vllm_paged), without vLLM:
a cache laid out as vLLM's head-major pages with a shuffled block table, filled through a slot
mapping, read by the PyTorch path (any step) and the Triton decode kernel (GPU, or the CPU under
the interpreter), against the dense-mask reference on the contiguous keys. Pages the pattern
does not keep hold NaN, so a path that read one would fail."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import DEVICE, DTYPES, assert_close

from s2attn import attention_reference, local_stride_pattern
from s2attn.integrations.vllm_paged import (
    paged_attention_torch,
    paged_decode_triton,
    paged_prefill,
    split_kv_cache,
    write_kv,
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
    free = torch.randperm(num_blocks, generator=gen)
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
    got = path(q, kv_cache, table, starts, lengths, pattern, scale)
    want = reference(q, keys, values, num_new, pattern, scale)
    assert_close(got, want.to(got.dtype), dtype, f"vLLM layout, {path.__name__}")


@pytest.mark.skipif(not supports_triton(torch.device(DEVICE)), reason="needs the Triton kernels")
@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_decode_over_vllm_pages_matches_reference(dtype):
    pattern = local_stride_pattern(
        HEADS, max_seq_len=512, block_size=32, local_blocks=2, vert_stride=3, num_kv_heads=KV_HEADS
    )
    lengths = [300, 33, 161, 512]
    kv_cache, table, keys, values = make_cache(lengths, 32, dtype)
    assert poison_unread_pages(kv_cache, table, lengths, [1] * len(lengths), pattern) > 0
    q = torch.randn(len(lengths), HEADS, DIM, generator=torch.Generator().manual_seed(1))
    q = q.to(DEVICE, dtype)
    seq_lens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    scale = 1 / math.sqrt(DIM)
    got = paged_decode_triton(q, kv_cache, table, seq_lens, pattern, scale)
    want = reference(q, keys, values, [1] * len(lengths), pattern, scale)
    assert_close(got, want.to(got.dtype), dtype, "Triton decode over vLLM pages")


def test_triton_decode_needs_page_equal_to_block():
    pattern = local_stride_pattern(
        HEADS, max_seq_len=512, block_size=32, local_blocks=2, vert_stride=3, num_kv_heads=KV_HEADS
    )
    kv_cache, table, _, _ = make_cache([40], 16, torch.float32)
    q = torch.zeros(1, HEADS, DIM, device=DEVICE)
    seq_lens = torch.tensor([40], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="page .16 tokens. to equal the pattern's block .32."):
        paged_decode_triton(q, kv_cache, table, seq_lens, pattern, 1.0)


@pytest.mark.parametrize("path", [paged_attention_torch, paged_prefill], ids=["torch", "prefill"])
def test_paged_paths_refuse_requests_past_the_pattern(path):
    pattern = local_stride_pattern(
        HEADS, max_seq_len=64, block_size=32, local_blocks=1, vert_stride=3, num_kv_heads=KV_HEADS
    )
    kv_cache, table, _, _ = make_cache([80], 16, torch.float32)
    q = torch.zeros(1, HEADS, DIM, device=DEVICE)
    with pytest.raises(ValueError, match="past the pattern's max_seq_len 64"):
        path(q, kv_cache, table, [0, 1], [80], pattern, 1.0)


def test_split_kv_cache_checks_the_shape():
    with pytest.raises(ValueError, match="2 \\* head_dim"):
        split_kv_cache(torch.zeros(4, 2, 16, 33))
