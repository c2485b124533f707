"""Per-kernel GPU time of the Gluon forward, dQ and dK/dV against how many heads' work items run
interleaved: ``heads_per_group`` 1 keeps one head's K/V in L2 at a time; more heads interleaved
let the last items taken be the lightest of all heads. Torch profiler kernel times, mean over
``--calls`` fwd+bwd calls, rounds alternating the groupings.

Drives s2attn.ops internals directly (names as of commit 06a44cd: it swaps
``forward.heads_per_program_group``, ``backward_hopper.dq_hopper`` and ``dkdv_hopper`` for
wrappers that set the groups): it follows them when they change.

    python benchmarks/tuning/item_groups.py --cases 8192:16,8192:64,32768:16 --groups 1,4,32
    python benchmarks/tuning/item_groups.py --dkdv-groups auto,1,2,4,8
"""

import argparse
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

import s2attn
from s2attn import local_stride_pattern
from s2attn.ops import backward_hopper, forward

ap = argparse.ArgumentParser()
ap.add_argument("--cases", default="8192:16,8192:64,32768:16,32768:64", help="seq:stride,...")
ap.add_argument("--groups", default="1,2,4,8,32", help="forward and dQ heads_per_group")
ap.add_argument(
    "--dkdv-groups", default="auto",
    help="dK/dV heads_per_group (KV heads a group; 'auto': dkdv_order's choice), swept with "
    "the forward/dQ groups fixed at their first value when given as a list",
)  # fmt: skip
ap.add_argument("--dim", type=int, default=128)
ap.add_argument("--rounds", type=int, default=3)
ap.add_argument("--calls", type=int, default=10)
args = ap.parse_args()
print(torch.cuda.get_device_name(), torch.__version__)

group, dkdv_group = 1, None
plain_groups, plain_dq = forward.heads_per_program_group, backward_hopper.dq_hopper
plain_dkdv = backward_hopper.dkdv_hopper
# The forward asks for groups of 1 (forward.py); dq_hopper and dkdv_hopper take them as an
# argument.
forward.heads_per_program_group = lambda num_bh, wanted: plain_groups(num_bh, group)
backward_hopper.dq_hopper = lambda *a, **kw: plain_dq(*a, **kw, heads_per_group=group)
backward_hopper.dkdv_hopper = lambda *a, **kw: plain_dkdv(*a, **kw, heads_per_group=dkdv_group)

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
        p = local_stride_pattern(32, seq, 64, 16, stride)
        q, k, v = (
            torch.randn(1, seq, 32, args.dim, device="cuda", dtype=torch.bfloat16,
                        requires_grad=True)
            for _ in range(3)
        )  # fmt: skip
        g = torch.randn_like(q)
        for swept in groups if rnd % 2 == 0 else groups[::-1]:
            if dkdv_sweep:
                dkdv_group = swept
            else:
                group = swept

            def step(q=q, k=k, v=v, p=p, g=g):
                q.grad = k.grad = v.grad = None
                s2attn.sparse_attention(q, k, v, p).backward(g)

            step()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(args.calls):
                    step()
                torch.cuda.synchronize()
            for e in prof.key_averages():
                for kernel in ("_forward_kernel", "_dq_kernel", "_dkdv_kernel"):
                    if e.key == kernel:
                        ms = e.device_time_total / 1e3 / args.calls
                        times[(seq, stride, swept, kernel)].append(ms)
print(f"{'seq':>6} {'V':>3} {'G':>4} {'forward ms':>22} {'dQ ms':>22} {'dK/dV ms':>22}")
for seq, stride in cases:
    for swept in groups:
        row = [
            " ".join(f"{t:.3f}" for t in times[(seq, stride, swept, kernel)])
            for kernel in ("_forward_kernel", "_dq_kernel", "_dkdv_kernel")
        ]
        name = "auto" if swept is None else swept
        print(f"{seq:>6} {stride:>3} {name:>4} {row[0]:>22} {row[1]:>22} {row[2]:>22}")
