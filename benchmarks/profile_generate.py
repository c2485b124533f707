"""Where the time of a compiled batch-1 decode step of the 7B-shaped HHST model goes.

Per step: the wall time, the GPU's busy time, the host's gap, the kernel time by category; and
the step against the time to read what it must read.

Model and caches as ``bench_serving.py --compiled`` builds them: the 7B-shaped Llama with random
weights (bf16), HHST with ``--dense-layers`` dense layers (spread through the stack, as
``s2attn.integrations.transformers.configure`` places them) and the rest S2 (block 64, local 16
blocks, vertical stride ``--stride``), one sequence whose ``S2Cache(static=True)`` is filled with
``--prompt`` random tokens as a prefill stores them. ``generate`` then runs with its compiled
decode step (transformers' default: Inductor, ``mode="reduce-overhead"``, CUDA graphs): two
warm-up calls of ``--warmup`` tokens (compilation, CUDA-graph recording), one timed call and one
profiled call of ``--steps`` decode steps each.

- **Steps**: a stopping criterion marks every pass of ``generate``'s loop after the token is
  chosen. It waits for the device first: ``generate`` waits there anyway on CUDA (its stop check
  reads a device flag every step), so each step's kernels run between its two marks. A step is the
  time between marks (the loop's period, sampling and bookkeeping included); the first pass, the
  one-token "prefill" that ``generate`` runs eagerly, is left out.
- **Wall**: the step's time unprofiled (median of the timed call's steps) and profiled.
- **Busy**: the union of the step's kernel, memcpy and memset intervals (``torch.profiler``,
  CUPTI), so overlapping kernels are not counted twice; **host gap** = wall - busy; **in the
  graph**: the busy time of kernels that the compiled step's CUDA-graph replay ran (the rest
  ``generate``'s loop and the graph's input copies launched one by one). Each kernel belongs to
  the step whose marks enclose the host call that launched it.
- **Categories**: every instant of busy time goes to the kernel that started first among those
  running, and that kernel's category: *s2attn decode* (``_decode_kernel``) of the S2 layers and
  of the dense layers, *page writes* (``_write_kernel``), *s2attn op, other launches* (what the
  operator launches between its page write and its decode kernel: the split counters' zeros),
  *GEMMs* (cuBLAS/CUTLASS/nvjet/Inductor templates), *lm_head GEMM* (the step's last run of GEMM
  kernels: the vocabulary projection), *sampling/logits, generate's loop* (every kernel
  launched outside the compiled graph but copies: the logits' float copy, argmax,
  ``generate``'s bookkeeping; where no graph ran, what follows the lm_head), *norms,
  elementwise* (Inductor's ``triton_`` kernels, ATen's), *memcpy/memset* (among them the
  graph's input copies), *other*. The categories sum to the busy time.
- **Dense or S2 layer**: each layer's ``s2attn::static_decode`` operator launches its page write
  and then its decode kernel, one layer after the next (each layer's input is the previous
  layer's output, so no launch of a later layer's attention comes first). The n-th such launch
  pair of a step is layer n's, and ``config.s2attn["layer_types"][n]`` says dense or S2. The
  step's count of decode launches is checked against the layer count, and the decode launches'
  grids are reported per layer type as a cross-check (the split count, the grid's second
  dimension, follows each layout's longest list: the dense layers' is longer).
- **Floor**: the bytes a step must read (every weight but the token embedding table, of which it
  reads one row; the pages the caches keep for the sequence: every block of the dense layers,
  what the pattern still reads in the S2 layers) over the GPU's *read* rate, measured here by
  ``torch.sum`` over a ``--read-gib`` GiB bf16 buffer (best of ``--read-repeats``; a read rate,
  not a copy rate: a copy moves twice the bytes). Reported: step / floor.
- **Top kernels**: the 15 kernels (by name) with the most time over the profiled steps.

    python benchmarks/profile_generate.py                    # 128k prompt, 8 profiled steps
    python benchmarks/profile_generate.py --prompt 32768 --steps 16
    python benchmarks/profile_generate.py --smoke            # CPU: a tiny model, CPU ops
    python benchmarks/profile_generate.py --skip-guard-eval  # without dynamo's guard checks

``--smoke`` runs the whole script on the CPU: a 2-layer model in float32 at a 256-token prompt
(block 16, local 2, stride 4, one dense layer), ``generate``'s decode step compiled with
``aot_eager``, and the CPU profiler's operators (their self time; an s2attn operator's inner
operators go to its layer's decode) in place of kernels.

Writes ``<date>_<device>_profile_generate.{md,json}`` (``profile_generate_skip_guard_eval``
with ``--skip-guard-eval``) and the profiler's trace (``.trace.json.gz``, for Perfetto or
chrome://tracing) to ``--out-dir``.
"""

