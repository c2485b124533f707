"""The seam between the autograd layer and the kernels (s2attn/ops/dispatch.py, options.py): the
backend predicates, and ``KernelOptions`` reaching the kernels it names.

On the CPU the Triton kernels run under the interpreter and no Gluon kernel can run; the Gluon
cases of the dispatch are tested on an sm_90 GPU (test_forward_hopper.py).
"""

from __future__ import annotations

import pytest
import torch
from helpers import DEVICE, DTYPES, ON_GPU, assert_close

import s2attn
from s2attn.layout import backward_layout, forward_layout
from s2attn.ops import dispatch
from s2attn.ops.env import INTERPRETED
from s2attn.ops.options import (
    GluonDqConfig,
    KernelOptions,
    TritonBackwardConfig,
    TritonForwardConfig,
)
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
        return  # the Gluon predicates on a GPU: test_forward_hopper.py
    q = torch.randn(1, 256, 2, 64, dtype=torch.float16)
    pattern = s2attn.local_stride_pattern(
        2, max_seq_len=256, block_size=64, local_blocks=2, vert_stride=2
    )
    layout = forward_layout(pattern, 128, 64, cpu)
    assert not dispatch.supports_gluon_forward(
        q, q, q, layout, varlen=False, check_k_bounds=False, softmax_scale=0.1
    )
    kv_layout = backward_layout(pattern, 64, 64, cpu, 4)
    assert not dispatch.supports_gluon_dkdv(q, q, q, q, q, q, kv_layout, varlen=False)
    assert not dispatch.supports_gluon_dq(
        q, q, q, q, q, q, layout, varlen=False, check_k_bounds=False, softmax_scale=0.1
    )


class _Spy:
    """Stands in for a Triton kernel and records each launch's keywords."""

    def __init__(self, kernel):
        self.kernel, self.calls = kernel, []

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*args, **kwargs):
            self.calls.append(kwargs)
            return launch(*args, **kwargs)

        return run


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
        spies[name] = _Spy(getattr(module, name))
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
