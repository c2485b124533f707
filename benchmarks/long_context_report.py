"""Long context's report: from the runs' metrics and evaluations to one markdown table per phase,
needle heat maps and JSON with every number (``benchmarks/long_context.py`` writes it after every
invocation; ``--merge`` makes one from the JSON of invocations run apart).

A run's metrics (``metrics.jsonl``) give its training seconds (steps only), its steady speed and
its validation curve; its ``eval.json`` gives bits per byte and the needle grid, its
``tasks/<task>.json`` (with ``--tasks``) the long-context tasks at the phase length. Each row is
then set against the dense row of its phase and seed: the gap in bits per byte, the speed-ups, the
equal-time view (dense's validation, interpolated over its training seconds, at the moment the row's
run finished), each task's gap in accuracy and, document by document, the gap in bits per byte of
the last bucket of positions.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np
from run_info import result_stem, table, versions_line

from s2attn.training.intervals import MIN_SEQUENCES, bootstrap_interval
from s2attn.training.tasks import POSITIONS

PHASES = ("base", "32k", "128k")
# What `s2attn eval` writes beside each model: the bits per byte and needle grid, and a folder
# of the tasks, a file each.
EVAL_RESULT, TASKS_DIR = "eval.json", "tasks"


# ------------------------------------------------------------------------------- the metrics
def read_rows(path: Path) -> list[dict]:
    rows = []
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except ValueError:
                continue  # a torn last line of a killed run
    return rows


def train_seconds(rows: list[dict]) -> list[tuple[dict, float]]:
    """Each metrics row with the training seconds (steps only) up to it."""
    out, seconds, tokens = [], 0.0, 0
    for r in rows:
        if "tokens_per_s" not in r:
            continue
        seconds += (r["tokens"] - tokens) / max(r["tokens_per_s"], 1e-9)
        tokens = r["tokens"]
        out.append((r, seconds))
    return out


def steady_speed(timed: list[tuple[dict, float]], steps: int) -> float | None:
    """Median tokens/s of the metrics rows past the first tenth of the phase's steps: the speed
    once warm-up (compilation under ``--compile``, the allocator's growth) is over."""
    speeds = sorted(r["tokens_per_s"] for r, _ in timed if r["step"] > steps / 10)
    return speeds[len(speeds) // 2] if speeds else None


# ------------------------------------------------------------------------------- the rows
def _val(row: dict) -> float | None:
    # The metrics rows name validation bits per byte "val_bpb" (formerly "val_loss").
    value = row.get("val_bpb", row.get("val_loss"))
    return None if value is None else float(value)


def at_time(timed: list[tuple[dict, float]], seconds: float) -> float | None:
    """Validation bits per byte of a run at ``seconds`` of training, linearly interpolated
    between its validation rows (its last value once it trained longer than that)."""
    points = [(s, _val(r)) for r, s in timed if _val(r) is not None]
    if not points:
        return None
    if seconds <= points[0][0]:
        return points[0][1] if len(points) == 1 else None
    for (s0, v0), (s1, v1) in zip(points, points[1:]):
        if s0 <= seconds <= s1:
            return v0 + (v1 - v0) * (seconds - s0) / max(s1 - s0, 1e-9)
    return points[-1][1]


def summarize(jobs: list) -> list[dict]:
    """One row per training job of ``long_context.plan_jobs`` (its phase, variant, seed and run
    folder) that has started: its metrics, and its evaluation where it ran."""
    rows = []
    for job in (j for j in jobs if j.kind == "train" and j.phase in PHASES):
        record_path = job.out / "run.json"
        if not record_path.is_file():
            continue
        record = json.loads(record_path.read_text())
        timed = train_seconds(read_rows(job.out / "metrics.jsonl"))
        seconds = timed[-1][1] if timed else None
        tokens = timed[-1][0]["tokens"] if timed else 0
        vals = [_val(r) for r, _ in timed if _val(r) is not None]
        peaks = [r["max_mem_gib"] for r, _ in timed if "max_mem_gib" in r]
        row = dict(
            phase=job.phase,
            variant=job.variant,
            seed=job.seed,
            done=job.done(),
            seq_len=record["options"]["seq_len"],
            steps=record["options"]["steps"],
            step=timed[-1][0]["step"] if timed else 0,
            tokens=tokens,
            train_s=seconds,
            wall_s=timed[-1][0].get("elapsed_s") if timed else None,
            tokens_per_s=tokens / seconds if seconds else None,
            steady_tokens_per_s=steady_speed(timed, record["options"]["steps"]),
            step_s=seconds / timed[-1][0]["step"] if timed else None,
            peak_gib=max(peaks) if peaks else None,
            final_val=vals[-1] if vals else None,
            density=record["model"]["mean_density"],
            parameters=record["model"]["parameters"],
            rope=record["model"].get("rope"),
            device=record["device"],
            versions=record["versions"],
            date=record["date"],
            curve=[
                {"step": r["step"], "train_s": s, "val_bpb": _val(r)}
                for r, s in timed
                if _val(r) is not None
            ],
        )
        ev = _read_result(job.out / EVAL_RESULT)
        if ev is not None:
            cells = [v for per_len in ev.get("accuracy", {}).values() for v in per_len.values()]
            row.update(
                val_bpb=ev.get("val_bpb"),
                needle=ev.get("accuracy"),
                eval_s=ev.get("wall_s"),
                eval_peak_gib=ev.get("max_mem_gib"),
                needle_mean=sum(cells) / len(cells) if cells else None,
                needle_min=min(cells) if cells else None,
            )
        parts = [_read_result(p) for p in sorted((job.out / TASKS_DIR).glob("*.json"))]
        parts = [p for p in parts if p and p.get("tasks")]
        if parts:
            # Each file holds one task beside the settings every one shares (level, seed).
            tasks = {k: v for p in parts for k, v in p["tasks"].items()}
            row.update(
                tasks=tasks,
                tasks_corpus=parts[0].get("corpus"),
                tasks_s=sum(p.get("wall_s") or 0.0 for p in parts),
            )
        rows.append(row)
    return compare_with_dense(rows)


def _read_result(path: Path) -> dict | None:
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except ValueError:
        return {}  # being written, or torn by a killed run


def task_cells(row: dict) -> dict[str, dict]:
    """The row's long-context task results at its phase length: ``{task: cell}``."""
    key = str(row["seq_len"])
    tasks = row.get("tasks") or {}
    return {t: by[key] for t, by in tasks.items() if isinstance(by, dict) and key in by}


def paired_mean(differences: list[float]) -> dict | None:
    """The mean of per-document differences with its 95% percentile bootstrap interval, as
    ``s2attn eval`` gives each bucket's; None below two documents."""
    if len(differences) < MIN_SEQUENCES:
        return None
    low, high = bootstrap_interval(np.asarray(differences)[:, None])
    return {"mean": float(np.mean(differences)), "ci": [float(low[0]), float(high[0])]}


def _same_documents(a: dict, b: dict, row: dict, dense: dict) -> bool:
    # The eval picks its documents by seed from the validation split: the same corpus and seed
    # give the same documents in the same order.
    edges = [[(x["start"], x["end"]) for x in c["buckets"]] for c in (a, b)]
    seeds = [(r.get("tasks") or {}).get("seed") for r in (row, dense)]
    return (
        a["n"] == b["n"]
        and edges[0] == edges[1]
        and seeds[0] == seeds[1]
        and row.get("tasks_corpus") == dense.get("tasks_corpus")
    )


def compare_tasks(row: dict, dense: dict | None) -> None:
    """``row``'s far-context gain (its first bucket of positions less its last, document by
    document) and, against ``dense`` (the dense row of its phase and seed, or None), each task's
    gap in accuracy and the last bucket's gap in bits per byte, document by document."""
    cells = task_cells(row)
    positions = cells.get(POSITIONS)
    row["far_context"] = positions and paired_mean(
        [s[0] - s[-1] for s in positions["per_sequence"]]
    )
    row["tasks_vs_dense"] = {}
    if dense is None or row is dense:
        return
    for name, cell in cells.items():
        theirs = task_cells(dense).get(name)
        if theirs is None:
            continue
        if name != POSITIONS:
            row["tasks_vs_dense"][name] = cell["accuracy"] - theirs["accuracy"]
        elif _same_documents(cell, theirs, row, dense):
            row["tasks_vs_dense"][name] = paired_mean(
                [a[-1] - b[-1] for a, b in zip(cell["per_sequence"], theirs["per_sequence"])]
            )


def compare_with_dense(rows: list[dict]) -> list[dict]:
    """Each row's gap to, speed-up over and equal-time view of the dense row of its phase and
    seed (None where there is none), and its tasks' (:func:`compare_tasks`)."""
    by_key = {(r["phase"], r["variant"], r["seed"]): r for r in rows}
    for r in rows:
        dense = by_key.get((r["phase"], "dense", r["seed"]))
        r["vs_dense"] = r["speedup"] = r["steady_speedup"] = r["dense_at_equal_time"] = None
        compare_tasks(r, dense)
        if dense is None or r["variant"] == "dense":
            continue
        if r.get("val_bpb") and dense.get("val_bpb"):
            r["vs_dense"] = r["val_bpb"] / dense["val_bpb"] - 1
        if r["tokens_per_s"] and dense["tokens_per_s"]:
            r["speedup"] = r["tokens_per_s"] / dense["tokens_per_s"]
        if r["steady_tokens_per_s"] and dense["steady_tokens_per_s"]:
            r["steady_speedup"] = r["steady_tokens_per_s"] / dense["steady_tokens_per_s"]
        if r["train_s"] is not None:
            dense_timed = [({"val_bpb": c["val_bpb"]}, c["train_s"]) for c in dense["curve"]]
            r["dense_at_equal_time"] = at_time(dense_timed, r["train_s"])
    return rows


def _fmt(x, spec: str = "{:.4f}") -> str:
    return "—" if x is None else spec.format(x)


def _seconds(x: float | None) -> str:
    return "—" if x is None else f"{x:.0f}" if x >= 10 else f"{x:.2f}"


def _rope(settings: dict | None) -> str:
    if not settings:
        return "—"
    text = f"{settings['rope_theta']:g}"
    if settings["rope_scaling"] == "linear":
        text += f", positions / {settings['rope_factor']:g}"
    return text


def markdown(rows: list[dict], o, env: dict, commands: list[str]) -> str:
    """The report's text; ``o`` holds the settings (parsed options, or a JSON report's)."""
    ran = " and ".join(f"`python benchmarks/long_context.py {c}`" for c in commands)
    lines = [
        f"# Long context: dense, HHST and controls extended from 4k — {env['device']}",
        "",
        versions_line(env),
        "",
        f"Preset `{o.preset}`, base {o.base_short_steps} steps at {o.base_short_len} then "
        f"{o.base_steps} at {o.base_len} tokens (base variant {o.base_variant}), seeds "
        f"{','.join(map(str, o.seeds))}; {ran}. Bits per byte and needles from `s2attn eval` at "
        f"the phase length ({o.samples} needles a cell, depths {o.depths}); seconds are training "
        "steps only (validation and checkpoints left out); steady tokens/s: the median of the "
        "logged rows past the first tenth of the steps (compilation and warm-up left out); "
        "equal time: dense's training-time validation at this run's training seconds, beside "
        "this run's own last value on the same batches.",
        "",
    ]
    if any(r.get("tasks") for r in rows):
        lines += [
            "Long-context tasks (`s2attn eval --tasks`, docs/training.md) at the phase length: "
            "each task's accuracy, its 95% Wilson score interval, the samples n and, for the "
            "other variants, the gap to dense of the same seed in points; for `positions`, over "
            "the same documents for every variant, the bits per byte of the first and the last "
            "bucket of target positions (95% bootstrap interval over documents), the first less "
            "the last (what far context is worth to the model) and the last bucket's gap to "
            "dense, both document by document with their bootstrap intervals.",
            "",
        ]
    header = [
        "variant",
        "seed",
        "steps",
        "RoPE base",
        "density",
        "val bits/byte",
        "vs dense",
        "needle mean",
        "lowest cell",
        "tokens",
        "train s",
        "tokens/s",
        "x dense",
        "steady tokens/s",
        "x dense steady",
        "peak GiB",
        "dense at equal time",
        "own (same batches)",
    ]
    for phase in PHASES:
        mine = [r for r in rows if r["phase"] == phase]
        if not mine:
            continue
        p = o.phase.get(phase)
        what = f"the base at {o.base_len} tokens"
        if p:
            what = f"{p['steps']} steps of {p['batch']} x {p['len']} tokens, lr {p['lr']:g}"
        lines += [f"## {phase}: {what}", ""]
        body = [
            [
                r["variant"],
                r["seed"],
                f"{r['step']}/{r['steps']}" + ("" if r["done"] else " *"),
                _rope(r["rope"]),
                _fmt(r["density"], "{:.3f}"),
                _fmt(r.get("val_bpb")),
                _fmt(r["vs_dense"] and 100 * r["vs_dense"], "{:+.2f}%"),
                _fmt(r.get("needle_mean"), "{:.3f}"),
                _fmt(r.get("needle_min"), "{:.2f}"),
                f"{r['tokens']:,}",
                _seconds(r["train_s"]),
                _fmt(r["tokens_per_s"], "{:,.0f}"),
                _fmt(r["speedup"], "{:.2f}x"),
                _fmt(r["steady_tokens_per_s"], "{:,.0f}"),
                _fmt(r["steady_speedup"], "{:.2f}x"),
                _fmt(r["peak_gib"], "{:.1f}"),
                _fmt(r["dense_at_equal_time"]),
                _fmt(r["final_val"]),
            ]
            for r in mine
        ]
        lines += table(header, body) + [""]
        lines += task_table(mine, o, phase, p["len"] if p else o.base_len)
    if any(not r["done"] for r in rows):
        lines += ["\\* unfinished: its steps so far.", ""]
    return "\n".join(lines) + "\n"


def _position(position: int) -> str:
    return f"{position // 1024}k" if position and position % 1024 == 0 else str(position)


def _bucket(bucket: dict) -> str:
    return f"[{_position(bucket['start'])}, {_position(bucket['end'])})"


def _accuracy_cell(cell: dict | None, gap: float | None) -> str:
    if cell is None:
        return "—"
    low, high = cell["ci"]
    text = f"{cell['accuracy']:.3f} [{low:.3f}, {high:.3f}] n {cell['n']}"
    return text if gap is None else f"{text} ({100 * gap:+.1f} pt)"


def _bpb_cell(value: dict | None, spec: str = "{:.4f}") -> str:
    """A bucket's bits per byte, or a paired difference (``mean``), with its interval."""
    if value is None:
        return "—"
    mean = value["bpb"] if "bpb" in value else value["mean"]
    low, high = value["ci"]
    return f"{spec.format(mean)} [{spec.format(low)}, {spec.format(high)}]"


def task_table(rows: list[dict], o, phase: str, length: int) -> list[str]:
    """The long-context tasks of one phase's rows (at ``length``, the phase length), and a line
    for each asked-for task too long for the phase."""
    minimum = getattr(o, "task_min_lengths", None) or {}
    asked = list(getattr(o, "tasks", None) or [])
    skipped = [t for t in asked if minimum.get(t, 0) > length]
    found = [t for r in rows for t in task_cells(r)]
    names = [t for t in dict.fromkeys(asked + found) if t not in skipped]
    if not names and not skipped:
        return []
    lines = [f"### {phase}: long-context tasks at {length} tokens", ""]
    synthetic = [t for t in names if t != POSITIONS]
    header = ["variant", "seed", *synthetic]
    if POSITIONS in names:
        buckets = next(
            (task_cells(r)[POSITIONS]["buckets"] for r in rows if POSITIONS in task_cells(r)), None
        )
        first, last = (_bucket(buckets[0]), _bucket(buckets[-1])) if buckets else ("first", "last")
        header += [
            "documents",
            f"bits/byte {first}",
            f"bits/byte {last}",
            "first − last",
            "last vs dense",
        ]
    body = []
    for r in rows:
        cells, gaps = task_cells(r), r.get("tasks_vs_dense") or {}
        line = [r["variant"], r["seed"]]
        line += [_accuracy_cell(cells.get(t), gaps.get(t)) for t in synthetic]
        if POSITIONS in names:
            c = cells.get(POSITIONS)
            line += (
                ["—"] * 5
                if c is None
                else [
                    c["n"],
                    _bpb_cell(c["buckets"][0]),
                    _bpb_cell(c["buckets"][-1]),
                    _bpb_cell(r.get("far_context")),
                    _bpb_cell(gaps.get(POSITIONS), "{:+.4f}"),
                ]
            )
        body.append(line)
    if names:
        lines += table(header, body) + [""]
    for t in skipped:
        lines.append(f"`{t}` needs samples of {minimum[t]} tokens or more: not run at {length}.")
    return lines + ([""] if skipped else [])


def plot_needles(rows: list[dict], phase: str, path: Path) -> Path | None:
    """One figure per phase: a needle heat map (depth down, length across) per variant (rows)
    and seed (columns)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mine = [r for r in rows if r["phase"] == phase and r.get("needle")]
    if not mine:
        return None
    variants = list(dict.fromkeys(r["variant"] for r in mine))
    seeds = sorted({r["seed"] for r in mine})
    fig, axes = plt.subplots(
        len(variants),
        len(seeds),
        squeeze=False,
        figsize=(1.5 + 3.4 * len(seeds), 0.6 + 2.9 * len(variants)),
        constrained_layout=True,
    )
    image = None
    for i, v in enumerate(variants):
        for j, s in enumerate(seeds):
            ax = axes[i][j]
            row = next((r for r in mine if r["variant"] == v and r["seed"] == s), None)
            if row is None:
                ax.set_axis_off()
                continue
            grid = row["needle"]
            lengths = sorted(grid, key=int)
            depths = sorted({d for cells in grid.values() for d in cells}, key=float)
            values = [[grid[n].get(d, math.nan) for n in lengths] for d in depths]
            image = ax.imshow(values, cmap="RdYlGn", vmin=0, vmax=1, aspect="auto")
            for y, line in enumerate(values):
                for x, value in enumerate(line):
                    ax.text(x, y, f"{value:.2f}", ha="center", va="center", fontsize=7)
            ax.set_xticks(
                range(len(lengths)),
                [f"{int(n) // 1024}k" if int(n) % 1024 == 0 else n for n in lengths],
            )
            ax.set_yticks(range(len(depths)), depths, fontsize=7)
            ax.set_title(f"{v}, seed {s}: mean {row['needle_mean']:.3f}", fontsize=9)
            if j == 0:
                ax.set_ylabel("needle depth")
            if i == len(variants) - 1:
                ax.set_xlabel("context length")
    fig.colorbar(image, ax=axes.ravel().tolist(), label="retrieval accuracy", shrink=0.8)
    fig.suptitle(f"needle retrieval after the {phase} phase", fontsize=10)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# Settings that must agree for reports to merge: the same bases, phases and evaluation.
MERGED_SETTINGS = ("preset", "base_short_len", "base_short_steps", "base_steps", "base_len",
                   "base_variant", "samples", "depths")  # fmt: skip


def merge_reports(paths: list[Path], out_dir: Path, name: str) -> None:
    """``--merge``: one report from the JSON reports of invocations that ran apart (say dense on
    one GPU and HHST on another, each with its own ``--gpus``) over the same bases and phases; a
    row seen twice keeps the later file's. Refuses reports whose settings differ, in the phases
    both have rows of: an invocation run ``--until 32k`` may differ in the 128k phase it never
    ran."""
    payloads = [json.loads(Path(p).read_text()) for p in paths]
    first = payloads[0]["settings"]
    phases = {}  # phase -> (the first report with rows in it, its settings of that phase)
    for path, payload in zip(paths, payloads):
        if "commands" not in payload:
            raise SystemExit(f"--merge: {path} records no command (written by an older version)")
        differ = [k for k in MERGED_SETTINGS if payload["settings"].get(k) != first.get(k)]
        ran = {r["phase"] for r in payload["rows"]} & payload["settings"]["phase"].keys()
        for phase in sorted(ran):
            seen, wanted = phases.setdefault(phase, (path, payload["settings"]["phase"][phase]))
            if payload["settings"]["phase"][phase] != wanted:
                differ.append(f"the {phase} phase (against {seen})")
        if differ:
            raise SystemExit(f"--merge: {path} differs from {paths[0]} in {', '.join(differ)}")
    by_key = {}
    for payload in payloads:
        for row in payload["rows"]:
            by_key[(row["phase"], row["variant"], row["seed"])] = row
    rows = compare_with_dense(list(by_key.values()))
    settings = dict(
        first,
        seeds=sorted({s for p in payloads for s in p["settings"]["seeds"]}),
        tasks=list(dict.fromkeys(t for p in payloads for t in p["settings"].get("tasks", []))),
        task_min_lengths={
            k: v for p in payloads for k, v in p["settings"].get("task_min_lengths", {}).items()
        },
        phase=dict(first["phase"], **{phase: wanted for phase, (_, wanted) in phases.items()}),
    )
    variants = {k: v for p in payloads for k, v in p["variants"].items()}
    commands = [c for p in payloads for c in p["commands"]]
    write_report(rows, payloads[0]["env"], settings, variants, commands, out_dir, name)


def write_report(
    rows: list[dict],
    env: dict,
    settings: dict,
    variants: dict,
    commands: list[str],
    out_dir: Path,
    name: str,
) -> None:
    """The markdown table, the JSON with every number and the needle heat maps; ``env`` is the
    machine's (``run_info.environment``), its device, versions and dates taken from the rows."""
    recorded = next(r for r in rows)
    env = dict(env)
    dates = sorted(r["date"] for r in rows)
    env.update(
        device=recorded["device"],
        torch=recorded["versions"]["torch"],
        triton=recorded["versions"].get("triton", env["triton"]),
        date=dates[0] if dates[0] == dates[-1] else f"{dates[0]} to {dates[-1]}",
    )
    # A CPU's recorded name carries its processor and threads: the file name takes "cpu".
    stem = result_stem(dict(env, device="cpu") if env["device"].startswith("cpu") else env, name)
    out_dir.mkdir(parents=True, exist_ok=True)
    text = markdown(rows, argparse.Namespace(**settings), env, commands)
    payload = dict(
        env=env,
        versions=recorded["versions"],
        settings=settings,
        variants=variants,
        commands=commands,
        rows=rows,
    )
    (out_dir / f"{stem}.md").write_text(text)
    (out_dir / f"{stem}.json").write_text(json.dumps(payload, indent=1) + "\n")
    print()
    print(text)
    written = [f"{stem}.md", f"{stem}.json"]
    for phase in PHASES:
        png = plot_needles(rows, phase, out_dir / f"{stem}_needle_{phase}.png")
        if png is not None:
            written.append(png.name)
    print(f"wrote {', '.join(written)} in {out_dir}")
