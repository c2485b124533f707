"""A static cache's decode step as one ``torch.library`` operator, for compiled graphs.

``s2attn::static_decode(q, k, v, k_pages, v_pages, page_table, seq_lens, pattern_key,
softmax_scale) -> out`` writes the new tokens' keys and values into their pages,
advances ``seq_lens`` and attends the new queries to the pages the pattern keeps, all in device
work on the cache's tensors (it mutates ``k_pages``, ``v_pages`` and ``seq_lens``). Nothing in it
reads or changes host state, so a compiled graph that holds it, replayed from a CUDA graph or run
by Inductor, serves every step; the cache's host bookkeeping (lengths, keep blocks) catches up
from ``seq_lens`` when an eager call next needs it (:meth:`PagedKVCache.catch_up`).

Only static caches (``PagedKVCache(static=True)``) qualify: their page table is fixed, so a step
needs no allocation, eviction or copy on write. On a Triton backend the operator launches the
page-write and decode kernels (the ones ``capture_decode_step`` records); elsewhere it computes
the same in PyTorch from the pattern's dense mask, for the CPU and small models.
"""

from __future__ import annotations

import weakref

import torch

from ..custom_ops import pattern_for_key, pattern_key
from ..layout import decode_layout, dense_decode_layout
from ..ops import dispatch
from ..ops.dispatch import supports_triton
from ..ops.triton import decode as triton_decode
from ..ops.triton.page_write import write_pages
from ..pattern import BlockPattern
from ..validation import check_tensor
from .cache import DECODE_STEP_TOKENS as MAX_DECODE_TOKENS
from .cache import PagedKVCache

__all__ = ["static_decode_step"]

_DENSE = -1  # the pattern key of a dense layer's cache (no pattern)

# Per pattern and device: the dense block mask the PyTorch path reads (small models only).
_MASKS: weakref.WeakKeyDictionary[BlockPattern, dict] = weakref.WeakKeyDictionary()


def _layout(key: int, block_size: int, kv_heads: int, max_blocks: int, device: torch.device):
    if key == _DENSE:
        return dense_decode_layout(block_size, kv_heads, max_blocks, device)
    return decode_layout(pattern_for_key(key), kv_heads, device)


def _block_mask(key: int, max_blocks: int, device: torch.device) -> torch.Tensor:
    """(pattern heads, blocks, blocks) bool: which KV blocks each query block keeps."""
    if key == _DENSE:
        return torch.ones(1, max_blocks, max_blocks, dtype=torch.bool, device=device)
    pattern = pattern_for_key(key)
    per_device = _MASKS.setdefault(pattern, {})
    if str(device) not in per_device:
        per_device[str(device)] = pattern.mask[:, :max_blocks, :max_blocks].to(device)
    return per_device[str(device)]


