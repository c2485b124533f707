"""Serving a 7B-shaped Llama: time to first token, decode tokens/s at batch 1 and at the largest
batch one GPU holds, and peak memory; HHST through s2attn's evicting ``S2Cache`` against dense SDPA
with transformers' ``DynamicCache``.

Model: random weights (nothing is downloaded), hidden 4096, 32 layers, 32 query / 8 KV heads of
128, MLP 11008, vocabulary 32000, bf16 (6.7B parameters). HHST: ``--dense-layers`` dense layers
spread through the stack (as ``s2attn.integrations.transformers.configure`` places them: 2 of 32
are layers 8 and 24), the rest S2 (block 64, local 16 blocks, vertical stride ``--stride``).

For each prompt length and configuration:

- **TTFT**: ``generate(max_new_tokens=1)`` on one prompt, the whole prefill through the model.
- **Decode tokens/s** at batch 1 and at the largest batch: every layer's cache is filled with
  random keys and values for every sequence, stored as a prefill stores them (the S2 cache keeps
  only what later queries read), instead of prefilling the batch through the model: a decode
  step's cost does not depend on the values, and prefilling dozens of 128k-token prompts would
  take minutes of GPU time per row. ``generate`` then decodes ``--new`` tokens greedily from the
  filled cache; tokens/s = batch x new / time (its first step is a one-token forward too).
- **Batch 1 is host-bound**, so its figure moves with the host: it is the median of
  ``--repeats`` runs (default 5), each filling a fresh cache, and each row names the host's load
  as it ran (load average, cores other processes kept busy); the heading names the CPU and the
  load at the start and end of the run.
- **Dense's best path**: dense's batch-1 figure is the faster of eager ``generate`` over
  ``DynamicCache`` and ``generate``'s compiled decode step (``reduce-overhead``) over
  ``StaticCache``; the row says which won (``--dense-eager-only``: eager alone). ``x dense batch
  1`` compares each row's batch-1 tokens/s with it.
- **Largest batch**: the most sequences of that length whose caches fit beside the weights:
  predicted from one sequence's cache bytes and the free memory less ``--headroom`` GiB, then
  lowered while filling or decoding runs out of memory.
- **Peak**: ``torch.cuda.max_memory_allocated`` while decoding at that batch (weights included);
  KV: the GPU bytes the caches hold.
- **Greedy check**: a short run (``--check-prompt`` tokens, ``--check-new`` new) of the HHST
  model through s2attn with ``S2Cache`` against the same model through ``s2attn_reference`` (the
  dense-mask reference): the tokens must be equal.

- **Compiled** (``--compiled``): the same decode rows over static caches (transformers'
  ``StaticCache``, and ``S2Cache(static=True)``), whose decode step ``generate`` compiles with
  CUDA graphs (``reduce-overhead``): Python's launch overhead out of the step. At the eager rows'
  largest batches (lower where a static cache does not fit), for ``--compiled-prompts``.

    python benchmarks/bench_serving.py                       # 32k and 128k prompts
    python benchmarks/bench_serving.py --prompts 131072 --skip-dense
    python benchmarks/bench_serving.py --compiled            # and compiled decode at 128k
    python benchmarks/bench_serving.py --prompts 32768 --repeats 9

Writes markdown and JSON with the device, versions and date to benchmarks/results/.
"""

from __future__ import annotations

import sys

