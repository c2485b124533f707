"""Kernel variants of the forward, dK/dV and dQ passes on one shape: each is first checked
against the float32 reference at 2k tokens, then timed at --seq. Variants differ in tile shape,
warps, pipeline depth, bulk tensor copies (use_tma) and, for the forward, walking two entries a
step (pair). Compilation runs in parallel worker processes first, so the device time goes to
timing. Prints one line per variant and a summary table last.

Drives the passes in ``s2attn.ops.dispatch`` directly, each variant a layout tile shape and a
``KernelOptions`` (``s2attn.ops.options``) that pins its backend and launch settings: it follows
them when they change.

    python benchmarks/tuning/sweep_kernels.py --seq 32768 --stride 16 --passes fwd,dkdv,dq
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import time
from dataclasses import replace
from functools import partial
from pathlib import Path

import torch
import triton

from s2attn import attention_reference, local_stride_pattern
from s2attn.ops import dispatch
from s2attn.ops.layout import backward_layout, forward_layout
from s2attn.ops.options import (
    GluonDkdvConfig,
    GluonDqConfig,
    GluonForwardConfig,
    KernelOptions,
    TritonBackwardConfig,
    TritonForwardConfig,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for run_info
from run_info import sweep_arguments

# A variant: (block_m, block_n, the KernelOptions of its pass). Gluon variants run where the
# Gluon kernel supports the call (sm_90, 128x64 forward and dQ tiles, 64x64 dK/dV tiles); Triton
# ones pin the Triton kernel. G is heads_per_group (32: every head's tiles side by side, the
# order before 2026-11-22); "ptr" turns bulk tensor copies off; "tma" uses host-made descriptors
# unless "dev" (made per program). Passes are named as KernelOptions names them.
_GLUON = {  # the Gluon kernel's tiles and settings
    "forward": (128, 64, GluonForwardConfig),
    "dkdv": (64, 64, GluonDkdvConfig),
    "dq": (128, 64, GluonDqConfig),
}


def _gluon(pass_name: str, **settings) -> tuple:
    block_m, block_n, config = _GLUON[pass_name]
    return block_m, block_n, KernelOptions(**{f"gluon_{pass_name}": config(**settings)})


def _triton(
    pass_name: str, block_m: int, block_n: int, warps: int, stages: int, **settings
) -> tuple:
    kind = TritonForwardConfig if pass_name == "forward" else TritonBackwardConfig
    config = kind(num_warps=warps, num_stages=stages, **settings)
    pinned = {f"{pass_name}_backend": "triton", f"triton_{pass_name}": config}
    return block_m, block_n, KernelOptions(**pinned)


_gluon_fwd, _triton_fwd = partial(_gluon, "forward"), partial(_triton, "forward")
_gluon_dkdv, _triton_dkdv = partial(_gluon, "dkdv"), partial(_triton, "dkdv")
_gluon_dq, _triton_dq = partial(_gluon, "dq"), partial(_triton, "dq")

FWD = {
    # The Gluon forward (ops/gluon/forward_sm90.py): ring slots (nb), entries per step (e2: 128
    # keys), "q-smem": q read from shared memory, "flat": one program per work item (else one
    # per SM).
    "gluon nb3": _gluon_fwd(num_buffers=3),
    "gluon nb4": _gluon_fwd(num_buffers=4),
    "gluon nb3 q-smem": _gluon_fwd(num_buffers=3, q_in_regs=False),
    "gluon nb4 flat": _gluon_fwd(num_buffers=4, persistent=False),
    "gluon e2 nb2": _gluon_fwd(entries_per_step=2, num_buffers=2, q_in_regs=False),
    # dim 64 only (shared memory):
    "gluon d64 nb6": _gluon_fwd(num_buffers=6, entries_per_step=1),
    "gluon d64 e2 nb3": _gluon_fwd(entries_per_step=2, num_buffers=3),
    "gluon d64 e2 nb4": _gluon_fwd(entries_per_step=2, num_buffers=4),
    "gluon d64 e2 nb5": _gluon_fwd(entries_per_step=2, num_buffers=5),
    "gluon d64 e2 nb2": _gluon_fwd(entries_per_step=2, num_buffers=2),
    "gluon d64 e2 nb3 q-smem": _gluon_fwd(entries_per_step=2, num_buffers=3, q_in_regs=False),
    "gluon d64 nb4": _gluon_fwd(num_buffers=4, entries_per_step=1),
    "ptr 128x64 w4s2 G32": _triton_fwd(128, 64, 4, 2, use_tma=False, heads_per_group=32),
    "ptr 128x64 w4s2 G1": _triton_fwd(128, 64, 4, 2, use_tma=False, heads_per_group=1),
    "tma-dev 128x64 w4s2 G32": _triton_fwd(128, 64, 4, 2, host_desc=False, heads_per_group=32),
    "tma-dev 128x64 w4s2 G1": _triton_fwd(128, 64, 4, 2, host_desc=False, heads_per_group=1),
    "tma-dev 128x64 w4s2 G4": _triton_fwd(128, 64, 4, 2, host_desc=False, heads_per_group=4),
    "tma 128x64 w4s2 G1": _triton_fwd(128, 64, 4, 2, heads_per_group=1),
    "tma 128x64 w4s2 G4": _triton_fwd(128, 64, 4, 2, heads_per_group=4),
    "tma+qreg 128x64 w4s2 G1": _triton_fwd(128, 64, 4, 2, q_in_regs=True, heads_per_group=1),
    "tma 128x64 w8s2 G1": _triton_fwd(128, 64, 8, 2, heads_per_group=1),
    "tma 128x64 w4s3 G1": _triton_fwd(128, 64, 4, 3, heads_per_group=1),
    "pair 128x64 w8s2 G1": _triton_fwd(128, 64, 8, 2, use_tma=False, pair=True, heads_per_group=1),
    "tma 64x64 w4s2 G1": _triton_fwd(64, 64, 4, 2, heads_per_group=1),
}
DKDV = {
    # The Gluon dK/dV (ops/gluon/backward_sm90.py): ring slots per stream (nb), (batch, KV head)
    # pairs per group of the item order (G; default: chosen from the lists' lengths).
    "gluon nb2": _gluon_dkdv(num_buffers=2),
    "gluon nb2 G1": _gluon_dkdv(num_buffers=2, heads_per_group=1),
    "gluon nb2 G2": _gluon_dkdv(num_buffers=2, heads_per_group=2),
    "gluon nb2 G4": _gluon_dkdv(num_buffers=2, heads_per_group=4),
    "gluon nb2 G32": _gluon_dkdv(num_buffers=2, heads_per_group=32),
    "gluon d64 nb4": _gluon_dkdv(num_buffers=4),
    "ptr 64x64 w4s2 G32": _triton_dkdv(64, 64, 4, 2, use_tma=False, heads_per_group=32),
    "ptr 64x64 w4s2 G1": _triton_dkdv(64, 64, 4, 2, use_tma=False, heads_per_group=1),
    "tma 64x64 w4s2 G1": _triton_dkdv(64, 64, 4, 2, heads_per_group=1),
    "tma 64x64 w4s2 G4": _triton_dkdv(64, 64, 4, 2, heads_per_group=4),
    "tma 64x64 w8s2 G1": _triton_dkdv(64, 64, 8, 2, heads_per_group=1),
    "tma+areg 64x64 w4s2 G4": _triton_dkdv(64, 64, 4, 2, a_in_regs=True, heads_per_group=4),
}
DQ = {
    # The Gluon dQ (ops/gluon/backward_sm90.py), on the forward's 128x64 tiles; "flat": one
    # program per work item.
    "gluon nb2": _gluon_dq(num_buffers=2),
    "gluon nb3": _gluon_dq(num_buffers=3),
    "gluon nb4": _gluon_dq(num_buffers=4),
    "gluon nb2 flat": _gluon_dq(num_buffers=2, persistent=False),
    "ptr 64x64 w4s2 G32": _triton_dq(64, 64, 4, 2, use_tma=False, heads_per_group=32),
    "ptr 64x64 w4s2 G1": _triton_dq(64, 64, 4, 2, use_tma=False, heads_per_group=1),
    "tma 64x64 w4s2 G1": _triton_dq(64, 64, 4, 2, heads_per_group=1),
    "tma 64x64 w4s2 G4": _triton_dq(64, 64, 4, 2, heads_per_group=4),
    "tma 128x64 w8s2 G1": _triton_dq(128, 64, 8, 2, heads_per_group=1),
    "tma+areg 64x64 w4s2 G1": _triton_dq(64, 64, 4, 2, a_in_regs=True, heads_per_group=1),
}
# The other backward kernel's variant while one is varied (--fixed-dkdv, --fixed-dq).
FIXED_DKDV = DKDV["ptr 64x64 w4s2 G32"]
FIXED_DQ = DQ["ptr 64x64 w4s2 G32"]


class Problem:
    def __init__(self, seq, heads, dim, block, local, stride, dtype=torch.bfloat16, seed=0):
        torch.manual_seed(seed)
        self.seq, self.dim = seq, dim
        self.pattern = local_stride_pattern(
            heads, max_seq_len=seq, block_size=block, local_blocks=local, vert_stride=stride
        )
        self.q, self.k, self.v, self.g = (
            torch.randn(1, seq, heads, dim, device="cuda", dtype=dtype) for _ in range(4)
        )
        self.scale = dim**-0.5
        self.flops = 4 * dim * self.pattern.kept_token_pairs(seq)
        self.out, self.lse = self.forward("tma 128x64 w4s2 G1")

    def forward(self, name):
        bm, bn, options = FWD[name]
        lay = forward_layout(self.pattern, bm, bn, self.q.device, gather=True)
        return dispatch.forward(
            self.q,
            self.k,
            self.v,
            lay,
            softmax_scale=self.scale,
            q_heads_per_pattern_head=1,
            options=options,
        )

    def backward(self, dkdv, dq):
        """One backward, dK/dV by the ``dkdv`` variant and dQ by the ``dq`` one."""
        (km, kn, dkdv_options), (qm, qn, dq_options) = dkdv, dq
        lay_kv = backward_layout(
            self.pattern, km, kn, self.q.device, self.seq // self.pattern.block_size
        )
        lay_q = forward_layout(self.pattern, qm, qn, self.q.device)
        options = replace(
            dkdv_options,
            dq_backend=dq_options.dq_backend,
            triton_dq=dq_options.triton_dq,
            gluon_dq=dq_options.gluon_dq,
        )
        return dispatch.backward(
            self.g,
            self.q,
            self.k,
            self.v,
            self.out,
            self.lse,
            None,
            lay_kv,
            lay_q,
            softmax_scale=self.scale,
            q_heads_per_pattern_head=1,
            options=options,
        )

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


def _fix_backward_variants(args) -> None:
    """Pin the pass that a dK/dV or dQ row does not sweep to the variants the flags name."""
    global FIXED_DKDV, FIXED_DQ
    FIXED_DKDV, FIXED_DQ = DKDV[args.fixed_dkdv], DQ[args.fixed_dq]


def _worker(jobs, args):
    _fix_backward_variants(args)  # a spawned worker starts from the module's defaults
    return _check_all(jobs, args)


def main() -> None:
    ap = sweep_arguments(argparse.ArgumentParser(description=__doc__))
    ap.add_argument("--only", default="", help="comma-separated substrings of variant names")
    ap.add_argument("--workers", type=int, default=min(12, os.cpu_count() or 1))
    ap.add_argument("--fixed-dkdv", default="ptr 64x64 w4s2 G32", help="dK/dV variant for dq rows")
    ap.add_argument("--fixed-dq", default="ptr 64x64 w4s2 G32", help="dQ variant for dkdv rows")
    args = ap.parse_args()
    _fix_backward_variants(args)
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
    print(
        f"(dkdv rows: whole backward with dQ fixed at {args.fixed_dq!r}; dq rows: dK/dV fixed at "
        f"{args.fixed_dkdv!r}; TF/s counts 2.5x the forward FLOPs)"
    )


if __name__ == "__main__":
    sys.exit(main())
