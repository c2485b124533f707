"""The kernels ``sparse_attention`` chooses by default on the GPU, against the float32 reference:
output, LSE and dq/dk/dv over the shapes that reach every kernel path (head dims 64/80/128/256,
pattern blocks 16/32/64/128, causal and bidirectional, GQA with a pattern per KV head or per
query head, fewer queries than keys, packed sequences whose lengths end inside a block) in
bfloat16, float16 and float32.

The other test files pin single kernels and small shapes; this one runs the public call on
sequences of 600-2048 tokens, as a user would, so it is the check to run next to timings after a
kernel change: ``python -m pytest -q tests/ops/test_verify_kernels.py`` (GPU only).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import pytest
import torch
from helpers import DEVICE, assert_close, gpu_only, skip_without_gpu

import s2attn

pytestmark = [gpu_only, skip_without_gpu]


@dataclass(frozen=True)
class Case:
    name: str
    dtype: torch.dtype
    q_shape: tuple[int, ...]  # (batch, seq_q, heads, dim), or packed (total_q, heads, dim)
    k_shape: tuple[int, ...]  # (batch, seq_k, kv_heads, dim), or packed (total_k, kv_heads, dim)
    pattern_heads: int
    pattern_seq: int
    block: int
    causal: bool
    local_blocks: int = 4
    vert_stride: int = 4
    q_lens: tuple[int, ...] | None = None  # packed sequences' lengths
    k_lens: tuple[int, ...] | None = None

    def pattern(self) -> s2attn.BlockPattern:
        return s2attn.local_stride_pattern(
            self.pattern_heads,
            max_seq_len=self.pattern_seq,
            block_size=self.block,
            local_blocks=self.local_blocks,
            vert_stride=self.vert_stride,
            causal=self.causal,
        )


def _cases() -> list[Case]:
    cases = []
    for dtype in (torch.bfloat16, torch.float16):
        for dim, causal in itertools.product((64, 80, 128, 256), (True, False)):
            seq = 2048 if dim == 128 else 1000
            shape = (2, seq, 4, dim)
            cases.append(Case(f"dim{dim}", dtype, shape, shape, 4, seq, 64, causal))
        for block, causal in itertools.product((16, 32, 128), (True, False)):
            shape = (1, 777, 4, 128)  # 777 ends inside a block of every size
            cases.append(Case(f"block{block}", dtype, shape, shape, 4, 777, block, causal, 3, 3))
        for per_kv_head, causal in itertools.product((False, True), (True, False)):
            cases.append(
                Case(
                    f"gqa8/2-{'per-kv-head' if per_kv_head else 'per-q-head'}",
                    dtype,
                    (1, 1500, 8, 128),
                    (1, 1500, 2, 128),
                    2 if per_kv_head else 8,
                    1500,
                    64,
                    causal,
                )
            )
        for causal in (True, False):
            cases.append(
                Case(
                    "seq_q700<seq_k1900",
                    dtype,
                    (1, 700, 4, 128),
                    (1, 1900, 4, 128),
                    4,
                    2000,
                    64,
                    causal,
                )
            )
            q_lens, k_lens = (300, 1, 1100, 517), (300, 64, 1700, 517)
            cases.append(
                Case(
                    "varlen",
                    dtype,
                    (sum(q_lens), 4, 128),
                    (sum(k_lens), 4, 128),
                    4,
                    2000,
                    64,
                    causal,
                    q_lens=q_lens,
                    k_lens=k_lens,
                )
            )
    for dim, causal in itertools.product((64, 128), (True, False)):
        shape = (1, 600, 2, dim)
        cases.append(Case(f"dim{dim}", torch.float32, shape, shape, 2, 600, 32, causal, 3, 3))
    return cases


def _case_id(case: Case) -> str:
    return f"{case.name}-{'causal' if case.causal else 'bidir'}-{str(case.dtype)[6:]}"


@pytest.mark.parametrize("case", _cases(), ids=_case_id)
def test_default_kernels_match_reference(case: Case):
    gen = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(shape, generator=gen).to(DEVICE, case.dtype).requires_grad_()
        for shape in (case.q_shape, case.k_shape, case.k_shape)
    )
    cu_seqlens, max_seqlens = {}, {}
    if case.q_lens is not None:
        cu = lambda lens: torch.tensor([0, *lens], device=DEVICE).cumsum(0).to(torch.int32)
        cu_seqlens = dict(cu_seqlens_q=cu(case.q_lens), cu_seqlens_k=cu(case.k_lens))
        max_seqlens = dict(max_seqlen_q=max(case.q_lens), max_seqlen_k=max(case.k_lens))
    pattern = case.pattern()
    out, lse = s2attn.sparse_attention(
        q, k, v, pattern, return_lse=True, **cu_seqlens, **max_seqlens
    )
    grad = torch.randn(out.shape, generator=gen).to(DEVICE, case.dtype)
    out.backward(grad)

    qr, kr, vr = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref, ref_lse = s2attn.attention_reference(qr, kr, vr, pattern, return_lse=True, **cu_seqlens)
    ref.backward(grad.float())
    assert_close(out, ref, case.dtype, "out")
    assert_close(lse, ref_lse, case.dtype, "lse")
    for name, got, want in (
        ("dq", q.grad, qr.grad),
        ("dk", k.grad, kr.grad),
        ("dv", v.grad, vr.grad),
    ):
        assert_close(got, want, case.dtype, name)
