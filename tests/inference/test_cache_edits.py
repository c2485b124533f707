"""The paged KV cache in serving use (issue 18): the default pool holds one append or prefill of the
whole max_seq_len, a pool too small raises naming the pages needed and leaves the cache as it was,
and crop, a full cache, reset between requests and two caches used alternately either work (decode
compared with the reference over every key) or raise and change nothing."""

from __future__ import annotations

import re

import pytest
import torch
from helpers import DEVICE, DTYPES, assert_close

import s2attn
from s2attn import PagedKVCache, attention_reference, paged_kv_cache, sparse_attention_with_kvcache

BS = 16
MAX_LEN = 160
HEADS, KV_HEADS, DIM = 4, 2, 16
DTYPE = DTYPES[0]


def s2_pattern(max_len: int = MAX_LEN) -> s2attn.BlockPattern:
    return s2attn.local_stride_pattern(
        HEADS,
        max_seq_len=max_len,
        block_size=BS,
        local_blocks=2,
        vert_stride=3,
        num_kv_heads=KV_HEADS,
    )


def make_cache(pattern, batch, max_len=MAX_LEN, dtype=DTYPE, **kwargs) -> PagedKVCache:
    return paged_kv_cache(
        pattern,
        batch_size=batch,
        num_kv_heads=KV_HEADS,
        head_dim=DIM,
        dtype=dtype,
        device=DEVICE,
        block_size=BS,
        max_seq_len=max_len,
        **kwargs,
    )


def state(cache: PagedKVCache) -> dict:
    """Everything an append or crop may change, copied."""
    return {
        "lengths": cache.lengths,
        "seq_lens": cache.seq_lens.tolist(),
        "table": cache._table.clone(),
        "page_table": cache.page_table.cpu(),
        "free": cache.pool.free_pages(),
        "keep": list(cache._keep_block),
    }


def assert_unchanged(cache: PagedKVCache, before: dict) -> None:
    after = state(cache)
    for key, value in before.items():
        same = torch.equal(value, after[key]) if torch.is_tensor(value) else value == after[key]
        assert same, f"{key} changed"


class Request:
    """A cache's batch with every token's q/k/v kept, so each step can be checked against the
    reference over the whole (uncropped) context."""

    def __init__(self, cache: PagedKVCache, pattern: s2attn.BlockPattern):
        self.cache, self.pattern = cache, pattern
        self.qkv = [[torch.zeros(0, h, DIM, device=DEVICE) for h in (HEADS, KV_HEADS, KV_HEADS)]
                    for _ in range(cache.batch_size)]  # fmt: skip

    def _new(self, counts):
        return [
            [torch.randn(n, h, DIM, device=DEVICE, dtype=self.cache.dtype) for h in (HEADS,
             KV_HEADS, KV_HEADS)] for n in counts
        ]  # fmt: skip

    def prefill(self, counts: list[int]) -> None:
        new = self._new(counts)
        cu = torch.tensor([0, *counts], device=DEVICE).cumsum(0).to(torch.int32)
        q, k, v = (torch.cat([x[i] for x in new]) for i in range(3))
        out = sparse_attention_with_kvcache(q, self.cache, k, v, cu_seqlens_q=cu)
        self._extend(new)
        self._check(out.split(counts), counts, "prefill")

    def step(self, num_new: int = 1, what: str = "decode") -> None:
        new = self._new([num_new] * self.cache.batch_size)
        q, k, v = (torch.stack([x[i] for x in new]) for i in range(3))
        out = sparse_attention_with_kvcache(q, self.cache, k, v)
        self._extend(new)
        self._check(list(out), [num_new] * len(new), what)

    def crop(self, num_tokens: int) -> None:
        self.cache.crop(num_tokens)
        self.qkv = [[x[: x.shape[0] - num_tokens] for x in seq] for seq in self.qkv]

    def _extend(self, new) -> None:
        self.qkv = [
            [torch.cat([a, b.float()]) for a, b in zip(s, n)] for s, n in zip(self.qkv, new)
        ]

    def _check(self, outs, counts, what) -> None:
        assert self.cache.lengths == [s[0].shape[0] for s in self.qkv]
        for b, (out, n) in enumerate(zip(outs, counts)):
            q, k, v = (x[None] for x in self.qkv[b])
            ref = attention_reference(q, k, v, self.pattern)[0, q.shape[1] - n :]
            assert_close(out, ref, self.cache.dtype, f"{what}, sequence {b}")


