"""torch.compile: the registered operators pass ``opcheck``, compiled code traces the attention
call with no graph break, agrees with the reference, and recompiles only for a new pattern.

Tests about tracing run the operators' reference path (the Triton predicate patched off), which
is fast; the kernels' path runs under the interpreter on the smallest shapes. Compiled functions
use the ``aot_eager`` backend: it runs the fake implementations and the registered autograd as
Inductor would, without compiling C++.
"""

from __future__ import annotations

import pytest
import torch
from helpers import DEVICE, DTYPES, assert_close, random_qkv, skip_without_gpu
from torch import nn

import s2attn
from s2attn.compile import attention_backward, attention_forward, pattern_key
from s2attn.ops import dispatch

BACKEND = "aot_eager"


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture
def reference_ops(monkeypatch):
    """The operators (and eager calls) on the dense-mask reference, as on a CPU without Triton."""
    monkeypatch.setattr(dispatch, "supports_triton", lambda device: False)


def _inputs(seed, batch, seq, heads, kv_heads, dim, dtype, grad=True):
    gen = torch.Generator().manual_seed(seed)
    qkv = random_qkv(gen, batch, seq, seq, heads, kv_heads, dim, dtype)
    return [t.requires_grad_(grad) for t in qkv]


def _reference_grads(q, k, v, pattern, upstream, **kwargs):
    """(out, lse) and the q/k/v gradients of the float32 reference, for ``upstream`` (out, lse)."""
    leaves = [t.detach().float().requires_grad_() for t in (q, k, v)]
    out, lse = s2attn.attention_reference(*leaves, pattern, return_lse=True, **kwargs)
    grads = torch.autograd.grad((out, lse), leaves, (upstream[0].float(), upstream[1]))
    return out, lse, grads


# ------------------------------------------------------------------------------------ opcheck
def _op_args(pattern, varlen, dtype, grad=True):
    q, k, v = _inputs(1, 2, 64, 2, 1, 16, dtype, grad)
    if varlen:
        q, k, v = (t.detach().reshape(128, *t.shape[2:]).requires_grad_(grad) for t in (q, k, v))
        cu = torch.tensor([0, 40, 128], dtype=torch.int32, device=DEVICE)
        return (q, k, v, pattern_key(pattern), 0.25, 2, cu, cu, 88, 88)
    # q as a permuted dense tensor: the fake must give the strides the kernels allocate.
    q = q.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_(grad)
    return (q, k, v, pattern_key(pattern), 0.25, 2, None, None, None, None)


@pytest.mark.parametrize("path", ["reference", "kernels"])
@pytest.mark.parametrize("varlen", [False, True], ids=["batched", "varlen"])
def test_opcheck(request, path, varlen):
    if path == "reference":
        request.getfixturevalue("reference_ops")
    elif not dispatch.supports_triton(torch.device(DEVICE)):
        pytest.skip("no Triton backend here")
    pattern = s2attn.local_stride_pattern(
        1, max_seq_len=128, block_size=16, local_blocks=1, vert_stride=2
    )
    dtype = DTYPES[0]
    args = _op_args(pattern, varlen, dtype)
    torch.library.opcheck(attention_forward, args)
    out, lse = attention_forward(*(a.detach() if torch.is_tensor(a) else a for a in args))
    grad_out, grad_lse = torch.randn_like(out), torch.randn_like(lse)
    q, k, v, *rest = (a.detach() if torch.is_tensor(a) else a for a in args)
    for grads in ((grad_out, grad_lse), (grad_out, None), (None, grad_lse)):
        torch.library.opcheck(attention_backward, (*grads, q, k, v, out, lse, *rest))


