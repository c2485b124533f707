"""Evaluating a language model: validation bits per byte and needle retrieval.

Three functions serve training and the ``s2attn eval`` command alike:

- :func:`validation_bpb`: mean next-token cross-entropy in bits over batches of held-out text.
  Tokens are bytes, so this is bits per byte; the ``BOS`` that starts every document counts as
  one token (a byte) both when predicted and when predicting.
- :func:`needle_accuracy`: the fraction of retrieval samples whose whole answer the model
  predicts exactly by greedy argmax under teacher forcing, which equals greedy generation of the
  answer, in one forward pass.
- :func:`needle_samples`: deterministic retrieval samples for a grid of depths at one length.

Every function takes any callable model that maps ``(batch, seq)`` int64 token ids to an object
with ``.logits`` of shape ``(batch, seq, vocab)`` (a transformers causal LM, or a stub in tests).
A transformers causal LM is run as its decoder, and its output head applied to at most
``scoring._LOGIT_ROWS`` positions at a time (the needle answers' only, for retrieval), so no
``(batch, seq, vocab)`` float32 tensor is ever made at long lengths.

``python -m s2attn eval DIR`` (:func:`add_arguments`, :func:`run`) loads a model saved by
``s2attn train``, reports its validation bits per byte and, with ``--needle``, its retrieval
accuracy over a grid of context lengths and needle depths, written as JSON and a heat map. At long
lengths it reads one sequence per forward pass (``--batch-size`` defaults to the run's, capped at
``_BATCH_TOKENS`` tokens a pass), and before loading anything it estimates the memory its
largest forward pass needs (:func:`forward_memory`): one that cannot fit the device's free
memory is refused with that figure. It prints its own wall time (and on CUDA the peak memory
next to the estimate).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from . import scoring, tasks
from .data import SourceCorpus, TokenStream, needle_filler
from .dependencies import INSTALL, OPTIONAL, missing
from .model_dir import load_model, read_model_dir
from .needles import NeedleSample, make_needle_sample
from .presets import parameter_count
from .scoring import _check_batch, _evaluating, _length_label, _sum_cross_entropy, needle_accuracy

__all__ = [
    "add_arguments",
    "forward_memory",
    "free_memory",
    "needle_accuracy",
    "needle_samples",
    "plot_needle_heatmaps",
    "run",
    "validation_batches",
    "validation_bpb",
]

# Tokens a single-needle sample spends on the needle and the question: 2 * (KEY key VALUE value)
# with the data module's default key and value lengths.
_KEY_LEN, _VALUE_LEN = 4, 6
_NEEDLE_OVERHEAD = 2 * (2 + _KEY_LEN + _VALUE_LEN)
# Tokens a forward pass of `s2attn eval` reads by default: one sequence from 32k tokens on.
_BATCH_TOKENS = 32768


# ------------------------------------------------------------------------ shared functions
def validation_bpb(
    model,
    batches: Sequence[torch.Tensor],
    *,
    device: str | torch.device,
    autocast_dtype: torch.dtype | None = None,
) -> float:
    """Mean next-token cross-entropy of ``model`` over ``batches``, in bits (nats / ln 2).

    Args:
        model: a callable mapping ``(batch, seq_len)`` int64 ids to an object with ``.logits``
            of shape ``(batch, seq_len, vocab)``; already on ``device``.
        batches: ``(batch, seq_len + 1)`` int64 tensors (any device): inputs are ``x[:, :-1]``,
            targets ``x[:, 1:]``. Batches may differ in size and length.
        device: where to run.
        autocast_dtype: run under ``torch.autocast`` with this dtype (bf16 on CUDA); ``None``
            runs in the model's own dtype.

    Returns the mean over every target token of every batch (not a mean of batch means). With
    byte-level tokens this is bits per byte; ``BOS`` separators count as tokens.

    Example::

        batches = validation_batches(SourceCorpus(split="val"), 4096, 8, count=8, seed=0)
        bpb = validation_bpb(model, batches, device="cuda", autocast_dtype=torch.bfloat16)
    """
    if len(batches) == 0:
        raise ValueError("batches must hold at least one batch, got none")
    for i, batch in enumerate(batches):
        _check_batch(batch, f"batches[{i}]")
    total_nats, tokens = 0.0, 0
    with _evaluating(model, device, autocast_dtype):
        for batch in batches:
            batch = batch.to(device=device, dtype=torch.int64)
            total_nats += _sum_cross_entropy(model, batch)
            tokens += batch[:, 1:].numel()
    return total_nats / tokens / math.log(2)


def forward_memory(config, tokens: int, *, weight_bytes: int = 4, activation_bytes: int = 2) -> int:
    """Estimated peak bytes of a no-grad forward pass of a transformers Llama model of
    ``config`` over ``tokens`` tokens (batch times length), logits as :func:`validation_bpb`
    makes them: the weights, the float32 residual stream, the larger of one layer's attention
    and MLP intermediates (q and k rotated in float32, as transformers' RoPE leaves them under
    autocast), the RoPE table and one chunk of logits, plus a quarter for the allocator's
    fragmentation and temporaries. Attention itself is taken to need memory linear in the length
    (SDPA's flash or memory-efficient kernels, s2attn's kernels).

    Args:
        config: the model's config.
        tokens: tokens of the largest forward pass.
        weight_bytes: bytes per weight (4: float32 master weights).
        activation_bytes: bytes per activation element (2 under bf16 autocast, 4 in float32).
    """
    text = config.get_text_config(decoder=True)
    h, f, v = text.hidden_size, text.intermediate_size, text.vocab_size
    head_dim = getattr(text, "head_dim", None) or h // text.num_attention_heads
    q = text.num_attention_heads * head_dim
    kv = text.num_key_value_heads * head_dim
    residual = 2 * 4 * h
    attention = activation_bytes * (2 * q + 2 * kv + h) + 3 * 4 * (q + kv)
    mlp = activation_bytes * (4 * f + h)
    per_token = residual + max(attention, mlp) + 2 * 4 * head_dim
    logits = min(tokens, scoring._LOGIT_ROWS) * v * (activation_bytes + 8)
    weights = parameter_count(config) * weight_bytes
    return int(1.25 * (weights + tokens * per_token + logits))


def free_memory(device: str | torch.device) -> int | None:
    """Bytes free for a new allocation on ``device``; None where that is unknown. On the CPU,
    Linux's ``MemAvailable`` (free pages and the page cache the kernel can drop), else the free
    pages alone."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _check_depths(depths: Sequence[float]) -> list[float]:
    depths = list(depths)
    if not depths:
        raise ValueError("depths must hold at least one depth in [0, 1], got none")
    for d in depths:
        if isinstance(d, bool) or not isinstance(d, (int, float)) or not 0.0 <= d <= 1.0:
            raise ValueError(f"depths must be numbers in [0, 1], got {d!r}")
    return [float(d) for d in depths]


