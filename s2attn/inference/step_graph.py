"""Eager decode steps replayed from a CUDA graph: one launch for a step's device work.

A decode step's device work (page write, length update, attention) takes about 13 µs of an H200 at
batch 1, but a step that launches its two Triton kernels from Python takes 0.11-0.19 ms of host
time on an H100 (``benchmarks/bench_decode_step.py``).
A cache's steps repeat the same two launches over the same tensors (page pools, page table,
lengths, the layout's lists), so after a first step of a shape launched directly (which compiles
the kernels), the next captures both launches in a CUDA graph, and every later step copies its
q, k and v into the graph's inputs, replays it and copies the output out: a few C++ calls.

The host's half of the step (eviction, new pages, the page table's changed entries) still runs
before the replay, on the same stream, so a graph captured once serves every step of its shape.
A graph holds the cache's tensors: when the cache swaps one for another (``select_sequences``), or
the step's shape or split count changes, the next step captures again.

Graphs are not used where they cannot be: off the GPU, inside another capture (the user's own
graph of a step), under ``torch.compile``, on a device other than the current one, or where the
step runs the PyTorch reference instead of the kernels.
"""

from __future__ import annotations

import operator
import warnings

import torch

from .decode_plan import DecodePlan
from .decode_step import decode_step, runs_kernels

__all__ = ["ENABLED", "applies", "device_step"]

# Off: every eager step launches its kernels directly (tests compare the two paths).
ENABLED = True

# Graphs a cache keeps (one per step shape); past it, they are all dropped.
_MAX_GRAPHS = 16


class StepGraph:
    """One cache's decode step of one shape: its first call launches directly from the graph's
    input buffers (compiling exactly the launches the capture then records), its second captures
    and replays, every later one replays. q, k, v are copied into the buffers each call."""

    def __init__(self, q, k, v, scale: float):
        self.q, self.k, self.v = (torch.empty_like(t, memory_format=torch.contiguous_format)
                                  for t in (q, k, v))  # fmt: skip
        self.scale = scale
        self.graph: torch.cuda.CUDAGraph | None = None
        self.held: tuple = ()
        self.direct = False  # a capture failed: this shape's steps launch directly

    def __call__(self, plan: DecodePlan, q, k, v, want_lse: bool):
        # One launch for the three copies (a copy's host cost is a launch's, not its bytes').
        torch._foreach_copy_([self.q, self.k, self.v], [q, k, v])
        held = plan.held
        if self.direct or not self.held:
            self.held = held
            return _launch(plan, self.q, self.k, self.v, self.scale)
        if self.graph is None or not all(map(operator.is_, self.held, held)):
            try:
                self._capture(plan)
            except Exception as exc:  # whatever failed, the step must still run
                # The host's half of this step has run (pages, lengths): the step cannot stop
                # here without leaving the cache half advanced, so it launches directly.
                self.graph, self.direct = None, True
                warnings.warn(
                    f"s2attn: capturing an eager decode step in a CUDA graph failed ({exc}); "
                    "this cache's steps of this shape launch directly from now on",
                    RuntimeWarning,
                    stacklevel=4,
                )
                return _launch(plan, self.q, self.k, self.v, self.scale)
            self.held = held
        self.graph.replay()
        # Fresh tensors: the next replay overwrites the graph's own.
        return self.out.clone(), (self.lse.clone() if want_lse else None)

    def _capture(self, plan: DecodePlan) -> None:
        device = self.q.device
        self.graph = torch.cuda.CUDAGraph()
        current = torch.cuda.current_stream(device)
        side = torch.cuda.Stream(device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            # Each graph its own memory pool: a pool shared through a stored handle is released
            # with the last graph that used it, and capturing into it then fails (torch 2.11,
            # H100: a second cache's capture after the first cache was freed). thread_local:
            # another thread's allocations meanwhile do not break the capture.
            self.graph.capture_begin(capture_error_mode="thread_local")
            try:
                self.out, self.lse = _launch(plan, self.q, self.k, self.v, self.scale)
            finally:
                self.graph.capture_end()
        current.wait_stream(side)


def applies(q: torch.Tensor) -> bool:
    """Whether an eager decode step of ``q`` replays a graph: then its plan takes the split
    count of a whole run (``PagedKVCache.decode_plan``), so that one graph serves every length."""
    return (
        ENABLED
        and not torch.compiler.is_compiling()
        and q.device.type == "cuda"
        and q.device.index == torch.cuda.current_device()
        and not torch.cuda.is_current_stream_capturing()
        # The PyTorch reference reads lengths back on the host: it cannot be captured.
        and runs_kernels(q.device)
    )


def device_step(
    graphs: dict, plan: DecodePlan, q, k, v, scale: float, want_lse: bool, graphed: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The device half of an eager decode step of ``plan`` (the cache's, after its host half):
    replayed from the cache's graph of its shape (``graphs``, the cache's ``step_graphs``) when
    ``graphed`` (:func:`applies`), else launched directly. Returns ``(out, lse)``; lse may be
    None unless ``want_lse``."""
    if not graphed:
        return _launch(plan, q, k, v, scale)
    key = (q.shape, k.shape, scale, plan.num_splits)
    graph = graphs.get(key)
    if graph is None:
        if len(graphs) >= _MAX_GRAPHS:  # a caller whose shapes never repeat
            graphs.clear()
        graph = graphs[key] = StepGraph(q, k, v, scale)
    return graph(plan, q, k, v, want_lse)


def _launch(plan: DecodePlan, q, k, v, scale: float):
    return decode_step(q, k, v, plan, softmax_scale=scale)