def test_opcheck_catches_a_wrong_fake(reference_ops, monkeypatch):
    """The check above can fail: an operator whose LSE disagrees with its fake's dtype."""
    from s2attn.plan import AttentionPlan

    plan_forward = AttentionPlan.forward

    def float64_lse(self, q, k, v):
        out, lse = plan_forward(self, q, k, v)
        return out, lse.double()

    monkeypatch.setattr(AttentionPlan, "forward", float64_lse)
    pattern = s2attn.local_stride_pattern(
        1, max_seq_len=128, block_size=16, local_blocks=1, vert_stride=2
    )
    with pytest.raises(Exception, match="test_faketensor failed"):
        torch.library.opcheck(
            attention_forward, _op_args(pattern, False, torch.float32), test_utils="test_faketensor"
        )


# -------------------------------------------------------------------------------- graph breaks
class _TinyBlock(nn.Module):
    def __init__(self, pattern, hidden, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.attn = s2attn.SparseAttention(pattern)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, -1).unbind(2)
        return x + self.proj(self.attn(q, k, v).reshape(b, s, -1))


def test_no_graph_break(reference_ops):
    pattern = s2attn.local_stride_pattern(
        2, max_seq_len=64, block_size=16, local_blocks=1, vert_stride=2
    )
    model = nn.Sequential(_TinyBlock(pattern, 32, 2), _TinyBlock(pattern, 32, 2))
    x = torch.randn(1, 64, 32)
    explained = torch._dynamo.explain(model)(x)
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1

    q, k, v = _inputs(2, 1, 64, 2, 2, 16, torch.float32)
    cu = torch.tensor([0, 30, 64], dtype=torch.int32)

    def with_lse(q, k, v):
        out, lse = s2attn.sparse_attention(q, k, v, pattern, return_lse=True)
        packed = s2attn.sparse_attention(
            q[0], k[0], v[0], pattern, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=34
        )
        qkv = torch.stack((q, k, v), dim=2)
        return out * 2 + packed + s2attn.sparse_attention_qkvpacked(qkv, pattern), lse

    explained = torch._dynamo.explain(with_lse)(q, k, v)
    assert explained.graph_break_count == 0, explained.break_reasons
    ops = [str(n.target) for g in explained.graphs for n in g.graph.nodes]
    assert ops.count("s2attn.forward.default") == 3