def _check_length(length: object, what: str = "length") -> None:
    if isinstance(length, bool) or not isinstance(length, int) or length <= _NEEDLE_OVERHEAD:
        raise ValueError(
            f"{what} must be an int > {_NEEDLE_OVERHEAD} (a needle, its question "
            f"and some filler), got {length!r}"
        )


def needle_samples(
    corpus: SourceCorpus,
    length: int,
    depths: Sequence[float],
    per_depth: int,
    seed: int,
) -> dict[float, list[NeedleSample]]:
    """Deterministic single-needle samples of ``length`` tokens at each depth.

    Sample ``i`` of every depth has the same filler (text of ``corpus``, normally the validation
    split, from a stream shuffled by ``seed`` and ``i``) and the same key and value: across
    depths only the needle's place changes, so the cells of a grid are directly comparable.

    Args:
        corpus: where the filler comes from.
        length: tokens per sample (the model reads ``length - 1``); more than 24.
        depths: numbers in ``[0, 1]``: 0 plants the needle at the start of the context, 1 right
            before the question.
        per_depth: samples per depth.
        seed: the same seed gives the same samples (on one machine and file set).

    Returns ``{depth: [NeedleSample] * per_depth}`` with ``depth`` as a float, in the given order;
    each sample's ``tokens`` has shape ``(length,)``.
    """
    _check_length(length)
    depths = _check_depths(depths)
    if isinstance(per_depth, bool) or not isinstance(per_depth, int) or per_depth < 1:
        raise ValueError(f"per_depth must be a positive int, got {per_depth!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an int, got {seed!r}")
    out: dict[float, list[NeedleSample]] = {d: [] for d in depths}
    for i in range(per_depth):
        # Large odd multipliers keep (seed, i) pairs from colliding for any realistic grid.
        filler = needle_filler(corpus, length, seed=seed * 1_000_003 + i)
        for d in depths:
            rng = random.Random(seed * 998_244_353 + i)
            out[d].append(make_needle_sample(filler, length, d, rng, _KEY_LEN, _VALUE_LEN))
    return out


