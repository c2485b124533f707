"""Kernel time against the SM clock and power over a sustained run: calls one forward
(s2attn's, or cuDNN's dense causal one) back to back for --seconds, timing each with CUDA
events, while nvidia-smi samples the clock, power and throttle reasons every 100 ms. Prints both
as a time series, so a slowdown can be matched to a clock drop. Batch 1, 32 heads, bf16, causal,
block 64, local 16. Each call's time includes its host launch work (the loop synchronizes).

    python scripts/clock_trace.py --seq 131072 --dim 128 --stride 64 --seconds 6
    python scripts/clock_trace.py --seq 32768 --provider cudnn
"""

import argparse
import subprocess
import time

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention

import s2attn
from s2attn import local_stride_pattern

ap = argparse.ArgumentParser()
ap.add_argument("--seq", type=int, default=131072)
ap.add_argument("--dim", type=int, default=128)
ap.add_argument("--stride", type=int, default=64)
ap.add_argument("--seconds", type=float, default=6.0)
ap.add_argument("--idle", type=float, default=3.0, help="seconds idle first, to start cool")
ap.add_argument(
    "--provider",
    default="s2attn",
    choices=["s2attn", "cudnn"],
    help="cudnn: dense causal SDPA on the cuDNN backend, the ratio targets' peer",
)
args = ap.parse_args()
p = local_stride_pattern(
    32, max_seq_len=args.seq, block_size=64, local_blocks=16, vert_stride=args.stride
)
q, k, v = (
    torch.randn(1, args.seq, 32, args.dim, device="cuda", dtype=torch.bfloat16) for _ in range(3)
)


def call():
    if args.provider == "s2attn":
        return s2attn.sparse_attention(q, k, v, p)
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=True)


call()
torch.cuda.synchronize()
query = "timestamp,clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active"
smi = subprocess.Popen(
    ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader", "-lms", "100"],
    stdout=subprocess.PIPE,
    text=True,
)
time.sleep(args.idle)
t0 = time.time()
marks = []
while time.time() - t0 < args.seconds:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    call()
    end.record()
    end.synchronize()  # keeps host time stamps next to the GPU's (costs a launch gap per call)
    marks.append((time.time() - t0, start, end))
torch.cuda.synchronize()
time.sleep(0.3)
smi.terminate()
samples = smi.stdout.read().strip().splitlines()
case = f"V{args.stride}" if args.provider == "s2attn" else "dense causal (cuDNN)"
print(torch.cuda.get_device_name(), args.provider, f"seq {args.seq} dim {args.dim} {case}")
print("calls per 0.5 s window (ms between events):")
window = 0.5
for w in range(int(args.seconds / window) + 1):
    ms = [s.elapsed_time(e) for t, s, e in marks if w * window <= t < (w + 1) * window]
    if ms:
        ms.sort()
        span = f"{w * window:4.1f}-{(w + 1) * window:4.1f} s"
        print(f"  {span}: {len(ms):3d} calls, median {ms[len(ms) // 2]:.3f} ms, min {ms[0]:.3f}")
print("nvidia-smi (timestamp, SM MHz, W, C, reasons):")
for line in samples:
    print("  " + line)
