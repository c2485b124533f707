"""Mixed precision: every entry point follows ``torch.autocast`` as SDPA does.

Inside a region the inputs are cast to the region's dtype, the output comes back in it, and float32
leaves get float32 gradients. The fair reference is the float32 dense-mask reference on the inputs
rounded to the region's dtype (what the kernels are handed) with exact gradients through that
rounding (what a float32 leaf should receive); the kernels then differ from it by their own
float16/bfloat16 arithmetic, checked at that dtype's tolerance. On the CPU the region is float16
(the interpreter's bfloat16 matmuls are wrong; CPU autocast takes float16 on the pinned torch), on
the GPU both. Outside a region, or under ``autocast(enabled=False)``, nothing changes.
"""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import (
    DEVICE,
    ON_GPU,
    REL_TOL,
    assert_close,
    dtype_ids,
    gpu_only,
    randn,
    random_qkv,
    relative_error,
    skip_without_gpu,
)

import s2attn
from s2attn import attention_reference, local_stride_pattern, paged_kv_cache
from s2attn.precision import autocast_entry

# The autocast dtypes whose kernels give correct results on this device.
REGIONS = [torch.bfloat16, torch.float16] if ON_GPU else [torch.float16]
REGION_IDS = dtype_ids(REGIONS)
BS = 16


def _leaves(shapes, seed: int, dtype=torch.float32) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [randn(gen, *s, dtype=dtype).requires_grad_() for s in shapes]


