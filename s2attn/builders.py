"""The builders of S2 patterns from a family's settings (:mod:`s2attn.rules`): the pattern keeps
one rule per head, and says where it is built when the settings give a pattern other than they
suggest (dense after all, incomplete)."""

from __future__ import annotations

import math
import warnings

from .input_checks import check_int
from .pattern import BlockPattern, check_block_size
from .rules import LocalStride, PatternFamily
from .rules.base import check_bool

__all__ = ["family_pattern", "local_stride_pattern"]


def local_stride_pattern(
    num_heads: int,
    *,
    max_seq_len: int,
    block_size: int,
    local_blocks: int,
    vert_stride: int,
    num_kv_heads: int | None = None,
    num_dense_heads: int = 0,
    homo_head: bool = False,
    head_offset: int = 0,
    causal: bool = True,
) -> BlockPattern:
    """The S2 pattern: a local window plus vertical stripes at absolute block positions.

    Query block ``i`` of a sparse head keeps KV block ``j`` when ``0 <= i - j < local_blocks``
    (``|i - j| < local_blocks`` when bidirectional) or when ``(j + shift) % vert_stride == 0``
    (and ``j <= i`` when causal). ``shift`` is ``head_offset`` plus the head's index among the
    sparse heads (its KV group's index when ``num_kv_heads`` is given), so ``vert_stride``
    consecutive sparse heads (or KV groups) cover every residue: the union is complete.
    ``homo_head=True`` gives every head the same shift. The last ``num_dense_heads`` query heads
    are dense. (The family :class:`s2attn.rules.LocalStride`, built by :func:`family_pattern`.)

    Because stripes sit at absolute positions, a KV block a head stops using is never used again by
    that head (the pattern is KV-efficient).

    Returns a pattern of ``num_heads`` heads; query heads of one KV group share one pattern.

    Example::

        >>> p = local_stride_pattern(
        ...     32, max_seq_len=8192, block_size=64, local_blocks=16, vert_stride=16
        ... )
        >>> p.is_union_complete(), p.is_kv_efficient()
        (True, True)
    """
    family = LocalStride(local_blocks, vert_stride, num_dense_heads, homo_head, head_offset)
    pattern, problems = _family_pattern(
        family, num_heads, max_seq_len, block_size, num_kv_heads, causal
    )
    for problem in problems:
        warnings.warn(problem, UserWarning, stacklevel=2)
    return pattern


def family_pattern(
    family: PatternFamily,
    num_heads: int,
    *,
    max_seq_len: int,
    block_size: int,
    num_kv_heads: int | None = None,
    causal: bool = True,
) -> BlockPattern:
    """The pattern of ``num_heads`` heads that ``family`` (a :class:`s2attn.rules.PatternFamily`,
    e.g. :class:`~s2attn.rules.LocalStride`) gives, over ``max_seq_len`` tokens in blocks of
    ``block_size``: one rule per KV group when ``num_kv_heads`` is given, shared by the group's
    query heads. Warns when the pattern is not what the settings suggest (dense after all, say).

    Example::

        >>> from s2attn.rules import LocalStride
        >>> family_pattern(LocalStride(local_blocks=4, vert_stride=8), 8, max_seq_len=4096,
        ...                block_size=64).is_union_complete()
        True
    """
    pattern, problems = _family_pattern(
        family, num_heads, max_seq_len, block_size, num_kv_heads, causal
    )
    for problem in problems:
        warnings.warn(problem, UserWarning, stacklevel=2)
    return pattern


def _family_pattern(family, num_heads, max_seq_len, block_size, num_kv_heads, causal):
    """:func:`family_pattern` and the warnings it gives, for the public builder to give them at
    its caller's line."""
    if not isinstance(family, PatternFamily):
        raise TypeError(f"family must be a PatternFamily, got {type(family).__name__}")
    num_heads, groups = _validate_heads(num_heads, num_kv_heads)
    max_seq_len = check_int("max_seq_len", max_seq_len)
    block_size = check_block_size(block_size)
    check_bool("causal", causal)
    group_rules = family.group_rules(num_heads, groups)
    nb = math.ceil(max_seq_len / block_size)
    problems = []
    if max_seq_len % block_size:
        problems.append(
            f"max_seq_len={max_seq_len} is not a multiple of block_size={block_size}: the "
            f"pattern covers {nb * block_size} tokens ({nb} blocks)"
        )
    size = num_heads // groups
    rules = [rule for rule in group_rules for _ in range(size)]
    pattern = BlockPattern._from_rules(rules, nb, block_size, causal)
    problem = family.warning(pattern, max_seq_len)
    return pattern, problems if problem is None else [*problems, problem]


def _validate_heads(num_heads: object, num_kv_heads: object) -> tuple[int, int]:
    """(num_heads, KV groups) as ints."""
    num_heads = check_int("num_heads", num_heads)
    if num_kv_heads is None:
        return num_heads, num_heads
    num_kv_heads = check_int("num_kv_heads", num_kv_heads)
    if num_heads % num_kv_heads:
        raise ValueError(f"num_kv_heads ({num_kv_heads}) must divide num_heads ({num_heads})")
    return num_heads, num_kv_heads
