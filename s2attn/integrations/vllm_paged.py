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
  GPU), each request's pages gathered into one prefix per KV head first. The GPU's prefill.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from dataclasses import dataclass

import torch

from ..attention import sparse_attention
from ..inference.decode_plan import DecodePlan, split_count
from ..inference.decode_step import attend
from ..inference.eviction import EvictionSchedule
from ..ops.cpu import paged_attention as paged_attention_reference
from ..ops.decode_layout import decode_layout, group_block_mask
from ..ops.dispatch import decode_page_tables, write_pages
from ..pattern import BlockPattern

__all__ = [
    "KV_PAGES",
    "KV_PAGES_ENV",
    "DecodeBuffers",
    "MixedDecodes",
    "PagedDecodeBatch",
    "StripeLayout",
    "decode_splits",
    "kv_head_pages",
    "mixed_decodes",
    "paged_attention_torch",
    "paged_decode_triton",
    "paged_prefill",
    "split_kv_cache",
    "stripe_layout",
    "stripe_pages",
    "window_last_read",
    "write_decode_kv",
    "write_kv",
    "write_stripes",
]


# How S2 layers keep their KV pages in vLLM: "per-head" (the default where it applies: each KV
# head keeps its own stripes, in a stripe group beside the window group) or "union" (one group
# per layer, freeing the blocks no KV head reads). For comparisons; read when the model is built.
KV_PAGES_ENV = "S2ATTN_VLLM_KV_PAGES"
KV_PAGES = ("per-head", "union")


@dataclass(frozen=True)
class StripeLayout:
    """Per KV head, the block of each stripe period that the layer's stripe group keeps for it.

    ``period`` is in pattern blocks; KV head ``h`` keeps block ``j`` in the stripe group when
    ``j % period == offsets[h]``, and reads every other block from the window group."""

    period: int
    offsets: tuple[int, ...]

    def offsets_on(self, device) -> torch.Tensor:
        """``offsets`` as an int64 tensor on ``device``: made before a CUDA graph is captured,
        since the copy from the host cannot be captured."""
        return torch.tensor(self.offsets, dtype=torch.int64, device=device)


def stripe_layout(pattern: BlockPattern, num_kv_heads: int, period: int) -> StripeLayout | None:
    """Each KV head's offset: the residue modulo ``period`` of most of the blocks it reads to
    the pattern's end (its stripe). None when the pattern frees nothing or spans under two
    periods (the union over KV heads then costs as little)."""
    if period < 2 or pattern.num_kv_blocks < 2 * period:
        return None
    schedule = EvictionSchedule(pattern, num_kv_heads, pattern.num_kv_blocks)
    if not schedule.evicts:
        return None
    read_to_end = schedule.last_use >= pattern.num_q_blocks - 1
    offsets = tuple(
        int(max(range(period), key=lambda r: int(row[r::period].sum()))) for row in read_to_end
    )
    return StripeLayout(period, offsets)


def window_last_read(pattern: BlockPattern, num_kv_heads: int, stripes: StripeLayout | None):
    """Per pattern block, the last query block that reads it from the window group: any KV
    head's read (the union), less each head's stripe blocks when ``stripes`` keeps them apart."""
    last = EvictionSchedule(pattern, num_kv_heads, pattern.num_kv_blocks).last_use.clone()
    if stripes is not None:
        for head, offset in enumerate(stripes.offsets):
            last[head, offset :: stripes.period] = -1
    return tuple(last.max(dim=0).values.tolist())


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
    """Store ``key``/``value`` (tokens, kv_heads, dim) at ``slot_mapping`` (tokens,).

    Slots of -1 (vLLM's padding) land in row 0 of vLLM's null block (block 0, which its block pool
    keeps for padding and never gives a request): skipping them would need their count on the
    host, a sync that a CUDA graph of the step cannot hold."""
    key_cache, value_cache = split_kv_cache(kv_cache)
    page = key_cache.shape[2]
    tokens = slot_mapping.shape[0]
    slots = slot_mapping.to(torch.int64).clamp(min=0)
    blocks, rows = slots // page, slots % page
    # Advanced indices on either side of a slice put the token axis first: (tokens, heads, dim).
    key_cache[blocks, :, rows] = key[:tokens].to(key_cache.dtype)
    value_cache[blocks, :, rows] = value[:tokens].to(value_cache.dtype)


