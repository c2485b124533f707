"""GPU exactness check of the default kernel choices, to run next to timings after a kernel change.

Output, LSE and dq/dk/dv of ``sparse_attention`` against ``attention_reference`` on float32 copies
of the same inputs, over the shapes that exercise every path of the kernels: head dims 64/80/128/
256, causal and bidirectional, GQA, packed (varlen) sequences, fewer queries than keys, lengths
that end inside a block, and every dtype. Prints one line per case and exits non-zero on failure.

    python benchmarks/verify_kernels.py
"""

from __future__ import annotations

import itertools
import multiprocessing as mp
import sys

import torch

import s2attn

TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-4}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    finite = torch.isfinite(b)
    if not torch.equal(torch.isfinite(a), finite):
        return float("inf")
    return ((a - b)[finite].norm() / b[finite].norm().clamp_min(1e-30)).item()


def _case(name, dtype, q_shape, k_shape, pattern, cu_q=None, cu_k=None, seed=0) -> bool:
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (
        torch.randn(s, generator=gen).to("cuda", dtype).requires_grad_()
        for s in (q_shape, k_shape, k_shape)
    )
    kwargs = {}
    if cu_q is not None:
        kwargs = dict(
            cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
            max_seqlen_q=int((cu_q[1:] - cu_q[:-1]).max()),
            max_seqlen_k=int((cu_k[1:] - cu_k[:-1]).max()),
        )  # fmt: skip
    out, lse = s2attn.sparse_attention(q, k, v, pattern, return_lse=True, **kwargs)
    g = torch.randn(out.shape, generator=gen).to("cuda", dtype)
    out.backward(g)
    qr, kr, vr = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref_kwargs = {k_: v_ for k_, v_ in kwargs.items() if k_.startswith("cu_")}
    ref, ref_lse = s2attn.attention_reference(qr, kr, vr, pattern, return_lse=True, **ref_kwargs)
    ref.backward(g.float())
    errs = [
        _rel(out, ref), _rel(lse, ref_lse),
        _rel(q.grad, qr.grad), _rel(k.grad, kr.grad), _rel(v.grad, vr.grad),
    ]  # fmt: skip
    ok = max(errs) < TOL[dtype] and not any(
        torch.isnan(t).any() for t in (out, q.grad, k.grad, v.grad)
    )
    print(
        f"{'ok  ' if ok else 'FAIL'} {name:44s} {str(dtype)[6:]:8s} "
        + " ".join(f"{e:.1e}" for e in errs),
        flush=True,
    )
    return ok


def _cases() -> list[tuple]:
    """(name, dtype, q shape, k shape, pattern args, q lengths, k lengths) of every case."""
    cases = []
    for dtype in (torch.bfloat16, torch.float16):
        for dim, causal in itertools.product((64, 80, 128, 256), (True, False)):
            seq = 1000 if dim != 128 else 2048
            cases.append((f"dim {dim} seq {seq} causal={causal}", dtype, (2, seq, 4, dim),
                          (2, seq, 4, dim), (4, seq, 64, 4, 4, causal), None, None))  # fmt: skip
        for block, causal in itertools.product((16, 32, 128), (True, False)):
            cases.append((f"block {block} seq 777 causal={causal}", dtype, (1, 777, 4, 128),
                          (1, 777, 4, 128), (4, 777, block, 3, 3, causal), None, None))  # fmt: skip
        for per_kv, causal in itertools.product((False, True), (True, False)):
            cases.append((f"GQA 8/2 per_kv_pattern={per_kv} causal={causal}", dtype,
                          (1, 1500, 8, 128), (1, 1500, 2, 128),
                          (2 if per_kv else 8, 1500, 64, 4, 4, causal), None, None))  # fmt: skip
        for causal in (True, False):
            cases.append((f"seq_q 700 < seq_k 1900 causal={causal}", dtype, (1, 700, 4, 128),
                          (1, 1900, 4, 128), (4, 2000, 64, 4, 4, causal), None, None))  # fmt: skip
            lq, lk = [300, 1, 1100, 517], [300, 64, 1700, 517]
            cases.append((f"varlen {lq}/{lk} causal={causal}", dtype, (sum(lq), 4, 128),
                          (sum(lk), 4, 128), (4, 2000, 64, 4, 4, causal), lq, lk))  # fmt: skip
    for dim, causal in itertools.product((64, 128), (True, False)):
        cases.append((f"fp32 dim {dim} causal={causal}", torch.float32, (1, 600, 2, dim),
                      (1, 600, 2, dim), (2, 600, 32, 3, 3, causal), None, None))  # fmt: skip
    return cases


def _run(case) -> bool:
    name, dtype, q_shape, k_shape, (heads, seq, block, local, stride, causal), lq, lk = case
    pattern = s2attn.local_stride_pattern(heads, seq, block, local, stride, causal=causal)
    cu = lambda lens: torch.tensor([0, *lens], device="cuda").cumsum(0).to(torch.int32)  # noqa: E731
    cu_q, cu_k = (cu(lq), cu(lk)) if lq else (None, None)
    return _case(name, dtype, q_shape, k_shape, pattern, cu_q, cu_k)


def main() -> int:
    print(f"{'case':49s} {'dtype':8s} out     lse     dq      dk      dv")
    cases = _cases()
    # Compilation dominates: run the cases in parallel processes.
    with mp.get_context("spawn").Pool(min(12, len(cases))) as pool:
        results = pool.map(_run, cases, chunksize=1)
    ok = all(results)
    print(f"{sum(results)}/{len(results)} cases ok")
    print("ALL OK" if ok else "FAILURES")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
