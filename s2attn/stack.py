"""The S2 settings of an HHST layer stack: which layers are dense, and the S2 layers' pattern.

One frozen :class:`S2Settings` goes from a preset (:mod:`s2attn.training.presets`) through a
transformers config (:func:`s2attn.integrations.transformers.configure` stores it,
:meth:`S2Settings.from_config` reads it back) or a Megatron layer spec
(:func:`s2attn.integrations.megatron.get_hhst_layer_spec`) to the patterns, and serves the CLI's
demo stack and the benchmarks the same way. It holds no model shape: heads, KV heads and the
length come in when a pattern is built (:meth:`S2Settings.pattern`, the one builder).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass

from .builders import family_pattern
from .pattern import (
    BlockPattern,
    check_block_size,
    dense_pattern,
    shared_dense_pattern,
    shared_pattern,
)
from .rules import FAMILIES, LocalStride, PatternFamily

__all__ = [
    "CONFIG_KEY",
    "S2Settings",
    "config_dense_pattern",
    "config_layer_pattern",
    "config_settings",
    "settings_with",
    "shared_s2_pattern",
    "spread_dense_layers",
]

# The attribute of a transformers config that holds the settings, as a JSON-friendly dict (so
# they survive ``save_pretrained``).
CONFIG_KEY = "s2attn"
# The family of a config saved without a "family" entry (before there were several).
_DEFAULT_FAMILY = LocalStride.name


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


@dataclass(frozen=True, init=False)
class S2Settings:
    """The S2 layers' pattern family and block size, and the indices of the dense layers.

    Args:
        block_size: tokens per block of every S2 layer's pattern.
        dense_layers: indices of the dense layers (kept sorted, without repeats).
        family: the S2 layers' :class:`~s2attn.rules.PatternFamily` (default: a
            :class:`~s2attn.rules.LocalStride` of local 16 blocks, stride 16).
        **family_fields: fields of the family, replacing the given (or default) family's, e.g.
            ``local_blocks=4, vert_stride=8``; they read through too (``settings.vert_stride``).

    Example::

        >>> s2 = S2Settings(block_size=16, local_blocks=2, vert_stride=4, dense_layers=(0,))
        >>> s2.layer_types(3)
        ['dense', 's2', 's2']
        >>> s2.family.local_blocks, s2.local_blocks  # the family's fields read through
        (2, 2)
        >>> s2.pattern(4, max_seq_len=256).density()  # the S2 layers' pattern
    """

    block_size: int
    dense_layers: tuple[int, ...]
    family: PatternFamily

    def __init__(
        self,
        block_size: int = 64,
        dense_layers: Iterable[int] = (0, 1),
        family: PatternFamily | None = None,
        **family_fields,
    ) -> None:
        family = LocalStride() if family is None else family
        if not isinstance(family, PatternFamily):
            raise TypeError(f"family must be a PatternFamily, got {type(family).__name__}")
        if family_fields:
            unknown = sorted(set(family_fields) - set(_field_names(family)))
            if unknown:
                raise TypeError(
                    f"S2Settings got {', '.join(unknown)}: neither a field of S2Settings "
                    f"(block_size, dense_layers, family) nor of its family {type(family).__name__}"
                    f" ({', '.join(_field_names(family))})"
                )
            family = dataclasses.replace(family, **family_fields)
        layers = tuple(dense_layers)
        if any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in layers):
            raise ValueError(
                f"dense_layers must be non-negative layer indices, got {dense_layers!r}"
            )
        object.__setattr__(self, "block_size", check_block_size(block_size))
        object.__setattr__(self, "dense_layers", tuple(sorted(set(layers))))
        object.__setattr__(self, "family", family)

    def __getattr__(self, name: str):
        # Only for names that are no attribute of the settings: the family's fields.
        family = self.__dict__.get("family")
        if name.startswith("_") or family is None or name not in _field_names(family):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(family, name)

    def replace(self, **changes) -> S2Settings:
        """A copy with ``changes`` applied: fields of the settings or of their family."""
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
        self,
        num_heads: int,
        *,
        max_seq_len: int,
        num_kv_heads: int | None = None,
        causal: bool = True,
    ) -> BlockPattern:
        """The pattern of every S2 layer (query heads of one KV group share one pattern)."""
        return family_pattern(
            self.family,
            num_heads,
            max_seq_len=max_seq_len,
            block_size=self.block_size,
            num_kv_heads=num_kv_heads,
            causal=causal,
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
        """The JSON-friendly dict a transformers config stores under :data:`CONFIG_KEY`: the
        family's name and fields, the block size, the patterns' length and each layer's kind."""
        return {
            "family": self.family.name,
            "block_size": self.block_size,
            **dataclasses.asdict(self.family),
            "max_seq_len": max_seq_len,
            "layer_types": self.layer_types(num_layers),
        }

    @classmethod
    def from_config(cls, config) -> S2Settings | None:
        """The settings a transformers config (or its :meth:`config_entry` dict) holds; None for
        a config without them (every layer dense)."""
        entry = config if isinstance(config, dict) else _entry(config)
        if entry is None:
            return None
        name = entry.get("family", _DEFAULT_FAMILY)
        if name not in FAMILIES:
            raise ValueError(
                f"config.{CONFIG_KEY}['family'] is {name!r}, not a pattern family of this "
                f"s2attn; known: {', '.join(sorted(FAMILIES))}"
            )
        family = FAMILIES[name]
        missing = [
            f for f in ("block_size", "layer_types", *_field_names(family)) if f not in entry
        ]
        if missing:
            raise ValueError(f"config.{CONFIG_KEY} lacks {', '.join(missing)} (family {name!r})")
        return cls(
            block_size=entry["block_size"],
            dense_layers=_dense_indices(entry["layer_types"]),
            family=family(**{f: entry[f] for f in _field_names(family)}),
        )


