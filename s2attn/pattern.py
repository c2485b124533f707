"""Block patterns: which KV blocks each head's query blocks may attend, the builders, the checks.

A pattern is pure metadata (a boolean tensor kept on the CPU); kernels never see it, only the
layouts compiled from it (``s2attn.ops.layout``, ``s2attn.ops.decode_layout``).

Positions count from 0 in every sequence. When a sequence has fewer queries than keys
(``seq_q < seq_k``, e.g. chunked prefill), queries are aligned bottom-right: query row ``t`` sits at
absolute position ``t + seq_k - seq_q``, so the last query sees the last key. A pattern built for
``max_seq_len`` serves any sequence up to that length through its top-left corner.
"""

from __future__ import annotations

import collections
import itertools
import math
import weakref

import torch

from . import block_lists
from .input_checks import as_int, check_int
from .rules import DenseRule, HeadRule, union_complete
from .rules.base import check_bool

__all__ = [
    "DENSE_VIEW_LIMIT",
    "BlockPattern",
    "check_dense_view",
    "dense_pattern",
    "shared_dense_pattern",
    "shared_pattern",
]

_OP_KEYS = itertools.count(1)
_LIVE: weakref.WeakValueDictionary[int, BlockPattern] = weakref.WeakValueDictionary()

# Bytes of host memory that one dense view of a pattern may take: :attr:`BlockPattern.mask`,
# :meth:`~BlockPattern.effective_block_mask`, :meth:`~BlockPattern.token_mask`,
# :meth:`~BlockPattern.draw`'s picture and :func:`s2attn.ops.decode_layout.group_block_mask`. They
# grow with the square of the blocks or tokens (the mask of 32 heads at 4M tokens in blocks of 64 is
# 137 GB), and a host that overcommits memory kills the process when it touches the pages instead of
# refusing the allocation, so they refuse first. Raise it for a host known to have the room; the
# methods that take ``max_bytes`` override it per call.
DENSE_VIEW_LIMIT = 4 << 30


def check_dense_view(what: str, needed: int, max_bytes: object, alternative: str) -> None:
    """Raise ``ValueError`` when ``what`` would need more than ``max_bytes`` of host memory
    (None: :data:`DENSE_VIEW_LIMIT`), naming both and ``alternative``; called before allocating."""
    limit = DENSE_VIEW_LIMIT if max_bytes is None else check_int("max_bytes", max_bytes, 0)
    if needed > limit:
        raise ValueError(
            f"{what} would need {needed:,} bytes ({needed / 2**30:.3g} GiB) of host memory, over "
            f"the limit of {limit:,} bytes (max_bytes, default s2attn.pattern.DENSE_VIEW_LIMIT); "
            f"{alternative}"
        )


# What to use instead of a dense view: the same answers in memory proportional to the kept blocks.
_INSTEAD_OF_MASK = (
    "the checks (density, is_kv_efficient, is_union_complete, kept_blocks_per_head) need no "
    "mask; for the blocks themselves use row_blocks(head, first, stop) or "
    "block_coordinates(heads=...), or take the view of a corner, crop(num_blocks)"
)


def check_block_size(block_size: object) -> int:
    block_size = as_int("block_size", block_size)
    if block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two >= 16, got {block_size}")
    return block_size


