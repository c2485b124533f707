"""The ceiling every attention figure is read against: what the kept work costs at the GPU's
own measured limits.

For each case of ``bench_attention.py`` (same patterns, batch 1, bf16, causal) and pass:

- *kept FLOPs*: the pattern's kept token pairs x 4 x head dim (forward; x 3.5 for forward and
  backward), as ``bench_attention.py`` counts effective TFLOP/s;
- *compulsory bytes*: what the pass must read and write once (forward: Q, K, V, O and the LSE;
  backward adds dO, dQ, dK, dV and the row statistics);
- the *ceiling*: the longer of the FLOPs at the measured dense bf16 GEMM rate and the bytes at
  the measured copy bandwidth, and the effective TFLOP/s that time gives;
- the *schedule's ceiling*: the same for the matrix products the kernels run, which exceed the
  credited ones backward: dK/dV runs four per kept tile (S^T, dP^T, dV, dK) and dQ three (it
  recomputes S and dP rather than sum dQ over programs with atomics, which would not be
  deterministic), 4.5x the forward's two where the count credits 3.5x.

With ``--measured`` (a ``bench_attention.py`` JSON) each s2attn time is set against its ceiling:
the share of the limit reached. The limits are measured here, on this GPU: a large bf16 matmul
(``--gemm-size``) and a device-to-device copy (``--copy-gib``); ``--gemm-tflops`` and
``--bandwidth-gbs`` give them instead (e.g. on a CPU, ``--smoke``).

    python benchmarks/ceiling.py --measured docs/results/2026-11-26_h100_attention_main.json
    python benchmarks/ceiling.py --smoke --gemm-tflops 800 --bandwidth-gbs 3000   # CPU

Writes ``<date>_<device>_ceiling.{md,json}`` to ``--out-dir``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from bench_attention import Case, cases
from run_info import environment, result_stem, versions_line, write_results

RESULTS = Path(__file__).resolve().parent / "results"
BYTES = 2  # bf16
PASSES = {"fwd": 1.0, "fwd+bwd": 3.5}  # credited FLOPs, in forwards
EXECUTED = {"fwd": 1.0, "fwd+bwd": 4.5}  # the products the kernels run (2 + 4 + 3 per kept tile)


def measure_gemm_tflops(size: int) -> float:
    """Dense bf16 matmul rate of this GPU, TFLOP/s (median of repeated launches)."""
    import triton.testing

    a, b = (torch.randn(size, size, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    ms = triton.testing.do_bench(lambda: a @ b, warmup=50, rep=300)
    return 2 * size**3 / ms / 1e9


def measure_bandwidth_gbs(gib: float) -> float:
    """Device memory bandwidth of a plain copy, GB/s (bytes read plus bytes written)."""
    import triton.testing

    n = int(gib * 2**30) // 2
    src = torch.empty(n, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=20, rep=200)
    return 2 * n * 2 / ms / 1e6


def compulsory_bytes(case: Case, backward: bool) -> int:
    """Bytes a pass reads and writes at least once."""
    q_rows = case.seq * case.heads * case.dim * BYTES  # Q, O, dO or dQ
    kv_rows = case.seq * case.kv_heads * case.dim * BYTES  # K, V, dK or dV
    stats = case.seq * case.heads * 4  # one float32 per row
    forward = 2 * q_rows + 2 * kv_rows + stats  # Q, K, V in; O, LSE out
    if not backward:
        return forward
    # Backward: Q, K, V, O, dO, LSE in (and delta, written and read); dQ, dK, dV out.
    return forward + 3 * q_rows + 4 * kv_rows + 3 * stats


def ceiling_rows(suite: str, seqs: list[int], gemm_tflops: float, bandwidth_gbs: float):
    rows = []
    for case in cases(suite, seqs):
        kept = case.pattern().kept_token_pairs(case.seq)
        for pass_name, factor in PASSES.items():
            flops = kept * 4 * case.dim * factor
            moved = compulsory_bytes(case, pass_name != "fwd")
            compute_ms = flops / gemm_tflops / 1e9
            memory_ms = moved / bandwidth_gbs / 1e6
            ms = max(compute_ms, memory_ms)
            schedule_ms = max(compute_ms * EXECUTED[pass_name] / factor, memory_ms)
            rows.append(
                dict(
                    case=case.name,
                    seq=case.seq,
                    pass_=pass_name,
                    kept_pairs=kept,
                    flops=flops,
                    bytes=moved,
                    compute_ms=compute_ms,
                    memory_ms=memory_ms,
                    ceiling_ms=ms,
                    ceiling_tflops=flops / ms / 1e9,
                    schedule_ceiling_ms=schedule_ms,
                    bound="compute" if compute_ms >= memory_ms else "memory",
                )
            )
    return rows


def attach_measured(rows: list[dict], path: Path) -> None:
    """Add each case's measured s2attn time and the share of the ceiling it reaches."""
    measured = {
        (r["case"], r["seq"], r["pass_"]): r["ms"]
        for r in json.loads(path.read_text())["rows"]
        if r["provider"] == "s2attn" and r.get("ms")
    }
    for row in rows:
        ms = measured.get((row["case"], row["seq"], row["pass_"]))
        row["measured_ms"] = ms
        row["of_ceiling"] = row["ceiling_ms"] / ms if ms else None
        row["of_schedule_ceiling"] = row["schedule_ceiling_ms"] / ms if ms else None


