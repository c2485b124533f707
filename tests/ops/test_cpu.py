"""The CPU path over the kept blocks (``s2attn.ops.cpu.blockwise_forward``/``_backward``) against
the dense-mask ground truth in float64, and the route a CPU call without the interpreter takes to
it, in memory bounded by the kept blocks."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading

import pytest
import torch
from helpers import assert_close, skip_without_gpu

import s2attn
from s2attn.ops import cpu
from s2attn.ops.cpu import blockwise_backward, blockwise_forward
from s2attn.reference import attention_reference

# The fallback computes in float32; float64 inputs in float64 (gradcheck).
TOL_DTYPE = {torch.float32: torch.float32, torch.float64: torch.float32}


def _reference(q, k, v, pattern, scale, cu_q=None, cu_k=None):
    """(out, lse, (dq, dk, dv) as a function of (grad_out, grad_lse)) from the dense mask in
    float64, by autograd."""
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    out, lse = attention_reference(
        q64, k64, v64, pattern, softmax_scale=scale, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
        return_lse=True, compute_dtype=torch.float64,
    )  # fmt: skip
    lse = lse.double()  # its float32 cast would round the LSE's gradient too

    def grads(grad_out, grad_lse):
        finite = lse.isfinite()
        total = (out * grad_out.double()).sum() + (lse[finite] * grad_lse.double()[finite]).sum()
        return torch.autograd.grad(total, (q64, k64, v64), retain_graph=True)

    return out.detach(), lse.detach(), grads


def _check(q, k, v, pattern, cu_q=None, cu_k=None, scale=0.3):
    dtype = TOL_DTYPE[q.dtype]
    out, lse = blockwise_forward(
        q, k, v, pattern, softmax_scale=scale, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k
    )
    ref_out, ref_lse, ref_grads = _reference(q, k, v, pattern, scale, cu_q, cu_k)
    assert out.dtype == q.dtype and out.is_contiguous()
    assert_close(out, ref_out, dtype, "out")
    assert_close(lse, ref_lse, dtype, "lse")
    grad_out, grad_lse = torch.randn_like(out), torch.randn_like(lse)
    grads = blockwise_backward(
        grad_out, grad_lse, q, k, v, out, lse, pattern, softmax_scale=scale,
        cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
    )  # fmt: skip
    for name, got, want, t in zip("qkv", grads, ref_grads(grad_out, grad_lse), (q, k, v)):
        assert got.shape == t.shape and got.dtype == t.dtype
        assert_close(got, want, dtype, f"d{name}")
    # Only the output's gradient, or only the LSE's.
    for go, gl in ((grad_out, None), (None, grad_lse)):
        grads = blockwise_backward(go, gl, q, k, v, out, lse, pattern, softmax_scale=scale,
                                   cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)  # fmt: skip
        zero_out, zero_lse = torch.zeros_like(out), torch.zeros_like(lse)
        want = ref_grads(grad_out if gl is None else zero_out, grad_lse if go is None else zero_lse)
        for name, got, w in zip("qkv", grads, want):
            assert_close(got, w, dtype, f"d{name} (one gradient)")


def _qkv(batch, seq_q, seq_k, heads, kv_heads, dim, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(*batch, seq_q, heads, dim, generator=g, dtype=dtype)
    k = torch.randn(*batch, seq_k, kv_heads, dim, generator=g, dtype=dtype)
    v = torch.randn(*batch, seq_k, kv_heads, dim, generator=g, dtype=dtype)
    return q, k, v


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize(
    "seq_q, seq_k, heads, kv_heads, pattern_heads, block_size",
    [
        (200, 200, 4, 2, 4, 16),  # GQA, one pattern per query head; last block partial
        (70, 300, 8, 2, 2, 32),  # fewer queries than keys; one pattern per KV head
        (513, 513, 2, 1, 2, 16),  # several query tiles (256 rows each)
        (64, 64, 2, 2, 2, 64),  # one block
    ],
)
def test_blockwise_matches_dense_mask(causal, seq_q, seq_k, heads, kv_heads, pattern_heads,
                                      block_size):  # fmt: skip
    pattern = s2attn.local_stride_pattern(
        pattern_heads, max_seq_len=1024, block_size=block_size, local_blocks=2, vert_stride=3,
        causal=causal,
    )  # fmt: skip
    _check(*_qkv((2,), seq_q, seq_k, heads, kv_heads, 32), pattern)


def test_blockwise_random_pattern_with_empty_rows():
    """A user pattern whose query blocks 1 and 3 keep nothing: those rows give 0 and LSE -inf."""
    g = torch.Generator().manual_seed(1)
    mask = torch.rand(3, 6, 6, generator=g) < 0.5
    mask[:, 1] = mask[:, 3] = False
    pattern = s2attn.BlockPattern(mask, 16, causal=True)
    q, k, v = _qkv((1,), 96, 96, 3, 3, 16, seed=1)
    out, lse = blockwise_forward(q, k, v, pattern, softmax_scale=0.25)
    assert (out[0, 16:32] == 0).all() and (lse[0, :, 16:32] == float("-inf")).all()
    _check(q, k, v, pattern, scale=0.25)


def test_blockwise_varlen_with_empty_sequences():
    pattern = s2attn.local_stride_pattern(
        4, max_seq_len=512, block_size=16, local_blocks=2, vert_stride=3, num_kv_heads=2
    )
    lens_q, lens_k = [30, 0, 100, 17], [50, 20, 100, 17]
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32)
    q, k, v = _qkv((), sum(lens_q), sum(lens_k), 4, 2, 16, seed=2)
    _check(q, k, v, pattern, cu_q, cu_k)


@skip_without_gpu
@pytest.mark.parametrize("varlen", [False, True], ids=["batched", "varlen"])
def test_blockwise_on_a_gpu(varlen):
    """The fallback on CUDA tensors (a GPU Triton does not serve): the pattern's block lists live
    on the host, the tiles' positions and masks go where q is."""
    pattern = s2attn.local_stride_pattern(
        4, max_seq_len=512, block_size=16, local_blocks=2, vert_stride=3, num_kv_heads=2
    )
    if varlen:
        cu = torch.tensor([0, 30, 30, 130], dtype=torch.int32, device="cuda")
        q, k, v = (t.cuda() for t in _qkv((), 130, 130, 4, 2, 16, seed=4))
        _check(q, k, v, pattern, cu, cu)
    else:
        _check(*(t.cuda() for t in _qkv((2,), 200, 200, 4, 2, 16, seed=4)), pattern)


