"""Per-kernel GPU time of one forward+backward: torch.profiler's CUDA kernel times, averaged over
a few calls, and the time between CUDA events around the same calls, whose difference is the gaps
the host leaves between kernels. Batch 1, 32 heads, bf16, causal, block 64, local 16 unless given.
A few calls read about 10% under a sustained run, the benchmarks' regime: the clock falls once
the load lasts a few tens of milliseconds (on an H100 at 32k V16, 7.2 ms of kernels over 3
calls, 8.0 over 30). Compare with `bench_attention.py` at --calls 30.

    python scripts/time_kernels.py --seq 131072 --strides 16,64 --dim 128
    python scripts/time_kernels.py --block-size 16 --local-blocks 64
    python scripts/time_kernels.py --kv-heads 8 --group-pattern
"""

import argparse
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

import s2attn
from s2attn import local_stride_pattern

ap = argparse.ArgumentParser()
ap.add_argument("--seq", type=int, default=32768)
ap.add_argument("--strides", default="16,64")
ap.add_argument("--dim", type=int, default=128)
ap.add_argument("--kv-heads", type=int, default=32)
ap.add_argument(
    "--group-pattern",
    action="store_true",
    help="one pattern per KV group (local_stride_pattern's num_kv_heads, as bench_attention's GQA "
    "case builds it) rather than one per query head",
)
ap.add_argument("--calls", type=int, default=3)
ap.add_argument("--block-size", type=int, default=64)
ap.add_argument("--local-blocks", type=int, default=16)
ap.add_argument("--trace", help="write each profile as a Chrome trace, PREFIX_<stride>.json")
args = ap.parse_args()


def time_step(stride: int) -> tuple[dict[str, float], float]:
    """(ms per fwd+bwd of each kernel, ms per fwd+bwd between CUDA events)."""
    p = local_stride_pattern(
        32,
        max_seq_len=args.seq,
        block_size=args.block_size,
        local_blocks=args.local_blocks,
        vert_stride=stride,
        num_kv_heads=args.kv_heads if args.group_pattern else None,
    )
    q, k, v = (
        torch.randn(
            1, args.seq, heads, args.dim, device="cuda", dtype=torch.bfloat16, requires_grad=True
        )
        for heads in (32, args.kv_heads, args.kv_heads)
    )
    g = torch.randn_like(q)

    def step():
        q.grad = k.grad = v.grad = None  # no gradient accumulation kernels in the profile
        s2attn.sparse_attention(q, k, v, p).backward(g)

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(args.calls):
            step()
        torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(args.calls):
        step()
    end.record()
    torch.cuda.synchronize()
    if args.trace:
        prof.export_chrome_trace(f"{args.trace}_{stride}.json")
    per_kernel = defaultdict(float)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            per_kernel[ev.name[:60]] += ev.device_time / 1e3 / args.calls
    return per_kernel, start.elapsed_time(end) / args.calls


print(torch.cuda.get_device_name(), torch.__version__, s2attn.__file__)
for stride in (int(s) for s in args.strides.split(",")):
    per_kernel, wall = time_step(stride)
    total = sum(per_kernel.values())
    print(
        f"\nseq {args.seq} V{stride} dim {args.dim} block {args.block_size}: {total:.3f} ms of "
        f"kernels per fwd+bwd, {wall:.3f} ms between events (gaps: {wall - total:.3f})"
    )
    for name, ms in sorted(per_kernel.items(), key=lambda kv: -kv[1]):
        if ms > 0.01:
            print(f"  {ms:8.3f} ms  {name}")
    torch.cuda.empty_cache()
