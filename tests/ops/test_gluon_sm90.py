"""The Gluon kernels for Hopper (ops/gluon/forward_sm90.py, ops/gluon/backward_sm90.py's dQ and
dK/dV) against the float32 dense-mask reference.

Runs only on an sm_90 GPU, the one place that kernel runs. Every case first asserts that the call
takes the Gluon path, so none of these can pass on the Triton kernel by mistake. Outputs start as
NaN (conftest). The other forward tests run through this kernel too on sm_90 wherever it applies;
these add its own knobs (ring depth, persistent or one program per work item, q in registers) and
shapes with more work items than SMs, so programs walk several tiles.
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import ON_GPU, assert_close, dtype_ids, randn

import s2attn
from s2attn import BlockPattern, dense_pattern, local_stride_pattern
from s2attn.ops import dispatch
from s2attn.ops.layout import backward_layout, forward_layout
from s2attn.ops.options import (
    GluonDkdvConfig,
    GluonDqConfig,
    GluonForwardConfig,
    KernelOptions,
)
from s2attn.ops.shapes import check_k_bounds

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not ON_GPU or torch.cuda.get_device_capability() != (9, 0), reason="needs an sm_90 GPU"
    ),
]

DTYPES = [torch.bfloat16, torch.float16]
DTYPE_IDS = dtype_ids(DTYPES)


def _run(q, k, v, pattern, config=None):
    """The forward through ``ops.dispatch.forward`` with the Gluon kernel's settings ``config``
    (a GluonForwardConfig), after checking that the Gluon kernel takes it; returns (out, lse)."""
    scale = q.shape[-1] ** -0.5
    kernel = dispatch.forward_kernel(
        q,
        k,
        v,
        block_size=pattern.block_size,
        causal=pattern.causal,
        gather=True,
        varlen=None,
        softmax_scale=scale,
    )
    assert kernel.backend == "gluon", "this case was meant for the Gluon kernel"
    layout = forward_layout(pattern, kernel.block_m, kernel.block_n, q.device, gather=True)
    options = KernelOptions(gluon_forward=config or GluonForwardConfig())
    return dispatch.forward(
        q,
        k,
        v,
        layout,
        softmax_scale=scale,
        q_heads_per_pattern_head=q.shape[2] // pattern.num_heads,
        kernel=kernel,
        options=options,
    )


def _check(q, k, v, pattern, config=None):
    out, lse = _run(q, k, v, pattern, config)
    ref, ref_lse = s2attn.attention_reference(
        q.float(), k.float(), v.float(), pattern, return_lse=True
    )
    assert_close(out, ref, q.dtype, "out")
    assert_close(lse, ref_lse, q.dtype, "lse")
    return out, lse


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("stride", [2, 5])
@pytest.mark.parametrize("entries", [1, 2])
def test_local_stride(gen, dtype, dim, causal, stride, entries):
    # 2 x 8 heads x 24 tiles = 384 work items: every persistent program walks several.
    seq, heads = 3072, 8
    q, k, v = (randn(gen, 2, seq, heads, dim, dtype=dtype) for _ in range(3))
    config = GluonForwardConfig(entries_per_step=entries, num_buffers=2, q_in_regs=dim == 64)
    pattern = local_stride_pattern(
        heads, max_seq_len=seq, block_size=64, local_blocks=4, vert_stride=stride, causal=causal
    )
    _check(q, k, v, pattern, config if entries == 2 else None)


_KERNEL_SETTINGS = [
    dict(num_buffers=2),
    dict(num_buffers=3),
    dict(num_buffers=4),
    dict(persistent=False),
    dict(q_in_regs=False),
    dict(num_buffers=2, persistent=False),
    dict(entries_per_step=2, num_buffers=2, q_in_regs=False),
    dict(entries_per_step=2, num_buffers=2, q_in_regs=False, persistent=False),
    dict(heads_per_group=4),
]


@pytest.mark.parametrize(
    "settings", _KERNEL_SETTINGS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items())
)
def test_kernel_options(gen, settings):
    seq, heads = 3072, 8
    q, k, v = (randn(gen, 1, seq, heads, 128, dtype=torch.bfloat16) for _ in range(3))
    pattern = local_stride_pattern(
        heads, max_seq_len=seq, block_size=64, local_blocks=3, vert_stride=4
    )
    _check(q, k, v, pattern, GluonForwardConfig(**settings))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("block_size", [64, 128])
def test_random_pattern(gen, dtype, causal, block_size):
    # Random blocks give tiles with no full entries, no entries at all and rows that see nothing.
    seq, heads = 2048, 4
    nb = math.ceil(seq / block_size)
    mask = torch.rand(heads, nb, nb, generator=gen) < 0.25
    mask[:, 3] = False  # a block of rows that attends nothing
    pattern = BlockPattern(mask, block_size, causal)
    q, k, v = (randn(gen, 1, seq, heads, 128, dtype=dtype) for _ in range(3))
    for config in (None, GluonForwardConfig(entries_per_step=2, num_buffers=2, q_in_regs=False)):
        _, lse = _check(q, k, v, pattern, config)
        assert torch.isinf(lse[:, :, 3 * block_size : 4 * block_size]).all()


def _half_tile_pattern(heads: int, seq: int, causal: bool) -> BlockPattern:
    """Block-64 pattern whose 128-row tiles have long runs of entries that one half of the tile
    (one consumer warpgroup) sees and the other does not: the first half sees every even block,
    the second only blocks 1, 16 and 31, so it skips runs of seven entries, longer than the K/V
    ring; in one tile the first half sees nothing at all."""
    nb = seq // 64
    mask = torch.zeros(heads, nb, nb, dtype=torch.bool)
    mask[:, 0::2, 0::2] = True
    mask[:, 1::2, 1:nb:15] = True
    mask[:, 6] = False  # tile 3: its first half attends nothing
    mask[1, :, :] = mask[0].roll(1, dims=1)  # another head, shifted by a block
    return BlockPattern(mask, 64, causal)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("buffers", [2, 3, 4])
def test_entries_one_half_of_the_tile_skips(gen, dtype, dim, causal, buffers):
    # Each warpgroup skips the entries it does not see and masks only where its own rows need
    # it; the skips must free their ring slots without deadlocking on the slot it still holds.
    seq, heads = 2048, 4
    pattern = _half_tile_pattern(heads, seq, causal)
    q, k, v = (randn(gen, 1, seq, heads, dim, dtype=dtype) for _ in range(3))
    config = GluonForwardConfig(num_buffers=buffers, entries_per_step=2 if dim == 64 else None)
    _, lse = _check(q, k, v, pattern, config)
    assert torch.isinf(lse[:, 0, 6 * 64 : 7 * 64]).all()


@pytest.mark.parametrize("causal", [True, False])
def test_dense_pattern(gen, causal):
    seq, heads = 2048, 4
    q, k, v = (randn(gen, 1, seq, heads, 128, dtype=torch.bfloat16) for _ in range(3))
    _check(q, k, v, dense_pattern(heads, max_seq_len=seq, block_size=64, causal=causal))


@pytest.mark.parametrize("per_kv_head", [False, True])
def test_gqa(gen, per_kv_head):
    seq, heads, kv_heads = 2048, 8, 2
    q = randn(gen, 2, seq, heads, 128, dtype=torch.bfloat16)
    k, v = (randn(gen, 2, seq, kv_heads, 128, dtype=torch.bfloat16) for _ in range(2))
    pattern = local_stride_pattern(
        kv_heads if per_kv_head else heads,
        max_seq_len=seq,
        block_size=64,
        local_blocks=4,
        vert_stride=3,
        num_kv_heads=kv_heads if per_kv_head else None,
    )
    _check(q, k, v, pattern)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("seq_q", [1, 700, 1984])
def test_fewer_queries_than_keys(gen, causal, seq_q):
    # Bottom-right aligned queries: the first tile starts mid-way and q rows before 0 are read
    # as zeros by the bulk copy; seq_k stays a multiple of 64 so bidirectional calls qualify.
    seq_k, heads = 2048, 4
    q = randn(gen, 1, seq_q, heads, 64, dtype=torch.bfloat16)
    k, v = (randn(gen, 1, seq_k, heads, 64, dtype=torch.bfloat16) for _ in range(2))
    _check(
        q,
        k,
        v,
        local_stride_pattern(
            heads, max_seq_len=seq_k, block_size=64, local_blocks=4, vert_stride=3, causal=causal
        ),
    )


def test_strided_inputs(gen):
    # q, k, v as views into one packed (batch, seq, 3, heads, dim) tensor.
    seq, heads = 2048, 4
    qkv = randn(gen, 1, seq, 3, heads, 128, dtype=torch.bfloat16)
    q, k, v = qkv.unbind(2)
    _check(
        q,
        k,
        v,
        local_stride_pattern(heads, max_seq_len=seq, block_size=64, local_blocks=4, vert_stride=3),
    )


def _max_jumps_mid_list(q, k, pattern, layout, qk_scale_log2):
    """How many (row, entry) pairs past each list's first entry see the row's running max of the
    scores (log2 units; entries in the kernel's order: full ones, then partial ones) grow by more
    than 8, i.e. rescale the output accumulated so far by less than 2^-8."""
    seq = q.shape[1]
    mask = pattern.token_mask(seq, seq).to(q.device)
    scores = torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float()) * qk_scale_log2
    scores = scores.masked_fill(~mask, float("-inf"))
    fo, fc = layout.full_offsets.tolist(), layout.full_cols.tolist()
    po, pc = layout.partial_offsets.tolist(), layout.partial_cols.tolist()
    moves = 0
    for h in range(pattern.num_heads):
        for tile in range(layout.num_groups):
            g = h * layout.num_groups + tile
            cols = fc[fo[g] : fo[g + 1]] + pc[po[g] : po[g + 1]]
            rows = scores[:, h, tile * 128 : (tile + 1) * 128]
            maxima = torch.stack([rows[..., n * 64 : (n + 1) * 64].amax(-1) for n in cols], -1)
            running = maxima.cummax(-1).values
            grew = running[..., 1:] - running[..., :-1]
            moves += int(((grew > 8) & running[..., :-1].isfinite()).sum())
    return moves


def test_running_max_moves_mid_list(gen):
    # Keys scaled per 64-key tile by 0.25 to 8: a row's tile maxima differ by far more than 8
    # (log2), so the output accumulated so far is rescaled by large factors at later steps of a
    # list. Plain random inputs, as in the other tests, move the max by a few units at most past
    # the first steps: a kernel that skipped or botched those rescales passed all of them.
    seq, heads, dim = 2048, 4, 128
    q, v = (randn(gen, 1, seq, heads, dim, dtype=torch.bfloat16) for _ in range(2))
    tile_scale = 2.0 ** (torch.rand(seq // 64, generator=gen) * 5 - 2)
    k = (
        torch.randn(1, seq, heads, dim, generator=gen)
        * tile_scale.repeat_interleave(64)[:, None, None]
    )
    k = k.to("cuda", torch.bfloat16)
    pattern = local_stride_pattern(
        heads, max_seq_len=seq, block_size=64, local_blocks=4, vert_stride=3
    )
    layout = forward_layout(pattern, 128, 64, q.device, gather=True)
    assert _max_jumps_mid_list(q, k, pattern, layout, dim**-0.5 * math.log2(math.e)) > 100
    for config in (None, GluonForwardConfig(entries_per_step=2, num_buffers=2, q_in_regs=False)):
        _check(q, k, v, pattern, config)


def test_matches_the_triton_kernel(gen):
    seq, heads = 4096, 8
    q, k, v = (randn(gen, 1, seq, heads, 128, dtype=torch.float16) for _ in range(3))
    pattern = local_stride_pattern(
        heads, max_seq_len=seq, block_size=64, local_blocks=4, vert_stride=4
    )
    out, lse = _run(q, k, v, pattern)
    layout = forward_layout(pattern, 128, 64, q.device, gather=True)
    ref_out, ref_lse = dispatch.forward(
        q,
        k,
        v,
        layout,
        softmax_scale=128**-0.5,
        q_heads_per_pattern_head=1,
        options=KernelOptions(forward_backend="triton"),
    )
    # Same arithmetic up to the order of MMA accumulation: far inside the fp16 tolerance.
    assert (out.float() - ref_out.float()).abs().max().item() < 2e-3
    assert (lse - ref_lse).abs().max().item() < 1e-3


def test_other_cases_fall_back():
    """Calls the Gluon kernel does not cover go to the Triton kernel, never to a wrong result."""
    q = torch.randn(1, 1000, 4, 128, device="cuda", dtype=torch.bfloat16)
    pattern = local_stride_pattern(
        4, max_seq_len=1000, block_size=64, local_blocks=4, vert_stride=3, causal=False
    )
    layout = forward_layout(pattern, 128, 64, q.device, gather=True)
    assert check_k_bounds(layout, 1000, False)  # bidirectional, seq_k inside a tile
    choice = dict(gather=True, varlen=None, softmax_scale=0.1)
    causal = dict(block_size=64, causal=True)
    assert dispatch.forward_kernel(q, q, q, **causal, **choice).backend == "gluon"
    bidirectional = dict(block_size=64, causal=False)
    assert dispatch.forward_kernel(q, q, q, **bidirectional, **choice).backend == "triton"
    small = forward_layout(
        local_stride_pattern(4, max_seq_len=4096, block_size=16, local_blocks=4, vert_stride=16),
        128,
        64,
        q.device,
        gather=True,
    )
    assert small.gather_width  # lone 16-token blocks share gathered KV tiles
    small_blocks = dict(block_size=16, causal=True)
    assert dispatch.forward_kernel(q, q, q, **small_blocks, **choice).backend == "triton"
    f32 = q.float()
    assert dispatch.forward_kernel(f32, f32, f32, **causal, **choice).backend == "triton"


# ------------------------------------------------------------------------------------ dQ kernel
def _check_gradients(gen, q, k, v, pattern, dtype, *, return_lse=False):
    """Gradients of q, k, v against the float32 reference; with ``return_lse`` the upstream
    gradient reaches the LSE output too."""
    outs = s2attn.sparse_attention(q, k, v, pattern, return_lse=return_lse)
    outs = outs if return_lse else (outs,)
    grads = [randn(gen, *t.shape, dtype=t.dtype) for t in outs]
    torch.autograd.backward(outs, grads)
    ref_q, ref_k, ref_v = (t.detach().float().requires_grad_() for t in (q, k, v))
    refs = s2attn.attention_reference(ref_q, ref_k, ref_v, pattern, return_lse=return_lse)
    refs = refs if return_lse else (refs,)
    torch.autograd.backward(refs, [g.float() for g in grads])
    for name, got, ref in (
        ("dq", q.grad, ref_q.grad),
        ("dk", k.grad, ref_k.grad),
        ("dv", v.grad, ref_v.grad),
    ):
        assert_close(got, ref, dtype, name)


def _launcher_calls(monkeypatch, name: str) -> list:
    """Records the calls of a Gluon launcher in ops/gluon/backward_sm90.py, so a case can assert
    that the kernel it was meant for ran."""
    from s2attn.ops.gluon import backward_sm90

    calls = []
    launch = getattr(backward_sm90, name)

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return launch(*args, **kwargs)

    monkeypatch.setattr(backward_sm90, name, spy)
    return calls


@pytest.fixture
def dq_calls(monkeypatch) -> list:
    return _launcher_calls(monkeypatch, "dq")


@pytest.fixture
def dkdv_calls(monkeypatch) -> list:
    return _launcher_calls(monkeypatch, "dkdv")


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize(
    "case", ["local-stride", "random", "gqa", "lse", "fewer-queries", "half-tiles"]
)
def test_gradients_through_the_dq_kernel(gen, dq_calls, dtype, causal, case):
    # The dQ kernel also computes delta (from O and dO, minus dLSE in case "lse") for the dK/dV
    # pass after it: the Gluon one, or the Triton one when there are fewer queries than keys.
    dim = 128  # the Gluon dQ takes dim 128 only
    seq_q = seq_k = 2048
    heads, kv_heads = 8, 8
    if case == "gqa":
        kv_heads = 2
    if case == "lse":
        seq_q = seq_k = 1984  # 15.5 query tiles: the last one half past the end
    if case == "fewer-queries":
        seq_q = 1000  # tiles start before query row 0 (bottom-right alignment)
    if case == "random":
        mask = torch.rand(heads, seq_k // 64, seq_k // 64, generator=gen) < 0.25
        mask[:, 3] = False  # rows that attend nothing: zero gradient, never NaN
        pattern = BlockPattern(mask, 64, causal)
    elif case == "half-tiles":
        pattern = _half_tile_pattern(heads, seq_k, causal)
    else:
        pattern = local_stride_pattern(
            heads, max_seq_len=seq_k, block_size=64, local_blocks=4, vert_stride=3, causal=causal
        )
    q = randn(gen, 2, seq_q, heads, dim, dtype=dtype).requires_grad_()
    k, v = (randn(gen, 2, seq_k, kv_heads, dim, dtype=dtype).requires_grad_() for _ in range(2))
    _check_gradients(gen, q, k, v, pattern, dtype, return_lse=case == "lse")
    assert len(dq_calls) == 1, "this case was meant for the Gluon dQ kernel"


def _backward_with(gen):
    """fp16 inputs (2k tokens, 4 heads, dim 128), their forward and dK/dV layout: returns a
    function of (dQ layout tiles, KernelOptions) giving (dq, dk, dv), for setting the Gluon
    backward kernels beside the Triton ones."""
    seq, heads = 2048, 4
    q, k, v, g = (randn(gen, 1, seq, heads, 128, dtype=torch.float16) for _ in range(4))
    pattern = local_stride_pattern(
        heads, max_seq_len=seq, block_size=64, local_blocks=4, vert_stride=3
    )
    out, lse = _run(q, k, v, pattern)
    layout_kv = backward_layout(pattern, 64, 64, q.device, seq // 64)

    def backward(dq_tiles, options):
        layout_q = forward_layout(pattern, *dq_tiles, q.device)
        return dispatch.backward(
            g,
            q,
            k,
            v,
            out,
            lse,
            None,
            layout_kv,
            layout_q,
            softmax_scale=128**-0.5,
            q_heads_per_pattern_head=1,
            options=options,
        )

    return backward


def _assert_same_arithmetic(gluon: torch.Tensor, triton: torch.Tensor) -> None:
    """Same arithmetic up to the order of MMA accumulation: far inside the fp16 tolerance."""
    scale = triton.float().abs().max().item()
    assert (gluon.float() - triton.float()).abs().max().item() < 2e-3 * scale


def test_dq_kernel_matches_the_triton_one(gen):
    backward = _backward_with(gen)
    triton_dq = backward((64, 64), KernelOptions(dq_backend="triton"))[0]
    for config in (GluonDqConfig(), GluonDqConfig(num_buffers=4)):
        gluon_dq = backward((128, 64), KernelOptions(gluon_dq=config))[0]
        _assert_same_arithmetic(gluon_dq, triton_dq)


# --------------------------------------------------------------------------------- dK/dV kernel
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("case", ["local-stride", "random", "gqa", "block16", "ragged"])
def test_gradients_through_the_dkdv_kernel(gen, dkdv_calls, dtype, dim, causal, case):
    # 2 x 8 heads x 32 KV tiles = 512 work items over 2 streams per SM: streams walk several.
    seq, heads, kv_heads = 2048, 8, 8
    if case == "gqa":
        kv_heads = 2
    if case == "ragged":
        seq = 1001  # a partial last tile, and rows that are not a multiple of 4 (padded stats)
    if case == "random":
        mask = torch.rand(heads, seq // 64, seq // 64, generator=gen) < 0.25
        mask[:, 3] = False  # rows that attend nothing: zero gradient, never NaN
        mask[:, :, 5] = False  # keys nothing attends: a KV tile with an empty list
        pattern = BlockPattern(mask, 64, causal)
    elif case == "block16":
        pattern = local_stride_pattern(
            heads, max_seq_len=seq, block_size=16, local_blocks=6, vert_stride=5, causal=causal
        )
    else:
        pattern = local_stride_pattern(
            heads, max_seq_len=seq, block_size=64, local_blocks=4, vert_stride=3, causal=causal
        )
    q = randn(gen, 2, seq, heads, dim, dtype=dtype).requires_grad_()
    k, v = (randn(gen, 2, seq, kv_heads, dim, dtype=dtype).requires_grad_() for _ in range(2))
    _check_gradients(gen, q, k, v, pattern, dtype)
    assert len(dkdv_calls) == 1, "this case was meant for the Gluon dK/dV kernel"


@pytest.mark.parametrize(
    "config",
    [
        GluonDkdvConfig(num_buffers=2, heads_per_group=3),
        GluonDkdvConfig(num_buffers=3),  # dim 64 only (shared memory)
        GluonDkdvConfig(num_buffers=4),
    ],
    ids=str,
)
def test_dkdv_kernel_options(gen, dkdv_calls, config):
    seq, heads, dim = 2048, 4, 128 if config.num_buffers == 2 else 64
    q, k, v, g = (randn(gen, 2, seq, heads, dim, dtype=torch.float16) for _ in range(4))
    pattern = local_stride_pattern(
        heads, max_seq_len=seq, block_size=64, local_blocks=4, vert_stride=3
    )
    out, lse = _run(q, k, v, pattern)
    layout_kv = backward_layout(pattern, 64, 64, q.device, seq // 64)
    (_, _), dq_tiles = dispatch.backward_tile_sizes(dim, q.dtype, q.device)
    layout_q = forward_layout(pattern, *dq_tiles, q.device)
    grads = dispatch.backward(
        g,
        q,
        k,
        v,
        out,
        lse,
        None,
        layout_kv,
        layout_q,
        softmax_scale=dim**-0.5,
        q_heads_per_pattern_head=1,
        options=KernelOptions(gluon_dkdv=config),
    )
    ref = [t.float().requires_grad_() for t in (q, k, v)]
    s2attn.attention_reference(*ref, pattern).backward(g.float())
    for name, got, r in zip(("dq", "dk", "dv"), grads, ref):
        assert_close(got, r.grad, q.dtype, name)
    assert [call["config"] for call in dkdv_calls] == [config], "meant for the Gluon dK/dV kernel"


def test_dkdv_strided_outputs(gen, dkdv_calls):
    # q, k, v and their gradients as views into one packed (seq, 3, heads, dim) tensor.
    seq, heads, dim = 1536, 4, 128
    qkv = randn(gen, 1, seq, 3, heads, dim, dtype=torch.bfloat16).requires_grad_()
    pattern = local_stride_pattern(
        heads, max_seq_len=seq, block_size=64, local_blocks=4, vert_stride=3
    )
    out = s2attn.sparse_attention_qkvpacked(qkv, pattern)
    grad = randn(gen, *out.shape, dtype=torch.bfloat16)
    out.backward(grad)
    ref = qkv.detach().float().requires_grad_()
    s2attn.attention_reference(*ref.unbind(2), pattern).backward(grad.float())
    assert_close(qkv.grad, ref.grad, torch.bfloat16, "dqkv")
    assert len(dkdv_calls) == 1, "this case was meant for the Gluon dK/dV kernel"


def test_dkdv_kernel_matches_the_triton_one(gen):
    backward = _backward_with(gen)
    gluon = backward((128, 64), KernelOptions())[1:]
    triton = backward((128, 64), KernelOptions(dkdv_backend="triton"))[1:]
    for got, want in zip(gluon, triton):
        _assert_same_arithmetic(got, want)


@pytest.mark.parametrize("persistent", [True, False], ids=["persistent", "per-item"])
def test_work_counter_left_at_zero(gen, dq_calls, dkdv_calls, persistent):
    # The three kernels share one work-item counter per stream and each launch puts it back to
    # zero (ops/gluon/common_sm90.py, item_counter): launches back to back, on the default stream
    # and on a second one, each stay exact, and the counters read zero after.
    from s2attn.ops.gluon.common_sm90 import item_counter

    seq, heads = 2048, 4
    pattern = local_stride_pattern(
        heads, max_seq_len=seq, block_size=64, local_blocks=4, vert_stride=3
    )
    side = torch.cuda.Stream()
    for stream in (torch.cuda.current_stream(), side, torch.cuda.current_stream()):
        with torch.cuda.stream(stream):
            q, k, v = (
                randn(gen, 1, seq, heads, 128, dtype=torch.float16).requires_grad_()
                for _ in range(3)
            )
            _check(
                q.detach(),
                k.detach(),
                v.detach(),
                pattern,
                GluonForwardConfig(persistent=persistent),
            )
            _check_gradients(gen, q, k, v, pattern, torch.float16)
            assert item_counter(q.device).item() == 0
    assert len(dq_calls) == 3 and len(dkdv_calls) == 3, "meant for the Gluon backward kernels"