def validation_batches(
    corpus: SourceCorpus, seq_len: int, batch_size: int, count: int, seed: int
) -> list[torch.Tensor]:
    """The first ``count`` batches, each ``(batch_size, seq_len + 1)`` int64, of a plain-text
    stream (no retrieval rows) over ``corpus`` with ``seed``: the same arguments give the same
    batches, so validation at every step, and after training, reads the same text."""
    stream = TokenStream(corpus, seq_len=seq_len, batch_size=batch_size, seed=seed)
    return [stream.next_batch() for _ in range(count)]


# -------------------------------------------------------------------------------- heat maps
def _depth_key(depth: float) -> str:
    return f"{depth:g}"


def plot_needle_heatmaps(results: dict[str, dict], path: str | Path) -> Path:
    """Draw one needle heat map per model, side by side (rows of four), into the image ``path``.

    Args:
        results: ``{panel title: result}`` where ``result`` is what ``s2attn eval --needle``
            writes (a dict with ``"accuracy"``) or its ``accuracy`` dict itself:
            ``{"<length>": {"<depth>": accuracy}}``. Panels may have different grids.
        path: the image to write (its suffix picks the format, e.g. ``.png``).

    Context length runs along the x axis, needle depth down the y axis (0, the start of the
    context, at the top), accuracy is the colour from red (0) to green (1), written in each cell.
    Returns ``path``.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not results:
        raise ValueError("results must hold at least one model's accuracy, got none")
    grids = {}
    for title, result in results.items():
        accuracy = result.get("accuracy", result) if isinstance(result, dict) else None
        if (
            not isinstance(accuracy, dict)
            or not accuracy
            or not all(isinstance(row, dict) and row for row in accuracy.values())
        ):
            raise ValueError(
                f"results[{title!r}] must be {{'<length>': {{'<depth>': value}}}} "
                "or hold it under 'accuracy'"
            )
        grids[title] = accuracy
    panels = len(grids)
    cols = min(panels, 4)
    rows = -(-panels // cols)
    fig, axes = plt.subplots(
        rows, cols, figsize=(1.2 + 3.2 * cols, 3.6 * rows), squeeze=False, constrained_layout=True
    )
    for ax in axes.flat[panels:]:
        ax.set_axis_off()
    image = None
    for i, (ax, (title, accuracy)) in enumerate(zip(axes.flat, grids.items())):
        lengths = sorted(accuracy, key=int)
        depths = sorted({d for row in accuracy.values() for d in row}, key=float)
        values = [[accuracy[n].get(d, float("nan")) for n in lengths] for d in depths]
        image = ax.imshow(values, cmap="RdYlGn", vmin=0.0, vmax=1.0, aspect="auto")
        for r, row in enumerate(values):
            for c, v in enumerate(row):
                ax.text(
                    c, r, "-" if math.isnan(v) else f"{v:.2f}", ha="center", va="center", fontsize=8
                )
        ax.set_xticks(range(len(lengths)), [_length_label(int(n)) for n in lengths])
        ax.set_yticks(range(len(depths)), [_depth_key(float(d)) for d in depths])
        ax.set_xlabel("context length (tokens)")
        if i % cols == 0:
            ax.set_ylabel("needle depth (0 = start)")
        ax.set_title(title, fontsize=10)
    fig.colorbar(image, ax=axes.ravel().tolist(), label="retrieval accuracy", shrink=0.9)
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------- the command
def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError(f"expected at least one int, got {text!r}")
    return values


def _float_list(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated numbers, got {text!r}"
        ) from None
    if not values:
        raise argparse.ArgumentTypeError(f"expected at least one number, got {text!r}")
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``s2attn eval``."""
    parser.add_argument("model_dir", help="a model saved by `s2attn train` (save_pretrained)")
    parser.add_argument(
        "--needle",
        action="store_true",
        help="also measure retrieval accuracy over --lengths x --depths",
    )
    parser.add_argument(
        "--lengths",
        type=_int_list,
        default=None,
        help="comma-separated context lengths in tokens (default: the training length)",
    )
    parser.add_argument(
        "--depths",
        type=_float_list,
        default=[0.0, 0.25, 0.5, 0.75, 1.0],
        help="comma-separated needle depths in [0, 1] (0 = start, 1 = end)",
    )
    parser.add_argument("--samples", type=int, default=20, help="samples per grid cell")
    tasks.add_arguments(parser)
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="write the results as JSON here, and the heat map next to it as <stem>.png",
    )
    parser.add_argument(
        "--seq-len",
        type=int,
        default=None,
        help="validation length (default: the training length from run.json)",
    )
    parser.add_argument(
        "--val-batches",
        type=int,
        default=None,
        help="validation batches for bits per byte (default: run.json's, else 4; 0 skips it)",
    )
    parser.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="sequences per forward pass (default: run.json's, else 8, capped at "
        f"{_BATCH_TOKENS} tokens a pass: 1 from {_BATCH_TOKENS} tokens on)",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=None,
        help="seed of the validation batches and needle samples (default: run.json's, else 0)",
    )
    parser.add_argument(
        "--device", choices=("cpu", "cuda"), default=None, help="default: cuda if available"
    )
    parser.add_argument(
        "--data-root",
        action="append",
        default=None,
        help="directory of the data (repeatable; default: run.json's roots, "
        "else the standard library)",
    )
    parser.add_argument(
        "--val-fraction",
        type=float,
        default=None,
        help="share of files in the validation split (default: run.json's, else 0.05)",
    )
    parser.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress bars (they show only when stderr is a terminal)",
    )


