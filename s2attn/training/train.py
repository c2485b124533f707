"""Training a language model of any variant: ``python -m s2attn train`` (its options:
:mod:`s2attn.training.options`).

One run trains one variant (:data:`~s2attn.training.presets.VARIANTS`) of one preset
(:data:`~s2attn.training.presets.PRESETS`) on the offline byte-level data of
:mod:`s2attn.training.data`, and writes into its output directory:

- ``run.json``: the resolved options, the preset, the model summary (parameters, layer kinds and
  densities), what the data reads (both splits' ``describe()``), the device, library versions,
  date and git commit.
- ``metrics.jsonl``: one JSON object per logged step, every quantity named with its unit:
  ``step``, ``loss_nats`` (mean training cross-entropy since the previous row, in nats per
  token), ``train_bpb`` (the same in bits per byte: a token is a byte), ``tokens`` (input tokens
  seen so far), ``lr``, ``grad_norm`` (before clipping), ``tokens_per_s`` (training time only),
  ``elapsed_s`` (wall time since the run started, summed over resumes) and on CUDA
  ``max_mem_gib``; validation rows add ``val_bpb`` (bits per byte on fixed held-out batches) and
  ``val_needle_acc`` (retrieval accuracy, a fraction, on fixed samples at the training length).
  Runs written before the units were named call these ``loss``, ``val_loss`` and
  ``val_needle``: read rows through :func:`~s2attn.training.metrics.read_metrics` (or
  :func:`~s2attn.training.metrics.metrics_row`), which gives the current names for both.
- ``checkpoint/``: model, optimizer, schedule, data stream and RNG states, for ``--resume``.
- ``train.lock``: locked by the process training in the directory, and holding its pid.
- at the end, the model (``save_pretrained``: ``config.json`` with the S2 settings and
  ``model.safetensors``), then ``curves.png`` (drawn last, and only with matplotlib installed: a
  run without it says so at its start, and ends well without the picture).

Recipe: AdamW (fused on CUDA; betas 0.9, 0.95; weight decay 0.1 on matrices only), linear
warm-up then cosine decay to 10% of the peak learning rate, gradients clipped to norm 1.0. On
CUDA the default precision keeps float32 master weights and runs under bf16 autocast; on the CPU
everything is float32.

Resuming (``--resume``) continues from the last checkpoint exactly: on one machine the losses
after it equal those of a run that never stopped (bitwise on the CPU), and ``metrics.jsonl``
goes on where the checkpoint was taken. ``--stop-at``, ``--time-limit`` and Ctrl-C end a run
early with a checkpoint of the step just completed and print the command that finishes it
(Ctrl-C exits with status 130; a second Ctrl-C stops at once, without a checkpoint). Every
input is checked, and the data listed, before anything is written; an output directory that
holds another run, a ``--resume`` with no checkpoint to resume from, and a directory that
another ``train`` process is using (a lock on ``train.lock`` inside it) are refused.

Long context: a run at a longer ``--seq-len`` starts from a shorter run's model with
``--init-from DIR``; its patterns and RoPE table cover ``--max-seq-len`` (default ``--seq-len``).
The source must have the same architecture (layers, hidden and MLP sizes, heads, KV heads,
vocabulary: the differing fields are listed otherwise); its variant may differ, since the
variants share every weight. ``--rope-theta`` sets the RoPE base, ``--rope-scaling linear
--rope-factor F`` divides positions by F (position interpolation); unset, they are the source
model's with ``--init-from``, else the preset's (base 10000, no scaling). The saved
``config.json`` records them, so ``s2attn eval`` loads the extended model as trained. Every
metrics row also holds ``step_s`` (training seconds per step), and the run ends with a line of
its steps, tokens, training time, tokens/s, step time and peak GPU memory.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shlex
import shutil
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from ..integrations import transformers as s2hf
from . import presets
from .checkpoints import (
    CHECKPOINT,
    Progress,
    find_checkpoint,
    load_checkpoint,
    save_checkpoint,
    saved_step,
)
from .data import TokenStream, default_roots
from .dependencies import INSTALL, OPTIONAL, missing
from .evaluate import needle_accuracy, validation_bpb
from .metrics import plot_curves, run_summary, truncate_metrics
from .options import TrainOptions, add_arguments
from .run_directory import CURVES_FILE, METRICS_FILE, RUN_FILE, claim, run_record, write_atomic
from .run_plan import RunPlan, prepare

__all__ = ["add_arguments", "lr_factor", "run"]

_BETAS = (0.9, 0.95)
_WEIGHT_DECAY = 0.1
_CLIP_NORM = 1.0
_MIN_LR_RATIO = 0.1
# The exit status of a command stopped by Ctrl-C (128 + SIGINT), as shells report it.
_INTERRUPTED = 130


def _initial_model(plan: RunPlan, resuming: bool):
    """The model a run starts from: fresh weights of its seed, or (not ``resuming``) the
    --init-from model's. Every S2 and RoPE setting lives in the config, so the weights carry
    over between lengths and between variants of one preset; the tied head is the embedding,
    loaded with it."""
    model = presets.build_model(plan.config, seed=plan.options.seed)
    if plan.initial_weights is not None and not resuming:
        result = model.load_state_dict(plan.initial_weights, strict=False)
        tied = {"lm_head.weight"} if plan.config.tie_word_embeddings else set()
        missing = sorted(set(result.missing_keys) - tied)
        if missing or result.unexpected_keys:
            raise ValueError(
                f"--init-from: weights missing {missing[:3]}, unexpected "
                f"{result.unexpected_keys[:3]}"
            )
    return model


# --------------------------------------------------------------------- optimizer, schedule
def _optimizer(model: torch.nn.Module, lr: float, device: torch.device) -> torch.optim.AdamW:
    # Decay matrices (projections, the tied embedding) only: decaying norms' gains pulls them to
    # zero for no regularising benefit.
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    other = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": _WEIGHT_DECAY},
        {"params": other, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=lr, betas=_BETAS, fused=device.type == "cuda")


def lr_factor(step: int, steps: int, warmup_steps: int) -> float:
    """The learning rate of optimizer step ``step`` (0-based) as a fraction of the peak: linear
    warm-up over ``warmup_steps``, then a cosine from 1 down to 0.1 at the last step."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    decay_steps = max(steps - warmup_steps - 1, 1)
    progress = min((step - warmup_steps) / decay_steps, 1.0)
    return _MIN_LR_RATIO + (1 - _MIN_LR_RATIO) * 0.5 * (1 + math.cos(math.pi * progress))


