"""What every benchmark shares: the record of its run (device, library versions, date, and the host
that host-bound timings depend on) and the stem its result files are named by, its timers, its
exactness measure, its markdown tables, its command line, and the writing of its results
(markdown, JSON, an optional plot) to ``benchmarks/results/``."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
import triton

# This checkout's s2attn, installed or not: a benchmark runs from any directory, and a
# PYTHONPATH that carries other packages (wheels unpacked on a GPU machine) leaves it out.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import s2attn

RESULTS = Path(__file__).resolve().parent / "results"


# ------------------------------------------------------------------------------------ the run
def environment() -> dict:
    return dict(
        device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        torch=torch.__version__,
        triton=triton.__version__,
        cuda=torch.version.cuda,
        s2attn=s2attn.__version__,
        host=host(),
        date=datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
    )


def site_source_args() -> list[str]:
    """``--data-root`` flags for the standard library and the site-packages directories of this
    interpreter: the data the committed quality and long-context runs trained on (``s2attn
    train``'s default then; it is the standard library alone now, so that an install cannot move
    a user's run). A benchmark names them so that its command still makes its results."""
    import sysconfig

    roots: list[str] = []
    for name in ("stdlib", "purelib", "platlib"):
        root = Path(sysconfig.get_paths()[name]).resolve()
        if root.is_dir() and str(root) not in roots:
            roots.append(str(root))
    return [flag for root in roots for flag in ("--data-root", root)]


def versions_line(env: dict) -> str:
    return (
        f"{env['date']} · torch {env['torch']} · triton {env['triton']} · CUDA {env['cuda']} · "
        f"s2attn {env['s2attn']}"
    )


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``; elsewhere what ``platform`` knows)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cpu_jiffies() -> tuple[int, int] | None:
    """(busy, total) clock ticks of every CPU since boot, from ``/proc/stat``; None elsewhere."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields) - idle, sum(fields)


def host_load(interval: float = 0.5) -> dict:
    """What else the host is doing now: its load averages, and the cores other processes kept
    busy over ``interval`` seconds (all CPUs' busy time from ``/proc/stat`` less this process's
    own), None where that cannot be read. Batch-1 decode is host-bound, so its timings move with
    this."""
    load = os.getloadavg() if hasattr(os, "getloadavg") else (None, None, None)
    before, own_before = _cpu_jiffies(), os.times()
    time.sleep(interval)
    after, own_after = _cpu_jiffies(), os.times()
    others = None
    if before is not None and after is not None:
        tick = os.sysconf("SC_CLK_TCK")
        busy = (after[0] - before[0]) / tick
        own = (own_after.user + own_after.system) - (own_before.user + own_before.system)
        others = max(0.0, busy - own) / interval
    return dict(load_1m=load[0], load_5m=load[1], other_cores_busy=others)


def host() -> dict:
    """The host beside the device: CPU model and core count."""
    return dict(cpu=cpu_model(), cores=os.cpu_count())


def host_line(env: dict) -> str:
    """``host: <CPU>, <cores> cores; load ... at the start, ... at the end``: what a result file
    says of the host its host-bound figures ran on."""
    h = env["host"]
    loads = [(when, env.get(f"host_load_{when}")) for when in ("start", "end")]
    ends = [f"{load_text(load)} at the {when}" for when, load in loads if load]
    return f"host: {h['cpu']}, {h['cores']} cores; " + ", ".join(ends)


def load_text(load: dict) -> str:
    """A load record in a few words: ``load 1.2, others 0.3 cores``."""
    text = "load " + cell(load["load_1m"], "{:.2f}")
    if load.get("other_cores_busy") is not None:
        text += f", others {load['other_cores_busy']:.1f} cores"
    return text


def result_stem(env: dict, name: str) -> str:
    """``<date>_<device>_<name>``, e.g. ``2026-11-22_h100_decode``."""
    device = env["device"].split()[1].lower() if " " in env["device"] else env["device"]
    return f"{env['date'][:10]}_{device}_{name}"


# ------------------------------------------------------------------------------------- timers
def median_ms(fn: Callable[[], object], **do_bench_args) -> float:
    """Median ms of ``fn`` by ``triton.testing.do_bench`` (25 ms of warm-up, 100 ms of repeats, L2
    flushed before each call); ``do_bench_args`` go to it (e.g. ``grad_to_none``)."""
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median", **do_bench_args)


def graph_ms(fn: Callable[[], object]) -> float | None:
    """Median ms of ``fn`` replayed from a CUDA graph, as serving engines run decode steps: at
    small sizes Python's launch overhead (tens of microseconds a launch) would otherwise be timed.
    None, said on stdout, when the call cannot be captured."""
    try:
        return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")
    except Exception as exc:  # a call that cannot be captured is reported, not hidden
        print(f"    (no CUDA-graph timing: {type(exc).__name__}: {str(exc)[:80]})", flush=True)
        return None


def read_rate_gbs(gib: float, repeats: int, device: str) -> float:
    """The device's read rate, GB/s: ``torch.sum`` over ``gib`` GiB of bf16 (float32 on the CPU),
    best of ``repeats``. A read rate, not a copy rate: the reduction writes nothing back."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    n = int(gib * 2**30) // (torch.finfo(dtype).bits // 8)
    buf = torch.ones(n, dtype=dtype, device=device)
    buf.sum()  # first-call costs
    best = float("inf")
    for _ in range(repeats):
        if device == "cuda":
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            buf.sum()
            end.record()
            end.synchronize()
            seconds = begin.elapsed_time(end) / 1e3
        else:
            t0 = time.perf_counter()
            buf.sum()
            seconds = time.perf_counter() - t0
        best = min(best, seconds)
    nbytes = buf.numel() * buf.element_size()
    del buf
    if device == "cuda":
        torch.cuda.empty_cache()  # the model's weights go where the buffer was
    return nbytes / best / 1e9


