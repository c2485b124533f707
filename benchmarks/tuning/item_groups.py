"""Per-kernel GPU time of the Gluon forward, dQ and dK/dV against how many heads' work items run
interleaved: ``heads_per_group`` 1 keeps one head's K/V in L2 at a time; more heads interleaved
let the last items taken be the lightest of all heads. Torch profiler kernel times, mean over
``--calls`` fwd+bwd calls, rounds alternating the groupings.

Drives ``s2attn.ops.dispatch`` directly (the layouts ``sparse_attention`` would take), setting
the groups through ``GluonForwardConfig``, ``GluonDqConfig`` and ``GluonDkdvConfig`` in the
``KernelOptions`` (``s2attn.ops.options``): it follows them when they change.

    python benchmarks/tuning/item_groups.py --cases 8192:16,8192:64,32768:16 --groups 1,4,32
    python benchmarks/tuning/item_groups.py --dkdv-groups auto,1,2,4,8
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from s2attn import local_stride_pattern
from s2attn.ops import dispatch
from s2attn.ops.layout import backward_layout, forward_layout
from s2attn.ops.options import GluonDkdvConfig, GluonDqConfig, GluonForwardConfig, KernelOptions

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for shapes
from shapes import BLOCK, HEADS, LOCAL_BLOCKS

KERNELS = ("_forward_kernel", "_dq_kernel", "_dkdv_kernel")


def options(group: int, dkdv_group: int | None) -> KernelOptions:
    """The forward and dQ work items interleaved ``group`` heads at a time; dK/dV's
    ``dkdv_group`` (batch, KV head) pairs at a time (None: the kernel's choice)."""
    return KernelOptions(
        gluon_forward=GluonForwardConfig(heads_per_group=group),
        gluon_dq=GluonDqConfig(heads_per_group=group),
        gluon_dkdv=GluonDkdvConfig(heads_per_group=dkdv_group),
    )


def fwd_bwd(q, k, v, g, pattern, options: KernelOptions):
    """One forward and backward on the layouts and tiles ``sparse_attention`` takes."""
    dev, dim, dtype = q.device, q.shape[-1], q.dtype
    scale, seq = dim**-0.5, q.shape[1]
    fwd_tiles = dispatch.forward_tile_sizes(dim, dtype, dev)
    dkdv_tiles, dq_tiles = dispatch.backward_tile_sizes(dim, dtype, dev)
    common = dict(softmax_scale=scale, q_heads_per_pattern_head=1, options=options)
    lay = forward_layout(pattern, *fwd_tiles, dev, gather=True)
    out, lse = dispatch.forward(q, k, v, lay, **common)
    num_blocks = seq // pattern.block_size
    lay_kv = backward_layout(pattern, *dkdv_tiles, dev, num_blocks, gather=True)
    lay_q = forward_layout(pattern, *dq_tiles, dev, gather=True)
    return dispatch.backward(g, q, k, v, out, lse, None, lay_kv, lay_q, **common)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="8192:16,8192:64,32768:16,32768:64", help="seq:stride,...")
    ap.add_argument("--groups", default="1,2,4,8,32", help="forward and dQ heads_per_group")
    ap.add_argument(
        "--dkdv-groups",
        default="auto",
        help="dK/dV heads_per_group (KV heads a group; 'auto': dkdv_order's choice), swept with "
        "the forward/dQ groups fixed at their first value when given as a list",
    )
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--calls", type=int, default=10)
    args = ap.parse_args()
    print(torch.cuda.get_device_name(), torch.__version__)

    dkdv_sweep = args.dkdv_groups != "auto"
    if dkdv_sweep:
        group = int(args.groups.split(",")[0])
        groups = [None if g == "auto" else int(g) for g in args.dkdv_groups.split(",")]
    else:
        groups = [int(g) for g in args.groups.split(",")]
    cases = [tuple(int(x) for x in c.split(":")) for c in args.cases.split(",")]
    times = defaultdict(list)
    for rnd in range(args.rounds):
        for seq, stride in cases:
            p = local_stride_pattern(
                HEADS,
                max_seq_len=seq,
                block_size=BLOCK,
                local_blocks=LOCAL_BLOCKS,
                vert_stride=stride,
            )
            q, k, v, g = (
                torch.randn(1, seq, HEADS, args.dim, device="cuda", dtype=torch.bfloat16)
                for _ in range(4)
            )
            for swept in groups if rnd % 2 == 0 else groups[::-1]:
                opts = options(group, swept) if dkdv_sweep else options(swept, None)
                fwd_bwd(q, k, v, g, p, opts)
                torch.cuda.synchronize()
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    for _ in range(args.calls):
                        fwd_bwd(q, k, v, g, p, opts)
                    torch.cuda.synchronize()
                for e in prof.key_averages():
                    if e.key in KERNELS:
                        ms = e.device_time_total / 1e3 / args.calls
                        times[(seq, stride, swept, e.key)].append(ms)
    print(f"{'seq':>6} {'V':>3} {'G':>4} {'forward ms':>22} {'dQ ms':>22} {'dK/dV ms':>22}")
    for seq, stride in cases:
        for swept in groups:
            row = [
                " ".join(f"{t:.3f}" for t in times[(seq, stride, swept, kernel)])
                for kernel in KERNELS
            ]
            name = "auto" if swept is None else swept
            print(f"{seq:>6} {stride:>3} {name:>4} {row[0]:>22} {row[1]:>22} {row[2]:>22}")


if __name__ == "__main__":
    main()