def _positive(name: str, value: int, allow_zero: bool = False) -> None:
    if value < (0 if allow_zero else 1):
        raise ValueError(f"{name} must be {'>= 0' if allow_zero else '>= 1'}, got {value}")


@dataclass(frozen=True)
class _Evaluation:
    """What ``s2attn eval`` was asked for, checked, with ``run.json``'s values (else the
    defaults) where the command line gives none."""

    model_dir: Path
    record: dict
    config: object
    limit: int
    seq_len: int
    seed: int
    val_batches: int
    val_fraction: float
    roots: list | None
    lengths: list[int]
    depths: list[float] | None
    device: str
    batch_size: int
    task_plan: tasks.TaskPlan
    # Bytes the largest forward pass needs (an estimate).
    memory_needed: int


def _resolve(args: argparse.Namespace) -> _Evaluation:
    """Check every argument, and read the model's config and context limit, before any model or
    data is loaded; raises ``ValueError`` naming the argument at fault."""
    model_dir = Path(args.model_dir)
    record, config, limit = read_model_dir(model_dir)

    def recorded(value, key: str, default, kind=int):
        return value if value is not None else kind(record.get(key, default))

    seq_len = args.seq_len or record.get("seq_len") or limit
    roots = args.data_root or record.get("data_root") or record.get("data_roots") or None
    lengths = args.lengths or [seq_len]
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    longest = max([seq_len, *lengths]) if args.needle or args.tasks else seq_len
    batch_size = args.batch_size or max(
        1, min(int(record.get("batch_size", 8)), _BATCH_TOKENS // longest)
    )
    val_batches = recorded(args.val_batches, "val_batches", 4)
    val_fraction = recorded(args.val_fraction, "val_fraction", 0.05, float)
    _positive("--batch-size", batch_size)
    _positive("--val-batches", val_batches, allow_zero=True)
    _positive("--samples", args.samples)
    if seq_len > limit:
        raise ValueError(
            f"--seq-len {seq_len} exceeds the model's context limit of {limit} "
            "tokens (its S2 patterns' / position table's length)"
        )
    depths = _check_needle_grid(lengths, args.depths, limit) if args.needle else None
    task_plan = tasks.plan(
        args.tasks, lengths, args.task_samples, limit=limit, roots=roots, val_fraction=val_fraction
    )
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available")
    if args.out is not None and args.out.suffix != ".json":
        raise ValueError(f"--out must name a .json file, got {str(args.out)!r}")
    return _Evaluation(
        model_dir=model_dir,
        record=record,
        config=config,
        limit=limit,
        seq_len=seq_len,
        seed=recorded(args.seed, "seed", 0),
        val_batches=val_batches,
        val_fraction=val_fraction,
        roots=roots,
        lengths=lengths,
        depths=depths,
        device=device,
        batch_size=batch_size,
        task_plan=task_plan,
        memory_needed=_check_memory(config, batch_size, longest, device),
    )


def _check_needle_grid(lengths: list[int], depths: Sequence[float], limit: int) -> list[float]:
    """The grid's depths, checked, once every one of ``lengths`` is checked against ``limit``."""
    for n in lengths:
        _check_length(n, "--lengths entries")
        if n > limit:
            raise ValueError(
                f"--lengths: {n} exceeds the model's context limit of {limit} tokens (its S2 "
                "patterns' / position table's length; train with a larger --max-seq-len)"
            )
    return _check_depths(depths)


def _check_memory(config, batch_size: int, longest: int, device: str) -> int:
    """The bytes the largest forward pass needs; raises ``ValueError`` when the device has less
    free."""
    # Weights as saved (float32 master weights, or bf16: 4 bytes bounds both); float32 weights
    # run under bf16 autocast on CUDA, as training ran, and in float32 on the CPU.
    needed = forward_memory(
        config, batch_size * longest, weight_bytes=4, activation_bytes=4 if device == "cpu" else 2
    )
    free = free_memory(device)
    if free is not None and needed > free:
        raise ValueError(
            f"evaluating {batch_size} x {longest} tokens a forward pass needs about "
            f"{needed / 2**30:.2f} GiB on {device}, and {free / 2**30:.2f} GiB is free: lower "
            "--batch-size (1 reads one sequence a pass), --seq-len or --lengths"
        )
    return needed


def run(args: argparse.Namespace) -> int:
    """``s2attn eval``: print bits per byte (and the needle grid), write ``--out``. Every
    argument is checked, and the model's context limit read, before any model or data is
    loaded."""
    started = time.perf_counter()
    ev = _resolve(args)
    draw_heatmap = args.needle and args.out is not None
    absent = missing(OPTIONAL) if draw_heatmap else []
    if absent:
        draw_heatmap = False
        print(
            f"s2attn eval: warning: {' and '.join(absent)}: the results go to {args.out}, but "
            f"no heat map next to it ({INSTALL})",
            file=sys.stderr,
        )
    corpus = SourceCorpus(ev.roots, split="val", val_fraction=ev.val_fraction)
    # Bars in a log file are lines of carriage returns: only on a terminal.
    progress = not args.no_progress and sys.stderr.isatty()
    model, autocast_dtype = load_model(ev.model_dir, ev.device, progress)
    if ev.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    title = " ".join(str(ev.record[k]) for k in ("variant", "preset") if ev.record.get(k))
    title = title or ev.model_dir.name
    print(
        f"{title}: {ev.model_dir} on {ev.device}"
        f"{' (bf16 autocast)' if autocast_dtype else ''}; val corpus {corpus!r}"
    )
    result = _result_header(ev, corpus)
    scored = {"device": ev.device, "autocast_dtype": autocast_dtype, "batch_size": ev.batch_size}
    if ev.val_batches:
        result.update(_validation(model, corpus, ev, scored))
    if args.needle:
        grid = _needle_grid(
            model, corpus, ev.lengths, ev.depths, args.samples, ev.seed, progress, **scored
        )
        result.update(samples_per_cell=args.samples, lengths=ev.lengths, depths=ev.depths)
        result["accuracy"] = grid
        _print_grid(grid)
    result.update(ev.task_plan.run(model, corpus, seed=ev.seed, progress=progress, **scored))
    _report_cost(ev, result, started)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.out}")
        if draw_heatmap:
            png = plot_needle_heatmaps({title: result}, args.out.with_suffix(".png"))
            print(f"wrote {png}")
    return 0