# --------------------------------------------------------------------- layouts while tracing
@pytest.mark.parametrize("form", ["batched", "varlen"])
def test_layouts_are_built_while_tracing(form):
    """The fake implementations build every layout the kernels will use, before any compiled code
    runs: under ``mode="reduce-overhead"`` the first run is CUDA-graph trees' warm-up, whose
    allocations land in the graph's private pool, where cached layouts would be refused."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    from s2attn.ops import layout

    if not dispatch.supports_triton(torch.device(DEVICE)):
        pytest.skip("no Triton backend here")
    dtype = DTYPES[-1]

    def call(pattern, q, k, v):
        if form == "batched":
            return s2attn.sparse_attention(q, k, v, pattern)
        flat = (t.reshape(128, *t.shape[2:]) for t in (q, k, v))
        cu = torch.tensor([0, 50, 128], dtype=torch.int32, device=DEVICE)
        return s2attn.sparse_attention(
            *flat, pattern, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=78, max_seqlen_k=78
        )

    eager_pattern = s2attn.local_stride_pattern(
        2, max_seq_len=128, block_size=16, local_blocks=2, vert_stride=2
    )
    q, k, v = _inputs(5, 2, 64, 2, 2, 16, dtype)
    call(eager_pattern, q, k, v).sum().backward()
    used = set(layout._CACHE[eager_pattern])
    assert len(used) >= 2  # the forward's and the backward's

    pattern = s2attn.local_stride_pattern(
        2, max_seq_len=128, block_size=16, local_blocks=2, vert_stride=2
    )  # a new object: nothing cached yet
    built = {}

    def on_compile(gm, example_inputs):
        built.setdefault("before any run", set(layout._CACHE.get(pattern, {})))
        return make_boxed_func(gm.forward)

    backend = aot_autograd(fw_compiler=on_compile, bw_compiler=on_compile)
    torch.compile(lambda q, k, v: call(pattern, q, k, v), backend=backend, fullgraph=True)(
        q, k, v
    ).sum().backward()
    assert built["before any run"] == used


# ------------------------------------------------------------------ compiled against reference
@pytest.mark.parametrize("path", ["reference", "kernels"])
@pytest.mark.parametrize("form", ["batched", "varlen", "qkvpacked"])
def test_compiled_matches_reference(request, path, form):
    if path == "reference":
        request.getfixturevalue("reference_ops")
    elif not dispatch.supports_triton(torch.device(DEVICE)):
        pytest.skip("no Triton backend here")
    dtype = DTYPES[-1]
    pattern = s2attn.local_stride_pattern(
        2, max_seq_len=64, block_size=16, local_blocks=1, vert_stride=2
    )
    q, k, v = _inputs(3, 2, 64, 2, 2, 16, dtype)
    kwargs = {}
    if form == "varlen":
        q, k, v = (t.detach().reshape(128, 2, 16).requires_grad_() for t in (q, k, v))
        cu = torch.tensor([0, 50, 110, 128], dtype=torch.int32, device=DEVICE)
        kwargs = dict(cu_seqlens_q=cu, cu_seqlens_k=cu)

    def call(q, k, v):
        if form == "qkvpacked":
            qkv = torch.stack((q, k, v), dim=2)
            return s2attn.sparse_attention_qkvpacked(qkv, pattern, return_lse=True)
        return s2attn.sparse_attention(q, k, v, pattern, return_lse=True, **kwargs)

    out, lse = torch.compile(call, backend=BACKEND, fullgraph=True)(q, k, v)
    gen = torch.Generator().manual_seed(4)
    upstream = (
        torch.randn(out.shape, generator=gen).to(DEVICE, dtype),
        torch.randn(lse.shape, generator=gen).to(DEVICE),
    )
    grads = torch.autograd.grad((out, lse), (q, k, v), upstream)
    ref_out, ref_lse, ref_grads = _reference_grads(q, k, v, pattern, upstream, **kwargs)
    assert_close(out, ref_out, dtype, f"{path} {form} out")
    assert_close(lse, ref_lse, torch.float32, f"{path} {form} lse")
    for name, got, want in zip("qkv", grads, ref_grads):
        assert_close(got, want, dtype, f"{path} {form} d{name}")


def test_compiled_under_autocast(reference_ops):
    """The boundary cast traces: float32 inputs under a bfloat16 region give a bfloat16 output
    and float32 gradients, as eager does."""
    pattern = s2attn.local_stride_pattern(
        2, max_seq_len=64, block_size=16, local_blocks=1, vert_stride=2
    )
    q, k, v = _inputs(5, 1, 64, 2, 2, 16, torch.float32)

    def call(q, k, v):
        with torch.autocast(q.device.type, dtype=torch.bfloat16):
            return s2attn.sparse_attention(q, k, v, pattern)

    explained = torch._dynamo.explain(call)(q, k, v)
    assert explained.graph_break_count == 0, explained.break_reasons
    out = torch.compile(call, backend=BACKEND, fullgraph=True)(q, k, v)
    eager = call(q, k, v)
    assert out.dtype == torch.bfloat16
    assert_close(out, eager.float(), torch.bfloat16, "compiled vs eager under autocast")
    (dq,) = torch.autograd.grad(out.float().sum(), (q,))
    assert dq.dtype == torch.float32


# ---------------------------------------------------------------------------- recompilations
def test_recompiles_only_for_a_new_pattern(reference_ops):
    graphs = []

    def counting_backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    first = s2attn.local_stride_pattern(
        2, max_seq_len=64, block_size=16, local_blocks=1, vert_stride=2
    )
    second = s2attn.local_stride_pattern(
        2, max_seq_len=64, block_size=16, local_blocks=1, vert_stride=2, head_offset=1
    )
    attn = s2attn.SparseAttention(first)
    compiled = torch.compile(attn, backend=counting_backend, fullgraph=True)
    q, k, v = _inputs(6, 1, 64, 2, 2, 16, torch.float32, grad=False)
    outs = [compiled(q, k, v) for _ in range(3)]
    assert len(graphs) == 1
    attn.pattern = second
    out_second = compiled(q, k, v)
    assert len(graphs) == 2
    compiled(q, k, v)
    attn.pattern = first
    compiled(q, k, v)  # the first graph is still cached
    assert len(graphs) == 2
    assert_close(outs[-1], s2attn.attention_reference(q, k, v, first), torch.float32, "first")
    ref = s2attn.attention_reference(q, k, v, second)
    assert_close(out_second, ref, torch.float32, "second pattern")


def test_a_collected_pattern_is_reported():
    from s2attn.compile import pattern_for_key

    key = pattern_key(
        s2attn.local_stride_pattern(1, max_seq_len=64, block_size=16, local_blocks=1, vert_stride=2)
    )
    with pytest.raises(RuntimeError, match="garbage-collected"):
        pattern_for_key(key)


def test_copies_get_their_own_key():
    """A deep copy or an unpickled pattern is a new live object with a new key (its original's
    key may name another pattern, e.g. in another process), and runs through the operator."""
    import copy
    import pickle

    from s2attn.compile import pattern_for_key

    pattern = s2attn.local_stride_pattern(
        2, max_seq_len=64, block_size=16, local_blocks=1, vert_stride=2
    )
    copies = [copy.deepcopy(pattern), pickle.loads(pickle.dumps(pattern))]
    keys = {pattern_key(pattern)} | {pattern_key(c) for c in copies}
    assert len(keys) == 3
    for c in copies:
        assert pattern_for_key(pattern_key(c)) is c
        assert torch.equal(c.mask, pattern.mask)
    q, k, v = (torch.randn(1, 64, 2, 16) for _ in range(3))
    out, _ = attention_forward(q, k, v, pattern_key(copies[1]), 0.25, 1, None, None, None, None)
    assert_close(out, s2attn.attention_reference(q, k, v, pattern), torch.float32, "copy")


# ------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@skip_without_gpu
@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_inductor_on_gpu(mode):
    """Inductor compiles a block around the operators (CUDA graphs under reduce-overhead); the
    kernels' results and gradients match the reference."""
    dtype = torch.bfloat16
    pattern = s2attn.local_stride_pattern(
        4, max_seq_len=1024, block_size=64, local_blocks=4, vert_stride=4
    )
    model = _TinyBlock(pattern, 256, 4).to(DEVICE, dtype)
    x = torch.randn(2, 1024, 256, device=DEVICE, dtype=dtype, requires_grad=True)
    compiled = torch.compile(model, fullgraph=True, mode=mode)
    for _ in range(3):  # CUDA graphs record on a later call
        out = compiled(x)
    (dx,) = torch.autograd.grad(out.float().square().sum(), (x,))
    with torch.no_grad():
        q, k, v = model.qkv(x).view(2, 1024, 3, 4, -1).unbind(2)
    want = model(x)
    (want_dx,) = torch.autograd.grad(want.float().square().sum(), (x,))
    assert_close(out, want.float(), dtype, f"{mode} out vs eager")
    assert_close(dx, want_dx, dtype, f"{mode} dx vs eager")
    ref = s2attn.attention_reference(q.float(), k.float(), v.float(), pattern)
    got = model.attn(q, k, v)
    assert_close(got, ref, dtype, f"{mode} attention vs reference")


