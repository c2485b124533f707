"""CPU attention time: s2attn's CPU path (no Triton interpreter) against dense SDPA, forward and
forward+backward, at 1 and 2 threads, alone and beside a CPU-bound process it starts itself.

The shape is the README Quick start's, scaled up: batch 2 x 8192 tokens x 32 heads x head dim
128, float32, causal; pattern block 64, an 8-block local window and every 8th block, heads
staggered. Each row times one forward+backward step of each provider: the forward column is
that step's forward call, the forward+backward column the whole step. The median of
``--repeats`` steps is reported, with the host's load average read before the row starts.

    python benchmarks/bench_cpu.py --smoke        # a small shape, seconds
    python benchmarks/bench_cpu.py                # the full shape: about 20 minutes on 2 cores
    python benchmarks/bench_cpu.py --repeats 1    # about 7 minutes
    python benchmarks/bench_cpu.py --repeats 1 --threads 2 --competing off

Prints a table and writes markdown and JSON with the host, versions and date to
benchmarks/results/.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

import torch
from run_info import (
    environment,
    finish,
    heading,
    host_line,
    host_load,
    load_text,
    parser,
    result_stem,
    table,
    write_results,
)

import s2attn
from s2attn.ops import env as ops_env

PROVIDERS = ("s2attn", "sdpa")
# A core's worth of work that never ends, for the rows that share the host with one.
_SPIN = "while True:\n    pass\n"


@dataclass(frozen=True)
class Shape:
    batch: int
    seq: int
    heads: int
    dim: int
    block_size: int
    local_blocks: int
    vert_stride: int


FULL = Shape(2, 8192, 32, 128, 64, 8, 8)
SMOKE = Shape(1, 1024, 4, 64, 64, 4, 4)


@dataclass
class Row:
    provider: str
    threads: int
    competing: bool
    fwd_s: float
    fwd_bwd_s: float
    fwd_runs: list[float]
    fwd_bwd_runs: list[float]
    load_before: dict


def step(provider: str, q, k, v, grad, pattern) -> tuple[float, float]:
    """Seconds of one step's forward call and of the whole forward+backward step."""
    for t in (q, k, v):
        t.grad = None
    begin = time.perf_counter()
    if provider == "s2attn":
        out = s2attn.sparse_attention(q, k, v, pattern)
    else:
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        ).transpose(1, 2)
    forward = time.perf_counter()
    out.backward(grad)
    end = time.perf_counter()
    return forward - begin, end - begin


def run_row(provider, threads, competing, shape, pattern, repeats) -> Row:
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)
    q, k, v, grad = (
        torch.randn(shape.batch, shape.seq, shape.heads, shape.dim, generator=gen) for _ in range(4)
    )
    for t in (q, k, v):
        t.requires_grad_()
    load = host_load()
    spinner = subprocess.Popen([sys.executable, "-c", _SPIN]) if competing else None
    try:
        runs = [step(provider, q, k, v, grad, pattern) for _ in range(repeats)]
    finally:
        if spinner is not None:
            spinner.kill()
            spinner.wait()
    fwd, total = [r[0] for r in runs], [r[1] for r in runs]
    return Row(
        provider,
        threads,
        competing,
        statistics.median(fwd),
        statistics.median(total),
        fwd,
        total,
        load,
    )


def markdown(rows: list[Row], env: dict, shape: Shape, density: float) -> str:
    lines = heading(
        "CPU attention, s2attn's CPU path against dense SDPA",
        env,
        f"batch {shape.batch} x {shape.seq} tokens x {shape.heads} heads x head dim {shape.dim}, "
        f"float32, causal; pattern block {shape.block_size}, local_blocks {shape.local_blocks}, "
        f"vert_stride {shape.vert_stride} (density {density:.3f} of causal dense). Median "
        "seconds of the steps; the forward is the forward call of a forward+backward step. "
        "'competing': a CPU-bound process the benchmark started ran beside the row. "
        + host_line(env),
    )
    dense = {(r.threads, r.competing): r for r in rows if r.provider == "sdpa"}
    body = []
    for r in rows:
        ref = dense.get((r.threads, r.competing))
        ratio = lambda mine, theirs: f"{theirs / mine:.2f}x" if ref and r is not ref else ""
        body.append(
            [
                r.provider,
                r.threads,
                "yes" if r.competing else "no",
                f"{r.fwd_s:.2f}",
                ratio(r.fwd_s, ref.fwd_s if ref else 0),
                f"{r.fwd_bwd_s:.2f}",
                ratio(r.fwd_bwd_s, ref.fwd_bwd_s if ref else 0),
                load_text(r.load_before),
            ]
        )
    header = [
        "provider",
        "threads",
        "competing",
        "fwd s",
        "vs SDPA",
        "fwd+bwd s",
        "vs SDPA",
        "host before the row",
    ]
    return "\n".join(lines + table(header, body)) + "\n"


def main() -> int:
    ap = parser(__doc__)
    ap.add_argument("--smoke", action="store_true", help=f"the small shape {SMOKE}")
    ap.add_argument("--repeats", type=int, default=3, help="steps per row (default 3)")
    ap.add_argument("--threads", default="1,2", help="torch thread counts (default 1,2)")
    ap.add_argument(
        "--competing",
        choices=("off", "on", "both"),
        default="both",
        help="rows alone, beside a spinning process, or both (default)",
    )
    ap.add_argument("--providers", default=",".join(PROVIDERS))
    args = ap.parse_args()
    if ops_env.INTERPRETED:
        raise SystemExit("bench_cpu.py times the CPU path: unset TRITON_INTERPRET")
    if args.repeats < 1:
        raise SystemExit(f"--repeats must be at least 1, got {args.repeats}")
    shape = SMOKE if args.smoke else FULL
    pattern = s2attn.local_stride_pattern(
        shape.heads,
        max_seq_len=shape.seq,
        block_size=shape.block_size,
        local_blocks=shape.local_blocks,
        vert_stride=shape.vert_stride,
    )
    env = environment()
    env["host_load_start"] = host_load()
    print(f"{env['device']} · torch {env['torch']} · {env['date']}")
    print(host_line(env), flush=True)
    competing = {"off": [False], "on": [True], "both": [False, True]}[args.competing]
    rows = []
    for busy in competing:
        for threads in (int(t) for t in args.threads.split(",")):
            for provider in args.providers.split(","):
                row = run_row(provider, threads, busy, shape, pattern, args.repeats)
                print(
                    f"{provider:7} threads {threads} competing {busy!s:5}: fwd "
                    f"{row.fwd_s:.2f} s, fwd+bwd {row.fwd_bwd_s:.2f} s "
                    f"({load_text(row.load_before)} before)",
                    flush=True,
                )
                rows.append(row)
    finish(env)
    name = "attention_smoke" if args.smoke else "attention"
    write_results(
        args.out_dir,
        result_stem(env, name + args.tag),
        markdown(rows, env, shape, pattern.density(shape.seq)),
        dict(env=env, shape=asdict(shape), rows=[asdict(r) for r in rows]),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
