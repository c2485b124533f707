"""vLLM's attention backend for S2 layers: its metadata, metadata builder and implementation,
over vLLM's paged KV cache in the head-major layout (:mod:`s2attn.integrations.vllm_paged`), and
the stripe layers of S2 layers whose KV heads keep their stripes apart. The plugin
(:mod:`s2attn.integrations.vllm`) builds S2 layers on them.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import ClassVar

import torch
import vllm
from vllm.config import VllmConfig, get_current_vllm_config, get_layers_from_vllm_config
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.attention import Attention
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)
from vllm.v1.kv_cache_interface import AttentionSpec, KVCacheSpec

try:  # vLLM 0.32 names its KV cache layouts; 0.26 takes the shape from get_kv_cache_shape
    from vllm.v1.kv_cache_interface import KVCacheLayout
except ImportError:
    KVCacheLayout = None

from ..pattern import BlockPattern
from . import vllm_kv
from .vllm_paged import (
    KV_PAGES_ENV,
    DecodeBuffers,
    MixedDecodes,
    PagedDecodeBatch,
    StripeLayout,
    decode_splits,
    kv_head_pages,
    mixed_decodes,
    paged_attention_torch,
    paged_decode_triton,
    paged_prefill,
    stripe_pages,
    write_decode_kv,
    write_kv,
    write_stripes,
)

__all__ = [
    "BACKEND_NAME",
    "S2AttentionBackend",
    "S2AttentionImpl",
    "S2AttentionMetadata",
    "S2AttentionMetadataBuilder",
    "S2StripeBackend",
    "stripe_backend",
]

# vLLM's enum member for out-of-tree backends (0.26 takes no new names; 0.32 would).
BACKEND_NAME = "CUSTOM"


# ------------------------------------------------------------------------------ backend
@dataclasses.dataclass
class S2AttentionMetadata:
    """One step's requests as the S2 layers read them.

    A step of one new token per request on a GPU, with vLLM's page equal to the pattern's block,
    carries ``decode`` (the group's :class:`DecodeBuffers`, from which its first layer composes
    the step's batch on the device, inside a CUDA graph of the step) and no host copies. Any
    other step carries host copies of the per-request offsets and lengths, which its paths loop
    over."""

    num_actual_tokens: int
    max_query_len: int
    query_start_loc: torch.Tensor  # (requests + 1,) int32
    seq_lens: torch.Tensor  # (requests,) int32
    block_table: torch.Tensor  # (requests, max_blocks) int32
    slot_mapping: torch.Tensor  # (tokens,) int64
    decode: DecodeBuffers | None = None
    query_start_loc_host: list[int] | None = None
    seq_lens_host: list[int] | None = None
    mixed: MixedDecodes | None = None  # a prefill step's single-token requests, on a GPU
    # Per stripe offsets (None: no stripes), the page table or decode batch over them: the
    # group's layers share this metadata, and the first layer of each composes it for the rest.
    stripe_tables: dict[tuple[int, ...], torch.Tensor] = dataclasses.field(default_factory=dict)
    decode_batches: dict[tuple[int, ...] | None, PagedDecodeBatch] = dataclasses.field(
        default_factory=dict
    )


def _decodes_in_place(vllm_config: VllmConfig, kv_cache_spec: KVCacheSpec) -> bool:
    """Whether decode steps of this group run the decode kernel over vLLM's pages in place (a CUDA
    device, pages of the pattern's block): those steps hold no host sync, so CUDA graphs can."""
    device = vllm_config.device_config.device
    return (
        getattr(device, "type", device) == "cuda"
        and isinstance(kv_cache_spec, vllm_kv.S2AttentionSpec)
        and kv_cache_spec.pattern_block_size == kv_cache_spec.block_size
    )


class S2AttentionMetadataBuilder(AttentionMetadataBuilder[S2AttentionMetadata]):
    # Set per group by get_cudagraph_support: full CUDA graphs of batches of single-token decodes
    # where the decode kernel reads vLLM's pages in place; other steps run between vLLM's
    # piecewise graphs.
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER

    @classmethod
    def get_cudagraph_support(
        cls, vllm_config: VllmConfig, kv_cache_spec: AttentionSpec
    ) -> AttentionCGSupport:
        if _decodes_in_place(vllm_config, kv_cache_spec):
            return AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
        return AttentionCGSupport.NEVER

    def __init__(
        self,
        kv_cache_spec: AttentionSpec,
        layer_names: list[str],
        vllm_config: VllmConfig,
        device: torch.device,
    ) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        # vLLM settles the page (its kernel block size) only when it lays out the cache; this
        # is the first point where it is final, still before any request.
        page = kv_cache_spec.block_size
        for name, layer in get_layers_from_vllm_config(vllm_config, Attention, layer_names).items():
            block = getattr(layer.impl, "pattern", None)
            block = None if block is None else block.block_size
            if block is not None and block % page:
                raise ValueError(
                    f"layer {name}: the S2 block_size {block} is not a multiple of vLLM's KV "
                    f"page of {page} tokens: pass block_size={block} to LLM(...) (--block-size "
                    f"{block} for vllm serve)"
                )
        # Speculative decoding's optimistic lengths would make the host's copy inexact.
        self._exact_host_lengths = vllm_config.speculative_config is None
        self._decode_buffers = None
        if _decodes_in_place(vllm_config, kv_cache_spec):
            self._decode_buffers = DecodeBuffers(
                vllm_config.scheduler_config.max_num_seqs, kv_cache_spec.num_kv_heads, device
            )

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> S2AttentionMetadata:
        m = common_attn_metadata
        requests = m.num_reqs
        metadata = S2AttentionMetadata(
            num_actual_tokens=m.num_actual_tokens,
            max_query_len=m.max_query_len,
            query_start_loc=m.query_start_loc,
            seq_lens=m.seq_lens[:requests],
            block_table=m.block_table_tensor[:requests],
            slot_mapping=m.slot_mapping,
        )
        in_place = self._decode_buffers is not None
        if in_place and m.max_query_len == 1 and m.num_actual_tokens == requests:
            metadata.decode = self._decode_buffers
            return metadata
        metadata.query_start_loc_host = m.query_start_loc_cpu[: requests + 1].tolist()
        host_lengths = getattr(m, "seq_lens_cpu_upper_bound", None)
        if host_lengths is None or not self._exact_host_lengths:
            host_lengths = metadata.seq_lens.cpu()
        metadata.seq_lens_host = host_lengths[:requests].tolist()
        if in_place:
            metadata.mixed = mixed_decodes(
                metadata.query_start_loc_host,
                metadata.seq_lens_host,
                self.kv_cache_spec.num_kv_heads,
                self.device,
            )
        return metadata


def _metadata_of(layer: torch.nn.Module) -> S2AttentionMetadata | None:
    """The step's metadata of an attention layer (None in vLLM's profiling runs, and under
    speculative decoding's lists, which take the slot-mapping write)."""
    metadata = get_forward_context().attn_metadata
    if not isinstance(metadata, dict):
        return None
    return metadata.get(getattr(layer, "layer_name", None))


class S2AttentionImpl(AttentionImpl[S2AttentionMetadata]):
    """One S2 layer: writes its keys and values into vLLM's pages, attends through its pattern."""

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        alibi_slopes: list[float] | None = None,
        sliding_window: int | None = None,
        kv_cache_dtype: str = "auto",
        logits_soft_cap: float | None = None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
        s2_pattern: BlockPattern | None = None,
        sinks: torch.Tensor | None = None,
        stripes: StripeLayout | None = None,
    ) -> None:
        unsupported = {
            "alibi_slopes": alibi_slopes,
            "sliding_window": sliding_window,
            "logits_soft_cap": logits_soft_cap,
            "kv_sharing_target_layer_name": kv_sharing_target_layer_name,
            "sinks": sinks,
        }
        for name, value in unsupported.items():
            if value is not None:
                raise ValueError(f"S2 attention layers do not support {name} (got {value!r})")
        if attn_type != AttentionType.DECODER:
            raise ValueError(f"S2 attention layers are causal decoders, got attn_type {attn_type}")
        if kv_cache_dtype != "auto":
            raise ValueError(
                f"S2 attention layers need kv_cache_dtype 'auto', got {kv_cache_dtype}"
            )
        if not isinstance(s2_pattern, BlockPattern):
            raise TypeError("S2AttentionImpl needs the layer's pattern as s2_pattern")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.kv_sharing_target_layer_name = None
        self.attn_type = attn_type
        self.pattern = s2_pattern
        # Each KV head's stripes in the stripe layer's group (named once that layer exists).
        self.stripes = stripes
        self.stripe_layer: str | None = None
        if stripes is not None:
            self._stripe_offsets = stripes.offsets_on(
                get_current_vllm_config().device_config.device
            )
        self._shares_pages = False
        self._splits: dict[int, int] = {}

    def do_kv_cache_update(
        self,
        layer: torch.nn.Module,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        batch = self._decode_batch(_metadata_of(layer))
        if batch is not None:
            if self.stripes is not None:  # the table's stripe pages index this same tensor
                self._check_shared_pages(kv_cache)
            write_decode_kv(key, value, kv_cache, batch)
            return
        write_kv(key, value, kv_cache, slot_mapping)
        if self.stripes is not None:
            stripe_slots = get_forward_context().slot_mapping.get(self.stripe_layer)
            if stripe_slots is not None:
                self._check_shared_pages(kv_cache)
                write_stripes(
                    key, value, kv_cache, stripe_slots, self.stripes.period, self._stripe_offsets
                )

    def forward(
        self,
        layer: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: S2AttentionMetadata | None,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("S2 attention layers do not fuse output quantization")
        if attn_metadata is None:  # vLLM's profiling and warm-up runs: no cache yet
            return output
        m = attn_metadata
        tokens = m.num_actual_tokens
        out = output.view(-1, self.num_heads, self.head_size)[:tokens]
        if m.decode is not None:
            batch = self._decode_batch(m)
            out.copy_(
                paged_decode_triton(
                    query[:tokens],
                    kv_cache,
                    batch,
                    self.pattern,
                    self.scale,
                    num_splits=self._decode_splits(tokens, query.device),
                )
            )
        elif query.device.type == "cuda":
            table = self._page_table(m)
            skip = frozenset()
            if m.mixed is not None:
                rows = m.mixed.tokens
                out[rows] = paged_decode_triton(
                    query[rows],
                    kv_cache,
                    m.mixed.batch(table),
                    self.pattern,
                    self.scale,
                    num_splits=self._decode_splits(len(m.mixed.host), query.device),
                )
                skip = m.mixed.host
            paged_prefill(
                query[:tokens],
                kv_cache,
                table,
                m.query_start_loc_host,
                m.seq_lens_host,
                self.pattern,
                self.scale,
                skip=skip,
                out=out,
            )
        else:  # the CPU reads the kept pages in PyTorch
            out.copy_(
                paged_attention_torch(
                    query[:tokens],
                    kv_cache,
                    self._page_table(m),
                    m.query_start_loc_host,
                    m.seq_lens_host,
                    self.pattern,
                    self.scale,
                )
            )
        return output

    def _decode_batch(self, m: S2AttentionMetadata | None) -> PagedDecodeBatch | None:
        """A decode step's batch over this layer's pages: the builder's, or with stripes kept
        apart, the same over their page table (composed once per step and stripe offsets)."""
        if m is None or m.decode is None:
            return None
        key = None if self.stripes is None else self.stripes.offsets
        if key not in m.decode_batches:
            if self.stripes is None:
                batch = m.decode.batch(m.block_table, m.seq_lens)
            else:
                batch = m.decode.batch(
                    m.block_table,
                    m.seq_lens,
                    self._stripe_table(),
                    self.stripes,
                    self._stripe_offsets,
                )
            m.decode_batches[key] = batch
        return m.decode_batches[key]

    def _page_table(self, m: S2AttentionMetadata) -> torch.Tensor:
        """Per KV head, the flattened page of each block: the window group's, or for a head's own
        stripe blocks the stripe group's (both groups' pages share the layer's tensor)."""
        if self.stripes is None:
            return kv_head_pages(m.block_table, self.num_kv_heads)
        offsets = self.stripes.offsets
        if offsets not in m.stripe_tables:
            m.stripe_tables[offsets] = stripe_pages(
                m.block_table, self._stripe_table(), self.stripes.period, self._stripe_offsets
            )
        return m.stripe_tables[offsets]

    def _stripe_table(self) -> torch.Tensor:
        """This step's block table of the stripe layer's group."""
        return get_forward_context().attn_metadata[self.stripe_layer].block_table

    def _check_shared_pages(self, kv_cache: torch.Tensor) -> None:
        # vLLM lays the groups' pages out in tensors shared by one layer of each group; the
        # stripe specs mirror the window specs so that a layer and its stripe layer share one.
        if self._shares_pages:
            return
        layer = get_forward_context().no_compile_layers[self.stripe_layer]
        stripe_cache = layer.kv_cache
        if isinstance(stripe_cache, (list, tuple)):
            stripe_cache = stripe_cache[0]
        if stripe_cache.data_ptr() != kv_cache.data_ptr():
            raise RuntimeError(
                f"vLLM {vllm.__version__} placed the stripe pages of {self.stripe_layer!r} in "
                f"another tensor than its layer's: serve with {KV_PAGES_ENV}=union"
            )
        self._shares_pages = True

    def _decode_splits(self, requests: int, device: torch.device) -> int:
        # Per batch size: a piecewise step runs this eagerly in every S2 layer.
        if requests not in self._splits:
            self._splits[requests] = decode_splits(
                self.pattern, self.num_kv_heads, requests, device
            )
        return self._splits[requests]


class S2AttentionBackend(AttentionBackend):
    """The S2 layers' backend: vLLM's paged cache in the head-major layout, s2attn's patterns."""

    # The impl writes the new keys and values itself, in do_kv_cache_update.
    forward_includes_kv_cache_update: bool = False
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto"]

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | MultipleOf]:
        # Any page that divides the pattern's block; the builder checks the layer's block.
        return [MultipleOf(16)]

    # Per (block, KV head) the page's keys then values: what vllm_paged reads and writes. vLLM
    # 0.32 asks for the layout by name, 0.26 for the shape.
    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple:
        return (KVCacheLayout.LBHNC,)

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        cache_dtype_str: str = "auto",
    ) -> tuple[int, ...]:
        return (num_blocks, num_kv_heads, block_size, 2 * head_size)

    @staticmethod
    def get_name() -> str:
        return BACKEND_NAME

    @staticmethod
    def get_impl_cls() -> type[S2AttentionImpl]:
        return S2AttentionImpl

    @staticmethod
    def get_builder_cls() -> type[S2AttentionMetadataBuilder]:
        return S2AttentionMetadataBuilder


