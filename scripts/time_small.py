"""Launch overhead vs kernel time of the forward at 8k (dev aid): do_bench (Python launches),
CUDA-graph replay, and the host time of one call."""
import time

import torch
import triton

import s2attn
from s2attn import local_stride_pattern

print(torch.cuda.get_device_name())
for dim, stride, seq in [(64, 16, 8192), (128, 64, 8192), (128, 16, 8192), (64, 16, 32768)]:
    p = local_stride_pattern(32, seq, 64, 16, stride)
    q, k, v = (torch.randn(1, seq, 32, dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    fn = lambda: s2attn.sparse_attention(q, k, v, p)  # noqa: E731
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(50):
        fn()
    host = (time.perf_counter() - t0) / 50 * 1e3
    torch.cuda.synchronize()
    ms = triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
    g = triton.testing.do_bench_cudagraph(fn, rep=200, return_mode="median")
    print(f"dim {dim} V{stride} seq {seq}: do_bench {ms:.3f} ms, graph {g:.3f} ms, host {host:.3f} ms/call")
