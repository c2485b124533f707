"""A/B of the forward (or forward+backward) between this tree's s2attn and another copy of the
package: the A/B behind the "new/old" ratios of benchmarks/NOTES.md.

Imports both in one process (the other as ``s2attn_base``, a copy of an older tree's s2attn/
directory; the package uses relative imports only) and times them in alternating rounds, so
that clock and host drift fall on both alike. The forward (with --backward, forward+backward),
batch 1, 32 heads, bf16, causal, local 16 blocks; each case is seq:dim:stride[:block] (block 64
unless given; block 16 takes the Triton kernels); do_bench medians in ms, or with --host the
host's time per call in ms.

    git archive HEAD s2attn | tar -x -C /tmp/base && mv /tmp/base/s2attn /tmp/base/s2attn_base
    PYTHONPATH=/tmp/base python benchmarks/tuning/ab_forward.py --rounds 3
"""

import argparse
import statistics
import sys
from pathlib import Path

import torch
import triton

import s2attn

try:
    import s2attn_base
except ImportError:  # said after --help has had its say
    s2attn_base = None

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for run_info
from run_info import host_ms  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument(
    "--cases",
    default="131072:128:16,131072:128:64,32768:128:16,32768:128:64,32768:64:16,32768:64:64,8192:128:16,8192:64:16",
)
ap.add_argument("--rounds", type=int, default=3)
ap.add_argument("--backward", action="store_true", help="time forward+backward")
ap.add_argument(
    "--host",
    action="store_true",
    help="time the host per call (run_info.host_ms) rather than the GPU (do_bench)",
)
args = ap.parse_args()
if s2attn_base is None:
    sys.exit("ab_forward.py compares with s2attn_base, a copy of another tree: see its docstring")
print(torch.cuda.get_device_name(), torch.__version__, triton.__version__)


def _time(lib, q, k, v, pattern):
    if args.backward:
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        grad = torch.randn_like(q)

        def fn():
            q.grad = k.grad = v.grad = None  # no accumulation kernels
            lib.sparse_attention(q, k, v, pattern).backward(grad)

    else:

        def fn():
            lib.sparse_attention(q, k, v, pattern)

    fn()
    if args.host:
        return host_ms(fn, 100)
    return triton.testing.do_bench(
        fn, warmup=25, rep=200, return_mode="median", grad_to_none=[q, k, v]
    )


def _fmt(xs):
    return " ".join(f"{x:.3f}" for x in xs)


cases = [tuple(int(x) for x in (c + ":64").split(":")[:4]) for c in args.cases.split(",")]
times = {(c, name): [] for c in cases for name in ("base", "new")}
for rnd in range(args.rounds):
    for seq, dim, stride, block in cases:
        q, k, v = (
            torch.randn(1, seq, 32, dim, device="cuda", dtype=torch.bfloat16) for _ in range(3)
        )
        for name, lib in (("base", s2attn_base), ("new", s2attn))[:: 1 if rnd % 2 == 0 else -1]:
            p = lib.local_stride_pattern(32, seq, block, 16, stride)
            times[(seq, dim, stride, block), name].append(_time(lib, q, k, v, p))
print(f"{'seq':>7} {'dim':>4} {'V':>3} {'blk':>3} {'base ms':>24} {'new ms':>24} {'new/base':>8}")
for c in cases:
    b, n = times[c, "base"], times[c, "new"]
    ratio = statistics.median(n) / statistics.median(b)
    print(f"{c[0]:>7} {c[1]:>4} {c[2]:>3} {c[3]:>3} {_fmt(b):>24} {_fmt(n):>24} {ratio:8.3f}")
