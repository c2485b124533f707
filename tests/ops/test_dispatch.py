"""The seam between the autograd layer and the kernels (s2attn/ops/dispatch.py, options.py): the
backend predicates, and ``KernelOptions`` reaching the kernels it names.

On the CPU the Triton kernels run under the interpreter and no Gluon kernel can run; the Gluon
cases of the dispatch are tested on an sm_90 GPU (test_gluon_sm90.py).
"""

from __future__ import annotations

import pytest
import torch
from helpers import DEVICE, DTYPES, ON_GPU, LaunchSpy, assert_close

import s2attn
from s2attn.ops import dispatch
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


class _Tensor:
    """What the choice of kernels reads of a CUDA tensor, without a GPU: shape, dtype, device,
    the last dim's stride, and whether bulk copies (TMA) may read it."""

    def __init__(self, shape, dtype=torch.bfloat16, tma=True, last_stride=1):
        self.shape, self.dtype, self.device = shape, dtype, torch.device("cuda")
        self.tma, self.last_stride = tma, last_stride

    def stride(self, dim):
        assert dim == -1
        return self.last_stride


# A batched causal bf16 call (head dim 128, 1024 tokens, 64-token blocks) on an sm_90 GPU, with
# every tensor fit for bulk copies.
_COMMON_CALL = dict(
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


@pytest.mark.parametrize("case, want_forward, want_dkdv, want_dq", _CHOICES)
def test_one_choice_of_backend_and_tiles(monkeypatch, case, want_forward, want_dkdv, want_dq):
    """The (backend, tiles) of each pass on a GPU, from the facts of the call: the table the
    layouts are built by and the launches follow, checked here without a GPU."""
    call = {**_COMMON_CALL, **case}
    monkeypatch.setattr(dispatch, "INTERPRETED", False)
    monkeypatch.setattr(dispatch, "GLUON_ENABLED", call["gluon_env"])
    monkeypatch.setattr(dispatch, "device_capability", lambda _: call["capability"])
    monkeypatch.setattr(dispatch, "tma_allowed", lambda _, *ts: all(t.tma for t in ts))
    seq_k, seq_q = call["seq"], call["seq_q"] or call["seq"]
    lead = () if call["varlen"] else (1,)
    q = _Tensor((*lead, seq_q, 4, call["dim"]), call["dtype"], call["tma_q"])
    k = _Tensor((*lead, seq_k, 4, call["dim"]), call["dtype"])
    grad_out = _Tensor(q.shape, call["dtype"], call["tma_grad_out"])
    dq = _Tensor(q.shape, call["dtype"], last_stride=call["dq_last_stride"])
    dk = _Tensor(k.shape, call["dtype"], call["tma_dk"])
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
    forward = dispatch.forward_kernel(q, k, k, gather=True, **choice)
    dkdv, dq = dispatch.backward_kernels(
        grad_out, q, k, k, q, dq=dq, dk=dk, dv=k, gather_dq=call["gather_dq"], **choice
    )
    assert forward == dispatch.PassKernel(*want_forward)
    assert dkdv == dispatch.PassKernel(*want_dkdv)
    assert dq == dispatch.PassKernel(*want_dq)


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
    assert dispatch.PassKernel("gluon", 128, 64).on(layout) == dispatch.PassKernel("triton", 32, 32)
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
