"""Eager decode steps replayed from CUDA graphs (``s2attn/inference/step_graph.py``): every step
equals the dense-mask reference, whether launched directly, captured or replayed, across block
boundaries and evictions, after the cache swaps its tensors, and at a new shape; each step's
output is its own tensor; where graphs cannot apply (the CPU, another capture) the step launches
directly."""

from __future__ import annotations

import pytest
import torch
from helpers import DEVICE, ON_GPU, skip_without_gpu
from test_decode import check_against_reference, filled_cache, make_pattern, step

import s2attn
from s2attn import sparse_attention_with_kvcache
from s2attn.inference import step_graph


def _graphs(cache) -> list:
    """The CUDA graphs the cache's steps captured."""
    return [g.graph for g in cache.step_graphs.values() if g.graph is not None]


@pytest.mark.gpu
@skip_without_gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kind", ["s2", "per_query_head", "dense"])
def test_replayed_steps_match_reference(kind, dtype):
    """40 steps of one token, then 10 of three (another shape: another graph), each against the
    reference; the first step of each shape launches directly, the second captures, the rest
    replay. Earlier outputs stay as they were while later steps replay."""
    torch.manual_seed(11)
    heads, kv_heads, dim = 4, 2, 64
    pattern = make_pattern(kind, heads, kv_heads)
    cache, ks, vs = filled_cache(pattern, [44, 29], kv_heads, dim, dtype)
    kept = []
    for i, num_new in enumerate([1] * 40 + [3] * 10):
        q, k, v = step(cache, heads, num_new, dtype)
        out, lse = sparse_attention_with_kvcache(q, cache, k, v, return_lse=True)
        kept.append((out, out.clone()))
        check_against_reference(cache, ks, vs, (q, k, v), (out, lse), dtype, f"step {i}")
        assert len(_graphs(cache)) == (i >= 1) + (i >= 41), f"step {i}: graphs {cache.step_graphs}"
    assert cache.lengths == [44 + 70, 29 + 70] and cache.seq_lens.tolist() == [114, 99]
    for i, (out, copy) in enumerate(kept):
        assert torch.equal(out, copy), f"step {i}'s output changed after later steps"


def _steps(cache, ks, vs, heads, dtype, what, count=3):
    for i in range(count):
        q, k, v = step(cache, heads, 1, dtype)
        result = sparse_attention_with_kvcache(q, cache, k, v, return_lse=True)
        check_against_reference(cache, ks, vs, (q, k, v), result, dtype, f"{what}, {i}")


@pytest.mark.gpu
@skip_without_gpu
def test_a_cache_that_swaps_its_tensors_captures_again():
    """A reorder at the same batch size rewrites the page table and lengths in place: the graph
    stays valid and replays. A selection to another batch size gives the cache new tensors, so
    back at the first batch size the graph captured over the old ones must not replay. Every
    step matches the reference over the selected sequences."""
    torch.manual_seed(12)
    heads, kv_heads, dim, dtype = 4, 2, 64, torch.float16
    pattern = make_pattern("s2", heads, kv_heads)
    cache, ks, vs = filled_cache(pattern, [44, 29], kv_heads, dim, dtype)
    _steps(cache, ks, vs, heads, dtype, "step")
    (first,) = _graphs(cache)
    table = cache.page_table
    cache.select_sequences([1, 0])
    ks, vs = [ks[1], ks[0]], [vs[1], vs[0]]
    _steps(cache, ks, vs, heads, dtype, "after a reorder")
    assert cache.page_table is table and _graphs(cache) == [first]
    cache.select_sequences([1])
    ks, vs = [ks[1]], [vs[1]]
    _steps(cache, ks, vs, heads, dtype, "one sequence")
    cache.select_sequences([0, 0])
    ks, vs = [ks[0], ks[0].clone()], [vs[0], vs[0].clone()]
    _steps(cache, ks, vs, heads, dtype, "two copies")
    assert cache.page_table is not table and first not in _graphs(cache)


