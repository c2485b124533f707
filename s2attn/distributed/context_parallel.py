"""The call: :func:`context_parallel_attention`, after a check that every rank's arguments are
good and agree with the others' (so that a disagreement raises on every rank rather than hangs a
collective); and :class:`CallCommunication`, its communication alone, for the benchmark.
"""

from __future__ import annotations

import math
import struct
import weakref
import zlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..attention import sparse_attention
from ..pattern import BlockPattern
from . import exchange
from .collectives import all_gather_single, comm_device, world_and_rank
from .footprint import rank_bytes_received, rank_kv_bytes
from .plan import ExchangePlan, cached_exchange_plan, exchange_plan

__all__ = ["CallCommunication", "context_parallel_attention"]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

# crc32 of each pattern (its rules, or its lists), computed once per pattern: the ranks compare
# it on every call.
_FINGERPRINTS: weakref.WeakKeyDictionary[BlockPattern, int] = weakref.WeakKeyDictionary()


def _fingerprint(pattern: BlockPattern) -> int:
    fp = _FINGERPRINTS.get(pattern)
    if fp is None:
        shape = struct.pack("<4q?", *pattern._shape, pattern.block_size, pattern.causal)
        fp = zlib.crc32(shape)
        if pattern.rules is not None:
            # A builder's pattern by its rules, so that a long one never builds its lists here
            # (every rank builds it the same way, from the same call).
            fp = zlib.crc32(repr(pattern.rules).encode(), fp)
        else:
            fp = zlib.crc32(pattern.cols.numpy().tobytes(), fp)
            fp = zlib.crc32(pattern.row_offsets.numpy().tobytes(), fp)
        _FINGERPRINTS[pattern] = fp
    return fp