def _result_header(ev: _Evaluation, corpus: SourceCorpus) -> dict:
    """The eval's JSON before any measurement: what was evaluated, where and with what."""
    import transformers

    import s2attn

    return {
        "model_dir": str(ev.model_dir),
        "variant": ev.record.get("variant"),
        "preset": ev.record.get("preset"),
        "seed": ev.seed,
        "device": torch.cuda.get_device_name() if ev.device == "cuda" else "cpu",
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "s2attn": s2attn.__version__,
        },
        "context_limit": ev.limit,
        "corpus": corpus.describe(),
    }


def _validation(model, corpus: SourceCorpus, ev: _Evaluation, scored: dict) -> dict:
    """Validation bits per byte, printed, and its entries of the eval's JSON."""
    batches = validation_batches(corpus, ev.seq_len, ev.batch_size, ev.val_batches, ev.seed)
    bpb = validation_bpb(
        model, batches, device=scored["device"], autocast_dtype=scored["autocast_dtype"]
    )
    tokens = sum(b[:, 1:].numel() for b in batches)
    print(
        f"validation: {bpb:.4f} bits per byte over {tokens} tokens "
        f"({ev.val_batches} x {ev.batch_size} x {ev.seq_len})"
    )
    return {"val_bpb": bpb, "val_seq_len": ev.seq_len, "val_tokens": tokens}


