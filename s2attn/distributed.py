"""Context parallelism: one long sequence split over the ranks of a ``torch.distributed`` group.

Each rank holds a shard of the sequence, laid out by :func:`shard`, and
:func:`context_parallel_attention` returns that rank's shard of the output; autograd returns each
rank its shards of dq, dk and dv. The result equals one-device :func:`s2attn.sparse_attention` on
the whole sequence.

Load balance. Under a causal pattern a query at position p reads keys ``[0, p]``, so the work of a
contiguous chunk grows with its position. :func:`shard` cuts the sequence into ``2 * W`` equal
chunks (W ranks) and gives rank r chunks ``r`` and ``2W - 1 - r``: each rank gets one early and
one late chunk, whose causal work sums to the same amount on every rank to first order. Measured
on S2 patterns (128k tokens, 32 heads, block 64, local 16, stride 16 or 64, W = 2 to 8): the
busiest rank's kept blocks are within 0.2% of the mean, against 26-71% above it for contiguous
shards.

Communication. A rank receives only the K/V tokens its queries read, per KV head (the blocks
its two chunks' query blocks keep under that head's pattern heads, up to each chunk's end under a
causal pattern), in one ``all_to_all_single`` each for K and V; the backward sends each received
token's gradient back to its owner the same way. Under a strided S2 pattern that is a few percent
of an all-gather's ``(W - 1) / W`` of the sequence (:func:`context_parallel_bytes` against
:func:`communication_bytes`). Each rank still lays K and V out over the whole sequence (zeros
where nothing is read), so its memory is an all-gather's; overlapping the exchange with compute is
for a later version.

Bidirectional patterns. The kernels align queries bottom-right to the keys, so a causal chunk is
computed against the keys up to its end and sits at its absolute position. A bidirectional chunk
reads keys on both sides: it is computed against all the keys with a *shifted* pattern, whose last
rows are the chunk's rows of the given pattern. That needs chunks of whole blocks (``local_seq /
2`` a multiple of the block size); a shifted pattern costs as much host memory as the pattern's
own rows up to the sequence length, once per chunk, cached.
"""

from __future__ import annotations

import math
import struct
import weakref
import zlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .attention import sparse_attention
from .pattern import BlockPattern

__all__ = [
    "communication_bytes",
    "context_parallel_attention",
    "context_parallel_bytes",
    "shard",
    "unshard",
]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

# torch 2.13 renamed the single-tensor collectives (the old names warn); older torch has only those.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

# crc32 of each pattern's mask, computed once per pattern: the ranks compare it on every call.
_FINGERPRINTS: weakref.WeakKeyDictionary[BlockPattern, int] = weakref.WeakKeyDictionary()


def _world(group: dist.ProcessGroup | None) -> tuple[int, int]:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("s2attn.distributed needs torch.distributed.init_process_group first")
    return dist.get_world_size(group), dist.get_rank(group)


def _check_seq_dim(x: torch.Tensor, seq_dim: int) -> int:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if not isinstance(seq_dim, int) or not -x.dim() <= seq_dim < x.dim():
        raise ValueError(f"seq_dim must be an int in [{-x.dim()}, {x.dim()}), got {seq_dim!r}")
    return seq_dim % x.dim()


def shard(
    x: torch.Tensor, group: dist.ProcessGroup | None = None, *, seq_dim: int = 1
) -> torch.Tensor:
    """This rank's shard of a full tensor, as :func:`context_parallel_attention` expects it.

    Args:
        x: the full tensor, e.g. (batch, seq, heads, dim), the same on every rank.
        group: the process group (default: the world).
        seq_dim: the sequence dimension of ``x``.

    Returns:
        (batch, seq / W, heads, dim) for a group of W ranks: chunks ``r`` and ``2W - 1 - r`` of the
        ``2W`` equal chunks of the sequence, concatenated (rank r). ``seq`` must divide by ``2W``.

    Example::

        >>> q_local = shard(q_full)          # on every rank
        >>> assert torch.equal(unshard(q_local), q_full)
    """
    world, rank = _world(group)
    seq_dim = _check_seq_dim(x, seq_dim)
    seq = x.shape[seq_dim]
    if seq % (2 * world) != 0:
        raise ValueError(
            f"the sequence length ({seq}) must divide by 2 * world size = {2 * world} "
            "(pad the sequence)"
        )
    chunks = x.chunk(2 * world, dim=seq_dim)
    return torch.cat([chunks[rank], chunks[2 * world - 1 - rank]], dim=seq_dim)