def _torch_step(q, k, v, k_pages, v_pages, page_table, seq_lens, key, scale):
    """The step in PyTorch: writes through the page table at ``seq_lens``, then attention over
    every page of each sequence under the pattern's mask and the causal rule."""
    batch, num_new, heads, dim = q.shape
    kv_heads, max_blocks = page_table.shape[1:]
    block = k_pages.shape[1]
    spare = (k_pages.shape[0] - 1) * block  # the page that takes writes of unstored blocks
    pos = seq_lens.long()[:, None] + torch.arange(num_new, device=q.device)  # (batch, new)
    pages = page_table.long().gather(
        2, (pos // block)[:, None, :].expand(batch, kv_heads, num_new)
    )  # (batch, kv_heads, new)
    rows = torch.where(pages >= 0, pages * block + (pos % block)[:, None, :], spare)
    rows = rows.transpose(1, 2).reshape(-1)
    k_pages.view(-1, dim).index_copy_(0, rows, k.reshape(-1, dim))
    v_pages.view(-1, dim).index_copy_(0, rows, v.reshape(-1, dim))
    seq_lens.add_(num_new)

    # Every block of each sequence, (batch, kv_heads, max_blocks * block, dim); blocks without a
    # page, and ring pages now holding newer blocks, are masked below (the pattern never reads
    # those for these queries).
    table = page_table.long()
    keys = k_pages[table.clamp(min=0)].flatten(2, 3)
    values = v_pages[table.clamp(min=0)].flatten(2, 3)
    group = heads // kv_heads
    keys = keys.repeat_interleave(group, dim=1).float()
    values = values.repeat_interleave(group, dim=1).float()
    scores = torch.einsum("bnhd,bhkd->bhnk", q.float(), keys) * scale
    mask = _block_mask(key, max_blocks, q.device)
    head_of = torch.arange(heads, device=q.device) // (heads // mask.shape[0])
    key_pos = torch.arange(max_blocks * block, device=q.device)
    # (batch, heads, new, keys): the pattern keeps the key's block for the query's block.
    kept = mask[head_of[None, :, None], (pos // block)[:, None, :]]  # (batch, heads, new, blocks)
    kept = kept.repeat_interleave(block, dim=-1)
    kept &= key_pos <= pos[:, None, :, None]
    kept &= (
        (table >= 0).repeat_interleave(group, dim=1).repeat_interleave(block, dim=-1)[:, :, None, :]
    )
    scores = scores.masked_fill(~kept, float("-inf"))
    out = torch.einsum("bhnk,bhkd->bnhd", scores.softmax(dim=-1), values)
    return out.to(q.dtype).contiguous()


@torch.library.custom_op("s2attn::static_decode", mutates_args=("k_pages", "v_pages", "seq_lens"))
def static_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    pattern_key: int,
    softmax_scale: float,
) -> torch.Tensor:
    # A step past the cache's end would write through rows the page table does not have: fail
    # on the device (no host sync), never corrupt pages.
    capacity = page_table.shape[2] * k_pages.shape[1]
    torch._assert_async(
        seq_lens.max() + q.shape[1] <= capacity,
        "s2attn: a decode step past the static cache's max_seq_len",
    )
    if not supports_triton(q.device):
        return _torch_step(q, k, v, k_pages, v_pages, page_table, seq_lens, pattern_key,
                           softmax_scale)  # fmt: skip
    kv_heads, max_blocks = page_table.shape[1:]
    layout = _layout(pattern_key, k_pages.shape[1], kv_heads, max_blocks, q.device)
    write_pages(k, v, k_pages, v_pages, page_table, seq_lens)  # at the old lengths
    seq_lens.add_(q.shape[1])
    out, _ = dispatch.decode(
        q, k_pages, v_pages, page_table, seq_lens, layout, softmax_scale=softmax_scale,
        num_splits=_run_num_splits(layout, pattern_key, q.shape[0], q.device),
    )  # fmt: skip
    return out.contiguous()


# (pattern key, KV heads, batch, device) -> the run's split count (as capture_decode_step's), kept
# so that a step not replayed from a graph does not scan the layout's list lengths again.
_SPLITS: dict[tuple, int] = {}


def _run_num_splits(layout, key: int, batch: int, device: torch.device) -> int:
    entry = (key, layout.num_kv_heads, batch, str(device))
    if entry not in _SPLITS:
        _SPLITS[entry] = triton_decode.run_num_splits(layout, batch, device)
    return _SPLITS[entry]


@static_decode.register_fake
def _(q, k, v, k_pages, v_pages, page_table, seq_lens, pattern_key, softmax_scale):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def _check_step(q, cache, k, v) -> None:
    """Shapes, dtypes and devices a step must have; read while tracing, so a compiled graph
    checks nothing per step (the cache's end is checked on the device)."""
    if not isinstance(cache, PagedKVCache) or not cache.static:
        raise ValueError("static_decode_step needs a static PagedKVCache (static=True)")
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t)
        if t.dtype != cache.dtype or t.device != cache.device:
            raise ValueError(
                f"{name} must be {cache.dtype} on {cache.device} (the cache's), got {t.dtype} on "
                f"{t.device}"
            )
    batch, kv_heads, dim = cache.batch_size, cache.num_kv_heads, cache.head_dim
    if q.dim() != 4 or q.shape[0] != batch or q.shape[-1] != dim or q.shape[2] % kv_heads:
        raise ValueError(
            f"q must be (batch={batch}, num_new, heads (a multiple of {kv_heads}), dim={dim}), "
            f"got {tuple(q.shape)}"
        )
    if not 1 <= q.shape[1] <= MAX_DECODE_TOKENS:
        raise ValueError(
            f"a decode step holds 1 to {MAX_DECODE_TOKENS} new tokens, got {q.shape[1]}"
        )
    want = (batch, q.shape[1], kv_heads, dim)
    if tuple(k.shape) != want or tuple(v.shape) != want:
        raise ValueError(f"k and v must be {want}, got {tuple(k.shape)} and {tuple(v.shape)}")
    pattern = cache.pattern
    if pattern is not None and pattern.num_heads not in (q.shape[2], kv_heads):
        raise ValueError(
            f"the cache's pattern has {pattern.num_heads} heads; expected the q heads "
            f"({q.shape[2]}) or the KV heads ({kv_heads})"
        )


def static_decode_step(
    q: torch.Tensor,
    cache: PagedKVCache,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    softmax_scale: float,
) -> torch.Tensor:
    """One decode step over a static cache through ``s2attn::static_decode``: ``q`` (batch,
    num_new, heads, dim) and the new ``k``/``v`` (batch, num_new, kv_heads, dim), in the cache's
    dtype and on its device. The cache's host lengths are left behind until its next eager use,
    which catches up (:meth:`PagedKVCache.catch_up`)."""
    _check_step(q, cache, k, v)
    key = _DENSE if cache.pattern is None else pattern_key(cache.pattern)
    cache._device_step = q.shape[1]  # the host's lengths now follow the device's (catch_up)
    return torch.ops.s2attn.static_decode(
        q, k, v, cache.k_pages, cache.v_pages, cache.page_table, cache.seq_lens, key,
        float(softmax_scale),
    )  # fmt: skip