def _local_problem(q, k, v, pattern, world: int, softmax_scale) -> str | None:
    """What is wrong with this rank's arguments, or None; checked before any collective."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            return f"{name} must be a torch.Tensor, got {type(t).__name__}"
        if t.dim() != 4:
            return f"{name} must be (batch, local_seq, heads, dim), got shape {tuple(t.shape)}"
    if not isinstance(pattern, BlockPattern):
        return f"pattern must be a BlockPattern, got {type(pattern).__name__}"
    if k.device != q.device or v.device != q.device:
        return f"q, k and v must be on one device, got {q.device}, {k.device}, {v.device}"
    if k.dtype != q.dtype or v.dtype != q.dtype:
        return f"q, k and v must have one dtype, got {q.dtype}, {k.dtype}, {v.dtype}"
    if q.dtype not in _DTYPES:
        return f"q must be float16, bfloat16, float32 or float64, got {q.dtype}"
    if k.shape != v.shape or k.shape[:2] != q.shape[:2]:
        return (
            f"k and v must be (batch, local_seq, kv_heads, dim) with q's batch and local_seq, got "
            f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    local = q.shape[1]
    if local % 2 != 0:
        return f"the local sequence ({local}) must be even: a shard holds two equal chunks"
    if not pattern.causal and (local // 2) % pattern.block_size:
        return (
            f"a bidirectional pattern needs chunks of whole blocks: local_seq / 2 = {local // 2} "
            f"is not a multiple of the block size {pattern.block_size}"
        )
    if local * world > pattern.max_seq_len:
        return (
            f"the global sequence ({local} x {world} ranks = {local * world}) exceeds the "
            f"pattern's max_seq_len {pattern.max_seq_len}"
        )
    if softmax_scale is not None and (
        not isinstance(softmax_scale, (int, float)) or not math.isfinite(softmax_scale)
    ):
        return f"softmax_scale must be a finite number, got {softmax_scale!r}"
    return None


def _check_agreement(q, k, v, pattern, softmax_scale, group) -> bool:
    """Raise the same error on every rank when any rank's arguments are bad or differ from the
    others'; one all-gather of a few integers, so a disagreement never hangs a collective.
    Returns whether every rank holds its exchange plan for the call (else all build theirs
    together)."""
    world, rank = world_and_rank(group)
    problem = _local_problem(q, k, v, pattern, world, softmax_scale)
    have_plan = problem is None and (
        cached_exchange_plan(pattern, q.shape[1] * world, world, rank, k.shape[2], q.device)
        is not None
    )
    if problem is None:
        # The scale's float64 bits, so that ranks compare it exactly as an integer.
        scale = 0.0 if softmax_scale is None else float(softmax_scale)
        scale_bits = struct.unpack("<q", struct.pack("<d", scale))[0]
        signature = [
            0,
            *q.shape,
            k.shape[2],
            _DTYPES.index(q.dtype),
            {"cpu": 0, "cuda": 1}.get(q.device.type, 2),
            pattern.block_size,
            pattern.num_heads,
            pattern.num_q_blocks,
            pattern.num_kv_blocks,
            _fingerprint(pattern),
            scale_bits,
        ]
    else:
        signature = [1] + [0] * 13
    # Last, and not compared: whether the rank holds its plan.
    mine = torch.tensor([*signature, have_plan], dtype=torch.int64, device=comm_device(group))
    everyone = mine.new_empty(world * mine.numel())
    all_gather_single(everyone, mine, group=group)
    everyone = everyone.view(world, -1).cpu()
    every_plan = bool(everyone[:, -1].all())
    everyone = everyone[:, :-1]
    bad = everyone[:, 0].nonzero().flatten().tolist()
    if bad:
        problems = [None] * world
        dist.all_gather_object(problems, problem, group=group)
        detail = "; ".join(f"rank {r}: {problems[r]}" for r in bad)
        raise ValueError(f"context_parallel_attention: bad arguments on rank(s) {bad}: {detail}")
    differ = (everyone != everyone[0]).any(dim=1).nonzero().flatten().tolist()
    if differ:
        names = (
            "ok, batch, local_seq, heads, dim, kv_heads, dtype, device type, block_size, "
            "pattern heads, q_blocks, kv_blocks, pattern crc32, softmax_scale"
        )
        raise ValueError(
            f"context_parallel_attention: ranks {differ} disagree with rank 0 on the shapes, "
            f"dtype, pattern or softmax_scale (this is rank {rank}); ({names}) per rank: "
            f"{everyone.tolist()}"
        )
    return every_plan


def _call_plan(q, k, pattern, every_plan: bool, group) -> ExchangePlan:
    """The rank's exchange plan for a call on these shards: cached when every rank holds its own
    (``every_plan``, from the agreement check), else built by all together."""
    world, rank = world_and_rank(group)
    key = (pattern, q.shape[1] * world, world, rank, k.shape[2], k.device)
    return cached_exchange_plan(*key) if every_plan else exchange_plan(*key, group)


def context_parallel_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pattern: BlockPattern,
    *,
    group: dist.ProcessGroup | None = None,
    softmax_scale: float | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """:func:`s2attn.sparse_attention` over a sequence sharded across the ranks of ``group``.

    Args:
        q: this rank's shard (batch, local_seq, heads, dim), laid out by :func:`.shard`; the global
            sequence is ``local_seq * W`` for W ranks, and ``local_seq`` must be even.
        k, v: this rank's shards (batch, local_seq, kv_heads, dim); same dtype and device as q.
        pattern: a :class:`s2attn.BlockPattern` covering the global sequence; a bidirectional
            one needs ``local_seq / 2`` to be a multiple of its block size.
        group: the process group (default: the world). Every rank must call with the same shapes,
            dtype, pattern and ``softmax_scale``; otherwise every rank raises a ValueError (one
            all-gather of a few integers per call checks it).
        softmax_scale: defaults to ``1 / sqrt(dim)``.
        return_lse: also return the float32 LSE (batch, heads, local_seq) of this rank's rows.

    Every rank receives the K and V tokens its queries read (see :func:`.context_parallel_bytes`)
    and computes each of its two query chunks with :func:`s2attn.sparse_attention` against
    compact keys: the blocks the chunk reads, the chunk's rows of the pattern renumbered onto
    them (see :mod:`s2attn.distributed`). The backward returns the received tokens' gradients to
    their owners. A group of one rank calls :func:`s2attn.sparse_attention` directly.

    Returns:
        ``out`` (batch, local_seq, heads, dim), this rank's shard of the output; with
        ``return_lse`` also ``lse`` (batch, heads, local_seq).

    Example::

        >>> # torchrun --nproc-per-node 4 ...; dist.init_process_group("nccl")
        >>> pattern = s2attn.local_stride_pattern(
        ...     32, max_seq_len=65536, block_size=64, local_blocks=16, vert_stride=16
        ... )
        >>> q, k, v = (shard(t) for t in (q_full, k_full, v_full))
        >>> out = unshard(context_parallel_attention(q, k, v, pattern))
    """
    every_plan = _check_agreement(q, k, v, pattern, softmax_scale, group)
    world, rank = world_and_rank(group)
    if world == 1:
        return sparse_attention(
            q, k, v, pattern, softmax_scale=softmax_scale, return_lse=return_lse
        )
    plan = _call_plan(q, k, pattern, every_plan, group)
    k_store = exchange.rank_store(k, exchange.ExchangeKV.apply(k, plan, group))
    v_store = exchange.rank_store(v, exchange.ExchangeKV.apply(v, plan, group))
    chunk = q.shape[1] // 2
    outs, lses = [], []
    for part, compact in enumerate(plan.chunks):
        result = sparse_attention(
            q[:, part * chunk : (part + 1) * chunk],
            exchange.chunk_keys(k_store, compact),
            exchange.chunk_keys(v_store, compact),
            compact.pattern,
            softmax_scale=softmax_scale,
            return_lse=return_lse,
        )
        if return_lse:
            outs.append(result[0])
            lses.append(result[1])
        else:
            outs.append(result)
    out = torch.cat(outs, dim=1)
    return (out, torch.cat(lses, dim=2)) if return_lse else out


@dataclass(frozen=True)
class CallCommunication:
    """What one call of :func:`context_parallel_attention` on given shards communicates, each part
    runnable alone, so that it can be timed apart from the attention
    (``benchmarks/context_parallel.py``). Build it with :meth:`of`; like the call, it and each
    method are collectives that every rank of the group runs together.

    ``plan`` is None in a group of one, which exchanges nothing (only the check runs)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    pattern: BlockPattern
    group: dist.ProcessGroup | None
    softmax_scale: float | None
    plan: ExchangePlan | None
    received_grad: torch.Tensor | None  # zeros in the shape of the received rows' gradient

    @classmethod
    def of(cls, q, k, v, pattern, *, group=None, softmax_scale=None) -> CallCommunication:
        every_plan = _check_agreement(q, k, v, pattern, softmax_scale, group)
        plan = received = None
        if world_and_rank(group)[0] > 1:
            plan = _call_plan(q, k, pattern, every_plan, group)
            received = k.new_zeros(k.shape[0], sum(plan.recv), k.shape[3])
        return cls(q, k, v, pattern, group, softmax_scale, plan, received)

    def agreement_check(self) -> None:
        """The call's check that the ranks agree: an all-gather of a few integers, read on the
        host."""
        _check_agreement(self.q, self.k, self.v, self.pattern, self.softmax_scale, self.group)

    def exchange_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The forward's exchange of K and V (:func:`~.exchange.send_rows`): the rows received of
        each."""
        return tuple(exchange.send_rows(x, self.plan, self.group) for x in (self.k, self.v))

    def return_gradients(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The backward's return of K's and V's received rows' gradients (zeros) to their owners
        (:func:`~.exchange.return_gradients`): the gradients of this rank's K and V shards."""
        return tuple(
            exchange.return_gradients(self.received_grad, self.plan, self.group, x.shape)
            for x in (self.k, self.v)
        )

    def _sizes(self) -> tuple:
        """The per-rank byte functions' arguments for this rank's call."""
        world, rank = world_and_rank(self.group)
        batch, local_seq, kv_heads, dim = self.k.shape
        itemsize = self.k.element_size()
        return self.pattern, batch, local_seq * world, kv_heads, dim, itemsize, world, rank

    def bytes_received(self) -> int:
        """Bytes of K and V this rank receives in a forward (the backward sends as many back):
        its entry of :func:`.context_parallel_bytes`, from its own plan alone."""
        return 0 if self.plan is None else rank_bytes_received(*self._sizes())

    def kv_bytes_held(self) -> int:
        """Bytes of K and V this rank holds in a forward: its entry of
        :func:`.context_parallel_kv_bytes`, from its own plan alone."""
        return rank_kv_bytes(*self._sizes())
