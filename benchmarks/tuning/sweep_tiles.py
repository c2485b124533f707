"""Sweep tile sizes, warps and pipeline depth of the Triton forward, dK/dV and dQ kernels on one
shape.

Prints one line per configuration (median ms of do_bench) and the best of each kernel, so the
defaults of s2attn/ops/triton/forward.py and backward.py (``default_config``) and the tile sizes
of s2attn/ops/dispatch.py can be chosen from measurement. The swept pass runs the Triton kernel
(``KernelOptions`` pins it); in a backward row the other pass runs as ``sparse_attention`` runs
it, on its default tiles and backend.

Drives the passes in ``s2attn.ops.dispatch`` directly, with ``KernelOptions``
(``s2attn.ops.options``): it follows them when they change.

    python benchmarks/tuning/sweep_tiles.py --seq 32768 --stride 16
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch
import triton

from s2attn import local_stride_pattern
from s2attn.ops import dispatch
from s2attn.ops.layout import backward_layout, forward_layout
from s2attn.ops.options import KernelOptions, TritonBackwardConfig, TritonForwardConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for run_info
from run_info import sweep_arguments

# Per pass: the (block_m, block_n) tiles, warps and stages to try.
SPACE = {
    "fwd": ([(64, 64), (128, 64), (128, 128), (64, 128)], (4, 8), (2, 3, 4)),
    "dkdv": ([(64, 64), (32, 64), (64, 128), (32, 128), (128, 64)], (4, 8), (2, 3)),
    "dq": ([(64, 64), (128, 64), (128, 32), (64, 32)], (4, 8), (2, 3)),
}


def bench(fn) -> float:
    try:
        return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")
    except Exception as exc:  # out of shared memory / registers: report and go on
        print(f"    failed: {type(exc).__name__}: {str(exc)[:80]}", flush=True)
        return float("inf")


def main() -> None:
    ap = sweep_arguments(argparse.ArgumentParser(description=__doc__))
    args = ap.parse_args()
    s, h, d = args.seq, args.heads, args.dim
    pattern = local_stride_pattern(
        h,
        max_seq_len=s,
        block_size=args.block_size,
        local_blocks=args.local_blocks,
        vert_stride=args.stride,
    )
    flops = 4 * d * pattern.kept_token_pairs(s)
    q, k, v, g = (torch.randn(1, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    scale = d**-0.5
    dev = q.device
    print(
        f"{torch.cuda.get_device_name()} seq {s} heads {h} dim {d} block {args.block_size} "
        f"stride {args.stride} density {pattern.density(s):.4f}",
        flush=True,
    )
    num_blocks = s // args.block_size
    fwd_tiles = dispatch.forward_tile_sizes(d, q.dtype, dev)
    dkdv_tiles, dq_tiles = dispatch.backward_tile_sizes(d, q.dtype, dev)
    common = dict(softmax_scale=scale, q_heads_per_pattern_head=1)
    out, lse = dispatch.forward(q, k, v, forward_layout(pattern, *fwd_tiles, dev), **common)

    def backward(lay_kv, lay_q, options):
        return dispatch.backward(
            g, q, k, v, out, lse, None, lay_kv, lay_q, **common, options=options
        )

    best = {}
    for name in args.passes.split(","):
        tiles, warps, stages = SPACE[name]
        for (bm, bn), w, st in itertools.product(tiles, warps, stages):
            if name == "fwd":
                config = TritonForwardConfig(num_warps=w, num_stages=st)
                options = KernelOptions(forward_backend="triton", triton_forward=config)
                lay = forward_layout(pattern, bm, bn, dev)
                fn = lambda: dispatch.forward(q, k, v, lay, **common, options=options)
                work = flops
            else:
                config = TritonBackwardConfig(num_warps=w, num_stages=st)
                if name == "dkdv":
                    options = KernelOptions(dkdv_backend="triton", triton_dkdv=config)
                    lay_kv = backward_layout(pattern, bm, bn, dev, num_blocks)
                    lay_q = forward_layout(pattern, *dq_tiles, dev)
                else:
                    options = KernelOptions(dq_backend="triton", triton_dq=config)
                    lay_kv = backward_layout(pattern, *dkdv_tiles, dev, num_blocks)
                    lay_q = forward_layout(pattern, bm, bn, dev)
                fn = lambda: backward(lay_kv, lay_q, options)
                work = 2.5 * flops
            ms = bench(fn)
            print(
                f"{name:5s} bm {bm:3d} bn {bn:3d} warps {w} stages {st}: "
                f"{ms:8.3f} ms {work / ms / 1e9:6.0f} TF/s",
                flush=True,
            )
            if ms < best.get(name, (float("inf"),))[0]:
                best[name] = (ms, bm, bn, w, st)
    for name, (ms, bm, bn, w, st) in best.items():
        print(f"BEST {name}: {ms:.3f} ms bm {bm} bn {bn} warps {w} stages {st}")


if __name__ == "__main__":
    main()
