"""vLLM's KV cache for S2 layers: a KV-cache spec type and its manager, which free every page no
KV head of the group's layers reads again.

vLLM (0.26 and later) groups layers by their ``KVCacheSpec`` and gives each group a
``SingleTypeKVCacheManager`` from ``vllm.v1.kv_cache_spec_registry``; managers free a request's
pages through ``remove_skipped_blocks`` before each allocation, replacing them with vLLM's null
block, as the sliding-window manager does. An S2 layer's keys are read by a KV head while its
pattern keeps them: the local window, then the stripes (``(block + offset) % stride == 0``), and
strides are absolute, so a block outside the window whose residue no head keeps is dead for good
(the pattern is KV-efficient). :class:`S2AttentionSpec` carries, per pattern block, the last query
block that reads it in any KV head of any layer of the group (the union over heads of
:func:`s2attn.inference.eviction.kv_last_use`); :class:`S2AttentionManager` frees a block's pages
once every query still to come lies past that. With GQA, the union over KV heads keeps about
``min(kv_heads, stride) / stride`` of the blocks behind the window.

Where each KV head has one stripe residue, an S2 layer keeps its heads' stripes apart instead: a
stripe layer beside it has a group of :class:`S2StripeSpec` (one page per stripe period, holding
per KV head the one block of the period that head keeps; :class:`S2StripeManager` keeps them
to the end), and the layer's own group then reads no head's stripes, so it frees every block
behind the local window (``window_last_read``).

What stays correct:

* chunked prefill and decode free on vLLM's processed-token count, so no scheduled query reads a
  freed page;
* preemption (recompute) frees the whole request and starts it again from its first token;
* prefix caching: S2 groups never report a hit, and never hash their pages, so a freed page is
  never handed to another request as cached (a hybrid model's hit is the minimum over its groups:
  with S2 layers no request starts from the cache);
* finished requests free every page they still hold (the base class does).

Dense layers keep vLLM's full-attention spec; :func:`register` adds the S2 type to the registry
after vLLM's own (the registry fills itself with the built-in types only while it is empty).
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Sequence
from typing import Self

import torch
from vllm.v1.core.single_type_kv_cache_manager import SingleTypeKVCacheManager
from vllm.v1.kv_cache_interface import AttentionSpec, FullAttentionSpec, KVCacheSpec
from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

from ..inference.eviction import EvictionSchedule
from ..pattern import BlockPattern
from .vllm_paged import StripeLayout, window_last_read

__all__ = [
    "S2AttentionManager",
    "S2AttentionSpec",
    "S2StripeManager",
    "S2StripeSpec",
    "dead_from",
    "peak_pages_per_request",
    "register",
    "s2_kv_cache_spec",
    "stripe_kv_cache_spec",
]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def dead_from(last_read: Sequence[int]) -> list[int]:
    """Per pattern block, the first query block from which no query reads it and its tokens are
    all computed: ``max(last_read[j], j) + 1`` (a block is freed only once the sequence is past
    it, even where the pattern reads it earlier or never)."""
    return [max(last, j) + 1 for j, last in enumerate(last_read)]


def peak_pages_per_request(
    last_read: Sequence[int],
    pattern_block: int,
    page: int,
    max_model_len: int,
    max_in_flight_tokens: int,
) -> int:
    """The most pages of ``page`` tokens one request of an S2 group holds at once.

    At a processed length ``n`` (query block ``q = n // pattern_block``), a request holds the live
    pattern blocks before ``q`` whole, and every page from ``q``'s first to the last of the
    ``max_in_flight_tokens`` scheduled past ``n`` (vLLM frees on the processed count, so in-flight
    steps keep theirs). The maximum over ``n``, never more than the dense ``max_model_len``'s.
    """
    per_block = pattern_block // page
    dead_by = [0] * (len(last_read) + 2)  # blocks dead from each query block on, cumulated
    for first in dead_from(last_read):
        dead_by[min(first, len(dead_by) - 1)] += 1
    for q in range(1, len(dead_by)):
        dead_by[q] += dead_by[q - 1]
    peak = 0
    for q in range(_cdiv(max_model_len, pattern_block)):
        live_before = q - dead_by[min(q, len(dead_by) - 1)]
        last_slot = min((q + 1) * pattern_block - 1 + max_in_flight_tokens, max_model_len)
        peak = max(peak, live_before * per_block + _cdiv(last_slot, page) - q * per_block)
    return min(peak, _cdiv(max_model_len, page))


@dataclasses.dataclass(frozen=True, kw_only=True)
class S2AttentionSpec(AttentionSpec):
    """The KV cache of S2 layers: vLLM's pages (``block_size`` tokens, the full-attention layout)
    of which a request keeps only those some query still to come reads.

    Fields beyond vLLM's: ``pattern_block_size`` (the pattern's block, a multiple of the page),
    ``last_read`` (per pattern block, the last query block that reads it in any KV head of the
    group's layers; -1 for none), and the engine's ``max_model_len`` and ``max_in_flight_tokens``,
    which bound the pages a request holds at once (the admission and start-up sizes).
    """

    pattern_block_size: int
    last_read: tuple[int, ...]
    max_model_len: int
    max_in_flight_tokens: int

    def max_admission_blocks_per_request(
        self, max_in_flight_tokens: int, max_model_len: int
    ) -> int:
        return peak_pages_per_request(
            self.last_read,
            self.pattern_block_size,
            self.block_size,
            max_model_len,
            max_in_flight_tokens,
        )

    def max_memory_usage_bytes(self, vllm_config) -> int:
        pages = self.max_admission_blocks_per_request(
            vllm_config.max_in_flight_tokens, vllm_config.model_config.max_model_len
        )
        return pages * self.page_size_bytes

    @classmethod
    def merge(cls, specs: list[Self]) -> Self:
        """One spec for a group's layers: a block lives while any layer's heads read it.

        vLLM also calls this on the first layer's spec with every layer's, to learn whether the
        model's specs are uniform, and takes an ``AssertionError`` for "no" (its own specs answer
        so): a model whose first layer is S2 and another dense. Raised explicitly, so that it
        survives ``python -O``."""
        first = specs[0]
        for spec in specs[1:]:
            if not isinstance(spec, S2AttentionSpec):
                raise AssertionError(f"not all layers are S2 layers: {type(spec).__name__}")
            if dataclasses.replace(spec, last_read=first.last_read) != first:
                raise AssertionError(
                    f"S2 layers of one KV cache group differ in more than their patterns: "
                    f"{spec} and {first}"
                )
        last_read = tuple(max(reads) for reads in zip(*(s.last_read for s in specs)))
        return dataclasses.replace(first, last_read=last_read)


class _NoPrefixCache:
    """A manager that never serves or records prefix-cache hits: a page an S2 group frees (or a
    stripe page that holds only some positions) must never come back as another request's hit."""

    def cache_blocks(
        self,
        request,
        num_tokens: int,
        retention_interval: int | None = None,
        *,
        replay_boundaries: Sequence[int] = (),  # vLLM 0.32's
    ) -> None:
        return None

    def get_num_common_prefix_blocks(self, running_request_id: str) -> int:
        return 0

    @classmethod
    def find_longest_cache_hit(
        cls,
        block_hashes,
        max_length: int,
        kv_cache_group_ids: list[int],
        block_pool,
        kv_cache_spec: KVCacheSpec,
        drop_eagle_block: bool,
        alignment_tokens: int,
        dcp_world_size: int = 1,
        pcp_world_size: int = 1,
    ):
        return tuple([] for _ in kv_cache_group_ids), 0