def _report_cost(ev: _Evaluation, result: dict, started: float) -> None:
    """Add the batch size, the memory (estimated, and on CUDA the peak) and the wall time to
    ``result``, and print them."""
    needed = ev.memory_needed
    result.update(
        batch_size=ev.batch_size,
        memory_estimate_gib=needed / 2**30,
        wall_s=time.perf_counter() - started,
    )
    memory = f"estimated {needed / 2**30:.2f} GiB"
    if ev.device == "cuda":
        result["max_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
        memory = f"peak {result['max_mem_gib']:.2f} GiB, {memory}"
    print(
        f"eval time: {result['wall_s']:.1f} s ({ev.batch_size} sequence(s) a forward pass; "
        f"memory {memory})"
    )


def _needle_grid(
    model,
    corpus,
    lengths,
    depths,
    samples,
    seed,
    progress: bool,
    *,
    device,
    autocast_dtype,
    batch_size,
) -> dict[str, dict[str, float]]:
    from tqdm.auto import tqdm

    accuracy: dict[str, dict[str, float]] = {}
    with tqdm(
        total=len(lengths) * len(depths), desc="needle grid", unit="cell", disable=not progress
    ) as bar:
        for n in lengths:
            cells = needle_samples(corpus, n, depths, samples, seed)
            row = accuracy.setdefault(str(n), {})
            for d, group in cells.items():
                row[_depth_key(d)] = needle_accuracy(
                    model,
                    group,
                    device=device,
                    autocast_dtype=autocast_dtype,
                    batch_size=batch_size,
                )
                bar.set_postfix(length=n, depth=_depth_key(d), acc=f"{row[_depth_key(d)]:.2f}")
                bar.update()
    return accuracy


def _print_grid(accuracy: dict[str, dict[str, float]]) -> None:
    depths = sorted({d for row in accuracy.values() for d in row}, key=float)
    print("needle accuracy (rows: depth, columns: context length)")
    print(f"{'depth':>7} " + " ".join(f"{_length_label(int(n)):>7}" for n in accuracy))
    for d in depths:
        print(f"{d:>7} " + " ".join(f"{accuracy[n].get(d, float('nan')):>7.2f}" for n in accuracy))
