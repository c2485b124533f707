"""Where a forward call's time goes besides its kernel (dev aid): the kernels' own time
(torch.profiler), do_bench (Python launches, L2 flushed before each call), do_bench without
the flush, CUDA-graph replay, and the host time of one call. Batch 1, 32 heads, bf16, causal,
block 64, local 16.

    python scripts/forward_gap.py --cases 131072:128:64,32768:64:16
"""

import argparse

import torch
import triton
from host_time import host_ms
from torch.profiler import ProfilerActivity, profile

import s2attn
from s2attn import local_stride_pattern

ap = argparse.ArgumentParser()
ap.add_argument("--cases", default="131072:128:64,32768:128:64,32768:64:16,8192:128:16")
args = ap.parse_args()
print(torch.cuda.get_device_name(), torch.__version__, triton.__version__)
print(f"{'seq':>7} {'dim':>4} {'V':>3} {'kernels':>8} {'do_bench':>8} {'no flush':>8} {'graph':>8} "
      f"{'host':>8}  kernels run (ms each)")  # fmt: skip
for case in args.cases.split(","):
    seq, dim, stride = (int(x) for x in case.split(":"))
    p = local_stride_pattern(32, seq, 64, 16, stride)
    q, k, v = (torch.randn(1, seq, 32, dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))

    def fn(q=q, k=k, v=v, p=p):
        return s2attn.sparse_attention(q, k, v, p)

    host = host_ms(fn, 20)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
    per = {}
    for e in prof.key_averages():
        if e.device_time_total > 0:
            per[e.key] = e.device_time_total / 5 / 1e3
    kernels = sum(per.values())
    bench = triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
    # do_bench flushes L2 before each call; back-to-back calls between two events do not.
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    reps = max(3, int(200 / max(bench, 0.01)))
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    no_flush = start.elapsed_time(end) / reps
    graph = triton.testing.do_bench_cudagraph(fn, rep=200, return_mode="median")
    names = ", ".join(
        f"{name[:28]} {ms:.3f}" for name, ms in sorted(per.items(), key=lambda x: -x[1])
    )
    print(f"{seq:>7} {dim:>4} {stride:>3} {kernels:8.3f} {bench:8.3f} {no_flush:8.3f} {graph:8.3f} "
          f"{host:8.3f}  {names}")  # fmt: skip
