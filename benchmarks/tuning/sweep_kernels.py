"""Kernel variants of the forward, dK/dV and dQ passes on one shape: each is first checked
against the float32 reference at 2k tokens, then timed at --seq. Variants differ in tile shape,
warps, pipeline depth, bulk tensor copies (USE_TMA) and, for the forward, walking two entries a
step (PAIR). Compilation runs in parallel worker processes first, so the device time goes to
timing. Prints one line per variant and a summary table last.

Drives the kernel launchers in ``s2attn.ops`` directly, with the internal names of commit 06a44cd
(``launch_options``, ``pattern_head_div``): it follows them when they change.

    python benchmarks/tuning/sweep_kernels.py --seq 32768 --stride 16 --passes fwd,dkdv,dq
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

import torch
import triton

from s2attn import attention_reference, local_stride_pattern
from s2attn.layout import backward_layout, forward_layout
from s2attn.ops import backward as bwd
from s2attn.ops import forward as fwd

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for run_info
from run_info import sweep_arguments  # noqa: E402


def _v(block_m: int, block_n: int, warps: int, stages: int, **options) -> tuple:
    return block_m, block_n, dict(num_warps=warps, num_stages=stages, **options)


# name: (block_m, block_n, options); options go to the launcher as launch_options. G is
# HEADS_PER_GROUP (32: every head's tiles side by side, the order before 2026-11-22); "tma" uses
# host-made descriptors unless "dev" (made per program).
def _t(block_m: int, block_n: int, warps: int, stages: int, **options) -> tuple:
    """A variant of a Triton kernel, never the Gluon one that sm_90 runs by default."""
    return _v(block_m, block_n, warps, stages, IMPL="triton", **options)


FWD = {
    # The Gluon forward (ops/forward_hopper.py): ring slots (nb), entries per step (e2: 128 keys),
    # "flat": one program per work item (else one per SM).
    "gluon nb3": (128, 64, {"num_buffers": 3}),
    "gluon nb4": (128, 64, {"num_buffers": 4}),
    "gluon nb3 q-smem": (128, 64, {"num_buffers": 3, "q_in_regs": False}),
    "gluon nb4 flat": (128, 64, {"num_buffers": 4, "persistent": False}),
    "gluon e2 nb2": (128, 64, {"entries_per_step": 2, "num_buffers": 2, "q_in_regs": False}),
    # dim 64 only (shared memory):
    "gluon d64 nb6": (128, 64, {"num_buffers": 6, "entries_per_step": 1}),
    "gluon d64 e2 nb3": (128, 64, {"entries_per_step": 2, "num_buffers": 3}),
    "gluon d64 e2 nb4": (128, 64, {"entries_per_step": 2, "num_buffers": 4}),
    "gluon d64 e2 nb5": (128, 64, {"entries_per_step": 2, "num_buffers": 5}),
    "gluon d64 e2 nb2": (128, 64, {"entries_per_step": 2, "num_buffers": 2}),
    "gluon d64 e2 nb3 q-smem": (
        128, 64, {"entries_per_step": 2, "num_buffers": 3, "q_in_regs": False}
    ),
    "gluon d64 nb4": (128, 64, {"num_buffers": 4, "entries_per_step": 1}),
    "ptr 128x64 w4s2 G32": _t(128, 64, 4, 2, USE_TMA=False, HEADS_PER_GROUP=32),
    "ptr 128x64 w4s2 G1": _t(128, 64, 4, 2, USE_TMA=False, HEADS_PER_GROUP=1),
    "tma-dev 128x64 w4s2 G32": _t(128, 64, 4, 2, HOST_DESC=False, HEADS_PER_GROUP=32),
    "tma-dev 128x64 w4s2 G1": _t(128, 64, 4, 2, HOST_DESC=False, HEADS_PER_GROUP=1),
    "tma-dev 128x64 w4s2 G4": _t(128, 64, 4, 2, HOST_DESC=False, HEADS_PER_GROUP=4),
    "tma 128x64 w4s2 G1": _t(128, 64, 4, 2, HEADS_PER_GROUP=1),
    "tma 128x64 w4s2 G4": _t(128, 64, 4, 2, HEADS_PER_GROUP=4),
    "tma+qreg 128x64 w4s2 G1": _t(128, 64, 4, 2, Q_IN_REGS=True),
    "tma 128x64 w8s2 G1": _t(128, 64, 8, 2),
    "tma 128x64 w4s3 G1": _t(128, 64, 4, 3),
    "pair 128x64 w8s2 G1": _t(128, 64, 8, 2, USE_TMA=False, PAIR=True),
    "tma 64x64 w4s2 G1": _t(64, 64, 4, 2),
}
DKDV = {
    # The Gluon dK/dV (ops/backward_hopper.py): ring slots per stream (nb), (batch, KV head)
    # pairs per group of the item order (G; default: chosen from the lists' lengths).
    "gluon nb2": (64, 64, {"num_buffers": 2}),
    "gluon nb2 G1": (64, 64, {"num_buffers": 2, "heads_per_group": 1}),
    "gluon nb2 G2": (64, 64, {"num_buffers": 2, "heads_per_group": 2}),
    "gluon nb2 G4": (64, 64, {"num_buffers": 2, "heads_per_group": 4}),
    "gluon nb2 G32": (64, 64, {"num_buffers": 2, "heads_per_group": 32}),
    "gluon d64 nb4": (64, 64, {"num_buffers": 4}),
    "ptr 64x64 w4s2 G32": _t(64, 64, 4, 2, USE_TMA=False, HEADS_PER_GROUP=32),
    "ptr 64x64 w4s2 G1": _t(64, 64, 4, 2, USE_TMA=False, HEADS_PER_GROUP=1),
    "tma 64x64 w4s2 G1": _t(64, 64, 4, 2, HEADS_PER_GROUP=1),
    "tma 64x64 w4s2 G4": _t(64, 64, 4, 2, HEADS_PER_GROUP=4),
    "tma 64x64 w8s2 G1": _t(64, 64, 8, 2, HEADS_PER_GROUP=1),
    "tma+areg 64x64 w4s2 G4": _t(64, 64, 4, 2, A_IN_REGS=True, HEADS_PER_GROUP=4),
}
DQ = {
    # The Gluon dQ (ops/backward_hopper.py), on the forward's 128x64 tiles; "flat": one program
    # per work item.
    "gluon nb2": (128, 64, {"num_buffers": 2}),
    "gluon nb3": (128, 64, {"num_buffers": 3}),
    "gluon nb4": (128, 64, {"num_buffers": 4}),
    "gluon nb2 flat": (128, 64, {"num_buffers": 2, "persistent": False}),
    "ptr 64x64 w4s2 G32": _v(64, 64, 4, 2, USE_TMA=False, HEADS_PER_GROUP=32),
    "ptr 64x64 w4s2 G1": _v(64, 64, 4, 2, USE_TMA=False, HEADS_PER_GROUP=1),
    "tma 64x64 w4s2 G1": _v(64, 64, 4, 2, HEADS_PER_GROUP=1),
    "tma 64x64 w4s2 G4": _v(64, 64, 4, 2, HEADS_PER_GROUP=4),
    "tma 128x64 w8s2 G1": _v(128, 64, 8, 2, HEADS_PER_GROUP=1),
    "tma+areg 64x64 w4s2 G1": _v(64, 64, 4, 2, A_IN_REGS=True, HEADS_PER_GROUP=1),
}
# The other backward kernel's configuration while one is varied (the current defaults).
FIXED_DKDV = DKDV["ptr 64x64 w4s2 G32"]
FIXED_DQ = DQ["ptr 64x64 w4s2 G32"]


class Problem:
    def __init__(self, seq, heads, dim, block, local, stride, dtype=torch.bfloat16, seed=0):
        torch.manual_seed(seed)
        self.seq, self.dim = seq, dim
        self.pattern = local_stride_pattern(heads, seq, block, local, stride)
        self.q, self.k, self.v, self.g = (
            torch.randn(1, seq, heads, dim, device="cuda", dtype=dtype) for _ in range(4)
        )
        self.scale = dim**-0.5
        self.flops = 4 * dim * self.pattern.kept_token_pairs(seq)
        self.out, self.lse = self.forward("tma 128x64 w4s2 G1")

    def forward(self, name):
        bm, bn, opts = FWD[name]
        lay = forward_layout(self.pattern, bm, bn, self.q.device, gather=True)
        return fwd.forward(
            self.q, self.k, self.v, lay, softmax_scale=self.scale, pattern_head_div=1,
            launch_options=opts,
        )  # fmt: skip

    def backward(self, dkdv, dq):
        (km, kn, kopts), (qm, qn, qopts) = dkdv, dq
        lay_kv = backward_layout(
            self.pattern, km, kn, self.q.device, self.seq // self.pattern.block_size
        )
        lay_q = forward_layout(self.pattern, qm, qn, self.q.device)
        return bwd.backward(
            self.g, self.q, self.k, self.v, self.out, self.lse, None, lay_kv, lay_q,
            softmax_scale=self.scale, pattern_head_div=1, launch_options=(kopts, qopts),
        )  # fmt: skip

    def run(self, pass_name, name):
        if pass_name == "fwd":
            return lambda: self.forward(name)
        if pass_name == "dkdv":
            return lambda: self.backward(DKDV[name], FIXED_DQ)
        return lambda: self.backward(FIXED_DKDV, DQ[name])


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _reference(p: Problem):
    q, k, v = (t.float().requires_grad_() for t in (p.q, p.k, p.v))
    out, lse = attention_reference(q, k, v, p.pattern, return_lse=True)
    out.backward(p.g.float())
    return out.detach(), lse.detach(), q.grad, k.grad, v.grad


def _check_all(jobs, args):
    """Run every (pass, name) on a 2k problem against the reference: compiles, and checks."""
    p = Problem(2048, args.heads, args.dim, args.block_size, args.local_blocks, args.stride)
    ref = _reference(p)
    results = {}
    for pass_name, name in jobs:
        try:
            got = p.run(pass_name, name)()
            torch.cuda.synchronize()
            if pass_name == "fwd":
                err = max(_rel(got[0], ref[0]), _rel(got[1], ref[1]))
            else:
                err = max(_rel(g, r) for g, r in zip(got, ref[2:]))
            results[(pass_name, name)] = f"{err:.1e}"
        except Exception as exc:  # out of shared memory / registers, or a compile error
            results[(pass_name, name)] = f"FAIL {type(exc).__name__}: {str(exc)[:100]}"
    return results


def _worker(jobs, args):
    return _check_all(jobs, args)


def main() -> None:
    ap = sweep_arguments(argparse.ArgumentParser(description=__doc__))
    ap.add_argument("--only", default="", help="comma-separated substrings of variant names")
    ap.add_argument("--workers", type=int, default=min(12, os.cpu_count() or 1))
    ap.add_argument("--fixed-dkdv", default="ptr 64x64 w4s2 G32", help="dK/dV variant for dq rows")
    ap.add_argument("--fixed-dq", default="ptr 64x64 w4s2 G32", help="dQ variant for dkdv rows")
    args = ap.parse_args()
    global FIXED_DKDV, FIXED_DQ
    FIXED_DKDV, FIXED_DQ = DKDV[args.fixed_dkdv], DQ[args.fixed_dq]
    tables = {"fwd": FWD, "dkdv": DKDV, "dq": DQ}
    only = [s for s in args.only.split(",") if s]
    jobs = [
        (pname, name)
        for pname in args.passes.split(",")
        for name in tables[pname]
        if not only or any(s in name for s in only)
    ]
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}")
    t0 = time.time()
    # Compile (and check) in parallel: each worker takes every n-th job.
    ctx = mp.get_context("spawn")
    n = max(1, min(args.workers, len(jobs)))
    with ctx.Pool(n) as pool:
        parts = pool.starmap(_worker, [(jobs[i::n], args) for i in range(n)])
    checks = {k: v for part in parts for k, v in part.items()}
    print(f"compiled and checked {len(jobs)} variants in {time.time() - t0:.0f} s", flush=True)

    p = Problem(args.seq, args.heads, args.dim, args.block_size, args.local_blocks, args.stride)
    print(
        f"seq {args.seq} heads {args.heads} dim {args.dim} block {args.block_size} "
        f"local {args.local_blocks} stride {args.stride} density {p.pattern.density(args.seq):.4f}",
        flush=True,
    )
    rows = []
    for pass_name, name in jobs:
        check = checks[(pass_name, name)]
        if check.startswith("FAIL"):
            rows.append((pass_name, name, float("inf"), 0.0, check))
            print(f"{pass_name:5s} {name:22s} {check}", flush=True)
            continue
        fn = p.run(pass_name, name)
        ms = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
        work = p.flops * (1.0 if pass_name == "fwd" else 2.5)
        rows.append((pass_name, name, ms, work / ms / 1e9, check))
        print(
            f"{pass_name:5s} {name:22s} {ms:8.3f} ms {work / ms / 1e9:6.0f} TF/s err {check}",
            flush=True,
        )
    # Time the forward variants a second time: the spread between the two is the noise.
    again = {}
    for pass_name, name in jobs:
        if pass_name == "fwd" and not checks[(pass_name, name)].startswith("FAIL"):
            again[name] = triton.testing.do_bench(
                p.run("fwd", name), warmup=25, rep=100, return_mode="median"
            )
    print("\npass  variant                      ms   TF/s  rel.err (2k vs fp32)  [fwd: 2nd timing]")
    for pass_name, name, ms, tf, check in rows:
        second = f"  [{again[name]:.3f}]" if pass_name == "fwd" and name in again else ""
        print(f"{pass_name:5s} {name:22s} {ms:8.3f} {tf:6.0f}  {check}{second}")
    print("(dkdv rows: whole backward with dQ fixed at", FIXED_DQ, "; dq rows: dK/dV fixed at",
          FIXED_DKDV, "; TF/s counts 2.5x the forward FLOPs)")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
