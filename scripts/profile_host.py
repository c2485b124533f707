"""Host-side profile of sparse_attention's calls: the host time per call, then cProfile's table
of where it goes, for the forward or with --backward one forward+backward per call, at 8k (where
host time can exceed kernel time). V16, batch 1, 32 heads, dim 128, bf16.

On a GPU the calls run for real and the time is what the host spends enqueuing them. With
``--stub-launches`` (the default without a GPU) the Triton launchers are replaced by no-ops, so
what is left is s2attn's own Python and autograd's: the part that can be measured on any machine.

    python scripts/profile_host.py --backward --sort cumulative
    python scripts/profile_host.py --backward --stub-launches --seq 8192
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
from run_info import host_ms

ap = argparse.ArgumentParser()
ap.add_argument("--backward", action="store_true")
ap.add_argument("--seq", type=int, default=8192)
ap.add_argument("--sort", default="tottime", help="pstats key: tottime, cumulative")
ap.add_argument("--stub-launches", action="store_true", help="no kernels (default on a CPU)")
args = ap.parse_args()
device = "cuda" if torch.cuda.is_available() else "cpu"
if args.stub_launches or device == "cpu":
    # The kernels' host side is Triton's launcher; without them a call is s2attn's Python. Every
    # pass takes the Triton path, whose launchers are stubbed here: on an sm_90 GPU the Gluon
    # kernels would otherwise still launch.
    from s2attn.ops import backends, dispatch

    dispatch.supports_triton = lambda _: True
    backends.GLUON_ENABLED = False  # as S2ATTN_HOPPER_FORWARD=0
    for module, names in (
        (backends.triton_forward, ("forward",)),
        (backends.triton_backward, ("row_delta", "dkdv", "dq")),
    ):
        for name in names:
            setattr(module, name, lambda *_, **__: None)
p = local_stride_pattern(32, max_seq_len=args.seq, block_size=64, local_blocks=16, vert_stride=16)
q, k, v = (
    torch.randn(
        1, args.seq, 32, 128, device=device, dtype=torch.bfloat16, requires_grad=args.backward
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
if device == "cuda":
    torch.cuda.synchronize()
pstats.Stats(prof).sort_stats(args.sort).print_stats(40)