import torch
from bench_generate import DEVICE, DTYPE, GIB, build_model, sync_time
from bench_generate import MODEL as GENERATE_MODEL
from run_info import (
    cell,
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

# The 1.1B model's Llama, scaled to the 7B shape (its heads, vocabulary and RoPE base kept).
MODEL = {**GENERATE_MODEL, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32}
KV_HEADS, HEAD_DIM = 8, 128
# Positions a cache holds past its prompt: the new tokens and room to spare.
ROOM = 512


def dense_cache(model, batch: int, ctx: int, static_len: int | None = None):
    """transformers' DynamicCache holding ``ctx`` random tokens per sequence in every layer, or its
    StaticCache of ``static_len`` positions (what ``generate`` compiles its decode step over)."""
    from transformers import DynamicCache, StaticCache

    if static_len is None:
        cache = DynamicCache(config=model.config)
    else:
        cache = StaticCache(config=model.config, max_cache_len=static_len)
    for i in range(MODEL["num_hidden_layers"]):
        k = torch.randn(batch, KV_HEADS, ctx, HEAD_DIM, device=DEVICE, dtype=DTYPE)
        cache.update(k, torch.randn_like(k), i)
    return cache


def s2_cache(model, batch: int, ctx: int, max_len: int, static: bool = False):
    """An S2Cache whose layers hold ``ctx`` random tokens per sequence, each sequence stored as its
    prefill would store it (dense layers everything, S2 layers what later queries read); with
    ``static``, its CUDA-graph-ready variant."""
    from s2attn.integrations.transformers import S2Cache

    cache = S2Cache(model.config, max_seq_len=max_len, static=static)
    probe = torch.empty(batch, KV_HEADS, 1, HEAD_DIM, device=DEVICE, dtype=DTYPE)
    for layer in cache.layers:
        layer.lazy_initialization(probe, probe)
        for b in range(batch):  # one sequence at a time: its (ctx, kv_heads, dim) keys
            counts = [ctx if i == b else 0 for i in range(batch)]
            cu = torch.tensor([0, *counts], device=DEVICE).cumsum(0).to(torch.int32)
            keep = [ctx if i <= b else 0 for i in range(batch)]
            k = torch.randn(ctx, KV_HEADS, HEAD_DIM, device=DEVICE, dtype=DTYPE)
            layer.paged.append(k, torch.randn_like(k), cu_seqlens=cu, keep_from=keep)
    return cache


def generate(model, ids, new: int, cache=None, **options):
    """Greedy ``generate`` of exactly ``new`` tokens after ``ids`` (nothing padded); ``options``
    go to it (e.g. ``output_scores``)."""
    with torch.no_grad():
        return model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            past_key_values=cache,
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            **options,
        )


def ttft(model, ctx: int, make_cache) -> float:
    torch.manual_seed(1)
    ids = torch.randint(2, MODEL["vocab_size"], (1, ctx), device=DEVICE)
    t0 = sync_time()
    generate(model, ids, 1, make_cache(ctx))
    return sync_time() - t0


def decode(model, batch: int, ctx: int, new: int, fill) -> dict:
    """Fill caches for ``batch`` sequences of ``ctx`` tokens, decode ``new`` tokens; time it."""
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    cache = fill(batch)
    kv_bytes = torch.cuda.memory_allocated() - before
    ids = torch.randint(2, MODEL["vocab_size"], (batch, ctx + 1), device=DEVICE)
    torch.cuda.reset_peak_memory_stats()
    generate(model, ids, 2, cache)  # the cache's first steps (layouts, kernels), not timed
    t0 = sync_time()
    generate(model, torch.cat([ids, ids[:, :2]], 1), new, cache)
    seconds = sync_time() - t0
    peak = torch.cuda.max_memory_allocated()
    del cache
    return dict(batch=batch, tok_s=batch * new / seconds, step_ms=1e3 * seconds / new,
                kv_gib=kv_bytes / GIB, peak_gib=peak / GIB)  # fmt: skip


def cudagraph_skips() -> int:
    """Graphs Inductor has compiled to run without CUDA graphs so far. It counts a graph once,
    when it compiles it: the rows that reuse it run without graphs too, uncounted."""
    from torch._dynamo.utils import counters

    return counters["inductor"]["cudagraph_skips"]