def _save_model(model, out: Path) -> None:
    """``save_pretrained`` without transformers' one-shard progress bar in the run's output."""
    from transformers.utils import logging as hf_logging

    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(out)
    finally:
        if shown:
            hf_logging.enable_progress_bar()


def _resume_command(plan: RunPlan) -> str:
    """The command that finishes this run: ``--out DIR --resume`` and every option that does
    not take its default value (``--resume`` refuses options that differ from the run's)."""
    opts = plan.options
    flags = opts.flags()
    parser = argparse.ArgumentParser()
    add_arguments(parser)

    def resolved(chosen: list[list[str]]) -> TrainOptions:
        argv = ["--out", str(plan.out), *(token for flag in chosen for token in flag)]
        return TrainOptions.resolve(parser.parse_args(argv))

    # Leave out, one at a time, every option that the remaining ones resolve to anyway (some
    # only once another is gone: --max-seq-len before --seq-len).
    want, kept = resolved(flags), list(flags)
    for flag in flags:
        fewer = [f for f in kept if f is not flag]
        try:
            if resolved(fewer) == want:
                kept = fewer
        except ValueError:
            pass
    if list(opts.data_root) != [str(r) for r in default_roots()]:
        kept += [["--data-root", root] for root in opts.data_root]
    if opts.init_from is not None:
        kept.append(["--init-from", opts.init_from])
    command = ["python", "-m", "s2attn", "train", "--out", str(plan.out), "--resume"]
    return shlex.join(command + [token for flag in kept for token in flag])


