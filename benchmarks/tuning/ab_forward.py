"""A/B of the forward (or forward+backward) between this tree's s2attn and another copy of the
package, the way docs/design.md compares two trees.

Imports both in one process (the other as ``s2attn_base``, a copy of an older tree's s2attn/
directory; the package uses relative imports only) and times them in alternating rounds, so
that clock and host drift fall on both alike. The forward (with --backward, forward+backward),
batch 1, 32 heads, bf16, causal. The cases: --cases seq:dim:stride[:block],... (local 16 blocks,
block 64 unless given; blocks 16 and 32 take the Triton kernels), or --suite extras for
bench_attention.py's (head dim 64, blocks 16 and 32, GQA 32/8, dense); --varlen packs each case's
tokens as four sequences of unequal lengths, none a multiple of the block (the varlen path).
do_bench medians in ms, or with --host the host's time per call in ms.

    git archive HEAD s2attn | tar -x -C /tmp/base && mv /tmp/base/s2attn /tmp/base/s2attn_base
    PYTHONPATH=/tmp/base python benchmarks/tuning/ab_forward.py --rounds 3
    PYTHONPATH=/tmp/base python benchmarks/tuning/ab_forward.py --suite extras --seqs 8192,32768
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
from bench_attention import Case, cases
from run_info import host_ms

ap = argparse.ArgumentParser()
ap.add_argument(
    "--cases",
    default="131072:128:16,131072:128:64,32768:128:16,32768:128:64,32768:64:16,32768:64:64,8192:128:16,8192:64:16",
)
ap.add_argument(
    "--suite",
    choices=("main", "extras"),
    help="bench_attention.py's cases at --seqs, instead of --cases",
)
ap.add_argument("--seqs", default="8192,32768,131072", help="with --suite")
ap.add_argument("--rounds", type=int, default=3)
ap.add_argument("--backward", action="store_true", help="time forward+backward")
ap.add_argument(
    "--host",
    action="store_true",
    help="time the host per call (run_info.host_ms) rather than the GPU (do_bench)",
)
ap.add_argument(
    "--varlen",
    action="store_true",
    help="each case's tokens as four packed sequences (cu_seqlens) of unequal lengths",
)
args = ap.parse_args()
if s2attn_base is None:
    sys.exit("ab_forward.py compares with s2attn_base, a copy of another tree: see its docstring")
print(torch.cuda.get_device_name(), torch.__version__, triton.__version__)


def _packed_lengths(seq: int) -> list[int]:
    """Four lengths summing to seq, longest first, none a multiple of 64."""
    lengths = [seq // 2 - 37, seq // 4 + 11, seq // 8 + 29]
    return lengths + [seq - sum(lengths)]


def _time(lib, q, k, v, pattern):
    kwargs = {}
    if args.varlen:
        lengths = torch.tensor([0] + _packed_lengths(q.shape[1]), device=q.device)
        cu = lengths.cumsum(0).to(torch.int32)
        kwargs = dict(cu_seqlens_q=cu, cu_seqlens_k=cu)
        q, k, v = (t[0] for t in (q, k, v))
    if args.backward:
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        grad = torch.randn_like(q)

        def fn():
            q.grad = k.grad = v.grad = None  # no accumulation kernels
            lib.sparse_attention(q, k, v, pattern, **kwargs).backward(grad)

    else:

        def fn():
            lib.sparse_attention(q, k, v, pattern, **kwargs)

    fn()
    if args.host:
        return host_ms(fn, 100)
    return triton.testing.do_bench(
        fn, warmup=25, rep=200, return_mode="median", grad_to_none=[q, k, v]
    )


def _fmt(xs):
    return " ".join(f"{x:.3f}" for x in xs)


def _case(text):
    seq, dim, stride, block = (int(x) for x in (text + ":64").split(":")[:4])
    name = f"V{stride} dim{dim}" + (f" block{block}" if block != 64 else "")
    return Case(name, seq, dim=dim, block=block, vert_stride=stride)


if args.suite:
    selected = cases(args.suite, [int(s) for s in args.seqs.split(",")])
else:
    selected = [_case(c) for c in args.cases.split(",")]
times = {(c, name): [] for c in selected for name in ("base", "new")}
for rnd in range(args.rounds):
    for c in selected:
        q = torch.randn(1, c.seq, c.heads, c.dim, device="cuda", dtype=torch.bfloat16)
        k, v = (
            torch.randn(1, c.seq, c.kv_heads, c.dim, device="cuda", dtype=torch.bfloat16)
            for _ in range(2)
        )
        for name, lib in (("base", s2attn_base), ("new", s2attn))[:: 1 if rnd % 2 == 0 else -1]:
            times[c, name].append(_time(lib, q, k, v, c.pattern(lib)))
print(f"{'case':>18} {'seq':>7} {'base ms':>24} {'new ms':>24} {'new/base':>8}")
for c in selected:
    b, n = times[c, "base"], times[c, "new"]
    ratio = statistics.median(n) / statistics.median(b)
    name = c.name + (" varlen" if args.varlen else "")
    print(f"{name:>18} {c.seq:>7} {_fmt(b):>24} {_fmt(n):>24} {ratio:8.3f}")