@pytest.mark.gpu
@skip_without_gpu
def test_replayed_and_direct_steps_agree(monkeypatch):
    """Two caches filled alike, one stepping through graphs and one launching directly, give the
    same outputs to fp16's tolerance at every step (their split counts may differ)."""
    torch.manual_seed(13)
    heads, kv_heads, dim, dtype = 8, 2, 64, torch.float16
    pattern = make_pattern("s2", heads, kv_heads)
    graphed, ks, vs = filled_cache(pattern, [100, 37], kv_heads, dim, dtype)
    direct = s2attn.paged_kv_cache(
        pattern, batch_size=2, num_kv_heads=kv_heads, head_dim=dim, dtype=dtype, device=DEVICE,
        block_size=graphed.block_size, max_seq_len=graphed.max_seq_len,
    )  # fmt: skip
    cu = torch.tensor([0, 100, 137], device=DEVICE, dtype=torch.int32)
    direct.append(torch.cat(ks), torch.cat(vs), cu_seqlens=cu, keep_from=[100, 37])
    for i in range(20):
        q, k, v = step(graphed, heads, 1, dtype)
        monkeypatch.setattr(step_graph, "ENABLED", True)
        a = sparse_attention_with_kvcache(q, graphed, k, v)
        monkeypatch.setattr(step_graph, "ENABLED", False)
        b = sparse_attention_with_kvcache(q, direct, k, v)
        torch.testing.assert_close(a, b, atol=2e-3, rtol=2e-3, msg=f"step {i}")
    assert _graphs(graphed) and not direct.step_graphs


def test_no_graphs_where_they_cannot_apply():
    """On the CPU (and in a capture, covered by capture_decode_step's tests) steps launch
    directly and the cache keeps no graph."""
    if ON_GPU:
        pytest.skip("the CPU's case")
    torch.manual_seed(14)
    cache, ks, vs = filled_cache(make_pattern("s2", 4, 2), [20, 9], 2, 16, torch.float32)
    for i in range(3):
        q, k, v = step(cache, 4, 1, torch.float32)
        result = sparse_attention_with_kvcache(q, cache, k, v, return_lse=True)
        check_against_reference(cache, ks, vs, (q, k, v), result, torch.float32, f"step {i}")
    assert cache.step_graphs == {}


@pytest.mark.gpu
@skip_without_gpu
def test_no_graphs_over_the_reference_step(monkeypatch):
    """Where the step's device half runs the PyTorch reference (it reads lengths back on the
    host, which a capture forbids), steps launch directly: they match the reference and the cache
    keeps no graph."""
    from s2attn.inference import decode_step

    monkeypatch.setattr(decode_step, "supports_triton", lambda device: False)
    torch.manual_seed(15)
    cache, ks, vs = filled_cache(make_pattern("s2", 4, 2), [20, 9], 2, 16, torch.float32)
    _steps(cache, ks, vs, 4, torch.float32, "reference step", count=4)
    assert cache.step_graphs == {}


@pytest.mark.gpu
@skip_without_gpu
def test_a_failed_capture_launches_directly(monkeypatch):
    """A capture that fails (here the launch raises while the stream captures) warns, and that
    step and every later one of its shape launch directly: all match the reference, and the
    cache's lengths advance once per step."""
    torch.manual_seed(16)
    heads, kv_heads, dim, dtype = 4, 2, 64, torch.float16
    cache, ks, vs = filled_cache(
        make_pattern("s2", heads, kv_heads), [44, 29], kv_heads, dim, dtype
    )
    launch = step_graph._launch

    def refuse_capture(*args):
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("no capture here")
        return launch(*args)

    monkeypatch.setattr(step_graph, "_launch", refuse_capture)
    _steps(cache, ks, vs, heads, dtype, "before", count=1)
    with pytest.warns(RuntimeWarning, match="launch directly from now on"):
        _steps(cache, ks, vs, heads, dtype, "the failed capture", count=1)
    _steps(cache, ks, vs, heads, dtype, "after", count=3)
    assert _graphs(cache) == [] and cache.lengths == [44 + 5, 29 + 5]
