"""Inference over an evicting, paged KV cache. Decoding flows down the modules:

    eviction.py       EvictionSchedule: from which query block on each KV block is never read
                      again, derived from the layer's pattern
    page_pool.py      PagePool: the pages, their free list, holder counts and copy on write
    cache.py          PagedKVCache, what both kinds share (page table, lengths; append, gather,
                      crop, reset, reports)
    cache_checks.py   the checks at a cache's boundary: its construction arguments, the new
                      tokens it takes, the arguments of its edits
    dynamic_cache.py  DynamicKVCache: pages taken and freed as the pattern reads them, shared by
                      beams
    static_cache.py   StaticKVCache: every block's page fixed up front, for CUDA graphs and
                      compiled steps
    cache_factory.py  paged_kv_cache(..., static=...): the kind chosen, the cache built
    model_cache.py    ModelKVCache: one cache per layer of a model
    decode_plan.py    DecodePlan: what one decode step's device work reads and writes (pages,
                      page table, lengths, layout, split count, split counters), planned by
                      the cache, taken by every decode path
    decode_step.py    the one decode step's device work (page write, lengths, attention) that
                      every decode path runs
    step_graph.py     eager decode steps replayed from a CUDA graph per cache and step shape
    attention.py      sparse_attention_with_kvcache: prefill, chunked prefill and decode over a
                      cache; capture_decode_step
    decode_op.py      the decode step as one torch.library operator (s2attn::static_decode) over
                      a static cache, for compiled graphs

Kernels are chosen through ``s2attn.ops.dispatch``; the decode lists come from
``s2attn.ops.decode_layout``, the plain-PyTorch path over pages from ``s2attn.ops.cpu``.
"""

from .attention import MAX_DECODE_TOKENS, capture_decode_step, sparse_attention_with_kvcache
from .cache import PagedKVCache
from .cache_factory import paged_kv_cache
from .dynamic_cache import DynamicKVCache
from .eviction import EvictionSchedule, kv_last_use
from .model_cache import ModelKVCache
from .page_pool import PagePool
from .static_cache import StaticKVCache

__all__ = [
    "MAX_DECODE_TOKENS",
    "DynamicKVCache",
    "EvictionSchedule",
    "ModelKVCache",
    "PagePool",
    "PagedKVCache",
    "StaticKVCache",
    "capture_decode_step",
    "kv_last_use",
    "paged_kv_cache",
    "sparse_attention_with_kvcache",
]
