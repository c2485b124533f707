"""Inference over an evicting, paged KV cache. Decoding flows down the three modules:

    eviction.py   EvictionSchedule: from which query block on each KV block is never read again,
                  derived from the layer's pattern
    cache.py      PagedKVCache (pages, page table, free list; append, gather, crop, reset) and
                  ModelKVCache (one per layer)
    attention.py  sparse_attention_with_kvcache: prefill, chunked prefill and decode over a cache
    decode_op.py  a static cache's decode step as one torch.library operator (s2attn::static_decode)
                  of device work alone, for compiled graphs and CUDA-graph replays

The kernels they launch are in ``s2attn.ops.triton`` (decode.py, page_write.py); the decode
lists in ``s2attn.layout``.
"""

from .attention import MAX_DECODE_TOKENS, capture_decode_step, sparse_attention_with_kvcache
from .cache import ModelKVCache, PagedKVCache
from .eviction import EvictionSchedule, kv_last_use

__all__ = [
    "MAX_DECODE_TOKENS",
    "EvictionSchedule",
    "ModelKVCache",
    "PagedKVCache",
    "capture_decode_step",
    "kv_last_use",
    "sparse_attention_with_kvcache",
]
