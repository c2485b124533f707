"""The seam between the autograd layer and the kernels (s2attn/ops/dispatch.py, backends.py,
options.py): the backend tables and the choice they give, and ``KernelOptions`` reaching the
kernels it names.

On the CPU the Triton kernels run under the interpreter and no Gluon kernel can run; the choice
on a GPU is checked here on stand-in tensors, and the Gluon kernels' results on an sm_90 GPU
(test_gluon_sm90.py).
"""

from __future__ import annotations

import pytest
import torch
from helpers import DEVICE, DTYPES, ON_GPU, LaunchSpy, assert_close

import s2attn
from s2attn.ops import backends, dispatch
from s2attn.ops.env import INTERPRETED
from s2attn.ops.layout import backward_layout, forward_layout
from s2attn.ops.options import (
    GluonDqConfig,
    KernelOptions,
    TritonBackwardConfig,
    TritonForwardConfig,
)
from s2attn.ops.shapes import Varlen
from s2attn.ops.triton import backward as triton_backward
from s2attn.ops.triton import decode as triton_decode
from s2attn.ops.triton import forward as triton_forward


def test_options_refuse_what_no_kernel_takes():
    with pytest.raises(ValueError, match="forward_backend must be one of"):
        KernelOptions(forward_backend="gluon")
    with pytest.raises(TypeError, match="triton_dq must be a TritonBackwardConfig"):
        KernelOptions(triton_dq=GluonDqConfig())
    with pytest.raises(TypeError):
        TritonForwardConfig(num_buffers=2)  # a Gluon setting


def test_settings_override_only_what_they_set():
    defaults = triton_forward.default_config(64, torch.float16)
    assert TritonForwardConfig().over(defaults) is defaults
    chosen = TritonForwardConfig(num_warps=2, pair=True).over(defaults)
    assert (chosen.num_warps, chosen.pair) == (2, True)
    assert chosen.num_stages == defaults.num_stages and chosen.use_tma == defaults.use_tma
    dq = triton_backward.default_dq_config(128, torch.float16, 128)
    assert dq.num_warps == 8  # 128-row dQ tiles take 8 warps unless told otherwise
    assert TritonBackwardConfig(num_warps=4).over(dq).num_warps == 4


def test_backend_predicates():
    cpu = torch.device("cpu")
    assert dispatch.supports_triton(cpu) == INTERPRETED
    assert dispatch.supports_triton(torch.device("cuda"))
    assert not dispatch.supports_triton(torch.device("meta"))
    if ON_GPU:
        return  # the Gluon cases on a GPU: test_gluon_sm90.py
    q = torch.randn(1, 256, 2, 64, dtype=torch.float16)
    choice = dict(block_size=64, causal=True, varlen=None, softmax_scale=0.1)
    forward = dispatch.forward_kernel(q, q, q, gather=True, **choice)
    assert forward == dispatch.PassKernel("triton", *dispatch.forward_tile_sizes(64, q.dtype, cpu))
    dkdv, dq = dispatch.backward_kernels(q, q, q, q, q, gather_dq=True, **choice)
    dkdv_tiles, dq_tiles = dispatch.backward_tile_sizes(64, q.dtype, cpu)
    assert dkdv == dispatch.PassKernel("triton", *dkdv_tiles)
    assert dq == dispatch.PassKernel("triton", *dq_tiles)


@pytest.mark.parametrize("table", ["FORWARD", "DKDV", "DQ"])
def test_every_table_ends_in_a_backend_for_every_call(table):
    """The last backend of a pass walks any tiles and takes every call, so that the choice always
    finds one; names are unique, as kernels name their backend."""
    rows = getattr(backends, table)
    last = rows[-1]
    assert last.walks_any_tiles and last.name == "triton"
    assert last.takes(None, (16, 16))
    assert len({row.name for row in rows}) == len(rows)


