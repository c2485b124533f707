"""Host time and peak host memory of a pattern's checks, each in a process of its own.

Does a pattern's ``density``, ``kept_token_pairs``, per-head counts, ``is_kv_efficient`` and
``is_union_complete`` stay cheap at millions of tokens? Each check runs in a fresh subprocess that
imports s2attn, builds the pattern and calls the check once: seconds are the call's wall time,
peak MiB the process's ``ru_maxrss`` less that of a process that only imports s2attn (building a
rule pattern costs next to nothing, so the peak is the check's). The CPU only; no kernel runs.

Rows: ``local_stride_pattern(heads, block_size=64, local_blocks=16, vert_stride=stride)`` at each
of ``--tokens`` and ``--strides`` (rules: closed forms per distinct rule), its head slice and crop,
and the same pattern given as block lists (``BlockPattern.from_block_lists``) at ``--list-tokens``
with ``--list-heads`` heads, walked a bounded chunk of rows at a time; there the peak includes the
lists themselves (``lists MiB``) and their building and checking (``from_block_lists``), so a
second column, the check's own MiB, gives the peak past the resident set once the pattern is
built (Linux's VmHWM, reset through ``/proc/self/clear_refs``; n/a elsewhere).

Then the forward, dK/dV and dQ layouts of ``--layout-heads`` heads at ``--layout-tokens`` and
``--layout-stride``, one per process, as a CUDA call at head dim 128 builds them (Triton's tiles),
here on the host: wall and CPU seconds, peak, and the GiB each layout holds. The host's load
average, at the start and the end, goes into the results: on a shared host, wall seconds stretch
with it.

    python benchmarks/pattern_checks.py
    python benchmarks/pattern_checks.py --tokens 1048576 4194304 --strides 32 64 --heads 32
    python benchmarks/pattern_checks.py --tokens --list-tokens 0 --tag layouts   # layouts only
"""

from __future__ import annotations

import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's s2attn, installed or not

