"""How much of a short call is host time: s2attn and cuDNN's dense SDPA, forward and
forward+backward, timed by do_bench as Python launches them and as CUDA-graph replays (the
kernels back to back). Batch 1, 32 heads, dim 128, bf16, causal, block 64, local 16; medians
in ms, and the cuDNN/s2attn ratio each way against 0.8/density.

    python scripts/graph_gap.py --cases 8192:16,8192:64
"""

import argparse

import torch
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

import s2attn
from s2attn import local_stride_pattern

ap = argparse.ArgumentParser()
ap.add_argument("--cases", default="8192:16,8192:64,32768:16,32768:64", help="seq:stride,...")
args = ap.parse_args()
print(torch.cuda.get_device_name(), torch.__version__, triton.__version__)


def cudnn(q, k, v, pattern):
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
    return out.transpose(1, 2)


def s2(q, k, v, pattern):
    return s2attn.sparse_attention(q, k, v, pattern)


def times(op, backward, q, k, v, pattern, g):
    def fn():
        out = op(q, k, v, pattern)
        if backward:
            torch.autograd.grad(out, (q, k, v), g)

    fn()
    eager = triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
    graph = triton.testing.do_bench_cudagraph(fn, rep=200, return_mode="median")
    return eager, graph


print(
    f"{'seq':>6} {'V':>3} {'pass':>8} {'s2 eager':>9} {'s2 graph':>9} {'cuDNN eager':>12} "
    f"{'cuDNN graph':>12} {'ratio eager':>12} {'ratio graph':>12} {'0.8/dens':>9}"
)
for case in args.cases.split(","):
    seq, stride = (int(x) for x in case.split(":"))
    pattern = local_stride_pattern(
        32, max_seq_len=seq, block_size=64, local_blocks=16, vert_stride=stride
    )
    target = 0.8 / pattern.density(seq)
    for backward in (False, True):
        q, k, v = (
            torch.randn(
                1, seq, 32, 128, device="cuda", dtype=torch.bfloat16, requires_grad=backward
            )
            for _ in range(3)
        )
        g = torch.randn_like(q)
        s2_e, s2_g = times(s2, backward, q, k, v, pattern, g)
        cu_e, cu_g = times(cudnn, backward, q, k, v, pattern, g)
        name = "fwd+bwd" if backward else "fwd"
        print(
            f"{seq:>6} {stride:>3} {name:>8} {s2_e:9.3f} {s2_g:9.3f} {cu_e:12.3f} {cu_g:12.3f} "
            f"{cu_e / s2_e:12.2f} {cu_g / s2_g:12.2f} {target:9.2f}"
        )
