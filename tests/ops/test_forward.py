"""The forward kernel against the float32 dense-mask reference: output and LSE.

On the CPU the kernels run under the Triton interpreter (slow), so shapes stay small but never
trivial: several tiles per sequence, ragged ends, rows that attend nothing. Outputs start as NaN
(conftest), so an element the kernel fails to write fails the comparison.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from helpers import (
    DEVICE,
    DTYPE_IDS,
    DTYPES,
    REL_TOL,
    assert_close,
    randn,
    random_qkv,
    relative_error,
    skip_without_gpu,
)

import s2attn
from s2attn import BlockPattern, local_stride_pattern
from s2attn.ops import backends, dispatch, layout

SEEDS = [0, 1]


def _random_pattern(gen, heads, max_seq_len, block_size, causal, density=0.3) -> BlockPattern:
    nb = math.ceil(max_seq_len / block_size)
    return BlockPattern(torch.rand(heads, nb, nb, generator=gen) < density, block_size, causal)


def _check(q, k, v, pattern, **kwargs):
    """sparse_attention against the reference on the same inputs upcast to float32."""
    out, lse = s2attn.sparse_attention(q, k, v, pattern, return_lse=True, **kwargs)
    ref_kwargs = {name: x for name, x in kwargs.items() if not name.startswith("max_seqlen")}
    ref, ref_lse = s2attn.attention_reference(
        q.float(), k.float(), v.float(), pattern, return_lse=True, **ref_kwargs
    )
    assert out.dtype == q.dtype and lse.dtype == torch.float32
    assert_close(out, ref, q.dtype, "out")
    assert_close(lse, ref_lse, q.dtype, "lse")
    return out, lse


# ---------------------------------------------------------------------------------- patterns
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize(
    "batch, seq, heads, dim, block_size, local_blocks, vert_stride, causal",
    [
        (2, 200, 4, 64, 16, 2, 3, True),
        (1, 257, 2, 64, 32, 2, 2, False),
        (2, 100, 2, 32, 64, 1, 2, True),
        (1, 300, 2, 64, 128, 1, 2, True),
    ],
)
def test_local_stride_pattern(
    gen, seed, dtype, batch, seq, heads, dim, block_size, local_blocks, vert_stride, causal
):
    # ``seed`` only changes the test id, from which ``gen`` is seeded: two draws of inputs per case.
    p = local_stride_pattern(
        heads,
        max_seq_len=seq,
        block_size=block_size,
        local_blocks=local_blocks,
        vert_stride=vert_stride,
        causal=causal,
    )
    _check(*random_qkv(gen, batch, seq, seq, heads, heads, dim, dtype), p)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize(
    "seq, block_size, causal",
    [
        (1, 16, True),
        (17, 16, False),
        (100, 32, True),
        (130, 16, True),
        (257, 64, False),
        (257, 128, True),
    ],
)
def test_random_pattern(gen, dtype, seq, block_size, causal):
    # Sparse enough that some rows attend nothing, in both causal and bidirectional patterns.
    p = _random_pattern(gen, 2, seq, block_size, causal)
    _check(*random_qkv(gen, 2, seq, seq, 2, 2, 64, dtype), p)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("dim", [16, 64, 80, 96, 128, 256])
def test_head_dims(gen, dtype, dim):
    seq = 64 if dim > 128 else 100  # 256-wide heads are slow under the interpreter
    p = local_stride_pattern(2, max_seq_len=seq, block_size=16, local_blocks=1, vert_stride=3)
    _check(*random_qkv(gen, 1, seq, seq, 2, 2, dim, dtype), p)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("causal", [True, False])
def test_dense_pattern_matches_torch_sdpa(gen, dtype, causal):
    """An independent ground truth for the dense case, for the reference and the kernel alike."""
    q, k, v = random_qkv(gen, 1, 150, 150, 2, 2, 64, dtype)
    p = s2attn.dense_pattern(2, max_seq_len=150, block_size=32, causal=causal)
    out, _ = _check(q, k, v, p)
    sdpa = F.scaled_dot_product_attention(
        *(t.float().transpose(1, 2) for t in (q, k, v)), is_causal=causal
    ).transpose(1, 2)
    assert_close(out, sdpa, dtype, "out vs SDPA")


def test_softmax_scale(gen):
    dtype = DTYPES[0]
    p = local_stride_pattern(2, max_seq_len=120, block_size=16, local_blocks=2, vert_stride=2)
    _check(*random_qkv(gen, 1, 120, 120, 2, 2, 64, dtype), p, softmax_scale=0.37)


# ------------------------------------------------------------------------------- GQA and MQA
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize(
    "heads, kv_heads, pattern_heads", [(8, 2, 8), (8, 2, 2), (4, 1, 4), (4, 1, 1)]
)
def test_gqa_and_mqa(gen, dtype, heads, kv_heads, pattern_heads):
    # Random per-head patterns, so a query head that reads its neighbour's pattern fails.
    p = _random_pattern(gen, pattern_heads, 130, 16, causal=True, density=0.5)
    _check(*random_qkv(gen, 1, 130, 130, heads, kv_heads, 64, dtype), p)


# ----------------------------------------------------------------------------------- lengths
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("seq_q, seq_k", [(1, 257), (17, 100), (100, 200), (64, 128)])
def test_fewer_queries_than_keys(gen, dtype, causal, seq_q, seq_k):
    p = local_stride_pattern(
        2, max_seq_len=256 + 16, block_size=16, local_blocks=2, vert_stride=3, causal=causal
    )
    _check(*random_qkv(gen, 2, seq_q, seq_k, 2, 2, 32, dtype), p)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("block_size, seq_q, seq_k", [(128, 64, 64), (128, 100, 192), (64, 96, 96)])
def test_bidirectional_sequence_ending_inside_a_block(gen, dtype, block_size, seq_q, seq_k):
    """seq_k a multiple of the KV tile but not of the block: the last block's KV tiles past seq_k
    are full entries of the cropped layout and must still be bounded."""
    p = BlockPattern(torch.ones(2, 2, 2, dtype=torch.bool), block_size, causal=False)
    _check(*random_qkv(gen, 2, seq_q, seq_k, 2, 2, 64, dtype), p)


def _cu(lengths) -> torch.Tensor:
    return torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0).to(DEVICE, torch.int32)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("causal", [True, False])
def test_varlen(gen, dtype, causal):
    # Different lengths, fewer queries than keys in some, an empty query run, a one-token one.
    lens_q, lens_k = [17, 0, 100, 64, 1, 130], [40, 5, 100, 130, 1, 130]
    heads = 2
    q = randn(gen, sum(lens_q), heads, 64, dtype=dtype)
    k = randn(gen, sum(lens_k), heads, 64, dtype=dtype)
    v = randn(gen, sum(lens_k), heads, 64, dtype=dtype)
    p = local_stride_pattern(
        heads, max_seq_len=130, block_size=16, local_blocks=2, vert_stride=3, causal=causal
    )
    out, lse = _check(
        q,
        k,
        v,
        p,
        cu_seqlens_q=_cu(lens_q),
        cu_seqlens_k=_cu(lens_k),
        max_seqlen_q=130,
        max_seqlen_k=130,
    )
    assert lse.shape == (heads, sum(lens_q))


def test_varlen_gqa_per_kv_head_pattern(gen):
    dtype = DTYPES[0]
    lens_q, lens_k = [33, 120], [70, 120]
    q = randn(gen, sum(lens_q), 4, 64, dtype=dtype)
    k = randn(gen, sum(lens_k), 2, 64, dtype=dtype)
    v = randn(gen, sum(lens_k), 2, 64, dtype=dtype)
    p = _random_pattern(gen, 2, 128, 32, causal=True, density=0.6)
    _check(q, k, v, p, cu_seqlens_q=_cu(lens_q), cu_seqlens_k=_cu(lens_k))


def test_empty_query_sequence(gen):
    q, k, v = random_qkv(gen, 1, 0, 40, 2, 2, 64, DTYPES[0])
    p = local_stride_pattern(2, max_seq_len=64, block_size=16, local_blocks=1, vert_stride=2)
    out, lse = s2attn.sparse_attention(q, k, v, p, return_lse=True)
    assert out.shape == q.shape and lse.shape == (1, 2, 0)


# ----------------------------------------------------------------------------------- strides
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("storage", ["qkv_slices", "transposed", "strided_dim"])
def test_strided_inputs(gen, dtype, storage):
    b, s, h, d = 2, 150, 2, 64
    if storage == "qkv_slices":
        q, k, v = randn(gen, b, s, 3, h, d, dtype=dtype).unbind(2)
    elif storage == "transposed":  # (batch, heads, seq, dim) storage, and (seq, batch, ...)
        q = randn(gen, b, h, s, d, dtype=dtype).transpose(1, 2)
        k = randn(gen, b, h, s, d, dtype=dtype).transpose(1, 2)
        v = randn(gen, s, b, h, d, dtype=dtype).transpose(0, 1)
    else:  # every other element of the head dim
        q, k, v = (randn(gen, b, s, h, 2 * d, dtype=dtype)[..., ::2] for _ in range(3))
    assert not any(t.is_contiguous() for t in (q, k, v))
    p = local_stride_pattern(h, max_seq_len=s, block_size=32, local_blocks=2, vert_stride=2)
    out, _ = _check(q, k, v, p)
    same, _ = _check(q.contiguous(), k.contiguous(), v.contiguous(), p)
    assert torch.equal(out, same)


# ------------------------------------------------------------------------ rows with no keys
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("causal", [True, False])
def test_rows_that_attend_nothing(gen, dtype, causal):
    bs, seq = 16, 100
    mask = local_stride_pattern(
        2, max_seq_len=seq, block_size=bs, local_blocks=2, vert_stride=3, causal=causal
    ).mask.clone()
    mask[0, 2] = False  # head 0, query block 2 (rows 32..47) keeps no KV block
    mask[1, 6] = False  # head 1, the ragged last block (rows 96..99)
    p = BlockPattern(mask, bs, causal)
    out, lse = _check(*random_qkv(gen, 2, seq, seq, 2, 2, 64, dtype), p)
    for head, rows in ((0, slice(32, 48)), (1, slice(96, 100))):
        assert (out[:, rows, head] == 0).all()
        assert (lse[:, head, rows] == float("-inf")).all()
    assert torch.isfinite(out).all() and not lse.isnan().any()
    assert torch.isfinite(lse[:, 0, :32]).all()


@pytest.mark.parametrize("causal", [True, False])
def test_pattern_that_keeps_nothing(gen, causal):
    dtype = DTYPES[0]
    p = BlockPattern(torch.zeros(2, 4, 4, dtype=torch.bool), 32, causal)
    out, lse = _check(*random_qkv(gen, 1, 70, 100, 2, 2, 64, dtype), p)
    assert (out == 0).all() and (lse == float("-inf")).all()


# ----------------------------------------------------------------------------- merging chunks
def _split(p: BlockPattern, gen) -> tuple[BlockPattern, BlockPattern]:
    """Two disjoint patterns whose union is p (random per block, so some rows are empty in one)."""
    cond = torch.rand(p.mask.shape, generator=gen) < 0.5
    return (
        BlockPattern(p.mask & cond, p.block_size, p.causal),
        BlockPattern(p.mask & ~cond, p.block_size, p.causal),
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("causal", [True, False])
def test_merge_partials_equals_one_call(gen, dtype, causal):
    q, k, v = random_qkv(gen, 2, 90, 120, 2, 2, 64, dtype)
    p = local_stride_pattern(
        2, max_seq_len=128, block_size=16, local_blocks=2, vert_stride=3, causal=causal
    )
    p1, p2 = _split(p, gen)
    o1, l1 = _check(q, k, v, p1)
    o2, l2 = _check(q, k, v, p2)
    out, lse = s2attn.merge_partials([o1, o2], [l1, l2])
    one, one_lse = _check(q, k, v, p)
    assert out.dtype == dtype
    assert_close(out, one, dtype, "merged out vs one call")
    assert_close(lse, one_lse, dtype, "merged lse vs one call")


def test_merge_partials_packed_with_empty_rows(gen):
    dtype = DTYPES[0]
    lens = [50, 90]
    q, k, v = (randn(gen, sum(lens), 2, 64, dtype=dtype) for _ in range(3))
    mask = local_stride_pattern(
        2, max_seq_len=96, block_size=16, local_blocks=1, vert_stride=3
    ).mask.clone()
    mask[0, 1] = False  # rows 16..31 of head 0 attend nothing in either chunk
    p = BlockPattern(mask, 16)
    cu = dict(cu_seqlens_q=_cu(lens), cu_seqlens_k=_cu(lens))
    parts = [_check(q, k, v, part, **cu) for part in _split(p, gen)]
    out, lse = s2attn.merge_partials(*zip(*parts))
    one, one_lse = _check(q, k, v, p, **cu)
    assert_close(out, one, dtype, "merged out vs one call")
    assert_close(lse, one_lse, dtype, "merged lse vs one call")
    assert (lse[0, 16:32] == float("-inf")).all() and (out[16:32, 0] == 0).all()


# ------------------------------------------------------------------- module and packed qkv
def test_module_matches_function(gen):
    dtype = DTYPES[0]
    p = local_stride_pattern(4, max_seq_len=128, block_size=16, local_blocks=2, vert_stride=2)
    q, k, v = random_qkv(gen, 1, 128, 128, 4, 2, 64, dtype)
    attn = s2attn.SparseAttention(p, softmax_scale=0.2)
    out, lse = attn(q, k, v, return_lse=True)
    want, want_lse = s2attn.sparse_attention(q, k, v, p, softmax_scale=0.2, return_lse=True)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
    ref = s2attn.attention_reference(q.float(), k.float(), v.float(), p, softmax_scale=0.2)
    assert_close(out, ref, dtype, "module out")
    assert repr(p) in repr(attn)
    with pytest.raises(TypeError, match="pattern"):
        s2attn.SparseAttention(p.mask)


def test_module_varlen(gen):
    dtype = DTYPES[0]
    lens = [30, 70]
    q, k, v = (randn(gen, 100, 2, 32, dtype=dtype) for _ in range(3))
    p = local_stride_pattern(2, max_seq_len=80, block_size=16, local_blocks=1, vert_stride=2)
    cu = dict(cu_seqlens_q=_cu(lens), cu_seqlens_k=_cu(lens))
    out = s2attn.SparseAttention(p)(q, k, v, **cu)
    assert torch.equal(out, s2attn.sparse_attention(q, k, v, p, **cu))


@pytest.mark.parametrize("varlen", [False, True])
def test_qkvpacked_matches_slices(gen, varlen):
    dtype = DTYPES[0]
    p = local_stride_pattern(2, max_seq_len=160, block_size=32, local_blocks=1, vert_stride=2)
    if varlen:
        qkv = randn(gen, 210, 3, 2, 64, dtype=dtype)
        kwargs = dict(cu_seqlens=_cu([60, 150]))
        sliced = dict(cu_seqlens_q=kwargs["cu_seqlens"], cu_seqlens_k=kwargs["cu_seqlens"])
    else:
        qkv = randn(gen, 2, 150, 3, 2, 64, dtype=dtype)
        kwargs, sliced = {}, {}
    out, lse = s2attn.sparse_attention_qkvpacked(qkv, p, return_lse=True, **kwargs)
    want, want_lse = _check(*qkv.unbind(-3), p, **sliced)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)


# --------------------------------------------------------------------------- tile geometries
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize(
    "block_size, block_m, block_n",
    [
        (16, 128, 64),
        (64, 64, 64),
        (16, 16, 16),
        (32, 32, 128),
        (16, 128, 128),
        (128, 64, 32),
        (64, 128, 16),
    ],
)
def test_tile_geometries(gen, monkeypatch, causal, block_size, block_m, block_n):
    """The GPU's tile shapes (and odd ones) through the public path, by a forward table of one
    backend, Triton's, at these tiles."""
    dtype = DTYPES[0]
    triton = dataclasses.replace(backends.FORWARD[-1], tiles=lambda *_: (block_m, block_n))
    monkeypatch.setattr(dispatch, "FORWARD", (triton,))
    p = _random_pattern(gen, 2, 280, block_size, causal, density=0.6)
    _check(*random_qkv(gen, 1, 200, 270, 2, 2, 64, dtype), p)
    if dispatch.supports_triton(torch.device(DEVICE)):  # the kernels ran at these tiles
        assert (block_m, block_n) in {key[:2] for key in layout._CACHE[p]}