class _Tensor:
    """What the choice of kernels reads of a tensor, without a GPU: shape, dtype, device, the
    last dim's stride, and whether bulk copies (TMA) may read it."""

    def __init__(self, shape, dtype=torch.bfloat16, tma=True, last_stride=1, device="cuda"):
        self.shape, self.dtype, self.device = shape, dtype, torch.device(device)
        self.tma, self.last_stride = tma, last_stride

    def stride(self, dim):
        assert dim == -1
        return self.last_stride


# A batched causal bf16 call (head dim 128, 1024 tokens, 64-token blocks) on an sm_90 GPU, with
# every tensor fit for bulk copies.
_COMMON_CALL = dict(
    device="cuda",
    interpreted=False,
    dim=128,
    dtype=torch.bfloat16,
    capability=(9, 0),
    gluon_env=True,
    options="auto",
    varlen=False,
    block_size=64,
    causal=True,
    seq=1024,
    seq_q=None,
    softmax_scale=0.1,
    gather_dq=True,
    tma_q=True,
    tma_grad_out=True,
    tma_dk=True,
    dq_last_stride=1,
)
# Each case: what differs from that call, and the (backend, tiles) of the forward, dK/dV and dQ
# it gets.
_CHOICES = [
    ({}, ("gluon", 128, 64), ("gluon", 64, 64), ("gluon", 128, 64)),
    # The Gluon dQ keeps the Triton tiles at dim 64; packed sequences and S2ATTN_HOPPER_FORWARD=0
    # go to Triton on the same tiles (dQ's stay the Gluon kernel's 128x64).
    ({"dim": 64}, ("gluon", 128, 64), ("gluon", 64, 64), ("triton", 64, 64)),
    ({"varlen": True}, ("triton", 128, 64), ("triton", 64, 64), ("triton", 128, 64)),
    ({"gluon_env": False}, ("triton", 128, 64), ("triton", 64, 64), ("triton", 128, 64)),
    ({"options": "triton"}, ("triton", 128, 64), ("triton", 64, 64), ("triton", 128, 64)),
    # Other GPUs and wide or 4-byte inputs: the Triton kernels on their own tiles.
    ({"capability": (8, 0)}, ("triton", 128, 64), ("triton", 64, 64), ("triton", 64, 64)),
    ({"capability": (10, 0)}, ("triton", 128, 64), ("triton", 64, 64), ("triton", 64, 64)),
    (
        {"capability": (8, 0), "dim": 64, "dtype": torch.float16},
        ("triton", 128, 64),
        ("triton", 64, 64),
        ("triton", 64, 64),
    ),
    (
        {"capability": (8, 0), "dim": 256},
        ("triton", 64, 32),
        ("triton", 32, 64),
        ("triton", 64, 32),
    ),
    # The CPU under the interpreter: the Triton kernels on small tiles (fewer slow programs).
    (
        {"device": "cpu", "interpreted": True},
        ("triton", 64, 32),
        ("triton", 32, 64),
        ("triton", 64, 32),
    ),
    (
        {"device": "cpu", "interpreted": True, "dim": 64, "dtype": torch.float32},
        ("triton", 64, 32),
        ("triton", 32, 64),
        ("triton", 64, 32),
    ),
    ({"dtype": torch.float32}, ("triton", 64, 64), ("triton", 32, 64), ("triton", 64, 32)),
    ({"dim": 256}, ("triton", 64, 32), ("triton", 32, 64), ("triton", 64, 32)),
    # Blocks smaller than a KV tile are gathered (the forward's always, dQ's unless turned off).
    ({"block_size": 16}, ("triton", 128, 64), ("gluon", 64, 64), ("triton", 128, 64)),
    (
        {"block_size": 16, "gather_dq": False},
        ("triton", 128, 64),
        ("gluon", 64, 64),
        ("gluon", 128, 64),
    ),
    # Bidirectional keys ending inside a tile need bounds; causal ones never do.
    ({"causal": False, "seq": 1000}, ("triton", 128, 64), ("gluon", 64, 64), ("triton", 128, 64)),
    ({"seq": 1000}, ("gluon", 128, 64), ("gluon", 64, 64), ("gluon", 128, 64)),
    ({"softmax_scale": -0.1}, ("triton", 128, 64), ("gluon", 64, 64), ("triton", 128, 64)),
    ({"seq_q": 512}, ("gluon", 128, 64), ("triton", 64, 64), ("gluon", 128, 64)),
    ({"tma_q": False}, ("triton", 128, 64), ("triton", 64, 64), ("triton", 128, 64)),
    ({"tma_grad_out": False}, ("gluon", 128, 64), ("triton", 64, 64), ("triton", 128, 64)),
    ({"tma_dk": False}, ("gluon", 128, 64), ("triton", 64, 64), ("gluon", 128, 64)),
    ({"dq_last_stride": 2}, ("gluon", 128, 64), ("gluon", 64, 64), ("triton", 128, 64)),
]


