"""What a pattern family is: one head's rule (:class:`HeadRule`) and the layer-wide settings that
give every head its rule (:class:`PatternFamily`); the dense rule; the checks over several rules.

A rule answers from its parameters alone, at any length: the blocks it keeps (in memory
proportional to them, on any device), how many, and whether it is dense after all. A
:class:`~s2attn.BlockPattern` built from rules keeps only them until its whole lists are asked
for, so its checks and its layouts never hold more than one head's blocks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

__all__ = ["DenseRule", "HeadRule", "PatternFamily", "check_bool", "strided_rows", "union_complete"]


def check_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r}")
    return value


class HeadRule:
    """One head's blocks over a square of ``nb`` query and KV blocks, as a hashable value.

    A family's rule is a frozen dataclass of plain ints and bools: equal rules keep equal blocks,
    and the pattern builds the lists of heads that share a rule once. Every rule keeps each
    row's diagonal block (so every query sees a key, and :meth:`token_pairs` holds)."""

    #: True for a rule that keeps every visible block by construction.
    is_dense: ClassVar[bool] = False

    def row_lists(
        self, nb: int, causal: bool, device=None, rows: tuple[int, int] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The kept blocks of query blocks ``rows = (first, stop)`` (default: all ``nb``) as int64
        (per-row counts, each block's query block, each block's KV block), sorted by query block
        then KV block, built in memory proportional to them on ``device``."""
        raise NotImplementedError

    def counts(self, nb: int, causal: bool) -> tuple[int, int, int]:
        """The kept blocks over ``nb`` blocks, those of the last row and those of the last column
        (causally visible or not), in time independent of ``nb``."""
        raise NotImplementedError

    def dense_reason(self, nb: int, causal: bool, block_size: int) -> str | None:
        """Why the rule keeps every visible block of ``nb`` although it is sparse by definition,
        or None when it drops some."""
        raise NotImplementedError

    def is_kv_efficient(self, nb: int, causal: bool) -> bool | None:
        """Whether the query blocks reading each KV block form one run; None when the rule cannot
        tell from its parameters (the pattern then walks its lists)."""
        return None

    @classmethod
    def union_complete(cls, rules: frozenset, nb: int, causal: bool) -> bool | None:
        """Whether heads of ``rules`` (all of this class) together keep every visible pair of
        ``nb`` blocks; None when the family has no closed form (the pattern walks its lists)."""
        return None

    def token_pairs(self, nb: int, last: int, block_size: int, causal: bool) -> int:
        """The token pairs the rule keeps over ``nb`` blocks whose last holds ``last`` tokens: its
        block pairs weighed as :meth:`BlockPattern.kept_token_pairs` weighs them. Every row keeps
        its diagonal block, so only the last row's and last column's counts change a weight."""
        kept, last_row, last_col = self.counts(nb, causal)
        bs = block_size
        if causal:  # diagonals are triangles; the last row's other blocks are last x bs
            return (
                bs * bs * (kept - nb)
                + (nb - 1) * bs * (bs + 1) // 2
                + last * (last + 1) // 2
                - (bs - last) * bs * (last_row - 1)
            )
        full = kept - last_row - last_col + 1
        return bs * bs * full + bs * last * (last_row + last_col - 2) + last * last


@dataclass(frozen=True)
class DenseRule(HeadRule):
    """A head that attends every visible block."""

    is_dense: ClassVar[bool] = True

    def row_lists(self, nb, causal, device=None, rows=None):
        i = torch.arange(*((0, nb) if rows is None else rows), device=device)
        hi = i if causal else torch.full_like(i, nb - 1)
        zeros = torch.zeros_like(i)
        return strided_rows(i, zeros, hi + 1, zeros, 0, zeros, 1, zeros)

    def counts(self, nb, causal):
        return (nb * (nb + 1) // 2, nb, 1) if causal else (nb * nb, nb, nb)

    def dense_reason(self, nb, causal, block_size):
        return None  # dense by construction, not after all

    def is_kv_efficient(self, nb, causal):
        return True

    @classmethod
    def union_complete(cls, rules, nb, causal):
        return True


def strided_rows(i, lo, local, before, first, first_after, stride, after):
    """Row lists (per-row counts, query blocks, KV blocks; int64, sorted) of rows ``i`` that each
    keep a window of ``local`` blocks from ``lo``, ``before`` stripes ``first + stride * k``
    below it and ``after`` stripes ``first_after + stride * k`` past it."""
    counts = before + local + after
    device = i.device
    n = torch.repeat_interleave(torch.arange(counts.numel(), device=device), counts)
    k = torch.arange(int(counts.sum()), device=device) - (counts.cumsum(0) - counts)[n]
    b, loc = before[n], local[n]
    cols = torch.where(
        k < b,
        first + stride * k,
        torch.where(k < b + loc, lo[n] + (k - b), first_after[n] + stride * (k - b - loc)),
    )
    return counts, i[n], cols


def union_complete(rules: frozenset, nb: int, causal: bool) -> bool | None:
    """Whether heads of ``rules`` together keep every visible pair of ``nb`` blocks, from the
    rules alone; None when they cannot tell (families without a closed form, or mixed)."""
    if any(rule.is_dense for rule in rules):
        return True
    kinds = {type(rule) for rule in rules}
    return kinds.pop().union_complete(rules, nb, causal) if len(kinds) == 1 else None


class PatternFamily:
    """The layer-wide settings of a family: what turns a layer's head counts into one
    :class:`HeadRule` per KV group. A frozen dataclass whose fields are plain values, saved in a
    transformers config under their names (with ``name``), so a family is read back from them.

    Subclasses set ``name`` and implement :meth:`group_rules`; :meth:`warning` may say why a
    pattern they build is not what the settings suggest."""

    #: The family's name in a config (``config.s2attn["family"]``).
    name: ClassVar[str]

    def group_rules(self, num_heads: int, num_groups: int) -> list[HeadRule]:
        """One rule per KV group of a layer of ``num_heads`` query heads in ``num_groups``
        groups (checked: the groups divide the heads)."""
        raise NotImplementedError

    def warning(self, pattern, max_seq_len: int) -> str | None:
        """Why ``pattern``, built from these settings for ``max_seq_len`` tokens, is worth a
        warning: by default, that it is dense after all."""
        reason = pattern.dense_reason
        return None if reason is None else f"{reason}: the pattern is dense"
