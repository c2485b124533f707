"""Attention over a :class:`~.cache.PagedKVCache`: prefill, chunked prefill and decode in one call.

``sparse_attention_with_kvcache(q, cache, k, v)`` appends the new tokens' keys and values to each
sequence and attends the new queries to everything before them, bottom-right aligned (the new
tokens sit at the end of each sequence). The path depends on the step:

* **decode** (a batched step of at most ``MAX_DECODE_TOKENS`` new tokens per sequence, e.g. one,
  or a few for speculative decoding): the tokens are written to the cache first, then the paged
  decode kernel reads only the pages the pattern keeps for them, split over the KV list when the
  batch is too small to fill the GPU.
* **prefill** (an empty cache): the forward kernel runs over the prompt's own keys, batched or
  packed; afterwards only the blocks later queries read are stored, so the cache never holds the
  whole prompt.
* **chunked prefill** (a longer step after a past): the chunk's past is gathered from the pages
  (evicted blocks as zeros, which the pattern never reads), the forward kernel runs over past plus
  chunk, and only what later queries read is stored. Prefilling in chunks gives the result of one
  pass.
"""

from __future__ import annotations

import torch

from ..attention import sparse_attention
from ..input_checks import check_cu_seqlens, check_softmax_scale, check_tensor
from ..ops import dispatch
from ..ops.dispatch import supports_triton
from ..pattern import BlockPattern, shared_dense_pattern
from ..precision import autocast_entry
from . import step_graph
from .cache import PagedKVCache
from .cache_checks import check_new_tokens
from .decode_step import MAX_DECODE_TOKENS, attend
from .static_cache import StaticKVCache

__all__ = [
    "MAX_DECODE_TOKENS",
    "capture_decode_step",
    "check_step_inputs",
    "sparse_attention_with_kvcache",
]


def _layer_pattern(cache: PagedKVCache) -> BlockPattern:
    if cache.pattern is not None:
        return cache.pattern
    return shared_dense_pattern(cache.num_kv_heads, cache.max_seq_len, cache.block_size)


def check_step_inputs(
    q,
    k,
    v,
    k_pages: torch.Tensor,
    page_table: torch.Tensor,
    pattern: BlockPattern | None,
    cu_seqlens_q=None,
) -> None:
    """Check q and the new k, v (or neither) against a cache of these pages, page table and
    pattern: every call over a cache, eager or compiled, checks its inputs here (k and v as the
    cache's appends check them, :func:`~.cache_checks.check_new_tokens`). The cache's facts
    come from its tensors, not its attributes: a compiled graph guards on those tensors anyway.
    Whether new tokens fit the cache is the cache's own check."""
    dtype, device, head_dim = k_pages.dtype, k_pages.device, k_pages.shape[-1]
    batch, kv_heads = page_table.shape[0], page_table.shape[1]
    check_tensor("q", q)
    if q.dtype != dtype:
        raise TypeError(f"q has dtype {q.dtype} but the cache holds {dtype}")
    if q.device != device:
        raise ValueError(f"q is on {q.device} but the cache is on {device}")
    if (k is None) != (v is None):
        raise ValueError("pass both k and v (new tokens to append) or neither")
    packed = cu_seqlens_q is not None
    if packed:
        if q.dim() != 3:
            raise ValueError(
                f"with cu_seqlens_q, q must be (total, heads, dim), got {tuple(q.shape)}"
            )
        if not isinstance(cu_seqlens_q, torch.Tensor) or cu_seqlens_q.dtype != torch.int32:
            raise TypeError("cu_seqlens_q must be an int32 tensor of batch + 1 offsets")
        if k is None:
            raise ValueError("packed queries need their new keys and values (k, v)")
    elif q.dim() != 4 or q.shape[0] != batch:
        raise ValueError(
            f"q must be (batch={batch}, num_new, heads, dim), or packed with cu_seqlens_q, got "
            f"{tuple(q.shape)}"
        )
    num_heads = q.shape[-2]
    if q.shape[-1] != head_dim:
        raise ValueError(f"q has head dim {q.shape[-1]} but the cache holds {head_dim}")
    if num_heads % kv_heads:
        raise ValueError(
            f"q heads ({num_heads}) must be a multiple of the cache's KV heads ({kv_heads})"
        )
    if pattern is not None and pattern.num_heads not in (num_heads, kv_heads):
        raise ValueError(
            f"the cache's pattern has {pattern.num_heads} heads; expected the q heads "
            f"({num_heads}) or the KV heads ({kv_heads})"
        )
    if k is not None:
        check_new_tokens(k, v, k_pages, page_table, cu_seqlens_q)
        if q.shape[:-2] != k.shape[:-2]:
            raise ValueError(
                f"q {tuple(q.shape)} and k {tuple(k.shape)} must hold the same new tokens"
            )


