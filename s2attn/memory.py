"""CUDA memory for what outlives a call (cached layouts, work counters), kept out of CUDA graphs'
private pools. Below the layouts and the kernels, which both cache such tensors."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch

__all__ = ["build_outside_graph_pool"]

_T = TypeVar("_T")


def build_outside_graph_pool(device: torch.device | str, build: Callable[[], _T]) -> _T:
    """``build()``, for something that outlives the call (a cached layout, a work counter), with
    its CUDA memory outside any CUDA graph's private pool.

    ``torch.compile(mode="reduce-overhead")`` runs a graph's first call (CUDA-graph trees'
    warm-up) with every allocation *of the calling thread* routed to the graph's pool; an entry
    cached then stays alive in that pool, and the trees refuse to record the graph ("tensor(s)
    in the cudagraph pool not tracked as outputs"). So on CUDA, outside a capture, ``build`` runs
    on a short-lived thread of its own, on that thread's (the default) stream, ordered after the
    caller's stream and before the caller's next work. Cache misses are rare (once per pattern,
    shape or stream), so the thread costs nothing that recurs. During a capture, and on the CPU,
    ``build()`` runs here: what a captured launch allocates belongs to its graph."""
    device = torch.device(device)
    if device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        return build()
    caller = torch.cuda.current_stream(device)

    def run() -> tuple[_T, torch.cuda.Stream]:
        with torch.cuda.device(device):
            stream = torch.cuda.current_stream(device)
            stream.wait_stream(caller)
            return build(), stream

    with ThreadPoolExecutor(max_workers=1) as thread:
        result, stream = thread.submit(run).result()
    caller.wait_stream(stream)
    return result
