"""Decode: time per step and KV memory of s2attn's paged, evicting cache against dense SDPA.

One new token per sequence; 32 query / 8 KV heads, head dim 128, bf16; S2 pattern block 64,
local_blocks 16, vertical stride 16 and 64 (KV heads staggered); contexts 8k/32k/128k, batch 1 and
16. The S2 cache is filled with random K/V the way a prefill stores them (only the blocks later
queries read); the dense cache holds every token, (batch, kv_heads, ctx, dim), for
``F.scaled_dot_product_attention(..., enable_gqa=True)``.

Times (medians of ``triton.testing.do_bench``, ms):

* ``s2 kernel``: the decode kernel and its split merge (``s2attn.ops.triton.decode.decode``).
* ``s2 call``: ``sparse_attention_with_kvcache(q, cache)``, the token already appended: host work
  (split choice, launch) included; ``s2 call again``: the same once more after FlexAttention's
  compile and timing, which come between them.
* ``s2 step``: a whole decode step, ``sparse_attention_with_kvcache(q, cache, k, v)``: append the
  token's K/V, evict, attend, replayed from the cache's step graph; mean over 32 consecutive steps
  (CUDA events). ``bench_decode_step.py`` times it against launching directly.
* ``SDPA``: dense SDPA on the dense cache, launched eagerly; ``SDPA graph``: the same call
  replayed from a CUDA graph. ``dense best``: the faster of the two, the row dense is read by
  (``dense path`` says which won).
* ``Flex``: FlexAttention (``torch.compile``-d ``flex_attention``, which decodes a one-token query
  with its split-K decoding kernel) on the dense cache with the pattern's block mask for the new
  token's query block; launched as a user would call it, host work included like ``s2 call``.

KV memory: the S2 cache's live pages, what its pattern needs, and the dense cache. ``rel err``
compares sequence 0's S2 output with the dense-mask reference.

At batch 1 the eager timings (``s2 call``, ``s2 step``, ``SDPA``, ``Flex``) are host work, which
moves with the host: each is the median of ``--repeats`` runs (default 5), and each batch-1 row
names the host's load when it ran (load average, cores other processes kept busy); the result's
heading names the CPU and the load at the start and end of the run.

    python benchmarks/bench_decode.py
    python benchmarks/bench_decode.py --contexts 131072 --batches 16 --strides 64 --sweep
    python benchmarks/bench_decode.py --batches 1 --repeats 9

``--sweep`` also times every (num_warps, num_stages, block_n, prefetch_entries, num_splits) of the
decode kernel on each case (CUDA-graph replays) and prints the best, to choose the launcher's
defaults from measurement; ``--sweep-batch1`` sweeps a smaller space (64-key tiles, 3 or 4
stages) for batch-1 rows, and ``--sweep-prefetch`` names the prefetch widths (default 0,16):

    python benchmarks/bench_decode.py --contexts 32768,131072 --batches 1 --strides 16,64 \\
        --sweep-batch1 --repeats 1
"""

from __future__ import annotations

import functools
import itertools
import sys

import torch
import torch.nn.functional as F
from run_info import (
    cell,
    finish,
    graph_ms,
    heading,
    host_line,
    host_load,
    load_text,
    median_ms,
    median_run,
    parser,
    read_rate_gbs,
    rel_err,
    repeats_argument,
    result_stem,
    start,
    table,
    write_results,
)
from shapes import BLOCK, DIM, HEADS, KV_HEADS, LOCAL_BLOCKS

import s2attn
from s2attn import PagedKVCache, attention_reference, paged_kv_cache, sparse_attention_with_kvcache
from s2attn.ops.options import TritonDecodeConfig
from s2attn.ops.triton import decode as dec

DTYPE = torch.bfloat16
DEVICE = "cuda"
STEPS = 32
WARM_STEPS = 3
MIB = 2**20