def _validate(q, cache, k, v, softmax_scale, cu_seqlens_q) -> float:
    """Check the inputs a call of any kind reads; return the scale. Whether new tokens fit the
    cache is the cache's check: in its plan on a decode step, before attending on a prefill."""
    if not isinstance(cache, PagedKVCache):
        raise TypeError(f"cache must be an s2attn.PagedKVCache, got {type(cache).__name__}")
    check_step_inputs(q, k, v, cache.k_pages, cache.page_table, cache.pattern, cu_seqlens_q)
    if k is None and q.shape[1] > min(cache.lengths):
        raise ValueError(
            f"q holds {q.shape[1]} tokens per sequence, more than the shortest cached "
            f"sequence ({min(cache.lengths)}); pass k and v to append them"
        )
    return check_softmax_scale(softmax_scale, q.shape[-1])


def _new_counts(
    q: torch.Tensor, cache: PagedKVCache, cu_seqlens_q: torch.Tensor | None
) -> list[int]:
    """New tokens per sequence."""
    if cu_seqlens_q is None:
        return [q.shape[1]] * cache.batch_size
    cu = check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.shape[0], q.device, cache.batch_size)
    return [b - a for a, b in zip(cu, cu[1:])]


def _attend_cache(q, cache: PagedKVCache, scale: float, num_splits: int | None):
    """Attention of q, the last tokens of each sequence, over the cache as it is."""
    return attend(q, cache.decode_plan(q.shape[1], num_splits=num_splits), softmax_scale=scale)


def _decode_step(q, cache: PagedKVCache, k, v, scale: float, num_splits: int | None, want_lse):
    """A decode step of checked inputs: the cache plans its pages on the host, then the step's
    device work writes, advances and attends, replayed from a CUDA graph where one applies."""
    graphed = step_graph.applies(q)
    plan = cache._plan_checked_decode_step(q.shape[1], num_splits=num_splits, whole_run=graphed)
    return step_graph.device_step(cache.step_graphs, plan, q, k, v, scale, want_lse, graphed)


def _step_inputs(q, cache: PagedKVCache, k, v, softmax_scale) -> tuple:
    """What a decode step's checks read of its inputs. Each value's type comes before it, so
    comparing two of these never compares a tensor with a number (an error, not False)."""
    return (type(q), type(k), type(v), q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype,
            q.device, k.device, v.device, type(softmax_scale), softmax_scale,
            cache.batch_size)  # fmt: skip


def _checked_scale(q, cache, k, v, softmax_scale, cu_seqlens_q) -> float | None:
    """The scale of a decode step whose inputs match the cache's last checked step's (their
    shapes, dtypes, devices, the scale given and the batch), else None. At batch 1 an eager
    step is host work: the checks cost about as much as the page planning."""
    checked = cache._checked_step if isinstance(cache, PagedKVCache) else None
    if checked is None or cu_seqlens_q is not None:
        return None
    try:
        inputs = _step_inputs(q, cache, k, v, softmax_scale)
    except AttributeError:  # not tensors: the checks name what is wrong
        return None
    return checked[1] if inputs == checked[0] else None


