"""The quality experiment: HHST against dense, all-S2, local-only and homogeneous strides.

Trains every variant at equal parameters, tokens and seed with ``python -m s2attn train``
(concurrently: the models are small, so one GPU holds them all and is busier shared), evaluates
each with ``python -m s2attn eval`` (validation bits per byte, needle retrieval over a grid of
lengths and depths), and writes one table, the validation curves and the needle heat maps.

    python benchmarks/quality_experiment.py --preset small --steps 1500 --runs runs/quality
    python benchmarks/quality_experiment.py --preset small --short-len 1024 --short-steps 3000 \
        --steps 1500 --runs runs/quality                     # 1k first: retrieval forms sooner
    python benchmarks/quality_experiment.py --preset tiny --steps 20 --runs /tmp/q --smoke   # CPU

Variants (name: train arguments): see ``VARIANTS``; ``--only`` picks some. Writes
``<date>_<device>_quality.{md,json}``, ``..._quality_curves.png`` and ``..._quality_needle.png``
to ``--out-dir`` (default benchmarks/results/).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from run_info import environment, result_stem, site_source_args, versions_line, write_results

RESULTS = Path(__file__).resolve().parent / "results"

# name -> extra arguments of `s2attn train`. "hhst", local and homo take the preset's dense
# layer (small: layer 3 of 6, the middle); the others place theirs explicitly.
VARIANTS: dict[str, list[str]] = {
    "dense": ["--variant", "dense"],
    "hhst": ["--variant", "hhst"],
    "hhst-first": ["--variant", "hhst", "--dense-layers", "0"],
    "hhst2-first": ["--variant", "hhst", "--dense-layers", "0,1"],
    "hhst2-spread": ["--variant", "hhst", "--dense-layers", "0,3"],
    "s2": ["--variant", "s2"],
    "local": ["--variant", "local"],
    "homo": ["--variant", "homo"],
    # Without a dense layer, only the stagger lets a layer reach every block: the S2 layers
    # must carry all long-range traffic themselves.
    "homo-s2": ["--variant", "homo", "--dense-layers", "none"],
    "local-s2": ["--variant", "local", "--dense-layers", "none"],
}

# Validation text and needles, the same whatever --seed, so that runs of several seeds are
# measured alike. 1: what the seed-0 runs in docs/results.md were measured on at the training length
# (their main phase ran with seed 1, and validation then followed the training seed).
VAL_SEED = 1


def launch(cmd: list[str], log: Path, env: dict, append: bool = False) -> subprocess.Popen:
    log.parent.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(
        cmd, stdout=log.open("a" if append else "w"), stderr=subprocess.STDOUT, env=env
    )


def run_all(jobs: dict[str, list[list[str]]], runs: Path, parallel: int, env: dict) -> dict:
    """Run ``jobs`` (name -> commands, run one after another while they succeed), at most
    ``parallel`` jobs at once; return each job's exit code (its first failing command's)."""
    pending, running, codes = list(jobs.items()), {}, {}
    while pending or running:
        while pending and len(running) < parallel:
            name, (first, *rest) = pending.pop(0)
            running[name] = (launch(first, runs / f"{name}.log", env), rest)
        time.sleep(2)
        for name, (proc, rest) in list(running.items()):
            if proc.poll() is None:
                continue
            if proc.returncode == 0 and rest:
                running[name] = (launch(rest[0], runs / f"{name}.log", env, True), rest[1:])
                continue
            codes[name] = proc.returncode
            del running[name]
            status = "ok" if proc.returncode == 0 else f"FAILED ({proc.returncode})"
            print(f"  {name}: {status}", flush=True)
    return codes


def read_metrics(path: Path) -> list[dict]:
    """A run's rows under today's names (``val_bpb``, ``val_needle_acc``), also where an older
    version logged them under others."""
    # Imported here, as main() imports the models: the module loads without transformers.
    from s2attn.training.metrics import read_metrics as read

    return read(path)


def short_run(runs: Path, name: str) -> Path:
    """Where a variant's first, shorter-context phase trains (``--short-len``)."""
    return runs / f"{name}.short"


def short_tokens(runs: Path, name: str) -> int:
    """Tokens of the variant's short phase, 0 without one."""
    path = short_run(runs, name) / "metrics.jsonl"
    return read_metrics(path)[-1]["tokens"] if path.exists() else 0


def summarize(names: list[str], runs: Path, train_len: int) -> list[dict]:
    rows = []
    for name in names:
        run = runs / name
        metrics = read_metrics(run / "metrics.jsonl")
        val = [m for m in metrics if "val_bpb" in m]
        first = short_tokens(runs, name)
        needle = json.loads((run / "needle.json").read_text())
        grid = needle["accuracy"]
        at_train = grid.get(str(train_len), {})
        rows.append(
            dict(
                variant=name,
                tokens=first + metrics[-1]["tokens"],
                short_tokens=first,
                val_bpb=val[-1]["val_bpb"] if val else None,
                eval_bpb=needle.get("val_bpb"),
                needle_mean=sum(v for cells in grid.values() for v in cells.values())
                / max(1, sum(len(cells) for cells in grid.values())),
                needle_min_at_train_len=min(at_train.values()) if at_train else None,
                needle=grid,
                elapsed_s=metrics[-1].get("elapsed_s"),
            )
        )
    dense = next((r["val_bpb"] for r in rows if r["variant"] == "dense"), None)
    for r in rows:
        r["vs_dense"] = (r["val_bpb"] / dense - 1) if dense and r["val_bpb"] else None
    return rows