class S2AttentionManager(_NoPrefixCache, SingleTypeKVCacheManager):
    """Frees, before each allocation, the pages of the pattern blocks no query still to come reads
    (:class:`S2AttentionSpec`); never serves or records prefix-cache hits."""

    def __init__(self, kv_cache_spec: S2AttentionSpec, **kwargs) -> None:
        # vLLM passes an admission cap only to the types it knows recycle blocks (sliding window,
        # chunked local); without one, admission would reserve a dense request's pages.
        kwargs["max_admission_blocks_per_request"] = kv_cache_spec.max_admission_blocks_per_request(
            kv_cache_spec.max_in_flight_tokens, kv_cache_spec.max_model_len
        )
        super().__init__(kv_cache_spec, **kwargs)
        if kv_cache_spec.pattern_block_size % self.block_size:
            raise ValueError(
                f"the S2 block_size {kv_cache_spec.pattern_block_size} is not a multiple of the "
                f"KV cache group's page of {self.block_size} tokens"
            )
        self._pages_per_block = kv_cache_spec.pattern_block_size // self.block_size
        first = dead_from(kv_cache_spec.last_read)
        self._by_death = sorted(range(len(first)), key=first.__getitem__)
        self._deaths = [first[j] for j in self._by_death]
        # Per request, the query block through which its dead pages are freed.
        self._freed_through: dict[str, int] = {}

    def remove_skipped_blocks(
        self,
        request_id: str,
        processed_computed_tokens: int,
        num_prompt_tokens: int | None = None,
    ) -> None:
        blocks = self.req_to_blocks.get(request_id)
        if not blocks:
            return
        query_block = processed_computed_tokens // self.kv_cache_spec.pattern_block_size
        done = self._freed_through.get(request_id, 0)
        if query_block <= done:
            return
        lo = bisect.bisect_right(self._deaths, done)
        hi = bisect.bisect_right(self._deaths, query_block)
        freed = []
        for j in self._by_death[lo:hi]:
            for i in range(j * self._pages_per_block, (j + 1) * self._pages_per_block):
                if i < len(blocks) and not blocks[i].is_null:
                    freed.append(blocks[i])
                    blocks[i] = self._null_block
        self._freed_through[request_id] = query_block
        if freed:
            self.block_pool.free_blocks(freed)

    def pop_blocks_for_free(self, request_id: str):
        self._freed_through.pop(request_id, None)
        return super().pop_blocks_for_free(request_id)