def _choices(monkeypatch, case, tiles=None):
    """The (forward, dK/dV, dQ) kernels chosen for ``_COMMON_CALL`` changed by ``case``, on
    stand-in tensors with the machine's facts patched in; at ``tiles`` for every pass (a
    layout's), or at the passes' own."""
    call = {**_COMMON_CALL, **case}
    monkeypatch.setattr(backends, "INTERPRETED", call["interpreted"])
    monkeypatch.setattr(backends, "GLUON_ENABLED", call["gluon_env"])
    monkeypatch.setattr(backends, "device_capability", lambda _: call["capability"])
    monkeypatch.setattr(backends, "tma_allowed", lambda _, *ts: all(t.tma for t in ts))
    seq_k, seq_q = call["seq"], call["seq_q"] or call["seq"]
    lead = () if call["varlen"] else (1,)
    shape, device = (4, call["dim"]), call["device"]
    q = _Tensor((*lead, seq_q, *shape), call["dtype"], call["tma_q"], device=device)
    k = _Tensor((*lead, seq_k, *shape), call["dtype"], device=device)
    grad_out = _Tensor(q.shape, call["dtype"], call["tma_grad_out"], device=device)
    dq = _Tensor(q.shape, call["dtype"], last_stride=call["dq_last_stride"], device=device)
    dk = _Tensor(k.shape, call["dtype"], call["tma_dk"], device=device)
    varlen = Varlen(None, None, seq_q, seq_k) if call["varlen"] else None
    backend = call["options"]
    options = KernelOptions(forward_backend=backend, dq_backend=backend, dkdv_backend=backend)
    choice = dict(
        block_size=call["block_size"],
        causal=call["causal"],
        varlen=varlen,
        softmax_scale=call["softmax_scale"],
        options=options,
    )
    forward = dispatch.forward_kernel(q, k, k, gather=True, tiles=tiles, **choice)
    dkdv, dq = dispatch.backward_kernels(
        grad_out,
        q,
        k,
        k,
        q,
        dq=dq,
        dk=dk,
        dv=k,
        gather_dq=call["gather_dq"],
        tiles=None if tiles is None else (tiles, tiles),
        **choice,
    )
    return forward, dkdv, dq


@pytest.mark.parametrize("case, want_forward, want_dkdv, want_dq", _CHOICES)
def test_one_choice_of_backend_and_tiles(monkeypatch, case, want_forward, want_dkdv, want_dq):
    """The (backend, tiles) of each pass on sm_90, sm_80 and sm_100 GPUs and on the CPU under
    the interpreter, from the facts of the call: the tables the layouts are built by and the
    launches follow, checked here without a GPU. The tiles the layouts are built at beforehand
    (``forward_tile_sizes``, ``backward_tile_sizes``) are the chosen ones."""
    forward, dkdv, dq = _choices(monkeypatch, case)
    assert forward == dispatch.PassKernel(*want_forward)
    assert dkdv == dispatch.PassKernel(*want_dkdv)
    assert dq == dispatch.PassKernel(*want_dq)
    call = {**_COMMON_CALL, **case}
    head_dim, dtype, device = call["dim"], call["dtype"], torch.device(call["device"])
    assert dispatch.forward_tile_sizes(head_dim, dtype, device) == want_forward[1:]
    assert dispatch.backward_tile_sizes(head_dim, dtype, device) == (want_dkdv[1:], want_dq[1:])