def test_blockwise_float64_computes_in_float64():
    """float64 inputs (gradcheck's) compute in float64: agreement to 1e-12, not float32's 1e-7."""
    pattern = s2attn.local_stride_pattern(2, max_seq_len=64, block_size=16, local_blocks=1,
                                          vert_stride=2)  # fmt: skip
    q, k, v = _qkv((1,), 40, 40, 2, 2, 16, torch.float64, seed=3)
    out, lse = blockwise_forward(q, k, v, pattern, softmax_scale=0.5)
    ref_out, ref_lse, ref_grads = _reference(q, k, v, pattern, 0.5)
    assert out.dtype == lse.dtype == torch.float64
    torch.testing.assert_close(out, ref_out, rtol=1e-12, atol=1e-12)
    # attention_reference hands its LSE back in float32.
    torch.testing.assert_close(lse, ref_lse, rtol=1e-7, atol=0)
    grad_out = torch.randn_like(out)
    grads = blockwise_backward(grad_out, None, q, k, v, out, lse, pattern, softmax_scale=0.5)
    for got, want in zip(grads, ref_grads(grad_out, torch.zeros_like(lse))):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


# A CPU process without the interpreter: sparse_attention and its backward take the blockwise
# path. 8 heads of 8192 tokens: the dense-mask reference holds (heads, N, N) float32 scores and
# probabilities, 2 GiB each; the blockwise path stays near its inputs and gradients. Measured as
# the peak's growth over the process once its inputs exist: what the libraries map at import
# (CUDA's, on a GPU machine) is not the call's.
_ROUTE = textwrap.dedent(
    """
    import resource, torch, s2attn
    from s2attn.ops import env
    assert not env.INTERPRETED
    torch.manual_seed(0)
    p = s2attn.local_stride_pattern(8, max_seq_len=8192, block_size=64, local_blocks=4,
                                    vert_stride=16)
    q, k, v = (torch.randn(1, 8192, 8, 64, dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    out, lse = s2attn.sparse_attention(q, k, v, p, return_lse=True)
    (out.float().square().sum() + lse.sum()).backward()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20 - before
    # Rows spread over the sequence against the dense mask on those rows alone.
    rows = torch.tensor([0, 1, 63, 64, 1000, 4095, 8191])
    qr = q.detach()[:, rows]
    mask = p.token_mask(8192)[:, rows]  # (heads, rows, keys): 8 x 7 x 8192
    s = torch.einsum("bqhd,bkhd->bhqk", qr.float(), k.detach().float()) / 8.0
    s = s.masked_fill(~mask, float("-inf"))
    ref = torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), v.detach().float())
    err = ((out[:, rows].float() - ref).norm() / ref.norm()).item()
    print(f"peak growth {peak:.2f} GiB, error {err:.1e}")
    assert err < 1e-2, err
    assert torch.isfinite(q.grad).all() and q.grad.abs().sum() > 0
    assert peak < 1.0, peak
    empty = torch.empty(0, 64, 8, 64)
    assert s2attn.sparse_attention(empty, empty, empty, p).shape == empty.shape
    """
)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_blockwise_half_inputs_compute_in_float32(dtype):
    """Half-precision inputs are upcast before anything is computed: the LSE (float32) agrees with
    the float64 reference of the same rounded inputs to float32's tolerance, which a product
    rounded to bfloat16 on the way (2.6e-4 here) would not meet."""
    pattern = s2attn.local_stride_pattern(2, max_seq_len=64, block_size=16, local_blocks=1,
                                          vert_stride=2)  # fmt: skip
    q, k, v = _qkv((2,), 64, 64, 2, 2, 16, dtype, seed=3)
    out, lse = blockwise_forward(q, k, v, pattern, softmax_scale=0.25)
    ref_out, ref_lse, _ = _reference(q, k, v, pattern, 0.25)
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert_close(lse, ref_lse, torch.float32, f"lse from {dtype} inputs")
    assert_close(out, ref_out, dtype, f"out from {dtype} inputs")