@pytest.mark.gpu
@skip_without_gpu
def test_cached_state_is_built_outside_a_graph_pool():
    """What outlives a call (layouts, the Gluon kernels' work counters) is allocated outside a
    CUDA graph's private pool even while the calling thread allocates into one, as it does in
    CUDA-graph trees' warm-up; the thread's other allocations still go to the pool."""
    from s2attn.memory import build_outside_graph_pool
    from s2attn.ops.layout import forward_layout

    pattern = s2attn.local_stride_pattern(
        4, max_seq_len=2048, block_size=64, local_blocks=4, vert_stride=4
    )
    pool = torch.cuda.MemPool()
    with torch.cuda.use_mem_pool(pool):
        inside = torch.zeros(4096, device=DEVICE)
        outside = build_outside_graph_pool(DEVICE, lambda: torch.ones(4096, device=DEVICE))
        layout = forward_layout(pattern, 64, 64, DEVICE)
    segments = [(s["address"], s["address"] + s["total_size"]) for s in pool.snapshot()]

    def in_pool(t: torch.Tensor) -> bool:
        return any(lo <= t.data_ptr() < hi for lo, hi in segments)

    assert in_pool(inside) and not in_pool(outside)
    assert outside.sum().item() == 4096  # built, and ordered before this read
    tensors = [t for t in vars(layout).values() if isinstance(t, torch.Tensor) and t.numel()]
    assert tensors and not any(in_pool(t) for t in tensors)