def _attend_dense(q, cache, k, v, scale, cu_q, counts, past):
    """Forward kernel over each sequence's past (gathered) and new keys, packed."""
    batch = cache.batch_size
    dev = q.device
    packed_q = q if cu_q is not None else q.reshape(-1, *q.shape[2:])
    if cu_q is None:
        cu_q = torch.arange(0, (batch + 1) * counts[0], counts[0], dtype=torch.int32, device=dev)
    k_new = k.reshape(-1, *k.shape[-2:])
    v_new = v.reshape(-1, *v.shape[-2:])
    if any(past):
        k_past, v_past, _ = cache.gather(past)
        # Interleave per sequence: its past, then its new tokens.
        bounds_new = [0, *torch.tensor(counts).cumsum(0).tolist()]
        bounds_past = [0, *torch.tensor(past).cumsum(0).tolist()]
        parts_k, parts_v = [], []
        for b in range(batch):
            old = slice(bounds_past[b], bounds_past[b + 1])
            new = slice(bounds_new[b], bounds_new[b + 1])
            parts_k += [k_past[old], k_new[new]]
            parts_v += [v_past[old], v_new[new]]
        k_ctx, v_ctx = torch.cat(parts_k), torch.cat(parts_v)
    else:
        k_ctx, v_ctx = k_new, v_new
    lens_k = [p + n for p, n in zip(past, counts)]
    cu_k = torch.tensor([0, *lens_k], dtype=torch.int64).cumsum(0).to(torch.int32).to(dev)
    out, lse = sparse_attention(
        packed_q,
        k_ctx,
        v_ctx,
        _layer_pattern(cache),
        softmax_scale=scale,
        cu_seqlens_q=cu_q,
        cu_seqlens_k=cu_k,
        max_seqlen_q=max(counts),
        max_seqlen_k=max(lens_k),
        return_lse=True,
    )
    return out, lse


def _cache_dtype(q, cache, *args, **kwargs) -> torch.dtype | None:
    # The cache's dtype, not the region's, is what the kernels read: compute in it, and hand the
    # output back at the region's dtype as SDPA would.
    return cache.dtype if isinstance(cache, PagedKVCache) else None


