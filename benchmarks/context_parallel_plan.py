"""Host cost of context parallelism's plan: each rank's receive plan, from its own chunks' rows.

A rank of ``context_parallel_attention`` plans from its two chunks' rows of the pattern alone (what
it reads, the compact keys of each chunk) and then exchanges its requests with the others (two
``all_to_all_single`` calls of a few integers a row, which this script leaves out). The plan is
built once per (pattern, length, world) and cached, so this is the first call's host cost. Each
rank's plan is built here in turn, in one process on the CPU, on a fresh pattern each time (no
cache): wall and CPU seconds, the busiest rank's first.

Pattern: ``local_stride_pattern(heads, block_size=64, local_blocks=16, vert_stride=stride,
num_kv_heads=kv_heads)``, causal, the ranks' chunks in the head-tail layout of ``shard``.

    python benchmarks/context_parallel_plan.py                 # W = 8, 32/8 heads, 1M and 4M
    python benchmarks/context_parallel_plan.py --world 4 --seqs 262144
"""

from __future__ import annotations

import resource
import sys
import time

from run_info import (
    environment,
    finish,
    heading,
    host_line,
    host_load,
    parser,
    result_stem,
    table,
    write_results,
)

import s2attn
from s2attn.distributed.plan import receive_plan


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--seqs", type=int, nargs="+", default=[1048576, 4194304])
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--stride", type=int, default=64)
    args = ap.parse_args()
    env = environment()
    env["host_load_start"] = host_load()
    print(f"{env['device']} · torch {env['torch']} · {env['date']}\n{host_line(env)}", flush=True)

    rows = []
    for seq in args.seqs:
        for rank in range(args.world):
            pattern = s2attn.local_stride_pattern(
                args.heads,
                max_seq_len=seq,
                block_size=64,
                local_blocks=16,
                vert_stride=args.stride,
                num_kv_heads=args.kv_heads,
            )
            t0, cpu0 = time.perf_counter(), time.process_time()
            # The plan's local part, as the rank's first call builds it (exchange_plan).
            plan = receive_plan(pattern, seq, args.world, rank, args.kv_heads)
            seconds, cpu_seconds = time.perf_counter() - t0, time.process_time() - cpu0
            row = dict(
                seq=seq,
                rank=rank,
                seconds=seconds,
                cpu_seconds=cpu_seconds,
                tokens_received=plan.tokens_received(),
                maxrss_gib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
            )
            rows.append(row)
            print(
                f"{seq:>8} tokens, rank {rank}: {seconds:.2f} s ({cpu_seconds:.2f} s CPU), "
                f"receives {row['tokens_received']:,} token rows",
                flush=True,
            )
    finish(env)

    def cells(seq: int) -> list:
        mine = [r for r in rows if r["seq"] == seq]
        busiest = max(mine, key=lambda r: r["tokens_received"])
        slowest = max(mine, key=lambda r: r["cpu_seconds"])
        return [
            seq,
            busiest["rank"],
            f"{busiest['tokens_received']:,}",
            f"{busiest['seconds']:.2f}",
            f"{busiest['cpu_seconds']:.2f}",
            f"{slowest['cpu_seconds']:.2f} (rank {slowest['rank']})",
            f"{max(r['maxrss_gib'] for r in mine):.2f}",
        ]

    header = ["tokens", "busiest rank", "token rows it receives", "its plan, s", "its plan, CPU s"]
    header += ["most CPU s of a rank", "process peak GiB (so far)"]
    description = (
        f"W = {args.world} ranks, {args.heads} query / {args.kv_heads} KV heads, block 64, local "
        f"16 blocks, stride {args.stride}, causal. Each rank's receive plan built in turn on a "
        "fresh pattern in one process (torch's default threads); the busiest rank receives the "
        f"most token rows. The {host_line(env)}: other processes sharing the cores stretch the "
        "seconds, and the CPU seconds less.\n\nCommand: `python benchmarks/context_parallel_plan.py"
        f"{''.join(' ' + a for a in sys.argv[1:])}`"
    )
    lines = heading("Context parallelism: each rank's plan on the host", env, description)
    lines += table(header, [cells(seq) for seq in args.seqs])
    name = f"context_parallel_plan_w{args.world}" + (f"_{args.tag}" if args.tag else "")
    write_results(
        args.out_dir, result_stem(env, name), "\n".join(lines) + "\n", dict(env=env, rows=rows)
    )


if __name__ == "__main__":
    main()