class _GatherShards(torch.autograd.Function):
    """All-gather of equal shards into (world, *shard.shape); the backward sums the gradients of
    all ranks into each owner's shard (a reduce-scatter)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        world = dist.get_world_size(group)
        # Flat buffers: gloo takes only an output that concatenates the inputs along dim 0.
        x = x.contiguous()
        out = x.new_empty(world * x.numel())
        _all_gather_single(out, x.view(-1), group=group)
        return out.view(world, *x.shape)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        group = ctx.group
        grad = grad.contiguous()
        if dist.get_backend(group) == dist.Backend.GLOO:
            # gloo has no reduce-scatter: a sum over all ranks, of which each keeps its own part
            # (on a copy: autograd may still hold the incoming gradient).
            summed = grad.clone()
            dist.all_reduce(summed, group=group)
            return summed[dist.get_rank(group)].clone(), None
        out = grad.new_empty(grad.shape[1:])
        _reduce_scatter_single(out.view(-1), grad.view(-1), group=group)
        return out, None


def _gather_sequence(x: torch.Tensor, group: dist.ProcessGroup | None, seq_dim: int):
    """The full tensor, in sequence order, from every rank's :func:`shard`; differentiable."""
    world = dist.get_world_size(group)
    gathered = _GatherShards.apply(x, group)  # (world, ..., local_seq, ...)
    firsts, seconds = gathered.chunk(2, dim=seq_dim + 1)
    # Rank r holds chunks r and 2W-1-r: the first halves in rank order, then the second halves in
    # reverse rank order, give chunks 0 .. 2W-1.
    parts = [firsts[r] for r in range(world)] + [seconds[r] for r in reversed(range(world))]
    return torch.cat(parts, dim=seq_dim)


# ----------------------------------------------------------------- moving only what is read
@dataclass(frozen=True)
class _ExchangePlan:
    """Which K/V tokens one rank sends to and receives from each rank, per KV head.

    ``send[d][g]``: indices into this rank's shard of the tokens rank ``d`` reads for KV head
    ``g``; ``recv[s][g]``: the global positions of the tokens this rank reads from rank ``s``'s
    shard, in the same order as ``s`` sends them (ascending position). Nothing to or from itself:
    a rank holds its own shard. ``own``: the global positions of this rank's shard."""

    seq: int
    send: list[list[torch.Tensor]]
    recv: list[list[torch.Tensor]]
    own: torch.Tensor

    def tokens_received(self) -> int:
        """Token rows (one KV head each) this rank receives, K or V alone."""
        return sum(int(i.numel()) for per_head in self.recv for i in per_head)


