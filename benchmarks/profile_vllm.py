"""Where a batch-1 decode step of vLLM's engine goes: the 7B shape, dense or HHST, one request.

The engine as ``bench_vllm.py`` builds it (random weights, vLLM's default engine: torch.compile,
full CUDA graphs of decode batches, asynchronous scheduling), stepped by hand in this process.
One request of ``--prompt`` random tokens is prefilled, then its decode steps are measured:

- **Wall**: ms per engine step, the median of three runs of ``--steps`` steps.
- **GPU**: the kernels' device time per step (torch.profiler over ``--steps`` steps), the
  largest kernels by name; against the wall, what the host leaves idle.
- **Host**: cProfile over ``--steps`` steps, the functions with the most time of their own
  (cProfile's own overhead inflates Python-heavy functions; read it for proportions).

    python benchmarks/profile_vllm.py                       # HHST at 128k
    python benchmarks/profile_vllm.py --config dense --prompt 32768

Needs a CUDA GPU and vLLM with s2attn's plugin. Writes markdown and JSON with the device,
versions and date to benchmarks/results/.
"""

from __future__ import annotations

import cProfile
import io
import os
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

from bench_vllm import BLOCK, CONFIGS, Engine, model_config, prompt, single_request
from run_info import finish, heading, host_line, parser, result_stem, start, table, write_results

from s2attn.integrations.vllm_paged import KV_PAGES_ENV


def decode_steps(engine: Engine, n: int) -> float:
    """ms per step over ``n`` engine steps."""
    began = time.perf_counter()
    for _ in range(n):
        engine.step()
    return (time.perf_counter() - began) / n * 1e3


def kernels(engine: Engine, steps: int) -> tuple[float, list[list]]:
    """(GPU ms per step, the 15 largest kernels: name, calls per step, us per call, ms per
    step)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        decode_steps(engine, steps)
    events = [e for e in prof.key_averages() if e.self_device_time_total > 0]
    total = sum(e.self_device_time_total for e in events) / steps / 1e3
    events.sort(key=lambda e: e.self_device_time_total, reverse=True)
    top = [
        [e.key[:70], e.count / steps, e.self_device_time_total / e.count,
         e.self_device_time_total / steps / 1e3]
        for e in events[:15]
    ]  # fmt: skip
    return total, top


def host_functions(engine: Engine, steps: int) -> list[list]:
    """The 20 functions with the most time of their own: where, calls per step, us per step."""
    profiler = cProfile.Profile()
    profiler.enable()
    decode_steps(engine, steps)
    profiler.disable()
    stats = pstats.Stats(profiler, stream=io.StringIO()).sort_stats("tottime")
    rows = []
    for (path, line, name), (_, calls, own, _, _) in list(stats.stats.items()):
        rows.append([f"{Path(path).name}:{line}({name})", calls / steps, own / steps * 1e6])
    rows.sort(key=lambda r: r[2], reverse=True)
    return rows[:20]


def markdown(result: dict, env: dict, args) -> str:
    description = (
        f"vLLM {env.get('vllm')}, the 7B shape {args.config}, one request of {args.prompt} random "
        f"tokens decoding; default engine, pages of 64, engine core in this process. "
        f"`{' '.join(sys.argv)}`."
    )
    lines = heading("vLLM batch-1 decode step", env, description)
    lines += [host_line(env), ""]
    lines += [
        f"Wall {result['wall_ms']:.2f} ms a step (runs {result['wall_runs']}); the kernels' "
        f"device time {result['gpu_ms']:.2f} ms a step; KV-cache groups {result['groups']}.",
        "",
    ]
    lines += table(
        ["kernel", "calls / step", "us / call", "ms / step"],
        ([k, f"{c:.1f}", f"{u:.1f}", f"{m:.3f}"] for k, c, u, m in result["kernels"]),
    )
    lines += ["", "Host (cProfile):", ""]
    lines += table(
        ["function", "calls / step", "us / step, own"],
        ([f, f"{c:.1f}", f"{u:.0f}"] for f, c, u in result["host"]),
    )
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = parser(__doc__)
    ap.add_argument("--config", choices=CONFIGS, default="hhst")
    ap.add_argument("--prompt", type=int, default=131072)
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args()
    env = start("a vLLM decode step")
    if env is None:
        return 1
    import vllm

    env["vllm"] = vllm.__version__
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if args.config == "hhst-union":
        os.environ[KV_PAGES_ENV] = "union"
    max_len = args.prompt + 2048
    directory = Path(tempfile.mkdtemp())
    model_config(args.config, max_len, 64).save_pretrained(directory)
    engine_args = SimpleNamespace(
        max_len=max_len, chunk=8192, max_seqs=256, gpu_memory_utilization=0.9
    )
    engine = Engine(directory, engine_args)
    # Warm-up as bench_vllm's: full prefill chunks and a partial one, a few decode steps.
    single_request(engine, 2 * engine_args.chunk + BLOCK + 1, 8, seed=1)
    # Enough new tokens for every measured step; stepped until the prefill is done.
    engine.submit([prompt(args.prompt, 2)], 6 * args.steps + 16)
    while not engine.scheduler.running or (
        engine.scheduler.running[0].num_computed_tokens <= args.prompt
    ):
        engine.step()
    runs = [round(decode_steps(engine, args.steps), 3) for _ in range(3)]
    gpu_ms, top = kernels(engine, args.steps)
    result = dict(
        config=args.config,
        prompt=args.prompt,
        wall_ms=statistics.median(runs),
        wall_runs=runs,
        gpu_ms=gpu_ms,
        kernels=top,
        host=host_functions(engine, args.steps),
        groups=len(engine.groups),
    )
    finish(env)
    payload = dict(env=env, args={k: str(v) for k, v in vars(args).items()}, rows=[result])
    stem = result_stem(env, f"profile_vllm_{args.config}_{args.prompt // 1024}k{args.tag}")
    write_results(args.out_dir, stem, markdown(result, env, args), payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