def markdown(rows: list[dict], env: dict, args, summary: dict) -> str:
    lines = [
        "# HHST quality: validation loss and needle retrieval against dense",
        "",
        f"{env['device']} · {versions_line(env)}",
        "",
        f"Preset `{args.preset}` ({summary.get('parameters', '?'):,} parameters each), "
        + (f"{args.short_steps} steps at {args.short_len} tokens then " if args.short_len else "")
        + f"{args.steps} steps at {args.train_len} tokens, seed {args.seed}; "
        f"`python benchmarks/quality_experiment.py {' '.join(sys.argv[1:])}`. Needle: accuracy "
        f"of the whole answer, {args.samples} samples per cell, lengths {args.lengths}, "
        f"depths {args.depths}.",
        "",
        "| variant | tokens | val bits/byte | vs dense | needle mean | needle min at train len |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        vs = "—" if r["vs_dense"] is None else f"{100 * r['vs_dense']:+.2f}%"
        bpb = "—" if r["val_bpb"] is None else f"{r['val_bpb']:.4f}"
        low = r["needle_min_at_train_len"]
        lines.append(
            f"| {r['variant']} | {r['tokens']:,} | {bpb} | {vs} | "
            f"{r['needle_mean']:.3f} | {'—' if low is None else f'{low:.2f}'} |"
        )
    return "\n".join(lines) + "\n"


def plot_curves(names: list[str], runs: Path, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_needle) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name in names:
        # A short phase is drawn dashed (validated at its own, shorter length), the main phase
        # solid, after the short phase's tokens.
        offset = short_tokens(runs, name)
        phases = [(runs / name, offset, "-")]
        if offset:
            phases.insert(0, (short_run(runs, name), 0, "--"))
        color = None
        for run, start, style in phases:
            val = [m for m in read_metrics(run / "metrics.jsonl") if "val_bpb" in m]
            tokens = [(start + m["tokens"]) / 1e6 for m in val]
            (line,) = ax_loss.plot(
                tokens,
                [m["val_bpb"] for m in val],
                style,
                marker=".",
                color=color,
                label=name if style == "-" else None,
            )
            color = line.get_color()
            if any("val_needle_acc" in m for m in val):
                ax_needle.plot(
                    tokens,
                    [m.get("val_needle_acc", float("nan")) for m in val],
                    style,
                    marker=".",
                    color=color,
                    label=name if style == "-" else None,
                )
    ax_loss.set(xlabel="training tokens (M)", ylabel="validation bits per byte", title=title)
    ax_needle.set(
        xlabel="training tokens (M)", ylabel="needle accuracy (validation set)", ylim=(-0.02, 1.02)
    )
    ax_loss.legend(fontsize=8)
    ax_needle.legend(fontsize=8)
    ax_loss.grid(alpha=0.3)
    ax_needle.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def recorded_environment(runs: Path, names: list[str]) -> dict:
    """The environment the runs themselves recorded (device, versions, the dates they ran)."""
    records = [json.loads((runs / n / "run.json").read_text()) for n in names]
    first = records[0]
    dates = sorted(r["date"] for r in records)
    return dict(
        device=first["device"],
        torch=first["versions"]["torch"],
        triton=first["versions"].get("triton"),
        cuda=first["versions"].get("cuda", "n/a"),
        s2attn=first["versions"].get("s2attn", "0.1.0"),
        date=dates[0] if dates[0] == dates[-1] else f"{dates[0]} to {dates[-1]}",
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--runs", type=Path, required=True, help="where the trained models go")
    ap.add_argument("--only", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    ap.add_argument("--parallel", type=int, default=len(VARIANTS))
    ap.add_argument("--train-len", type=int, default=None, help="default: the preset's")
    ap.add_argument("--lengths", default=None, help="needle lengths; default: 1/4, 1/2, 1x")
    ap.add_argument("--depths", default="0,0.1,0.2,0.3,0.4,0.5,0.6,0.7,0.8,0.9,1")
    ap.add_argument("--samples", type=int, default=20)
    ap.add_argument("--train-args", default="", help="extra arguments for every train run")
    ap.add_argument(
        "--short-len",
        type=int,
        default=None,
        help="train each variant first at this shorter length (same tokens per step), then "
        "--steps at --train-len from its weights (--init-from): retrieval forms far sooner on "
        "short rows",
    )
    ap.add_argument("--short-steps", type=int, default=None, help="steps of the short phase")
    ap.add_argument("--skip-train", action="store_true", help="evaluate existing runs only")
    ap.add_argument(
        "--report-only",
        action="store_true",
        help="neither train nor evaluate: tabulate and plot the runs' metrics.jsonl and "
        "needle.json (e.g. runs made in several calls and gathered here), with the device, "
        "versions and date their run.json recorded",
    )
    ap.add_argument("--smoke", action="store_true", help="CPU: no GPU assumed")
    ap.add_argument("--out-dir", type=Path, default=RESULTS)
    ap.add_argument("--name", default="quality")
    args = ap.parse_args()

    from s2attn.training.presets import PRESETS, model_config, model_summary

    preset = PRESETS[args.preset]
    args.train_len = args.train_len or preset.seq_len
    if (args.short_len is None) != (args.short_steps is None):
        ap.error("--short-len and --short-steps go together")
    if args.short_len is not None and not 0 < args.short_len < args.train_len:
        ap.error(f"--short-len must be below --train-len ({args.train_len})")
    if args.short_len is not None and (preset.batch_size * args.train_len) % args.short_len:
        ap.error("--short-len must divide batch size x --train-len (same tokens per step)")
    if args.lengths is None:
        args.lengths = ",".join(str(args.train_len * k // 4) for k in (1, 2, 4))
    summary = model_summary(model_config(preset, "dense", seq_len=args.train_len))
    device = ["--device", "cpu"] if args.smoke else []
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"))
    python = [sys.executable, "-m", "s2attn"]

    if not (args.skip_train or args.report_only):
        print(f"training {len(args.only)} variants, {args.parallel} at once", flush=True)

        def train(name: str, steps: int, seed: int, seq_len: int, out: Path, *extra: str):
            command = [
                *python,
                "train",
                "--preset",
                args.preset,
                "--no-progress",
                *device,
                *VARIANTS[name],
                "--steps",
                str(steps),
                "--seed",
                str(seed),
                "--seq-len",
                str(seq_len),
                "--out",
                str(out),
                "--val-seed",
                str(VAL_SEED),
                *extra,
                *args.train_args.split(),
            ]
            if "--data-root" not in args.train_args.split():
                command += site_source_args()
            return command

        jobs = {}
        for name in args.only:
            main = args.runs / name
            jobs[name] = [train(name, args.steps, args.seed, args.train_len, main)]
            if args.short_len:
                short = short_run(args.runs, name)
                batch = preset.batch_size * args.train_len // args.short_len
                jobs[name] = [
                    train(
                        name,
                        args.short_steps,
                        args.seed,
                        args.short_len,
                        short,
                        "--max-seq-len",
                        str(args.train_len),
                        "--batch-size",
                        str(batch),
                    ),
                    # Another seed for the main phase: other documents, not the short phase's
                    # again.
                    train(
                        name,
                        args.steps,
                        args.seed + 1,
                        args.train_len,
                        main,
                        "--init-from",
                        str(short),
                    ),
                ]
        codes = run_all(jobs, args.runs, args.parallel, env)
        if any(codes.values()):
            print("some runs failed; see their logs in", args.runs)
    trained = [n for n in args.only if (args.runs / n / "config.json").exists()]
    if args.report_only:
        trained = [n for n in args.only if (args.runs / n / "run.json").exists()]
    print(f"evaluating {0 if args.report_only else len(trained)} models", flush=True)
    jobs = {
        f"{name}.eval": [
            [
                *python,
                "eval",
                str(args.runs / name),
                "--needle",
                "--lengths",
                args.lengths,
                "--depths",
                args.depths,
                "--samples",
                str(args.samples),
                "--seed",
                str(VAL_SEED),
                "--out",
                str(args.runs / name / "needle.json"),
                *device,
            ]
        ]
        for name in trained
    }
    if not args.report_only:
        run_all(jobs, args.runs, args.parallel, env)
    done = [n for n in trained if (args.runs / n / "needle.json").exists()]

    result_env = environment() if not args.report_only else recorded_environment(args.runs, done)
    rows = summarize(done, args.runs, args.train_len)
    text = markdown(rows, result_env, args, summary)
    stem = result_stem(result_env, args.name)
    # "environment", not run_info's "env": the committed reports and quality_seeds.py read it.
    payload = dict(
        environment=result_env,
        preset=args.preset,
        steps=args.steps,
        short_len=args.short_len,
        short_steps=args.short_steps,
        seed=args.seed,
        train_args=args.train_args,
        train_len=args.train_len,
        lengths=args.lengths,
        depths=args.depths,
        samples=args.samples,
        model=summary,
        rows=rows,
    )
    write_results(args.out_dir, stem, text, payload)
    plot_curves(
        done,
        args.runs,
        args.out_dir / f"{stem}_curves.png",
        f"{args.preset}, "
        + (f"{args.short_steps} steps at {args.short_len} then " if args.short_len else "")
        + f"{args.steps} steps at {args.train_len} tokens",
    )
    from s2attn.training.evaluate import plot_needle_heatmaps

    plot_needle_heatmaps(
        {
            r["variant"]: json.loads((args.runs / r["variant"] / "needle.json").read_text())
            for r in rows
        },
        args.out_dir / f"{stem}_needle.png",
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