@dataclasses.dataclass(frozen=True, kw_only=True)
class S2StripeSpec(AttentionSpec):
    """The stripes of S2 layers whose KV heads each keep their own: one page per stripe period
    (``block_size`` = ``period`` pattern blocks of tokens) holding, per KV head, the one block of
    the period that the head keeps (the block whose index is the head's offset modulo the
    period). A page of this group has the bytes of one pattern block of every KV head, as the
    window group's pages do (vLLM pools pages of one size).

    Fields beyond vLLM's: ``pattern_block_size``, ``period`` (in pattern blocks),
    ``window_last_read`` (the partner window spec's, so that vLLM groups and pairs these specs
    as it does their layers'), ``max_model_len`` and ``max_in_flight_tokens``.
    """

    pattern_block_size: int
    period: int
    window_last_read: tuple[int, ...]
    max_model_len: int
    max_in_flight_tokens: int

    @property
    def real_page_size_bytes(self) -> int:
        return (
            2
            * self.pattern_block_size
            * self.num_kv_heads
            * self.head_size
            * _dtype_bytes(self.dtype)
        )

    @property
    def unpadded_page_size_bytes(self) -> int:
        return self.real_page_size_bytes

    @property
    def page_size_bytes(self) -> int:
        return self.real_page_size_bytes

    def max_admission_blocks_per_request(
        self, max_in_flight_tokens: int, max_model_len: int
    ) -> int:
        # Stripes are read to the end: a request holds a page of every period it has reached.
        return _cdiv(max_model_len, self.block_size)

    def max_memory_usage_bytes(self, vllm_config) -> int:
        pages = self.max_admission_blocks_per_request(
            vllm_config.max_in_flight_tokens, vllm_config.model_config.max_model_len
        )
        return pages * self.page_size_bytes

    @classmethod
    def merge(cls, specs: list[Self]) -> Self:
        first = specs[0]
        for spec in specs[1:]:
            if spec != first:
                raise AssertionError(f"stripe specs of one group differ: {spec} and {first}")
        return first