@autocast_entry("q", "k", "v", compute_dtype=_cache_dtype, output_in_region=True)
def sparse_attention_with_kvcache(
    q: torch.Tensor,
    cache: PagedKVCache,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    *,
    softmax_scale: float | None = None,
    cu_seqlens_q: torch.Tensor | None = None,
    return_lse: bool = False,
    num_splits: int | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Append new tokens to a paged KV cache and attend their queries to the cached context.

    Args:
        q: (batch, num_new, heads, dim), or packed (total_new, heads, dim) with
            ``cu_seqlens_q``; the cache's dtype and device. The new tokens follow each sequence's
            cached tokens: row ``t`` of sequence ``b`` sits at absolute position
            ``cache.lengths[b] + t`` (before the append).
        cache: the layer's :class:`s2attn.PagedKVCache`; its pattern (None: dense) has ``heads``
            or ``kv_heads`` heads.
        k, v: the new tokens' keys and values, (batch, num_new, kv_heads, dim) or packed
            (total_new, kv_heads, dim). None when they were appended already (``cache.append``);
            q's tokens are then the last ``num_new`` of every sequence (batched q only).
        softmax_scale: defaults to ``1 / sqrt(dim)``.
        cu_seqlens_q: int32 (batch + 1,) offsets of each sequence's new tokens in packed q/k/v
            (variable-length prefill; a sequence may have none).
        return_lse: also return the float32 natural-log LSE per row.
        num_splits: decode only: programs per (sequence, KV head); default from the GPU's size.

    Returns ``out`` shaped like q, in q's dtype; with ``return_lse`` also ``lse`` (batch, heads,
    num_new), or (heads, total_new) for packed q.

    Under ``torch.autocast`` for the cache's device the cache keeps its own dtype: q and the new
    keys and values (any floating dtypes, float64 aside) are cast to the cache's dtype, attention
    over the cache computes in it, and ``out`` comes back in the region's dtype (the LSE stays
    float32). Outside autocast, q must be in the cache's dtype.

    Example::

        >>> cache = s2attn.paged_kv_cache(pattern, batch_size=2, num_kv_heads=8, head_dim=128,
        ...                               dtype=torch.bfloat16, device="cuda")
        >>> out = s2attn.sparse_attention_with_kvcache(q_prompt, cache, k_prompt, v_prompt)
        >>> for _ in range(steps):  # q_step (2, 1, 32, 128), k/v_step (2, 1, 8, 128)
        ...     out = s2attn.sparse_attention_with_kvcache(q_step, cache, k_step, v_step)
    """
    scale = _checked_scale(q, cache, k, v, softmax_scale, cu_seqlens_q)
    if scale is not None:
        out, lse = _decode_step(q, cache, k, v, scale, num_splits, return_lse)
        return (out, lse) if return_lse else out
    scale = _validate(q, cache, k, v, softmax_scale, cu_seqlens_q)
    if k is None:
        if not supports_triton(q.device):
            raise RuntimeError("reading new tokens back from the cache needs the Triton kernels")
        out, lse = _attend_cache(q, cache, scale, num_splits)
        return (out, lse) if return_lse else out

    packed = cu_seqlens_q is not None
    group = q.shape[-2] // cache.num_kv_heads
    is_decode_step = (
        not packed
        and q.shape[1] <= MAX_DECODE_TOKENS
        and group * q.shape[1] <= dispatch.MAX_DECODE_ROWS
        and supports_triton(q.device)
    )
    if is_decode_step:
        out, lse = _decode_step(q, cache, k, v, scale, num_splits, return_lse)
        cache._checked_step = (_step_inputs(q, cache, k, v, softmax_scale), scale)
        return (out, lse) if return_lse else out

    past, counts = cache.lengths, _new_counts(q, cache, cu_seqlens_q)
    new = [p + n for p, n in zip(past, counts)]
    cache._check_fits(new)  # before attending, not only in the append after it
    out, lse = _attend_dense(q, cache, k, v, scale, cu_seqlens_q, counts, past)
    # The new tokens' queries are done: store only what later queries read.
    cache.append(k, v, cu_seqlens=cu_seqlens_q, keep_from=new)
    if not packed:
        out = out.view(q.shape)
        lse = lse.view(q.shape[-2], cache.batch_size, q.shape[1]).transpose(0, 1)
    return (out, lse) if return_lse else out


def capture_decode_step(
    q: torch.Tensor,
    cache: PagedKVCache,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    softmax_scale: float | None = None,
    num_splits: int | None = None,
):
    """Capture one decode step over a static cache in a CUDA graph; return ``step()``, which
    replays it: writes the new keys and values, attends, advances the cache, and returns the
    output (one tensor, overwritten by every replay).

    ``q``, ``k``, ``v`` (batch, num_new, heads or kv_heads, dim) are the graph's inputs: copy each
    step's values into them before ``step()``. The step's device state (page table, lengths) is
    updated in place, so one graph serves every step until the cache is full. The split count is
    fixed for the whole run (``num_splits``; default: the longest list's). Capturing runs one
    step for real to compile and warm the kernels, then crops it away: the cache's contents are
    unchanged. Eager calls on the cache stay valid between replays.

    Example::

        >>> cache = s2attn.paged_kv_cache(pattern, batch_size=8, num_kv_heads=8, head_dim=128,
        ...                               device="cuda", static=True)
        >>> s2attn.sparse_attention_with_kvcache(q_prompt, cache, k_prompt, v_prompt)
        >>> step = s2attn.capture_decode_step(q_buf, cache, k_buf, v_buf)
        >>> for _ in range(new_tokens):
        ...     q_buf.copy_(q_next); k_buf.copy_(k_next); v_buf.copy_(v_next)
        ...     out = step()
    """
    if not isinstance(cache, StaticKVCache):
        raise ValueError("capture_decode_step needs a static cache (paged_kv_cache(static=True))")
    if q.device.type != "cuda":
        raise ValueError(f"CUDA graphs need a CUDA device, got {q.device}")
    if q.dim() != 4 or q.shape[1] > MAX_DECODE_TOKENS:
        raise ValueError(
            f"q must be a decode step (batch, <= {MAX_DECODE_TOKENS} tokens, heads, dim), got "
            f"{tuple(q.shape)}"
        )
    num_new = q.shape[1]
    if num_splits is None:
        # The whole run's, as every captured step takes (the warm-up step and the captured one
        # must launch alike).
        num_splits = cache.step_plan.num_splits

    def call():
        return sparse_attention_with_kvcache(
            q, cache, k, v, softmax_scale=softmax_scale, num_splits=num_splits
        )

    # A real step on a side stream compiles and warms the kernels (CUDA graphs capture no
    # compilation); cropping it leaves the cache as it was.
    side = torch.cuda.Stream(q.device)
    side.wait_stream(torch.cuda.current_stream(q.device))
    with torch.cuda.stream(side):
        call()
    torch.cuda.current_stream(q.device).wait_stream(side)
    cache.crop(num_new)
    # Capturing runs the host code without the device work: keep the host bookkeeping as it was.
    graph = torch.cuda.CUDAGraph()
    with cache.host_state_kept(), torch.cuda.graph(graph):
        out = call()

    def step() -> torch.Tensor:
        cache.advance(num_new)  # checks before the device runs: a full cache raises here
        graph.replay()
        return out

    return step
