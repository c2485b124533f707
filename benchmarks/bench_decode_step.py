"""The eager decode step: replayed from the cache's CUDA graph, and launched directly.

A step is ``sparse_attention_with_kvcache(q, cache, k, v)``: append the token's K/V, evict what
the pattern never reads again, attend. On a GPU it replays the cache's step graph
(``s2attn.inference.step_graph``); with ``step_graph.ENABLED = False`` it launches its two
kernels from Python. At batch 1 both are host work, so the figures move with the host: each is
the median of ``--repeats`` runs of ``--steps`` consecutive steps (wall clock, the GPU
synchronized at each run's end), and each row names the host's load when it ran.

Shapes as ``bench_decode.py``: 32 query / 8 KV heads of 128, bf16, block 64, local 16 blocks,
vertical stride 64 (``--stride``), the cache filled as a prefill stores it. ``graphs MiB``: the
growth of the CUDA caching allocator's reserved memory over the graphed steps' warm-up (the graph's
private memory pool).

    python benchmarks/bench_decode_step.py
    python benchmarks/bench_decode_step.py --contexts 131072 --batches 1,4 --repeats 9
"""

from __future__ import annotations

import sys
import time

import torch
from bench_decode import DEVICE, DTYPE, fill_cache
from run_info import (
    finish,
    heading,
    host_line,
    host_load,
    load_text,
    median_run,
    parser,
    repeats_argument,
    result_stem,
    start,
    table,
    write_results,
)
from shapes import BLOCK, DIM, HEADS, KV_HEADS, LOCAL_BLOCKS

import s2attn
from s2attn import sparse_attention_with_kvcache
from s2attn.inference import step_graph

WARMUP = 20  # the first step launches directly, the second captures: both left out


def steps_ms(cache, q, k, v, steps: int) -> float:
    """Mean ms of ``steps`` consecutive decode steps, by the wall clock."""
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(steps):
        sparse_attention_with_kvcache(q, cache, k, v)
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / steps * 1e3


def run(ctx: int, batch: int, stride: int, steps: int, repeats: int) -> dict:
    # Room for every step of both ways (warm-up and timed runs), a block to spare.
    max_len = ctx + (2 + 2 * (WARMUP + repeats * steps) // BLOCK) * BLOCK
    pattern = s2attn.local_stride_pattern(
        KV_HEADS, max_seq_len=max_len, block_size=BLOCK, local_blocks=LOCAL_BLOCKS,
        vert_stride=stride,
    )  # fmt: skip
    g = torch.Generator(device=DEVICE).manual_seed(0)
    kv = torch.randn(batch, KV_HEADS, ctx, DIM, device=DEVICE, dtype=DTYPE, generator=g)
    cache = fill_cache(pattern, kv, torch.randn_like(kv), max_len)
    del kv
    q = torch.randn(batch, 1, HEADS, DIM, device=DEVICE, dtype=DTYPE, generator=g)
    k = torch.randn(batch, 1, KV_HEADS, DIM, device=DEVICE, dtype=DTYPE, generator=g)
    v = torch.randn_like(k)
    row = dict(ctx=ctx, batch=batch, vert_stride=stride, steps=steps, repeats=repeats)
    for graphs in (True, False):
        step_graph.ENABLED = graphs
        try:
            reserved = torch.cuda.memory_reserved()
            steps_ms(cache, q, k, v, WARMUP)
            grown = (torch.cuda.memory_reserved() - reserved) / 2**20
            ms, runs = median_run(lambda: steps_ms(cache, q, k, v, steps), repeats)
        finally:
            step_graph.ENABLED = True
        name = "graph" if graphs else "direct"
        row.update({f"{name}_ms": ms, f"{name}_runs": runs, f"{name}_reserved_mib": grown})
    row["host_load"] = host_load()
    print(
        f"  ctx {ctx} batch {batch} V{stride}: graph {row['graph_ms']:.4f} ms, direct "
        f"{row['direct_ms']:.4f} ms ({row['direct_ms'] / row['graph_ms']:.1f}x); graphs "
        f"+{row['graph_reserved_mib']:.0f} MiB reserved; {load_text(row['host_load'])}",
        flush=True,
    )
    return row


def markdown(rows: list[dict], env: dict) -> str:
    lines = heading(
        "Eager decode step: CUDA graph against direct launches",
        env,
        f"One step = `sparse_attention_with_kvcache(q, cache, k, v)` (append, evict, attend), "
        f"{HEADS}/{KV_HEADS} heads of {DIM}, bf16, block {BLOCK}, local {LOCAL_BLOCKS} blocks. "
        f"ms: the median of {rows[0]['repeats']} runs of {rows[0]['steps']} consecutive steps "
        "(wall clock). graphs MiB: reserved memory added by the graphed steps' warm-up.",
    )
    lines += [host_line(env), ""]
    header = ["ctx", "batch", "V", "graph ms", "direct ms", "direct / graph", "graphs MiB", "host"]
    lines += table(
        header,
        (
            [
                r["ctx"],
                r["batch"],
                r["vert_stride"],
                f"{r['graph_ms']:.4f}",
                f"{r['direct_ms']:.4f}",
                f"{r['direct_ms'] / r['graph_ms']:.1f}x",
                f"{r['graph_reserved_mib']:.0f}",
                load_text(r["host_load"]),
            ]
            for r in rows
        ),
    )
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = parser(__doc__)
    ap.add_argument("--contexts", default="4096,32768,131072")
    ap.add_argument("--batches", default="1")
    ap.add_argument("--stride", type=int, default=64)
    ap.add_argument("--steps", type=int, default=300, help="steps a run (300)")
    repeats_argument(ap)
    args = ap.parse_args()
    if args.repeats < 1 or args.steps < 1:
        ap.error("--repeats and --steps must be at least 1")
    env = start("the eager decode step")
    if env is None:
        return 2
    rows = []
    for ctx in (int(c) for c in args.contexts.split(",")):
        for batch in (int(b) for b in args.batches.split(",")):
            rows.append(run(ctx, batch, args.stride, args.steps, args.repeats))
            torch.cuda.empty_cache()
    finish(env)
    stem = result_stem(env, f"decode_step{args.tag}")
    write_results(args.out_dir, stem, markdown(rows, env), dict(env=env, rows=rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