from __future__ import annotations

import bisect
import collections
import gzip
import json
import re
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import bench_generate
import bench_serving
import torch
from bench_generate import build_model
from bench_serving import MODEL, ROOM, generate, s2_cache
from run_info import (
    cell,
    environment,
    finish,
    heading,
    host_line,
    parser,
    read_rate_gbs,
    result_stem,
    start,
    table,
    versions_line,
    write_results,
)
from transformers import StoppingCriteria, StoppingCriteriaList

# --smoke's model: 8 KV heads of 128 as bench_serving's cache filler builds them, little else.
SMOKE_MODEL = dict(
    hidden_size=1024,
    intermediate_size=1024,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=8,
    vocab_size=512,
    rope_theta=10000.0,
)
MARK = "profile_generate: step mark"
# The kernels s2attn's decode step launches (s2attn/ops/triton/decode.py, page_write.py).
DECODE_KERNEL, WRITE_KERNEL = "_decode_kernel", "_write_kernel"
S2_OP = "s2attn::"  # the CPU profiler's name of s2attn's operators
COMPILED_REGION = "Torch-Compiled Region"  # the CPU profiler's name of a compiled graph's run
CATEGORIES = (
    "s2attn decode, S2 layers",
    "s2attn decode, dense layers",
    "page writes",
    "s2attn op, other launches",
    "GEMMs",
    "lm_head GEMM",
    "norms, elementwise",
    "sampling/logits, generate's loop",
    "memcpy/memset",
    "other",
)
GEMM = re.compile(
    r"gemm|gemv|nvjet|cutlass|cublas|xmma|splitkreduce|triton_tem_"
    r"|^aten::(mm|addmm|bmm|baddbmm|matmul|linear)$",
    re.IGNORECASE,
)
ELEMENTWISE = re.compile(r"^triton_|at::native|^aten::|elementwise|reduce", re.IGNORECASE)
TOP = 15


# ------------------------------------------------------------------------------- the steps
class StepMarks(StoppingCriteria):
    """A stopping criterion that never stops: called once per pass of ``generate``'s loop, it
    waits for the device (as ``generate`` does right after it on CUDA), then records the time
    and, under the profiler, a ``MARK`` event."""

    def __init__(self):
        self.times: list[float] = []
        self._never: torch.Tensor | None = None

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        if input_ids.is_cuda:
            torch.cuda.synchronize(input_ids.device)
        with torch.profiler.record_function(MARK):
            self.times.append(time.perf_counter())
        # One tensor for every call: a new one would launch a fill into the next step.
        if self._never is None or self._never.shape[0] != input_ids.shape[0]:
            self._never = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        return self._never


def decode_steps(model, ids, cache, steps: int, options: dict) -> tuple[torch.Tensor, list[float]]:
    """``generate`` of ``steps + 1`` tokens after ``ids`` (the first pass its one-token prefill);
    returns the sequences and the seconds of each of the ``steps`` decode steps."""
    marks = StepMarks()
    out = generate(
        model, ids, steps + 1, cache, stopping_criteria=StoppingCriteriaList([marks]), **options
    )
    return out, [b - a for a, b in zip(marks.times, marks.times[1:])]