def settings_with(settings: S2Settings | None, **fields) -> S2Settings:
    """``settings`` (default: ``S2Settings()``) with the ``fields`` given as other than None
    replaced: what an entry point's keywords make of the settings it is given."""
    return (settings or S2Settings()).replace(**{k: v for k, v in fields.items() if v is not None})


def _field_names(family) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(family))


def _dense_indices(layer_types: Iterable[str]) -> tuple[int, ...]:
    return tuple(i for i, kind in enumerate(layer_types) if kind == "dense")


def _text_config(config):
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def _entry(config) -> dict | None:
    return getattr(_text_config(config), CONFIG_KEY, None)


def config_settings(config) -> tuple[S2Settings, dict]:
    """The settings a configured transformers config holds and the dict they are stored as
    (its ``max_seq_len``, ``layer_types``); ``ValueError`` when it holds none."""
    entry = _configured_entry(config)
    return S2Settings.from_config(entry), entry


def _configured_entry(config) -> dict:
    entry = _entry(config)
    if entry is None:
        raise ValueError(
            "the model's config has no s2attn settings: call "
            "s2attn.integrations.transformers.configure(config, ...) before building the model"
        )
    return entry


def _heads(config) -> tuple[int, int]:
    text = _text_config(config)
    heads = text.num_attention_heads
    return heads, getattr(text, "num_key_value_heads", None) or heads


def config_layer_pattern(config, layer_idx: int) -> BlockPattern | None:
    """The pattern of layer ``layer_idx`` of a configured transformers config, None when dense
    (see :func:`shared_s2_pattern`)."""
    entry = _configured_entry(config)
    types = entry["layer_types"]
    if not 0 <= layer_idx < len(types):
        raise ValueError(f"layer_idx {layer_idx} outside the config's {len(types)} layers")
    if types[layer_idx] == "dense":
        return None
    return shared_s2_pattern(entry, *_heads(config))


def shared_s2_pattern(entry: dict, num_heads: int, num_kv_heads: int) -> BlockPattern:
    """The S2 layers' pattern of the settings stored as ``entry`` (a config's
    :meth:`S2Settings.config_entry`), one object per configuration, shared by every S2 layer
    (see :func:`s2attn.pattern.shared_pattern`). Found by the entry's values alone: compiled code
    that looks it up reads the config's dict, guarded, and builds nothing."""
    key = ("s2", num_heads, num_kv_heads, *((k, v) for k, v in entry.items() if k != "layer_types"))
    return shared_pattern(
        key,
        lambda: S2Settings.from_config(entry).pattern(
            num_heads, max_seq_len=entry["max_seq_len"], num_kv_heads=num_kv_heads
        ),
    )


def config_dense_pattern(config) -> BlockPattern:
    """The dense layers' pattern of a configured config: one dense pattern over its KV heads,
    shared with their KV caches (:func:`s2attn.pattern.shared_dense_pattern`)."""
    entry = _configured_entry(config)
    return shared_dense_pattern(_heads(config)[1], entry["max_seq_len"], entry["block_size"])
