"""The S2 settings of an HHST layer stack: which layers are dense, and the S2 layers' pattern.

One frozen :class:`S2Settings` goes from a preset (:mod:`s2attn.models.presets`) through a
transformers config (:func:`s2attn.integrations.transformers.configure` stores it,
:meth:`S2Settings.from_config` reads it back) to the patterns, and serves the CLI's demo stack
and the benchmarks the same way. It holds no model shape: heads, KV heads and the length come in
when a pattern is built.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass

from .pattern import BlockPattern, dense_pattern, local_stride_pattern

__all__ = ["CONFIG_KEY", "S2Settings"]

# The attribute of a transformers config that holds the settings, as a JSON-friendly dict (so
# they survive ``save_pretrained``).
CONFIG_KEY = "s2attn"


def spread_dense_layers(count: int, num_layers: int) -> tuple[int, ...]:
    """Where ``count`` dense layers go in a stack of ``num_layers``: the middle of each of
    ``count`` equal slices of the stack, so never the first layer unless more than half the
    layers are dense.

    Why not first: copying a token from far back needs a head below the copying layer that marks
    each token's predecessor, and only a dense layer reads from anywhere. With its dense layers
    first, the `small` preset neither retrieved nor modelled code as well (+10% bits per byte,
    needle means 0.54 and 0.12); with one in the middle it matched dense (docs/results.md,
    Quality)."""
    if not 0 <= count <= num_layers:
        raise ValueError(f"dense_layers must be in [0, {num_layers}], got {count}")
    return tuple((2 * k + 1) * num_layers // (2 * count) for k in range(count))


@dataclass(frozen=True)
class S2Settings:
    """The S2 layers' :func:`~s2attn.local_stride_pattern` and the indices of the dense layers.

    Args:
        block_size, local_blocks, vert_stride, num_dense_heads, homo_head, head_offset: the
            arguments of :func:`~s2attn.local_stride_pattern` that every S2 layer shares.
        dense_layers: indices of the dense layers (kept sorted, without repeats).

    Example::

        >>> s2 = S2Settings(block_size=16, local_blocks=2, vert_stride=4, dense_layers=(0,))
        >>> s2.layer_types(3)
        ['dense', 's2', 's2']
        >>> s2.pattern(4, max_seq_len=256).density()  # the S2 layers' pattern
    """

    block_size: int = 64
    local_blocks: int = 16
    vert_stride: int = 16
    dense_layers: tuple[int, ...] = (0, 1)
    num_dense_heads: int = 0
    homo_head: bool = False
    head_offset: int = 0

    def __post_init__(self) -> None:
        layers = tuple(self.dense_layers)
        if any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in layers):
            raise ValueError(
                f"dense_layers must be non-negative layer indices, got {self.dense_layers!r}"
            )
        object.__setattr__(self, "dense_layers", tuple(sorted(set(layers))))

    def replace(self, **changes) -> S2Settings:
        """A copy with ``changes`` (field names) applied."""
        return dataclasses.replace(self, **changes)

    def layer_types(self, num_layers: int) -> list[str]:
        """``"dense"`` or ``"s2"`` per layer of a stack of ``num_layers``."""
        if any(i >= num_layers for i in self.dense_layers):
            raise ValueError(
                f"dense_layers must be layer indices in [0, {num_layers}), got "
                f"{list(self.dense_layers)}"
            )
        return ["dense" if i in self.dense_layers else "s2" for i in range(num_layers)]

    def pattern(
        self, num_heads: int, *, max_seq_len: int, num_kv_heads: int | None = None
    ) -> BlockPattern:
        """The pattern of every S2 layer (query heads of one KV group share one pattern)."""
        return local_stride_pattern(
            num_heads,
            max_seq_len=max_seq_len,
            block_size=self.block_size,
            local_blocks=self.local_blocks,
            vert_stride=self.vert_stride,
            num_kv_heads=num_kv_heads,
            num_dense_heads=self.num_dense_heads,
            homo_head=self.homo_head,
            head_offset=self.head_offset,
        )

    def layer_patterns(
        self,
        num_layers: int,
        num_heads: int,
        *,
        max_seq_len: int,
        num_kv_heads: int | None = None,
    ) -> list[BlockPattern]:
        """Every layer's pattern, the dense layers' a :func:`~s2attn.dense_pattern`."""
        s2 = self.pattern(num_heads, max_seq_len=max_seq_len, num_kv_heads=num_kv_heads)
        dense = dense_pattern(num_heads, max_seq_len=max_seq_len, block_size=self.block_size)
        return [dense if kind == "dense" else s2 for kind in self.layer_types(num_layers)]

    # ------------------------------------------------------------------ transformers configs
    def config_entry(self, num_layers: int, max_seq_len: int) -> dict:
        """The JSON-friendly dict a transformers config stores under :data:`CONFIG_KEY`."""
        return {
            "block_size": self.block_size,
            "local_blocks": self.local_blocks,
            "vert_stride": self.vert_stride,
            "max_seq_len": max_seq_len,
            "num_dense_heads": self.num_dense_heads,
            "homo_head": self.homo_head,
            "head_offset": self.head_offset,
            "layer_types": self.layer_types(num_layers),
        }

    @classmethod
    def from_config(cls, config) -> S2Settings | None:
        """The settings a transformers config (or its :meth:`config_entry` dict) holds; None for
        a config without them (every layer dense)."""
        if not isinstance(config, dict):
            if hasattr(config, "get_text_config"):
                config = config.get_text_config(decoder=True)
            config = getattr(config, CONFIG_KEY, None)
            if config is None:
                return None
        fields = {f.name for f in dataclasses.fields(cls)} - {"dense_layers"}
        dense = _dense_indices(config["layer_types"])
        return cls(dense_layers=dense, **{k: config[k] for k in fields})


def _dense_indices(layer_types: Iterable[str]) -> tuple[int, ...]:
    return tuple(i for i, kind in enumerate(layer_types) if kind == "dense")