# ------------------------------------------------------------------------------- the trace
@dataclass
class Piece:
    """A stretch of device time (a kernel, memcpy or memset), or on the CPU an operator's self
    time. ``chain``: its name, then (CPU) its enclosing operators' names, innermost first;
    ``launch``: the host time that places it in a step; ``call``: what tells its launch (or CPU
    operator call) from others of the same name; ``graph``: run by the compiled graph (a
    CUDA-graph replay; on the CPU, inside Dynamo's compiled region); ``op``: the s2attn
    operator call it belongs to (None: none), with ``role`` "write", "decode" or "other" in it."""

    name: str
    start: float  # microseconds
    dur: float
    kind: str  # "kernel", "memcpy", "memset" or "cpu"
    chain: tuple[str, ...]
    launch: float
    call: float
    graph: bool = False
    grid: tuple[int, ...] | None = None
    op: float | None = None
    role: str | None = None

    @property
    def end(self) -> float:
        return self.start + self.dur


def read_trace(trace: dict) -> tuple[list[float], list[Piece]]:
    """The step marks' times and the pieces of a ``torch.profiler`` chrome trace: the device's
    kernels, memcpys and memsets where it has any, else the CPU operators of the marks' thread
    (their self time)."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    marks = [e for e in events if e.get("name") == MARK and e.get("cat") == "user_annotation"]
    kinds = {"kernel": "kernel", "gpu_memcpy": "memcpy", "gpu_memset": "memset"}
    device = [e for e in events if e.get("cat") in kinds]
    if not device:
        tid = marks[0]["tid"] if marks else None
        ops = [e for e in events if e.get("cat") == "cpu_op" and e.get("tid") == tid]
        return sorted(e["ts"] for e in marks), cpu_pieces(ops)
    # A kernel is placed by the host call that launched it (a kernel launch, memcpy, or the
    # replay of a CUDA graph, whose kernels carry its correlation id): the host's clock, which
    # the marks use, whatever the GPU clock's offset.
    launches = {
        e["args"]["correlation"]: e
        for e in events
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})
    }
    pieces = []
    for e in device:
        args = e.get("args", {})
        launch = launches.get(args.get("correlation"), e)
        grid = tuple(args["grid"]) if "grid" in args else None
        pieces.append(
            Piece(
                e["name"],
                e["ts"],
                e["dur"],
                kinds[e["cat"]],
                (e["name"],),
                launch["ts"],
                e["ts"],
                "GraphLaunch" in launch["name"],
                grid,
            )
        )
    return sorted(e["ts"] for e in marks), pieces


def cpu_pieces(ops: list[dict]) -> list[Piece]:
    """The self time of nested CPU operators (one thread's) as pieces: each stretch of time goes
    to the innermost operator running, named with its enclosing operators; pieces inside an
    s2attn operator carry that call's start as ``op``."""
    pieces: list[Piece] = []
    stack: list[list] = []  # [event, end, cursor, chain, op]

    def emit(frame, until):
        if until > frame[2]:
            event, _, cursor, chain, op = frame
            role = None if op is None else "decode"
            graph = any(name.startswith(COMPILED_REGION) for name in chain)
            pieces.append(
                Piece(
                    event["name"],
                    cursor,
                    until - cursor,
                    "cpu",
                    chain,
                    cursor,
                    event["ts"],
                    graph,
                    op=op,
                    role=role,
                )
            )
        frame[2] = until

    def close(until):
        while stack and stack[-1][1] <= until:
            frame = stack.pop()
            emit(frame, frame[1])
            if stack:
                stack[-1][2] = frame[1]

    for e in sorted(ops, key=lambda e: (e["ts"], -e["dur"])):
        close(e["ts"])
        end, chain, op = e["ts"] + e["dur"], (e["name"],), None
        if stack:
            parent = stack[-1]
            emit(parent, e["ts"])
            end, chain, op = min(end, parent[1]), (e["name"], *parent[3]), parent[4]
        if op is None and e["name"].startswith(S2_OP):
            op = e["ts"]
        stack.append([e, end, e["ts"], chain, op])
    close(float("inf"))
    return pieces


def split_steps(marks: list[float], pieces: list[Piece]) -> list[list[Piece]]:
    """The pieces launched between each two consecutive marks, in the order they ran."""
    steps: list[list[Piece]] = [[] for _ in range(max(0, len(marks) - 1))]
    for p in pieces:
        i = bisect.bisect_right(marks, p.launch) - 1
        if 0 <= i < len(steps):
            steps[i].append(p)
    for step in steps:
        step.sort(key=lambda p: p.start)
    return steps


def attribute_kernels(step: list[Piece]) -> None:
    """Device kernels of s2attn's decode operator: a page write opens a call, its decode kernel
    closes it, and what runs between belongs to it (CPU pieces carry their call already)."""
    current = None
    for p in step:
        if p.kind == "cpu":
            continue
        if WRITE_KERNEL in p.name:
            current, p.op, p.role = p.start, p.start, "write"
        elif DECODE_KERNEL in p.name:
            p.op, p.role = (current if current is not None else p.start), "decode"
            current = None
        elif current is not None:
            p.op, p.role = current, "other"


def base_category(p: Piece, layer_type: str | None) -> str:
    if p.op is not None:
        if p.role == "write":
            return "page writes"
        if p.role == "decode":
            return f"s2attn decode, {'dense' if layer_type == 'dense' else 'S2'} layers"
        return "s2attn op, other launches"
    if p.kind in ("memcpy", "memset"):
        return "memcpy/memset"
    if any(GEMM.search(name) for name in p.chain):
        return "GEMMs"
    if any(ELEMENTWISE.search(name) for name in p.chain):
        return "norms, elementwise"
    return "other"


def categorise(step: list[Piece], layer_types: list[str]) -> tuple[dict, list[str]]:
    """A step's busy time by category (ms) and each piece's category. The n-th s2attn call of
    the step is layer n's; the step's last run of GEMMs is the lm_head. What runs outside the
    compiled graph (copies aside) is generate's loop; where no graph ran, what follows the
    lm_head is."""
    attribute_kernels(step)
    calls = list(dict.fromkeys(p.op for p in step if p.op is not None))
    layer_of = {op: i for i, op in enumerate(calls)}

    def layer_type(p: Piece) -> str | None:
        i = layer_of.get(p.op)
        return layer_types[i] if i is not None and i < len(layer_types) else None

    cats = [base_category(p, layer_type(p)) for p in step]
    gemms = [i for i, c in enumerate(cats) if c == "GEMMs"]
    if gemms:
        first = last = gemms[-1]
        while first > 0 and cats[first - 1] == "GEMMs":
            first -= 1
        cats[first : last + 1] = ["lm_head GEMM"] * (last + 1 - first)
    graphed = any(p.graph for p in step)  # else no graph to tell the loop's work from
    after = gemms[-1] if gemms else len(step)
    for i, p in enumerate(step):
        outside = not p.graph and cats[i] != "memcpy/memset" if graphed else i > after
        if p.op is None and outside:
            cats[i] = "sampling/logits, generate's loop"
    # Each instant to the piece that started first among those running: sums to the union.
    times = dict.fromkeys(CATEGORIES, 0.0)
    graph_ms, cursor = 0.0, float("-inf")
    for p, c in zip(step, cats):
        credit = max(0.0, p.end - max(p.start, cursor)) / 1e3
        times[c] += credit
        graph_ms += credit if p.graph else 0.0
        cursor = max(cursor, p.end)
    grids = collections.defaultdict(set)
    for p in step:
        if p.role == "decode" and p.grid is not None:
            grids[layer_type(p) or "unknown"].add(p.grid)
    return dict(categories=times, graph_ms=graph_ms, attention_calls=len(calls), grids=grids), cats


def analyse(trace: dict, layer_types: list[str]) -> dict:
    """Per step: wall, busy, host gap, the categories; over the steps: the top kernels and the
    decode launches' grids by layer type."""
    marks, pieces = read_trace(trace)
    rows, totals, grids = [], {}, collections.defaultdict(set)
    for k, step in enumerate(split_steps(marks, pieces)):
        result, cats = categorise(step, layer_types)
        busy = sum(result["categories"].values())
        wall = (marks[k + 1] - marks[k]) / 1e3
        rows.append(
            dict(
                step=k,
                wall_ms=wall,
                busy_ms=busy,
                gap_ms=wall - busy,
                graph_ms=result["graph_ms"],
                pieces=len(step),
                attention_calls=result["attention_calls"],
                categories=result["categories"],
            )
        )
        for layer_type, seen in result["grids"].items():
            grids[layer_type] |= seen
        for p, c in zip(step, cats):
            entry = totals.setdefault(p.name, dict(name=p.name, ms=0.0, calls=set(), cats={}))
            entry["ms"] += p.dur / 1e3
            entry["calls"].add((k, p.call))
            entry["cats"][c] = entry["cats"].get(c, 0) + 1
    top = sorted(totals.values(), key=lambda t: -t["ms"])[:TOP]
    for t in top:
        t["category"] = max(t.pop("cats").items(), key=lambda kv: kv[1])[0]
        t["calls"] = len(t["calls"])
        t["ms_per_step"] = t["ms"] / max(1, len(rows))
    kind = pieces[0].kind if pieces else "none"
    return dict(steps=rows, top=top, pieces=kind, grids={k: sorted(v) for k, v in grids.items()})


# ------------------------------------------------------------------------------- the floor
def weight_bytes(model) -> tuple[int, int]:
    """(bytes of every parameter, bytes a decode step reads: all but the token embedding table,
    of which it reads one row, unless the lm_head shares it)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    embedding = model.get_input_embeddings().weight
    output = model.get_output_embeddings()
    if output is not None and output.weight is embedding:
        return total, total
    row = embedding.shape[1] * embedding.element_size()
    return total, total - embedding.numel() * embedding.element_size() + row


def kv_bytes(cache, layer_types: list[str]) -> dict[str, int]:
    """Bytes of the pages each layer type needs from this position on (a dense layer: every
    block; an S2 layer: the blocks its pattern still reads), summed over its layers."""
    out = {"dense": 0, "s2": 0}
    for layer, kind in zip(cache.layers, layer_types):
        out[kind] += layer.paged.memory_report()["needed_bytes"]
    return out


# ------------------------------------------------------------------------------- the report
def markdown(result: dict, env: dict, args) -> str:
    import transformers

    floor, steps = result["floor"], result["rows"]
    versions = f"{versions_line(env)} · transformers {transformers.__version__}"
    unit = "CPU operators' self time" if result["profile"]["pieces"] == "cpu" else "kernels"
    lines = heading(
        "Where a compiled decode step goes",
        env,
        f"Llama-style, {result['params'] / 1e9:.2f}B parameters, random weights: "
        f"{result['model']}. HHST: layer types {''.join(t[0] for t in result['layer_types'])} "
        f"(d dense, s S2: block {result['block']}, local {result['local']}, stride "
        f"{args.stride}). One sequence, `S2Cache(static=True)` filled with {args.prompt} random "
        f"tokens; `generate`'s decode step {result['compiled']}"
        f"{', guards skipped after the warm-up' if args.skip_guard_eval else ''}. "
        f"{args.steps} steps profiled "
        f"({unit}); a step runs from one pass of generate's loop to the next (the loop waits "
        f"for the device each pass). Busy: the union of the step's {unit}; host gap: wall - "
        "busy; in the graph: the busy time of the compiled graph's own work. The categories "
        "share the busy time out (overlaps counted once; see the script's doc). "
        f"{host_line(env)}.",
        versions,
    )
    lines += ["## Steps", ""]
    lines += table(
        [
            "step",
            "wall ms",
            "busy ms",
            "host gap ms",
            "of busy: in the graph ms",
            "pieces",
            "s2attn calls",
        ],
        (
            [
                r["step"],
                f"{r['wall_ms']:.3f}",
                f"{r['busy_ms']:.3f}",
                f"{r['gap_ms']:.3f}",
                f"{r['graph_ms']:.3f}",
                r["pieces"],
                r["attention_calls"],
            ]
            for r in steps
        ),
    )
    med = lambda key: statistics.median(r[key] for r in steps) if steps else None
    lines += [
        "",
        f"Median: wall {cell(med('wall_ms'))} ms profiled, {cell(result['unprofiled_ms'])} ms "
        f"unprofiled (median of {args.steps} steps); busy {cell(med('busy_ms'))} ms; host gap "
        f"{cell(med('gap_ms'))} ms.",
    ]
    if any(r["attention_calls"] != result["num_layers"] for r in steps):
        lines += [
            "",
            f"**Check**: a step's s2attn calls differ from the {result['num_layers']} layers: "
            "the dense/S2 split below is not reliable.",
        ]
    if not steps or not any(r["pieces"] for r in steps):
        lines += ["", "**Check**: the profile holds no device work between the step marks."]
    elif result["profile"]["pieces"] != "cpu" and not any(r["graph_ms"] for r in steps):
        lines += [
            "",
            "**Check**: no kernel of a CUDA-graph replay: the step ran without CUDA graphs, or "
            "the profiler did not see inside them.",
        ]
    lines += ["", "## Busy time by category (ms per step)", ""]
    busy = med("busy_ms") or 0.0

    def stats(cat):
        values = [r["categories"][cat] for r in steps] or [0.0]
        mean = statistics.fmean(values)
        share = f"{100 * mean / busy:.1f}%" if busy else "n/a"
        return [cat, f"{mean:.3f}", f"{min(values):.3f}", f"{max(values):.3f}", share]

    lines += table(["category", "mean", "min", "max", "of busy"], (stats(c) for c in CATEGORIES))
    grids = result["profile"]["grids"]
    if grids:
        lines += [
            "",
            "Decode launches' grids: "
            + "; ".join(f"{k} layers {', '.join(map(str, v))}" for k, v in sorted(grids.items()))
            + ".",
        ]
    lines += ["", f"## Top {TOP} by time", ""]
    lines += table(
        ["name", "category", "calls per step", "ms per step", "µs per call"],
        (
            [
                f"`{t['name'][:90].replace('|', '/')}`",
                t["category"],
                f"{t['calls'] / max(1, len(steps)):.1f}",
                f"{t['ms_per_step']:.3f}",
                f"{1e3 * t['ms'] / t['calls']:.1f}",
            ]
            for t in result["profile"]["top"]
        ),
    )
    rate = floor["read_gbs"]
    lines += ["", "## Floor", ""]
    lines += [
        f"Read rate {rate:.0f} GB/s: `torch.sum` over {floor['read_gib']} GiB, best of "
        f"{floor['read_repeats']} (a read rate, not a copy rate). Weights: every parameter but "
        f"the token embedding table (one row of it): {floor['weights_read'] / 1e9:.2f} GB of "
        f"{floor['weights_all'] / 1e9:.2f} GB. KV: the pages the caches need from this "
        "position on.",
        "",
    ]
    cats = {
        c: statistics.fmean(r["categories"][c] for r in steps) if steps else 0.0 for c in CATEGORIES
    }
    gemm = cats["GEMMs"] + cats["lm_head GEMM"]
    rows = [
        ["weights", floor["weights_read"], gemm, "GEMMs + lm_head"],
        [
            "KV, dense layers",
            floor["kv"]["dense"],
            cats["s2attn decode, dense layers"],
            "s2attn decode, dense layers",
        ],
        [
            "KV, S2 layers",
            floor["kv"]["s2"],
            cats["s2attn decode, S2 layers"],
            "s2attn decode, S2 layers",
        ],
    ]
    lines += table(
        ["read", "GB", "floor ms", "measured ms", "measured as", "x floor"],
        (
            [
                what,
                f"{b / 1e9:.3f}",
                f"{b / rate / 1e6:.3f}",
                f"{ms:.3f}",
                name,
                f"{ms / (b / rate / 1e6):.2f}" if b else "n/a",
            ]
            for what, b, ms, name in rows
        ),
    )
    lines += [
        "",
        f"Step floor {floor['floor_ms']:.3f} ms: the unprofiled step is "
        f"{cell(floor['step_over_floor'], '{:.2f}')}x it, the profiled step "
        f"{cell(floor['profiled_over_floor'], '{:.2f}')}x, the busy time "
        f"{cell(floor['busy_over_floor'], '{:.2f}')}x.",
    ]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------- the run
def use_cpu() -> None:
    """Point bench_generate's model builder and bench_serving's cache filler at the CPU in
    float32 (--smoke): they build on the GPU in bf16, as their module constants say."""
    for module in (bench_generate, bench_serving):
        module.DEVICE, module.DTYPE = "cpu", torch.float32


def smoke_compile_config():
    """``generate``'s compile settings for --smoke: aot_eager, on the CPU too (transformers
    compiles the decode step on GPUs only by default)."""
    from transformers.generation.configuration_utils import CompileConfig

    config = CompileConfig(fullgraph=True, backend="aot_eager", mode=None)
    config._compile_all_devices = True
    return config


def parse(argv: list[str] | None = None):
    ap = parser(__doc__)
    ap.add_argument("--prompt", type=int, default=131072, help="tokens in the cache (131072)")
    ap.add_argument("--steps", type=int, default=8, help="decode steps profiled (8)")
    ap.add_argument("--warmup", type=int, default=6, help="tokens per warm-up generate call")
    ap.add_argument("--dense-layers", type=int, default=2)
    ap.add_argument("--stride", type=int, default=64)
    ap.add_argument("--read-gib", type=float, default=4.0, help="buffer the read rate sums")
    ap.add_argument("--read-repeats", type=int, default=10)
    ap.add_argument(
        "--skip-guard-eval",
        action="store_true",
        help="time and profile under torch.compiler.set_stance(skip_guard_eval_unsafe=True), "
        "after the warm-up: dynamo checks only the guards that tell its compiled graphs apart",
    )
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny model: checks the script")
    args = ap.parse_args(argv)
    if args.smoke:
        args.prompt, args.steps, args.warmup, args.stride, args.dense_layers = 256, 2, 2, 4, 1
        args.read_gib, args.read_repeats = 1 / 16, 3
    for name in ("prompt", "steps", "warmup", "read_repeats"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.read_gib <= 0:
        ap.error(f"--read-gib must be positive, got {args.read_gib}")
    # The calls' tokens past the prompt (each call's last token is not stored) fit the cache.
    if 2 * args.warmup + 2 * (args.steps + 1) >= ROOM:
        ap.error(f"--warmup and --steps: 2 x warmup + 2 x (steps + 1) must stay below {ROOM}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.smoke:
        use_cpu()
        env = environment()
        print(f"{env['device']} · torch {env['torch']} · {env['date']} (smoke)", flush=True)
    else:
        env = start("a compiled decode step")
        if env is None:
            return 2
    from s2attn.integrations import transformers as s2hf

    device = bench_serving.DEVICE
    rate = read_rate_gbs(args.read_gib, args.read_repeats, device)
    print(f"read rate: {rate:.0f} GB/s (torch.sum over {args.read_gib} GiB)", flush=True)

    shape = SMOKE_MODEL if args.smoke else MODEL
    block, local = (16, 2) if args.smoke else (64, 16)
    max_len = args.prompt + ROOM
    model = build_model(max_len, shape)
    s2hf.configure(
        model.config,
        block_size=block,
        local_blocks=local,
        vert_stride=args.stride,
        dense_layers=args.dense_layers,
        max_seq_len=max_len,
    )
    model.set_attn_implementation(s2hf.ATTN_IMPLEMENTATION)
    layer_types = list(model.config.s2attn["layer_types"])
    weights_all, weights_read = weight_bytes(model)
    kinds = "".join(t[0] for t in layer_types)
    print(f"model: {weights_all / 1e9:.2f} GB of weights; layers {kinds}", flush=True)

    options = dict(compile_config=smoke_compile_config()) if args.smoke else {}
    cache = s2_cache(model, 1, args.prompt, max_len, static=True)
    kv = kv_bytes(cache, layer_types)
    ids = torch.randint(2, shape["vocab_size"], (1, args.prompt + 1), device=device)
    print("warm-up (compilation, CUDA-graph recording)", flush=True)
    for _ in range(2):
        ids, _ = decode_steps(model, ids, cache, args.warmup - 1, options)
    # After the warm-up every graph the steps need exists; skipping guard evaluation then trades
    # dynamo's per-step checks for the caller's promise that nothing they check will change.
    stance = torch.compiler.set_stance("default", skip_guard_eval_unsafe=args.skip_guard_eval)
    with stance:
        ids, timed = decode_steps(model, ids, cache, args.steps, options)
    unprofiled = statistics.median(timed) * 1e3
    print(f"unprofiled: {unprofiled:.3f} ms a step (median of {args.steps})", flush=True)

    activities = [torch.profiler.ProfilerActivity.CPU]
    if device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with stance, torch.profiler.profile(activities=activities) as prof:
        decode_steps(model, ids, cache, args.steps, options)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        trace = json.loads(path.read_text())
        # Runs with and without the guards side by side keep their own files.
        name = "profile_generate" + ("_skip_guard_eval" if args.skip_guard_eval else "")
        stem = result_stem(env, f"{name}{'_smoke' if args.smoke else ''}{args.tag}")
        args.out_dir.mkdir(parents=True, exist_ok=True)
        with path.open("rb") as src, gzip.open(args.out_dir / f"{stem}.trace.json.gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
    profile = analyse(trace, layer_types)

    kv_total = kv["dense"] + kv["s2"]
    floor_ms = (weights_read + kv_total) / rate / 1e6
    rows = profile.pop("steps")

    def ratio(key: str) -> float | None:
        return statistics.median(r[key] for r in rows) / floor_ms if rows else None

    floor = dict(
        read_gbs=rate,
        read_gib=args.read_gib,
        read_repeats=args.read_repeats,
        weights_all=weights_all,
        weights_read=weights_read,
        kv=kv,
        floor_ms=floor_ms,
        step_over_floor=unprofiled / floor_ms,
        profiled_over_floor=ratio("wall_ms"),
        busy_over_floor=ratio("busy_ms"),
    )
    finish(env)
    result = dict(
        env=env,
        args={k: str(v) for k, v in vars(args).items()},
        model=shape,
        params=sum(p.numel() for p in model.parameters()),
        num_layers=len(layer_types),
        layer_types=layer_types,
        block=block,
        local=local,
        compiled="compiled with aot_eager" if args.smoke else "compiled (reduce-overhead)",
        unprofiled_ms=unprofiled,
        unprofiled_steps_ms=[1e3 * s for s in timed],
        floor=floor,
        profile=profile,
        rows=rows,
    )
    write_results(args.out_dir, stem, markdown(result, env, args), result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