def fill_cache(pattern, k_dense, v_dense, max_seq_len) -> PagedKVCache:
    """A cache holding the dense tokens, stored as a prefill of each sequence would store them."""
    batch, _, ctx, _ = k_dense.shape
    cache = paged_kv_cache(
        pattern,
        batch_size=batch,
        num_kv_heads=KV_HEADS,
        head_dim=DIM,
        dtype=DTYPE,
        device=DEVICE,
        max_seq_len=max_seq_len,
    )
    for b in range(batch):  # one sequence at a time: a (ctx, kv_heads, dim) copy each
        counts = [ctx if i == b else 0 for i in range(batch)]
        cu = torch.tensor([0, *counts], device=DEVICE).cumsum(0).to(torch.int32)
        keep = [ctx if i <= b else 0 for i in range(batch)]
        cache.append(
            k_dense[b].transpose(0, 1), v_dense[b].transpose(0, 1), cu_seqlens=cu, keep_from=keep
        )
    return cache


def step_time(cache: PagedKVCache, q, k, v) -> float:
    """Mean ms of STEPS consecutive decode steps (append + evict + attend), after WARM_STEPS
    (the first launches directly, the second captures the cache's step graph)."""
    for _ in range(WARM_STEPS):
        sparse_attention_with_kvcache(q, cache, k, v)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(STEPS):
        sparse_attention_with_kvcache(q, cache, k, v)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / STEPS


_FLEX = None