# ------------------------------------------------------------------------------ torch.compile
def test_torch_compile_traces_the_call(gen):
    """A full graph holds the call (the registered operator, ``tests/test_compile.py``) and gets
    the eager results and gradients, with no warning."""
    import warnings

    dtype = DTYPES[0]
    q, k, v = (t.requires_grad_() for t in random_qkv(gen, 1, 64, 64, 2, 2, 16, dtype))
    p = local_stride_pattern(2, max_seq_len=64, block_size=16, local_blocks=1, vert_stride=2)

    def fn(q, k, v):
        return s2attn.sparse_attention(q, k, v, p) * 2

    upstream = randn(gen, *q.shape, dtype=dtype)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message="s2attn")
            out = torch.compile(fn, backend="aot_eager", fullgraph=True)(q, k, v)
        grads = torch.autograd.grad(out, (q, k, v), upstream)
        eager = fn(q, k, v)
        assert torch.equal(out, eager)
        for got, want in zip(grads, torch.autograd.grad(eager, (q, k, v), upstream)):
            assert torch.equal(got, want)
    finally:
        torch._dynamo.reset()


# --------------------------------------------------------------------------- the tests can fail
def test_a_wrong_pattern_is_caught(gen):
    dtype = DTYPES[0]
    q, k, v = random_qkv(gen, 1, 128, 128, 2, 2, 64, dtype)
    p = local_stride_pattern(2, max_seq_len=128, block_size=16, local_blocks=2, vert_stride=4)
    shifted = local_stride_pattern(
        2, max_seq_len=128, block_size=16, local_blocks=2, vert_stride=4, head_offset=1
    )
    out = s2attn.sparse_attention(q, k, v, p)
    wrong = s2attn.attention_reference(q.float(), k.float(), v.float(), shifted)
    assert relative_error(out, wrong) > 10 * REL_TOL[dtype]
    with pytest.raises(AssertionError):
        assert_close(out, wrong, dtype, "out vs the wrong pattern")
    with pytest.raises(AssertionError, match="NaN"):
        assert_close(torch.full_like(out, float("nan")), out, dtype, "poisoned")


