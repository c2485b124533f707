"""A static cache's decode step as one ``torch.library`` operator, for compiled graphs.

``s2attn::static_decode(q, k, v, k_pages, v_pages, page_table, seq_lens, split_counters,
pattern_key, num_splits, softmax_scale, check_room) -> out`` (after q, k, v, the cache's
:class:`~.decode_plan.DecodePlan` as :meth:`~.decode_plan.DecodePlan.op_arguments` gives it)
writes the new tokens' keys and values into their pages, advances ``seq_lens`` and attends the
new queries to the pages the pattern keeps, all in device work on the cache's tensors (it mutates
``k_pages``, ``v_pages`` and ``seq_lens``; the kernel counts its finished splits in
``split_counters`` and leaves them at zero). With
``check_room`` it first asserts on the device that the step fits the cache. Nothing in it
reads or changes host state, so a compiled graph that holds it, replayed from a CUDA graph or run
by Inductor, serves every step; the cache's host bookkeeping (lengths, keep blocks) catches up
from ``seq_lens`` when an eager call next needs it (:meth:`StaticKVCache.catch_up`).

Only static caches (``paged_kv_cache(static=True)``) qualify: their page table is fixed, so a step
needs no allocation, eviction or copy on write. Its body is the decode step every path runs
(:func:`~.decode_step.decode_step`): on a Triton backend the page-write and decode kernels (the
ones ``capture_decode_step`` records); elsewhere the plain-PyTorch reference over pages, for the
CPU and small models.
"""

from __future__ import annotations

import torch

from ..compile import pattern_for_key
from .attention import check_step_inputs
from .cache import PagedKVCache
from .decode_plan import DENSE_KEY, DecodePlan
from .decode_step import MAX_DECODE_TOKENS, decode_step
from .static_cache import StaticKVCache

__all__ = ["STEP_WRITES", "static_decode_step"]

# The cache tensors the operator writes, by their names as arguments and as DecodePlan fields: a
# caller that captures the step in CUDA graphs fixes their addresses (the transformers
# integration marks each one static).
STEP_WRITES = ("k_pages", "v_pages", "seq_lens", "split_counters")


@torch.library.custom_op("s2attn::static_decode", mutates_args=STEP_WRITES)
def static_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    split_counters: torch.Tensor,
    pattern_key: int,
    num_splits: int,
    softmax_scale: float,
    check_room: bool,
) -> torch.Tensor:
    if check_room:
        _assert_room(seq_lens, q.shape[1], page_table.shape[2] * k_pages.shape[1])
    pattern = None if pattern_key == DENSE_KEY else pattern_for_key(pattern_key)
    # The cache's own split counters: without them each call would zero its own, a launch per
    # layer.
    plan = DecodePlan.build(
        k_pages, v_pages, page_table, seq_lens, split_counters, pattern, num_splits
    )
    out, _ = decode_step(q, k, v, plan, softmax_scale=softmax_scale)
    return out.contiguous()


def _assert_room(seq_lens: torch.Tensor, num_new: int, capacity: int) -> None:
    # A step past the cache's end has rows the page table does not have: the page write drops
    # them, so the step would go on with tokens missing. The host refuses it first
    # (StaticKVCache.check_room); where no host code runs per step (a graph replayed as is),
    # fail on the device instead. Two launches (the max, the assert): a model pays them once per
    # step, not per layer (static_decode_step's check_room).
    torch._assert_async(
        seq_lens.max() + num_new <= capacity,
        f"s2attn: a decode step of {num_new} tokens past the static cache's {capacity} "
        "(check cache.check_room(num_new) before compiled steps)",
    )


@static_decode.register_fake
def _(q, k, v, k_pages, v_pages, page_table, seq_lens, split_counters, pattern_key, num_splits,
      softmax_scale, check_room):  # fmt: skip
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def static_decode_step(
    q: torch.Tensor,
    cache: PagedKVCache,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    softmax_scale: float,
    check_room: bool = True,
) -> torch.Tensor:
    """One decode step over a static cache through ``s2attn::static_decode``: ``q`` (batch,
    num_new, heads, dim) and the new ``k``/``v`` (batch, num_new, kv_heads, dim), in the cache's
    dtype and on its device. The cache's host lengths are left behind until its next eager use,
    which catches up (:meth:`StaticKVCache.catch_up`).

    A step that would take a sequence past the cache's ``max_seq_len`` raises ``ValueError``
    naming the length it needs, before anything is written, when called eagerly. Inside a
    compiled graph the host checks nothing per step: call ``cache.check_room(num_new)`` before
    the graph runs (the transformers integration does, when ``generate`` asks the cache for the
    step's mask sizes); a step that still overruns fails on the device and writes nothing.

    ``check_room=False`` leaves that device check to another cache's call in the same step: one
    whose lengths advance in lockstep with this cache's (the layers of one model's cache) and
    that runs before this one (the transformers integration gives it to the first layer that
    stores tokens). A model then pays the check once per step instead of once per layer."""
    if not isinstance(cache, StaticKVCache):
        raise ValueError("static_decode_step needs a static cache (paged_kv_cache(static=True))")
    # The plan's tensors, which a compiled graph takes as inputs and guards anyway, say what the
    # inputs must be: each cache attribute read here would add a guard per layer, evaluated
    # before every step. Read while tracing: a compiled graph checks nothing per step (the
    # cache's end is checked on the device).
    plan = cache.step_plan
    check_step_inputs(q, k, v, plan.k_pages, plan.page_table, plan.pattern)
    if not 1 <= q.shape[1] <= MAX_DECODE_TOKENS:
        raise ValueError(
            f"a decode step holds 1 to {MAX_DECODE_TOKENS} new tokens, got {q.shape[1]}"
        )
    if not torch.compiler.is_compiling():
        # Called eagerly, the step can be refused on the host with the length it needs; a
        # compiled graph checks nothing here (it would guard on the lengths and retrace per
        # step), so its caller checks the room before the graph runs.
        cache.check_room(q.shape[1])
    cache.follow_device_steps(q.shape[1])
    return torch.ops.s2attn.static_decode(
        q, k, v, *plan.op_arguments(), float(softmax_scale), bool(check_room)
    )