def median_run(measure: Callable[[], float], repeats: int) -> tuple[float, list[float]]:
    """The median of ``repeats`` runs of ``measure`` (one timing each), and every run's value:
    host-bound figures move between runs with what else the host does, so one run is not a
    figure."""
    runs = [measure() for _ in range(repeats)]
    return statistics.median(runs), runs


def host_ms(fn: Callable[[], object], calls: int) -> float:
    """Median milliseconds of host time per call of ``fn``, over ``calls`` calls after one
    warm-up. Each call starts on an idle GPU and is timed alone: calls back to back let the GPU's
    queue fill, and then the host waits for the kernels (the timing reads the GPU, not the
    host); the median drops the garbage collector's and the machine's odd slow call."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else lambda: None
    fn()
    times = []
    for _ in range(calls):
        sync()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    sync()
    return statistics.median(times) * 1e3


# ------------------------------------------------------------------------------------- tables
def rel_err(a: torch.Tensor, b: torch.Tensor, piece: int = 8192) -> float:
    """Relative error of ``a`` against the reference ``b``: the norm of the difference over the
    norm of ``b``, in float64, summed over pieces of ``piece`` along the longest dimension (a
    float64 copy of a whole 1M-token tensor would be 16 GiB)."""
    dim = max(range(a.dim()), key=a.shape.__getitem__) if a.dim() else 0
    pieces = zip(a.split(piece, dim), b.split(piece, dim)) if a.dim() else [(a, b)]
    diff2 = ref2 = 0.0
    for x, y in pieces:
        diff2 += (x.double() - y.double()).square().sum().item()
        ref2 += y.double().square().sum().item()
    return (diff2 / ref2) ** 0.5


def cell(x: float | None, spec: str = "{:.3f}") -> str:
    """A table cell: ``x`` formatted by ``spec``, or ``n/a`` when there is no value."""
    return "n/a" if x is None else spec.format(x)


def heading(title: str, env: dict, description: str, versions: str | None = None) -> list[str]:
    """A result file's first lines: ``# <title> — <device>``, the versions line (``versions``
    replaces the default one), and a paragraph saying what was measured and how."""
    return [f"# {title} — {env['device']}", "", versions or versions_line(env), "", description, ""]


def table(header: list[str], rows: Iterable[list]) -> list[str]:
    """A markdown table's lines; every row has one cell per header column."""
    line = lambda cells: "| " + " | ".join(str(c) for c in cells) + " |"
    return [line(header), "|" + " --- |" * len(header), *(line(r) for r in rows)]


# ------------------------------------------------------------------------------ command line
def parser(doc: str) -> argparse.ArgumentParser:
    """A benchmark's argument parser: its description is the first line of ``doc``; ``--tag``
    and ``--out-dir`` name where the results go."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--tag", default="", help="suffix for the result files")
    ap.add_argument("--out-dir", type=Path, default=RESULTS)
    return ap


def repeats_argument(ap: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``--repeats N``: runs of each host-bound (batch-1) timing, of which the median is
    reported."""
    ap.add_argument(
        "--repeats",
        type=int,
        default=5,
        help="runs of each host-bound batch-1 timing; the median is reported (default 5)",
    )
    return ap


def sweep_arguments(ap: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The tuning sweeps' one shape (batch 1, bf16, a causal local-stride pattern) and the passes
    to sweep (``fwd``, ``dkdv``, ``dq``)."""
    for flag, default in (
        ("--seq", 32768),
        ("--heads", 32),
        ("--dim", 128),
        ("--block-size", 64),
        ("--local-blocks", 16),
        ("--stride", 16),
    ):
        ap.add_argument(flag, type=int, default=default)
    ap.add_argument("--passes", default="fwd,dkdv,dq")
    return ap


def start(what: str) -> dict | None:
    """The run's environment, printed as the first line of the output; None, said on stderr, when
    there is no CUDA device to time ``what`` on."""
    if not torch.cuda.is_available():
        print(f"{Path(sys.argv[0]).name} times {what}; no CUDA device here.", file=sys.stderr)
        return None
    env = environment()
    env["host_load_start"] = host_load()
    print(f"{env['device']} · torch {env['torch']} · triton {env['triton']} · {env['date']}")
    print(host_line(env), flush=True)
    return env


def finish(env: dict) -> None:
    """Record the host's load at the end of the run in ``env`` (see :func:`host_load`)."""
    env["host_load_end"] = host_load()


# ------------------------------------------------------------------------------------ results
def write_results(
    out_dir: Path,
    stem: str,
    markdown: str,
    payload: dict,
    plot: Callable[[Path], None] | None = None,
) -> None:
    """Write ``<stem>.md``, ``<stem>.json`` (``payload``: at least ``env`` and ``rows``) and, given
    ``plot``, ``<stem>.png`` to ``out_dir``; then print the markdown and what was written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{stem}.md").write_text(markdown)
    (out_dir / f"{stem}.json").write_text(json.dumps(payload, indent=1))
    if plot is not None:
        plot(out_dir / f"{stem}.png")
    print()
    print(markdown)
    print(f"wrote {out_dir / stem}.{{md,json{',png' if plot is not None else ''}}}")
