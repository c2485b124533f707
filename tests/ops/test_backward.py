"""Backward pass: dq, dk, dv (and the LSE's gradient) of the Triton kernels against torch.autograd
through the dense-mask reference, run on float32 copies of the same inputs.

Every case draws fresh seeded inputs and a random upstream gradient. On the CPU the kernels run
under the Triton interpreter, so shapes stay small (batch <= 2, heads <= 8, seq <= 200); larger
shapes and bf16 run on the GPU.
"""

from __future__ import annotations

import sys

import pytest
import torch
from helpers import (
    DEVICE,
    DTYPE_IDS,
    DTYPES,
    ON_GPU,
    LaunchSpy,
    assert_close,
    gpu_only,
    randn,
    random_qkv,
    skip_without_gpu,
    views_rows_apart,
)

import s2attn
from s2attn import BlockPattern, local_stride_pattern
from s2attn.ops.options import KernelOptions


# ----------------------------------------------------------------------------------- helpers
def _leaves(shapes, dtype, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [randn(gen, *s, dtype=dtype).requires_grad_() for s in shapes]


def _qkv(batch, seq_q, seq_k, heads, kv_heads, dim, dtype, seed=0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    qkv = random_qkv(gen, batch, seq_q, seq_k, heads, kv_heads, dim, dtype)
    return [t.requires_grad_() for t in qkv]


def _varlen_qkv(lens_q, lens_k, heads, kv_heads, dim, dtype, seed=0):
    total_q, total_k = sum(lens_q), sum(lens_k)
    q, k, v = _leaves(
        [(total_q, heads, dim), (total_k, kv_heads, dim), (total_k, kv_heads, dim)], dtype, seed
    )
    cu = lambda lens: torch.tensor([0, *lens], device=DEVICE).cumsum(0).to(torch.int32)
    return q, k, v, cu(lens_q), cu(lens_k)


def _pattern(heads, seq, block_size=16, *, causal=True, local_blocks=2, vert_stride=3):
    """A local-stride pattern whose local window does not cover the sequence: the stripes matter."""
    return local_stride_pattern(
        heads,
        max_seq_len=seq,
        block_size=block_size,
        local_blocks=local_blocks,
        vert_stride=vert_stride,
        causal=causal,
    )


def _upstream(outputs, seed: int) -> list[torch.Tensor]:
    """Random upstream gradients, one per output, never zeros or ones."""
    gen = torch.Generator().manual_seed(seed + 1000)
    return [randn(gen, *o.shape, dtype=o.dtype) for o in outputs]


def _reference_grads(inputs, pattern, upstream, *, return_lse=False, **kwargs):
    """Outputs and input gradients of the float32 reference on float32 copies of ``inputs``."""
    ref_inputs = [t.detach().float().requires_grad_() for t in inputs]
    ref = s2attn.attention_reference(*ref_inputs, pattern, return_lse=return_lse, **kwargs)
    ref = list(ref) if return_lse else [ref]
    torch.autograd.backward(ref, [g.float() for g in upstream])
    grads = [t.grad if t.grad is not None else torch.zeros_like(t) for t in ref_inputs]
    return ref, grads


def _check_grads(q, k, v, pattern, dtype, what, *, return_lse=False, seed=0, **kwargs):
    """Run the kernel forward and backward; compare out (and lse), dq, dk, dv with the reference."""
    res = s2attn.sparse_attention(q, k, v, pattern, return_lse=return_lse, **kwargs)
    outs = list(res) if return_lse else [res]
    upstream = _upstream(outs, seed)
    torch.autograd.backward(outs, upstream)
    ref_kwargs = {key: val for key, val in kwargs.items() if not key.startswith("max_seqlen")}
    refs, ref_grads = _reference_grads(
        (q, k, v), pattern, upstream, return_lse=return_lse, **ref_kwargs
    )
    assert_close(outs[0], refs[0], dtype, f"{what} out")
    if return_lse:
        assert_close(outs[1], refs[1], dtype, f"{what} lse")
    for name, t, r in zip(("dq", "dk", "dv"), (q, k, v), ref_grads):
        assert_close(t.grad, r, dtype, f"{what} {name}")


# ----------------------------------------------------------------- dtypes, head dims, masks
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
@pytest.mark.parametrize("head_dim", [16, 64, 80, 96, 128])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_grads_head_dims(dtype, head_dim, causal):
    q, k, v = _qkv(2, 90, 90, 2, 2, head_dim, dtype, seed=head_dim)
    pattern = _pattern(2, 90, causal=causal)
    _check_grads(q, k, v, pattern, dtype, f"d{head_dim} causal={causal}")


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_grads_head_dim_256(dtype):
    q, k, v = _qkv(1, 48, 48, 2, 2, 256, dtype, seed=1)
    _check_grads(q, k, v, _pattern(2, 48, local_blocks=1, vert_stride=2), dtype, "d256")


@pytest.mark.parametrize(
    "kv_heads, per_kv_head, causal",
    [(2, False, True), (2, True, False), (1, False, False), (1, True, True)],
    ids=["gqa-per-q-head", "gqa-per-kv-head", "mqa-per-q-head", "mqa-per-kv-head"],
)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_grads_gqa(dtype, kv_heads, per_kv_head, causal):
    """dK/dV of a KV head sum over the query heads of its group; patterns per query head differ
    inside a group, patterns per KV head are shared by it."""
    q, k, v = _qkv(1, 96, 96, 8, kv_heads, 32, dtype, seed=kv_heads)
    pattern = _pattern(kv_heads if per_kv_head else 8, 96, causal=causal)
    _check_grads(q, k, v, pattern, dtype, f"8/{kv_heads} heads per_kv_head={per_kv_head}")


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_grads_varlen(dtype, causal):
    """Packed sequences of different lengths, several with fewer queries than keys, one with
    keys but no queries (its dK, dV are zero), one empty (as a left-padded row's padding is when
    there is none)."""
    lens_q, lens_k = [33, 1, 0, 0, 100, 20], [33, 5, 40, 0, 190, 64]
    q, k, v, cu_q, cu_k = _varlen_qkv(lens_q, lens_k, 4, 2, 32, dtype, seed=3)
    _check_grads(
        q,
        k,
        v,
        _pattern(4, 190, causal=causal),
        dtype,
        f"varlen causal={causal}",
        cu_seqlens_q=cu_q,
        cu_seqlens_k=cu_k,
        max_seqlen_q=100,
        max_seqlen_k=190,
    )


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_grads_fewer_queries_than_keys(dtype, causal):
    """Batched seq_q < seq_k: queries aligned bottom-right, mid-tile."""
    q, k, v = _qkv(2, 50, 130, 2, 2, 64, dtype, seed=4)
    _check_grads(q, k, v, _pattern(2, 130, causal=causal), dtype, f"50 of 130 causal={causal}")


@pytest.mark.parametrize("seq", [1, 33, 190])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
def test_grads_ragged_lengths(seq, causal):
    """Lengths that are not a multiple of the block (or of any tile)."""
    dtype = DTYPES[0]
    q, k, v = _qkv(2, seq, seq, 2, 2, 64, dtype, seed=seq)
    pattern = _pattern(2, 192, block_size=32, causal=causal, local_blocks=2, vert_stride=2)
    _check_grads(q, k, v, pattern, dtype, f"seq {seq} causal={causal}")


def test_grads_with_element_offsets_past_2_31():
    """Row x sequence stride passes 2^31 elements (at 32 heads of 128, from 512k tokens on): the
    kernels must form such offsets in 64 bits. Here q, k, v and the upstream gradient are views a
    2^26-element stride apart into one buffer that is never filled (virtual memory on the CPU), so
    rows 32..47 sit past 2^31; 32-bit offsets read elsewhere (a segfault under the interpreter,
    an illegal address on the GPU, as a 4M-token sequence over two GPUs showed)."""
    dtype, seq, dim = DTYPES[0], 48, 16
    q, k, v, upstream = views_rows_apart(4, seq, dim, 2**26, dtype)
    gen = torch.Generator().manual_seed(0)
    for t in (q, k, v, upstream):
        t.copy_(randn(gen, *t.shape, dtype=dtype))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    pattern = _pattern(1, seq, block_size=16, local_blocks=1)  # 2 would keep all 3 blocks
    out = s2attn.sparse_attention(q, k, v, pattern)
    out.backward(upstream)
    (ref,), ref_grads = _reference_grads((q, k, v), pattern, [upstream])
    assert_close(out, ref, dtype, "out")
    for name, t, r in zip(("dq", "dk", "dv"), (q, k, v), ref_grads):
        assert_close(t.grad, r, dtype, name)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
@pytest.mark.parametrize("block_size", [16, 32, 64, 128])
def test_grads_block_sizes(block_size, causal):
    """Pattern blocks smaller than, equal to and larger than the kernels' tiles."""
    dtype = DTYPES[0]
    seq = 200
    q, k, v = _qkv(1, seq, seq, 2, 2, 64, dtype, seed=block_size)
    pattern = _pattern(2, seq, block_size, causal=causal, local_blocks=1, vert_stride=2)
    _check_grads(q, k, v, pattern, dtype, f"block {block_size} causal={causal}")


# ----------------------------------------------------------------------- gathered KV tiles
@pytest.fixture
def backward_spies(monkeypatch) -> dict[str, LaunchSpy]:
    from s2attn.ops.triton import backward as bwd

    names = ("_dkdv_gathered_kernel", "_dq_kernel")
    spies = {name: LaunchSpy(getattr(bwd, name)) for name in names}
    for name, spy in spies.items():
        monkeypatch.setattr(bwd, name, spy)
    return spies


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
@pytest.mark.parametrize("case", ["mha", "gqa-per-kv-head", "gqa-per-q-head", "varlen", "fewer-q"])
def test_grads_gathered_kv_tiles(backward_spies, case, causal):
    """Block-16 stride blocks far from their queries go to gathered KV tiles in both backward
    passes: dQ walks them like the forward; dK/dV adds their sums after the contiguous pass.
    Patterns per query head of a GQA group keep dK/dV contiguous (a tile's sums must belong to
    one KV head)."""
    dtype = DTYPES[0]
    heads, kv_heads, seq_q, seq_k = 4, 4, 384, 384
    kwargs = {}
    if case.startswith("gqa"):
        kv_heads = 2
    if case == "fewer-q":
        seq_q = 150
    pattern = _pattern(
        2 if case == "gqa-per-kv-head" else heads,
        seq_k,
        causal=causal,
        local_blocks=2,
        vert_stride=4,
    )
    if case == "varlen":
        lens_q, lens_k = [384, 90, 200], [384, 250, 200]
        q, k, v, cu_q, cu_k = _varlen_qkv(lens_q, lens_k, heads, kv_heads, 32, dtype, seed=7)
        kwargs = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=384, max_seqlen_k=384)
    else:
        q, k, v = _qkv(1, seq_q, seq_k, heads, kv_heads, 32, dtype, seed=7)
    _check_grads(q, k, v, pattern, dtype, f"{case} causal={causal}", **kwargs)
    gathered_dkdv = backward_spies["_dkdv_gathered_kernel"].calls
    dq_gather = [call["GATHER"] for call in backward_spies["_dq_kernel"].calls]
    assert len(gathered_dkdv) == (0 if case == "gqa-per-q-head" else 1)
    assert dq_gather == [True]  # head dim 32: never the Gluon dQ


def test_gathered_and_contiguous_backward_agree(backward_spies):
    """The same gradients with and without gathered KV tiles (``KernelOptions``' switches), up
    to summation order."""
    from s2attn.plan import AttentionPlan

    dtype = DTYPES[0]
    q, k, v = (t.detach() for t in _qkv(1, 384, 384, 2, 2, 32, dtype, seed=8))
    pattern = _pattern(2, 384, local_blocks=2, vert_stride=4)
    (grad,) = _upstream([q], 9)
    grads = []
    for gather in (True, False):
        options = KernelOptions(gather_dq=gather, gather_dkdv=gather)
        plan = AttentionPlan(pattern, 32**-0.5, 1, options=options)
        out, lse = plan.forward(q, k, v)
        grads.append([g.float() for g in plan.backward(grad, None, q, k, v, out, lse)])
    assert len(backward_spies["_dkdv_gathered_kernel"].calls) == 1  # with gather only
    assert [call["GATHER"] for call in backward_spies["_dq_kernel"].calls] == [True, False]
    for name, a, b in zip(("dq", "dk", "dv"), *grads):
        scale = b.abs().max().item()
        assert (a - b).abs().max().item() <= 4e-3 * scale, name


# ------------------------------------------------------------------------- strides, packing
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_grads_strided_inputs(dtype):
    """q, k, v read in place from a packed (batch, seq, 3, heads, dim) tensor, and q from a
    (batch, heads, seq, dim) tensor transposed: gradients reach the underlying leaves."""
    (qkv, q_bhsd) = _leaves([(2, 80, 3, 2, 64), (2, 2, 80, 64)], dtype, seed=5)
    q, k, v = qkv.unbind(2)
    assert not q.is_contiguous()
    pattern = _pattern(2, 80)
    out = s2attn.sparse_attention(q, k, v, pattern) + s2attn.sparse_attention(
        q_bhsd.transpose(1, 2), k, v, pattern
    )
    (g,) = _upstream([out], seed=5)
    out.backward(g)

    ref_qkv, ref_q_bhsd = (t.detach().float().requires_grad_() for t in (qkv, q_bhsd))
    rq, rk, rv = ref_qkv.unbind(2)
    ref = s2attn.attention_reference(rq, rk, rv, pattern) + s2attn.attention_reference(
        ref_q_bhsd.transpose(1, 2), rk, rv, pattern
    )
    ref.backward(g.float())
    assert_close(qkv.grad, ref_qkv.grad, dtype, "strided dqkv")
    assert_close(q_bhsd.grad, ref_q_bhsd.grad, dtype, "transposed dq")


@gpu_only
@skip_without_gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_grads_sequence_first_gqa_dim64(dtype):
    """Megatron's layout on the Hopper kernels' shapes: (seq, batch, heads, dim) leaves read
    through a transpose, batch 2, 8 query / 4 KV heads of 64, 64-token blocks, a per-query-head
    S2 pattern at 4k tokens. On an H100 (2026-11-24) benchmarks/megatron_gpt.py measured dq and dk
    of such a layer 6-11% off the reference, the forward and dv within 1e-2."""
    seq, batch = 4096, 2
    leaves = _leaves([(seq, batch, 8, 64), (seq, batch, 4, 64), (seq, batch, 4, 64)], dtype, 11)
    q, k, v = (t.transpose(0, 1) for t in leaves)
    pattern = local_stride_pattern(
        8, max_seq_len=seq, block_size=64, local_blocks=4, vert_stride=8, num_kv_heads=4
    )
    out = s2attn.sparse_attention(q, k, v, pattern)
    (g,) = _upstream([out], seed=11)
    out.backward(g)
    ref_leaves = [t.detach().float().requires_grad_() for t in leaves]
    ref = s2attn.attention_reference(*(t.transpose(0, 1) for t in ref_leaves), pattern)
    ref.backward(g.float())
    assert_close(out, ref, dtype, "sequence-first out")
    for name, t, r in zip(("dq", "dk", "dv"), leaves, ref_leaves):
        assert_close(t.grad, r.grad, dtype, f"sequence-first {name}")


@pytest.mark.parametrize("varlen", [False, True], ids=["batched", "varlen"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_grads_qkvpacked(dtype, varlen):
    """qkv's gradient comes back as one tensor: the reference's dq, dk, dv stacked."""
    pattern = _pattern(2, 120)
    if varlen:
        lens = [120, 7, 57]
        (qkv,) = _leaves([(sum(lens), 3, 2, 64)], dtype, seed=6)
        cu = torch.tensor([0, *lens], device=DEVICE).cumsum(0).to(torch.int32)
        kwargs = dict(cu_seqlens=cu, max_seqlen=max(lens))
        ref_kwargs = dict(cu_seqlens_q=cu, cu_seqlens_k=cu)
    else:
        (qkv,) = _leaves([(2, 120, 3, 2, 64)], dtype, seed=6)
        kwargs, ref_kwargs = {}, {}
    out = s2attn.sparse_attention_qkvpacked(qkv, pattern, **kwargs)
    upstream = _upstream([out], seed=6)
    out.backward(upstream[0])

    refs, (dq, dk, dv) = _reference_grads(qkv.unbind(-3), pattern, upstream, **ref_kwargs)
    assert_close(out, refs[0], dtype, "qkvpacked out")
    assert qkv.grad.shape == qkv.shape
    assert_close(qkv.grad, torch.stack([dq, dk, dv], dim=-3), dtype, "qkvpacked dqkv")


# --------------------------------------------------------------------------------- the LSE
@pytest.mark.parametrize("varlen", [False, True], ids=["batched", "varlen"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_grads_through_lse(dtype, varlen):
    """A loss of both out and lse: the LSE gradient enters the kernels' row term."""
    if varlen:
        q, k, v, cu_q, cu_k = _varlen_qkv([40, 90], [70, 90], 2, 2, 64, dtype, seed=7)
        kwargs = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    else:
        q, k, v = _qkv(2, 90, 90, 2, 2, 64, dtype, seed=7)
        kwargs = {}
    _check_grads(q, k, v, _pattern(2, 96), dtype, "out+lse", return_lse=True, **kwargs)


@pytest.mark.parametrize("varlen", [False, True], ids=["batched", "varlen"])
@pytest.mark.parametrize("layout", ["expanded", "transposed"])
def test_grads_upstream_layouts(layout, varlen):
    """Autograd hands the backward its upstream gradients in any layout: expanded (stride 0) by a
    sum, permuted by a transpose. The kernels must read dO and dLSE with their own strides."""
    dtype = DTYPES[0]
    if varlen:
        q, k, v, cu_q, cu_k = _varlen_qkv([40, 90], [70, 90], 2, 2, 64, dtype, seed=18)
        kwargs = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    else:
        q, k, v = _qkv(2, 90, 90, 2, 2, 64, dtype, seed=18)
        kwargs = {}
    pattern = _pattern(2, 96)
    if layout == "expanded":  # dO strides (0, 0, 0, 1), dLSE strides (..., 0)
        views = lambda out, lse: [out.sum(dim=tuple(range(out.dim() - 1))), lse.sum(dim=-1)]
    else:
        views = lambda out, lse: [out.transpose(-2, -3), lse.transpose(-1, -2)]
    outs = views(*s2attn.sparse_attention(q, k, v, pattern, return_lse=True, **kwargs))
    upstream = _upstream(outs, seed=18)
    torch.autograd.backward(outs, upstream)

    ref_inputs = [t.detach().float().requires_grad_() for t in (q, k, v)]
    ref = s2attn.attention_reference(*ref_inputs, pattern, return_lse=True, **kwargs)
    torch.autograd.backward(views(*ref), [g.float() for g in upstream])
    for name, t, r in zip(("dq", "dk", "dv"), (q, k, v), ref_inputs):
        assert_close(t.grad, r.grad, dtype, f"{layout} upstream {name}")


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
def test_grads_lse_only(causal):
    """Only the LSE is used: the backward gets no output gradient (and dV is zero)."""
    dtype = DTYPES[0]
    q, k, v = _qkv(2, 90, 90, 4, 2, 64, dtype, seed=8)
    pattern = _pattern(4, 90, causal=causal)
    _, lse = s2attn.sparse_attention(q, k, v, pattern, return_lse=True)
    upstream = _upstream([lse], seed=8)
    lse.backward(upstream[0])

    ref_inputs = [t.detach().float().requires_grad_() for t in (q, k, v)]
    _, ref_lse = s2attn.attention_reference(*ref_inputs, pattern, return_lse=True)
    ref_lse.backward(upstream[0])
    assert ref_inputs[2].grad is None  # the reference's LSE does not depend on v
    assert_close(q.grad, ref_inputs[0].grad, dtype, "lse-only dq")
    assert_close(k.grad, ref_inputs[1].grad, dtype, "lse-only dk")
    assert_close(v.grad, torch.zeros_like(v), dtype, "lse-only dv")


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_grads_empty_rows_and_unused_keys(dtype, causal):
    """Query rows that attend nothing get zero dq (and give nothing to dk, dv); keys nobody
    attends get zero dk, dv. No NaN anywhere, including the LSE's gradient at -inf rows."""
    heads, seq, bs = 2, 96, 16
    mask = _pattern(heads, seq, bs, causal=causal).mask.clone()
    mask[1, 2, :] = False  # head 1, query block 2: attends nothing
    mask[0, 5, :] = False  # head 0, query block 5 (the last): attends nothing
    mask[:, :, 3] = False  # KV block 3: no head, no query uses it
    pattern = BlockPattern(mask, bs, causal)
    q, k, v = _qkv(2, seq, seq, heads, heads, 64, dtype, seed=9)
    out, lse = s2attn.sparse_attention(q, k, v, pattern, return_lse=True)
    assert torch.isinf(lse[:, 1, 32:48]).all() and torch.isinf(lse[:, 0, 80:]).all()
    g_out, g_lse = _upstream([out, lse], seed=9)
    # The loss sees the LSE of the rows that attend something; -inf rows get gradient 0.
    finite_lse = lambda x: x.masked_fill(torch.isinf(x), 0.0)
    torch.autograd.backward([out, finite_lse(lse)], [g_out, g_lse])

    for name, grad in (("dq", q.grad), ("dk", k.grad), ("dv", v.grad)):
        assert not torch.isnan(grad).any(), f"NaN in {name}"
    assert (q.grad[:, 32:48, 1] == 0).all() and (q.grad[:, 80:, 0] == 0).all()
    assert (k.grad[:, 48:64] == 0).all() and (v.grad[:, 48:64] == 0).all()

    ref_inputs = [t.detach().float().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = s2attn.attention_reference(*ref_inputs, pattern, return_lse=True)
    torch.autograd.backward([ref_out, finite_lse(ref_lse)], [g_out.float(), g_lse])
    for name, t, r in zip(("dq", "dk", "dv"), (q, k, v), ref_inputs):
        assert_close(t.grad, r.grad, dtype, f"empty rows {name}")


# ---------------------------------------------------------------------- merging partials
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_merge_partials_grads(dtype, causal):
    """Two patterns splitting the KV blocks in halves, merged through their LSEs, give the output
    and the q, k, v gradients of one call on their union; rows empty in both stay NaN-free."""
    heads, seq, bs = 2, 128, 16
    mask = _pattern(heads, seq, bs, causal=causal).mask.clone()
    mask[1, 2, :] = False  # head 1, query block 2 attends nothing in either half
    full = BlockPattern(mask, bs, causal)
    first_half = torch.arange(full.num_kv_blocks) < full.num_kv_blocks // 2
    p1 = BlockPattern(full.mask & first_half, bs, causal)
    p2 = BlockPattern(full.mask & ~first_half, bs, causal)

    q, k, v = _qkv(1, seq, seq, heads, heads, 64, dtype, seed=10)
    o1, l1 = s2attn.sparse_attention(q, k, v, p1, return_lse=True)
    o2, l2 = s2attn.sparse_attention(q, k, v, p2, return_lse=True)
    if causal:  # early queries see nothing of the second half: their partial LSE is -inf
        assert torch.isinf(l2[..., :16]).all()
    merged, merged_lse = s2attn.merge_partials([o1, o2], [l1, l2])
    assert torch.isinf(merged_lse[:, 1, 32:48]).all()
    (g,) = _upstream([merged], seed=10)
    merged.backward(g)

    q1, k1, v1 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    single, single_lse = s2attn.sparse_attention(q1, k1, v1, full, return_lse=True)
    single.backward(g)
    assert_close(merged, single, dtype, "merged out vs one call")
    assert_close(merged_lse, single_lse, torch.float32, "merged lse vs one call")
    for name, a, b in zip(("dq", "dk", "dv"), (q, k, v), (q1, k1, v1)):
        assert_close(a.grad, b.grad, dtype, f"merged {name} vs one call")

    _, ref_grads = _reference_grads((q, k, v), full, [g])
    for name, a, r in zip(("dq", "dk", "dv"), (q, k, v), ref_grads):
        assert_close(a.grad, r, dtype, f"merged {name} vs reference")


# ------------------------------------------------------------------ determinism, gradcheck
def test_backward_is_deterministic():
    """No atomics: two backward runs give bit-identical gradients (GQA sums included)."""
    dtype = DTYPES[0]
    lens_q, lens_k = [70, 100], [100, 100]
    q, k, v, cu_q, cu_k = _varlen_qkv(lens_q, lens_k, 4, 2, 64, dtype, seed=11)
    pattern = _pattern(4, 100)
    out, lse = s2attn.sparse_attention(
        q, k, v, pattern, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, return_lse=True
    )
    upstream = _upstream([out, lse], seed=11)
    first = torch.autograd.grad([out, lse], (q, k, v), upstream, retain_graph=True)
    second = torch.autograd.grad([out, lse], (q, k, v), upstream)
    for name, a, b in zip(("dq", "dk", "dv"), first, second):
        assert torch.equal(a, b), f"{name} differs between two backward runs"


@pytest.mark.parametrize("case", ["causal-gqa", "bidir", "varlen"])
def test_gradcheck_float64(case, monkeypatch):
    """torch.autograd.gradcheck through the kernels in float64 (out and lse), on tiny shapes."""
    if not ON_GPU:
        # On a mismatch, fast-mode gradcheck recomputes whole Jacobians for its message: thousands
        # of interpreted kernel calls (minutes). Report the fast-mode mismatch alone instead.
        gradcheck_module = sys.modules["torch.autograd.gradcheck"]
        no_jacobians = lambda *args, **kwargs: ""
        monkeypatch.setattr(
            gradcheck_module, "_run_slow_mode_and_get_error", no_jacobians, raising=False
        )
    causal = case != "bidir"
    pattern = local_stride_pattern(
        2, max_seq_len=40, block_size=16, local_blocks=1, vert_stride=2, causal=causal
    )
    kwargs = {}
    if case == "varlen":
        q, k, v, cu_q, cu_k = _varlen_qkv([17, 40], [30, 40], 2, 2, 16, torch.float64, seed=12)
        kwargs = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    else:
        kv_heads = 1 if case == "causal-gqa" else 2
        q, k, v = _qkv(1, 40, 40, 2, kv_heads, 16, torch.float64, seed=12)

    def fn(q, k, v):
        return s2attn.sparse_attention(q, k, v, pattern, return_lse=True, **kwargs)

    assert torch.autograd.gradcheck(fn, (q, k, v), fast_mode=True)


# ----------------------------------------------------------------------------- the module
def test_module_backward():
    dtype = DTYPES[0]
    pattern = _pattern(4, 100)
    attn = s2attn.SparseAttention(pattern, softmax_scale=0.2)
    q, k, v = _qkv(2, 100, 100, 4, 2, 32, dtype, seed=13)
    out = attn(q, k, v)
    (g,) = _upstream([out], seed=13)
    out.backward(g)
    refs, ref_grads = _reference_grads((q, k, v), pattern, [g], softmax_scale=0.2)
    assert_close(out, refs[0], dtype, "module out")
    for name, t, r in zip(("dq", "dk", "dv"), (q, k, v), ref_grads):
        assert_close(t.grad, r, dtype, f"module {name}")


def test_double_backward_raises():
    # The kernels give first derivatives only; a second must fail loudly, never come back as 0.
    pattern = _pattern(2, 64)
    q, k, v = _qkv(1, 64, 64, 2, 2, 16, DTYPES[0], seed=17)
    out = s2attn.sparse_attention(q, k, v, pattern)
    (dq,) = torch.autograd.grad(out.float().square().sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        dq.sum().backward()


# -------------------------------------------------------------------- larger shapes, GPU
@gpu_only
@skip_without_gpu
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_grads_large(dtype, head_dim, causal):
    """The GPU tile sizes (Merge-Q tiles over 64-token blocks) on longer GQA sequences."""
    q, k, v = _qkv(2, 1000, 1000, 8, 2, head_dim, dtype, seed=14)
    pattern = local_stride_pattern(
        8, max_seq_len=1024, block_size=64, local_blocks=4, vert_stride=4, causal=causal
    )
    _check_grads(q, k, v, pattern, dtype, f"large d{head_dim} causal={causal}")


@gpu_only
@skip_without_gpu
@pytest.mark.parametrize("block_size", [16, 128])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_grads_large_varlen(dtype, block_size):
    lens_q, lens_k = [300, 1, 1024, 513], [700, 1, 1024, 513]
    q, k, v, cu_q, cu_k = _varlen_qkv(lens_q, lens_k, 8, 1, 128, dtype, seed=15)
    pattern = local_stride_pattern(
        1,
        max_seq_len=1024,
        block_size=block_size,
        local_blocks=2048 // block_size // 8,
        vert_stride=4,
    )
    _check_grads(
        q,
        k,
        v,
        pattern,
        dtype,
        f"large varlen block {block_size}",
        return_lse=True,
        cu_seqlens_q=cu_q,
        cu_seqlens_k=cu_k,
    )


@gpu_only
@skip_without_gpu
def test_backward_is_deterministic_large():
    q, k, v = _qkv(2, 2048, 2048, 16, 4, 128, torch.bfloat16, seed=16)
    pattern = local_stride_pattern(
        16, max_seq_len=2048, block_size=64, local_blocks=4, vert_stride=8
    )
    out = s2attn.sparse_attention(q, k, v, pattern)
    (g,) = _upstream([out], seed=16)
    first = torch.autograd.grad(out, (q, k, v), g, retain_graph=True)
    second = torch.autograd.grad(out, (q, k, v), g)
    for name, a, b in zip(("dq", "dk", "dv"), first, second):
        assert torch.equal(a, b), f"{name} differs between two backward runs"


@gpu_only
@skip_without_gpu
def test_backward_memory_is_linear_in_seq():
    """fwd+bwd at 16k tokens keeps no seq x seq tensor: the extra memory stays a small multiple
    of one input, far below the 8 * 16384^2 * 2 bytes (4 GiB) of one bf16 score matrix."""
    batch, seq, heads, dim = 1, 16384, 8, 64
    q, k, v = _qkv(batch, seq, seq, heads, heads, dim, torch.bfloat16, seed=17)
    (g,) = _upstream([q], seed=17)
    pattern = local_stride_pattern(
        heads, max_seq_len=seq, block_size=64, local_blocks=4, vert_stride=8
    )

    def fwd_bwd():
        out = s2attn.sparse_attention(q, k, v, pattern)
        out.backward(g)
        for t in (q, k, v):
            t.grad = None

    fwd_bwd()  # compile the kernels and cache the layouts
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fwd_bwd()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before
    input_bytes = q.numel() * q.element_size()
    score_bytes = heads * seq * seq * 2
    print(
        f"fwd+bwd extra memory {extra / 2**20:.1f} MiB = {extra / input_bytes:.1f} x one input "
        f"({input_bytes / 2**20:.0f} MiB); a score matrix would take {score_bytes / 2**30:.0f} GiB"
    )
    assert extra < 20 * input_bytes


@gpu_only
@skip_without_gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_grads_in_cuda_graph(dtype):
    """A forward+backward captured in a CUDA graph (the remedy for host-bound short sequences)
    replays exactly: each replay reads the static inputs' new values, and the kernels' work-item
    counters, zeroed inside the graph, start again from zero."""
    batch, seq, heads, dim = 1, 2048, 8, 128
    q, k, v = _qkv(batch, seq, seq, heads, heads, dim, dtype, seed=18)
    (g,) = _upstream([q], seed=18)
    pattern = local_stride_pattern(
        heads, max_seq_len=seq, block_size=64, local_blocks=4, vert_stride=8
    )

    def fwd_bwd():
        out = s2attn.sparse_attention(q, k, v, pattern)
        return (out, *torch.autograd.grad(out, (q, k, v), g))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the default stream, as capture requires
        for _ in range(2):
            fwd_bwd()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fwd_bwd()
    for seed in (19, 20):
        fresh = _qkv(batch, seq, seq, heads, heads, dim, dtype, seed=seed)
        with torch.no_grad():
            for static, new in zip((q, k, v, g), (*fresh, *_upstream([q], seed=seed))):
                static.copy_(new)
        graph.replay()
        torch.cuda.synchronize()
        (ref,), ref_grads = _reference_grads((q, k, v), pattern, [g])
        for name, got, want in zip(("out", "dq", "dk", "dv"), captured, (ref, *ref_grads)):
            assert_close(got, want, dtype, f"graph replay (inputs {seed}) {name}")


def test_dkdv_item_order():
    # The Gluon dK/dV kernel's queue (ops/gluon/dkdv_queue_sm90.py): a permutation of the items, one
    # group of (batch, KV head) pairs after another, longest list first within a group, each
    # group's long lists ahead of the previous group's short ones, short ones last.
    from s2attn.ops.gluon.dkdv_queue_sm90 import dkdv_order
    from s2attn.ops.layout import backward_layout

    heads, tiles = 8, 128
    pattern = local_stride_pattern(
        heads, max_seq_len=tiles * 64, block_size=64, local_blocks=16, vert_stride=64
    )
    layout = backward_layout(pattern, 64, 64, torch.device("cpu"), tiles)
    order = dkdv_order(layout, 2, heads, heads, tiles, 1, 4, 264).long()
    assert sorted(order.tolist()) == list(range(2 * heads * tiles))
    lengths = (layout.full_offsets.diff() + layout.partial_offsets.diff()).view(heads, -1)
    lengths = lengths[:, :tiles].repeat(2, 1).flatten()[order]
    group = order // tiles // 4
    long = lengths > 2 * lengths.median()
    assert long.any() and not long[-tiles:].any()
    # Within one group and class, lists come longest first; long lists of group g come before
    # short lists of group g - 1 and after the short lists of group g - 2.
    for g in range(int(group.max()) + 1):
        for cls in (True, False):
            sel = ((group == g) & (long == cls)).nonzero().flatten()
            assert (lengths[sel].diff() <= 0).all()
            if cls and g >= 1:
                assert sel.max() < ((group == g - 1) & ~long).nonzero().min()
