"""Several runs of the quality experiment side by side: per variant, the spread over seeds.

One run of ``quality_experiment.py`` is one seed: a 0.3% difference between two variants may be
noise. Give this script the JSON each run wrote (``--seed`` differing, ``--name`` telling them
apart) and it tabulates, per variant, the mean and the range of the validation loss, its gap to
dense (within each seed, then averaged), and the needle accuracy, so a claimed difference can be
read against the seed-to-seed spread. Runs of one seed may come as several files (one variant each,
as when each run trains alone): they are joined by seed, and each variant's gap is taken against
the dense run of its own seed (none where that seed has no dense run). A second table lists every
run with the device it ran on, since the runs of one comparison may come from different machines.

    python benchmarks/quality_seeds.py benchmarks/results/*_quality_seed*.json

Writes ``<first run's date>_<device>_quality_seeds.{md,json}`` to ``--out-dir``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from run_info import cell, result_stem, versions_line, write_results

RESULTS = Path(__file__).resolve().parent / "results"


def join_seeds(runs: list[dict]) -> list[dict]:
    """One run per seed, holding the rows of every file of that seed; each row's ``vs_dense``
    taken against that seed's dense row (None without one)."""
    joined: dict[int, dict] = {}
    for run in runs:
        seed_run = joined.setdefault(run["seed"], {**run, "rows": []})
        for row in run["rows"]:
            if any(r["variant"] == row["variant"] for r in seed_run["rows"]):
                raise ValueError(f"seed {run['seed']} has two {row['variant']!r} runs")
            # Rows of one seed may come from different machines: each keeps its own.
            seed_run["rows"].append(dict(row, device=run["environment"]["device"]))
    for run in joined.values():
        dense = next((r["val_bpb"] for r in run["rows"] if r["variant"] == "dense"), None)
        for row in run["rows"]:
            known = dense is not None and row["val_bpb"] is not None
            row["vs_dense"] = row["val_bpb"] / dense - 1 if known else None
    return list(joined.values())


def aggregate(runs: list[dict]) -> list[dict]:
    """Per variant (dense first, then in the order first seen): seeds, val bits/byte
    mean/min/max, the gap to dense per seed averaged, needle mean averaged and its lowest cell at
    the training length."""
    order = list(dict.fromkeys(r["variant"] for run in runs for r in run["rows"]))
    order.sort(key=lambda variant: variant != "dense")
    rows = []
    for variant in order:
        per_seed = [
            (run["seed"], next(r for r in run["rows"] if r["variant"] == variant))
            for run in runs
            if any(r["variant"] == variant for r in run["rows"])
        ]
        val = [r["val_bpb"] for _, r in per_seed if r["val_bpb"] is not None]
        gaps = [r["vs_dense"] for _, r in per_seed if r.get("vs_dense") is not None]
        lows = [r["needle_min_at_train_len"] for _, r in per_seed]
        rows.append(
            dict(
                variant=variant,
                seeds=[s for s, _ in per_seed],
                val_bpb_mean=statistics.fmean(val) if val else None,
                val_bpb_min=min(val, default=None),
                val_bpb_max=max(val, default=None),
                vs_dense_mean=statistics.fmean(gaps) if gaps else None,
                needle_mean=statistics.fmean(r["needle_mean"] for _, r in per_seed),
                needle_min_at_train_len=min((x for x in lows if x is not None), default=None),
            )
        )
    return rows


def recipe(run: dict) -> str:
    short = run.get("short_steps")
    first = f"{short} steps at {run['short_len']} tokens then " if short else ""
    return f"{first}{run['steps']} steps at {run['train_len']} tokens"


def markdown(rows: list[dict], runs: list[dict], paths: list[str], seed_runs: list[dict]) -> str:
    env = runs[0]["environment"]
    devices = " and ".join(sorted({run["environment"]["device"] for run in runs}))
    lines = [
        "# HHST quality over seeds",
        "",
        f"{devices} · {versions_line(env)}",
        "",
        f"{len(paths)} runs (seeds {sorted({run['seed'] for run in runs})}) of preset "
        f"`{runs[0]['preset']}`, {recipe(runs[0])}: {', '.join(Path(p).name for p in paths)}. "
        "The gap to dense is taken within each seed, then averaged.",
        "",
        "| variant | seeds | val bits/byte mean (min-max) | vs dense | needle mean | lowest needle "
        "cell at train len |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        val = (
            "—"
            if r["val_bpb_mean"] is None
            else f"{r['val_bpb_mean']:.4f} ({r['val_bpb_min']:.4f}-{r['val_bpb_max']:.4f})"
        )
        gap = "—" if r["vs_dense_mean"] is None else f"{100 * r['vs_dense_mean']:+.2f}%"
        low = r["needle_min_at_train_len"]
        lines.append(
            f"| {r['variant']} | {len(r['seeds'])} | {val} | {gap} | {r['needle_mean']:.3f} | "
            f"{'—' if low is None else f'{low:.2f}'} |"
        )
    lines += [
        "",
        "Each run:",
        "",
        "| seed | variant | device | val bits/byte | vs dense, same seed | needle mean | lowest "
        "needle cell at train len |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for run in sorted(seed_runs, key=lambda run: run["seed"]):
        for r in sorted(run["rows"], key=lambda r: r["variant"] != "dense"):
            gap = "—" if r.get("vs_dense") is None else f"{100 * r['vs_dense']:+.2f}%"
            val, low = cell(r["val_bpb"], "{:.4f}"), cell(r["needle_min_at_train_len"], "{:.2f}")
            lines.append(
                f"| {run['seed']} | {r['variant']} | {r['device']} | {val} | {gap} | "
                f"{r['needle_mean']:.3f} | {low} |"
            )
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", help="JSON files written by quality_experiment.py")
    ap.add_argument("--out-dir", type=Path, default=RESULTS)
    ap.add_argument("--name", default="quality_seeds")
    args = ap.parse_args()
    runs = [json.loads(Path(p).read_text()) for p in args.runs]
    recipes = {
        (run["preset"], run["steps"], run.get("short_steps"), run.get("train_args", ""))
        for run in runs
    }
    if len(recipes) > 1:
        ap.error(f"the runs differ in preset, steps or train arguments: {sorted(recipes, key=str)}")
    try:
        seed_runs = join_seeds(runs)
    except ValueError as exc:
        ap.error(str(exc))
    rows = aggregate(seed_runs)
    env = runs[0]["environment"]
    write_results(
        args.out_dir,
        result_stem(env, args.name),
        markdown(rows, runs, args.runs, seed_runs),
        dict(env=env, runs=[str(p) for p in args.runs], rows=rows, seed_runs=seed_runs),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