def _owners(seq: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For every global position: the rank whose shard holds it, and its index in that shard."""
    chunk = seq // (2 * world)
    pos = torch.arange(seq)
    c = pos // chunk
    late = c >= world
    owner = torch.where(late, 2 * world - 1 - c, c)
    local = pos - c * chunk + late.long() * chunk
    return owner, local


def _tokens_read(pattern: BlockPattern, seq: int, world: int, kv_heads: int) -> torch.Tensor:
    """(world, kv_heads, seq) bool: the key positions each rank's queries read, per KV head: for
    each of its two chunks, the blocks its query blocks keep under the KV head's pattern heads,
    and under a causal pattern only the positions up to the chunk's end (a pattern may keep
    blocks past the diagonal that causality never reads). Read from the pattern's block lists:
    each chunk's rows are one slice of them per pattern head."""
    b, chunk = pattern.block_size, seq // (2 * world)
    nb = -(-seq // b)
    q_blocks = pattern.num_q_blocks
    # Pattern heads per KV head: the KV heads themselves, or each KV head's query heads.
    heads_per_kv = pattern.num_heads // kv_heads
    offsets, cols = pattern.row_offsets, pattern.cols.long()
    out = torch.zeros(world, kv_heads, seq, dtype=torch.bool)
    for r in range(world):
        for c in (r, 2 * world - 1 - r):
            start, end = c * chunk, (c + 1) * chunk
            first, last = start // b, (end - 1) // b
            blocks = torch.zeros(kv_heads, nb, dtype=torch.bool)
            for h in range(pattern.num_heads):
                row = h * q_blocks
                kept = cols[offsets[row + first] : offsets[row + last + 1]]
                blocks[h // heads_per_kv, kept[kept < nb]] = True
            read = blocks.repeat_interleave(b, dim=1)[:, :seq]
            if pattern.causal:
                read[:, end:] = False
            out[r] |= read
    return out


_PLANS: weakref.WeakKeyDictionary[BlockPattern, dict] = weakref.WeakKeyDictionary()


def _exchange_plan(
    pattern: BlockPattern,
    seq: int,
    world: int,
    rank: int,
    kv_heads: int,
    device: torch.device | None = None,
) -> _ExchangePlan:
    """The plan, its index tensors on ``device`` (moved once, not on every call)."""
    plans = _PLANS.setdefault(pattern, {})
    key = (seq, world, rank, kv_heads, None if device is None else str(device))
    if key not in plans and device is not None:
        cpu = _exchange_plan(pattern, seq, world, rank, kv_heads)
        plans[key] = _ExchangePlan(
            seq,
            [[i.to(device) for i in per_head] for per_head in cpu.send],
            [[i.to(device) for i in per_head] for per_head in cpu.recv],
            cpu.own.to(device),
        )
    if key not in plans:
        read = _tokens_read(pattern, seq, world, kv_heads)
        owner, local = _owners(seq, world)
        mine = owner == rank
        send = [
            [local[read[d, g] & mine] if d != rank else local[:0] for g in range(kv_heads)]
            for d in range(world)
        ]
        recv = [
            [
                (read[rank, g] & (owner == s)).nonzero().flatten() if s != rank else local[:0]
                for g in range(kv_heads)
            ]
            for s in range(world)
        ]
        own = mine.nonzero().flatten()
        own = own[local[own].argsort()]  # in shard order
        plans[key] = _ExchangePlan(seq, send, recv, own)
    return plans[key]


def _pieces(x: torch.Tensor, index: list[list[torch.Tensor]], dim_size: int) -> list[torch.Tensor]:
    """x (batch, n, kv_heads, dim) rows ``index[r][g]`` of head g, flat, one tensor per rank."""
    return [
        torch.cat([x[:, i, g].reshape(-1) for g, i in enumerate(per_head)])
        if any(i.numel() for i in per_head)
        else x.new_empty(0)
        for per_head in index
    ]


def _sizes(index: list[list[torch.Tensor]], batch: int, dim: int) -> list[int]:
    return [batch * dim * sum(int(i.numel()) for i in per_head) for per_head in index]


def _all_to_all(pieces: list[torch.Tensor], out_sizes: list[int], group) -> list[torch.Tensor]:
    send = torch.cat(pieces)
    recv = send.new_empty(sum(out_sizes))
    dist.all_to_all_single(
        recv, send, output_split_sizes=out_sizes,
        input_split_sizes=[p.numel() for p in pieces], group=group,
    )  # fmt: skip
    return list(recv.split(out_sizes))


class _ExchangeKV(torch.autograd.Function):
    """A rank's shard (batch, local_seq, kv_heads, dim) -> the whole sequence (batch, seq,
    kv_heads, dim) holding the rank's own tokens and those its queries read, zeros elsewhere
    (which its pattern never reads). The backward sends each received token's gradient back to
    its owner, which adds it to its own."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, plan: _ExchangePlan, group) -> torch.Tensor:
        ctx.plan, ctx.group = plan, group
        batch, _, kv_heads, dim = x.shape
        x = x.contiguous()
        full = x.new_zeros(batch, plan.seq, kv_heads, dim)
        full[:, plan.own] = x
        received = _all_to_all(_pieces(x, plan.send, dim), _sizes(plan.recv, batch, dim), group)
        for flat, per_head in zip(received, plan.recv):
            start = 0
            for g, positions in enumerate(per_head):
                n = batch * int(positions.numel()) * dim
                full[:, positions, g] = flat[start : start + n].view(batch, -1, dim)
                start += n
        return full

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        plan, group = ctx.plan, ctx.group
        batch, _, kv_heads, dim = grad.shape
        grad = grad.contiguous()
        local = grad[:, plan.own].clone()
        returned = _all_to_all(_pieces(grad, plan.recv, dim), _sizes(plan.send, batch, dim), group)
        for flat, per_head in zip(returned, plan.send):
            start = 0
            for g, index in enumerate(per_head):
                n = batch * int(index.numel()) * dim
                piece = flat[start : start + n].view(batch, -1, dim)
                local[:, :, g].index_add_(1, index, piece)
                start += n
        return local, None, None


def context_parallel_bytes(
    pattern: BlockPattern,
    batch: int,
    seq: int,
    kv_heads: int,
    dim: int,
    dtype: torch.dtype,
    world_size: int,
) -> list[int]:
    """Bytes of K and V each rank receives in one forward of :func:`context_parallel_attention`
    (the backward sends as many back): only the tokens its queries read, per KV head. Compare
    with :func:`communication_bytes`, an all-gather's."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return [
        2 * batch * dim * itemsize
        * _exchange_plan(pattern, seq, world_size, r, kv_heads).tokens_received()
        for r in range(world_size)
    ]  # fmt: skip


def unshard(
    x: torch.Tensor, group: dist.ProcessGroup | None = None, *, seq_dim: int = 1
) -> torch.Tensor:
    """The full tensor from every rank's shard (the inverse of :func:`shard`), on every rank.

    Args:
        x: this rank's shard, e.g. (batch, seq / W, heads, dim); the same shape on every rank.
        group: the process group (default: the world).
        seq_dim: the sequence dimension of ``x``.

    Returns:
        (batch, seq, heads, dim). Differentiable: the backward sums every rank's gradient of the
        full tensor into the owner's shard (as when each rank's loss is one term of a sum).
    """
    _world(group)
    seq_dim = _check_seq_dim(x, seq_dim)
    if x.shape[seq_dim] % 2 != 0:
        raise ValueError(
            f"a shard holds two equal chunks: its length along seq_dim ({x.shape[seq_dim]}) must "
            "be even"
        )
    return _gather_sequence(x, group, seq_dim)


def communication_bytes(
    batch: int, seq: int, kv_heads: int, dim: int, dtype: torch.dtype, world_size: int
) -> int:
    """Bytes each rank would receive for K and V in one forward from an all-gather of the whole
    sequence; :func:`context_parallel_bytes` gives what it does receive."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * batch * seq * kv_heads * dim * itemsize * (world_size - 1) // world_size


def _fingerprint(pattern: BlockPattern) -> int:
    fp = _FINGERPRINTS.get(pattern)
    if fp is None:
        shape = struct.pack("<4q?", *pattern._shape, pattern.block_size, pattern.causal)
        fp = zlib.crc32(pattern.cols.numpy().tobytes(), zlib.crc32(shape))
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


def _check_agreement(q, k, v, pattern, softmax_scale, group) -> None:
    """Raise the same error on every rank when any rank's arguments are bad or differ from the
    others'; one all-gather of a few integers, so a disagreement never hangs a collective."""
    world, rank = _world(group)
    problem = _local_problem(q, k, v, pattern, world, softmax_scale)
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
    on_gpu = dist.get_backend(group) == dist.Backend.NCCL
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    mine = torch.tensor(signature, dtype=torch.int64, device=device)
    everyone = mine.new_empty(world * mine.numel())
    _all_gather_single(everyone, mine, group=group)
    everyone = everyone.view(world, -1).cpu()
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
            "pattern heads, q_blocks, kv_blocks, mask crc32, softmax_scale"
        )
        raise ValueError(
            f"context_parallel_attention: ranks {differ} disagree with rank 0 on the shapes, "
            f"dtype, pattern or softmax_scale (this is rank {rank}); ({names}) per rank: "
            f"{everyone.tolist()}"
        )


