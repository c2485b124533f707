"""Block patterns: which KV blocks each head's query blocks may attend, the builders, the checks.

A pattern is pure metadata (a boolean tensor kept on the CPU); kernels never see it, only the
layouts compiled from it (``s2attn.layout``).

Positions count from 0 in every sequence. When a sequence has fewer queries than keys
(``seq_q < seq_k``, e.g. chunked prefill), queries are aligned bottom-right: query row ``t`` sits at
absolute position ``t + seq_k - seq_q``, so the last query sees the last key. A pattern built for
``max_seq_len`` serves any sequence up to that length through its top-left corner.
"""

from __future__ import annotations

import itertools
import math
import weakref

import torch

__all__ = [
    "BlockPattern",
    "dense_pattern",
    "local_stride_pattern",
    "shared_dense_pattern",
    "shared_pattern",
]

_OP_KEYS = itertools.count(1)
_LIVE: weakref.WeakValueDictionary[int, BlockPattern] = weakref.WeakValueDictionary()


def _check_block_size(block_size: int) -> None:
    if (
        not isinstance(block_size, int)
        or isinstance(block_size, bool)
        or block_size < 16
        or block_size & (block_size - 1)
    ):
        raise ValueError(f"block_size must be a power of two >= 16, got {block_size!r}")


def _check_positive_int(name: str, value: int, minimum: int = 1) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