# ------------------------------------------------------------------------ pool sizing
@pytest.mark.parametrize("batch", [1, 2])
def test_one_append_of_max_seq_len_fits_the_default_pool(batch):
    """Filling a cache in one append (or one prefill) of its whole length keeps only what later
    queries read; appends that stop short of the end then decode to the end in the same pool."""
    torch.manual_seed(0)
    pattern = s2_pattern()
    cache = make_cache(pattern, batch, dtype=torch.float32)
    assert cache.num_pages == cache.default_num_pages() < batch * KV_HEADS * (MAX_LEN // BS)
    k = torch.randn(batch, MAX_LEN, KV_HEADS, DIM, device=DEVICE)
    cache.append(k, k)
    assert cache.lengths == [MAX_LEN] * batch and cache.live_pages == cache.needed_pages()
    cache.reset()
    q = torch.randn(batch, MAX_LEN, HEADS, DIM, device=DEVICE)
    out = sparse_attention_with_kvcache(q, cache, k, k)
    assert_close(out, attention_reference(q, k, k, pattern), torch.float32, "whole prefill")
    # One append short of the end, then single tokens to the end: never more than the pool.
    cache.reset()
    cache.append(k[:, :-20], k[:, :-20])
    for t in range(MAX_LEN - 20, MAX_LEN):
        cache.append(k[:, t : t + 1], k[:, t : t + 1])
        if t + 1 < MAX_LEN:  # at the end no later query reads anything
            assert cache.live_pages <= cache.needed_pages() + batch * KV_HEADS
    got, _, cu = cache.gather()
    table = cache.page_table.cpu()
    for b in range(batch):  # what is held is what was written
        held = (table[b, 0] >= 0).repeat_interleave(BS).to(DEVICE)
        assert torch.equal(got[cu[b] : cu[b + 1]][held, 0], k[b][held, 0])


def test_filled_cache_decodes_like_the_reference():
    torch.manual_seed(1)
    pattern = s2_pattern()
    req = Request(make_cache(pattern, 2), pattern)
    k = torch.randn(2, 100, KV_HEADS, DIM, device=DEVICE, dtype=DTYPE)
    req.cache.append(k, k)  # filled by one append, not through attention
    req.qkv = [[torch.randn(100, HEADS, DIM, device=DEVICE), k[b].float(), k[b].float()]
               for b in range(2)]  # fmt: skip
    for _ in range(3):
        req.step()


def test_too_small_pool_names_the_size_and_changes_nothing():
    torch.manual_seed(2)
    pattern = s2_pattern()
    k = torch.randn(1, 90, KV_HEADS, DIM, device=DEVICE)
    small = make_cache(pattern, 1, dtype=torch.float32, num_pages=6)
    small.append(k[:, :40], k[:, :40], keep_from=[40])
    before = state(small)
    # Kept for queries from 50 on, the next 50 tokens need more pages than the pool has,
    # although the same append would also free blocks no query from 50 on reads.
    with pytest.raises(RuntimeError, match=r"num_pages >= (\d+)") as info:
        small.append(k[:, 40:], k[:, 40:], keep_from=[50])
    assert_unchanged(small, before)
    assert "num_pages=6" in str(info.value)
    needed = int(re.search(r"num_pages >= (\d+)", str(info.value)).group(1))
    enough = make_cache(pattern, 1, dtype=torch.float32, num_pages=needed)
    enough.append(k[:, :40], k[:, :40], keep_from=[40])
    enough.append(k[:, 40:], k[:, 40:], keep_from=[50])
    assert enough.live_pages == needed
    # The cache that refused still works.
    small.append(k[:, 40:41], k[:, 40:41])
    assert small.lengths == [41]


# ------------------------------------------------------------------------- cache edits
def test_crop_then_decode_and_crop_too_far():
    torch.manual_seed(3)
    pattern = s2_pattern()
    req = Request(make_cache(pattern, 2), pattern)
    req.prefill([50, 35])  # different lengths per sequence
    for _ in range(4):
        req.step()
    req.step(3, "speculative step")
    req.crop(3)  # the rejected speculative tokens
    req.step(1, "decode after crop")
    # Cropping across a block boundary, back to where the cache still serves queries.
    cache = req.cache
    allowed = min(n - b * BS for n, b in zip(cache.lengths, cache._keep_block))
    assert allowed > 1
    req.crop(allowed)
    req.step(2, "decode after a long crop")
    before = state(cache)
    allowed = min(n - b * BS for n, b in zip(cache.lengths, cache._keep_block))
    with pytest.raises(ValueError, match="already evicted"):
        cache.crop(allowed + 1)
    with pytest.raises(ValueError, match="num_tokens"):
        cache.crop(1000)
    assert_unchanged(cache, before)
    req.step(1, "decode after refused crops")


def test_full_cache_refuses_the_next_step_and_changes_nothing():
    torch.manual_seed(4)
    max_len = 64
    pattern = s2_pattern(max_len)
    req = Request(make_cache(pattern, 2, max_len=max_len), pattern)
    req.prefill([max_len - 2, max_len - 2])
    req.step(2, "steps to the last position")
    before = state(req.cache)
    q = torch.randn(2, 1, HEADS, DIM, device=DEVICE, dtype=DTYPE)
    k = torch.randn(2, 1, KV_HEADS, DIM, device=DEVICE, dtype=DTYPE)
    with pytest.raises(ValueError, match="max_seq_len"):
        sparse_attention_with_kvcache(q, req.cache, k, k)
    with pytest.raises(ValueError, match="max_seq_len"):
        req.cache.append(k, k)
    assert_unchanged(req.cache, before)
    req.crop(1)
    req.step(1, "decode after crop of a full cache")


@pytest.mark.parametrize("static", [False, True])
def test_steps_after_a_checked_step_still_refuse_bad_inputs(static, monkeypatch):
    """A decode step whose inputs match the last checked step's skips the checks (host time):
    every other input still goes through them, raises by name and changes nothing, also after
    steps that skipped them and after the batch changed under the same shapes."""
    from s2attn.inference import attention

    torch.manual_seed(6)
    pattern = s2_pattern()
    req = Request(make_cache(pattern, 2, static=static), pattern)
    req.prefill([37, 20])
    checks = []
    validate = attention._validate
    monkeypatch.setattr(attention, "_validate", lambda *a: checks.append(1) or validate(*a))
    for _ in range(3):
        req.step(1, "steps of one shape")
    assert len(checks) == 1, "steps of the first step's inputs check them again"
    cache = req.cache
    before = state(cache)
    q = torch.randn(2, 1, HEADS, DIM, device=DEVICE, dtype=DTYPE)
    k = torch.randn(2, 1, KV_HEADS, DIM, device=DEVICE, dtype=DTYPE)
    bad = [
        (TypeError, "k has dtype", (q, k.double(), k.double(), None)),
        (TypeError, "q has dtype", (q.double(), k, k, None)),
        (ValueError, "kv_heads", (q, k[:, :, :1], k[:, :, :1], None)),
        (ValueError, "differ in shape", (q, k, k[:1], None)),
        (ValueError, "softmax_scale", (q, k, k, torch.tensor([0.5, 0.25]))),
        (ValueError, "softmax_scale", (q, k, k, float("nan"))),
        (TypeError, "q must be a torch.Tensor", (q.tolist(), k, k, None)),
        (ValueError, r"q must be \(batch=2", (q[:1], k[:1], k[:1], None)),
    ]
    for error, match, (qb, kb, vb, scale) in bad:
        with pytest.raises(error, match=match):
            sparse_attention_with_kvcache(qb, cache, kb, vb, softmax_scale=scale)
        assert_unchanged(cache, before)
    req.step(1, "a step after the refusals")
    if not static:
        # One sequence left: the last step's shapes now name the wrong batch.
        cache.select_sequences([1])
        req.qkv = req.qkv[1:]
        with pytest.raises(ValueError, match=r"q must be \(batch=1"):
            sparse_attention_with_kvcache(q, cache, k, k)
        req.step(1, "a step after the batch changed")


def test_reset_between_requests_and_two_caches_alternately():
    torch.manual_seed(5)
    pattern = s2_pattern()
    dense = s2attn.dense_pattern(KV_HEADS, max_seq_len=MAX_LEN, block_size=BS)
    a = Request(make_cache(pattern, 2), pattern)
    b = Request(make_cache(None, 1), dense)
    a.prefill([40, 20])
    b.prefill([33])
    for _ in range(3):  # interleaved steps: neither cache sees the other's state
        a.step()
        b.step()
    a.cache.reset()
    assert a.cache.live_pages == 0 and a.cache.lengths == [0, 0]
    a = Request(a.cache, pattern)  # a new request in the same cache
    a.prefill([18, 51])
    a.step()
    b.step()


# ------------------------------------------------------------------------- beam reorder
def assert_counts_match(cache: PagedKVCache) -> None:
    held = cache._table[cache._table >= 0].long()
    counts = torch.bincount(held, minlength=cache.num_pages).to(torch.int32)
    assert torch.equal(counts, cache.pool.holders()), "page counts differ from the table"
    free = torch.tensor(cache.pool.free_pages(), dtype=torch.int64)
    assert (counts[free] == 0).all() and free.unique().numel() == free.numel()
    assert cache.live_pages == int((counts > 0).sum())


def test_reordered_sequences_share_pages_and_copy_on_write():
    torch.manual_seed(6)
    pattern = s2_pattern()
    req = Request(make_cache(pattern, 3), pattern)
    req.prefill([40, 24, 57])  # every sequence ends inside a block
    req.step()
    cache = req.cache
    own = [int((cache._table[b] >= 0).sum()) for b in range(3)]
    # Beam search's reorder: sequence 2 is dropped, sequence 0 continues twice.
    order = [0, 0, 1]
    cache.select_sequences(torch.tensor(order))
    req.qkv = [req.qkv[i] for i in order]
    assert cache.live_pages == own[0] + own[1] and cache.pool.holders().max() == 2
    assert_counts_match(cache)
    # Both copies of sequence 0 write different tokens into their shared last block.
    req.step(1, "decode after reorder")
    assert cache.live_pages == own[0] + own[1] + KV_HEADS  # the shared block was copied
    assert_counts_match(cache)
    for _ in range(BS):  # across a block boundary and an eviction
        req.step()
    assert_counts_match(cache)
    cache.select_sequences([2, 1, 1])  # the repeat frees what only the first copy held
    req.qkv = [req.qkv[i] for i in (2, 1, 1)]
    assert_counts_match(cache)
    req.step(2, "decode after a second reorder")
    assert_counts_match(cache)
    # Fewer sequences (batch_select_indices), then more (batch_repeat_interleave).
    cache.select_sequences([1])
    req.qkv = [req.qkv[1]]
    req.step(1, "decode after selecting one sequence")
    cache.select_sequences([0, 0])
    req.qkv = [req.qkv[0], req.qkv[0]]
    req.step(1, "decode after repeating it")
    assert_counts_match(cache)
    # More sequences than the cache was built with: the decode kernel's split counters (one per
    # sequence and KV head, indexed by its atomics) follow the batch.
    cache.select_sequences([1, 0, 1, 0])
    req.qkv = [req.qkv[i] for i in (1, 0, 1, 0)]
    assert cache.split_counters.shape == (4 * KV_HEADS,) and not cache.split_counters.any()
    req.step(1, "decode after growing the batch")
    assert_counts_match(cache)
    before = state(cache)
    with pytest.raises(ValueError, match="indices"):
        cache.select_sequences([0, 4])
    with pytest.raises(ValueError, match="indices"):
        cache.select_sequences(torch.zeros(2))
    assert_unchanged(cache, before)
    cache.reset()
    assert cache.live_pages == 0 and not cache.pool.holders().any()


@pytest.mark.parametrize("static", [False, True])
def test_bad_edit_arguments_name_the_argument_and_change_nothing(static):
    """A gather's lengths, a reorder's indices and an append's keep_from are refused by name,
    with the cache left as it was."""
    torch.manual_seed(7)
    pattern = s2_pattern()
    req = Request(make_cache(pattern, 2, static=static), pattern)
    req.prefill([40, 24])
    cache = req.cache
    before = state(cache)
    for lengths in ([41, 24], [40], [-1, 0]):
        with pytest.raises(ValueError, match=re.escape("lengths must give 0 <= n <= the held")):
            cache.gather(lengths)
    for indices in ([], [0, 2], [0, 1.0], torch.zeros(2, 1, dtype=torch.int64)):
        with pytest.raises(ValueError, match="indices must be"):
            cache.select_sequences(indices)
    k = torch.zeros(2, 1, KV_HEADS, DIM, dtype=DTYPE, device=DEVICE)
    with pytest.raises(ValueError, match="keep_from needs one position per sequence"):
        cache.append(k, k, keep_from=[41])
    with pytest.raises(ValueError, match=re.escape("keep_from[1] must be an integer in [0, 25]")):
        cache.append(k, k, keep_from=[41, 26])
    assert_unchanged(cache, before)


# ------------------------------------------------------------------------- static caches
@pytest.mark.parametrize("kind", ["s2", "dense"])
def test_static_cache_decodes_like_the_reference_and_never_changes_its_table(kind):
    """static=True: packed prefill of different lengths, decode steps over several block
    boundaries (the ring's pages reused many times), a speculative step, a crop inside the ring,
    a beam reorder and a reset, each step against the reference; the page tables never change, and
    the pool is about the dynamic cache's peak."""
    torch.manual_seed(7)
    pattern = (
        s2_pattern()
        if kind == "s2"
        else s2attn.dense_pattern(KV_HEADS, max_seq_len=MAX_LEN, block_size=BS)
    )
    cache = make_cache(pattern if kind == "s2" else None, 2, static=True)
    plan = cache.static_plan()
    dynamic = make_cache(pattern if kind == "s2" else None, 2)
    if kind == "s2":  # local 2 blocks: a block is read by its own and the next query block
        assert plan["ring"] == 3 and plan["num_pages"] <= dynamic.num_pages * 1.2
    else:
        assert plan["ring"] == 0 and plan["num_pages"] == 2 * KV_HEADS * MAX_LEN // BS
    table, device_table = cache._table.clone(), cache.page_table.clone()
    req = Request(cache, pattern)
    req.prefill([50, 35])
    for _ in range(3 * BS + 5):
        req.step()
    req.step(3, "speculative step")
    req.crop(3)
    req.step(1, "decode after crop")
    order = [1, 0]
    cache.select_sequences(order)
    req.qkv = [req.qkv[i] for i in order]
    req.step(1, "decode after reorder")
    cache.reset()
    req = Request(cache, pattern)
    req.prefill([70, 17])
    req.step(2, "decode after reset")
    assert torch.equal(cache._table, table) and torch.equal(cache.page_table, device_table)


def test_static_cache_chunked_prefill_and_refusals():
    torch.manual_seed(8)
    pattern = s2_pattern()
    req = Request(make_cache(pattern, 2, static=True), pattern)
    req.prefill([40, 21])
    req.prefill([37, 50])  # a chunk after a past: the past's live blocks read from the ring
    req.step(1, "decode after chunked prefill")
    cache = req.cache
    # What the cache gives back: the blocks later queries read, exactly; zeros for the others,
    # whose ring pages hold newer blocks by now.
    k_held, _, cu = cache.gather()
    for b, (start, end) in enumerate(zip(cu.tolist(), cu.tolist()[1:])):
        live = cache.eviction.read_from(cache._keep_block[b], slice(0, (end - start - 1) // BS + 1))
        live = live.repeat_interleave(BS, dim=1)[:, : end - start].T.to(DEVICE)  # (tokens, heads)
        want = torch.where(live[..., None], req.qkv[b][1].to(DTYPE), 0)
        assert torch.equal(k_held[start:end], want), f"sequence {b}'s held keys"
        assert (~live).any() and live.any()
    before = state(cache)
    k = torch.randn(2, 40, KV_HEADS, DIM, device=DEVICE, dtype=DTYPE)
    with pytest.raises(ValueError, match="cannot keep sequence 0's new blocks"):
        cache.append(k, k, keep_from=cache.lengths)  # kept for queries not yet run
    with pytest.raises(ValueError, match="ring pages of the blocks"):
        cache.crop(2 * BS + 1)
    with pytest.raises(ValueError, match="keeps its batch size"):
        cache.select_sequences([0])
    with pytest.raises(ValueError, match="sizes its own pool"):
        make_cache(pattern, 1, static=True, num_pages=10)
    assert_unchanged(cache, before)
    req.step(1, "decode after refusals")