class BlockPattern:
    """Which (query block, KV block) pairs each head may attend.

    Args:
        mask: bool tensor of shape (heads, q_blocks, kv_blocks); ``mask[h, i, j]`` lets head ``h``'s
            query block ``i`` attend KV block ``j``. Copied; later changes to the caller's tensor
            do not affect the pattern. For patterns too large for a dense mask, see
            :meth:`from_block_lists`.
        block_size: tokens per block, a power of two >= 16.
        causal: when True the token-level rule ``q_pos >= k_pos`` is ANDed onto the blocks; entries
            above the block diagonal are then never used.

    ``heads`` may equal the number of query heads (one pattern per query head) or the number of KV
    heads (each query head uses its KV head's pattern).

    Storage is proportional to the kept blocks: per (head, query block) row, the sorted list of
    its KV blocks (CSR: :attr:`row_offsets`, :attr:`cols`). The checks walk these lists a bounded
    chunk of rows at a time, and the kernels' layouts work from them; :attr:`mask` is a dense view
    built on each access, for small patterns and tests. Patterns made by the builders
    (:mod:`s2attn.builders`) and :func:`dense_pattern` keep only each head's rule until the
    whole lists are asked for: head slices and crops stay rules, the checks (:meth:`density`,
    :meth:`kept_token_pairs`, :meth:`kept_blocks_per_head`, :meth:`is_kv_efficient`,
    :meth:`is_union_complete`) are closed forms of the rules, and the kernels' layouts generate
    one head's blocks at a time on the layout's device, so host memory does not grow with the
    length.

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
        block_size = check_block_size(block_size)
        check_bool("causal", causal)
        heads, q_blocks, kv_blocks = mask.shape
        rows, cols = (
            mask.detach().to("cpu").reshape(heads * q_blocks, kv_blocks).nonzero(as_tuple=True)
        )  # row-major: sorted by row, then column
        counts = torch.bincount(rows, minlength=heads * q_blocks)
        self._init(heads, q_blocks, kv_blocks, counts, cols, block_size, causal)

    @classmethod
    def from_block_lists(
        cls,
        row_offsets: torch.Tensor,
        cols: torch.Tensor,
        *,
        num_heads: int,
        num_kv_blocks: int,
        block_size: int,
        causal: bool = True,
    ) -> BlockPattern:
        """A pattern from its kept blocks, at any size: row ``r = head * q_blocks + i`` keeps KV
        blocks ``cols[row_offsets[r]:row_offsets[r + 1]]``, in increasing order.

        Args:
            row_offsets: integer (num_heads * q_blocks + 1,), from 0, non-decreasing, ending at
                ``len(cols)``.
            cols: integer (kept blocks,), each row's KV blocks strictly increasing, in
                ``[0, num_kv_blocks)``.

        Example::

            >>> # 1 head, 2 query blocks: block 0 keeps KV block 0, block 1 keeps 0 and 1.
            >>> BlockPattern.from_block_lists(torch.tensor([0, 1, 3]), torch.tensor([0, 0, 1]),
            ...                               num_heads=1, num_kv_blocks=2, block_size=64)
        """
        num_heads = check_int("num_heads", num_heads)
        num_kv_blocks = check_int("num_kv_blocks", num_kv_blocks)
        block_size = check_block_size(block_size)
        check_bool("causal", causal)
        counts, cols = block_lists.check_block_lists(row_offsets, cols, num_heads, num_kv_blocks)
        q_blocks = counts.numel() // num_heads
        return cls._from_lists(num_heads, q_blocks, num_kv_blocks, counts, cols, block_size, causal)

    @classmethod
    def _from_lists(cls, heads, q_blocks, kv_blocks, counts, cols, block_size, causal):
        """A pattern from checked per-row counts and KV blocks, no further checks."""
        pattern = cls.__new__(cls)
        pattern._init(heads, q_blocks, kv_blocks, counts, cols, block_size, causal)
        return pattern

    def _init(self, heads, q_blocks, kv_blocks, counts, cols, block_size, causal) -> None:
        self._shape = (heads, q_blocks, kv_blocks)
        self._rules = None
        self._lists = (block_lists.offsets_from_counts(counts), cols.to(torch.int32).contiguous())
        self.block_size = block_size
        self.causal = causal
        self._register()

    @classmethod
    def _from_rules(cls, rules, num_blocks, block_size, causal) -> BlockPattern:
        """A square pattern kept as one :class:`~s2attn.rules.HeadRule` per head, its lists built
        only when asked for."""
        pattern = cls.__new__(cls)
        pattern._shape = (len(rules), num_blocks, num_blocks)
        pattern._rules = tuple(rules)
        pattern._lists = None
        pattern.block_size = block_size
        pattern.causal = causal
        pattern._register()
        return pattern

    @property
    def row_offsets(self) -> torch.Tensor:
        """int64 (heads * q_blocks + 1,): row ``r``'s KV blocks are ``cols[row_offsets[r]:
        row_offsets[r + 1]]``, row ``r = head * q_blocks + query block``."""
        return self._materialized()[0]

    @property
    def cols(self) -> torch.Tensor:
        """int32 (kept blocks,): each row's KV blocks in increasing order."""
        return self._materialized()[1]

    def _materialized(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._lists is None:
            nb = self.num_q_blocks
            built: dict[HeadRule, tuple[torch.Tensor, torch.Tensor]] = {}  # heads sharing a rule
            for r in self._rules:
                if r not in built:
                    counts, _, cols = r.row_lists(nb, self.causal)
                    built[r] = counts, cols.to(torch.int32)
            heads = [built[r] for r in self._rules]
            counts = torch.cat([c for c, _ in heads])
            self._lists = (
                block_lists.offsets_from_counts(counts),
                torch.cat([c for _, c in heads]),
            )
        return self._lists

    @property
    def rules(self) -> tuple[HeadRule, ...] | None:
        """Per head, the rule of a builder's pattern (e.g. a
        :class:`~s2attn.rules.LocalStrideRule`, or :class:`~s2attn.rules.DenseRule` for a dense
        head); None for a pattern given by a mask or lists. Two patterns with the same rules,
        shape, block size and causality are the same pattern."""
        return self._rules

    @property
    def dense_reason(self) -> str | None:
        """Why a builder's pattern keeps every visible block although its heads are sparse by
        rule (a window as long as the sequence, a stride of 1, a single block), or None. Read
        from the rules alone, at any length. None too for heads dense by construction
        (:func:`dense_pattern`, ``num_dense_heads``) and for patterns given as masks or lists."""
        if self._rules is None:
            return None
        reasons = [
            rule.dense_reason(self.num_q_blocks, self.causal, self.block_size)
            for rule in dict.fromkeys(self._rules)
            if not rule.is_dense
        ]
        if not reasons or None in reasons:
            return None
        return reasons[0]

    def _head_rules(self, heads: slice) -> tuple | None:
        """The rules of a head range, or None when the pattern holds lists (or has built them:
        slices of those are cheaper from the lists)."""
        return None if self._rules is None or self._lists is not None else self._rules[heads]

    # ------------------------------------------------------------------ identity
    # Every live pattern has a process-unique integer key, by which the torch.library operators
    # (s2attn.compile) name it: a pattern is not a tensor. The key is set here, eagerly, so
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
        return self._shape[0]

    @property
    def num_q_blocks(self) -> int:
        return self._shape[1]

    @property
    def num_kv_blocks(self) -> int:
        return self._shape[2]

    @property
    def num_kept_blocks(self) -> int:
        """Kept (head, query block, KV block) triples, causally visible or not."""
        return int(self.kept_blocks_per_head().sum())

    def kept_blocks_per_head(self) -> torch.Tensor:
        """int64 (heads,): each head's kept (query block, KV block) pairs, causally visible or
        not. A builder's pattern counts them from its rules, in time independent of the length."""
        if self._rules is not None:
            counts = {r: r.counts(self.num_q_blocks, self.causal)[0] for r in self._rules}
            return torch.tensor([counts[r] for r in self._rules], dtype=torch.int64)
        return self.row_offsets[:: self.num_q_blocks].diff()

    @property
    def max_seq_len(self) -> int:
        """The longest key sequence this pattern covers (queries sit at absolute positions too)."""
        return min(self.num_q_blocks, self.num_kv_blocks) * self.block_size

    @property
    def mask(self) -> torch.Tensor:
        """The dense bool view (heads, q_blocks, kv_blocks), built on each access: as large as the
        square of the block count, so for small patterns and tests. Raises ``ValueError`` before
        allocating when its ``heads * q_blocks * kv_blocks`` bytes exceed
        :data:`DENSE_VIEW_LIMIT`."""
        check_dense_view("BlockPattern.mask", math.prod(self._shape), None, _INSTEAD_OF_MASK)
        return self._dense_mask()

    def _dense_mask(self) -> torch.Tensor:
        """:attr:`mask`, its size already checked by the caller."""
        dense = torch.zeros(self._shape, dtype=torch.bool)
        dense[self.block_coordinates()] = True
        return dense

    def block_coordinates(
        self,
        num_blocks: int | None = None,
        heads: slice | None = None,
        device: torch.device | str | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The kept blocks as int64 (head, query block, KV block) triples, sorted in that order:
        of the top-left ``num_blocks`` corner when given, of a head range when given (heads
        counted from the range's start), on ``device`` (default: the CPU). A rule pattern
        generates them there, without building its whole lists."""
        if num_blocks is not None:
            num_blocks = check_int("num_blocks", num_blocks, 0)
        heads = slice(0, self.num_heads) if heads is None else heads
        if not isinstance(heads, slice):
            raise TypeError(f"heads must be a slice of heads, got {type(heads).__name__}")
        if heads.step not in (None, 1):
            raise ValueError(f"heads must be a range of heads (step 1), got {heads}")
        rules = self._head_rules(heads)
        if rules is not None:
            # A rule cropped to fewer blocks is the same rule over fewer blocks.
            nb = self.num_q_blocks if num_blocks is None else min(num_blocks, self.num_q_blocks)
            parts = []
            for n, rule in enumerate(rules):
                _, i, j = rule.row_lists(nb, self.causal, device=device)
                parts.append((torch.full_like(i, n), i, j))
            return tuple(torch.cat(column) for column in zip(*parts))
        if device is not None:
            return tuple(t.to(device) for t in self.block_coordinates(num_blocks, heads))
        first, stop, _ = heads.indices(self.num_heads)
        q_blocks = self.num_q_blocks
        lo = int(self.row_offsets[first * q_blocks])
        hi = int(self.row_offsets[stop * q_blocks])
        counts = (
            self.row_offsets[first * q_blocks + 1 : stop * q_blocks + 1]
            - self.row_offsets[first * q_blocks : stop * q_blocks]
        )
        rows = torch.repeat_interleave(torch.arange(counts.numel()), counts)
        h, i, j = rows // q_blocks, rows % q_blocks, self.cols[lo:hi].long()
        if num_blocks is not None:
            keep = (i < num_blocks) & (j < num_blocks)
            h, i, j = h[keep], i[keep], j[keep]
        return h, i, j

    def row_blocks(self, head: int, first: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The kept blocks of one head's query blocks ``[first, stop)`` as int64 (query block,
        KV block) pairs, sorted: in time and memory proportional to those rows alone."""
        head = as_int("head", head)
        first = as_int("first", first)
        stop = as_int("stop", stop)
        if not 0 <= head < self.num_heads or not 0 <= first <= stop <= self.num_q_blocks:
            raise ValueError(
                f"head {head}, rows [{first}, {stop}) outside the pattern's {self.num_heads} heads "
                f"and {self.num_q_blocks} query blocks"
            )
        rules = self._head_rules(slice(head, head + 1))
        if rules is not None:
            _, i, j = rules[0].row_lists(self.num_q_blocks, self.causal, rows=(first, stop))
            return i, j
        row = head * self.num_q_blocks
        offsets = self.row_offsets[row + first : row + stop + 1]
        i = torch.repeat_interleave(torch.arange(first, stop), offsets.diff())
        return i, self.cols[int(offsets[0]) : int(offsets[-1])].long()

    def _from_coordinates(self, h, i, j, heads: int, q_blocks: int, kv_blocks: int):
        """A pattern of this kind from sorted (head, query block, KV block) triples."""
        counts = torch.bincount(h * q_blocks + i, minlength=heads * q_blocks)
        return BlockPattern._from_lists(heads, q_blocks, kv_blocks, counts, j, self.block_size,
                                        self.causal)  # fmt: skip

    def __getitem__(self, heads: slice) -> BlockPattern:
        """The pattern of a head range, e.g. ``pattern[8:16]`` for one tensor-parallel rank."""
        if not isinstance(heads, slice):
            raise TypeError(f"index a BlockPattern by a slice of heads, got {type(heads).__name__}")
        picked = range(*heads.indices(self.num_heads))
        if len(picked) == 0:
            raise ValueError(f"head slice {heads} selects no heads out of {self.num_heads}")
        rules = self._head_rules(heads)
        if rules is not None:
            return BlockPattern._from_rules(rules, self.num_q_blocks, self.block_size, self.causal)
        parts = [self.block_coordinates(heads=slice(p, p + 1)) for p in picked]
        h = torch.cat([torch.full_like(part[0], n) for n, part in enumerate(parts)])
        i = torch.cat([part[1] for part in parts])
        j = torch.cat([part[2] for part in parts])
        return self._from_coordinates(h, i, j, len(picked), self.num_q_blocks, self.num_kv_blocks)

    def crop(self, num_blocks: int) -> BlockPattern:
        """The top-left ``num_blocks`` x ``num_blocks`` corner: what a shorter sequence uses."""
        num_blocks = check_int("num_blocks", num_blocks)
        if num_blocks > min(self.num_q_blocks, self.num_kv_blocks):
            raise ValueError(
                f"num_blocks={num_blocks} exceeds the pattern's "
                f"{min(self.num_q_blocks, self.num_kv_blocks)} blocks"
            )
        rules = self._head_rules(slice(None))
        if rules is not None:
            return BlockPattern._from_rules(rules, num_blocks, self.block_size, self.causal)
        h, i, j = self.block_coordinates(num_blocks)
        return self._from_coordinates(h, i, j, self.num_heads, num_blocks, num_blocks)

    def __repr__(self) -> str:
        reason = self.dense_reason
        dense = "" if reason is None else f", effectively dense: {reason}"
        return (
            f"BlockPattern(heads={self.num_heads}, q_blocks={self.num_q_blocks}, "
            f"kv_blocks={self.num_kv_blocks}, block_size={self.block_size}, causal={self.causal}, "
            f"density={self.density():.3f}{dense})"
        )

    def draw(self, head: int = 0, max_blocks: int = 64, *, max_bytes: int | None = None) -> str:
        """A text picture of one head's pattern ('#' attended, '.' dropped, ' ' causally hidden),
        of its top-left ``max_blocks`` x ``max_blocks`` corner, built one row at a time from the
        drawn blocks alone. Raises ``ValueError`` before drawing when the text (2 bytes per cell:
        the rows and the joined picture) would exceed ``max_bytes`` (default
        :data:`DENSE_VIEW_LIMIT`)."""
        head = as_int("head", head)
        if not 0 <= head < self.num_heads:
            raise ValueError(f"head {head} outside the pattern's {self.num_heads} heads")
        max_blocks = check_int("max_blocks", max_blocks)
        n_q = min(self.num_q_blocks, max_blocks)
        n_k = min(self.num_kv_blocks, max_blocks)
        check_dense_view(
            f"draw(max_blocks={max_blocks}) of {n_q} x {n_k} blocks",
            2 * n_q * (n_k + 1),
            max_bytes,
            "pass a smaller max_blocks",
        )
        rules = self._head_rules(slice(head, head + 1))
        lines = []
        for r in range(n_q):
            if rules is not None:  # the rule over the drawn corner: nothing past it is generated
                _, _, j = rules[0].row_lists(n_q, self.causal, rows=(r, r + 1))
            else:
                _, j = self.row_blocks(head, r, r + 1)
            # Causally hidden cells are the row's tail, blank: the line stops before them.
            width = min(r + 1, n_k) if self.causal else n_k
            row = torch.full((width,), ord("."), dtype=torch.uint8)
            row[j[j < width]] = ord("#")
            lines.append(row.numpy().tobytes().decode())
        return "\n".join(lines)

    # ---------------------------------------------------------------- masks
    def _visible_blocks(self) -> torch.Tensor:
        """(q_blocks, kv_blocks): block pairs that hold at least one causally visible token pair."""
        qb, kb = self.num_q_blocks, self.num_kv_blocks
        if not self.causal:
            return torch.ones(qb, kb, dtype=torch.bool)
        return torch.arange(kb)[None, :] <= torch.arange(qb)[:, None]

    def effective_block_mask(self, *, max_bytes: int | None = None) -> torch.Tensor:
        """The mask with causally invisible blocks cleared: bool (heads, q_blocks, kv_blocks).

        Raises ``ValueError`` before allocating when the view and the (q_blocks, kv_blocks)
        visibility mask together (``(heads + 1) * q_blocks * kv_blocks`` bytes) would exceed
        ``max_bytes`` (default :data:`DENSE_VIEW_LIMIT`).
        """
        heads, q_blocks, kv_blocks = self._shape
        check_dense_view(
            "BlockPattern.effective_block_mask()",
            (heads + 1) * q_blocks * kv_blocks,
            max_bytes,
            _INSTEAD_OF_MASK,
        )
        mask = self._dense_mask()
        mask &= self._visible_blocks()
        return mask

    def token_mask(
        self, seq_q: int, seq_k: int | None = None, *, max_bytes: int | None = None
    ) -> torch.Tensor:
        """Dense token mask (heads, seq_q, seq_k), bool: may query row t attend key s.

        Queries are bottom-right aligned (row ``t`` at absolute position ``t + seq_k - seq_q``).
        Raises ``ValueError`` before allocating when its dense tensors together would exceed
        ``max_bytes`` (default :data:`DENSE_VIEW_LIMIT`): the block mask of the ``nb`` blocks
        that ``seq_k`` spans, its rows per query, the token mask, and the causal rule, i.e.
        ``heads * (nb * nb + seq_q * nb + seq_q * seq_k) + seq_q * seq_k`` bytes (without the last
        term when not causal).
        """
        seq_k = seq_q if seq_k is None else seq_k
        seq_q = check_int("seq_q", seq_q)
        seq_k = check_int("seq_k", seq_k)
        if seq_q > seq_k:
            raise ValueError(f"seq_q ({seq_q}) must be <= seq_k ({seq_k})")
        if seq_k > self.max_seq_len:
            raise ValueError(
                f"sequence length {seq_k} exceeds the pattern's max_seq_len {self.max_seq_len}"
            )
        bs = self.block_size
        nb = math.ceil(seq_k / bs)
        heads = self.num_heads
        check_dense_view(
            f"token_mask({seq_q}, {seq_k}) of {heads} heads",
            heads * (nb * nb + seq_q * nb + seq_q * seq_k) + (seq_q * seq_k if self.causal else 0),
            max_bytes,
            "s2attn.sparse_attention never builds this mask; for a check, take fewer tokens "
            "(seq_q rows against the first seq_k keys) or use the pattern's own checks and "
            "row_blocks",
        )
        q_pos = torch.arange(seq_q) + (seq_k - seq_q)
        k_pos = torch.arange(seq_k)
        m = self.crop(nb)._dense_mask()[:, q_pos // bs][:, :, k_pos // bs]
        if self.causal:
            m &= q_pos[:, None] >= k_pos[None, :]
        return m

    # --------------------------------------------------------------- checks
    # A builder's pattern answers from its rules: closed forms over each distinct rule, in time
    # and memory independent of the length. A pattern given as lists (or rules without a closed
    # form) is walked a bounded chunk of rows at a time (s2attn.block_lists).
    def kept_token_pairs(self, seq_len: int) -> int:
        """Token pairs the pattern keeps for one sequence of ``seq_len``, summed over heads: each
        kept block pair weighs its visible token pairs (full blocks, the last one shorter, the
        diagonal a triangle when causal)."""
        seq_len = self._check_seq_len(seq_len)
        bs = self.block_size
        nb = math.ceil(seq_len / bs)
        last = seq_len - (nb - 1) * bs
        if self._rules is not None:
            return sum(
                uses * rule.token_pairs(nb, last, bs, self.causal)
                for rule, uses in collections.Counter(self._rules).items()
            )
        return sum(block_lists.head_token_pairs(self, h, nb, last) for h in range(self.num_heads))

    def _check_seq_len(self, seq_len: object) -> int:
        seq_len = check_int("seq_len", seq_len)
        if seq_len > self.max_seq_len:
            raise ValueError(
                f"seq_len {seq_len} exceeds the pattern's max_seq_len {self.max_seq_len}"
            )
        return seq_len

    def _visible_pairs(self, seq_len: int) -> int:
        return seq_len * (seq_len + 1) // 2 if self.causal else seq_len * seq_len

    def density(self, seq_len: int | None = None) -> float:
        """Fraction of the causally visible token pairs that the pattern keeps, over all heads."""
        seq_len = self._check_seq_len(self.max_seq_len if seq_len is None else seq_len)
        return self.kept_token_pairs(seq_len) / (self._visible_pairs(seq_len) * self.num_heads)

    def is_kv_efficient(self) -> bool:
        """True when, for every head and KV block, the query blocks using it form one run.

        Then a KV block, once left behind by the queries, is never read again and can be evicted.
        """
        if self._rules is not None:
            nb, causal = self.num_q_blocks, self.causal
            answers = {rule.is_kv_efficient(nb, causal) for rule in set(self._rules)}
            if None not in answers:
                return all(answers)
        return all(block_lists.head_kv_efficient(self, h) for h in range(self.num_heads))

    def is_union_complete(self, num_kv_heads: int | None = None) -> bool:
        """True when every visible block pair is attended by at least one head.

        With ``num_kv_heads`` the heads are split into that many consecutive groups (the GQA
        groups) and every group must be complete on its own.
        """
        groups = 1 if num_kv_heads is None else num_kv_heads
        groups = check_int("num_kv_heads", groups)
        if self.num_heads % groups:
            raise ValueError(
                f"num_kv_heads={groups} does not divide the pattern's {self.num_heads} heads"
            )
        size = self.num_heads // groups
        for group in (range(g * size, (g + 1) * size) for g in range(groups)):
            complete = None
            if self._rules is not None:
                rules = frozenset(self._rules[group.start : group.stop])
                complete = union_complete(rules, self.num_q_blocks, self.causal)
            if complete is None:
                complete = block_lists.group_union_complete(self, group)
            if not complete:
                return False
        return True


def dense_pattern(
    num_heads: int, *, max_seq_len: int, block_size: int, causal: bool = True
) -> BlockPattern:
    """Every head attends every (visible) block: dense attention expressed as a pattern."""
    num_heads = check_int("num_heads", num_heads)
    max_seq_len = check_int("max_seq_len", max_seq_len)
    block_size = check_block_size(block_size)
    check_bool("causal", causal)
    nb = math.ceil(max_seq_len / block_size)
    return BlockPattern._from_rules([DenseRule()] * num_heads, nb, block_size, causal)


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
        lambda: dense_pattern(num_heads, max_seq_len=max_seq_len, block_size=block_size),
    )