# ------------------------------------------------------------------------------ GPU shapes
@pytest.mark.gpu
@skip_without_gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize(
    "batch, seq, heads, kv_heads, dim, block_size, causal",
    [
        (2, 2049, 8, 8, 128, 64, True),
        (1, 1500, 4, 4, 64, 16, True),
        (1, 1000, 4, 2, 256, 32, False),
        (1, 777, 8, 2, 80, 128, True),
        (2, 4096, 16, 4, 128, 64, True),
    ],
)
def test_gpu_large(gen, dtype, batch, seq, heads, kv_heads, dim, block_size, causal):
    p = local_stride_pattern(
        heads, max_seq_len=seq, block_size=block_size, local_blocks=4, vert_stride=4, causal=causal
    )
    _check(*random_qkv(gen, batch, seq, seq, heads, kv_heads, dim, dtype), p)


@pytest.mark.gpu
@skip_without_gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("causal", [True, False])
def test_gpu_varlen(gen, dtype, causal):
    lens_q, lens_k = [1000, 37, 2049, 1], [1500, 37, 2049, 700]
    q = randn(gen, sum(lens_q), 8, 128, dtype=dtype)
    k = randn(gen, sum(lens_k), 2, 128, dtype=dtype)
    v = randn(gen, sum(lens_k), 2, 128, dtype=dtype)
    p = local_stride_pattern(
        8,
        max_seq_len=2049,
        block_size=64,
        local_blocks=4,
        vert_stride=8,
        num_kv_heads=2,
        causal=causal,
    )
    _check(q, k, v, p, cu_seqlens_q=_cu(lens_q), cu_seqlens_k=_cu(lens_k))
