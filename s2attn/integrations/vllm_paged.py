"""S2 attention over vLLM's paged KV cache, in vLLM's own layout; no import of vLLM.

vLLM hands an attention layer one tensor per layer, ``kv_cache`` of shape (num_blocks,
num_kv_heads, page_size, 2 * head_dim) in the head-major layout (vLLM's ``KVCacheLayout.LBHNC``,
the one its CPU backend reads): for each (block, KV head) the ``page_size`` keys, then the
``page_size`` values. A request's token at position ``t`` lives in block
``block_table[request, t // page_size]`` at row ``t % page_size``; ``slot_mapping`` gives the new
tokens' ``block * page_size + row`` (-1 for padding).

Three functions serve the plugin (``s2attn.integrations.vllm``) and are tested standalone:

* :func:`write_kv`: store new keys and values at their slots.
* :func:`paged_attention_torch`: any step (prefill, chunked prefill, decode) in plain PyTorch
  (:func:`s2attn.ops.cpu.paged_attention` over vLLM's pages), each KV head reading
  only the KV blocks its pattern keeps for the step's queries; the exact dense-mask result. The
  CPU path.
* :func:`paged_decode_triton`: one new token per request through s2attn's Triton decode kernel,
  reading vLLM's pages in place (a (block, KV head) pair is one page of the kernel); needs the
  pattern's block to equal vLLM's page.
* :func:`paged_prefill`: any step through :func:`s2attn.sparse_attention` (the forward kernel on a
  GPU), each request's kept pages gathered into a contiguous prefix first. The GPU's prefill.
"""

from __future__ import annotations

import torch

from ..attention import sparse_attention
from ..ops.cpu import paged_attention as paged_attention_reference
from ..ops.decode_layout import decode_layout, group_block_mask
from ..pattern import BlockPattern

__all__ = [
    "paged_attention_torch",
    "paged_decode_triton",
    "paged_prefill",
    "split_kv_cache",
    "write_kv",
]