def test_cpu_call_without_interpreter_is_blockwise_and_bounded():
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET",)}
    result = subprocess.run([sys.executable, "-c", _ROUTE], env=env, capture_output=True,
                            text=True, timeout=600)  # fmt: skip
    print(result.stdout, result.stderr[-3000:])
    assert result.returncode == 0


def test_blockwise_tile_that_keeps_nothing():
    """Query blocks 2 and 3 keep nothing in any head: with 64-token blocks they make one whole
    query tile of 128 rows with no KV block, whose rows give 0, LSE -inf and no gradient."""
    g = torch.Generator().manual_seed(5)
    mask = torch.rand(2, 6, 6, generator=g) < 0.6
    mask[:, :, 0] = True  # every other row keeps a block
    mask[:, 2:4] = False
    pattern = s2attn.BlockPattern(mask, 64, causal=True)
    q, k, v = _qkv((2,), 384, 384, 2, 2, 16, seed=5)
    out, lse = blockwise_forward(q, k, v, pattern, softmax_scale=0.25)
    assert (out[:, 128:256] == 0).all() and (lse[:, :, 128:256] == float("-inf")).all()
    _check(q, k, v, pattern, scale=0.25)


def test_blockwise_heads_split_to_bound_memory(monkeypatch):
    """A tile whose scores exceed the work-buffer bound runs its heads in chunks, with the same
    results (GQA: each chunk's heads add into shared KV heads)."""
    monkeypatch.setattr(cpu, "_TILE_SCORES", 1)  # one head at a time
    pattern = s2attn.local_stride_pattern(
        4, max_seq_len=512, block_size=16, local_blocks=2, vert_stride=3, causal=True
    )
    _check(*_qkv((2,), 150, 150, 4, 2, 16, seed=6), pattern)


def test_blockwise_dense_heads_and_bidirectional():
    """Dense heads beside sparse ones (tiles of different widths padded to one), without the
    causal rule."""
    pattern = s2attn.local_stride_pattern(
        4,
        max_seq_len=256,
        block_size=16,
        local_blocks=2,
        vert_stride=4,
        num_dense_heads=2,
        causal=False,
    )
    _check(*_qkv((1,), 100, 180, 4, 4, 16, seed=7), pattern)


def _count_threads(into: list) -> None:
    into.append(torch.get_num_threads())


def test_blockwise_workers_match_one_thread_and_leave_the_thread_count():
    """Three torch threads make three workers taking tiles as they go: the same results as one
    thread (the forward to the bit; dK, dV summed in another order), under inference mode too,
    and the caller's thread count, and the one a new thread starts with, are as before."""
    pattern = s2attn.local_stride_pattern(
        4, max_seq_len=1024, block_size=16, local_blocks=2, vert_stride=3, num_kv_heads=2
    )
    q, k, v = _qkv((2,), 300, 300, 4, 2, 16, seed=8)
    grad_out = torch.randn_like(q)
    before = torch.get_num_threads()
    results = {}
    try:
        for threads in (1, 3):
            torch.set_num_threads(threads)
            out, lse = blockwise_forward(q, k, v, pattern, softmax_scale=0.3)
            grads = blockwise_backward(grad_out, None, q, k, v, out, lse, pattern,
                                       softmax_scale=0.3)  # fmt: skip
            with torch.inference_mode():
                inference_out, _ = blockwise_forward(q, k, v, pattern, softmax_scale=0.3)
            results[threads] = out, lse, inference_out, grads
            seen = []
            new_thread = threading.Thread(target=_count_threads, args=(seen,))
            new_thread.start()
            new_thread.join()
            assert torch.get_num_threads() == threads and seen == [threads]
    finally:
        torch.set_num_threads(before)
    (out1, lse1, inf1, grads1), (out3, lse3, inf3, grads3) = results[1], results[3]
    assert torch.equal(out1, out3) and torch.equal(lse1, lse3) and torch.equal(inf1, inf3)
    for one, three in zip(grads1, grads3):
        torch.testing.assert_close(three, one, rtol=1e-5, atol=1e-6)