def decode_one(model, ctx: int, new: int, fill, repeats: int) -> dict:
    """Batch-1 decode, host-bound: the run of median tokens/s among ``repeats`` (each over a
    fresh cache), with every run's tokens/s and the host's load before them."""
    load = host_load()
    done = []

    def measure() -> float:
        done.append(decode(model, 1, ctx, new, fill))
        return done[-1]["tok_s"]

    _, runs = median_run(measure, repeats)
    median = sorted(done, key=lambda r: r["tok_s"])[(len(done) - 1) // 2]
    return dict(median, tok_s_runs=runs, host_load=load)


def largest_batch(model, ctx: int, new: int, fill, headroom: float, cap: int) -> dict:
    """Decode at the largest batch that fits (see the module's doc)."""
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    one = fill(1)
    per_seq = torch.cuda.memory_allocated() - before
    del one
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info()
    batch = max(1, min(cap, int((free - headroom * GIB) // per_seq)))
    print(f"    one sequence's cache {per_seq / GIB:.3f} GiB: trying batch {batch}", flush=True)
    row = fitting_batch(model, ctx, new, fill, batch)
    row["per_seq_gib"] = per_seq / GIB
    return row


def fitting_batch(model, ctx: int, new: int, fill, batch: int) -> dict:
    """Decode at ``batch``, or at the largest smaller batch that does not run out of memory."""
    while True:
        try:
            return decode(model, batch, ctx, new, fill)
        except torch.OutOfMemoryError:
            # An allocation that fails inside a compiled step leaves Inductor's CUDA-graph tree
            # mid-recording (its next call fails an assertion); the smaller batch starts a new one.
            from torch._inductor.cudagraph_trees import reset_cudagraph_trees

            reset_cudagraph_trees()
            torch.cuda.empty_cache()
            if batch == 1:
                raise
            batch = max(1, int(batch * 0.92))
            print(f"    out of memory: trying batch {batch}", flush=True)


def greedy_check(model, s2hf, args, dtype: torch.dtype) -> dict:
    """HHST through s2attn (S2Cache) against s2attn_reference (DynamicCache), the model's weights
    in ``dtype``: how many leading tokens are equal, and at the first that differs, the reference's
    own logit margin between its token and s2attn's (a near-tie, when small)."""
    torch.manual_seed(2)
    ids = torch.randint(2, MODEL["vocab_size"], (1, args.check_prompt), device=DEVICE)
    model.to(dtype)
    runs = {}
    for name in (s2hf.ATTN_IMPLEMENTATION, s2hf.REFERENCE_IMPLEMENTATION):
        model.set_attn_implementation(name)
        cache = s2hf.S2Cache(model.config) if name == s2hf.ATTN_IMPLEMENTATION else None
        runs[name] = generate(model, ids, args.check_new, cache, return_dict_in_generate=True,
                              output_scores=True)  # fmt: skip
    model.set_attn_implementation(s2hf.ATTN_IMPLEMENTATION)
    model.to(DTYPE)
    got = runs[s2hf.ATTN_IMPLEMENTATION].sequences[0, args.check_prompt :].tolist()
    ref = runs[s2hf.REFERENCE_IMPLEMENTATION]
    want = ref.sequences[0, args.check_prompt :].tolist()
    same = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), len(want))
    margin = None
    if same < len(want):  # both runs saw the same tokens up to here
        scores = ref.scores[same][0].float()
        margin = (scores[want[same]] - scores[got[same]]).item()
        spread = scores.std().item()
    row = dict(dtype=str(dtype).removeprefix("torch."), equal_prefix=same, new=len(want),
               ref_margin=margin, ref_logit_std=spread if margin is not None else None)  # fmt: skip
    print(f"  greedy check ({row['dtype']}): {same} of {len(want)} tokens equal the reference's"
          + (f"; at the first difference the reference's margin is {margin:.4f} (its logits' "
             f"std {spread:.3f})" if margin is not None else ""), flush=True)  # fmt: skip
    return row


def warn_skips(row: dict) -> None:
    if row["cudagraph_skips"]:
        print(f"    WARNING: Inductor compiled {row['cudagraph_skips']} graph(s) of this row "
              "without CUDA graphs (its log says why): its compiled figures are not "
              "reduce-overhead's", flush=True)  # fmt: skip


def dense_best_one(model, ctx: int, args, eager: dict) -> tuple[dict, dict]:
    """Dense's batch 1 by its best path: ``eager`` (DynamicCache) or generate's compiled decode
    step over a StaticCache, whichever decodes faster; returns it and the row's note of both."""
    static = lambda b: dense_cache(model, b, ctx, ctx + ROOM)
    skips = cudagraph_skips()
    compiled = decode_one(model, ctx, args.new, static, args.repeats)
    print(f"    batch 1 compiled (StaticCache): {compiled['tok_s']:.1f} tok/s", flush=True)
    won = "compiled" if compiled["tok_s"] > eager["tok_s"] else "eager"
    note = dict(one_path=won, one_eager=eager, one_compiled=compiled,
                cudagraph_skips=cudagraph_skips() - skips)  # fmt: skip
    warn_skips(note)
    return (compiled if won == "compiled" else eager), note


def markdown(rows: list[dict], checks: list[dict], env: dict, args, params: int) -> str:
    import transformers

    versions = (
        f"{env['date']} · torch {env['torch']} · triton {env['triton']} · transformers "
        f"{transformers.__version__} · s2attn {env['s2attn']}"
    )
    lines = heading(
        "Serving benchmark",
        env,
        f"Llama-style, {params / 1e9:.2f}B parameters, random weights, bf16: {MODEL}. HHST: "
        f"{args.dense_layers} dense layers spread through the stack, the rest S2 (block 64, "
        "local 16, stride "
        f"{args.stride}). TTFT: one prompt through the model. Decode: caches filled with random "
        f"K/V for every sequence (as a prefill stores them), then {args.new} greedy tokens; "
        "`x dense` compares with the dense row of the same prompt and kind (eager, or static "
        "caches with a compiled decode step) at its own largest batch. Batch 1 is host-bound: "
        f"the median of {args.repeats} runs, with the host's load as they ran (`host`; load "
        "average, cores other processes kept busy); dense's batch 1 is its best path, eager "
        "(DynamicCache) or compiled (StaticCache, `reduce-overhead`), named in `batch-1 path`; "
        "`x dense batch 1` compares with it. "
        f"Peak: all GPU memory while decoding at the largest batch, weights included. "
        f"{host_line(env)}.",
        versions,
    )

    # Each row against the dense row of its prompt and kind (eager, or static and compiled).
    def kind(r):
        return r["prompt"], r["config"].endswith("static+compiled")

    dense = {kind(r): r for r in rows if r["config"].startswith("dense SDPA")}

    def speedup(r):
        d = dense.get(kind(r))
        return f"{r['max']['tok_s'] / d['max']['tok_s']:.1f}" if d else "—"

    def batch_one_path(r):
        path = r.get("one_path") or ("compiled" if kind(r)[1] else "eager")
        # A compiled graph of the row ran without CUDA graphs: not the path it names.
        skipped = path == "compiled" and r.get("cudagraph_skips")
        return path + (" (CUDA graphs skipped)" if skipped else "")

    # Batch 1 against dense's best path at the same prompt (eager or compiled, whichever won).
    dense_one = {r["prompt"]: r for r in rows if r["config"] == "dense SDPA"}

    def speedup_one(r):
        d = dense_one.get(r["prompt"])
        return f"{r['one']['tok_s'] / d['one']['tok_s']:.1f}" if d else "—"

    lines += table(
        ["prompt", "config", "TTFT s", "tok/s batch 1", "step ms batch 1", "batch-1 path",
         "x dense batch 1", "host (batch 1)", "largest batch", "tok/s largest",
         "step ms largest", "x dense", "KV GiB per seq", "peak GiB"],
        ([r["prompt"], r["config"], cell(r["ttft_s"], "{:.2f}"), f"{r['one']['tok_s']:.1f}",
          f"{r['one']['step_ms']:.1f}", batch_one_path(r), speedup_one(r),
          load_text(r["one"]["host_load"]), r["max"]["batch"], f"{r['max']['tok_s']:.0f}",
          f"{r['max']['step_ms']:.1f}", speedup(r), f"{r['max']['per_seq_gib']:.3f}",
          f"{r['max']['peak_gib']:.1f}"] for r in rows),
    )  # fmt: skip
    for c in checks:
        lines += [
            "",
            f"Greedy check (HHST, weights in {c['dtype']}, {args.check_prompt}-token prompt, "
            f"{c['new']} new tokens, batch 1): {c['equal_prefix']} of {c['new']} tokens equal "
            "`s2attn_reference`'s"
            + (f"; at the first difference the reference's own logits differ by "
               f"{c['ref_margin']:.4f} between its token and s2attn's (its logits' standard "
               f"deviation: {c['ref_logit_std']:.3f})." if c["ref_margin"] is not None else "."),
        ]  # fmt: skip
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = parser(__doc__)
    ap.add_argument("--prompts", default="32768,131072")
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument("--stride", type=int, default=64)
    ap.add_argument("--dense-layers", type=int, default=2)
    ap.add_argument("--headroom", type=float, default=6.0, help="GiB kept for activations")
    ap.add_argument("--max-batch", type=int, default=256)
    ap.add_argument("--skip-dense", action="store_true")
    ap.add_argument("--check-prompt", type=int, default=4096)
    ap.add_argument("--check-new", type=int, default=16)
    ap.add_argument(
        "--compiled",
        action="store_true",
        help="also static caches with generate's compiled decode step (StaticCache for dense, "
        "S2Cache(static=True) for HHST), at --compiled-prompts",
    )
    ap.add_argument("--compiled-prompts", default="131072")
    ap.add_argument(
        "--dense-eager-only",
        action="store_true",
        help="time dense's batch 1 eagerly only, not also compiled over StaticCache (its best "
        "path by default)",
    )
    repeats_argument(ap)
    args = ap.parse_args()
    if args.repeats < 1:
        ap.error(f"--repeats must be at least 1, got {args.repeats}")
    env = start("a 7B-shaped model")
    if env is None:
        return 2
    from s2attn.integrations import transformers as s2hf

    prompts = [int(p) for p in args.prompts.split(",")]
    max_len = max(prompts) + ROOM  # the patterns' length
    model = build_model(max_len, MODEL)
    params = sum(p.numel() for p in model.parameters())
    print(f"model: {params / 1e9:.2f}B parameters", flush=True)
    s2hf.configure(model.config, block_size=64, local_blocks=16, vert_stride=args.stride,
                   dense_layers=args.dense_layers, max_seq_len=max_len)  # fmt: skip
    checks = [greedy_check(model, s2hf, args, d) for d in (torch.float32, DTYPE) if args.check_new]

    configs = [] if args.skip_dense else [("dense SDPA", "sdpa")]
    configs.append((f"HHST V{args.stride}", s2hf.ATTN_IMPLEMENTATION))
    rows = []
    for name, implementation in configs:
        model.set_attn_implementation(implementation)
        if implementation == "sdpa":
            fill = lambda batch, ctx: dense_cache(model, batch, ctx)
            make_cache = lambda ctx: None  # generate's DynamicCache
        else:
            # Each prompt's caches sized for it (the prompt, the new tokens, a margin): the page
            # pools hold what the patterns keep for that length, not for the longest prompt.
            fill = lambda batch, ctx: s2_cache(model, batch, ctx, ctx + ROOM)
            make_cache = lambda ctx: s2hf.S2Cache(model.config, max_seq_len=ctx + ROOM)
        ttft(model, min(2048, *prompts), make_cache)  # compiles what the prefill launches
        for ctx in prompts:
            print(f"[{name}] prompt {ctx}", flush=True)
            first = ttft(model, ctx, make_cache)
            print(f"    TTFT {first:.2f} s", flush=True)
            one = decode_one(model, ctx, args.new, lambda b, ctx=ctx: fill(b, ctx), args.repeats)
            load = load_text(one["host_load"])
            print(
                f"    batch 1: {one['tok_s']:.1f} tok/s (median of {args.repeats}; {load})",
                flush=True,
            )
            path = {}
            if implementation == "sdpa" and not args.dense_eager_only:
                one, path = dense_best_one(model, ctx, args, one)
            most = largest_batch(model, ctx, args.new, lambda b, ctx=ctx: fill(b, ctx),
                                 args.headroom, args.max_batch)  # fmt: skip
            print(f"    batch {most['batch']}: {most['tok_s']:.0f} tok/s, "
                  f"peak {most['peak_gib']:.1f} GiB", flush=True)  # fmt: skip
            rows.append(dict(config=name, prompt=ctx, ttft_s=first, one=one, max=most, **path))
            torch.cuda.empty_cache()

    # Static caches, whose decode step generate compiles (mode "reduce-overhead": CUDA graphs),
    # at the eager rows' largest batches (lower where a static cache holds more).
    for name, implementation in configs if args.compiled else []:
        model.set_attn_implementation(implementation)
        if implementation == "sdpa":
            fill = lambda batch, ctx: dense_cache(model, batch, ctx, ctx + ROOM)
        else:
            fill = lambda batch, ctx: s2_cache(model, batch, ctx, ctx + ROOM, True)
        for ctx in [int(p) for p in args.compiled_prompts.split(",")]:
            eager = next(r for r in rows if (r["config"], r["prompt"]) == (name, ctx))
            print(f"[{name}, static, compiled] prompt {ctx}", flush=True)
            skips = cudagraph_skips()
            one = decode_one(model, ctx, args.new, lambda b, ctx=ctx: fill(b, ctx), args.repeats)
            print(f"    batch 1: {one['tok_s']:.1f} tok/s (median of {args.repeats})", flush=True)
            most = fitting_batch(model, ctx, args.new, lambda b, ctx=ctx: fill(b, ctx),
                                 eager["max"]["batch"])  # fmt: skip
            most["per_seq_gib"] = most["kv_gib"] / most["batch"]
            print(f"    batch {most['batch']}: {most['tok_s']:.0f} tok/s", flush=True)
            rows.append(dict(config=f"{name} static+compiled", prompt=ctx, ttft_s=None, one=one,
                             max=most, cudagraph_skips=cudagraph_skips() - skips))  # fmt: skip
            warn_skips(rows[-1])
            torch.cuda.empty_cache()

    finish(env)
    stem = result_stem(env, f"serving{args.tag}")
    payload = dict(env=env, model=MODEL, args={k: str(v) for k, v in vars(args).items()},
                   rows=rows, greedy_checks=checks)  # fmt: skip
    write_results(args.out_dir, stem, markdown(rows, checks, env, args, params), payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