def paged_attention_torch(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    page_table: torch.Tensor,
    query_start_loc: list[int],
    seq_lens: list[int],
    pattern: BlockPattern,
    softmax_scale: float,
) -> torch.Tensor:
    """Attention of each request's new queries over its cached keys, restricted to ``pattern``.

    Args:
        query: (tokens, heads, dim), the requests' new tokens packed in order.
        kv_cache: vLLM's (num_blocks, kv_heads, page, 2 * dim) cache, the new tokens already in it.
        page_table: int32 (requests, kv_heads, max_pages), per KV head the page of the flattened
            cache (``kv_cache.flatten(0, 1)``) holding each of its positions' page:
            :func:`kv_head_pages` of vLLM's block table, or :func:`stripe_pages`.
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
        page_table,
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
    page_table: torch.Tensor,
    query_start_loc: list[int],
    seq_lens: list[int],
    pattern: BlockPattern,
    softmax_scale: float,
    *,
    skip: frozenset[int] = frozenset(),
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """As :func:`paged_attention_torch`, through :func:`s2attn.sparse_attention`: per request, its
    pages are gathered, per KV head, into one (length, kv_heads, dim) prefix (one indexing of the
    pages for the keys, one for the values), the pages its pattern keeps for none of its new
    queries zeroed, and the new queries, its last positions, attend it. On a GPU this is the
    forward kernel; on the CPU the exact reference. Requests in ``skip`` are left out (their rows
    of ``out``, when given, untouched: :func:`paged_decode_triton` computes them)."""
    key_cache, value_cache = split_kv_cache(kv_cache)
    kv_heads, page = key_cache.shape[1], key_cache.shape[2]
    _kv_head_masks(query.shape[1], kv_heads, pattern)  # checks the heads before any work
    k_pages, v_pages = key_cache.flatten(0, 1), value_cache.flatten(0, 1)
    out = torch.empty_like(query) if out is None else out
    for r, length in enumerate(seq_lens):
        start, end = query_start_loc[r], query_start_loc[r + 1]
        if end == start or r in skip:
            continue
        _check_length(r, length, pattern)
        table = page_table[r, :, : -(-length // page)].to(torch.int64)
        kept = _kept_pages(pattern, kv_heads, length - (end - start), length, page, query.device)
        k = _gathered(k_pages, table, kept, length, query.dtype)
        v = _gathered(v_pages, table, kept, length, query.dtype)
        q = query[start:end][None]
        out[start:end] = sparse_attention(q, k, v, pattern, softmax_scale=softmax_scale)[0]
    return out


def _gathered(pages, table, kept, length: int, dtype: torch.dtype) -> torch.Tensor:
    """A request's (1, length, kv_heads, dim) keys or values from ``pages`` through its (kv_heads,
    pages) ``table``, a strided view of one gathered copy. Pages not ``kept`` are zeroed: they
    may hold anything (vLLM's null block, another request's tokens), and a kernel tile wider than
    a pattern block loads them beside a kept block, scoring them at weight zero, which a NaN there
    would still turn into NaN."""
    rows = pages[table].to(dtype)  # (kv_heads, pages, page, dim)
    rows.masked_fill_(~kept[:, :, None, None], 0)
    return rows.flatten(1, 2).transpose(0, 1)[None, :length]


# Per pattern, the last few (queries, length) spans' kept pages: a step's S2 layers share their
# pattern and ask for the same spans in turn.
_KEPT: weakref.WeakKeyDictionary[BlockPattern, OrderedDict] = weakref.WeakKeyDictionary()
_KEPT_SPANS = 16


def _kept_pages(pattern, kv_heads: int, first_query: int, length: int, page: int, device):
    """(kv_heads, pages) bool on ``device``: whether the pattern keeps each page's block for some
    query at positions ``[first_query, length)``, per KV head."""
    key = (kv_heads, first_query, length, page, str(device))
    spans = _KEPT.setdefault(pattern, OrderedDict())
    if key in spans:
        spans.move_to_end(key)
        return spans[key]
    block = pattern.block_size
    _, masks = _kv_head_masks(pattern.num_heads, kv_heads, pattern)
    q_blocks = slice(first_query // block, (length - 1) // block + 1)
    kept = masks[:, :, q_blocks, : q_blocks.stop].any(dim=2).any(dim=1)
    kept = kept.repeat_interleave(block // page, dim=1)[:, : -(-length // page)].to(device)
    spans[key] = kept
    if len(spans) > _KEPT_SPANS:
        spans.popitem(last=False)
    return kept


# Per pattern and KV head count, its group_block_mask: seconds to build at 128k, and a model's
# S2 layers ask for it in every prefill chunk.
_GROUP_MASKS: weakref.WeakKeyDictionary[BlockPattern, dict[int, torch.Tensor]] = (
    weakref.WeakKeyDictionary()
)


def _kv_head_masks(num_heads: int, kv_heads: int, pattern: BlockPattern):
    """(query heads per KV head, the pattern per KV head as ``group_block_mask`` gives it)."""
    if num_heads % kv_heads:
        raise ValueError(f"query heads ({num_heads}) must be a multiple of KV heads ({kv_heads})")
    masks = _GROUP_MASKS.setdefault(pattern, {})
    if kv_heads not in masks:
        masks[kv_heads] = group_block_mask(pattern, kv_heads)
    return num_heads // kv_heads, masks[kv_heads]


def _check_length(request: int, length: int, pattern: BlockPattern) -> None:
    if length > pattern.max_seq_len:
        raise ValueError(
            f"request {request} holds {length} tokens, past the pattern's max_seq_len "
            f"{pattern.max_seq_len}"
        )


def kv_head_pages(block_table: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """vLLM's (requests, max_blocks) block table, or a (requests, kv_heads, max_blocks) table of
    each KV head's vLLM blocks, as s2attn's int32 (requests, kv_heads, blocks) page table over
    ``key_cache.flatten(0, 1)``: a (vLLM block b, KV head h) pair is page ``b * kv_heads + h``
    (flattening is a view, since a block's heads are consecutive)."""
    if block_table.dim() == 2:
        block_table = block_table[:, None, :]
    heads = torch.arange(kv_heads, device=block_table.device, dtype=torch.int32)
    table = block_table.to(torch.int32) * kv_heads
    return (table + heads[None, :, None]).contiguous()


def stripe_pages(
    window_table: torch.Tensor, stripe_table: torch.Tensor, period: int, offsets: torch.Tensor
) -> torch.Tensor:
    """The per-KV-head page table of a layer whose KV heads keep their stripes apart: KV head
    ``h`` reads block ``j`` from the stripe group's page of ``j``'s period when ``j % period ==
    offsets[h]`` (:func:`write_stripes` stored it there), from the window group's page of ``j``
    otherwise. Both tables are vLLM's, of the two groups, whose pages share one tensor;
    ``offsets`` (kv_heads,) int64 on their device (:meth:`StripeLayout.offsets_on`). No host
    sync or copy: a CUDA graph holds it."""
    kv_heads = offsets.shape[0]
    device = window_table.device
    blocks = torch.arange(window_table.shape[1], device=device)
    in_stripe = (blocks[None, :] % period) == offsets[:, None]  # (kv_heads, width)
    periods = (blocks // period).clamp(max=stripe_table.shape[1] - 1)
    blocks_of = torch.where(
        in_stripe[None], stripe_table[:, periods][:, None, :], window_table[:, None, :]
    )
    return kv_head_pages(blocks_of, kv_heads)


def write_stripes(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    stripe_slots: torch.Tensor,
    period: int,
    offsets: torch.Tensor,
) -> None:
    """Store each KV head's keys and values of its stripe blocks in the stripe group's pages.

    ``stripe_slots`` is vLLM's slot mapping of the stripe group (a page per period of
    ``period * page`` tokens): a token at offset ``o`` of its period belongs to block ``o //
    page`` of the period, which KV head ``h`` keeps when that is ``offsets[h]``; it goes to row
    ``o % page`` of the head's part of the period's page. The other heads' writes land in vLLM's
    null block (as padding's do, :func:`write_kv`): a write per (token, KV head), no host sync."""
    key_cache, value_cache = split_kv_cache(kv_cache)
    page = key_cache.shape[2]
    tokens = stripe_slots.shape[0]
    slots = stripe_slots.to(torch.int64)
    period_tokens = period * page
    pages, offset = slots.clamp(min=0) // period_tokens, slots.clamp(min=0) % period_tokens
    kept = ((offset // page)[:, None] == offsets[None, :]) & (slots >= 0)[:, None]
    dest = torch.where(kept, pages[:, None], 0)  # (tokens, kv_heads)
    heads = torch.arange(offsets.shape[0], device=slots.device)[None, :]
    rows = (offset % page)[:, None]
    key_cache[dest, heads, rows] = key[:tokens].to(key_cache.dtype)
    value_cache[dest, heads, rows] = value[:tokens].to(value_cache.dtype)


class DecodeBuffers:
    """A KV-cache group's decode steps: the decode kernel's split counters, allocated once, and
    each step's batch composed on the device from vLLM's block tables and lengths.

    vLLM replays CUDA graphs of its decode steps, and a graph reads the addresses it captured:
    vLLM keeps its block tables and lengths in tensors of fixed addresses (its own attention
    backends read them inside its graphs), :meth:`batch` composes from them with no host sync
    (one launch), and the counters are these same tensors at every step.

    Args:
        max_requests: the most requests of one step (vLLM's ``max_num_seqs``).
        num_kv_heads: the layers' KV heads.
        device: the pages' device.
    """

    def __init__(self, max_requests: int, num_kv_heads: int, device: torch.device) -> None:
        self.num_kv_heads = num_kv_heads
        # The kernel's count of finished splits per (request, KV head), zero between launches: the
        # layers of a group launch one after another, so they share it.
        self.split_counters = torch.zeros(
            max_requests * num_kv_heads, dtype=torch.int32, device=device
        )

    def batch(
        self,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        stripe_table: torch.Tensor | None = None,
        stripes: StripeLayout | None = None,
        offsets: torch.Tensor | None = None,
    ) -> PagedDecodeBatch:
        """This step's batch: ``block_table`` int32 (requests, width) and ``seq_lens``
        (requests,), each request's length with its new token; with ``stripes``, the stripe
        group's ``stripe_table`` and the layer's ``offsets`` (:meth:`StripeLayout.offsets_on`) as
        :func:`stripe_pages` composes them. All on the buffers' device.

        vLLM pads a graph's batch with requests of length 0: their rows of the batch's table
        read its null block (block 0, which no request owns) whatever their rows of vLLM's
        tables hold, and their length is raised to 1, so the kernel reads one position of a real
        page for them and their token is written there; vLLM drops their outputs."""
        requests = block_table.shape[0]
        if requests * self.num_kv_heads > self.split_counters.shape[0]:
            raise ValueError(
                f"a step of {requests} requests exceeds the decode buffers' "
                f"{self.split_counters.shape[0] // self.num_kv_heads}"
            )
        period = 0 if stripes is None else stripes.period
        table, lengths, positions = decode_page_tables(
            block_table,
            seq_lens,
            self.num_kv_heads,
            stripe_table if stripes is not None else None,
            period,
            offsets,
        )
        counters = self.split_counters[: requests * self.num_kv_heads]
        return PagedDecodeBatch(table, lengths, positions, counters)


@dataclass(frozen=True)
class PagedDecodeBatch:
    """One decode step of vLLM's requests as the decode kernel reads it
    (:meth:`DecodeBuffers.batch`).

    Attributes:
        page_table: int32 (requests, kv_heads, max_blocks), pages of the flattened cache.
        seq_lens: int32 (requests,), each request's length with its new token (at least 1).
        positions: int32 (requests,), its new token's position (``seq_lens - 1``).
        split_counters: int32 (requests * kv_heads,), zero between launches.
    """

    page_table: torch.Tensor
    seq_lens: torch.Tensor
    positions: torch.Tensor
    split_counters: torch.Tensor


@dataclass(frozen=True)
class MixedDecodes:
    """The single-token requests of a step that also prefills: the decode kernel computes them
    (:func:`mixed_decodes`), for the forward kernel over a gathered copy of their whole past
    would read each request's every page, per layer and step.

    Attributes:
        requests: int64 (n,) their indices in the step, on the device; ``host`` the same set.
        tokens: int64 (n,) their query rows.
        seq_lens, positions, split_counters: as :class:`PagedDecodeBatch`'s for them.
    """

    requests: torch.Tensor
    tokens: torch.Tensor
    seq_lens: torch.Tensor
    positions: torch.Tensor
    split_counters: torch.Tensor
    host: frozenset[int]

    def batch(self, page_table: torch.Tensor) -> PagedDecodeBatch:
        """Their decode batch, given the step's (requests, kv_heads, blocks) page table."""
        return PagedDecodeBatch(
            page_table[self.requests], self.seq_lens, self.positions, self.split_counters
        )


def mixed_decodes(
    query_start_loc: list[int], seq_lens: list[int], num_kv_heads: int, device
) -> MixedDecodes | None:
    """The step's requests of one new token, as :class:`MixedDecodes` (None if there are none).

    Every S2 group's builder asks with the same step's lists: the last answer is kept and given
    again for equal lists (the split counters too: every layer of every group launches in turn on
    one stream, and the kernel leaves them zero), and one copy to the device carries the four
    index tensors."""
    key = (tuple(query_start_loc), tuple(seq_lens), num_kv_heads, str(device))
    if _LAST_MIXED and _LAST_MIXED[0] == key:
        return _LAST_MIXED[1]
    rows = [r for r in range(len(seq_lens)) if query_start_loc[r + 1] - query_start_loc[r] == 1]
    mixed = None
    if rows:
        lengths = [seq_lens[r] for r in rows]
        starts = [query_start_loc[r] for r in rows]
        host = torch.tensor([rows, starts, lengths, [n - 1 for n in lengths]], dtype=torch.int64)
        requests, tokens, lengths_on, positions = host.to(device)
        mixed = MixedDecodes(
            requests=requests,
            tokens=tokens,
            seq_lens=lengths_on.to(torch.int32),
            positions=positions.to(torch.int32),
            split_counters=torch.zeros(len(rows) * num_kv_heads, dtype=torch.int32, device=device),
            host=frozenset(rows),
        )
    _LAST_MIXED[:] = [key, mixed]
    return mixed


_LAST_MIXED: list = []  # [key, MixedDecodes | None] of mixed_decodes' last step


def write_decode_kv(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, batch: PagedDecodeBatch
) -> None:
    """Store a decode step's new keys and values, (requests, kv_heads, dim), one token per
    request, through the batch's per-KV-head page table: each (token, KV head) lands in the page
    that the decode kernel reads it from (for :func:`stripe_pages`' table, a head's stripe block
    in its stripe page alone), in one launch where :func:`write_kv` and :func:`write_stripes`
    take a dozen small ones. Padding requests write their null block."""
    key_cache, value_cache = split_kv_cache(kv_cache)
    requests = batch.positions.shape[0]
    write_pages(
        key[:requests, None],
        value[:requests, None],
        key_cache.flatten(0, 1),
        value_cache.flatten(0, 1),
        batch.page_table,
        batch.positions,
    )


def decode_splits(pattern: BlockPattern, num_kv_heads: int, requests: int, device) -> int:
    """The decode kernel's programs per (request, KV head) for a step of ``requests``: from the
    longest list of the whole pattern, so that one count serves every length (a CUDA graph of the
    step is replayed at every length)."""
    layout = decode_layout(pattern, num_kv_heads, device)
    return split_count(
        [int(layout.list_lengths.max())],
        None,
        block_size=pattern.block_size,
        batch=requests,
        num_kv_heads=num_kv_heads,
        device=torch.device(device),
    )


def paged_decode_triton(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    batch: PagedDecodeBatch,
    pattern: BlockPattern,
    softmax_scale: float,
    *,
    num_splits: int | None = None,
) -> torch.Tensor:
    """One new token per request through s2attn's Triton decode kernel, over vLLM's pages.

    Args:
        query: (requests, heads, dim): each request's newest token, already written to the cache.
        kv_cache: vLLM's (num_blocks, kv_heads, page, 2 * dim) cache with ``page ==
            pattern.block_size``.
        batch: the step's page table, lengths and split counters (:meth:`DecodeBuffers.batch`).
        pattern, softmax_scale: as :func:`paged_attention_torch`.
        num_splits: the kernel's split count (default :func:`decode_splits`'s).

    Returns (requests, heads, dim) in query's dtype. Runs on a CUDA GPU, or on the CPU under
    ``TRITON_INTERPRET=1``; no host sync, so a CUDA graph can hold it. The kernel reads, per
    (request, KV head), only the pages its decode layout lists for the query's block.
    """
    key_cache, value_cache = split_kv_cache(kv_cache)
    kv_heads, page = key_cache.shape[1], key_cache.shape[2]
    if page != pattern.block_size:
        raise ValueError(
            f"the Triton decode path needs vLLM's page ({page} tokens) to equal the pattern's "
            f"block ({pattern.block_size})"
        )
    requests = query.shape[0]
    if num_splits is None:
        num_splits = decode_splits(pattern, kv_heads, requests, query.device)
    # Pages keep their strides (2 * page * dim) in the flattened view.
    plan = DecodePlan.build(
        key_cache.flatten(0, 1),
        value_cache.flatten(0, 1),
        batch.page_table,
        batch.seq_lens,
        batch.split_counters,
        pattern,
        num_splits,
    )
    out, _ = attend(query[:, None], plan, softmax_scale=softmax_scale)
    return out[:, 0]