def markdown(rows, env, limits, args) -> str:
    lines = [
        "# Attention ceiling: kept work at the GPU's measured limits",
        "",
        f"{env['device']} · {versions_line(env)}",
        "",
        f"Dense bf16 GEMM {limits['gemm_tflops']:.0f} TFLOP/s, copy bandwidth "
        f"{limits['bandwidth_gbs']:.0f} GB/s ({limits['source']}). Batch 1, bf16, causal; the "
        "cases of `bench_attention.py`. Ceiling = max(kept FLOPs / GEMM rate, compulsory bytes / "
        "bandwidth). Schedule ceiling: the same with the products the kernels run (backward "
        "7 per kept tile, where the FLOP count credits 5)."
        + (f" Measured: `{args.measured}`." if args.measured else ""),
        "",
        "| case | seq | pass | kept FLOPs | bound | ceiling | ceiling TFLOP/s | schedule ceiling "
        "| measured | of ceiling | of schedule ceiling |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    pct = lambda x: "—" if x is None else f"{100 * x:.0f}%"
    for r in rows:
        measured = r.get("measured_ms")
        lines.append(
            f"| {r['case']} | {r['seq'] // 1024}k | {r['pass_']} | {r['flops'] / 1e12:.2f} T | "
            f"{r['bound']} | {r['ceiling_ms']:.3f} ms | {r['ceiling_tflops']:.0f} | "
            f"{r['schedule_ceiling_ms']:.3f} ms | "
            f"{'—' if measured is None else f'{measured:.3f} ms'} | "
            f"{pct(r.get('of_ceiling'))} | {pct(r.get('of_schedule_ceiling'))} |"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--suite", choices=["main", "extras", "all"], default="all")
    ap.add_argument("--seqs", type=int, nargs="+", default=[8192, 32768, 131072])
    ap.add_argument("--measured", type=Path, help="a bench_attention.py JSON to compare with")
    ap.add_argument("--gemm-size", type=int, default=8192)
    ap.add_argument("--copy-gib", type=float, default=4.0)
    ap.add_argument("--gemm-tflops", type=float, help="instead of measuring")
    ap.add_argument("--bandwidth-gbs", type=float, help="instead of measuring")
    ap.add_argument("--smoke", action="store_true", help="CPU: small lengths, limits given")
    ap.add_argument("--out-dir", type=Path, default=RESULTS)
    ap.add_argument("--name", default="ceiling")
    args = ap.parse_args()
    if args.smoke:
        args.seqs = [4096]
    given = args.gemm_tflops is not None and args.bandwidth_gbs is not None
    if not given and not torch.cuda.is_available():
        ap.error("no GPU to measure: give --gemm-tflops and --bandwidth-gbs")
    limits = dict(
        gemm_tflops=args.gemm_tflops or measure_gemm_tflops(args.gemm_size),
        bandwidth_gbs=args.bandwidth_gbs or measure_bandwidth_gbs(args.copy_gib),
        source="given"
        if given
        else f"measured: {args.gemm_size}^3 matmul, {args.copy_gib} GiB copy",
    )
    rows = ceiling_rows(args.suite, args.seqs, limits["gemm_tflops"], limits["bandwidth_gbs"])
    if args.measured:
        attach_measured(rows, args.measured)
    env = environment()
    write_results(
        args.out_dir,
        result_stem(env, args.name),
        markdown(rows, env, limits, args),
        dict(env=env, limits=limits, rows=rows),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