def flex_fn(pattern, q, k_full, v_full, scale: float):
    """FlexAttention over the dense cache, masked to the blocks the pattern keeps for the new
    token (the last key): a callable, and its output once."""
    global _FLEX
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if _FLEX is None:
        # One compile per shape; past dynamo's default of 8 a call falls back to eager
        # flex_attention, which materializes every score (what a 12-shape run met).
        torch._dynamo.config.recompile_limit = 64
        _FLEX = torch.compile(flex_attention, dynamic=False)
    kv_len = k_full.shape[2]
    group = HEADS // KV_HEADS
    # The new token's query block's row per KV head; keys past it do not exist, so it is causal.
    row = (kv_len - 1) // BLOCK
    keep = torch.zeros(KV_HEADS, pattern.num_kv_blocks, dtype=torch.bool)
    for head in range(KV_HEADS):
        keep[head, pattern.row_blocks(head, row, row + 1)[1]] = True
    keep = keep.to(q.device)

    def kept(b, h, q_idx, kv_idx):
        return keep[h // group, kv_idx // BLOCK]

    mask = create_block_mask(kept, None, HEADS, 1, kv_len, device=q.device, BLOCK_SIZE=(128, BLOCK))
    fn = functools.partial(
        _FLEX, q.transpose(1, 2), k_full, v_full, block_mask=mask, scale=scale, enable_gqa=True
    )
    return fn, fn().transpose(1, 2)


def kernel_fn(
    cache: PagedKVCache, q, scale: float, splits: int, config: TritonDecodeConfig | None = None
):
    """The decode kernel (and split merge) alone, on the cache's pages, with the cache's split
    counter (left out, each call would zero one of its own: a second launch in every timing)."""
    layout = cache.decode_layout
    return functools.partial(
        dec.decode,
        q,
        cache.k_pages,
        cache.v_pages,
        cache.page_table,
        cache.seq_lens,
        layout,
        softmax_scale=scale,
        num_splits=splits,
        split_counters=cache.split_counters,
        config=config,
    )


# The launches --sweep times: every (warps, stages, block_n, prefetch_entries, splits). The split
# count is a run-time argument, but each power of two up to it compiles anew (the merge's width).
SWEEP_SPACE = dict(
    warps=(4, 8),
    stages=(2, 3, 4),
    block_n=(32, 64),
    prefetch=(0, 16),
    splits=(1, 2, 4, 8, 16, 32, 64),
)
# --sweep-batch1: a single sequence's few programs wait on dependent loads, not bandwidth, so its
# sweep is over split counts (finer, and past 2 programs per SM) and prefetching, at the 64-key
# tiles and deep pipelines the batch-16 sweep chose, so that three contexts and two strides take
# minutes.
SWEEP_BATCH1_SPACE = dict(
    SWEEP_SPACE, stages=(3, 4), block_n=(64,), splits=(4, 8, 12, 16, 24, 32, 48, 64)
)


def sweep(
    cache: PagedKVCache, q, scale: float, default_ms: float, blocks: int, space: dict
) -> dict:
    """Times every launch of ``space`` on the case (CUDA-graph replays) and returns the best.
    ``default_ms``: the launcher's default launch, timed the same way."""
    heuristic = dec.decode_num_splits(q.shape[0], KV_HEADS, blocks, q.device)
    print(f"    the heuristic's splits: {heuristic}", flush=True)
    best = None
    launches = itertools.product(
        space["warps"], space["stages"], space["block_n"], space["prefetch"], space["splits"]
    )
    for warps, stages, block_n, prefetch, splits in launches:
        if splits > max(blocks, 1):  # splits past the list's pages would have nothing to read
            continue
        config = TritonDecodeConfig(
            num_warps=warps, num_stages=stages, block_n=block_n, prefetch_entries=prefetch
        )
        try:
            fn = kernel_fn(cache, q, scale, splits, config)
            fn()  # compile outside the graph capture
            ms = graph_ms(fn) or median_ms(fn)
        except Exception as exc:  # out of shared memory / registers
            print(f"      {config} splits {splits}: {type(exc).__name__}")
            continue
        print(
            f"      warps {warps} stages {stages} block_n {block_n} prefetch {prefetch:2d} "
            f"splits {splits:2d}: {ms:.4f} ms",
            flush=True,
        )
        if best is None or ms < best["ms"]:
            best = dict(
                ms=ms,
                num_warps=warps,
                num_stages=stages,
                block_n=block_n,
                prefetch_entries=prefetch,
                splits=splits,
            )
    print(f"    best {best} (default {default_ms:.4f} ms)", flush=True)
    if best is not None:
        best.update(default_ms=default_ms, heuristic_splits=heuristic)
    return best


def run_stride(
    stride, ctx, q, k_full, v_full, k1, v1, sdpa, dense_bytes, sweep_space, repeats
) -> dict:
    batch = q.shape[0]
    scale = DIM**-0.5
    # At batch 1 the eager timings are host work: the median of `repeats` runs.
    runs = repeats if batch == 1 else 1
    load = host_load() if batch == 1 else None
    # Room for the new token and every timed run's steps, a block to spare.
    max_len = ctx + (2 + (runs * (STEPS + WARM_STEPS)) // BLOCK) * BLOCK
    pattern = s2attn.local_stride_pattern(
        KV_HEADS,
        max_seq_len=max_len,
        block_size=BLOCK,
        local_blocks=LOCAL_BLOCKS,
        vert_stride=stride,
    )
    cache = fill_cache(pattern, k_full[:, :, :ctx], v_full[:, :, :ctx], max_len)
    cache.append(k1, v1)
    blocks = int(cache.decode_layout.list_lengths[ctx // BLOCK])  # the new token's query block
    splits = dec.decode_num_splits(batch, KV_HEADS, blocks, q.device)
    kernel = kernel_fn(cache, q, scale, splits)
    out, _ = kernel()
    ref = attention_reference(
        q[:1],
        k_full[:1].transpose(1, 2),
        v_full[:1].transpose(1, 2),
        pattern,
        compute_dtype=torch.float32,
    )
    err = rel_err(out[:1], ref)
    kernel_ms = median_ms(kernel)
    kernel_graph_ms = graph_ms(kernel)
    call = functools.partial(sparse_attention_with_kvcache, q, cache)
    call_ms, call_runs = median_run(lambda: median_ms(call), runs)
    flex, flex_out = flex_fn(pattern, q, k_full, v_full, scale)
    flex_ms, _ = median_run(lambda: median_ms(flex), runs)
    flex_err = rel_err(flex_out[:1], ref)
    # The batch-1 call is host work: timed again after FlexAttention's compile, to see whether
    # what ran before it matters.
    call_again_ms, _ = median_run(lambda: median_ms(call), runs)
    report = cache.memory_report()
    best = None
    if sweep_space is not None:  # against the default launch timed as the sweep times its own
        default_ms = kernel_graph_ms or kernel_ms
        best = sweep(cache, q, scale, default_ms, blocks, sweep_space)
    step_ms, step_runs = median_run(lambda: step_time(cache, q, k1, v1), runs)
    # Bytes the kernel must read: the kept pages of every (sequence, KV head), K and V.
    read_bytes = batch * KV_HEADS * blocks * cache.page_bytes
    row = dict(
        ctx=ctx,
        batch=batch,
        vert_stride=stride,
        blocks_read=blocks,
        splits=splits,
        s2_kernel_ms=kernel_ms,
        s2_call_ms=call_ms,
        s2_call_again_ms=call_again_ms,
        s2_step_ms=step_ms,
        s2_call_runs=call_runs,
        s2_step_runs=step_runs,
        repeats=runs,
        host_load=load,
        **sdpa,
        flex_ms=flex_ms,
        flex_rel_err=flex_err,
        s2_kernel_graph_ms=kernel_graph_ms,
        speedup_vs_sdpa=sdpa["sdpa_ms"] / kernel_ms,
        read_gbps=read_bytes / kernel_ms / 1e6,
        read_bytes=read_bytes,
        live_mib=report["live_bytes"] / MIB,
        needed_mib=report["needed_bytes"] / MIB,
        dense_mib=dense_bytes / MIB,
        rel_err=err,
        sweep_best=best,
    )
    print(
        f"    V{stride}: kernel {kernel_ms:.4f} ms ({row['read_gbps']:.0f} GB/s, {splits} splits, "
        f"{blocks} blocks) graph {kernel_graph_ms or float('nan'):.4f} call {call_ms:.4f} "
        f"(again {call_again_ms:.4f}) "
        f"step {step_ms:.4f} | Flex {flex_ms:.4f} (err {flex_err:.1e}) | KV live "
        f"{row['live_mib']:.0f} need {row['needed_mib']:.0f} dense {row['dense_mib']:.0f} MiB | "
        f"x{row['speedup_vs_sdpa']:.1f} vs SDPA | rel err {err:.1e}",
        flush=True,
    )
    return row


def device_limits() -> dict:
    """What a captured decode step is read against: the GPU's read rate (``torch.sum`` over 1 GiB,
    which writes nothing back: a copy rate counts writes the kernel does not make, and the kernel
    beats it) and one launch (a one-element add replayed from a CUDA graph: the kernel and the gap
    between kernels in a graph)."""
    read_gbps = read_rate_gbs(1, 5, DEVICE)
    one = torch.zeros(1, device=DEVICE)
    launch_ms = graph_ms(lambda: one.add_(1)) or median_ms(lambda: one.add_(1))
    limits = dict(read_gbps=read_gbps, launch_ms=launch_ms)
    print(f"  read {read_gbps:.0f} GB/s, one launch {launch_ms * 1e3:.1f} us", flush=True)
    return limits


def dense_timings(sdpa, batch: int, repeats: int) -> dict:
    """Dense SDPA on the dense cache: launched eagerly (at batch 1 the median of ``repeats``
    runs: host work) and replayed from a CUDA graph; its best path is the faster of the two."""
    eager_ms, _ = median_run(lambda: median_ms(sdpa), repeats if batch == 1 else 1)
    graph = graph_ms(sdpa)
    best_path = "CUDA graph" if graph is not None and graph < eager_ms else "eager"
    best_ms = graph if best_path == "CUDA graph" else eager_ms
    return dict(
        sdpa_ms=eager_ms, sdpa_graph_ms=graph, dense_best_path=best_path, dense_best_ms=best_ms
    )


def run(
    ctx: int, batch: int, strides: list[int], sweep_space: dict | None, repeats: int
) -> list[dict]:
    torch.manual_seed(0)
    # The dense cache: the context plus the new token (the last position), made in place so that
    # the largest cases (128k x 64 sequences: 32 GiB) need no second copy.
    k_full = torch.randn(batch, KV_HEADS, ctx + 1, DIM, device=DEVICE, dtype=DTYPE)
    v_full = torch.randn_like(k_full)
    q = torch.randn(batch, 1, HEADS, DIM, device=DEVICE, dtype=DTYPE)
    k1, v1 = (t[:, :, ctx:].transpose(1, 2).contiguous() for t in (k_full, v_full))
    sdpa = functools.partial(
        F.scaled_dot_product_attention, q.transpose(1, 2), k_full, v_full, enable_gqa=True
    )
    dense = dense_timings(sdpa, batch, repeats)
    dense_bytes = 2 * k_full.numel() * k_full.element_size()
    print(
        f"  ctx {ctx} batch {batch}: SDPA {dense['sdpa_ms']:.4f} ms (best: "
        f"{dense['dense_best_path']}, {dense['dense_best_ms']:.4f} ms), dense KV "
        f"{dense_bytes / MIB:.0f} MiB",
        flush=True,
    )
    rows = []
    for stride in strides:
        rows.append(
            run_stride(
                stride, ctx, q, k_full, v_full, k1, v1, dense, dense_bytes, sweep_space, repeats
            )
        )
        torch.cuda.empty_cache()
    return rows


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


# The result table: a column's header and its cell of a row.
COLUMNS = [
    ("ctx", lambda r: r["ctx"]),
    ("batch", lambda r: r["batch"]),
    ("V", lambda r: r["vert_stride"]),
    ("blocks read", lambda r: r["blocks_read"]),
    ("splits", lambda r: r["splits"]),
    ("s2 kernel ms", lambda r: f"{r['s2_kernel_ms']:.4f}"),
    ("s2 kernel graph ms", lambda r: cell(r["s2_kernel_graph_ms"], "{:.4f}")),
    ("s2 call ms", lambda r: f"{r['s2_call_ms']:.4f}"),
    ("s2 call again ms", lambda r: cell(r.get("s2_call_again_ms"), "{:.4f}")),
    ("s2 step ms", lambda r: f"{r['s2_step_ms']:.4f}"),
    ("SDPA ms", lambda r: f"{r['sdpa_ms']:.4f}"),
    ("dense best ms", lambda r: f"{r['dense_best_ms']:.4f}"),
    ("dense path", lambda r: r["dense_best_path"]),
    ("call x dense best", lambda r: f"{r['dense_best_ms'] / r['s2_call_ms']:.1f}"),
    ("Flex ms", lambda r: cell(r.get("flex_ms"), "{:.4f}")),
    ("call x SDPA", lambda r: f"{r['sdpa_ms'] / r['s2_call_ms']:.1f}"),
    ("call x Flex", lambda r: cell(_ratio(r.get("flex_ms"), r["s2_call_ms"]), "{:.1f}")),
    ("SDPA graph ms", lambda r: cell(r["sdpa_graph_ms"], "{:.4f}")),
    ("x SDPA", lambda r: f"{r['speedup_vs_sdpa']:.1f}"),
    ("x SDPA graph", lambda r: cell(_ratio(r["sdpa_graph_ms"], r["s2_kernel_graph_ms"]), "{:.1f}")),
    ("bound ms", lambda r: cell(r.get("bound_ms"), "{:.4f}")),
    ("graph / bound", lambda r: cell(_ratio(r["s2_kernel_graph_ms"], r.get("bound_ms")), "{:.2f}")),
    (
        "GB/s graph",
        lambda r: cell(_ratio(r["read_bytes"] / 1e6, r["s2_kernel_graph_ms"]), "{:.0f}"),
    ),
    ("KV live MiB", lambda r: f"{r['live_mib']:.1f}"),
    ("KV need MiB", lambda r: f"{r['needed_mib']:.1f}"),
    ("KV dense MiB", lambda r: f"{r['dense_mib']:.0f}"),
    ("rel err", lambda r: f"{r['rel_err']:.1e}"),
    ("host (batch 1)", lambda r: load_text(r["host_load"]) if r["host_load"] else "—"),
]


def markdown(rows: list[dict], env: dict, limits: dict) -> str:
    lines = heading(
        "Decode benchmark",
        env,
        f"One new token per sequence, {HEADS} query / {KV_HEADS} KV heads, dim {DIM}, bf16; S2 "
        f"block {BLOCK}, local_blocks {LOCAL_BLOCKS}. Medians of `triton.testing.do_bench` (step: "
        f"mean of {STEPS} steps). `x SDPA` = SDPA ms / s2 kernel ms. GB/s: kept K/V pages read per "
        "second by the kernel. KV MiB: live pages of the S2 cache, what the pattern needs, the "
        "dense cache. `call x SDPA`, `call x Flex`: their ms / s2 call ms (the public call against "
        "each, launched eagerly). `dense best`: SDPA's faster path, eager or replayed from a CUDA "
        "graph (`dense path`); `call x dense best`: it over s2 call ms. At batch 1 the eager "
        "timings (call, step, SDPA, Flex) are host work: medians of "
        f"{max(r['repeats'] for r in rows)} runs, each row with the host's load as it ran "
        f"(load average; cores other processes kept busy); {host_line(env)}. `graph` columns: "
        "the same call replayed from a CUDA graph "
        "(`do_bench_cudagraph`), i.e. GPU time without Python's launch overhead. `bound ms`: the "
        f"bytes the kernel must read at the measured read rate ({limits['read_gbps']:.0f} GB/s, "
        "`torch.sum` over 1 GiB, best of 5) plus one launch "
        f"({limits['launch_ms'] * 1e3:.1f} us, a one-element add replayed from a CUDA graph); "
        "`graph / bound`: the captured "
        "kernel against it. Replays of a small case read pages that stay in L2.",
    )
    lines += table([name for name, _ in COLUMNS], ([c(r) for _, c in COLUMNS] for r in rows))
    best = [r for r in rows if r["sweep_best"]]
    if best:
        lines += ["", "Sweep (best launch per case):", ""]
        lines += [
            f"- ctx {r['ctx']} batch {r['batch']} V{r['vert_stride']}: {r['sweep_best']}"
            for r in best
        ]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = parser(__doc__)
    ap.add_argument("--contexts", default="8192,32768,131072")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--strides", default="16,64")
    ap.add_argument("--sweep", action="store_true", help="also sweep the kernel's launch options")
    ap.add_argument(
        "--sweep-batch1",
        action="store_true",
        help="sweep the batch-1 space instead (implies --sweep): 64-key tiles, 3 or 4 stages",
    )
    ap.add_argument(
        "--sweep-prefetch",
        default=",".join(map(str, SWEEP_SPACE["prefetch"])),
        help="the sweep's prefetch_entries (0: off; else a power of two)",
    )
    repeats_argument(ap)
    args = ap.parse_args()
    if args.repeats < 1:
        ap.error(f"--repeats must be at least 1, got {args.repeats}")
    env = start("GPU kernels")
    if env is None:
        return 2
    contexts = [int(c) for c in args.contexts.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    strides = [int(s) for s in args.strides.split(",")]
    sweep_space = None
    if args.sweep or args.sweep_batch1:
        sweep_space = dict(SWEEP_BATCH1_SPACE if args.sweep_batch1 else SWEEP_SPACE)
        sweep_space["prefetch"] = tuple(int(w) for w in args.sweep_prefetch.split(","))
    limits = device_limits()
    rows = []
    cases = list(itertools.product(contexts, batches))
    for i, (ctx, batch) in enumerate(cases, 1):
        print(f"[{i}/{len(cases)}] context {ctx}, batch {batch}", flush=True)
        rows += run(ctx, batch, strides, sweep_space, args.repeats)
        torch.cuda.empty_cache()
    for row in rows:  # the captured kernel against its bytes at the read rate, plus one launch
        row["bound_ms"] = row["read_bytes"] / (limits["read_gbps"] * 1e6) + limits["launch_ms"]
    finish(env)
    stem = result_stem(env, f"decode{args.tag}")
    write_results(args.out_dir, stem, markdown(rows, env, limits),
                  dict(env=env, limits=limits, rows=rows))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
