"""Serving a 7B-shaped Llama in vLLM: dense against HHST (s2attn's plugin), 32k and 128k prompts.

Model: bench_serving.py's 7B shape (hidden 4096, 32 layers, 32 query / 8 KV heads of 128, MLP
11008, vocabulary 32000, bf16), random weights through vLLM's dummy loader (nothing is
downloaded). HHST: layers 8 and 24 dense, the rest S2 (block 64, local 16 blocks, vertical stride
``--stride``). Both engines as vLLM builds them by default (torch.compile, CUDA graphs: full graphs
of decode batches, piecewise otherwise), pages of 64 tokens, no prefix caching (random prompts
share nothing), prefill chunks of ``--chunk`` tokens. Each engine runs in a process of its own,
with vLLM's engine core in that process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so that the
benchmark reads the scheduler's pages and steps the engine itself.

For each engine and prompt length:

- **TTFT and batch-1 decode**: one request alone (random prompt, ``--new`` greedy tokens); TTFT
  from its submission to its first token, decode tokens/s over the rest but its last
  ``ACCOUNTING_STEPS``, where the pages it holds are read (untimed). Batch 1 is host-bound:
  the median of ``--repeats`` requests, and the host's load is recorded.
- **KV held**: the pages the request holds in each KV-cache group at its last step, as bytes, and
  for the S2 layers beside two bounds: the union over KV heads (what a page of all KV heads can
  free: the pages vLLM's S2 groups may hold) and what ``S2Cache`` keeps in transformers (each KV
  head its own blocks).
- **Largest concurrency**: the most requests of that length the KV pool holds at their peak
  (vLLM's pool blocks over the blocks one request needs in every group), all submitted at once
  with enough new tokens that every request is still decoding once the last prefill is done;
  throughput is the tokens per second of the steps in which all of them decode together.
- **transformers' generate** (``--generate``): ``bench_serving.py``'s rows at the same prompts and
  stride (its compiled rows at the longest), on the same GPU after the vLLM engines, for reference.

    python benchmarks/bench_vllm.py                          # 32k and 128k, dense and HHST
    python benchmarks/bench_vllm.py --generate               # and transformers' generate
    python benchmarks/bench_vllm.py --prompts 131072 --configs hhst

Needs a CUDA GPU and vLLM (0.26.x or 0.32.x) with s2attn's plugin (``pip install
's2attn[vllm]'``). Writes markdown and JSON with the device, versions and date to
benchmarks/results/.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch
from bench_serving import MODEL
from run_info import (
    cell,
    finish,
    heading,
    host_line,
    host_load,
    load_text,
    parser,
    repeats_argument,
    result_stem,
    start,
    table,
    write_results,
)

from s2attn.integrations.vllm_paged import KV_PAGES_ENV

GIB = 2**30
BLOCK, LOCAL = 64, 16
DENSE_LAYERS = 2
VOCAB = MODEL["vocab_size"]
CONFIGS = ("dense", "hhst", "hhst-union")
# The most new tokens of any request: the engine's length is the longest prompt plus this.
MAX_NEW = 2048
# A batch-1 request's last steps, where the benchmark reads the pages it holds (untimed).
ACCOUNTING_STEPS = 4


# --------------------------------------------------------------------------- the worker process
def model_config(name: str, max_len: int, stride: int):
    """The 7B shape's transformers config, HHST when ``name`` is ``hhst`` or ``hhst-union``."""
    import transformers

    from s2attn.integrations.transformers import configure

    # Named, so that vLLM serves it as a Llama with an LM head (an unnamed config is its
    # LlamaModel); an HHST config names S2LlamaForCausalLM when saved.
    config = transformers.LlamaConfig(
        **MODEL,
        max_position_embeddings=max_len,
        torch_dtype="bfloat16",
        head_dim=128,
        architectures=["LlamaForCausalLM"],
    )
    if name.startswith("hhst"):
        configure(
            config,
            block_size=BLOCK,
            local_blocks=LOCAL,
            vert_stride=stride,
            dense_layers=DENSE_LAYERS,
            max_seq_len=max_len,
        )
    return config