# (start, chunk, seq) -> shifted pattern, per pattern (see the module docstring).
_SHIFTED: weakref.WeakKeyDictionary[BlockPattern, dict] = weakref.WeakKeyDictionary()


def _shifted(pattern: BlockPattern, start: int, chunk: int, seq: int) -> BlockPattern:
    """A bidirectional pattern over ``seq`` tokens whose last ``chunk / block`` query rows are
    ``pattern``'s rows for the queries ``[start, start + chunk)`` (all block-aligned): with the
    chunk's queries aligned bottom-right to all ``seq`` keys, each query reads its own row."""
    cache = _SHIFTED.setdefault(pattern, {})
    key = (start, chunk, seq)
    if key not in cache:
        b = pattern.block_size
        blocks, rows, first = -(-seq // b), chunk // b, start // b
        # Each head: rows first .. first + rows - 1 of the pattern, as the last rows of one
        # over `blocks` x `blocks`; the rows before them keep nothing.
        counts, kept = [], []
        for h in range(pattern.num_heads):
            row = h * pattern.num_q_blocks + first
            lo, hi = int(pattern.row_offsets[row]), int(pattern.row_offsets[row + rows])
            cols = pattern.cols[lo:hi]
            inside = cols < blocks
            per_row = torch.diff(pattern.row_offsets[row : row + rows + 1])
            row_of = torch.repeat_interleave(torch.arange(rows), per_row)
            counts += [torch.zeros(blocks - rows, dtype=torch.int64),
                       torch.bincount(row_of[inside], minlength=rows)]  # fmt: skip
            kept.append(cols[inside])
        offsets = torch.zeros(blocks * pattern.num_heads + 1, dtype=torch.int64)
        offsets[1:] = torch.cat(counts).cumsum(0)
        cache[key] = BlockPattern.from_block_lists(
            offsets, torch.cat(kept), num_heads=pattern.num_heads, num_kv_blocks=blocks,
            block_size=b, causal=False,
        )  # fmt: skip
    return cache[key]


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
        q: this rank's shard (batch, local_seq, heads, dim), laid out by :func:`shard`; the global
            sequence is ``local_seq * W`` for W ranks, and ``local_seq`` must be even.
        k, v: this rank's shards (batch, local_seq, kv_heads, dim); same dtype and device as q.
        pattern: a :class:`s2attn.BlockPattern` covering the global sequence; a bidirectional
            one needs ``local_seq / 2`` to be a multiple of its block size.
        group: the process group (default: the world). Every rank must call with the same shapes,
            dtype, pattern and ``softmax_scale``; otherwise every rank raises a ValueError (one
            all-gather of a few integers per call checks it).
        softmax_scale: defaults to ``1 / sqrt(dim)``.
        return_lse: also return the float32 LSE (batch, heads, local_seq) of this rank's rows.

    Every rank receives the K and V tokens its queries read (see :func:`context_parallel_bytes`)
    and computes its two query chunks with :func:`s2attn.sparse_attention`: under a causal
    pattern each against the keys up to the chunk's end (the kernel aligns queries bottom-right,
    so the chunk sits at its absolute position), under a bidirectional one against all keys with
    the chunk's rows of the pattern shifted to the end. The backward returns the received
    tokens' gradients to their owners. A group of one rank calls :func:`s2attn.sparse_attention`
    directly.

    Returns:
        ``out`` (batch, local_seq, heads, dim), this rank's shard of the output; with
        ``return_lse`` also ``lse`` (batch, heads, local_seq).

    Example::

        >>> # torchrun --nproc-per-node 4 ...; dist.init_process_group("nccl")
        >>> pattern = s2attn.local_stride_pattern(32, 65536, 64, local_blocks=16, vert_stride=16)
        >>> q, k, v = (shard(t) for t in (q_full, k_full, v_full))
        >>> out = unshard(context_parallel_attention(q, k, v, pattern))
    """
    _check_agreement(q, k, v, pattern, softmax_scale, group)
    world, rank = _world(group)
    if world == 1:
        return sparse_attention(
            q, k, v, pattern, softmax_scale=softmax_scale, return_lse=return_lse
        )
    plan = _exchange_plan(pattern, q.shape[1] * world, world, rank, k.shape[2], k.device)
    k_full = _ExchangeKV.apply(k, plan, group)
    v_full = _ExchangeKV.apply(v, plan, group)
    chunk = q.shape[1] // 2
    outs, lses = [], []
    seq = k_full.shape[1]
    for part, index in enumerate((rank, 2 * world - 1 - rank)):
        end = (index + 1) * chunk
        keys, chunk_pattern = end, pattern
        if not pattern.causal:
            keys, chunk_pattern = seq, _shifted(pattern, index * chunk, chunk, seq)
        result = sparse_attention(
            q[:, part * chunk : (part + 1) * chunk],
            k_full[:, :keys],
            v_full[:, :keys],
            chunk_pattern,
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