@pytest.mark.parametrize(
    "tiles, want",
    [
        # A Gluon kernel's own tiles: it still takes the call (dK/dV's are 64x64, not these).
        ((128, 64), ("gluon", "triton", "gluon")),
        ((64, 64), ("triton", "gluon", "triton")),
        # Tiles no Gluon kernel walks: the Triton kernels, which walk any.
        ((32, 32), ("triton", "triton", "triton")),
    ],
)
def test_a_layout_of_other_tiles_gets_a_backend_that_walks_them(monkeypatch, tiles, want):
    kernels = _choices(monkeypatch, {}, tiles)
    assert kernels == tuple(dispatch.PassKernel(name, *tiles) for name in want)


def test_decode_takes_the_first_backend_that_runs_on_the_device(monkeypatch):
    """A GPU's split count is the Triton decode kernel's rule; the CPU's is 1, with the
    interpreter (Triton's rule there) or without (no decode kernel: the PyTorch path)."""
    monkeypatch.setattr(triton_decode, "_num_sms", lambda _: 132)
    gpu, cpu = torch.device("cuda"), torch.device("cpu")
    for batch, pages in ((1, 49), (16, 2048), (64, 3)):
        want = triton_decode.decode_num_splits(batch, 8, pages, gpu)
        assert dispatch.decode_num_splits(batch, 8, pages, gpu) == want
    assert dispatch.decode_num_splits(1, 8, 49, gpu) > 1  # the rule, not the fallback's 1
    for interpreted in (True, False):
        monkeypatch.setattr(backends, "INTERPRETED", interpreted)
        assert dispatch.decode_num_splits(1, 8, 49, cpu) == 1
    q = torch.zeros(1, 1, 2, 16)
    with pytest.raises(RuntimeError, match="no decode kernel runs on cpu"):
        dispatch.decode(q, q, q, q, q, None, softmax_scale=1.0)


@pytest.mark.skipif(not (ON_GPU or INTERPRETED), reason="needs the Triton kernels")
def test_a_kernel_runs_only_on_its_own_tiles():
    """A layout built at other tiles than the kernel chosen for it is refused; left to choose,
    the launch takes the Triton kernel, which walks any tiles."""
    q = torch.randn(1, 128, 2, 32, dtype=DTYPES[0]).to(DEVICE)
    pattern = s2attn.local_stride_pattern(
        2, max_seq_len=128, block_size=32, local_blocks=2, vert_stride=2
    )
    layout = forward_layout(pattern, 32, 32, q.device)
    args = dict(softmax_scale=0.1, q_heads_per_pattern_head=1)
    with pytest.raises(ValueError, match="layout has 32x32 tiles but the kernel chosen"):
        dispatch.forward(q, q, q, layout, kernel=dispatch.PassKernel("triton", 64, 32), **args)
    with pytest.raises(ValueError, match="kernel.backend is 'cuda'; this pass has"):
        dispatch.forward(q, q, q, layout, kernel=dispatch.PassKernel("cuda", 32, 32), **args)
    out, _ = dispatch.forward(q, q, q, layout, **args)
    ref = s2attn.attention_reference(q.float(), q.float(), q.float(), pattern, softmax_scale=0.1)
    assert_close(out, ref, DTYPES[0], "out")