def prompt(length: int, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {"prompt_token_ids": torch.randint(2, VOCAB, (length,), generator=gen).tolist()}


class Engine:
    """vLLM's engine in this process, stepped by hand, with its scheduler's pages in view."""

    def __init__(self, directory: Path, args) -> None:
        from vllm import LLM

        self.llm = LLM(
            str(directory),
            load_format="dummy",
            skip_tokenizer_init=True,
            dtype="bfloat16",
            block_size=BLOCK,
            max_model_len=args.max_len,
            max_num_batched_tokens=args.chunk,
            max_num_seqs=args.max_seqs,
            gpu_memory_utilization=args.gpu_memory_utilization,
            enable_prefix_caching=False,
            seed=0,
        )
        self.engine = self.llm.llm_engine
        core = self.engine.engine_core.engine_core
        self.scheduler = core.scheduler
        self.manager = self.scheduler.kv_cache_manager
        self.config = core.vllm_config
        self.groups = self.manager.kv_cache_config.kv_cache_groups
        self.next_id = 0

    def submit(self, prompts: list[dict], new: int) -> list[str]:
        from vllm import SamplingParams

        params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
        ids = []
        for p in prompts:
            ids.append(str(self.next_id))
            self.engine.add_request(ids[-1], p, params)
            self.next_id += 1
        return ids

    def step(self) -> tuple[float, list]:
        """One engine step: (the time it returned, the outputs it returned). No device sync of
        its own: the outputs are tokens already on the host, and with vLLM's asynchronous
        scheduling (its default) the engine has launched its next batch before returning them,
        as it does when serving."""
        outputs = self.engine.step()
        return time.perf_counter(), outputs

    def pages_held(self) -> list[int] | None:
        """Per KV-cache group, the pages the one running request holds (vLLM's null block, id 0,
        is none); None while none runs. The scheduler's own id: vLLM adds a suffix to ours."""
        if len(self.scheduler.running) != 1:
            return None
        request_id = self.scheduler.running[0].request_id
        return [sum(b != 0 for b in blocks) for blocks in self.manager.get_block_ids(request_id)]

    def group_bytes(self, pages: list[int]) -> dict:
        """Bytes of ``pages`` per group, summed over the dense groups and over the S2 layers'
        groups (their windows and, each KV head's stripes kept apart, their stripe groups)."""
        from s2attn.integrations.vllm_kv import S2AttentionSpec, S2StripeSpec

        held = {"dense": 0, "s2": 0}
        for group, n in zip(self.groups, pages):
            spec = group.kv_cache_spec
            kind = "s2" if isinstance(spec, (S2AttentionSpec, S2StripeSpec)) else "dense"
            held[kind] += n * spec.page_size_bytes * len(group.layer_names)
        return held

    def peak_pages_per_request(self, length: int) -> int:
        """Pool blocks one request of ``length`` tokens holds at its peak, over every group: a
        full-attention group one page per ``block_size`` tokens, a recycling one (S2) its
        admission cap."""
        in_flight = self.config.max_in_flight_tokens
        pages = 0
        for group in self.groups:
            spec = group.kv_cache_spec
            if hasattr(spec, "max_admission_blocks_per_request"):
                pages += spec.max_admission_blocks_per_request(in_flight, length)
            else:
                pages += -(-length // spec.block_size)
        return pages


def single_request(engine: Engine, length: int, new: int, seed: int) -> dict:
    """One request alone: TTFT, decode tokens/s after the first token, pages held at the end.

    The pages are read only in the request's last ``ACCOUNTING_STEPS`` steps, which the
    tokens/s leaves out: reading them walks every group's block list on the host (33,000 block
    ids a step for HHST at 128k, 31 groups of 2,050 entries), host work that serving does not do
    and that a host-bound step would pay in full."""
    submitted = time.perf_counter()
    engine.submit([prompt(length, seed)], new)
    first = last = None
    tokens = timed = 0
    pages = None
    while engine.engine.has_unfinished_requests():
        accounting = tokens >= new - ACCOUNTING_STEPS
        held = engine.pages_held() if accounting else None
        now, outputs = engine.step()
        pages = held or pages
        for out in outputs:
            tokens = len(out.outputs[0].token_ids)
            if first is None and tokens:
                first = now
            if not accounting:
                last, timed = now, tokens
    if timed < 2:
        raise ValueError(f"{new} new tokens leave no decode step to time; ask for more")
    return dict(
        ttft_s=first - submitted,
        tok_s=(timed - 1) / (last - first),
        pages=pages,
        kv_bytes=engine.group_bytes(pages) if pages else None,
    )


def concurrency_row(engine: Engine, length: int, args) -> dict:
    """The most requests of ``length`` the pool holds at their peak, all submitted at once;
    throughput over the steps in which every admitted request decodes and none waits."""
    pool = engine.manager.kv_cache_config.num_blocks - 1  # less vLLM's null block
    peak = engine.peak_pages_per_request(length + MAX_NEW)
    batch = min(pool // peak, args.max_seqs)
    # Every request keeps decoding until the last prefill ends: one token per engine step.
    prefill_steps = -(-batch * length // args.chunk) + batch
    new = prefill_steps + args.decode_window
    if new > MAX_NEW:
        raise ValueError(f"{batch} requests of {length} need {new} new tokens, over {MAX_NEW}")
    engine.submit([prompt(length, 1000 + i) for i in range(batch)], new)
    scheduler = engine.scheduler
    window, decoded, start, most_running = [], 0, time.perf_counter(), 0
    while engine.engine.has_unfinished_requests():
        running = list(scheduler.running)
        decoding = (
            not scheduler.waiting
            and running
            and all(r.num_computed_tokens >= r.num_prompt_tokens for r in running)
        )
        most_running = max(most_running, len(running))
        before = time.perf_counter()
        now, _ = engine.step()
        if decoding and len(window) < args.decode_window:
            window.append(now - before)
            decoded += len(running)
    seconds = sum(window)
    return dict(
        batch=batch,
        peak_pages=peak,
        pool_blocks=pool,
        most_running=most_running,
        decode_steps=len(window),
        tok_s=decoded / seconds if seconds else None,
        step_ms=1e3 * seconds / len(window) if window else None,
        wall_s=time.perf_counter() - start,
    )


def s2_bounds(length: int, stride: int) -> dict:
    """Bytes of the S2 layers' keys and values at a request's last position of ``length``: the
    union over KV heads of the blocks some query still to come reads (what one KV-cache group
    per layer holds, ``S2ATTN_VLLM_KV_PAGES=union``), and each KV head's own (``S2Cache``)."""
    from s2attn.inference.eviction import kv_last_use
    from s2attn.integrations.transformers import layer_pattern

    config = model_config("hhst", -(-length // BLOCK) * BLOCK, stride)
    kv_heads, dim = MODEL["num_key_value_heads"], 128
    q = (length - 1) // BLOCK
    per_block = BLOCK * dim * 2 * 2  # keys and values, bf16, one KV head
    union = own = 0
    counted = {}  # layers of one pattern share it
    for layer in range(MODEL["num_hidden_layers"]):
        pattern = layer_pattern(config, layer)
        if pattern is None:
            continue
        if id(pattern) not in counted:
            live = kv_last_use(pattern, kv_heads)[:, : q + 1] >= q
            counted[id(pattern)] = (int(live.any(dim=0).sum()) * kv_heads, int(live.sum()))
        union += counted[id(pattern)][0] * per_block
        own += counted[id(pattern)][1] * per_block
    return dict(union=union, s2cache=own)


def worker(args) -> None:
    directory = Path(tempfile.mkdtemp())
    model_config(args.worker, args.max_len, args.stride).save_pretrained(directory)
    loaded = time.perf_counter()
    engine = Engine(directory, args)
    result = dict(
        config=args.worker,
        startup_s=time.perf_counter() - loaded,
        cudagraph_mode=str(engine.config.compilation_config.cudagraph_mode),
        async_scheduling=engine.config.scheduler_config.async_scheduling,
        pool_blocks=engine.manager.kv_cache_config.num_blocks,
        groups=[(type(g.kv_cache_spec).__name__, len(g.layer_names)) for g in engine.groups],
        rows=[],
    )
    Path(args.json).write_text(json.dumps(result, indent=1))
    served_s2 = any("S2" in name for name, _ in result["groups"])
    if served_s2 != (args.worker != "dense"):
        raise RuntimeError(f"the {args.worker} engine's KV-cache groups are {result['groups']}")
    # Warm-up: every kernel compiled and tuned, prefill chunks of full length and a partial one.
    single_request(engine, 2 * args.chunk + BLOCK + 1, 8, seed=1)
    for length in args.prompts:
        runs = []
        for r in range(args.repeats):
            runs.append(single_request(engine, length, args.new, seed=r))
            runs[-1]["host_load"] = host_load()
        row = dict(
            prompt=length,
            ttft_s=statistics.median(run["ttft_s"] for run in runs),
            tok_s=statistics.median(run["tok_s"] for run in runs),
            runs=runs,
            kv_bytes=runs[-1]["kv_bytes"],
            pages=runs[-1]["pages"],
        )
        result["rows"].append(row)
        Path(args.json).write_text(json.dumps(result, indent=1))
        if args.worker != "dense":
            row["s2_bounds"] = s2_bounds(length + args.new - 1, args.stride)
        if args.concurrency_prompts is None or length in args.concurrency_prompts:
            row["most"] = concurrency_row(engine, length, args)
        Path(args.json).write_text(json.dumps(result, indent=1))
        print(json.dumps({k: v for k, v in row.items() if k != "runs"}), flush=True)
    Path(args.json).write_text(json.dumps(result, indent=1))


# --------------------------------------------------------------------------- the parent process
def markdown(results: list[dict], env: dict, args) -> str:
    dense = {r["prompt"]: r for res in results if res["config"] == "dense" for r in res["rows"]}
    description = (
        f"vLLM {env.get('vllm')} serving a 7B-shaped Llama (random weights, bf16, 32 layers, "
        f"32/8 heads of 128): dense, and HHST (layers 8 and 24 dense, the rest S2: block "
        f"{BLOCK}, local {LOCAL}, stride {args.stride}) through s2attn's plugin. Default engine "
        f"(torch.compile and CUDA graphs), pages of {BLOCK}, chunks of {args.chunk} tokens, "
        f"engine core in the benchmark's process. Batch 1: median of {args.repeats} requests "
        f"of {args.new} new tokens, the last {ACCOUNTING_STEPS} untimed (the pages held are read "
        f"there). Largest batch: the most requests the pool holds at their "
        f"peak, throughput over the steps where all decode. `{' '.join(sys.argv)}`."
    )
    if any(res["config"] == "hhst-union" for res in results):
        description += (
            " hhst-union: the same HHST, each S2 layer's KV-cache group holding the union over "
            f"KV heads ({KV_PAGES_ENV}=union) instead of each KV head's stripes apart."
        )
    lines = heading("vLLM serving", env, description)
    lines += [host_line(env), ""]
    header = [
        "config",
        "prompt",
        "TTFT s",
        "x dense",
        "batch-1 tok/s",
        "x dense",
        "largest batch",
        "tok/s there",
        "x dense",
        "KV GiB / seq (dense + S2 layers)",
    ]
    rows = []
    for res in results:
        for r in res["rows"]:
            base = dense.get(r["prompt"])
            most = r.get("most") or {}
            base_most = (base or {}).get("most") or {}
            kv = r["kv_bytes"] or {"dense": float("nan"), "s2": float("nan")}
            rows.append(
                [
                    res["config"],
                    r["prompt"],
                    cell(r["ttft_s"], "{:.2f}"),
                    cell(base and base["ttft_s"] / r["ttft_s"], "{:.2f}"),
                    cell(r["tok_s"], "{:.1f}"),
                    cell(base and r["tok_s"] / base["tok_s"], "{:.2f}"),
                    most.get("most_running", "-"),
                    cell(most.get("tok_s"), "{:.0f}"),
                    cell(
                        most.get("tok_s")
                        and base_most.get("tok_s")
                        and most["tok_s"] / base_most["tok_s"],
                        "{:.2f}",
                    ),
                    f"{(kv['dense'] + kv['s2']) / GIB:.2f} ({kv['dense'] / GIB:.2f} + "
                    f"{kv['s2'] / GIB:.2f})",
                ]
            )
    lines += table(header, rows)
    bounds = [
        (res["config"], r["prompt"], r)
        for res in results
        for r in res["rows"]
        if "s2_bounds" in r and r["kv_bytes"]
    ]
    if bounds:
        lines += ["", "KV held in the S2 layers per sequence, at its last token:", ""]
        lines += table(
            [
                "config",
                "prompt",
                "vLLM holds GiB",
                "union over KV heads GiB",
                "S2Cache GiB",
                "vLLM / S2Cache",
            ],
            [
                [
                    config,
                    p,
                    f"{r['kv_bytes']['s2'] / GIB:.3f}",
                    f"{r['s2_bounds']['union'] / GIB:.3f}",
                    f"{r['s2_bounds']['s2cache'] / GIB:.3f}",
                    cell(r["kv_bytes"]["s2"] / r["s2_bounds"]["s2cache"], "{:.2f}"),
                ]
                for config, p, r in bounds
            ],
        )
    lines += ["", "Engines:", ""]
    for res in results:
        sched = {True: "on", False: "off"}.get(res.get("async_scheduling"), "not recorded")
        groups = Counter(tuple(g) for g in res["groups"])
        lines.append(
            f"- {res['config']}: start-up {res['startup_s']:.0f} s, CUDA graphs "
            f"{res['cudagraph_mode']}, asynchronous scheduling {sched}, pool "
            f"{res['pool_blocks']} blocks; KV-cache groups: "
            + ", ".join(f"{k} {name} of {n} layers" for (name, n), k in groups.items())
        )
    load = load_text(env["host_load_start"])
    lines += ["", f"Host load per batch-1 request: see the JSON ({load} at the start)."]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = repeats_argument(parser(__doc__))
    ap.add_argument("--prompts", type=int, nargs="+", default=[32768, 131072])
    ap.add_argument(
        "--configs",
        nargs="*",
        default=["dense", "hhst"],
        choices=CONFIGS,
        help="hhst-union: HHST with one KV-cache group per S2 layer pair, the union over KV heads "
        f"({KV_PAGES_ENV}=union); none: no engine, the table from --workers-dir's results (with "
        "--generate, to add generate's rows in a call of their own)",
    )
    ap.add_argument("--stride", type=int, default=64)
    ap.add_argument("--new", type=int, default=128, help="new tokens of a batch-1 request")
    ap.add_argument("--chunk", type=int, default=8192, help="vLLM's max_num_batched_tokens")
    ap.add_argument("--max-seqs", type=int, default=256)
    ap.add_argument(
        "--decode-window",
        type=int,
        default=48,
        help="steps all requests of the largest batch decode together",
    )
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument(
        "--concurrency-prompts",
        type=int,
        nargs="*",
        help="prompt lengths of the largest-batch rows (default: every --prompts; none: skip)",
    )
    ap.add_argument(
        "--workers-dir",
        type=Path,
        help="keep each engine's results here; engines not in --configs are read from it, so "
        "that runs split across calls make one table",
    )
    ap.add_argument(
        "--generate",
        action="store_true",
        help="also transformers' generate at the same prompts (bench_serving.py), for reference",
    )
    ap.add_argument("--worker", choices=CONFIGS, help=argparse.SUPPRESS)
    ap.add_argument("--json", help=argparse.SUPPRESS)
    ap.set_defaults(repeats=3)
    args = ap.parse_args()
    if not ACCOUNTING_STEPS + 2 <= args.new <= MAX_NEW:
        ap.error(f"--new is from {ACCOUNTING_STEPS + 2} to {MAX_NEW}")
    args.max_len = max(args.prompts) + MAX_NEW
    if args.worker:
        worker(args)
        return 0
    env = start("vLLM serving")
    if env is None:
        return 1
    import vllm

    env["vllm"] = vllm.__version__
    results = []
    workers = args.workers_dir or Path(tempfile.mkdtemp())
    workers.mkdir(parents=True, exist_ok=True)
    for name in CONFIGS:
        out = workers / f"{name}.json"
        if name in args.configs:
            command = [
                sys.executable,
                __file__,
                *sys.argv[1:],
                "--worker",
                name,
                "--json",
                str(out),
            ]
            environ = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
            if name == "hhst-union":
                environ[KV_PAGES_ENV] = "union"
            code = subprocess.call(command, env=environ)
            if code:
                print(f"{name}: the worker exited with {code}", file=sys.stderr)
        if out.exists() and (name in args.configs or args.workers_dir):
            results.append(json.loads(out.read_text()))
    generate = generate_rows(workers, args)
    finish(env)
    payload = dict(
        env=env,
        model=MODEL,
        args={k: str(v) for k, v in vars(args).items()},
        results=results,
        rows=[r for res in results for r in res["rows"]],
        generate_rows=generate,
    )
    text = markdown(results, env, args) + generate_markdown(generate)
    write_results(args.out_dir, result_stem(env, "vllm" + args.tag), text, payload)
    return 0


def generate_rows(workers: Path, args) -> list[dict]:
    """transformers' ``generate`` on the same GPU, for reference: ``bench_serving.py`` (eager
    decode at the same prompts and stride, and static caches with a compiled decode step at the
    longest; dense SDPA against HHST through ``S2Cache``) after the vLLM engines, with
    ``--generate``; else the rows a run kept in ``--workers-dir``."""
    out = workers / "generate"
    if args.generate:
        prompts = ",".join(map(str, args.prompts))
        command = [sys.executable, str(Path(__file__).with_name("bench_serving.py")),
                   "--prompts", prompts, "--compiled", "--compiled-prompts", str(max(args.prompts)),
                   "--stride", str(args.stride), "--repeats", str(args.repeats),
                   "--out-dir", str(out)]  # fmt: skip
        code = subprocess.call(command)
        if code:
            print(f"generate: bench_serving.py exited with {code}", file=sys.stderr)
    found = sorted(out.glob("*_serving*.json")) if out.is_dir() else []
    return json.loads(found[-1].read_text())["rows"] if found else []


def generate_markdown(rows: list[dict]) -> str:
    if not rows:
        return ""
    lines = [
        "",
        "transformers `generate` on the same GPU in the same run (`bench_serving.py`: eager "
        "DynamicCache / S2Cache, and static caches with a compiled decode step; batch-1 and "
        "largest-batch decode from caches filled with random keys and values):",
        "",
    ]
    lines += table(
        ["config", "prompt", "TTFT s", "batch-1 tok/s", "largest batch", "tok/s there",
         "KV GiB / seq"],
        ([r["config"], r["prompt"], cell(r["ttft_s"], "{:.2f}"), f"{r['one']['tok_s']:.1f}",
          r["max"]["batch"], f"{r['max']['tok_s']:.0f}", f"{r['max']['per_seq_gib']:.3f}"]
         for r in rows),
    )  # fmt: skip
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