def split_kv_cache(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(num_blocks, kv_heads, page, 2 * dim) -> keys and values, each a (num_blocks, kv_heads,
    page, dim) view of the same memory."""
    if kv_cache.dim() != 4 or kv_cache.shape[-1] % 2:
        raise ValueError(
            "kv_cache must be (num_blocks, num_kv_heads, page_size, 2 * head_dim), got "
            f"{tuple(kv_cache.shape)}"
        )
    num_blocks, kv_heads, page, two_dim = kv_cache.shape
    # Within one (block, KV head) the page's keys come first, then its values.
    paired = kv_cache.view(num_blocks, kv_heads, 2, page, two_dim // 2)
    return paired[:, :, 0], paired[:, :, 1]


def write_kv(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store ``key``/``value`` (tokens, kv_heads, dim) at ``slot_mapping`` (tokens,); slots of -1
    (vLLM's padding) are skipped."""
    key_cache, value_cache = split_kv_cache(kv_cache)
    page = key_cache.shape[2]
    tokens = slot_mapping.shape[0]
    slots = slot_mapping.to(torch.int64)
    stored = slots >= 0
    if not bool(stored.all()):
        slots, key, value = slots[stored], key[:tokens][stored], value[:tokens][stored]
    blocks, rows = slots // page, slots % page
    # Advanced indices on either side of a slice put the token axis first: (tokens, heads, dim).
    key_cache[blocks, :, rows] = key[: slots.shape[0]].to(key_cache.dtype)
    value_cache[blocks, :, rows] = value[: slots.shape[0]].to(value_cache.dtype)


def paged_attention_torch(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: list[int],
    seq_lens: list[int],
    pattern: BlockPattern,
    softmax_scale: float,
) -> torch.Tensor:
    """Attention of each request's new queries over its cached keys, restricted to ``pattern``.

    Args:
        query: (tokens, heads, dim), the requests' new tokens packed in order.
        kv_cache: vLLM's (num_blocks, kv_heads, page, 2 * dim) cache, the new tokens already in it.
        block_table: (requests, max_blocks) vLLM block of each page of each request.
        query_start_loc: requests + 1 offsets into ``query``.
        seq_lens: per request, its length with the new tokens (they are its last positions).
        pattern: causal, over at least ``max(seq_lens)`` tokens, heads a multiple of kv_heads.
        softmax_scale: the score scale.

    Returns (tokens, heads, dim) in query's dtype, computed in float32. Each KV head reads only
    the pages of the KV blocks its pattern keeps for some query of the request.
    """
    key_cache, value_cache = split_kv_cache(kv_cache)
    _, masks = _kv_head_masks(query.shape[1], key_cache.shape[1], pattern)
    for r, length in enumerate(seq_lens):
        if query_start_loc[r + 1] > query_start_loc[r]:
            _check_length(r, length, pattern)
    k_pages, v_pages = key_cache.flatten(0, 1), value_cache.flatten(0, 1)
    out, _ = paged_attention_reference(
        query,
        k_pages,
        v_pages,
        _page_table(block_table, key_cache.shape[1]),
        query_start_loc,
        seq_lens,
        masks.flatten(0, 1),
        block_size=pattern.block_size,
        softmax_scale=softmax_scale,
    )
    return out


def paged_prefill(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: list[int],
    seq_lens: list[int],
    pattern: BlockPattern,
    softmax_scale: float,
) -> torch.Tensor:
    """As :func:`paged_attention_torch`, through :func:`s2attn.sparse_attention`: per request, the
    pages of the KV blocks its pattern keeps for its new queries are gathered into a contiguous
    prefix (the other positions zero; the kernel never reads them), and the new queries, its last
    positions, attend it. On a GPU this is the forward kernel; on the CPU the exact reference."""
    key_cache, value_cache = split_kv_cache(kv_cache)
    num_heads = query.shape[1]
    kv_heads, page, dim = key_cache.shape[1], key_cache.shape[2], key_cache.shape[3]
    _, masks = _kv_head_masks(num_heads, kv_heads, pattern)
    out = torch.empty_like(query)
    for r, start, end, _, kept in _requests(masks, query_start_loc, seq_lens, pattern):
        shape = (1, seq_lens[r], kv_heads, dim)
        k = torch.zeros(shape, dtype=query.dtype, device=query.device)
        v = torch.zeros(shape, dtype=query.dtype, device=query.device)
        for h, pos in enumerate(kept):
            pages, in_page = _slots(pos, block_table[r], page)
            k[0, pos.to(k.device), h] = key_cache[pages, h, in_page].to(k.dtype)
            v[0, pos.to(v.device), h] = value_cache[pages, h, in_page].to(v.dtype)
        q = query[start:end][None]
        out[start:end] = sparse_attention(q, k, v, pattern, softmax_scale=softmax_scale)[0]
    return out


def _kv_head_masks(num_heads: int, kv_heads: int, pattern: BlockPattern):
    """(query heads per KV head, the pattern per KV head as ``group_block_mask`` gives it)."""
    if num_heads % kv_heads:
        raise ValueError(f"query heads ({num_heads}) must be a multiple of KV heads ({kv_heads})")
    return num_heads // kv_heads, group_block_mask(pattern, kv_heads)


def _requests(masks, query_start_loc, seq_lens, pattern):
    """For each request with new queries: (request, its first and past-last query rows, the
    queries' positions, per KV head the positions of the KV blocks it keeps for some new query).
    Refuses requests longer than the pattern."""
    block = pattern.block_size
    for r, length in enumerate(seq_lens):
        start, end = query_start_loc[r], query_start_loc[r + 1]
        if end == start:
            continue
        _check_length(r, length, pattern)
        q_pos = torch.arange(length - (end - start), length)
        first_q_block, last_q_block = int(q_pos[0]) // block, int(q_pos[-1]) // block
        kept = []
        for head_mask in masks[:, :, first_q_block : last_q_block + 1, : last_q_block + 1]:
            blocks = head_mask.any(dim=1).any(dim=0).nonzero().flatten()
            pos = (blocks[:, None] * block + torch.arange(block)).flatten()
            kept.append(pos[pos < length])
        yield r, start, end, q_pos, kept


def _check_length(request: int, length: int, pattern: BlockPattern) -> None:
    if length > pattern.max_seq_len:
        raise ValueError(
            f"request {request} holds {length} tokens, past the pattern's max_seq_len "
            f"{pattern.max_seq_len}"
        )


def _page_table(block_table: torch.Tensor, kv_heads: int, num_blocks: int | None = None):
    """vLLM's (requests, max_blocks) block table as s2attn's int32 (requests, kv_heads, blocks)
    page table over ``key_cache.flatten(0, 1)``: a (vLLM block b, KV head h) pair is page
    ``b * kv_heads + h`` (flattening is a view, since a block's heads are consecutive)."""
    heads = torch.arange(kv_heads, device=block_table.device, dtype=torch.int64)
    table = block_table[:, :num_blocks].to(torch.int64)[:, None, :] * kv_heads
    return (table + heads[None, :, None]).to(torch.int32).contiguous()


def _slots(pos: torch.Tensor, table: torch.Tensor, page: int):
    """(vLLM blocks, rows in them) of a request's token positions ``pos``, given its table row."""
    table = table.to(torch.int64)
    return table[(pos // page).to(table.device)], (pos % page).to(table.device)


def paged_decode_triton(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    pattern: BlockPattern,
    softmax_scale: float,
) -> torch.Tensor:
    """One new token per request through s2attn's Triton decode kernel, over vLLM's pages.

    Args:
        query: (requests, heads, dim): each request's newest token, already written to the cache.
        kv_cache: vLLM's (num_blocks, kv_heads, page, 2 * dim) cache with ``page ==
            pattern.block_size``.
        block_table: (requests, max_blocks) int, vLLM's block of each page.
        seq_lens: (requests,) int, each request's length with the new token.
        pattern, softmax_scale: as :func:`paged_attention_torch`.

    Returns (requests, heads, dim) in query's dtype. Runs on a CUDA GPU, or on the CPU under
    ``TRITON_INTERPRET=1``. The kernel reads, per (request, KV head), only the pages its decode
    layout lists for the query's block.
    """
    from ..ops import dispatch  # imports Triton: only this path needs it

    key_cache, value_cache = split_kv_cache(kv_cache)
    num_blocks, kv_heads, page, dim = key_cache.shape
    if page != pattern.block_size:
        raise ValueError(
            f"the Triton decode path needs vLLM's page ({page} tokens) to equal the pattern's "
            f"block ({pattern.block_size})"
        )
    # Pages keep their strides (2 * page * dim) in the flattened view.
    k_pages, v_pages = key_cache.flatten(0, 1), value_cache.flatten(0, 1)
    page_table = _page_table(block_table, kv_heads, -(-int(seq_lens.max()) // page))
    layout = decode_layout(pattern, kv_heads, query.device)
    out, _ = dispatch.decode(
        query[:, None],
        k_pages,
        v_pages,
        page_table,
        seq_lens.to(torch.int32),
        layout,
        softmax_scale=softmax_scale,
    )
    return out[:, 0]