CHECKS = {
    "density()": lambda p, n: p.density(),
    "kept_token_pairs(n - 1)": lambda p, n: p.kept_token_pairs(n - 1),
    "kept_blocks_per_head()": lambda p, n: p.kept_blocks_per_head().tolist(),
    "num_kept_blocks": lambda p, n: p.num_kept_blocks,
    "is_kv_efficient()": lambda p, n: p.is_kv_efficient(),
    "is_union_complete()": lambda p, n: p.is_union_complete(),
    "is_union_complete(num_kv_heads=8)": lambda p, n: p.is_union_complete(num_kv_heads=8),
    "[8:16].density()": lambda p, n: p[8:16].density(),
    "crop(half).is_union_complete()": lambda p, n: p.crop(p.num_q_blocks // 2).is_union_complete(),
}
LIST_CHECKS = ["density()", "num_kept_blocks", "is_kv_efficient()", "is_union_complete()"]
# The layouts of a CUDA call at head dim 128 in bf16 on Triton's tiles (forward 128x64, dK/dV
# and dQ 64x64: dispatch.forward_tile_sizes, backward_tile_sizes), built here on the host as a
# GPU call builds them on its device. Their answer: the GiB the layout holds.
LAYOUTS = {  # check -> (builder in s2attn.ops.layout, block_m, block_n)
    "forward_layout (128x64), GiB": ("forward_layout", 128, 64),
    "backward_layout (dK/dV, 64x64), GiB": ("backward_layout", 64, 64),
    "forward_layout (dQ, 64x64), GiB": ("forward_layout", 64, 64),
}


def _build_layout(check: str, p):
    from s2attn.ops import layout

    builder, block_m, block_n = LAYOUTS[check]
    # The per-KV-tile lists run to the end of the pattern: a call crops them to its length.
    crop = p.num_q_blocks if builder == "backward_layout" else None
    return getattr(layout, builder)(p, block_m, block_n, "cpu", crop, gather=True)


def _held_gib(layout) -> float:
    import torch

    parts = [vars(layout)] + ([vars(layout.gathered_kv)] if layout.gathered_kv else [])
    return sum(t.nbytes for d in parts for t in d.values() if isinstance(t, torch.Tensor)) / 2**30


def _pattern(kind: str, tokens: int, heads: int, stride: int):
    import torch

    import s2attn

    rules = s2attn.local_stride_pattern(
        heads, max_seq_len=tokens, block_size=64, local_blocks=16, vert_stride=stride
    )
    if kind == "rules":
        return rules
    # The lists a chunk of rows at a time, so that building them costs little past their size.
    nb, step = rules.num_q_blocks, 1024
    counts, cols = [], []
    for h in range(heads):
        for first in range(0, nb, step):
            i, j = rules.row_blocks(h, first, min(first + step, nb))
            counts.append(torch.bincount(i - first, minlength=min(step, nb - first)))
            cols.append(j.to(torch.int32))
    offsets = torch.zeros(heads * nb + 1, dtype=torch.int64)
    offsets[1:] = torch.cat(counts).cumsum(0)
    return s2attn.BlockPattern.from_block_lists(
        offsets, torch.cat(cols), num_heads=heads, num_kv_blocks=nb, block_size=64
    )


def _child(spec: dict | None) -> None:
    """One measurement, printed as JSON: the import-only baseline when ``spec`` is None."""
    import torch

    import s2attn  # noqa: F401  (the baseline's imports)

    if spec is None:
        print(json.dumps({"maxrss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}))
        return
    if spec["threads"]:
        torch.set_num_threads(spec["threads"])
    p = _pattern(spec["kind"], spec["tokens"], spec["heads"], spec["stride"])
    lists_mib = 0.0 if p.rules is not None else (p.row_offsets.nbytes + p.cols.nbytes) / 2**20
    resident = _reset_peak()
    t0 = time.perf_counter()
    cpu0 = time.process_time()
    if spec["check"] in LAYOUTS:
        answer = _held_gib(_build_layout(spec["check"], p))
    else:
        answer = CHECKS[spec["check"]](p, spec["tokens"])
    seconds, cpu_seconds = time.perf_counter() - t0, time.process_time() - cpu0
    own_kib = None if resident is None else _status_kib("VmHWM") - resident
    if isinstance(answer, list):  # per-head counts: their sum stands for them
        answer = sum(answer)
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    got = dict(seconds=seconds, cpu_seconds=cpu_seconds, maxrss_kib=maxrss, own_kib=own_kib)
    got["lists_mib"] = lists_mib
    print(json.dumps(dict(got, answer=answer)))


def _status_kib(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def _reset_peak() -> int | None:
    """Linux's peak resident set (VmHWM) reset to the resident set now, which is returned: the
    check's own peak is then VmHWM less it, apart from building the pattern (block lists cost
    more to build than to check). None where the kernel offers no reset."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return _status_kib("VmRSS")
    except (OSError, KeyError):
        return None


def _run_child(spec: dict | None, timeout: float) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    out = subprocess.run(
        [sys.executable, __file__, "--one", json.dumps(spec)],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )
    if out.returncode != 0:
        return dict(error=f"exit {out.returncode}: {out.stderr.strip()[-200:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> None:
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

    ap = parser(__doc__)
    ap.add_argument("--tokens", type=int, nargs="*", default=[1048576, 4194304])
    ap.add_argument("--strides", type=int, nargs="+", default=[32, 64])
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--list-tokens", type=int, default=1048576)
    ap.add_argument("--list-heads", type=int, default=8)
    ap.add_argument("--layout-tokens", type=int, default=1048576, help="0: no layout row")
    ap.add_argument("--layout-heads", type=int, default=16)
    ap.add_argument("--layout-stride", type=int, default=64)
    ap.add_argument("--timeout", type=float, default=600, help="seconds per check's process")
    ap.add_argument(
        "--threads", type=int, default=0, help="torch threads in each check (0: torch's default)"
    )
    args = ap.parse_args()

    env = environment()
    env["cpu"] = f"{_cpu_name()}, {os.cpu_count()} cores"
    env["threads"] = args.threads or "default"
    env["host_load_start"] = host_load()
    print(f"{env['cpu']} · torch {env['torch']} · {env['date']}", flush=True)
    base = _run_child(None, args.timeout)["maxrss_kib"]
    print(f"import-only baseline: {base / 1024:.0f} MiB", flush=True)

    def spec(kind: str, check: str, tokens: int, heads: int, stride: int) -> dict:
        return dict(
            kind=kind, check=check, tokens=tokens, heads=heads, stride=stride, threads=args.threads
        )

    specs = [
        spec("rules", c, n, args.heads, s)
        for n in args.tokens
        for s in args.strides
        for c in CHECKS
    ]
    if args.list_tokens:
        specs += [
            spec("lists", c, args.list_tokens, args.list_heads, s)
            for s in args.strides
            for c in LIST_CHECKS
        ]
    if args.layout_tokens:
        specs += [
            spec("rules", c, args.layout_tokens, args.layout_heads, args.layout_stride)
            for c in LAYOUTS
        ]
    rows = []
    for spec in specs:
        got = _run_child(spec, args.timeout)
        row = dict(spec, baseline_mib=base / 1024)
        if "error" in got:
            row["error"] = got["error"]
        else:
            row.update(
                seconds=got["seconds"],
                cpu_seconds=got["cpu_seconds"],
                peak_mib=(got["maxrss_kib"] - base) / 1024,
                own_mib=None if got["own_kib"] is None else got["own_kib"] / 1024,
                lists_mib=got["lists_mib"],
                answer=got["answer"],
            )
        rows.append(row)
        shown = row.get("error") or f"{row['seconds']:.4f} s, peak {row['peak_mib']:.1f} MiB"
        where = f"{spec['kind']:>5} {spec['tokens']:>8} h{spec['heads']} s{spec['stride']}"
        print(f"{where} {spec['check']:<34} {shown}", flush=True)

    finish(env)

    def cells(r: dict) -> list:
        if "error" in r:
            measured = [r["error"], "", "", "", "", ""]
        else:
            answer = f"{r['answer']:.6f}" if isinstance(r["answer"], float) else r["answer"]
            own = "n/a" if r["own_mib"] is None else f"{r['own_mib']:.1f}"
            measured = [f"{r['seconds']:.4f}", f"{r['cpu_seconds']:.4f}", f"{r['peak_mib']:.1f}"]
            measured += [own, f"{r['lists_mib']:.0f}"]
            measured.append(answer)
        return [f"`{r['check']}`", r["kind"], r["tokens"], r["heads"], r["stride"], *measured]

    header = ["check", "pattern", "tokens", "heads", "stride", "seconds", "CPU seconds", "peak MiB"]
    header += ["check's own MiB", "lists MiB", "answer"]
    description = (
        f"{env['cpu']}, torch threads: {env['threads']}. Each check alone in a fresh process: "
        "seconds of the one call; peak MiB the process's ru_maxrss less an import-only "
        f"process's ({base / 1024:.0f} MiB). "
        "Patterns: local_stride_pattern(heads, block_size=64, local_blocks=16, vert_stride="
        "stride); `lists` is the same pattern given as block lists (its peak includes the lists "
        "and their building). Check's own MiB: the peak past the resident set once the pattern is "
        "built (Linux's VmHWM, reset through /proc/self/clear_refs). CPU seconds: the "
        "process's CPU time in the call, every thread's. Layouts: those of a CUDA call at head "
        "dim 128 in bf16 on Triton's tiles, built on the host; their answer is the GiB the "
        f"layout holds. The {host_line(env)}: other processes sharing the cores stretch the "
        "seconds, and the CPU seconds less."
        f"\n\nCommand: `python benchmarks/{Path(__file__).name} {' '.join(sys.argv[1:])}`"
    )
    lines = heading("Pattern checks: host time and memory", env, description)
    lines += table(header, [cells(r) for r in rows])
    name = "pattern_checks" + (f"_{args.tag}" if args.tag else "")
    write_results(
        args.out_dir,
        result_stem(env, name),
        "\n".join(lines) + "\n",
        dict(env=env, baseline_mib=base / 1024, rows=rows),
    )


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--one":
        _child(json.loads(sys.argv[2]))
    else:
        main()