@pytest.mark.skipif(not (ON_GPU or INTERPRETED), reason="needs the Triton kernels")
def test_options_reach_the_triton_kernels(monkeypatch):
    """Settings given for the Triton kernels are the ones they launch with, and the results stay
    those of the reference."""
    spies = {}
    for module, name in (
        (triton_forward, "_forward_kernel"),
        (triton_backward, "_dkdv_kernel"),
        (triton_backward, "_dq_kernel"),
    ):
        spies[name] = LaunchSpy(getattr(module, name))
        monkeypatch.setattr(module, name, spies[name])
    dtype = DTYPES[0]
    gen = torch.Generator().manual_seed(3)
    q, k, v, grad = (torch.randn(2, 192, 4, 32, generator=gen).to(DEVICE, dtype) for _ in range(4))
    pattern = s2attn.local_stride_pattern(
        4, max_seq_len=192, block_size=32, local_blocks=2, vert_stride=3
    )
    options = KernelOptions(
        forward_backend="triton",
        dq_backend="triton",
        dkdv_backend="triton",
        triton_forward=TritonForwardConfig(num_warps=2, heads_per_group=2),
        triton_dq=TritonBackwardConfig(num_stages=3, heads_per_group=4),
        triton_dkdv=TritonBackwardConfig(num_warps=2, heads_per_group=1),
    )
    (fwd_m, fwd_n), ((kv_m, kv_n), (dq_m, dq_n)) = (
        dispatch.forward_tile_sizes(32, dtype, q.device),
        dispatch.backward_tile_sizes(32, dtype, q.device),
    )
    out, lse = dispatch.forward(
        q,
        k,
        v,
        forward_layout(pattern, fwd_m, fwd_n, q.device),
        softmax_scale=32**-0.5,
        q_heads_per_pattern_head=1,
        options=options,
    )
    dq, dk, dv = dispatch.backward(
        grad,
        q,
        k,
        v,
        out,
        lse,
        None,
        backward_layout(pattern, kv_m, kv_n, q.device, 192 // 32),
        forward_layout(pattern, dq_m, dq_n, q.device),
        softmax_scale=32**-0.5,
        q_heads_per_pattern_head=1,
        options=options,
    )
    (fwd,), (dkdv,), (dq_call,) = (spies[n].calls for n in spies)
    assert fwd["num_warps"] == 2 and dq_call["num_stages"] == 3 and dkdv["num_warps"] == 2
    ref = [t.float().requires_grad_() for t in (q, k, v)]
    ref_out = s2attn.attention_reference(*ref, pattern)
    ref_out.backward(grad.float())
    assert_close(out, ref_out, dtype, "out")
    for name, got, want in zip(("dq", "dk", "dv"), (dq, dk, dv), ref):
        assert_close(got, want.grad, dtype, name)


@pytest.mark.parametrize("dq_computes_delta", [True, False])
@pytest.mark.parametrize("dkdv_reads_stats", [True, False])
def test_backward_launches_in_the_order_the_rows_declare(
    monkeypatch, dq_computes_delta, dkdv_reads_stats
):
    """A dQ backend that computes the row term runs first, else the row-delta kernel does; dK/dV
    next, with the row statistics allocated when its row reads them; dQ last otherwise. Checked
    with stand-in rows (no kernel runs), as a new backend would join the tables."""
    launched = []

    def row(name, **flags):
        def launch(b, layout):
            launched.append((name, layout.block_m, None if b.stats is None else b.stats.shape))

        return backends.PassBackend(
            name, tiles=lambda *_: (16, 16), takes=lambda *_: True, launch=launch, **flags
        )

    monkeypatch.setattr(dispatch, "DKDV", (row("dkdv", reads_row_stats=dkdv_reads_stats),))
    monkeypatch.setattr(dispatch, "DQ", (row("dq", computes_delta=dq_computes_delta),))
    monkeypatch.setattr(dispatch, "row_delta", lambda b: launched.append(("delta", None, None)))
    batch, seq, heads, dim = 2, 48, 3, 16
    q = torch.randn(batch, seq, heads, dim)
    lse = torch.randn(batch, heads, seq)

    class Layout:
        block_m = block_n = 16
        block_size, causal, gather_width = 16, True, 0

    layout = Layout()
    dispatch.backward(
        q, q, q, q, q, lse, None, layout, layout, softmax_scale=1.0, q_heads_per_pattern_head=1
    )
    stats = (batch * heads, 2, 48) if dkdv_reads_stats else None  # rows padded to 16 bytes
    dkdv, dq = ("dkdv", 16, stats), ("dq", 16, stats)
    want = [dq, dkdv] if dq_computes_delta else [("delta", None, None), dkdv, dq]
    assert launched == want
