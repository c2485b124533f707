"""Long context: dense, HHST and a control extended from the same 4k weights to 32k, then 128k.

One command runs the whole experiment as a small graph of jobs, each a ``python -m s2attn``
subprocess with its log in ``--runs``/logs, several at once (one per GPU of ``--gpus``):

==========================  =====================================================================
``base1k/s<seed>``          the README's 4k recipe, first phase: ``--base-short-steps`` (4000)
                            steps of 32 x 1024 tokens (patterns and RoPE cover 4096)
``base/s<seed>``            then ``--base-steps`` (800) steps of 8 x 4096 from those weights, with
                            seed + 1 (other documents), as ``quality_experiment.py --short-len``
``32k/<variant>/s<seed>``   from ``base/s<seed>`` (``--init-from``): ``--steps-32k`` steps of
                            ``--batch-32k`` x ``--len-32k`` tokens, seed + 2
``128k/<variant>/s<seed>``  from ``32k/<variant>/s<seed>``: ``--steps-128k`` x ``--batch-128k`` x
                            ``--len-128k``, seed + 3
``eval/<phase>/...``        ``s2attn eval`` of each trained model: bits per byte at the phase length
                            and the needle grid at 1/8, 1/4, 1/2 and the whole phase length
                            (``--depths``: 11 depths, ``--samples`` 20 needles a cell)
``tasks/<phase>/.../<t>``   with ``--tasks``: ``s2attn eval --tasks t`` of each trained model at
                            the phase length, a job a task (``--task-samples`` 100 samples or
                            documents), into ``tasks/<t>.json`` beside the model
==========================  =====================================================================

``--tasks`` takes the evaluations of ``s2attn eval --tasks`` (``multikey``, ``multivalue``,
``vartrack``, ``aggregate``, ``positions``; docs/training.md); a task whose shortest sample is
longer than a phase is not planned there, and the report says so. A job a task, so that no one
ten-minute call has to hold all of them at 128k; the jobs are apart from the needle grid's, so
models evaluated before ``--tasks`` was given get their tasks by the same command with it, and
nothing else reruns. ``--task-args`` adds ``s2attn eval`` arguments to them
(``--data-root`` for more long documents under ``positions``).

``--base-from DIR`` takes the bases from ``DIR/s<seed>`` instead (saved by an earlier invocation
or machine; weights in any float dtype) and plans no base jobs.

The base is one model per seed, of ``--base-variant`` (default hhst); every variant of a phase
starts from the same weights (the variants share every parameter and differ only in attention),
reads the same batches (same seed) and so sees equal tokens. Variants (``--variants``, default
``dense,hhst,local``) are names of ``VARIANTS``: name -> extra ``s2attn train`` arguments;
``--variant-args NAME=ARGS`` adds or replaces one; ``--variants-128k`` keeps only some of them
for the 128k phase. ``hhst-pi`` (HHST with position interpolation
instead of a larger RoPE base) and ``s2`` are there to add; an HHST with a RoPE base of 1M::

    --variants dense,hhst,local,hhst-1m --variant-args "hhst-1m=--variant hhst --rope-theta 1e6"

Each extension phase's position scheme is ``--rope-32k`` / ``--rope-128k`` (train arguments; the
variant's come after them and win). In these and in variant arguments ``{len}`` is the phase
length, ``{scale}`` the phase length over the base length (8 at 32k, 32 at 128k), ``{theta}``
10000 x ``{scale}`` and ``{theta_sq}`` 10000 x ``{scale}`` squared (640000 at 32k, 10240000 at
128k). By default the RoPE base grows with the square of the length ({theta_sq}): with a base
that only kept pace with it ({theta}: 80000 at 32k, 320000 at 128k) every model, dense included,
lost the needles at the start of the context (docs/results.md, "The RoPE base of the extension").
Learning rate ``--lr-32k``/``--lr-128k`` (3e-4) after ``--warmup-32k``/``--warmup-128k`` (20)
steps; gradient checkpointing from ``--checkpointing-from`` tokens (32768) on; validation every
``--val-every-32k``/``--val-every-128k`` steps (a tenth of the phase), so dense's curve gives the
equal-time view below.

Time: ``--deadline SECONDS`` bounds the invocation. A training job starts only while at least
``--min-job-s`` remain, and gets ``--time-limit`` = the time left minus ``--margin-s``, so it
stops with a checkpoint before the deadline; an evaluation starts only if its estimate (its
tokens at three times the model's training speed, plus start-up) fits; whatever still runs at
the deadline is stopped (SIGINT, as Ctrl-C; so is every job when this script is interrupted or
terminated). The same command again (same ``--runs``) resumes unfinished training jobs
(``--resume``), reruns unfinished evaluations and skips finished jobs; ``--until PHASE`` leaves
the later phases out. On the GPU, in calls of at most ten minutes on the same machine::

    python benchmarks/long_context.py --runs /tmp/long --gpus 0,1,2,3 --seeds 0,1 --deadline 540

repeated until it prints "all jobs done" (``--dry-run`` lists the jobs and their commands). On
the CPU, the whole pipeline at toy sizes (tiny preset, 128 -> 256 -> 512 -> 1024 tokens; every
task at 3 samples)::

    python benchmarks/long_context.py --smoke --runs /tmp/long --out-dir /tmp/long/results

Report (``long_context_report.py``; after every invocation, or alone with ``--report-only``): per
phase a markdown table of variant, seed, validation bits per byte at the phase length (``s2attn
eval``), its gap to dense of the same seed, needle mean and lowest cell, tokens, training seconds
(steps only), tokens/s and its ratio to dense, the steady tokens/s (median of the logged rows past
the first tenth of the steps, so ``--train-args --compile``'s compilation is left out) and its
ratio, peak GPU memory, and the equal-time view: dense's validation bits per byte (training-time
validation, interpolated over its training seconds) at the moment this model finished, beside
this model's own final value on the same batches. With ``--tasks``, a second table per phase:
each task's accuracy with n, its 95% interval and its gap to dense in points, and for
``positions`` the first and last buckets' bits per byte, the first less the last, and the last
bucket's gap to dense, document by document. Also one needle heat-map PNG per phase (rows:
variants, columns: seeds; each panel depth x length) and JSON with every number, the runs' device
and library versions, written as ``<date>_<device>_long_context*`` to ``--out-dir`` (default
benchmarks/results/). Invocations run apart over the same bases (dense on one GPU with its own
``--gpus``, HHST on another) make one report with ``--merge A.json B.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from long_context_report import (
    EVAL_RESULT,
    PHASES,
    TASKS_DIR,
    merge_reports,
    read_rows,
    summarize,
    train_seconds,
    write_report,
)
from run_info import environment, site_source_args

ROOT = Path(__file__).resolve().parents[1]

RESULTS = Path(__file__).resolve().parent / "results"

# name -> extra arguments of `s2attn train` (formatted with {len}, {scale}, {theta}, {theta_sq}).
VARIANTS: dict[str, list[str]] = {
    "dense": ["--variant", "dense"],
    "hhst": ["--variant", "hhst"],
    # The window alone, as wide as the S2 layers' density at the phase length allows.
    "local": ["--variant", "local"],
    "s2": ["--variant", "s2"],
    "hhst-pi": [
        "--variant",
        "hhst",
        "--rope-theta",
        "10000",
        "--rope-scaling",
        "linear",
        "--rope-factor",
        "{scale}",
    ],
}
# Validation text and needles, whatever --seed, as in benchmarks/quality_experiment.py.
VAL_SEED = 1
DEPTHS = "0,0.1,0.2,0.3,0.4,0.5,0.6,0.7,0.8,0.9,1"
BASE_THETA = 10000.0

# Defaults of the GPU experiment and of --smoke (CPU, tiny preset, a few steps a phase).
DEFAULTS = dict(
    preset="small",
    base_short_len=1024,
    base_short_steps=4000,
    base_steps=800,
    len_32k=32768,
    steps_32k=300,
    batch_32k=2,
    len_128k=131072,
    steps_128k=100,
    batch_128k=1,
    checkpointing_from=32768,
    samples=20,
    depths=DEPTHS,
    eval_val_batches=8,
    train_val_batches=2,
    train_val_needles=8,
    checkpoint_every=100,
    train_args="",
    tasks="none",
    task_samples=100,
)
SMOKE = dict(
    preset="tiny",
    base_short_len=128,
    base_short_steps=6,
    base_steps=4,
    len_32k=512,
    steps_32k=4,
    batch_32k=2,
    len_128k=1024,
    steps_128k=3,
    batch_128k=1,
    checkpointing_from=1024,
    samples=2,
    depths="0,0.5,1",
    eval_val_batches=1,
    train_val_batches=1,
    train_val_needles=2,
    checkpoint_every=2,
    # Every task at lengths of 256 to 1024: the base is too short for multikey and aggregate.
    tasks="all",
    task_samples=3,
    # The package's own sources: listed in a moment, unlike the whole site-packages.
    train_args=f"--data-root {ROOT / 's2attn'} --val-fraction 0.2",
)


# ---------------------------------------------------------------------------------- the jobs
@dataclass
class Job:
    """One subprocess of the experiment: ``s2attn train`` into ``out``, or ``s2attn eval`` of the
    model in ``out`` (writing ``out/<result>``: ``eval.json``, or ``tasks/<task>.json`` for a
    task)."""

    name: str
    kind: str  # "train" or "eval"
    phase: str
    variant: str
    seed: int
    out: Path
    args: list[str]
    deps: list[str]
    eval_tokens: int = 0  # what an evaluation reads, for its time estimate
    result: str = EVAL_RESULT

    def done(self) -> bool:
        if self.kind == "train":
            return (self.out / "model.safetensors").is_file()
        try:
            json.loads((self.out / self.result).read_text())
        except (OSError, ValueError):
            return False
        return True

    def command(self, time_limit: float | None) -> list[str]:
        cmd = [sys.executable, "-m", "s2attn", self.kind, *self.args]
        if self.kind == "train":
            if (self.out / "run.json").is_file():
                cmd.append("--resume")
            if time_limit is not None:
                cmd += ["--time-limit", f"{time_limit:.0f}"]
        return cmd

    def log(self, runs: Path) -> Path:
        return runs / "logs" / (self.name.replace("/", "_") + ".log")


def _format(args: list[str], length: int, base_len: int) -> list[str]:
    scale = length / base_len
    values = dict(
        len=length,
        scale=f"{scale:g}",
        theta=f"{BASE_THETA * scale:g}",
        theta_sq=f"{BASE_THETA * scale**2:g}",
    )
    try:
        return [a.format(**values) for a in args]
    except (KeyError, IndexError, ValueError) as exc:
        raise SystemExit(
            f"bad placeholder in {' '.join(args)!r}: {exc} "
            "(use {len}, {scale}, {theta} or {theta_sq})"
        ) from None


def flags(**options) -> list[str]:
    """Command-line arguments from keywords: ``seq_len=1024`` -> ``--seq-len 1024``; True gives
    the flag alone, False and None nothing."""
    out = []
    for key, value in options.items():
        if value is None or value is False:
            continue
        out.append("--" + key.replace("_", "-"))
        if value is not True:
            out.append(str(value))
    return out


def plan_jobs(o: argparse.Namespace) -> list[Job]:
    """Every job of the experiment, in the order they are preferred when several are ready:
    earlier phases first, and within a phase training before evaluation."""
    runs, base_len = o.runs, o.base_len
    common = [
        *flags(preset=o.preset, val_seed=VAL_SEED, no_progress=True),
        *flags(checkpoint_every=o.checkpoint_every),
        *o.device_args,
    ]
    extra = shlex.split(o.train_args)
    if "--data-root" not in extra:
        extra += site_source_args()
    trains, evals, tasks = [], [], []

    def train(variant: str, seed: int, out: Path, deps: list[str], *args: str) -> None:
        """Train ``variant`` into ``out``, named after it (``<phase>/[<variant>/]s<seed>``)."""
        name = str(out.relative_to(runs))
        args = [*common, *args, "--out", str(out), *extra]
        trains.append(Job(name, "train", name.split("/")[0], variant, seed, out, args, deps))

    def evaluation(job: Job, length: int) -> None:
        lengths = sorted({max(length // k, 1) for k in (8, 4, 2, 1)})
        args = [
            str(job.out),
            *flags(needle=True, lengths=",".join(map(str, lengths)), depths=o.depths),
            *flags(samples=o.samples, seed=VAL_SEED, seq_len=length),
            *flags(val_batches=o.eval_val_batches, out=job.out / EVAL_RESULT, no_progress=True),
            *o.device_args,
        ]
        depths = len(o.depths.split(","))
        tokens = o.eval_val_batches * length + o.samples * depths * sum(lengths)
        name, deps = f"eval/{job.name}", [job.name]
        evals.append(Job(name, "eval", job.phase, job.variant, job.seed, job.out, args, deps))
        evals[-1].eval_tokens = tokens
        task_evaluations(job, length)

    def task_evaluations(job: Job, length: int) -> None:
        """``s2attn eval --tasks`` of ``job``'s model at ``length``, of each task that fits it."""
        for task in o.tasks:
            if o.task_min_lengths.get(task, 0) > length:
                continue
            result = f"{TASKS_DIR}/{task}.json"
            args = [
                str(job.out),
                *flags(tasks=task, task_samples=o.task_samples, lengths=length, seq_len=length),
                *flags(val_batches=0, seed=VAL_SEED, out=job.out / result, no_progress=True),
                *o.device_args,
                *shlex.split(o.task_args),
            ]
            # --task-samples samples of the length (positions: at most as many documents).
            tokens = o.task_samples * length
            name, deps = f"tasks/{job.name}/{task}", [job.name]
            where = (job.phase, job.variant, job.seed, job.out)
            tasks.append(Job(name, "eval", *where, args, deps, tokens, result=result))

    def base_jobs(seed: int) -> dict:
        """The 4k base of ``seed`` in two phases; each variant's (job, weights) to start from."""
        short, base = runs / "base1k" / f"s{seed}", runs / "base" / f"s{seed}"
        variant_args = _format(VARIANTS[o.base_variant], base_len, base_len)
        train(
            o.base_variant,
            seed,
            short,
            [],
            *variant_args,
            *flags(seq_len=o.base_short_len, max_seq_len=base_len, steps=o.base_short_steps),
            *flags(batch_size=o.base_batch * base_len // o.base_short_len, seed=seed),
        )
        # Another seed for the 4k phase: other documents, not the first phase's again.
        train(
            o.base_variant,
            seed,
            base,
            [f"base1k/s{seed}"],
            *variant_args,
            *flags(seq_len=base_len, batch_size=o.base_batch),
            *flags(steps=o.base_steps, seed=seed + 1, init_from=short),
        )
        evaluation(trains[-1], base_len)
        return {v: (f"base/s{seed}", base) for v in o.variants}

    def extension_jobs(seed: int, previous: dict) -> None:
        """The 32k and 128k phases of every variant, each from the one before."""
        for offset, phase in enumerate(PHASES[1:], start=2):
            p = o.phase[phase]
            runs_of_phase = {}  # variant -> (job, weights) of this phase, for the next one
            for v in o.variants_128k if phase == "128k" else o.variants:
                out = runs / phase / v / f"s{seed}"
                # A 128k-only variant (NAME:FROM) starts from FROM's 32k weights.
                dep, source = previous[o.sources_128k.get(v, v) if phase == "128k" else v]
                train(
                    v,
                    seed,
                    out,
                    [] if dep is None else [dep],
                    *flags(seq_len=p["len"], batch_size=p["batch"], steps=p["steps"]),
                    *flags(lr=p["lr"], warmup_steps=p["warmup"], seed=seed + offset),
                    *flags(init_from=source, val_every=p["val_every"]),
                    *flags(val_batches=o.train_val_batches, val_needles=o.train_val_needles),
                    *flags(gradient_checkpointing=p["len"] >= o.checkpointing_from),
                    *_format(shlex.split(p["rope"]), p["len"], base_len),
                    *_format(VARIANTS[v], p["len"], base_len),
                )
                evaluation(trains[-1], p["len"])
                runs_of_phase[v] = (trains[-1].name, out)
            previous = runs_of_phase

    for seed in o.seeds:
        if o.base_from is not None:
            # A 4k base trained elsewhere (another runs directory, an earlier machine).
            source = o.base_from / f"s{seed}"
            previous = {v: (None, source) for v in o.variants}
        else:
            previous = base_jobs(seed)
        extension_jobs(seed, previous)
    order = {name: i for i, name in enumerate(("base1k", *PHASES))}
    jobs = [j for j in trains + evals + tasks if order[j.phase] <= order[o.until]]
    # Earlier phases first, a phase's training before its evaluation, so that each phase's
    # results are complete before the next phase's runs take the GPUs; sorted() is stable.
    return sorted(jobs, key=lambda j: (order[j.phase], j.kind == "eval", j.seed))


# ------------------------------------------------------------------------------ the scheduler
def eval_estimate(job: Job) -> float:
    """Seconds an evaluation should take: start-up, and its tokens at three times the model's
    training speed (a forward pass is about a third of a training step)."""
    timed = train_seconds(read_rows(job.out / "metrics.jsonl"))
    if not timed:
        return 60.0
    row, seconds = timed[-1]
    speed = row["tokens"] / max(seconds, 1e-9)
    return 30.0 + job.eval_tokens / (3 * speed)


def _default_sigint() -> None:
    """In a job's process before it runs: SIGINT back to its default. A scheduler started in the
    background (``cmd &`` in a script) or by a test runner's worker ignores SIGINT, and a job
    would inherit that until it installs its own handler: a deadline's stop sent in that window
    would be lost and the job would run on past the deadline."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class Scheduler:
    """Runs the ready jobs, one per slot (GPU), within the deadline.

    ``clock`` gives the seconds that the deadline and the time limits count; a test passes its
    own, so that what it checks does not hang on how fast a shared host runs."""

    def __init__(
        self,
        jobs: list[Job],
        o: argparse.Namespace,
        env: dict,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.jobs, self.o, self.env, self.clock = {j.name: j for j in jobs}, o, env, clock
        self.start = clock()
        self.deadline = self.start + o.deadline if o.deadline else math.inf
        self.running: dict[str, tuple[subprocess.Popen, str, float]] = {}
        self.finished: set[str] = set()  # this invocation: done, failed, stopped or skipped
        self.failed: set[str] = set()

    def say(self, text: str) -> None:
        print(f"[{self.clock() - self.start:6.0f} s] {text}", flush=True)

    def left(self) -> float:
        return self.deadline - self.clock()

    def ready(self) -> list[Job]:
        out = []
        for job in self.jobs.values():
            if job.name in self.finished or job.name in self.running:
                continue
            if any(d in self.failed for d in job.deps):
                self.finished.add(job.name)
                self.failed.add(job.name)
                self.say(f"{job.name}: skipped, a job it needs failed")
                continue
            # save_pretrained writes model.safetensors in place: a training job still running
            # may not have finished writing it.
            if all(self.jobs[d].done() and d not in self.running for d in job.deps):
                out.append(job)
        return out

    def may_start(self, job: Job) -> tuple[bool, float | None]:
        """Whether ``job`` may start now, and the --time-limit it gets."""
        left = self.left()
        if job.kind == "train":
            if left < max(self.o.min_job_s, self.o.margin_s + 1):
                return False, None
            return True, None if math.isinf(left) else left - self.o.margin_s
        return eval_estimate(job) <= left - self.o.margin_s, None

    def launch(self, job: Job, slot: str, time_limit: float | None) -> None:
        log = job.log(self.o.runs)
        log.parent.mkdir(parents=True, exist_ok=True)
        cmd = job.command(time_limit)
        env = dict(self.env, CUDA_VISIBLE_DEVICES="" if self.o.smoke else slot)
        with log.open("a") as f:
            f.write(f"\n$ {shlex.join(cmd)}\n")
            f.flush()
            # In this process's group (no session of its own): whatever ends this process
            # from outside ends the jobs too, so none trains on unwatched.
            proc = subprocess.Popen(
                cmd, stdout=f, stderr=subprocess.STDOUT, env=env, preexec_fn=_default_sigint
            )
        self.running[job.name] = (proc, slot, self.clock())
        what = "resuming" if "--resume" in cmd else "starting"
        limit = "" if time_limit is None else f", time limit {time_limit:.0f} s"
        self.say(f"{what} {job.name} on {'slot' if self.o.smoke else 'GPU'} {slot}{limit}")

    def reap(self) -> None:
        for name, (proc, _, began) in list(self.running.items()):
            if proc.poll() is None:
                continue
            del self.running[name]
            self.finished.add(name)
            job, took = self.jobs[name], self.clock() - began
            if proc.returncode == 0 and job.done():
                self.say(f"{name}: done in {took:.0f} s")
            elif proc.returncode == 0:
                self.say(
                    f"{name}: stopped with a checkpoint before its last step (time limit) "
                    f"after {took:.0f} s; the next invocation resumes it"
                )
            else:
                self.failed.add(name)
                tail = job.log(self.o.runs).read_text().splitlines()[-15:]
                self.say(
                    f"{name}: FAILED (exit {proc.returncode}) after {took:.0f} s; end of "
                    f"{job.log(self.o.runs)}:\n    " + "\n    ".join(tail)
                )

    def stop_all(self, why: str) -> None:
        # SIGINT, as Ctrl-C would: a training run may save a checkpoint on its way out.
        for name, (proc, _, _) in list(self.running.items()):
            if proc.poll() is None:
                self.say(f"{name}: stopping it ({why})")
                proc.send_signal(signal.SIGINT)
        for name, (proc, _, _) in list(self.running.items()):
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            del self.running[name]
            self.finished.add(name)

    def run(self) -> None:
        done = [j.name for j in self.jobs.values() if j.done()]
        self.finished.update(done)
        if done:
            self.say(f"already done, skipped: {', '.join(done)}")
        slots = list(self.o.gpus)
        try:
            while True:
                self.reap()
                free = [s for s in slots if s not in {v[1] for v in self.running.values()}]
                waiting = False
                for job in self.ready():
                    if not free:
                        break
                    ok, limit = self.may_start(job)
                    if ok:
                        self.launch(job, free.pop(0), limit)
                    else:
                        waiting = True
                if not self.running:
                    if waiting:
                        self.say("too little time left to start the jobs that are ready")
                    break
                if self.left() <= 0:
                    self.stop_all("deadline")
                    break
                time.sleep(self.o.poll_s)
        finally:
            if self.running:
                self.stop_all("interrupted")
        left = [j.name for j in self.jobs.values() if not j.done()]
        if left:
            self.say(
                f"{len(left)} jobs unfinished ({', '.join(left)}): run the same command "
                "again to continue"
            )
        else:
            self.say("all jobs done")


# ----------------------------------------------------------------------------------- report
def report(jobs: list[Job], o: argparse.Namespace) -> None:
    rows = summarize(jobs)
    if not rows:
        print("nothing to report yet")
        return
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(o).items()}
    variants = {v: VARIANTS[v] for v in {*o.variants, *o.variants_128k, o.base_variant}}
    commands = [shlex.join(sys.argv[1:])]
    write_report(rows, environment(), settings, variants, commands, o.out_dir, o.name)


# ------------------------------------------------------------------------------ command line
def _ints(text: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") from None


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = ap.add_argument
    add("--runs", type=Path, help="where the runs and their logs go (required but with --merge)")
    add("--gpus", default="0", help="GPUs to use, one job each (default 0)")
    add("--seeds", type=_ints, default=[0], help="comma-separated seeds (default 0)")
    add(
        "--variants",
        default="dense,hhst,local",
        help=f"of {', '.join(VARIANTS)} and those --variant-args adds (default dense,hhst,local)",
    )
    add(
        "--variants-128k",
        default=None,
        help="the variants that go on to 128k, of --variants (default all of them); NAME:FROM "
        "adds a 128k-only variant NAME (say, another stride) started from FROM's 32k weights",
    )
    add(
        "--variant-args",
        action="append",
        default=[],
        metavar="NAME=ARGS",
        help="add (or replace) variant NAME: its `s2attn train` arguments (repeatable)",
    )
    add("--base-variant", default="hhst", help="variant of the 4k base (default hhst)")
    add("--preset", help="model preset (default small; tiny with --smoke)")
    add("--base-short-len", type=int, help="the base's first phase length (1024)")
    add("--base-short-steps", type=int, help="its steps (4000)")
    add("--base-steps", type=int, help="steps of the base at the preset's length (800)")
    for phase, length, steps, batch in (("32k", 32768, 300, 2), ("128k", 131072, 100, 1)):
        add(f"--len-{phase}", type=int, help=f"tokens per sequence ({length})")
        add(f"--steps-{phase}", type=int, help=f"optimizer steps ({steps})")
        add(f"--batch-{phase}", type=int, help=f"sequences per step ({batch})")
        add(f"--lr-{phase}", type=float, default=3e-4, help="peak learning rate (3e-4)")
        add(f"--warmup-{phase}", type=int, default=20, help="warm-up steps (20)")
        add(f"--val-every-{phase}", type=int, help="validate every N steps (a tenth)")
        add(
            f"--rope-{phase}",
            default="--rope-theta {theta_sq}",
            help="its RoPE train arguments (default '--rope-theta {theta_sq}')",
        )
    add("--checkpointing-from", type=int, help="gradient checkpointing from this length (32768)")
    add("--samples", type=int, help="needles a grid cell (20)")
    add("--depths", help="needle depths (11, from 0 to 1)")
    add("--eval-val-batches", type=int, help="validation sequences of the evaluation (8)")
    add("--train-val-batches", type=int, help="validation batches while training (2)")
    add("--train-val-needles", type=int, help="validation needles while training (8)")
    add("--checkpoint-every", type=int, help="training checkpoints every N steps (100)")
    add("--train-args", help="extra arguments for every train job")
    add(
        "--tasks",
        help="comma-separated `s2attn eval --tasks` evaluations at each phase length, all, or "
        "none (default none; all with --smoke)",
    )
    add("--task-samples", type=int, help="samples (documents) a task and phase (100; 3 smoke)")
    add("--task-args", default="", help="extra arguments for every tasks job")
    add("--deadline", type=float, help="seconds this invocation may take (default: no limit)")
    add(
        "--margin-s",
        type=float,
        default=45.0,
        help="a training job stops this long before the deadline (45)",
    )
    add(
        "--min-job-s",
        type=float,
        default=90.0,
        help="start no training job with less time left than this (90)",
    )
    add("--poll-s", type=float, default=2.0, help=argparse.SUPPRESS)
    add(
        "--until",
        choices=PHASES,
        default=PHASES[-1],
        help="plan the jobs up to this phase only (default 128k: all)",
    )
    add(
        "--base-from",
        type=Path,
        default=None,
        help="start the 32k phase from the 4k bases in DIR/s<seed> (a model saved by s2attn "
        "train) instead of training them here",
    )
    add("--report-only", action="store_true", help="tabulate and plot the runs; run nothing")
    add(
        "--merge",
        nargs="+",
        type=Path,
        metavar="JSON",
        help="one report from these JSON reports of invocations run apart (same bases and "
        "phases), written to --out-dir; runs nothing",
    )
    add("--dry-run", action="store_true", help="list the jobs and their commands; run nothing")
    add("--smoke", action="store_true", help="CPU: tiny preset, toy lengths, a few steps")
    add("--out-dir", type=Path, default=RESULTS)
    add("--name", default="long_context", help="result files' name (after date and device)")
    o = ap.parse_args(argv)
    if o.merge:
        return o
    if o.runs is None:
        ap.error("--runs is required (but with --merge)")

    defaults = SMOKE if o.smoke else DEFAULTS
    for key, value in defaults.items():
        if getattr(o, key) is None:
            setattr(o, key, value)
    for spec in o.variant_args:
        name, sep, args = spec.partition("=")
        if not sep or not name.strip():
            ap.error(f"--variant-args takes NAME=ARGS, got {spec!r}")
        VARIANTS[name.strip()] = shlex.split(args)
    o.variants = [v.strip() for v in o.variants.split(",") if v.strip()]
    o.sources_128k = {}
    if o.variants_128k is None:
        o.variants_128k = list(o.variants)
    else:
        specs = [v.strip() for v in o.variants_128k.split(",") if v.strip()]
        o.variants_128k = [v.partition(":")[0].strip() for v in specs]
        o.sources_128k = {
            name.strip(): source.strip()
            for name, sep, source in (v.partition(":") for v in specs)
            if sep
        }
        plain = [v for v in o.variants_128k if v not in o.sources_128k]
        if not set(plain + list(o.sources_128k.values())) <= set(o.variants):
            ap.error(
                f"--variants-128k {specs}: each variant, or the FROM of NAME:FROM, must be among "
                f"--variants {o.variants}"
            )
    for v in [*o.variants, *o.variants_128k, o.base_variant]:
        if v not in VARIANTS:
            ap.error(
                f"unknown variant {v!r}: choose from {', '.join(VARIANTS)} or add it with "
                "--variant-args"
            )
    if not o.seeds:
        ap.error("--seeds: at least one seed")
    from s2attn.training.tasks import TASK_NAMES, TASKS

    o.tasks = [t.strip() for t in o.tasks.split(",") if t.strip() and t.strip() != "none"]
    if o.tasks == ["all"]:
        o.tasks = list(TASK_NAMES)
    unknown = [t for t in o.tasks if t not in TASK_NAMES]
    if unknown:
        ap.error(
            f"--tasks: unknown {', '.join(unknown)}; choose from {', '.join(TASK_NAMES)} "
            "(or all, or none, alone)"
        )
    o.tasks = list(dict.fromkeys(o.tasks))
    o.task_min_lengths = {t: TASKS[t].min_length() for t in o.tasks if t in TASKS}
    if o.task_samples < 1:
        ap.error(f"--task-samples must be >= 1, got {o.task_samples}")
    if o.base_from is not None:
        for seed in o.seeds:
            base = o.base_from / f"s{seed}"
            if not (base / "model.safetensors").is_file() or not (base / "run.json").is_file():
                ap.error(f"--base-from: {base} holds no model.safetensors and run.json of a run")
    o.gpus = [g.strip() for g in o.gpus.split(",") if g.strip()]
    if not o.gpus:
        ap.error("--gpus: at least one GPU")

    from s2attn.training.presets import PRESETS

    if o.preset not in PRESETS:
        ap.error(f"--preset: one of {', '.join(PRESETS)}")
    preset = PRESETS[o.preset]
    o.base_len, o.base_batch = preset.seq_len, preset.batch_size
    if (o.base_batch * o.base_len) % o.base_short_len:
        ap.error("--base-short-len must divide the preset's tokens per step")
    o.phase = {}
    for phase in PHASES[1:]:
        key = phase
        p = dict(
            len=getattr(o, f"len_{key}"),
            steps=getattr(o, f"steps_{key}"),
            batch=getattr(o, f"batch_{key}"),
            lr=getattr(o, f"lr_{key}"),
            warmup=getattr(o, f"warmup_{key}"),
            rope=getattr(o, f"rope_{key}"),
        )
        every = getattr(o, f"val_every_{key}")
        p["val_every"] = every if every is not None else max(1, p["steps"] // 10)
        for name in ("len", "steps", "batch", "val_every"):
            if p[name] < 1:
                ap.error(f"--{name.replace('_', '-')}-{phase} must be >= 1")
        o.phase[phase] = p
    if not o.base_len < o.phase["32k"]["len"] < o.phase["128k"]["len"]:
        ap.error(f"lengths must grow: base {o.base_len}, then --len-32k, then --len-128k")
    o.device_args = ["--device", "cpu"] if o.smoke else []
    if o.deadline is not None and o.deadline <= 0:
        ap.error("--deadline must be a positive number of seconds")
    o.runs = o.runs.resolve()
    return o


def job_environment(o: argparse.Namespace) -> dict:
    """The environment of every job: this tree first on the path."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    if o.smoke:
        # The CPU runs S2 layers through the exact reference, not the Triton interpreter.
        env.pop("TRITON_INTERPRET", None)
        env["OMP_NUM_THREADS"] = "1"
    return env


def _terminated(signum, frame):
    raise SystemExit(128 + signum)  # through the scheduler's clean-up, which stops the jobs


def main(argv: list[str] | None = None) -> int:
    o = parse(argv)
    if o.merge:
        merge_reports(o.merge, o.out_dir, o.name)
        return 0
    jobs = plan_jobs(o)
    if o.dry_run:
        for job in jobs:
            state = "done" if job.done() else "to do"
            print(
                f"{job.name} [{state}; after {', '.join(job.deps) or 'nothing'}]\n  "
                f"{shlex.join(job.command(None))}"
            )
        return 0
    if not o.report_only:
        o.runs.mkdir(parents=True, exist_ok=True)
        signal.signal(signal.SIGTERM, _terminated)
        Scheduler(jobs, o, job_environment(o)).run()
    report(jobs, o)
    return 0


if __name__ == "__main__":
    sys.exit(main())
