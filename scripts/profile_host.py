"""Host-side profile of sparse_attention's calls: the host time per call, then cProfile's table
of where it goes, for the forward or with --backward one forward+backward per call, at 8k (where
host time can exceed kernel time). V16, batch 1, 32 heads, dim 128, bf16.

    python scripts/profile_host.py --backward --sort cumulative
"""

import argparse
import cProfile
import pstats
import sys
from pathlib import Path

import torch

import s2attn
from s2attn import local_stride_pattern

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from run_info import host_ms  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--backward", action="store_true")
ap.add_argument("--seq", type=int, default=8192)
ap.add_argument("--sort", default="tottime", help="pstats key: tottime, cumulative")
args = ap.parse_args()
p = local_stride_pattern(32, args.seq, 64, 16, 16)
q, k, v = (
    torch.randn(
        1, args.seq, 32, 128, device="cuda", dtype=torch.bfloat16, requires_grad=args.backward
    )
    for _ in range(3)
)
g = torch.randn_like(q)


def call():
    out = s2attn.sparse_attention(q, k, v, p)
    if args.backward:
        torch.autograd.grad(out, (q, k, v), g)


host = host_ms(call, 50)
print(f"host time per call: {host:.3f} ms (returns before the GPU is done unless it syncs)")
prof = cProfile.Profile()
prof.enable()
for _ in range(100):
    call()
prof.disable()
torch.cuda.synchronize()
pstats.Stats(prof).sort_stats(args.sort).print_stats(40)