# ------------------------------------------------------------------------- the stripe layers
@dataclasses.dataclass
class S2StripeMetadata:
    """A step's view of a stripe group: its block table, which the S2 layer reads."""

    block_table: torch.Tensor  # (requests, periods) int32


class S2StripeMetadataBuilder(AttentionMetadataBuilder[S2StripeMetadata]):
    # Views of vLLM's persistent tables only: any CUDA graph may hold them.
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.ALWAYS

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> S2StripeMetadata:
        m = common_attn_metadata
        return S2StripeMetadata(block_table=m.block_table_tensor[: m.num_reqs])


class S2StripeImpl(AttentionImpl[S2StripeMetadata]):
    """A stripe layer computes nothing: its S2 layer writes and reads its pages."""

    def __init__(self, num_heads, head_size, scale, num_kv_heads=None, *args, **kwargs) -> None:
        self.num_heads = num_heads
        self.head_size = head_size
        self.num_kv_heads = num_kv_heads or num_heads
        self.pattern = kwargs.get("s2_pattern")
        self.stripes = kwargs.get("stripes")
        self.kv_cache_dtype = kwargs.get("kv_cache_dtype", "auto")
        self.kv_sharing_target_layer_name = None
        self.attn_type = AttentionType.DECODER

    def forward(self, *args, **kwargs):
        raise RuntimeError("a stripe layer is never run: its S2 layer reads its pages")


class S2StripeBackend(S2AttentionBackend):
    """The stripe layers' backend: a page spans ``period`` pattern blocks of tokens and holds one
    block of every KV head, in the S2 layers' head-major layout."""

    period: ClassVar[int] = 1

    @classmethod
    def get_kv_cache_shape(
        cls,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        cache_dtype_str: str = "auto",
    ) -> tuple[int, ...]:
        return (num_blocks, num_kv_heads, block_size // cls.period, 2 * head_size)

    @staticmethod
    def get_impl_cls() -> type[S2StripeImpl]:
        return S2StripeImpl

    @staticmethod
    def get_builder_cls() -> type[S2StripeMetadataBuilder]:
        return S2StripeMetadataBuilder


@functools.cache
def stripe_backend(period: int) -> type[S2StripeBackend]:
    return type(f"S2StripeBackend{period}", (S2StripeBackend,), {"period": period})