def _qkv(batch, seq, heads, kv_heads, dim, seed, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return [
        t.requires_grad_() for t in random_qkv(gen, batch, seq, seq, heads, kv_heads, dim, dtype)
    ]


def _rounded(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t``'s values rounded to ``dtype``, in float32, with the identity as gradient."""
    return t + (t.detach().to(dtype).float() - t.detach())


def _upstream(out: torch.Tensor, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed + 1000)
    return torch.randn(out.shape, generator=gen).to(DEVICE, out.dtype)


def _reference(inputs, region, pattern, upstream, **kwargs):
    """Output and input gradients of the float32 reference on ``inputs`` rounded to ``region``."""
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = attention_reference(*(_rounded(t, region) for t in leaves), pattern, **kwargs)
    out.backward(upstream.float())
    return out, [t.grad for t in leaves]


def _check(out, inputs, region, pattern, seed, what, **kwargs):
    """``out`` came from float32 ``inputs`` under autocast(region): its dtype, values, and the
    float32 gradients it sends back, against the reference."""
    assert out.dtype == region, f"{what}: output in {out.dtype}, expected the region's {region}"
    upstream = _upstream(out, seed)
    out.backward(upstream)
    ref, ref_grads = _reference(inputs, region, pattern, upstream, **kwargs)
    assert_close(out.float(), ref, region, f"{what} out")
    for name, t, g in zip(("dq", "dk", "dv"), inputs, ref_grads):
        assert t.grad.dtype == torch.float32, f"{what} {name}: {t.grad.dtype}, expected float32"
        assert_close(t.grad, g, region, f"{what} {name}")


# -------------------------------------------------------------------------- entry points
@pytest.mark.parametrize("region", REGIONS, ids=REGION_IDS)
def test_sparse_attention(region):
    """GQA, float32 leaves; the result is the very call on inputs cast by hand, and the LSE stays
    float32."""
    pattern = local_stride_pattern(
        4, max_seq_len=80, block_size=BS, local_blocks=2, vert_stride=3, num_kv_heads=2
    )
    q, k, v = _qkv(2, 80, 4, 2, 32, seed=0)
    with torch.autocast(DEVICE, dtype=region):
        out, lse = s2attn.sparse_attention(q, k, v, pattern, return_lse=True)
    assert lse.dtype == torch.float32
    by_hand = s2attn.sparse_attention(q.to(region), k.to(region), v.to(region), pattern)
    assert torch.equal(out, by_hand), "autocast took another path than the hand-cast call"
    _check(out, (q, k, v), region, pattern, 0, "batched")


@pytest.mark.parametrize("region", REGIONS, ids=REGION_IDS)
def test_varlen(region):
    pattern = local_stride_pattern(2, max_seq_len=96, block_size=BS, local_blocks=2, vert_stride=3)
    lens = [40, 0, 75]
    q, k, v = _leaves([(sum(lens), 2, 32)] * 3, seed=1)
    cu = torch.tensor([0, *lens], device=DEVICE).cumsum(0).to(torch.int32)
    with torch.autocast(DEVICE, dtype=region):
        out = s2attn.sparse_attention(q, k, v, pattern, cu_seqlens_q=cu, cu_seqlens_k=cu)
    _check(out, (q, k, v), region, pattern, 1, "varlen", cu_seqlens_q=cu, cu_seqlens_k=cu)


@pytest.mark.parametrize("region", REGIONS, ids=REGION_IDS)
def test_qkvpacked(region):
    """The packed gradient comes back as one float32 tensor of qkv's shape."""
    pattern = local_stride_pattern(2, max_seq_len=64, block_size=BS, local_blocks=2, vert_stride=3)
    (qkv,) = _leaves([(2, 64, 3, 2, 32)], seed=2)
    with torch.autocast(DEVICE, dtype=region):
        out = s2attn.sparse_attention_qkvpacked(qkv, pattern)
    assert out.dtype == region
    upstream = _upstream(out, 2)
    out.backward(upstream)
    ref, ref_grads = _reference(qkv.unbind(2), region, pattern, upstream)
    assert_close(out.float(), ref, region, "qkvpacked out")
    assert qkv.grad.dtype == torch.float32 and qkv.grad.shape == qkv.shape
    assert_close(qkv.grad, torch.stack(ref_grads, dim=2), region, "qkvpacked dqkv")


@pytest.mark.parametrize("region", REGIONS, ids=REGION_IDS)
def test_module(region):
    pattern = local_stride_pattern(2, max_seq_len=64, block_size=BS, local_blocks=2, vert_stride=3)
    attn = s2attn.SparseAttention(pattern, softmax_scale=0.3)
    q, k, v = _qkv(1, 64, 2, 2, 32, seed=3)
    with torch.autocast(DEVICE, dtype=region):
        out = attn(q, k, v)
    _check(out, (q, k, v), region, pattern, 3, "module", softmax_scale=0.3)


@pytest.mark.parametrize("region", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
def test_kvcache_keeps_its_dtype(region):
    """A float16 cache under autocast with float32 q/k/v: a prefill and a decode step store and
    compute in float16 (so a bfloat16 region runs no bfloat16 matmul, even on the CPU); the output
    comes back in the region's dtype."""
    heads, kv_heads, dim, prompt = 4, 2, 32, 50
    pattern = local_stride_pattern(
        heads, max_seq_len=96, block_size=BS, local_blocks=2, vert_stride=3, num_kv_heads=kv_heads
    )
    cache = paged_kv_cache(
        pattern,
        batch_size=2,
        num_kv_heads=kv_heads,
        head_dim=dim,
        dtype=torch.float16,
        device=DEVICE,
        block_size=BS,
        max_seq_len=96,
    )
    q, k, v = (t.detach() for t in _qkv(2, prompt + 1, heads, kv_heads, dim, seed=4))
    steps = (slice(0, prompt), slice(prompt, prompt + 1))  # prefill, then one decode step
    outs = []
    with torch.autocast(DEVICE, dtype=region):
        for s in steps:
            out, lse = s2attn.sparse_attention_with_kvcache(
                q[:, s], cache, k[:, s], v[:, s], return_lse=True
            )
            assert out.dtype == region and lse.dtype == torch.float32
            outs.append(out)
    assert cache.k_pages.dtype == torch.float16 and cache.lengths == [prompt + 1] * 2
    half = [t.to(torch.float16).float() for t in (q, k, v)]
    ref = attention_reference(*half, pattern)
    # The tolerance of the coarser of the two roundings: float16 compute, region output.
    coarser = max((torch.float16, region), key=REL_TOL.get)
    assert_close(torch.cat(outs, dim=1).float(), ref, coarser, "prefill + decode")


# ----------------------------------------------------------------------------- transformers
# Through a whole model the two attentions' different roundings pass through the region's
# matmuls, forward and backward, into every later value: measured 1.2e-3 (logits) to 3.2e-3
# (weight gradients) in float16; an S2 layer run dense instead gives 0.2 to 0.6.
MODEL_TOL = {torch.float16: 1e-2, torch.bfloat16: 4e-2}


def _assert_model_close(actual, expected, region, what):
    err = relative_error(actual.float(), expected.float())
    print(f"{what}: relative error {err:.2e} (tolerance {MODEL_TOL[region]:.0e}, {region})")
    assert err < MODEL_TOL[region], f"{what}: relative error {err:.3e} for {region}"


def _tiny_llama():
    """float32 weights, 2 layers (dense, S2), 4 query / 2 KV heads of dim 16, blocks of 16."""
    transformers = pytest.importorskip("transformers")
    s2hf = pytest.importorskip("s2attn.integrations.transformers")
    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=128,
        initializer_range=0.2,
        bos_token_id=1,
        eos_token_id=None,
        pad_token_id=0,
    )
    s2hf.configure(config, block_size=16, local_blocks=2, vert_stride=3, dense_layers=[0])
    torch.manual_seed(5)
    model = transformers.LlamaForCausalLM(config).to(DEVICE)
    reference = transformers.LlamaForCausalLM(copy.deepcopy(config)).to(DEVICE)
    reference.load_state_dict(model.state_dict())
    reference.set_attn_implementation(s2hf.REFERENCE_IMPLEMENTATION)
    return model, reference, s2hf


@pytest.mark.parametrize("region", REGIONS, ids=REGION_IDS)
def test_transformers_training_step(region, monkeypatch):
    """A training forward and backward of a float32 Llama under autocast through ``"s2attn"``
    matches ``"s2attn_reference"`` under the same autocast: logits, loss and float32 weight
    gradients; then a prefill into an S2Cache, which keeps its pages in the region's dtype
    although the model hands it float32 keys."""
    model, reference, s2hf = _tiny_llama()
    seen = []
    real = s2hf.sparse_attention

    def spy(q, k, v, *args, **kwargs):
        seen.append((q.dtype, k.dtype, v.dtype))
        return real(q, k, v, *args, **kwargs)

    monkeypatch.setattr(s2hf, "sparse_attention", spy)
    ids = torch.randint(2, 128, (2, 60), device=DEVICE)
    with torch.autocast(DEVICE, dtype=region):
        got = model(ids, labels=ids)
        want = reference(ids, labels=ids)
    # Llama hands the attention float32 q/k/v: the cast is what makes the region's dtype.
    assert seen and all(dtypes == (torch.float32,) * 3 for dtypes in seen), seen
    assert got.logits.dtype == want.logits.dtype
    _assert_model_close(got.logits, want.logits, region, "logits")
    got.loss.backward()
    want.loss.backward()
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        w = model.model.layers[1].self_attn.get_submodule(name).weight
        w_ref = reference.model.layers[1].self_attn.get_submodule(name).weight
        assert w.grad.dtype == torch.float32
        _assert_model_close(w.grad, w_ref.grad, region, f"S2 layer {name}.weight grad")

    cache = s2hf.S2Cache(model.config)
    with torch.no_grad(), torch.autocast(DEVICE, dtype=region):
        prefill = model(ids, past_key_values=cache, use_cache=True)
    assert cache.layers[1].paged.dtype == region
    _assert_model_close(prefill.logits, want.logits, region, "S2Cache prefill logits")


# ------------------------------------------------------------------------ outside a region
def test_autocast_disabled_inside_keeps_float32_exactly():
    pattern = local_stride_pattern(2, max_seq_len=64, block_size=BS, local_blocks=2, vert_stride=3)
    q, k, v = (t.detach() for t in _qkv(1, 64, 2, 2, 32, seed=6))
    plain = s2attn.sparse_attention(q, k, v, pattern)
    with torch.autocast(DEVICE, dtype=REGIONS[-1]):
        with torch.autocast(DEVICE, enabled=False):
            nested = s2attn.sparse_attention(q, k, v, pattern)
    assert nested.dtype == torch.float32
    assert torch.equal(nested, plain)


def test_mixed_dtypes_raise_outside_autocast_and_are_cast_inside():
    pattern = local_stride_pattern(2, max_seq_len=64, block_size=BS, local_blocks=2, vert_stride=3)
    q, k, v = (t.detach() for t in _qkv(1, 64, 2, 2, 32, seed=7))
    q16 = q.to(torch.float16)
    message = "k has dtype torch.float32 but q has torch.float16"
    with pytest.raises(TypeError, match=message):
        s2attn.sparse_attention(q16, k, v, pattern)
    with torch.autocast(DEVICE, dtype=REGIONS[-1]):
        with torch.autocast(DEVICE, enabled=False), pytest.raises(TypeError, match=message):
            s2attn.sparse_attention(q16, k, v, pattern)
        out = s2attn.sparse_attention(q16, k, v, pattern)
    assert out.dtype == REGIONS[-1]
    by_hand = s2attn.sparse_attention(*(t.to(REGIONS[-1]) for t in (q16, k, v)), pattern)
    assert torch.equal(out, by_hand)


def test_float64_is_not_cast():
    """As for SDPA: autocast leaves float64 alone (gradcheck under an outer region still works)."""
    pattern = local_stride_pattern(2, max_seq_len=32, block_size=BS, local_blocks=1, vert_stride=2)
    q, k, v = (t.detach() for t in _qkv(1, 32, 2, 2, 16, seed=8, dtype=torch.float64))
    with torch.autocast(DEVICE, dtype=REGIONS[-1]):
        out = s2attn.sparse_attention(q, k, v, pattern)
    assert out.dtype == torch.float64
    assert torch.equal(out, s2attn.sparse_attention(q, k, v, pattern))


# ------------------------------------------------------------------------------ the decorator
class _Store:
    """Stands in for a cache: keeps its own dtype (None: not a store the boundary knows)."""

    def __init__(self, dtype):
        self.dtype = dtype


@autocast_entry(
    "q",
    "k",
    "v",
    compute_dtype=lambda q, store, *_, **__: store.dtype,
    output_in_region=True,
)
def _attend_store(q, store, k=None, v=None, *, return_lse=False):
    """What an entry point over a cache sees: its tensors' dtypes and whether autocast is on."""
    seen = (q.dtype, k.dtype, None if v is None else v.dtype, torch.is_autocast_enabled(DEVICE))
    out = q.clone()
    lse = torch.zeros(3, device=q.device)
    return (out, lse, seen) if return_lse else (out, seen)


def test_autocast_entry_computes_in_the_dtype_it_is_given():
    """The boundary a cache's entry points take (compute in the cache's dtype, hand the output
    back in the region's): arguments cast wherever they are passed, autocast off inside, the
    LSE and other results untouched; a None dtype or no region leaves the call as it came."""
    region = REGIONS[-1]
    q, k = (torch.randn(4, device=DEVICE) for _ in range(2))
    with torch.autocast(DEVICE, dtype=region):
        out, lse, seen = _attend_store(q, _Store(torch.bfloat16), k=k, return_lse=True)
        assert seen == (torch.bfloat16, torch.bfloat16, None, False)
        assert out.dtype == region and lse.dtype == torch.float32
        assert torch.equal(out, q.to(torch.bfloat16).to(region))
        out, seen = _attend_store(q, store=_Store(torch.float16), k=k, v=k.double())
        assert seen == (torch.float16, torch.float16, torch.float64, False)  # float64 stays
        out, seen = _attend_store(q, _Store(None), k)
        assert seen == (torch.float32, torch.float32, None, True) and out.dtype == torch.float32
    out, seen = _attend_store(q, _Store(torch.bfloat16), k)
    assert seen == (torch.float32, torch.float32, None, False) and out.dtype == torch.float32


def test_autocast_entry_names_only_its_parameters():
    with pytest.raises(ValueError, match="has no parameter 'query'"):
        autocast_entry("query")(lambda q, k: q)


# ------------------------------------------------------------------------------- GPU only
@gpu_only
@skip_without_gpu
@pytest.mark.parametrize("region", REGIONS, ids=REGION_IDS)
def test_large_gqa_under_autocast(region):
    """The shapes the Hopper kernels take (dim 128, 64-token blocks), float32 leaves."""
    pattern = local_stride_pattern(
        8, max_seq_len=2048, block_size=64, local_blocks=4, vert_stride=8, num_kv_heads=4
    )
    q, k, v = _qkv(2, 2048, 8, 4, 128, seed=9)
    with torch.autocast(DEVICE, dtype=region):
        out = s2attn.sparse_attention(q, k, v, pattern)
    _check(out, (q, k, v), region, pattern, 9, "large")
