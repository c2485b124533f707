"""Sweep tile sizes, warps and pipeline depth of the forward, dK/dV and dQ kernels on one shape.

Prints one line per configuration (median ms of do_bench) and the best of each kernel, so the
defaults in s2attn/ops/forward.py and backward.py can be chosen from measurement.

Drives the kernel launchers in ``s2attn.ops`` directly, with the internal names of commit 06a44cd
(``launch_options``, ``pattern_head_div``): it follows them when they change.

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
from s2attn.layout import backward_layout, forward_layout
from s2attn.ops import backward as bwd
from s2attn.ops import forward as fwd

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for run_info
from run_info import sweep_arguments  # noqa: E402


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
    pattern = local_stride_pattern(h, s, args.block_size, args.local_blocks, args.stride)
    flops = 4 * d * pattern.kept_token_pairs(s)
    q, k, v, g = (torch.randn(1, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    scale = d**-0.5
    print(
        f"{torch.cuda.get_device_name()} seq {s} heads {h} dim {d} block {args.block_size} "
        f"stride {args.stride} density {pattern.density(s):.4f}",
        flush=True,
    )
    out, lse = fwd.forward(
        q, k, v, forward_layout(pattern, 128, 64, q.device), softmax_scale=scale, pattern_head_div=1
    )
    passes = args.passes.split(",")
    space = {
        "fwd": ([(64, 64), (128, 64), (128, 128), (64, 128)], (4, 8), (2, 3, 4)),
        "dkdv": ([(64, 64), (32, 64), (64, 128), (32, 128), (128, 64)], (4, 8), (2, 3)),
        "dq": ([(64, 64), (128, 64), (128, 32), (64, 32)], (4, 8), (2, 3)),
    }
    best = {}
    for name in passes:
        tiles, warps, stages = space[name]
        opts = [dict(num_warps=w, num_stages=st) for w, st in itertools.product(warps, stages)]
        for (bm, bn), o in itertools.product(tiles, opts):
            if name == "fwd":
                lay = forward_layout(pattern, bm, bn, q.device)
                fn = lambda: fwd.forward(
                    q,
                    k,
                    v,
                    lay,
                    softmax_scale=scale,
                    pattern_head_div=1,  # noqa: E731
                    launch_options=o,
                )
                work = flops
            else:
                if name == "dkdv":
                    lay_kv, lay_q = (
                        backward_layout(pattern, bm, bn, q.device, s // args.block_size),
                        forward_layout(pattern, 128, 64, q.device),
                    )
                    opts_pair = (o, dict(num_warps=8, num_stages=2))
                else:
                    lay_kv, lay_q = (
                        backward_layout(pattern, 64, 64, q.device, s // args.block_size),
                        forward_layout(pattern, bm, bn, q.device),
                    )
                    opts_pair = (dict(num_warps=8, num_stages=2), o)
                fn = lambda: bwd.backward(
                    g,
                    q,
                    k,
                    v,
                    out,
                    lse,
                    None,
                    lay_kv,
                    lay_q,  # noqa: E731
                    softmax_scale=scale,
                    pattern_head_div=1,
                    launch_options=opts_pair,
                )
                work = 2.5 * flops
            ms = bench(fn)
            print(
                f"{name:5s} bm {bm:3d} bn {bn:3d} warps {o['num_warps']} stages {o['num_stages']}: "
                f"{ms:8.3f} ms {work / ms / 1e9:6.0f} TF/s",
                flush=True,
            )
            if ms < best.get(name, (float("inf"),))[0]:
                best[name] = (ms, bm, bn, o)
    for name, (ms, bm, bn, o) in best.items():
        print(f"BEST {name}: {ms:.3f} ms bm {bm} bn {bn} {o}")


if __name__ == "__main__":
    main()
