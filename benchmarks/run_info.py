"""What every benchmark shares: the record of its run (device, library versions, date) and the stem
its result files are named by, its timers, its exactness measure, its markdown tables, its command
line, and the writing of its results (markdown, JSON, an optional plot) to
``benchmarks/results/``."""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
import triton

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
        date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    )


def versions_line(env: dict) -> str:
    return (
        f"{env['date']} · torch {env['torch']} · triton {env['triton']} · CUDA {env['cuda']} · "
        f"s2attn {env['s2attn']}"
    )


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
    line = lambda cells: "| " + " | ".join(str(c) for c in cells) + " |"  # noqa: E731
    return [line(header), "|" + " --- |" * len(header), *(line(r) for r in rows)]


# ------------------------------------------------------------------------------ command line
def parser(doc: str) -> argparse.ArgumentParser:
    """A benchmark's argument parser: its description is the first line of ``doc``; ``--tag``
    and ``--out-dir`` name where the results go."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--tag", default="", help="suffix for the result files")
    ap.add_argument("--out-dir", type=Path, default=RESULTS)
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
    print(f"{env['device']} · torch {env['torch']} · triton {env['triton']} · {env['date']}")
    return env


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