# -------------------------------------------------------------------- through transformers
@pytest.mark.parametrize("loaded", [False, True], ids=["configured", "from_pretrained"])
def test_transformers_model_compiles_whole(loaded, reference_ops, tmp_path):
    """A Llama with S2 and dense layers through the "s2attn" attention function traces as one
    graph (a model loaded from disk after ``prepare``), and the compiled logits and gradients
    equal eager ones."""
    from transformers import LlamaForCausalLM

    from s2attn.integrations import transformers as s2hf
    from s2attn.training import presets

    model = presets.build_model(presets.model_config("tiny", "hhst", seq_len=128))
    if loaded:
        s2attn.pattern._SHARED.clear()  # as in a new process: nothing built before the load
        model.save_pretrained(tmp_path)
        model = LlamaForCausalLM.from_pretrained(tmp_path)
        s2hf.prepare(model)
    ids = torch.randint(0, 256, (2, 128), generator=torch.Generator().manual_seed(3))

    def logits(ids):
        return model(input_ids=ids, use_cache=False).logits

    explained = torch._dynamo.explain(logits)(ids)
    assert explained.graph_break_count == 0, explained.break_reasons
    ops = [str(n.target) for g in explained.graphs for n in g.graph.nodes]
    assert ops.count("s2attn.forward.default") == model.config.num_hidden_layers

    eager = logits(ids)
    eager_grads = torch.autograd.grad(eager.square().mean(), list(model.parameters()))
    compiled = torch.compile(logits, backend=BACKEND, fullgraph=True)(ids)
    grads = torch.autograd.grad(compiled.square().mean(), list(model.parameters()))
    assert_close(compiled, eager, torch.float32, "compiled logits")
    for got, want in zip(grads, eager_grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


def test_transformers_padded_batch_compiles_whole(reference_ops):
    """A left-padded batch (training, prefill without a cache): the padding mask goes to the
    attention as data, so the model still traces as one graph, and compiled logits and gradients
    equal eager ones."""
    from s2attn.training import presets

    model = presets.build_model(presets.model_config("tiny", "hhst", seq_len=128))
    gen = torch.Generator().manual_seed(4)
    ids = torch.randint(0, 256, (3, 128), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, :50] = 0
    mask[2, :127] = 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)

    def logits(ids, mask, positions):
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False)
        return out.logits * mask[..., None]  # padded rows carry no meaning

    explained = torch._dynamo.explain(logits)(ids, mask, positions)
    assert explained.graph_break_count == 0, explained.break_reasons
    eager = logits(ids, mask, positions)
    eager_grads = torch.autograd.grad(eager.square().mean(), list(model.parameters()))
    compiled = torch.compile(logits, backend=BACKEND, fullgraph=True)(ids, mask, positions)
    grads = torch.autograd.grad(compiled.square().mean(), list(model.parameters()))
    assert_close(compiled, eager, torch.float32, "compiled logits")
    for got, want in zip(grads, eager_grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