class BlockPattern:
    """Which (query block, KV block) pairs each head may attend.

    Args:
        mask: bool tensor of shape (heads, q_blocks, kv_blocks); ``mask[h, i, j]`` lets head ``h``'s
            query block ``i`` attend KV block ``j``. Copied to the CPU; later changes to the
            caller's tensor do not affect the pattern.
        block_size: tokens per block, a power of two >= 16.
        causal: when True the token-level rule ``q_pos >= k_pos`` is ANDed onto the blocks; entries
            above the block diagonal are then never used.

    ``heads`` may equal the number of query heads (one pattern per query head) or the number of KV
    heads (each query head uses its KV head's pattern).

    Example::

        >>> mask = torch.ones(4, 8, 8, dtype=torch.bool).tril()
        >>> p = BlockPattern(mask, block_size=64)
        >>> p.density(512)
        1.0
    """

    def __init__(self, mask: torch.Tensor, block_size: int, causal: bool = True):
        if not isinstance(mask, torch.Tensor):
            raise TypeError(f"mask must be a torch.Tensor, got {type(mask).__name__}")
        if mask.dtype != torch.bool:
            raise TypeError(f"mask must have dtype torch.bool, got {mask.dtype}")
        if mask.dim() != 3:
            raise ValueError(
                f"mask must have shape (heads, q_blocks, kv_blocks), got {tuple(mask.shape)}"
            )
        if min(mask.shape) == 0:
            raise ValueError(f"mask must not be empty, got shape {tuple(mask.shape)}")
        _check_block_size(block_size)
        if not isinstance(causal, bool):
            raise TypeError(f"causal must be a bool, got {causal!r}")
        self.mask = mask.detach().to("cpu", copy=True).contiguous()
        self.block_size = block_size
        self.causal = causal
        self._register()

    # ------------------------------------------------------------------ identity
    # Every live pattern has a process-unique integer key, by which the torch.library operators
    # (s2attn.custom_ops) name it: a pattern is not a tensor. The key is set here, eagerly, so
    # that torch.compile reads it as a plain int attribute (guarded on its value) and never runs
    # registration code while tracing, which torch 2.11 cannot do for an object argument.
    def _register(self) -> None:
        self.op_key = next(_OP_KEYS)
        _LIVE[self.op_key] = self

    # A copy or an unpickled pattern (deepcopy of a model, another process) is a new live object:
    # it gets its own key, never its original's, which may name another pattern here.
    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state.pop("op_key", None)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._register()

    @staticmethod
    def for_op_key(key: int) -> BlockPattern | None:
        """The live pattern whose ``op_key`` is ``key``, or None once it has been freed."""
        return _LIVE.get(key)

    # ------------------------------------------------------------------ shape
    @property
    def num_heads(self) -> int:
        return self.mask.shape[0]

    @property
    def num_q_blocks(self) -> int:
        return self.mask.shape[1]

    @property
    def num_kv_blocks(self) -> int:
        return self.mask.shape[2]

    @property
    def max_seq_len(self) -> int:
        """The longest key sequence this pattern covers (queries sit at absolute positions too)."""
        return min(self.num_q_blocks, self.num_kv_blocks) * self.block_size

    def __getitem__(self, heads: slice) -> BlockPattern:
        """The pattern of a head range, e.g. ``pattern[8:16]`` for one tensor-parallel rank."""
        if not isinstance(heads, slice):
            raise TypeError(f"index a BlockPattern by a slice of heads, got {type(heads).__name__}")
        sub = self.mask[heads]
        if sub.shape[0] == 0:
            raise ValueError(f"head slice {heads} selects no heads out of {self.num_heads}")
        return BlockPattern(sub, self.block_size, self.causal)

    def crop(self, num_blocks: int) -> BlockPattern:
        """The top-left ``num_blocks`` x ``num_blocks`` corner: what a shorter sequence uses."""
        _check_positive_int("num_blocks", num_blocks)
        if num_blocks > min(self.num_q_blocks, self.num_kv_blocks):
            raise ValueError(
                f"num_blocks={num_blocks} exceeds the pattern's "
                f"{min(self.num_q_blocks, self.num_kv_blocks)} blocks"
            )
        return BlockPattern(self.mask[:, :num_blocks, :num_blocks], self.block_size, self.causal)

    def __repr__(self) -> str:
        return (
            f"BlockPattern(heads={self.num_heads}, q_blocks={self.num_q_blocks}, "
            f"kv_blocks={self.num_kv_blocks}, block_size={self.block_size}, causal={self.causal}, "
            f"density={self.density():.3f})"
        )

    def draw(self, head: int = 0, max_blocks: int = 64) -> str:
        """A text picture of one head's pattern ('#' attended, '.' dropped, ' ' causally hidden)."""
        n_q = min(self.num_q_blocks, max_blocks)
        n_k = min(self.num_kv_blocks, max_blocks)
        m = self.mask[head, :n_q, :n_k]
        lines = []
        for i in range(n_q):
            row = []
            for j in range(n_k):
                if self.causal and j > i:
                    row.append(" ")
                else:
                    row.append("#" if m[i, j] else ".")
            lines.append("".join(row).rstrip())
        return "\n".join(lines)

    # ---------------------------------------------------------------- masks
    def _visible_blocks(self) -> torch.Tensor:
        """(q_blocks, kv_blocks): block pairs that hold at least one causally visible token pair."""
        qb, kb = self.num_q_blocks, self.num_kv_blocks
        if not self.causal:
            return torch.ones(qb, kb, dtype=torch.bool)
        return torch.arange(kb)[None, :] <= torch.arange(qb)[:, None]

    def effective_block_mask(self) -> torch.Tensor:
        """The mask with causally invisible blocks cleared: (heads, q_blocks, kv_blocks)."""
        return self.mask & self._visible_blocks()

    def token_mask(self, seq_q: int, seq_k: int | None = None) -> torch.Tensor:
        """Dense token mask (heads, seq_q, seq_k), bool: may query row t attend key s.

        Queries are bottom-right aligned (row ``t`` at absolute position ``t + seq_k - seq_q``).
        """
        seq_k = seq_q if seq_k is None else seq_k
        _check_positive_int("seq_q", seq_q)
        _check_positive_int("seq_k", seq_k)
        if seq_q > seq_k:
            raise ValueError(f"seq_q ({seq_q}) must be <= seq_k ({seq_k})")
        if seq_k > self.max_seq_len:
            raise ValueError(
                f"sequence length {seq_k} exceeds the pattern's max_seq_len {self.max_seq_len}"
            )
        q_pos = torch.arange(seq_q) + (seq_k - seq_q)
        k_pos = torch.arange(seq_k)
        bs = self.block_size
        m = self.mask[:, q_pos // bs][:, :, k_pos // bs]
        if self.causal:
            m = m & (q_pos[:, None] >= k_pos[None, :])
        return m

    # --------------------------------------------------------------- checks
    def _visible_token_pairs(self, seq_len: int) -> torch.Tensor:
        """(q_blocks, kv_blocks) float64: visible token pairs per block pair for one sequence."""
        bs = self.block_size
        nb = math.ceil(seq_len / bs)
        lens = torch.full((nb,), bs, dtype=torch.float64)
        lens[-1] = seq_len - (nb - 1) * bs
        pairs = lens[:, None] * lens[None, :]
        if self.causal:
            pairs = pairs.tril(-1) + torch.diag(lens * (lens + 1) / 2)
        return pairs

    def density(self, seq_len: int | None = None) -> float:
        """Fraction of the causally visible token pairs that the pattern keeps, over all heads."""
        seq_len = self.max_seq_len if seq_len is None else seq_len
        _check_positive_int("seq_len", seq_len)
        if seq_len > self.max_seq_len:
            raise ValueError(
                f"seq_len {seq_len} exceeds the pattern's max_seq_len {self.max_seq_len}"
            )
        nb = math.ceil(seq_len / self.block_size)
        pairs = self._visible_token_pairs(seq_len)
        kept = (self.mask[:, :nb, :nb].to(torch.float64) * pairs).sum()
        return (kept / (pairs.sum() * self.num_heads)).item()

    def kept_token_pairs(self, seq_len: int) -> int:
        """Token pairs the pattern keeps for one sequence of ``seq_len``, summed over heads."""
        nb = math.ceil(seq_len / self.block_size)
        pairs = self._visible_token_pairs(seq_len)
        return int((self.mask[:, :nb, :nb].to(torch.float64) * pairs).sum().item())

    def is_kv_efficient(self) -> bool:
        """True when, for every head and KV block, the query blocks using it form one run.

        Then a KV block, once left behind by the queries, is never read again and can be evicted.
        """
        used = self.effective_block_mask()  # (h, i, j)
        starts = used.clone()
        starts[:, 1:] &= ~used[:, :-1]
        return bool((starts.sum(dim=1) <= 1).all())

    def is_union_complete(self, num_kv_heads: int | None = None) -> bool:
        """True when every visible block pair is attended by at least one head.

        With ``num_kv_heads`` the heads are split into that many consecutive groups (the GQA
        groups) and every group must be complete on its own.
        """
        groups = 1 if num_kv_heads is None else num_kv_heads
        _check_positive_int("num_kv_heads", groups)
        if self.num_heads % groups:
            raise ValueError(
                f"num_kv_heads={groups} does not divide the pattern's {self.num_heads} heads"
            )
        visible = self._visible_blocks()
        covered = self.mask.view(groups, -1, self.num_q_blocks, self.num_kv_blocks).any(dim=1)
        return bool((covered | ~visible).all())


def _validate_heads(num_heads: int, num_kv_heads: int | None) -> int:
    _check_positive_int("num_heads", num_heads)
    if num_kv_heads is None:
        return num_heads
    _check_positive_int("num_kv_heads", num_kv_heads)
    if num_heads % num_kv_heads:
        raise ValueError(f"num_kv_heads ({num_kv_heads}) must divide num_heads ({num_heads})")
    return num_kv_heads


def dense_pattern(
    num_heads: int, max_seq_len: int, block_size: int, *, causal: bool = True
) -> BlockPattern:
    """Every head attends every (visible) block: dense attention expressed as a pattern."""
    _check_positive_int("num_heads", num_heads)
    _check_positive_int("max_seq_len", max_seq_len)
    _check_block_size(block_size)
    nb = math.ceil(max_seq_len / block_size)
    return BlockPattern(torch.ones(num_heads, nb, nb, dtype=torch.bool), block_size, causal)


# Patterns shared by every layer and caller of one configuration, so that their layouts are
# built once. A plain dict, not a functools cache: torch.compile reads an entry of a global dict
# as a guarded constant, where it cannot trace into functools.lru_cache. The oldest entries go
# beyond _MAX_SHARED.
_SHARED: dict[tuple, BlockPattern] = {}
_MAX_SHARED = 16


def shared_pattern(key: tuple, build) -> BlockPattern:
    """The pattern cached under ``key``, built by ``build()`` the first time."""
    pattern = _SHARED.get(key)
    if pattern is None:
        while len(_SHARED) >= _MAX_SHARED:
            del _SHARED[next(iter(_SHARED))]
        pattern = _SHARED[key] = build()
    return pattern


def shared_dense_pattern(num_heads: int, max_seq_len: int, block_size: int) -> BlockPattern:
    """The causal :func:`dense_pattern` of this shape, one object per process (see
    :func:`shared_pattern`): the dense layers of a model share it with their KV caches."""
    return shared_pattern(
        ("dense", num_heads, max_seq_len, block_size),
        lambda: dense_pattern(num_heads, max_seq_len, block_size),
    )


def local_stride_pattern(
    num_heads: int,
    max_seq_len: int,
    block_size: int,
    local_blocks: int,
    vert_stride: int,
    *,
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
    are dense.

    Because stripes sit at absolute positions, a KV block a head stops using is never used again by
    that head (the pattern is KV-efficient).

    Returns a pattern of ``num_heads`` heads; query heads of one KV group share one pattern.

    Example::

        >>> p = local_stride_pattern(32, 8192, 64, local_blocks=16, vert_stride=16)
        >>> p.is_union_complete(), p.is_kv_efficient()
        (True, True)
    """
    groups = _validate_heads(num_heads, num_kv_heads)
    _check_positive_int("max_seq_len", max_seq_len)
    _check_block_size(block_size)
    _check_positive_int("local_blocks", local_blocks)
    _check_positive_int("vert_stride", vert_stride)
    _check_positive_int("num_dense_heads", num_dense_heads, minimum=0)
    if num_dense_heads > num_heads:
        raise ValueError(f"num_dense_heads ({num_dense_heads}) exceeds num_heads ({num_heads})")
    group_size = num_heads // groups
    if num_dense_heads % group_size:
        raise ValueError(
            f"num_dense_heads ({num_dense_heads}) must be a multiple of the GQA group size "
            f"({group_size}) so that every KV group shares one pattern"
        )
    if not isinstance(head_offset, int):
        raise ValueError(f"head_offset must be an integer, got {head_offset!r}")

    nb = math.ceil(max_seq_len / block_size)
    i = torch.arange(nb)[:, None]
    j = torch.arange(nb)[None, :]
    local = (i - j >= 0) & (i - j < local_blocks) if causal else (i - j).abs() < local_blocks
    visible = j <= i if causal else torch.ones(nb, nb, dtype=torch.bool)

    num_sparse_groups = groups - num_dense_heads // group_size
    masks = []
    for g in range(groups):
        if g >= num_sparse_groups:
            masks.append(torch.ones(nb, nb, dtype=torch.bool))
            continue
        shift = head_offset + (0 if homo_head else g)
        stripes = ((j + shift) % vert_stride == 0) & visible
        masks.append(local | stripes)
    mask = torch.stack(masks).repeat_interleave(group_size, dim=0)
    return BlockPattern(mask, block_size, causal)