class S2StripeManager(_NoPrefixCache, SingleTypeKVCacheManager):
    """A stripe group's pages: one per period reached, kept until the request ends."""

    def __init__(self, kv_cache_spec: S2StripeSpec, **kwargs) -> None:
        kwargs["max_admission_blocks_per_request"] = kv_cache_spec.max_admission_blocks_per_request(
            kv_cache_spec.max_in_flight_tokens, kv_cache_spec.max_model_len
        )
        super().__init__(kv_cache_spec, **kwargs)

    def remove_skipped_blocks(
        self,
        request_id: str,
        processed_computed_tokens: int,
        num_prompt_tokens: int | None = None,
    ) -> None:
        return None


def register() -> None:
    """Add :class:`S2AttentionSpec` and its manager to vLLM's registry, after vLLM's own types.

    The registry registers its built-in types on the first lookup, and only while it is empty;
    the lookup here makes it do so before the S2 type enters. Safe to call again."""
    KVCacheSpecRegistry.check_kv_cache_spec_registry({})
    KVCacheSpecRegistry.register(S2AttentionSpec, S2AttentionManager)
    KVCacheSpecRegistry.register(S2StripeSpec, S2StripeManager)


def s2_kv_cache_spec(
    spec: KVCacheSpec | None,
    pattern: BlockPattern,
    num_kv_heads: int,
    vllm_config,
    stripes: StripeLayout | None = None,
) -> KVCacheSpec | None:
    """An S2 layer's spec: ``spec`` (vLLM's full-attention spec for the layer) as an
    :class:`S2AttentionSpec` when the pattern frees blocks, else ``spec`` unchanged (a dense
    pattern; or vLLM's hybrid KV cache manager turned off, which serves one spec type only).
    With ``stripes``, the window group's: each KV head's stripe blocks are read from the layer's
    stripe group (:func:`stripe_kv_cache_spec`)."""
    if type(spec) is not FullAttentionSpec:
        return spec
    if vllm_config.scheduler_config.disable_hybrid_kv_cache_manager:
        return spec
    schedule = EvictionSchedule(pattern, num_kv_heads, pattern.num_kv_blocks)
    if not schedule.evicts:
        return spec
    register()
    return S2AttentionSpec(
        **_attention_fields(spec),
        pattern_block_size=pattern.block_size,
        last_read=window_last_read(pattern, num_kv_heads, stripes),
        max_model_len=vllm_config.model_config.max_model_len,
        max_in_flight_tokens=vllm_config.max_in_flight_tokens,
    )


def stripe_kv_cache_spec(
    spec: FullAttentionSpec,
    pattern: BlockPattern,
    num_kv_heads: int,
    vllm_config,
    stripes: StripeLayout,
) -> S2StripeSpec:
    """The stripe group's spec of an S2 layer whose window spec ``s2_kv_cache_spec(spec,
    pattern, num_kv_heads, vllm_config, stripes)`` gives."""
    register()
    fields = {**_attention_fields(spec), "block_size": stripes.period * pattern.block_size}
    if "tokens_per_state" in fields:  # vLLM 0.32 lays a page out by its states: a block a head
        fields["tokens_per_state"] = stripes.period
    return S2StripeSpec(
        **fields,
        pattern_block_size=pattern.block_size,
        period=stripes.period,
        window_last_read=window_last_read(pattern, num_kv_heads, stripes),
        max_model_len=vllm_config.model_config.max_model_len,
        max_in_flight_tokens=vllm_config.max_in_flight_tokens,
    )


def _attention_fields(spec: KVCacheSpec) -> dict:
    return {f.name: getattr(spec, f.name) for f in dataclasses.fields(AttentionSpec) if f.init}
