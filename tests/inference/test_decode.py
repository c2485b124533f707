"""The paged decode kernel (via sparse_attention_with_kvcache) against the dense-mask reference.

Contexts of different lengths per sequence sit in a PagedKVCache; the new tokens' queries sit at the
last positions of each sequence. Covered: patterns shared by a GQA group, per-query-head patterns,
dense layers, several new tokens that straddle a block boundary, split-K with the exact merge,
padded head dims, MHA/MQA, pages read in slices narrower than a page, page ids prefetched as
vectors (``prefetch_entries``), and many consecutive steps with eviction in between.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from helpers import (
    DEVICE,
    DTYPE_IDS,
    DTYPES,
    ON_GPU,
    assert_close,
    assert_fails_on_the_device,
    run_to_the_device_assertion,
    skip_without_gpu,
)

import s2attn
from s2attn import attention_reference, paged_kv_cache, sparse_attention_with_kvcache
from s2attn.ops import dispatch
from s2attn.ops.options import TritonDecodeConfig
from s2attn.ops.triton import decode as triton_decode

BS = 16
MAX_LEN = 256


def make_pattern(kind: str, heads: int, kv_heads: int) -> s2attn.BlockPattern | None:
    if kind == "s2":  # GQA groups share one pattern
        return s2attn.local_stride_pattern(
            heads,
            max_seq_len=MAX_LEN,
            block_size=BS,
            local_blocks=2,
            vert_stride=3,
            num_kv_heads=kv_heads,
        )
    if kind == "per_query_head":  # heads of one group differ: the union is read, bits mask it
        return s2attn.local_stride_pattern(
            heads, max_seq_len=MAX_LEN, block_size=BS, local_blocks=2, vert_stride=3
        )
    assert kind == "dense"
    return None


def reference_pattern(pattern, kv_heads):
    return (
        pattern
        if pattern is not None
        else s2attn.dense_pattern(kv_heads, max_seq_len=MAX_LEN, block_size=BS)
    )


def filled_cache(pattern, lens, kv_heads, dim, dtype, **kwargs):
    """A cache holding random past keys/values of the given lengths, stored as a prefill would."""
    cache = paged_kv_cache(
        pattern,
        batch_size=len(lens),
        num_kv_heads=kv_heads,
        head_dim=dim,
        dtype=dtype,
        device=DEVICE,
        block_size=BS,
        max_seq_len=MAX_LEN,
        **kwargs,
    )
    ks = [torch.randn(n, kv_heads, dim, device=DEVICE, dtype=dtype) for n in lens]
    vs = [torch.randn(n, kv_heads, dim, device=DEVICE, dtype=dtype) for n in lens]
    cu = torch.tensor([0, *lens], device=DEVICE).cumsum(0).to(torch.int32)
    cache.append(torch.cat(ks), torch.cat(vs), cu_seqlens=cu, keep_from=list(lens))
    return cache, ks, vs


def reference_step(q, ks, vs, k_new, v_new, pattern):
    """out (batch, new, heads, dim) and lse (batch, heads, new) of each sequence, in float64."""
    outs, lses = [], []
    for b in range(q.shape[0]):
        k = torch.cat([ks[b], k_new[b]])[None]
        v = torch.cat([vs[b], v_new[b]])[None]
        o, lse = attention_reference(
            q[b : b + 1], k, v, pattern, return_lse=True, compute_dtype=torch.float64
        )
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


def step(cache, heads, num_new, dtype):
    b, kvh, d = cache.batch_size, cache.num_kv_heads, cache.head_dim
    q = torch.randn(b, num_new, heads, d, device=DEVICE, dtype=dtype)
    k = torch.randn(b, num_new, kvh, d, device=DEVICE, dtype=dtype)
    v = torch.randn(b, num_new, kvh, d, device=DEVICE, dtype=dtype)
    return q, k, v


def check_step(cache, ks, vs, heads, num_new, dtype, what, num_splits=None):
    q, k, v = step(cache, heads, num_new, dtype)
    out, lse = sparse_attention_with_kvcache(q, cache, k, v, return_lse=True, num_splits=num_splits)
    check_against_reference(cache, ks, vs, (q, k, v), (out, lse), dtype, what)


def check_against_reference(cache, ks, vs, inputs, result, dtype, what):
    """One step's (out, lse) against the reference over the past ``ks``/``vs`` and the step's
    new tokens, which are then appended to ``ks``/``vs``."""
    (q, k, v), (out, lse) = inputs, result
    pattern = reference_pattern(cache.pattern, cache.num_kv_heads)
    ref_out, ref_lse = reference_step(q, ks, vs, k, v, pattern)
    assert_close(out, ref_out, dtype, f"{what} out")
    assert_close(lse, ref_lse.float(), torch.float32, f"{what} lse")
    for b in range(cache.batch_size):
        ks[b] = torch.cat([ks[b], k[b]])
        vs[b] = torch.cat([vs[b], v[b]])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_new", [1, 4])
@pytest.mark.parametrize("kind", ["s2", "per_query_head", "dense"])
def test_decode_matches_reference(kind, num_new, dtype):
    torch.manual_seed(0)
    heads, kv_heads, dim = 4, 2, 32
    # Sequence 1 ends at 63: four new tokens (63..66) straddle query blocks 3 and 4.
    pattern = make_pattern(kind, heads, kv_heads)
    cache, ks, vs = filled_cache(pattern, [37, 63], kv_heads, dim, dtype)
    check_step(cache, ks, vs, heads, num_new, dtype, f"{kind} new={num_new}", num_splits=1)


# The merge loads 64 // rows splits at a time: 4 at 2 new tokens (16 rows), 1 at 20 (64 rows).
@pytest.mark.parametrize("num_splits,num_new", [(2, 2), (5, 2), (13, 2), (5, 20)])
def test_split_k_merge_is_exact(num_splits, num_new):
    torch.manual_seed(1)
    heads, kv_heads, dim, dtype = 4, 2, 32, torch.float32
    pattern = make_pattern("s2", heads, kv_heads)
    cache, ks, vs = filled_cache(pattern, [150, 90], kv_heads, dim, dtype)
    what = f"splits={num_splits} new={num_new}"
    check_step(cache, ks, vs, heads, num_new, dtype, what, num_splits=num_splits)


def test_split_merge_over_many_steps_leaves_counters_at_zero():
    # The last split to finish merges, counted by the cache's counters: on a GPU the splits run
    # concurrently, so many steps give the count many chances to go wrong.
    torch.manual_seed(6)
    heads, kv_heads, dim, dtype = 4, 2, 32, DTYPES[0]
    pattern = make_pattern("per_query_head", heads, kv_heads)
    cache, ks, vs = filled_cache(pattern, [150, 90, 201], kv_heads, dim, dtype)
    for i in range(12):
        check_step(cache, ks, vs, heads, 1 + i % 3, dtype, f"step {i}", num_splits=3 + i % 5)
        assert not cache.split_counters.any(), f"step {i} left a split count behind"


@skip_without_gpu
def test_repeated_launches_reuse_only_a_matching_compiled_kernel():
    torch.manual_seed(7)
    heads, kv_heads, dim, dtype = 4, 2, 64, torch.bfloat16
    pattern = make_pattern("s2", heads, kv_heads)
    cache, ks, vs = filled_cache(pattern, [150, 90], kv_heads, dim, dtype)
    q = torch.randn(2, 1, heads, dim, device=DEVICE, dtype=dtype)
    memo = triton_decode._DECODE.compiled
    first = sparse_attention_with_kvcache(q, cache, num_splits=3)
    keys = len(memo)
    again = sparse_attention_with_kvcache(q.clone(), cache, num_splits=3)  # the direct launch
    assert len(memo) == keys
    torch.testing.assert_close(again, first, rtol=0, atol=0)
    # A query 2 bytes off 16-byte alignment: Triton would specialize anew, so must the memo.
    spare = torch.empty(q.numel() + 1, device=DEVICE, dtype=dtype)
    shifted = spare[1:].view(q.shape).copy_(q)
    assert shifted.data_ptr() % 16
    out = sparse_attention_with_kvcache(shifted, cache, num_splits=3)
    assert len(memo) == keys + 1
    torch.testing.assert_close(out, first, rtol=0, atol=0)
    # And a call through the memo is exact against the reference.
    check_step(cache, ks, vs, heads, 1, dtype, "after the memo's launches", num_splits=3)
    check_step(cache, ks, vs, heads, 1, dtype, "a memo hit", num_splits=3)


@pytest.mark.parametrize(
    "heads, kv_heads, dim, num_new",
    [
        (4, 1, 48, 2),  # MQA, a head dim that is not a power of two
        (2, 2, 16, 3),  # MHA
        (8, 1, 16, 16),  # 8 heads x 16 tokens: a full 128-row tile
    ],
)
def test_decode_shapes(heads, kv_heads, dim, num_new):
    torch.manual_seed(2)
    dtype = DTYPES[0]
    pattern = make_pattern("s2", heads, kv_heads)
    cache, ks, vs = filled_cache(pattern, [16, 45], kv_heads, dim, dtype)
    check_step(cache, ks, vs, heads, num_new, dtype, f"{heads}/{kv_heads} heads dim {dim}")


def test_consecutive_steps_with_eviction():
    """Decode across block boundaries: pages are freed and reused between steps."""
    torch.manual_seed(3)
    heads, kv_heads, dim, dtype = 4, 2, 16, DTYPES[-1]
    pattern = make_pattern("s2", heads, kv_heads)
    cache, ks, vs = filled_cache(pattern, [44, 29], kv_heads, dim, dtype)
    for i, num_new in enumerate([3, 3, 3, 1, 2]):
        check_step(cache, ks, vs, heads, num_new, dtype, f"step {i}")
        assert cache.live_pages < cache.num_pages


@pytest.mark.gpu
@skip_without_gpu
@pytest.mark.parametrize("kind", ["s2", "dense"])
def test_decode_steps_never_synchronize(kind):
    """Decode steps, across block boundaries (new pages, evictions, page-table uploads), queue
    their work without waiting for the GPU: under sync debug mode "error" any host-device
    synchronization raises. Outputs are checked against the reference afterwards."""
    torch.manual_seed(5)
    heads, kv_heads, dim, dtype = 4, 2, 64, torch.float16
    pattern = make_pattern(kind, heads, kv_heads)
    cache, ks, vs = filled_cache(pattern, [44, 29], kv_heads, dim, dtype)
    assert cache.decode_layout is not None  # built here: its construction may synchronize
    steps = [step(cache, heads, 1, dtype) for _ in range(24)]  # crosses a block boundary
    for q, k, v in steps[:2]:  # warm-up: kernels compiled, host caches filled
        sparse_attention_with_kvcache(q, cache, k, v)
    for b in range(cache.batch_size):
        ks[b] = torch.cat([ks[b], *(k[b] for _, k, _ in steps[:2])])
        vs[b] = torch.cat([vs[b], *(v[b] for _, _, v in steps[:2])])
    outs = []
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for q, k, v in steps[2:]:
            outs.append(sparse_attention_with_kvcache(q, cache, k, v, return_lse=True))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for i, (inputs, result) in enumerate(zip(steps[2:], outs)):
        check_against_reference(cache, ks, vs, inputs, result, dtype, f"step {i}")


@pytest.mark.gpu
@skip_without_gpu
@pytest.mark.parametrize("kind", ["s2", "dense"])
def test_static_cache_step_replays_from_a_cuda_graph(kind):
    """One captured decode step over a static cache, replayed for 40 steps (across block
    boundaries, the ring's pages reused), equals the reference at every step; an eager step in
    between and the graph's next replay agree with it too."""
    torch.manual_seed(6)
    heads, kv_heads, dim, dtype = 4, 2, 64, torch.float16
    pattern = make_pattern(kind, heads, kv_heads)
    cache, ks, vs = filled_cache(pattern, [44, 29], kv_heads, dim, dtype, static=True)
    q_buf, k_buf, v_buf = step(cache, heads, 1, dtype)
    replay = s2attn.capture_decode_step(q_buf, cache, k_buf, v_buf)
    assert cache.lengths == [44, 29]  # capturing left the cache as it was
    for i in range(40):
        q, k, v = step(cache, heads, 1, dtype)
        if i == 20:  # an eager step between replays
            out = sparse_attention_with_kvcache(q, cache, k, v)
        else:
            q_buf.copy_(q), k_buf.copy_(k), v_buf.copy_(v)
            out = replay().clone()
        pattern_ref = reference_pattern(cache.pattern, kv_heads)
        ref, _ = reference_step(q, ks, vs, k, v, pattern_ref)
        assert_close(out, ref, dtype, f"step {i}")
        for b in range(cache.batch_size):
            ks[b], vs[b] = torch.cat([ks[b], k[b]]), torch.cat([vs[b], v[b]])
    assert cache.lengths == [84, 69] and cache.seq_lens.tolist() == [84, 69]


@pytest.mark.parametrize("path", ["kernels", "pytorch"])
@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("kind", ["s2", "dense"])
def test_a_step_run_by_hand_from_its_plan_matches_reference(kind, static, path, monkeypatch):
    """A caller of the decode step takes the cache's plan: plan_decode_step (the host half:
    pages, lengths), then decode_step of that plan (the device half), step after step across
    block boundaries, equals the reference and leaves the cache where
    sparse_attention_with_kvcache would."""
    from s2attn.inference import decode_step

    if path == "pytorch":
        monkeypatch.setattr(decode_step, "supports_triton", lambda device: False)
    torch.manual_seed(17)
    heads, kv_heads, dim, dtype = 4, 2, 16, torch.float32
    pattern = make_pattern(kind, heads, kv_heads)
    cache, ks, vs = filled_cache(pattern, [44, 29], kv_heads, dim, dtype, static=static)
    for i in range(6):
        q, k, v = step(cache, heads, 3, dtype)
        plan = cache.plan_decode_step(k, v)
        assert cache.lengths == [n + 3 for n in (44 + 3 * i, 29 + 3 * i)]
        result = decode_step.decode_step(q, k, v, plan, softmax_scale=dim**-0.5)
        check_against_reference(cache, ks, vs, (q, k, v), result, dtype, f"step {i}")
    assert cache.seq_lens.tolist() == cache.lengths == [62, 47]
    assert not cache.split_counters.any()
    check_step(cache, ks, vs, heads, 1, dtype, "an eager step after the steps by hand")
    with pytest.raises(ValueError, match="at most 16 new tokens"):
        cache.plan_decode_step(*step(cache, heads, 17, dtype)[1:])
    bad = torch.randn(2, 1, 1, dim, device=DEVICE, dtype=dtype)
    with pytest.raises(ValueError, match="kv_heads=2"):
        cache.plan_decode_step(bad, bad)
    assert cache.lengths == [63, 48]


def test_a_plan_follows_the_cache():
    """A plan holds the cache's tensors and the split count the step needs: the same plan from
    step to step while nothing changes, a new one once the cache swaps its tensors (a batch of
    another size); the split count of a step follows its query blocks' lists, a whole run's the
    longest list of all."""
    heads, kv_heads, dim, dtype = 4, 2, 16, torch.float32
    cache, *_ = filled_cache(make_pattern("s2", heads, kv_heads), [44, 29], kv_heads, dim, dtype)
    plan = cache.decode_plan(1)
    # The step's own split count (1 on a CPU, the heuristic's on a GPU) names the same plan.
    assert cache.decode_plan(1) is plan
    assert cache.decode_plan(num_splits=plan.num_splits) is plan
    held = (cache.k_pages, cache.v_pages, cache.page_table, cache.seq_lens, cache.decode_layout)
    assert all(a is b for a, b in zip(plan.held, (*held, cache.split_counters), strict=True))
    assert cache.decode_plan(num_splits=3).num_splits == 3
    cache.select_sequences([1, 0, 0])
    swapped = cache.decode_plan(1)
    assert swapped is not plan and swapped.page_table is cache.page_table
    assert swapped.split_counters.shape == (3 * kv_heads,)
    # What the cache asks the kernel's heuristic for: the longest list the step's query blocks
    # walk, or (a whole run) the longest of all, asked once per batch size.
    lists = cache.decode_layout.list_lengths.tolist()
    step_longest = max(lists[(n - 1) // BS] for n in cache.lengths)
    assert step_longest < max(lists), "the test's lengths should tell the two apart"
    asked = []

    def heuristic(batch, num_kv_heads, longest, device):
        asked.append((batch, num_kv_heads, longest))
        return 7

    with mock.patch.object(dispatch, "decode_num_splits", heuristic):
        assert cache.decode_plan(1).num_splits == 7
        assert cache.decode_plan().num_splits == cache.decode_plan().num_splits == 7
    assert asked == [(3, kv_heads, step_longest), (3, kv_heads, max(lists))]


@pytest.mark.parametrize("path", ["kernels", "pytorch"])
@pytest.mark.parametrize("kind", ["s2", "per_query_head", "dense"])
@pytest.mark.parametrize("num_new", [1, 3])
def test_static_decode_operator_matches_reference(kind, num_new, path, monkeypatch):
    """The compiled decode step's operator (s2attn::static_decode), called step after step over
    a static cache (across block boundaries, the ring's pages reused), equals the reference; it
    advances only the device's lengths, and the host's catch up at the next eager call (the
    operator's own, or another), which then works as usual (an eager step, a crop)."""
    from s2attn.inference import decode_op, decode_step

    if path == "pytorch":
        monkeypatch.setattr(decode_step, "supports_triton", lambda device: False)
    torch.manual_seed(7)
    heads, kv_heads, dim, dtype = 4, 2, 16, torch.float32
    pattern = make_pattern(kind, heads, kv_heads)
    cache, ks, vs = filled_cache(pattern, [44, 29], kv_heads, dim, dtype, static=True)
    steps = 12 if num_new == 1 else 6
    for i in range(steps):
        q, k, v = step(cache, heads, num_new, dtype)
        out = decode_op.static_decode_step(q, cache, k, v, softmax_scale=dim**-0.5)
        pattern_ref = reference_pattern(cache.pattern, kv_heads)
        ref, _ = reference_step(q, ks, vs, k, v, pattern_ref)
        assert_close(out, ref, dtype, f"step {i}")
        for b in range(cache.batch_size):
            ks[b], vs[b] = torch.cat([ks[b], k[b]]), torch.cat([vs[b], v[b]])
    held = [44 + steps * num_new, 29 + steps * num_new]
    # The operator left the host's lengths behind; each eager call caught them up first, to
    # check the step's room.
    assert cache._lengths == [n - num_new for n in held]
    assert cache.lengths == held and cache.seq_lens.tolist() == held  # caught up
    check_step(cache, ks, vs, heads, 1, dtype, "eager step after the operator's")
    cache.crop(1)
    assert cache.lengths == [n for n in held]


@pytest.mark.parametrize("check_room", [True, False])
@pytest.mark.parametrize("path", ["kernels", "pytorch"])
def test_static_decode_opcheck(path, check_room, monkeypatch):
    """torch.library.opcheck on s2attn::static_decode: its schema (what it mutates), fake
    implementation and the compiled (AOT) dispatch agree with running it."""
    from s2attn.inference import decode_op, decode_step  # noqa: F401 (decode_op: the operator)

    if path == "pytorch":
        monkeypatch.setattr(decode_step, "supports_triton", lambda device: False)
    pattern = make_pattern("s2", 4, 2)
    cache, *_ = filled_cache(pattern, [44, 29], 2, 16, torch.float32, static=True)
    q, k, v = step(cache, 4, 2, torch.float32)
    args = (q, k, v, *cache.step_plan.op_arguments(), 0.25, check_room)
    torch.library.opcheck(torch.ops.s2attn.static_decode.default, args)


def test_static_decode_operator_refuses_bad_steps():
    """A dynamic cache, and steps of the wrong shape, dtype or size, raise before anything is
    written: the cache's lengths and pages stay as they were."""
    from s2attn.inference.decode_op import static_decode_step

    dynamic, *_ = filled_cache(make_pattern("s2", 4, 2), [20], 2, 16, torch.float32)
    q, k, v = step(dynamic, 4, 1, torch.float32)
    with pytest.raises(ValueError, match=r"static cache \(paged_kv_cache\(static=True\)\)"):
        static_decode_step(q, dynamic, k, v, softmax_scale=0.25)
    cache, *_ = filled_cache(make_pattern("s2", 4, 2), [20, 9], 2, 16, torch.float32, static=True)
    pages = cache.k_pages.clone()
    q, k, v = step(cache, 4, 1, torch.float32)
    q2, k2, v2 = step(cache, 4, 2, torch.float32)
    bad = [
        ((q[:1], k[:1], v[:1]), ValueError, "batch=2"),
        ((q[..., :8], k, v), ValueError, "head dim 8 but the cache holds 16"),
        ((q[:, :, :3], k, v), ValueError, r"multiple of the cache's KV heads \(2\)"),
        ((q, k[:, :, :1], v[:, :, :1]), ValueError, r"k must be \(batch=2, num_new, kv_heads=2"),
        ((q2, k2[:, :1], v2[:, :1]), ValueError, "must hold the same new tokens"),
        ((q, k, v[:, :, :1]), ValueError, "k and v differ in shape"),
        ((q.double(), k, v), TypeError, "q has dtype torch.float64 but the cache holds"),
        ((q, k, v.double()), TypeError, "v has dtype torch.float64 but the cache holds"),
        (step(cache, 4, 17, torch.float32), ValueError, "1 to 16 new tokens"),
        (step(cache, 6, 1, torch.float32), ValueError, "pattern has 4 heads"),
    ]
    for args, error, match in bad:
        with pytest.raises(error, match=match):
            static_decode_step(*args[:1], cache, *args[1:], softmax_scale=0.25)
    assert cache.lengths == [20, 9] and cache.seq_lens.tolist() == [20, 9]
    assert torch.equal(cache.k_pages, pages)


@pytest.mark.parametrize("kind", ["s2", "dense"])
def test_static_decode_refuses_a_step_past_max_seq_len(kind):
    """A static cache's decode steps up to max_seq_len run, compiled (one graph for every step)
    or eager; the step past it is refused on the host before anything is written, naming the
    length it needs and the cache's max_seq_len: by check_room after compiled steps (whose graph
    checks nothing on the host), and by the eager operator call itself."""
    from s2attn.inference.decode_op import static_decode_step

    heads, kv_heads, dim, dtype = 4, 2, 16, torch.float32
    pattern = make_pattern(kind, heads, kv_heads)
    cache, *_ = filled_cache(pattern, [MAX_LEN - 4, MAX_LEN - 9], kv_heads, dim, dtype, static=True)
    graphs = []

    def counting_backend(gm, example_inputs):
        graphs.append(gm)
        return torch._dynamo.backends.debugging.aot_eager(gm, example_inputs)

    @torch.compile(backend=counting_backend, fullgraph=True)
    def decode(q, k, v):
        return static_decode_step(q, cache, k, v, softmax_scale=dim**-0.5)

    torch._dynamo.reset()
    for _ in range(3):
        cache.check_room(1)
        decode(*step(cache, heads, 1, dtype))
    assert len(graphs) == 1, f"{len(graphs)} graphs for 3 steps"
    q, k, v = step(cache, heads, 1, dtype)
    static_decode_step(q, cache, k, v, softmax_scale=dim**-0.5)  # eager, after compiled steps
    full = [MAX_LEN, MAX_LEN - 5]
    assert cache.seq_lens.tolist() == full
    k_pages, v_pages = cache.k_pages.clone(), cache.v_pages.clone()
    need = f"sequence 0 would hold {MAX_LEN + 1} tokens, past the cache's max_seq_len {MAX_LEN}"
    with pytest.raises(ValueError, match=need):
        cache.check_room(1)
    q, k, v = step(cache, heads, 1, dtype)
    with pytest.raises(ValueError, match=need):
        static_decode_step(q, cache, k, v, softmax_scale=dim**-0.5)
    assert cache.lengths == full and cache.seq_lens.tolist() == full
    assert torch.equal(cache.k_pages, k_pages) and torch.equal(cache.v_pages, v_pages)
    cache.check_room(0)  # a full cache has room for nothing more, which fits


def test_compiled_static_decode_past_the_end_fails_on_the_device():
    """A compiled step past a static cache's end, its host check skipped (a graph replayed as
    is), fails the operator's device assertion before anything is written. With
    check_room=False (another cache's call checks the step) the operator asserts nothing. On a
    GPU the step past the end runs in a child process: a CUDA assertion ends its context."""
    if ON_GPU:
        assert_fails_on_the_device(__file__, "_decode_past_the_end_of_a_static_cache")
    else:
        _decode_past_the_end_of_a_static_cache()


def _decode_past_the_end_of_a_static_cache(child: bool = False):
    from s2attn.inference import decode_op

    heads, kv_heads, dim, dtype = 4, 2, 16, torch.float32
    cache, *_ = filled_cache(make_pattern("s2", heads, kv_heads), [MAX_LEN - 2, 9], kv_heads,
                             dim, dtype, static=True)  # fmt: skip
    asserts = []
    assert_async = torch._assert_async

    def counting_assert(*args):
        asserts.append(args)
        return assert_async(*args)

    @torch.compile(backend="aot_eager", fullgraph=True)
    def decode(q, k, v, check_room):
        return decode_op.static_decode_step(
            q, cache, k, v, softmax_scale=dim**-0.5, check_room=check_room
        )

    torch._dynamo.reset()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch, "_assert_async", counting_assert)
        decode(*step(cache, heads, 1, dtype), False)
        assert len(asserts) == 0
        decode(*step(cache, heads, 1, dtype), True)  # the last row
        assert len(asserts) == 1
    assert cache.seq_lens.tolist() == [MAX_LEN, 11]
    pages, lengths = cache.k_pages.clone(), cache.seq_lens.clone()
    if child:
        return run_to_the_device_assertion(lambda: decode(*step(cache, heads, 1, dtype), True))
    with pytest.raises(RuntimeError, match=f"1 tokens past the static cache's {MAX_LEN}"):
        decode(*step(cache, heads, 1, dtype), True)
    assert torch.equal(cache.k_pages, pages) and torch.equal(cache.seq_lens, lengths)


@pytest.mark.gpu
@skip_without_gpu
def test_static_decode_operator_under_reduce_overhead():
    """A decode step compiled with mode="reduce-overhead" (Inductor and CUDA-graph trees) over a
    static cache: every call after the warm-up replays a graph, and each equals the reference."""
    from s2attn.inference.decode_op import static_decode_step

    torch.manual_seed(8)
    heads, kv_heads, dim, dtype = 4, 2, 64, torch.float16
    pattern = make_pattern("s2", heads, kv_heads)
    cache, ks, vs = filled_cache(pattern, [44, 29], kv_heads, dim, dtype, static=True)
    for t in (cache.k_pages, cache.v_pages, cache.seq_lens, cache.page_table):
        torch._dynamo.mark_static_address(t)

    @torch.compile(mode="reduce-overhead", fullgraph=True)
    def decode(q, k, v):
        return static_decode_step(q, cache, k, v, softmax_scale=dim**-0.5) * 1.0

    for i in range(30):
        q, k, v = step(cache, heads, 1, dtype)
        out = decode(q, k, v).clone()
        ref, _ = reference_step(q, ks, vs, k, v, reference_pattern(cache.pattern, kv_heads))
        assert_close(out, ref, dtype, f"step {i}")
        for b in range(cache.batch_size):
            ks[b], vs[b] = torch.cat([ks[b], k[b]]), torch.cat([vs[b], v[b]])
    assert cache.lengths == [74, 59]


def test_new_tokens_already_in_the_cache():
    """k=None: q's tokens were appended by cache.append and are read back from the pages."""
    torch.manual_seed(4)
    heads, kv_heads, dim, dtype = 4, 2, 32, DTYPES[0]
    pattern = make_pattern("s2", heads, kv_heads)
    cache, ks, vs = filled_cache(pattern, [40, 20], kv_heads, dim, dtype)
    q, k, v = step(cache, heads, 2, dtype)
    cache.append(k, v)
    out = sparse_attention_with_kvcache(q, cache)
    ref, _ = reference_step(q, ks, vs, k, v, pattern)
    assert_close(out, ref, dtype, "k=None")


def test_pages_wider_than_the_kv_tile():
    """The launcher's settings (``TritonDecodeConfig``): pages of 32 tokens read in two 16-key
    slices, one launch per step, against the reference."""
    torch.manual_seed(6)
    heads, kv_heads, dim, dtype, page = 4, 2, 16, DTYPES[0], 32
    pattern = s2attn.local_stride_pattern(
        heads,
        max_seq_len=MAX_LEN,
        block_size=page,
        local_blocks=2,
        vert_stride=3,
        num_kv_heads=kv_heads,
    )
    cache = paged_kv_cache(
        pattern, batch_size=2, num_kv_heads=kv_heads, head_dim=dim, dtype=dtype, device=DEVICE
    )
    lens = [70, 45]
    ks = [torch.randn(n, kv_heads, dim, device=DEVICE, dtype=dtype) for n in lens]
    vs = [torch.randn(n, kv_heads, dim, device=DEVICE, dtype=dtype) for n in lens]
    cu = torch.tensor([0, *lens], device=DEVICE).cumsum(0).to(torch.int32)
    cache.append(torch.cat(ks), torch.cat(vs), cu_seqlens=cu, keep_from=lens)
    q, k, v = step(cache, heads, 2, dtype)
    cache.append(k, v)
    args = (q, cache.k_pages, cache.v_pages, cache.page_table, cache.seq_lens, cache.decode_layout)
    config = TritonDecodeConfig(block_n=16)
    out, lse = triton_decode.decode(*args, softmax_scale=dim**-0.5, config=config)
    ref_out, ref_lse = reference_step(q, ks, vs, k, v, pattern)
    assert_close(out, ref_out, dtype, "block_n 16 out")
    assert_close(lse, ref_lse.float(), torch.float32, "block_n 16 lse")
    with pytest.raises(ValueError, match="block_n=64 must divide the page size 32"):
        triton_decode.decode(*args, softmax_scale=1.0, config=TritonDecodeConfig(block_n=64))


def direct_step(cache, ks, vs, heads, num_new, dtype, num_splits, config, what):
    """One step through the kernel's launcher (its ``config`` and split count as given), the new
    tokens appended first, against the reference; outputs start as NaN (POISON_OUTPUTS)."""
    assert triton_decode.POISON_OUTPUTS, "tests poison outputs (conftest.py)"
    q, k, v = step(cache, heads, num_new, dtype)
    cache.append(k, v)
    out, lse = triton_decode.decode(
        q, cache.k_pages, cache.v_pages, cache.page_table, cache.seq_lens, cache.decode_layout,
        softmax_scale=cache.head_dim**-0.5, num_splits=num_splits, config=config,
    )  # fmt: skip
    # The reference reads the past from ks/vs and the new tokens from k/v, as check_step's do.
    check_against_reference(cache, ks, vs, (q, k, v), (out, lse), dtype, what)


# (prefetch_entries, num_splits). Lists here hold 3-4 full entries (s2), 10-14 partial ones with
# per-head bits (per_query_head) or 9-13 implicit ones (dense): one split of width 2 walks the
# full entries unmasked and the partial ones masked, each in several chunks, the last partly
# empty; 3 splits of width 4 walk both lists as one, a split's share crossing from full entries
# to partial ones; 16 splits hold one page or none each, with prefetch and without.
PREFETCH_CASES = [(2, 1), (4, 3), (16, 16), (0, 16)]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("num_new", [1, 3])
@pytest.mark.parametrize("kind", ["s2", "per_query_head", "dense"])
@pytest.mark.parametrize("prefetch,num_splits", PREFETCH_CASES)
def test_prefetched_page_ids_match_reference(prefetch, num_splits, kind, num_new, dtype):
    torch.manual_seed(9)
    heads, kv_heads, dim = 8, 2, 32  # GQA group 4, as the 7B layers have
    pattern = make_pattern(kind, heads, kv_heads)
    # Sequence 1 ends at 205: three new tokens (206..208) straddle query blocks 12 and 13.
    cache, ks, vs = filled_cache(pattern, [150, 206], kv_heads, dim, dtype)
    config = TritonDecodeConfig(prefetch_entries=prefetch)
    what = f"{kind} prefetch {prefetch} splits {num_splits} new={num_new}"
    direct_step(cache, ks, vs, heads, num_new, dtype, num_splits, config, what)


def test_prefetch_width_must_be_a_power_of_two():
    heads, kv_heads, dim, dtype = 4, 2, 16, DTYPES[0]
    cache, *_ = filled_cache(make_pattern("s2", heads, kv_heads), [20, 20], kv_heads, dim, dtype)
    q, *_ = step(cache, heads, 1, dtype)
    args = (q, cache.k_pages, cache.v_pages, cache.page_table, cache.seq_lens, cache.decode_layout)
    for bad in (3, -2):
        with pytest.raises(ValueError, match=f"prefetch_entries={bad} must be 0 or a power of two"):
            config = TritonDecodeConfig(prefetch_entries=bad)
            triton_decode.decode(*args, softmax_scale=0.25, config=config)


def test_split_heuristic_pages_per_split(monkeypatch):
    """decode_num_splits on a (pretend) 132-SM GPU. Many (sequence, KV head) pairs: 2 programs
    per SM, at least 4 pages a split. Few pairs and at most 192 pages: 16 splits, or 3 pages a
    split where 16 would hold more. Never more splits than pages, nor more than 64."""
    monkeypatch.setattr(triton_decode, "_num_sms", lambda index: 132)
    gpu = torch.device("cuda", 0)

    def splits(batch, pages):
        return triton_decode.decode_num_splits(batch, 8, pages, gpu)

    assert splits(1, 18) == 16  # 4k, stride 64
    assert splits(1, 49) == 17  # 128k, stride 64: 3 pages a split
    assert splits(1, 145) == 49  # 128k, stride 16
    assert splits(1, 10) == 10 and splits(1, 1) == 1
    assert splits(1, 192) == 64
    assert splits(1, 193) == 33 and splits(1, 2048) == 33  # a dense layer at 128k: bandwidth
    assert splits(2, 49) == 17  # 16 pairs: 264 programs would take 17 splits each
    assert splits(4, 49) == 9  # 32 pairs: 2 programs per SM
    assert splits(16, 49) == 3 and splits(16, 4) == 1
    assert triton_decode.decode_num_splits(1, 8, 49, torch.device("cpu")) == 1


def test_decode_output_has_no_unwritten_rows():
    """A context of one token: most of the tile's rows and keys are padding."""
    torch.manual_seed(5)
    heads, kv_heads, dim, dtype = 2, 1, 16, DTYPES[0]
    cache, ks, vs = filled_cache(make_pattern("s2", heads, kv_heads), [0, 1], kv_heads, dim, dtype)
    check_step(cache, ks, vs, heads, 1, dtype, "tiny")


def test_bad_inputs_name_the_argument():
    heads, kv_heads, dim, dtype = 4, 2, 16, DTYPES[0]
    cache, _, _ = filled_cache(make_pattern("s2", heads, kv_heads), [20, 20], kv_heads, dim, dtype)
    q, k, v = step(cache, heads, 1, dtype)
    with pytest.raises(TypeError, match="cache"):
        sparse_attention_with_kvcache(q, "cache", k, v)
    with pytest.raises(TypeError, match="q has dtype"):
        wrong = q.float() if dtype != torch.float32 else q.half()
        sparse_attention_with_kvcache(wrong, cache, k, v)
    with pytest.raises(ValueError, match="q must be"):
        sparse_attention_with_kvcache(q[:1], cache, k[:1], v[:1])
    with pytest.raises(ValueError, match="head dim"):
        sparse_attention_with_kvcache(q[..., :8], cache, k, v)
    with pytest.raises(ValueError, match="multiple of the cache's KV heads"):
        sparse_attention_with_kvcache(q[:, :, :3], cache, k, v)
    with pytest.raises(ValueError, match="both k and v"):
        sparse_attention_with_kvcache(q, cache, k, None)
    with pytest.raises(ValueError, match="same new tokens"):
        sparse_attention_with_kvcache(q, cache, torch.cat([k, k], 1), torch.cat([v, v], 1))
    with pytest.raises(ValueError, match="softmax_scale"):
        sparse_attention_with_kvcache(q, cache, k, v, softmax_scale=float("nan"))
    with pytest.raises(ValueError, match="max_seq_len"):
        big = torch.randn(2, MAX_LEN, kv_heads, dim, device=DEVICE, dtype=dtype)
        sparse_attention_with_kvcache(
            torch.randn(2, MAX_LEN, heads, dim, device=DEVICE, dtype=dtype), cache, big, big
        )
    with pytest.raises(ValueError, match="pattern has"):
        other = paged_kv_cache(
            s2attn.local_stride_pattern(
                8, max_seq_len=MAX_LEN, block_size=BS, local_blocks=2, vert_stride=3, num_kv_heads=2
            ),
            batch_size=2,
            num_kv_heads=2,
            head_dim=dim,
            dtype=dtype,
            device=DEVICE,
        )
        sparse_attention_with_kvcache(q, other, k, v)
    assert cache.lengths == [20, 20]  # failed calls store nothing