class _CtrlC:
    """Ctrl-C while entered (in the main thread, where Python handles signals): the first asks
    the training loop to stop after the step in progress, with a checkpoint; a second one
    raises ``KeyboardInterrupt`` at once."""

    def __init__(self) -> None:
        self.requested = False
        self._previous = None
        self._installed = False

    def __enter__(self) -> _CtrlC:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
            self._installed = True
        return self

    def __exit__(self, *exc) -> None:
        if self._installed:
            signal.signal(signal.SIGINT, self._previous)

    def _handle(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        # os.write, not print: the handler may run in the middle of a print to the same stream.
        os.write(
            2,
            b"\ns2attn train: stopping after this step, with a checkpoint (Ctrl-C again to stop "
            b"at once, without one)\n",
        )


# ------------------------------------------------------------------------------ training
def run(args: argparse.Namespace) -> int:
    """``s2attn train``: train one run into ``args.out``. Raises ``ValueError`` for bad input
    before anything is written. Returns 0, also when ``--stop-at`` / ``--time-limit`` stopped
    the run early, and 130 when Ctrl-C did (the message says how to finish it)."""
    started = time.perf_counter()
    try:
        plan = prepare(args)
    except KeyboardInterrupt:
        print("\ns2attn train: interrupted; nothing was written", file=sys.stderr)
        return _INTERRUPTED
    lock = None
    try:
        lock, resume_from = claim(plan.out, plan.options, plan.controls.resume)
        absent = missing(OPTIONAL)
        if absent:
            print(
                f"s2attn train: warning: {' and '.join(absent)}: the run trains and saves its "
                f"model, but draws no {CURVES_FILE} ({INSTALL})",
                file=sys.stderr,
            )
        with _CtrlC() as ctrl_c:
            return _train(plan, resume_from, started, ctrl_c)
    except KeyboardInterrupt:
        checkpoint = find_checkpoint(plan.out)
        if checkpoint is None:
            where = "no checkpoint was written"
        else:
            step = saved_step(checkpoint)
            where = f"the checkpoint of step {step} continues with:\n  {_resume_command(plan)}"
        print(f"\ns2attn train: interrupted; {where}", file=sys.stderr)
        return _INTERRUPTED
    finally:
        if lock is not None:
            lock.close()


@dataclass
class _State:
    """What training changes: the model, its optimizer and schedule, the data stream, the
    counters, and the running loss of the current metrics row (on the device, so that a step
    does not wait for the GPU)."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    stream: TokenStream
    progress: Progress
    row_loss: torch.Tensor
    # Wall time of the run before this process started, and when this process started.
    elapsed_base: float
    started: float

    def elapsed(self) -> float:
        return self.elapsed_base + time.perf_counter() - self.started


@dataclass
class _Stop:
    """When the run stops: the last step this process trains, and why if before ``--steps``."""

    last: int
    reason: str | None = None

    def at(self, step: int, reason: str) -> None:
        self.last, self.reason = step, reason


def _train(plan: RunPlan, resume_from: Path | None, started: float, ctrl_c: _CtrlC) -> int:
    """Train from the start, or from the checkpoint ``resume_from``, to ``--steps`` or an early
    stop; returns the exit status."""
    from tqdm.auto import tqdm

    opts, stop_at = plan.options, plan.controls.stop_at
    state = _set_up(plan, resume_from, started)
    progress = state.progress
    stop = _Stop(min(opts.steps, stop_at) if stop_at else opts.steps)
    _print_start(plan, progress.step)
    if ctrl_c.requested:
        stop.at(progress.step, "Ctrl-C")
        if resume_from is None:
            # Stopped before its first step: a checkpoint of step 0 makes the run resumable.
            _checkpoint(plan, state)
    bar = tqdm(
        total=opts.steps,
        initial=progress.step,
        unit="step",
        file=sys.stderr,
        dynamic_ncols=True,
        mininterval=1.0,
        disable=not plan.controls.progress,
    )
    with (plan.out / METRICS_FILE).open("a") as log, bar:
        while progress.step < stop.last:
            t0 = time.perf_counter()
            lr, grad_norm = _step(plan, state)
            step = progress.step
            validating = step == opts.steps or bool(opts.val_every and step % opts.val_every == 0)
            if step % opts.log_every == 0 or validating:
                row = _metrics_row(plan, state, lr, grad_norm, t0)
                if validating:
                    _validate(plan, state.model, row)
                _log(plan, state, row, log, bar, validating)
            else:
                progress.row_train_s += time.perf_counter() - t0
            bar.update()
            _check_stop(plan, stop, step, ctrl_c, started)
            if step == stop.last or (opts.checkpoint_every and step % opts.checkpoint_every == 0):
                _checkpoint(plan, state)
    return _finish(plan, state, stop)


def _set_up(plan: RunPlan, resume_from: Path | None, started: float) -> _State:
    """Write the run's record (a fresh run), seed, build the model, optimizer and schedule, and
    load the checkpoint ``resume_from`` when resuming."""
    opts, out, device = plan.options, plan.out, plan.device
    metrics_path = out / METRICS_FILE
    if resume_from is None:
        corpora = {"train": plan.train_corpus, "val": plan.val_corpus}
        record = run_record(opts, plan.config, corpora, device)
        write_atomic(out / RUN_FILE, json.dumps(record, indent=2) + "\n")
        metrics_path.write_text("")
        shutil.rmtree(out / CHECKPOINT, ignore_errors=True)
    torch.manual_seed(opts.seed)
    random.seed(opts.seed)
    model = _initial_model(plan, resuming=resume_from is not None)
    if opts.precision == "bf16":
        model.to(torch.bfloat16)
    model.to(device)
    if opts.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    # In place: the state dict keeps its keys, so checkpoints and saved models are the
    # uncompiled model's. The S2 layers are custom operators Inductor calls as they are.
    if opts.compile_layers:
        s2hf.compile_layers(model)
    elif opts.compile:
        model.compile()
    optimizer = _optimizer(model, opts.lr, device)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, opts.steps, opts.warmup_steps)
    )
    stream = plan.stream
    progress = Progress()
    if resume_from is not None:
        progress = load_checkpoint(resume_from, model, optimizer, scheduler, stream, device)
    truncate_metrics(metrics_path, progress.step)
    row_loss = torch.tensor(progress.row_loss, dtype=torch.float32, device=device)
    return _State(
        model, optimizer, scheduler, stream, progress, row_loss, progress.elapsed_s, started
    )


def _print_start(plan: RunPlan, step: int) -> None:
    opts = plan.options
    summary = presets.model_summary(plan.config, opts.seq_len)
    layers = "".join("D" if t == "dense" else "S" for t in summary["layer_types"])
    print(
        f"s2attn train: {opts.variant} ({opts.preset}), {summary['parameters'] / 1e6:.2f}M "
        f"parameters, layers {layers} (D dense, S sparse), mean density "
        f"{summary['mean_density']}; {opts.steps} steps x {opts.tokens_per_step} tokens on "
        f"{plan.device} ({opts.precision}); "
        + (f"resuming at step {step}" if step else "starting")
        + f"; writing {plan.out}",
        flush=True,
    )


def _step(plan: RunPlan, state: _State) -> tuple[float, torch.Tensor]:
    """One optimizer step over ``--grad-accum`` micro-batches; returns the step's learning rate
    and gradient norm (before clipping)."""
    opts, device, model = plan.options, plan.device, state.model
    autocast = opts.autocast_dtype
    for _ in range(opts.grad_accum):
        batch, answers = state.stream.next_batch_with_answers()
        batch = batch.to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=autocast, enabled=autocast is not None):
            logits = model(input_ids=batch[:, :-1], use_cache=False).logits
        # Cross-entropy in float32 whatever the logits' dtype: bf16 would round it.
        token_loss = F.cross_entropy(
            logits.float().flatten(0, 1), batch[:, 1:].flatten(), reduction="none"
        )
        loss = token_loss.mean()  # what is logged: the plain language-model loss
        objective = loss
        if opts.answer_weight != 1:
            # The answers are a few tokens in thousands: weighting them is what lets a small
            # model learn retrieval within a short run.
            extra = answers[:, 1:].flatten().to(device, non_blocking=True)
            weighted = (token_loss * extra).sum() / token_loss.numel()
            objective = loss + (opts.answer_weight - 1) * weighted
        (objective / opts.grad_accum).backward()
        state.row_loss += loss.detach() / opts.grad_accum
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), _CLIP_NORM)
    lr = state.optimizer.param_groups[0]["lr"]
    state.optimizer.step()
    state.scheduler.step()
    state.optimizer.zero_grad(set_to_none=True)
    progress = state.progress
    progress.step += 1
    progress.tokens += opts.tokens_per_step
    progress.row_steps += 1
    progress.row_tokens += opts.tokens_per_step
    return lr, grad_norm


def _metrics_row(plan: RunPlan, state: _State, lr: float, grad_norm, t0: float) -> dict:
    """The training part of a metrics row: the means since the previous row."""
    progress = state.progress
    if plan.device.type == "cuda":
        torch.cuda.synchronize(plan.device)
    progress.row_train_s += time.perf_counter() - t0
    mean_loss = state.row_loss.item() / progress.row_steps
    if not math.isfinite(mean_loss):
        raise FloatingPointError(
            f"the training loss became {mean_loss} by step {progress.step}; lower --lr or "
            "raise --warmup-steps"
        )
    return {
        "step": progress.step,
        "loss_nats": mean_loss,
        "train_bpb": mean_loss / math.log(2),
        "tokens": progress.tokens,
        "lr": lr,
        "grad_norm": float(grad_norm),
        "tokens_per_s": progress.row_tokens / max(progress.row_train_s, 1e-9),
        "step_s": progress.row_train_s / progress.row_steps,
    }


def _validate(plan: RunPlan, model, row: dict) -> None:
    """Add the held-out bits per byte and the needle accuracy to ``row``."""
    autocast = plan.options.autocast_dtype
    if plan.val_batches:
        row["val_bpb"] = validation_bpb(
            model, plan.val_batches, device=plan.device, autocast_dtype=autocast
        )
    if plan.val_needles:
        row["val_needle_acc"] = needle_accuracy(
            model,
            plan.val_needles,
            device=plan.device,
            autocast_dtype=autocast,
            batch_size=plan.options.batch_size,
        )


def _log(plan: RunPlan, state: _State, row: dict, log, bar, validating: bool) -> None:
    """Write ``row`` to the metrics, show it, and start the next row's sums."""
    row["elapsed_s"] = state.elapsed()
    if plan.device.type == "cuda":
        row["max_mem_gib"] = torch.cuda.max_memory_allocated(plan.device) / 2**30
    log.write(json.dumps(row) + "\n")
    log.flush()
    loss = row["loss_nats"]
    bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{row['tokens_per_s']:.3g}", refresh=False)
    if validating:
        val = f"val {row['val_bpb']:.4f} bits/byte, " if "val_bpb" in row else ""
        needle = f"needle {row['val_needle_acc']:.2f}, " if "val_needle_acc" in row else ""
        bar.write(
            f"step {row['step']}/{plan.options.steps}: loss {loss:.4f} nats, {val}{needle}"
            f"{row['tokens_per_s']:.4g} tokens/s",
            file=sys.stdout,
        )
    state.row_loss.zero_()
    progress = state.progress
    progress.row_loss = 0.0
    progress.row_steps = progress.row_tokens = 0
    progress.row_train_s = 0.0


def _check_stop(plan: RunPlan, stop: _Stop, step: int, ctrl_c: _CtrlC, started: float) -> None:
    """Stop after ``step`` once ``--time-limit`` has passed or Ctrl-C asked to."""
    over_time = (
        plan.controls.time_limit and time.perf_counter() - started > plan.controls.time_limit
    )
    if over_time and step < plan.options.steps:
        stop.at(step, f"--time-limit {plan.controls.time_limit:g} s")
    if ctrl_c.requested and step < stop.last:
        stop.at(step, "Ctrl-C")


def _checkpoint(plan: RunPlan, state: _State) -> None:
    progress = state.progress
    # The GPU's queued work belongs to the row's training time, not to the save.
    t1 = time.perf_counter()
    progress.row_loss = state.row_loss.item()
    progress.row_train_s += time.perf_counter() - t1
    progress.elapsed_s = state.elapsed()
    save_checkpoint(
        plan.out,
        state.model,
        state.optimizer,
        state.scheduler,
        state.stream,
        progress,
        plan.device,
    )
    progress.row_loss = 0.0


def _finish(plan: RunPlan, state: _State, stop: _Stop) -> int:
    """The summary, the model when the run is complete, then the curves (optional: they come
    after everything a run cannot do without); else how to finish the run."""
    opts, out, progress = plan.options, plan.out, state.progress
    metrics_path = out / METRICS_FILE
    print(run_summary(metrics_path, progress, plan.device), flush=True)
    complete = progress.step >= opts.steps
    if complete:
        _save_model(state.model, out)
    drawn = not missing(OPTIONAL)
    if drawn:
        title = f"{opts.variant} ({opts.preset}, seq {opts.seq_len}, seed {opts.seed})"
        plot_curves(metrics_path, out / CURVES_FILE, title, opts.needle_fraction > 0)
    if not complete:
        reason = stop.reason or f"--stop-at {plan.controls.stop_at}"
        print(
            f"stopped at step {progress.step} of {opts.steps} ({reason}); checkpoint in "
            f"{out / CHECKPOINT}; continue with:\n  {_resume_command(plan)}",
            flush=True,
        )
        return _INTERRUPTED if reason == "Ctrl-C" else 0
    made = "model, metrics and curves" if drawn else f"model and metrics (no {CURVES_FILE})"
    print(f"done: {opts.steps} steps, {progress.tokens} tokens; {made} in {out}")
    return 0
