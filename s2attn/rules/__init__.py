"""Pattern families: per family, one head's rule and the layer-wide settings that give each head
its rule (see :mod:`s2attn.rules.base`). A new family is a module here with those two classes,
listed in :data:`FAMILIES`: :func:`s2attn.pattern.family_pattern` builds its patterns,
:class:`s2attn.stack.S2Settings` carries it into models and their configs."""

from __future__ import annotations

from .base import DenseRule, HeadRule, PatternFamily, union_complete
from .local_stride import LocalStride, LocalStrideRule

__all__ = [
    "FAMILIES",
    "DenseRule",
    "HeadRule",
    "LocalStride",
    "LocalStrideRule",
    "PatternFamily",
    "union_complete",
]

#: Every family by its name in a config (``config.s2attn["family"]``).
FAMILIES: dict[str, type[PatternFamily]] = {family.name: family for family in (LocalStride,)}
