"""The local-stride (S2) family: a local window plus vertical stripes at absolute block positions.

Query block ``i`` of a head keeps KV block ``j`` when ``0 <= i - j < local_blocks``
(``|i - j| < local_blocks`` when bidirectional) or when ``(j + shift) % vert_stride == 0`` (and
``j <= i`` when causal). Because the stripes sit at absolute positions, a KV block a head stops
using is never used again by that head: the rule is KV-efficient.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..input_checks import as_int, check_int
from .base import DenseRule, HeadRule, PatternFamily, check_bool, strided_rows

__all__ = ["LocalStride", "LocalStrideRule"]


@dataclass(frozen=True)
class LocalStrideRule(HeadRule):
    """One head's window of ``local_blocks`` blocks and stripes every ``vert_stride`` blocks,
    shifted by ``shift`` (in ``[0, vert_stride)``)."""

    local_blocks: int
    vert_stride: int
    shift: int

    def _geometry(self, nb, causal, device, rows):
        """Per query block of ``rows``: the window ``[lo, hi]``, the stripes ``first + stride * k``
        below it (``before`` of them) and from ``first_after`` on past it (``after``)."""
        i = torch.arange(*((0, nb) if rows is None else rows), device=device)
        lo = (i - self.local_blocks + 1).clamp(min=0)
        hi = i if causal else (i + self.local_blocks - 1).clamp(max=nb - 1)
        stride, first = self.vert_stride, -self.shift % self.vert_stride  # the first stripe
        before = ((lo - first + stride - 1) // stride).clamp(min=0)
        first_after = hi + 1 + (first - hi - 1) % stride
        after = (
            torch.zeros_like(i) if causal else ((nb - 1 - first_after) // stride + 1).clamp(min=0)
        )
        return i, lo, hi - lo + 1, before, first, first_after, stride, after

    def row_lists(self, nb, causal, device=None, rows=None):
        return strided_rows(*self._geometry(nb, causal, device, rows))

    def counts(self, nb, causal):
        window, stride = self.local_blocks, self.vert_stride
        first = -self.shift % stride  # the first stripe
        stripes = max(0, -(-(nb - first) // stride))
        # Stripe j is kept outside the window by the rows from j + window on (and, bidirectional,
        # by those up to j - window); the last row keeps the stripes below nb - window.
        last_row = min(nb, window) + max(0, -(-(nb - window - first) // stride))
        rows_after = _below_sum(nb - window, first, stride, stripes)
        if causal:
            if nb <= window:
                local = nb * (nb + 1) // 2
            else:
                local = window * (window + 1) // 2 + (nb - window) * window
            return local + rows_after, last_row, 1
        # Row i's window [i - window + 1, i + window - 1] clipped to [0, nb): nb blocks each, less
        # what each side clips, the same sum on both sides.
        local = nb * nb - 2 * _below_sum(nb - window, 0, 1, nb)
        # Over the stripes: sum max(0, j - window + 1)
        #   = sum (j - window + 1) + sum max(0, window - 1 - j)
        rows_before = (
            stripes * (first - window + 1)
            + stride * stripes * (stripes - 1) // 2
            + _below_sum(window - 1, first, stride, stripes)
        )
        last_col = nb if (nb - 1 - first) % stride == 0 else min(nb, window)
        return local + rows_after + rows_before, last_row, last_col

    def dense_reason(self, nb, causal, block_size):
        """A causal row ``i`` leaves out blocks ``[0, i - local_blocks]`` (bidirectional, also
        ``[i + local_blocks, nb)``), at most ``nb - local_blocks`` of them in the last (first)
        row; with ``vert_stride >= 2`` two neighbours are never both stripes, so only a single
        block left out can be kept by the stripes: block 0 (and ``nb - 1``, bidirectional)."""
        local_blocks, vert_stride = self.local_blocks, self.vert_stride
        if nb == 1:
            return f"block_size={block_size} holds the whole sequence in one block"
        if local_blocks >= nb:
            return f"local_blocks={local_blocks} covers all {nb} blocks"
        if vert_stride == 1:
            return "vert_stride=1 keeps every block"
        first = -self.shift % vert_stride  # the first stripe
        if local_blocks == nb - 1 and first == 0 and (causal or (nb - 1) % vert_stride == 0):
            left_out = "block 0" if causal else f"blocks 0 and {nb - 1}"
            return (
                f"local_blocks={local_blocks} of {nb} blocks leaves out only {left_out}, which "
                f"every head's stripes (vert_stride={vert_stride}) keep"
            )
        return None

    def is_kv_efficient(self, nb, causal):
        # KV block j is read by the rows of its window around j and, when j is a stripe, by every
        # row that sees j: one run either way, at any length.
        return True

    @classmethod
    def union_complete(cls, rules, nb, causal):
        """The widest window keeps every pair nearer than it; a pair farther off is kept only by
        a head whose stripe is its KV block, so every KV block with such a pair must be some
        head's stripe. Stripes repeat with the strides' least common multiple: one period of
        those blocks decides."""
        window = max(rule.local_blocks for rule in rules)
        period = math.lcm(*(rule.vert_stride for rule in rules))
        # KV blocks j with a visible pair farther than the window: from row nb - 1
        # (j < nb - window) and, bidirectional, from row 0 (j >= window).
        spans = [(0, nb - window)] if causal else [(0, nb - window), (window, nb)]
        for start, stop in spans:
            j = torch.arange(start, start + max(0, min(stop - start, period)))
            stripe = torch.zeros_like(j, dtype=torch.bool)
            for rule in rules:
                stripe |= (j + rule.shift) % rule.vert_stride == 0
            if not stripe.all():
                return False
        return True


def _below_sum(a: int, first: int, stride: int, n: int) -> int:
    """``sum(max(0, a - x))`` over the ``n`` terms ``x = first + stride * k``: how far the terms
    below ``a`` lie below it, added up."""
    m = min(n, max(0, -(-(a - first) // stride)))  # the terms below a
    return m * (a - first) - stride * m * (m - 1) // 2


@dataclass(frozen=True)
class LocalStride(PatternFamily):
    """The S2 layers' settings: every sparse head a :class:`LocalStrideRule`.

    Args:
        local_blocks: the local window in blocks, the query's own block included.
        vert_stride: blocks between a head's stripes.
        num_dense_heads: the last query heads are dense (a multiple of the GQA group size).
        homo_head: every head on the same stripes; otherwise the stripes of sparse head (or KV
            group) ``g`` are shifted by ``head_offset + g``, so ``vert_stride`` consecutive
            sparse groups cover every residue and the union is complete.
        head_offset: the first sparse group's shift.
    """

    name = "local_stride"

    local_blocks: int = 16
    vert_stride: int = 16
    num_dense_heads: int = 0
    homo_head: bool = False
    head_offset: int = 0

    def __post_init__(self) -> None:
        # Plain ints, whatever integral type came in: the rules and the caches keyed on them
        # hold no numpy or torch scalars.
        set_field = object.__setattr__
        set_field(self, "local_blocks", check_int("local_blocks", self.local_blocks))
        set_field(self, "vert_stride", check_int("vert_stride", self.vert_stride))
        set_field(self, "num_dense_heads", check_int("num_dense_heads", self.num_dense_heads, 0))
        check_bool("homo_head", self.homo_head)
        set_field(self, "head_offset", as_int("head_offset", self.head_offset))

    def group_rules(self, num_heads, num_groups):
        dense_heads = self.num_dense_heads
        if dense_heads > num_heads:
            raise ValueError(f"num_dense_heads ({dense_heads}) exceeds num_heads ({num_heads})")
        group_size = num_heads // num_groups
        if dense_heads % group_size:
            raise ValueError(
                f"num_dense_heads ({dense_heads}) must be a multiple of the GQA group size "
                f"({group_size}) so that every KV group shares one pattern"
            )
        sparse_groups = num_groups - dense_heads // group_size
        return [
            LocalStrideRule(
                self.local_blocks,
                self.vert_stride,
                (self.head_offset + (0 if self.homo_head else g)) % self.vert_stride,
            )
            if g < sparse_groups
            else DenseRule()
            for g in range(num_groups)
        ]

    def warning(self, pattern, max_seq_len):
        # A pattern that keeps everything costs what dense attention costs, and more (the
        # layouts, the masks): say so where it is built, not in a benchmark later.
        if self.num_dense_heads == pattern.num_heads:
            return (
                f"num_dense_heads={self.num_dense_heads} makes every head dense: the pattern is "
                "dense"
            )
        dense = super().warning(pattern, max_seq_len)
        nb = pattern.num_q_blocks
        if dense is None and self.vert_stride > nb and not pattern.is_union_complete():
            # Each head keeps at most one stripe, and some heads none: too few heads to cover.
            return (
                f"vert_stride={self.vert_stride} exceeds the {nb} blocks of "
                f"max_seq_len={max_seq_len} (block_size={pattern.block_size}): some visible "
                "blocks lie on no head's stripe, so the pattern is not union complete"
            )
        return dense
