"""The KV cache of the ``"s2attn"`` attention in HuggingFace transformers' ``generate``:
:class:`S2Cache`, a transformers ``Cache`` of :class:`S2CacheLayer`s, each over a
:class:`s2attn.PagedKVCache` that evicts what the layer's pattern never reads again (see
:mod:`s2attn.integrations.transformers`, which exports both)."""

from __future__ import annotations

import math

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ..inference import PagedKVCache, paged_kv_cache
from ..inference.decode_op import STEP_WRITES
from ..pattern import BlockPattern
from ..precision import autocast_dtype
from ..stack import config_layer_pattern, config_settings

__all__ = ["S2Cache", "S2CacheLayer"]


class S2CacheLayer(CacheLayerMixin):
    """One layer of :class:`S2Cache`: a :class:`s2attn.PagedKVCache`, built at the first update
    (when batch, dtype and device are known).

    ``update`` stores nothing itself: it tags the new keys with this layer and returns them, and
    the ``"s2attn"`` attention appends and attends in one call, choosing what to store by the
    path it takes (a prefill never stores the blocks only the prompt's own queries read).
    """

    is_sliding = False
    is_croppable = True

    def __init__(
        self,
        pattern: BlockPattern | None,
        *,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        max_seq_len: int,
        num_pages: int | None = None,
        static: bool = False,
    ):
        super().__init__()
        self.pattern = pattern
        self.static = static
        # Static layers decode inside compiled graphs (transformers compiles generate's decode
        # step for caches that say so); see _compiled_decode.
        self.is_compileable = static
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.block_size = block_size
        self.max_seq_len = max_seq_len
        self.num_pages = num_pages
        self.paged: PagedKVCache | None = None
        self._pending = False
        # Whether this layer's compiled decode steps check on the device that the step fits the
        # cache (see _compiled_decode). The layers of one S2Cache share _room_check: the first to
        # store tokens takes it and checks for all, once per step; a layer alone checks itself.
        self.checks_room = True
        self._room_check: list[S2CacheLayer | None] = [None]

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        # Under autocast the model hands over float32 keys (its projections' input dtype), but
        # attention computes at the region's dtype: keep the cache there, not at twice the bytes.
        dtype = autocast_dtype(key_states) or key_states.dtype
        self.paged = paged_kv_cache(
            self.pattern,
            batch_size=key_states.shape[0],
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            dtype=dtype,
            device=key_states.device,
            max_seq_len=self.max_seq_len,
            block_size=self.block_size,
            num_pages=self.num_pages,
            static=self.static,
        )
        self.batch_size = key_states.shape[0]
        self.is_initialized = True
        if self._room_check[0] is None:
            self._room_check[0] = self
        self.checks_room = self._room_check[0] is self
        if self.static and not torch.compiler.is_compiling():
            # Fixed addresses: CUDA graphs of compiled decode steps keep them. Every tensor the
            # step's operator writes must be among them: Inductor runs a graph that mutates any
            # other input without CUDA graphs (a 7B step at 128k: 14.8 ms, not 8.1).
            for name in (*STEP_WRITES, "page_table"):
                torch._dynamo.mark_static_address(getattr(self.paged.step_plan, name))

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self._pending:
            raise RuntimeError(
                "S2Cache was updated twice without the 's2attn' attention storing the tokens: "
                "build the model with attn_implementation='s2attn' (configure(config, ...))"
            )
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        # The hand-off to the attention function. transformers (5.x) gives that function the
        # module (config, layer_idx), q/k/v, the mask and the model's forward kwargs, never
        # past_key_values (LlamaAttention.forward takes it by name and calls
        # past_key_values.update, then the attention interface with the keys update returned);
        # Cache.update never sees the module, and the mask interface (create_causal_mask) gets
        # sizes only, and none at all for a 4-D mask. Any other seam is state kept between calls,
        # stale once a step stops between here and the attention or runs without an S2Cache.
        # These keys are new in every forward, so the tag lives one layer's step; under
        # torch.compile it is a side effect inside the trace, with no guard of its own.
        key_states._s2attn_cache_layer = self
        self._pending = True
        return key_states, value_states

    def take_step(self) -> None:
        """The ``"s2attn"`` attention takes the tokens :meth:`update` handed over and stores them
        itself (it appends and attends in one call)."""
        self._pending = False

    def get_seq_length(self) -> int | torch.Tensor:
        if not self.is_initialized:
            return 0
        if self.static and torch.compiler.is_compiling():
            return self.paged.seq_lens.max()  # the host's lengths may lag: no sync in a graph
        return max(self.paged.lengths)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        if self.static:  # a fixed size, as transformers' static caches give: no sync, no retrace
            if self.is_initialized and not torch.compiler.is_compiling():
                # generate asks for the next step's mask outside its compiled decode step, which
                # checks nothing on the host: refuse a step past the cache here, before it runs.
                self.paged.check_room(query_length)
            return self.max_seq_len, 0
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return self.max_seq_len

    def crop(self, tokens_to_remove: int) -> None:
        """Remove ``-tokens_to_remove`` tokens (or, when positive, keep that many: the legacy
        form), e.g. rejected tokens of assisted generation."""
        remove = self._tokens_to_crop(tokens_to_remove)
        if remove > 0:
            self.paged.crop(remove)

    def _tokens_to_crop(self, tokens_to_remove: int) -> int:
        """Tokens ``crop(tokens_to_remove)`` removes; raises ``ValueError`` when it cannot."""
        if not self.is_initialized:
            return 0
        length = self.get_seq_length()
        remove = length - tokens_to_remove if tokens_to_remove > 0 else -tokens_to_remove
        remove = min(max(remove, 0), min(self.paged.lengths))
        if remove > 0:
            self.paged.check_crop(remove)
        return remove

    def reset(self) -> None:
        if self.is_initialized:
            self.paged.reset()
        self._pending = False

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: sequence ``i`` continues sequence ``beam_idx[i]``. Beams share the pages
        of their common past; a beam writing into a shared page copies it first."""
        if self.is_initialized:
            self.paged.select_sequences(beam_idx.cpu())
            self.batch_size = self.paged.batch_size

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat every sequence ``repeats`` times (sharing its pages)."""
        if self.is_initialized:
            self.paged.select_sequences(
                torch.arange(self.paged.batch_size).repeat_interleave(repeats)
            )
            self.batch_size = self.paged.batch_size

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep only the sequences ``indices``."""
        if self.is_initialized:
            if isinstance(indices, torch.Tensor) and indices.dtype == torch.bool:
                indices = indices.nonzero().squeeze(1)
            self.paged.select_sequences(torch.as_tensor(indices).cpu())
            self.batch_size = self.paged.batch_size

    def _unsupported(self, *args, **kwargs):
        raise NotImplementedError("S2Cache keeps its pages on one device: no offloading")

    offload = prefetch = _unsupported


class S2Cache(Cache):
    """A transformers ``Cache`` over :class:`s2attn.PagedKVCache` layers: S2 layers evict what
    their pattern never reads again, dense layers keep everything.

    Args:
        config: the model's config, set up by :func:`configure`.
        max_seq_len: the longest sequence; defaults to the patterns' length.
        num_pages: pages per layer's pool; defaults to each pattern's peak need (see
            :class:`s2attn.PagedKVCache`).
        static: layers of static caches (``paged_kv_cache(static=True)``): every block's page fixed
            when the layer is built, so decode steps change no page table (what CUDA graphs
            need); ``num_pages`` is then not taken.

    Needs the ``"s2attn"`` attention implementation. ``memory_report()`` sums the layers' live and
    dense-equivalent bytes.

    Example::

        >>> cache = S2Cache(model.config)
        >>> model.generate(input_ids, past_key_values=cache, max_new_tokens=64)
        >>> cache.memory_report()["live_bytes"] / cache.memory_report()["dense_bytes"]
    """

    def __init__(
        self,
        config,
        *,
        max_seq_len: int | None = None,
        num_pages: int | None = None,
        static: bool = False,
    ):
        if max_seq_len is not None and (
            isinstance(max_seq_len, bool) or not isinstance(max_seq_len, int) or max_seq_len < 1
        ):
            raise ValueError(
                f"S2Cache: max_seq_len must be a positive int (tokens), or None for the "
                f"patterns' length, got {max_seq_len!r}"
            )
        text = config.get_text_config(decoder=True)
        settings, entry = config_settings(text)
        heads = text.num_attention_heads
        kv_heads = getattr(text, "num_key_value_heads", None) or heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        block_size = settings.block_size
        length = max_seq_len or entry["max_seq_len"]
        layers = [
            S2CacheLayer(
                config_layer_pattern(text, i),
                num_kv_heads=kv_heads,
                head_dim=head_dim,
                block_size=block_size,
                max_seq_len=math.ceil(length / block_size) * block_size,
                num_pages=num_pages,
                static=static,
            )
            for i in range(text.num_hidden_layers)
        ]
        shared: list[S2CacheLayer | None] = [None]
        for layer in layers:
            layer._room_check = shared
        super().__init__(layers=layers)

    def crop(self, tokens_to_remove: int) -> None:
        """Every layer's crop (see :meth:`S2CacheLayer.crop`); when the tokens cannot come back
        in some layer (its pattern already evicted what queries there read), raises
        ``ValueError`` and crops none."""
        for layer in self.layers:
            layer._tokens_to_crop(tokens_to_remove)
        super().crop(tokens_to_remove)

    def memory_report(self) -> dict[str, int]:
        """Live, needed, dense-equivalent and pool bytes (and pages) summed over the layers."""
        total: dict[str, int] = {}
        for layer in self.layers:
            if layer.is_initialized:
                for key, value in layer.paged.memory_report().items():
                    total[key] = total.get(key, 0) + value
        return total
