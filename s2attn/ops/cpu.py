"""The attention ops in plain PyTorch, for devices no Triton backend serves (a CPU without the
interpreter): the call plan's forward and backward over the kept blocks
(:func:`blockwise_forward`, :func:`blockwise_backward`), and the decode step's page write and
attention over a paged KV cache (:func:`write_pages`, :func:`paged_attention`), which vLLM's
layout shares. ``s2attn.reference`` holds the ground truth they are tested against.

The blockwise passes walk the query blocks a tile of rows at a time. A tile's work for every
batch entry and every head is one batched matmul over the KV blocks the tile keeps, gathered
into one tensor (heads that keep fewer blocks padded with masked ones): few, large operations,
so that Python's overhead stays small next to the arithmetic. On a CPU the caller's torch
threads work as independent workers, each taking the next tile and running its operations on
one thread (:func:`_each_tile`).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from ..pattern import BlockPattern

__all__ = ["blockwise_backward", "blockwise_forward", "paged_attention", "write_pages"]

# Query rows per tile. A tile walks the union of its query blocks' KV blocks, so more rows cost
# more masked work (13% more scores than kept at 128 rows, block 64, an 8-block window); fewer
# make smaller matmuls, which run further below the CPU's peak.
_TILE_ROWS = 128
# exp2 runs at about twice exp's speed on a CPU: scores are kept in base 2, log2(e) folded into
# the queries' scale.
_LOG2E = 1.0 / math.log(2.0)
# Scores the workers' tiles hold at once (elements): beyond it a tile's heads go in chunks, which
# bounds the work buffers (64 MiB of each kind in float32, all workers together) whatever the
# batch, head and thread counts.
_TILE_SCORES = 1 << 24


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


# ------------------------------------------------------------------------------- the tiles
@dataclass(frozen=True)
class _Tile:
    """One query tile: its rows ``[row0, row1)`` of the sequence, and per pattern head the KV
    blocks it reads, ``cols`` (heads, n), padded with block 0 where a head keeps fewer. Each
    head's blocks that need a token mask (partial blocks, padding) come last, in the last
    ``masked`` columns, whose scores ``hidden`` (heads, rows, masked * block) hides; None when
    no score of the tile is hidden (inner blocks, fully visible)."""

    row0: int
    row1: int
    cols: torch.Tensor
    masked: int
    hidden: torch.Tensor | None

    def heads(self, first: int, stop: int) -> _Tile:
        """The tile of pattern heads ``[first, stop)``."""
        hidden = None if self.hidden is None else self.hidden[first:stop]
        return _Tile(self.row0, self.row1, self.cols[first:stop], self.masked, hidden)


# Query tiles whose block lists are read from the pattern at once: one call per head for this
# many tiles (a call costs far more than a tile's share of its work).
_TILES_PER_READ = 32


def _tiles(pattern: BlockPattern, seq_q: int, seq_k: int, device: torch.device):
    """The query tiles of a sequence of ``seq_q`` queries and ``seq_k`` keys (queries aligned
    bottom-right), their masks on ``device``."""
    bs, heads = pattern.block_size, pattern.num_heads
    offset = seq_k - seq_q
    first_block, stop_block = offset // bs, -(-seq_k // bs)
    per_tile = max(1, _TILE_ROWS // bs)
    for c0 in range(first_block, stop_block, per_tile * _TILES_PER_READ):
        c1 = min(c0 + per_tile * _TILES_PER_READ, stop_block)
        lists = [pattern.row_blocks(h, c0, c1) for h in range(heads)]
        h = torch.cat([torch.full_like(i, n) for n, (i, _) in enumerate(lists)])
        i, j = torch.cat([i for i, _ in lists]), torch.cat([j for _, j in lists])
        keep = j < stop_block
        if pattern.causal:
            keep &= j <= i  # blocks past the diagonal hold no visible key
        h, i, j = h[keep], i[keep], j[keep]
        t = (i - c0) // per_tile
        # Each (tile, head)'s union of KV blocks, sorted, and every pair's column in it.
        union, column_of = torch.unique((t * heads + h) * stop_block + j, return_inverse=True)
        tile_head, union_j = union // stop_block, union % stop_block
        counts = torch.bincount(tile_head, minlength=-(-(c1 - c0) // per_tile) * heads)
        starts = counts.cumsum(0) - counts
        column = torch.arange(union.numel()) - starts[tile_head]
        pair_column = column[column_of]
        for n, i0 in enumerate(range(c0, c1, per_tile)):
            i1 = min(i0 + per_tile, stop_block)
            width = int(counts[n * heads : (n + 1) * heads].max())
            if width == 0:
                continue  # no head keeps a block: the rows keep their 0 and -inf
            at = (tile_head >= n * heads) & (tile_head < (n + 1) * heads)
            cols = torch.zeros(heads, width, dtype=torch.int64)
            cols[tile_head[at] - n * heads, column[at]] = union_j[at]
            kept = torch.zeros(heads, i1 - i0, width, dtype=torch.bool)
            mine = t == n
            kept[h[mine], i[mine] - i0, pair_column[mine]] = True
            yield _tile(cols, kept, i0, offset, seq_k, bs, pattern.causal, device)


def _tile(cols, kept, i0, offset, seq_k, bs, causal, device) -> _Tile:
    """A :class:`_Tile` from its padded block lists ``cols`` (heads, n) and which of its row
    blocks keeps which column, ``kept`` (heads, row blocks, n)."""
    q_pos = torch.arange(max(i0 * bs, offset), min((i0 + kept.shape[1]) * bs, seq_k))
    row0, row1 = int(q_pos[0]) - offset, int(q_pos[-1]) + 1 - offset
    # A kept block every row of the tile sees in full needs no mask.
    whole = cols * bs + bs <= seq_k
    if causal:
        whole &= cols < i0  # every query of the tile is past the block's last key
    full = kept.all(dim=1) & whole  # padding is not
    masked = int((~full).sum(dim=1).max())
    if masked == 0:
        return _Tile(row0, row1, cols.to(device), 0, None)
    # Full columns first, so that one slice of the scores holds every hidden one.
    order = torch.sort(full.to(torch.int8), dim=1, descending=True, stable=True).indices
    cols = cols.gather(1, order)
    tail = cols[:, -masked:]  # (heads, masked)
    tail_kept = kept.gather(2, order[:, None].expand_as(kept))[:, :, -masked:]
    k_pos = tail[:, :, None] * bs + torch.arange(bs)  # (heads, masked, bs)
    row_block = q_pos // bs - i0
    shown = tail_kept[:, row_block, :, None] & (k_pos < seq_k)[:, None]  # (heads, rows, masked, bs)
    if causal:
        shown &= q_pos[None, :, None, None] >= k_pos[:, None]
    hidden = ~shown.flatten(2)
    # Built on the host, where the pattern's block lists live; used where q is.
    return _Tile(row0, row1, cols.to(device), masked, hidden.to(device))


# ------------------------------------------------------------------------- one sequence run
class _Run:
    """One pass over sequences of equal lengths: the keys and values laid out for batched
    matmuls, per KV head in whole blocks, (batch, KV heads, blocks, block, dim), zero past the
    last key; and the work buffers a tile's rows of the per-query tensors are copied into, from
    (batch, seq_q, heads, ...) tensors seen as (batch, pattern heads, per, seq_q, ...)
    (:meth:`query_view`)."""

    def __init__(self, pattern, q, k, v, scale, compute):
        batch, seq_q, num_heads, _ = q.shape
        seq_k, kv_heads = k.shape[1], k.shape[2]
        bs = pattern.block_size
        self.pattern, self.scale, self.compute = pattern, scale, compute
        self.batch, self.seq_q, self.seq_k = batch, seq_q, seq_k
        self.per = num_heads // pattern.num_heads
        self.num_blocks = -(-seq_k // bs)
        # As :func:`_tiles` walks them: from the first query's block on.
        num_tiles = -(-(self.num_blocks - (seq_k - seq_q) // bs) // max(1, _TILE_ROWS // bs))
        # Workers (:func:`_each_tile`): the caller's torch threads on a CPU, at most one a tile.
        self.workers = min(torch.get_num_threads(), num_tiles) if q.device.type == "cpu" else 1
        self.scatter_lock = threading.Lock()  # the workers add into one dk and dv
        # The KV head of each pattern head.
        self.kv_head = (
            torch.arange(pattern.num_heads, device=q.device) * self.per // (num_heads // kv_heads)
        )
        # Queries carry the scale, in base 2: one multiply of q instead of one of every score.
        self.q = self.query_view(q)
        self.q_scale = scale * _LOG2E
        self.k, self.v = self.key_layout(k), self.key_layout(v)
        self._local = threading.local()  # each worker thread's buffers

    def buffer(self, name: str, *shape: int) -> torch.Tensor:
        """A reused work buffer of ``shape`` (its contents are garbage): tiles of one run differ
        little in size, and a fresh tensor of a few MB costs its pages' faults on every tile."""
        numel = math.prod(shape)
        if not hasattr(self._local, "buffers"):
            self._local.buffers = {}
        held = self._local.buffers.get(name)
        if held is None or held.numel() < numel:
            held = self._local.buffers[name] = self.k.new_empty(numel)
        return held[:numel].view(shape)

    def query_view(self, t: torch.Tensor) -> torch.Tensor:
        """(batch, seq_q, heads, ...) seen as (batch, pattern heads, per, seq_q, ...), a view."""
        return t.unflatten(2, (self.pattern.num_heads, self.per)).movedim(1, 3)

    def from_key_layout(self, t: torch.Tensor) -> torch.Tensor:
        """:meth:`key_layout`'s inverse, as a view: (batch, seq_k, kv_heads, dim)."""
        b, h, _, _, d = t.shape
        return t.view(b, h, -1, d)[:, :, : self.seq_k].transpose(1, 2)

    def key_layout(self, t: torch.Tensor) -> torch.Tensor:
        """(batch, seq_k, kv_heads, dim) -> (batch, kv_heads, blocks, block, dim)."""
        b, s, h, d = t.shape
        bs = self.pattern.block_size
        blocks = t.new_empty(b, h, self.num_blocks * bs, d, dtype=self.compute)
        blocks[:, :, :s] = t.transpose(1, 2)
        blocks[:, :, s:] = 0
        return blocks.view(b, h, self.num_blocks, bs, d)

    def head_chunks(self, tile: _Tile):
        """(first head, the tile of heads ``[first, first + G)``), in chunks whose scores fit
        the workers' share of ``_TILE_SCORES``."""
        heads, n = tile.cols.shape
        per_head = self.batch * self.per * (tile.row1 - tile.row0) * n * self.pattern.block_size
        step = max(1, _TILE_SCORES // self.workers // per_head)
        if step >= heads:
            yield 0, tile
            return
        for a in range(0, heads, step):
            yield a, tile.heads(a, min(a + step, heads))

    def block_index(self, first: int, tile: _Tile) -> torch.Tensor:
        """The flat (KV head, block) index of each of the tile's columns, (G * n,)."""
        g = tile.cols.shape[0]
        kv_head = self.kv_head[first : first + g, None]
        return (kv_head * self.num_blocks + tile.cols).flatten()

    def gather(self, name: str, blocks: torch.Tensor, index: torch.Tensor, heads: int):
        """The blocks at ``index`` of ``blocks`` (batch, kv_heads, blocks, block, dim), as
        (batch * heads, n * block, dim), in the work buffer ``name``."""
        b, _, _, bs, d = blocks.shape
        flat = blocks.view(b, -1, bs * d)
        # One contiguous block per index: a row copy each, where a multi-dimensional index
        # would compute every element's address.
        picked = self.buffer(name, b, index.numel(), bs * d)
        for n in range(b):
            torch.index_select(flat[n], 0, index, out=picked[n])
        return picked.view(b * heads, -1, d)

    def rows(self, name: str, t: torch.Tensor, first: int, tile: _Tile, scale: float = 1.0):
        """The tile's rows of heads ``[first, first + G)`` of ``t`` (a :meth:`query_view`) times
        ``scale``, as (batch * G, per * rows, ...) in the compute dtype, in the work buffer
        ``name``."""
        g = tile.cols.shape[0]
        picked = t[:, first : first + g, :, tile.row0 : tile.row1]
        rows = self.buffer(name, *picked.shape)
        rows.copy_(picked)
        if scale != 1.0:
            # In the compute dtype: mul(picked, scale, out=rows) would round the product to a
            # half-precision input's dtype before storing it.
            rows.mul_(scale)
        return rows.view(self.batch * g, -1, *picked.shape[4:])

    def queries(self, first: int, tile: _Tile) -> torch.Tensor:
        """:meth:`rows` of the queries, scaled for base-2 scores."""
        return self.rows("queries", self.q, first, tile, self.q_scale)

    @staticmethod
    def tile_view(t: torch.Tensor, first: int, tile: _Tile) -> torch.Tensor:
        """The tile's rows of heads ``[first, first + G)`` of ``t`` (a :meth:`query_view`)."""
        return t[:, first : first + tile.cols.shape[0], :, tile.row0 : tile.row1]

    def scores(self, tile: _Tile, q_rows: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """The tile's masked base-2 scores (batch * G, per * rows, n * block), in the work
        buffer ``scores``."""
        scores = self.buffer("scores", *q_rows.shape[:2], keys.shape[1])
        torch.bmm(q_rows, keys.transpose(1, 2), out=scores)
        if tile.hidden is not None:
            g, n = tile.cols.shape
            view = scores.view(self.batch, g, self.per, tile.row1 - tile.row0, -1)
            view[..., (n - tile.masked) * self.pattern.block_size :].masked_fill_(
                tile.hidden[None, :, None], float("-inf")
            )
        return scores

    def scatter_add(self, into: torch.Tensor, index: torch.Tensor, grads: torch.Tensor) -> None:
        """Add the (batch * G, n * block, dim) gradients of gathered blocks into ``into``
        (batch, kv_heads, blocks, block, dim): GQA heads sharing a KV head add up."""
        b, _, _, bs, d = into.shape
        flat = into.view(b, -1, bs * d)
        grads = grads.view(b, index.numel(), bs * d)
        with self.scatter_lock:
            for n in range(b):
                flat[n].index_add_(0, index, grads[n])


def _each_tile(run: _Run, tiles: Iterator[_Tile], work: Callable[[int, _Tile], None]) -> None:
    """Call ``work(first head, tile of heads)`` on every head chunk of every tile.

    On a CPU the caller's torch threads become workers that each take the next tile when done
    with one, each running its operations on one thread: a worker whose core another process
    shares does less of the work, where the threads of one OpenMP region would all wait for it
    at the region's end, thousands of times a call. Workers other than the first are torch
    threads of their own; the default thread count they change is the caller's again after."""
    workers = run.workers
    if workers == 1:
        for tile in tiles:
            for first, part in run.head_chunks(tile):
                work(first, part)
        return
    lock = threading.Lock()
    inference = torch.is_inference_mode_enabled()

    def loop() -> None:
        torch.set_num_threads(1)
        with torch.inference_mode(inference), torch.no_grad():
            while True:
                with lock:
                    tile = next(tiles, None)
                if tile is None:
                    return
                for first, part in run.head_chunks(tile):
                    work(first, part)

    threads = torch.get_num_threads()
    try:
        with ThreadPoolExecutor(workers, thread_name_prefix="s2attn-cpu") as pool:
            for done in [pool.submit(loop) for _ in range(workers)]:
                done.result()
    finally:
        torch.set_num_threads(threads)


def _packed_sequences(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor):
    """(query rows, key rows) of each packed sequence."""
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    return [(slice(a, b), slice(c, d)) for a, b, c, d in zip(cq, cq[1:], ck, ck[1:])]


# --------------------------------------------------------------------------------- the passes
def blockwise_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pattern: BlockPattern,
    *,
    softmax_scale: float,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``s2attn.reference.attention_reference``'s (out, lse) on validated inputs, over the KV
    blocks each query tile keeps.

    Computes in float32 (float64 for float64 inputs); ``out`` comes back contiguous in q's
    dtype, ``lse`` (batch, heads, seq_q) or (heads, total_q) in the compute dtype, -inf (with
    output 0) for rows that attend nothing.

    Memory beyond the inputs and the outputs (``out`` in the compute dtype first): k and v
    in the compute dtype, padded to whole blocks, of one packed sequence at a time; and the work
    buffers of one query tile of ``T = max(128, block)`` rows for ``G`` pattern heads, one set
    per worker (:func:`_each_tile`, one per torch thread): scores
    ``batch * G * per * T * keys`` elements (``per`` query heads a pattern head, ``keys`` the
    most keys one head's tile keeps: its blocks' union, under ``(window + T / block +
    seq_k / stride) * block`` for a local-stride pattern), gathered keys and values ``batch * G
    * keys * dim`` each, and ``batch * G * per * T * dim`` twice. ``G`` is every head, or as many
    as keep every worker's scores together within ``2**24`` elements (at least one): linear in
    the length, never (seq_q, seq_k).
    """
    compute = _compute_dtype(q.dtype)
    out = torch.zeros(q.shape, dtype=compute, device=q.device)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=compute, device=q.device)
    if cu_seqlens_q is None:
        _forward_run(pattern, q, k, v, softmax_scale, compute, out, lse)
        return out.to(q.dtype), lse.permute(0, 2, 1).contiguous()
    for rows, cols in _packed_sequences(cu_seqlens_q, cu_seqlens_k):
        _forward_run(
            pattern,
            q[None, rows],
            k[None, cols],
            v[None, cols],
            softmax_scale,
            compute,
            out[None, rows],
            lse[None, rows],
        )
    return out.to(q.dtype), lse.permute(1, 0).contiguous()


def _forward_run(pattern, q, k, v, scale, compute, out, lse) -> None:
    """Write ``out`` (batch, seq_q, heads, dim) and ``lse`` (batch, seq_q, heads), zero and
    -inf until then, of sequences of one length."""
    if 0 in (q.shape[0], q.shape[1], k.shape[1]):
        return
    run = _Run(pattern, q, k, v, scale, compute)
    out, lse = run.query_view(out), run.query_view(lse)
    tiles = _tiles(pattern, run.seq_q, run.seq_k, q.device)
    _each_tile(run, tiles, lambda first, part: _forward_tile(run, first, part, out, lse))


def _forward_tile(run: _Run, first: int, tile: _Tile, out, lse) -> None:
    """The tile's rows of ``out`` and ``lse`` (in the run's layout) of its heads, which start
    at pattern head ``first``."""
    g = tile.cols.shape[0]
    index = run.block_index(first, tile)
    q_rows = run.queries(first, tile)
    scores = run.scores(tile, q_rows, run.gather("keys", run.k, index, g))
    row_max = scores.amax(dim=-1, keepdim=True)
    row_max.masked_fill_(row_max == float("-inf"), 0.0)  # rows that see no key
    probs = scores.sub_(row_max).exp2_()
    total = probs.sum(dim=-1, keepdim=True)
    values = run.gather("values", run.v, index, g)
    tile_out = run.buffer("out", *q_rows.shape)
    torch.bmm(probs, values, out=tile_out)
    # The largest term is 2^0 = 1 in a row that sees a key: only empty rows sum below 1.
    tile_out.div_(total.clamp(min=1.0))
    into = run.tile_view(out, first, tile)
    into.copy_(tile_out.view(into.shape))
    into = run.tile_view(lse, first, tile)
    into.copy_(((row_max + total.log2()) / _LOG2E).view(into.shape))


def blockwise_backward(
    grad_out: torch.Tensor | None,
    grad_lse: torch.Tensor | None,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    pattern: BlockPattern,
    *,
    softmax_scale: float,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of :func:`blockwise_forward`, shaped and typed like q, k, v, from the
    gradients of out (None when only the LSE was used) and of lse (None when unused).

    Recomputes each tile's probabilities from the saved LSE, as the kernels do; dK and dV of a
    GQA group's query heads add into their KV head. Memory beyond the inputs and the gradients
    (in the compute dtype first): k, v and their gradients in the compute dtype padded to whole
    blocks, of one packed sequence at a time; and :func:`blockwise_forward`'s work buffers, with
    the scores' gradient (as large as the scores) and the gathered blocks' gradients (as large
    as the gathered keys). With more than one worker, dk and dv add the tiles' shares in an
    order that varies from call to call: they agree to rounding, not to the bit.
    """
    compute = _compute_dtype(q.dtype)
    packed = cu_seqlens_q is not None
    # Per row, as (..., rows, heads): the LSE, and what the score gradients subtract:
    # delta = rowsum(dO * O), less the LSE's gradient.
    lse_rows = (lse.permute(1, 0) if packed else lse.permute(0, 2, 1)).to(compute)
    row_term = torch.zeros_like(lse_rows)
    if grad_out is not None:
        row_term += (grad_out.to(compute) * out.to(compute)).sum(-1)
    if grad_lse is not None:
        row_term -= (grad_lse.permute(1, 0) if packed else grad_lse.permute(0, 2, 1)).to(compute)
    # In base 2; lse -inf (a row that sees no key) subtracts 0: its scores are all -inf.
    lse_rows = lse_rows * _LOG2E
    lse_rows.masked_fill_(lse_rows == float("-inf"), 0.0)
    # Strided like the inputs, as the operator's fake promises (``torch.empty_like``).
    dq, dk, dv = (torch.zeros_like(t, dtype=compute) for t in (q, k, v))
    if packed:
        runs = _packed_sequences(cu_seqlens_q, cu_seqlens_k)
        pick = lambda t, at: None if t is None else t[None, at]
    else:
        runs = [(slice(None), slice(None))]
        pick = lambda t, at: t
    for rows, cols in runs:
        _backward_run(
            pattern,
            (pick(grad_out, rows), pick(lse_rows, rows), pick(row_term, rows)),
            (pick(q, rows), pick(k, cols), pick(v, cols)),
            (pick(dq, rows), pick(dk, cols), pick(dv, cols)),
            softmax_scale,
            compute,
        )
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _backward_run(pattern, rows, inputs, grads, scale, compute) -> None:
    """Write the gradients ``grads`` (dq, dk, dv: zero until then, like q, k, v in the compute
    dtype) of sequences of one length from ``rows`` (grad_out or None, the base-2 LSE with 0 for
    -inf, and row_term: per query row) and ``inputs`` (q, k, v)."""
    q, k, v = inputs
    if 0 in (q.shape[0], q.shape[1], k.shape[1]):
        return
    run = _Run(pattern, q, k, v, scale, compute)
    grad_out, lse, row_term = (None if t is None else run.query_view(t) for t in rows)
    dq = run.query_view(grads[0])
    dk, dv = torch.zeros_like(run.k), torch.zeros_like(run.v)
    _each_tile(
        run,
        _tiles(pattern, run.seq_q, run.seq_k, q.device),
        lambda first, part: _backward_tile(run, first, part, lse, row_term, grad_out, (dq, dk, dv)),
    )
    dk /= _LOG2E  # of queries scaled by softmax_scale * log2(e)
    grads[1].copy_(run.from_key_layout(dk))
    grads[2].copy_(run.from_key_layout(dv))


def _backward_tile(run: _Run, first: int, tile: _Tile, lse, row_term, grad_out, grads):
    """Write the tile's rows of dq (a :meth:`_Run.query_view`) and add its share of dk and dv
    (in the run's key layout; dk of the queries as the run scales them, divided by log2(e)
    once at the end)."""
    dq, dk, dv = grads
    g = tile.cols.shape[0]
    index = run.block_index(first, tile)
    q_rows = run.queries(first, tile)
    keys = run.gather("keys", run.k, index, g)
    probs = run.scores(tile, q_rows, keys)
    probs.sub_(run.rows("lse", lse, first, tile)[..., None]).exp2_()
    term = run.rows("term", row_term, first, tile)[..., None]
    block_grads = run.buffer("block_grads", *keys.shape)
    if grad_out is not None:
        d_out = run.rows("d_out", grad_out, first, tile)
        d_scores = run.buffer("d_scores", *probs.shape)
        torch.bmm(d_out, run.gather("values", run.v, index, g).transpose(1, 2), out=d_scores)
        d_scores.sub_(term).mul_(probs)
        torch.bmm(probs.transpose(1, 2), d_out, out=block_grads)
        run.scatter_add(dv, index, block_grads)
    else:
        d_scores = probs.mul_(term.neg())
    tile_dq = run.buffer("out", *q_rows.shape)
    torch.bmm(d_scores, keys, out=tile_dq)
    into = run.tile_view(dq, first, tile)
    torch.mul(tile_dq.view(into.shape), run.scale, out=into)
    torch.bmm(d_scores.transpose(1, 2), q_rows, out=block_grads)
    run.scatter_add(dk, index, block_grads)


# ---------------------------------------------------------------------------- over pages
def write_pages(
    k: torch.Tensor,
    v: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
) -> None:
    """Store new tokens' K/V, (batch, num_new, kv_heads, dim), at positions ``seq_lens[b] + t``
    through ``page_table`` (batch, kv_heads, blocks); blocks without a page (-1) write into the
    last page of ``k_pages``/``v_pages`` (pages, page_size, dim), which nothing reads."""
    batch, num_new, kv_heads, dim = k.shape
    page = k_pages.shape[1]
    spare = (k_pages.shape[0] - 1) * page
    pos = seq_lens.long()[:, None] + torch.arange(num_new, device=k.device)  # (batch, new)
    pages = page_table.long().gather(2, (pos // page)[:, None, :].expand(batch, kv_heads, num_new))
    rows = torch.where(pages >= 0, pages * page + (pos % page)[:, None, :], spare)
    rows = rows.transpose(1, 2).reshape(-1)  # (batch, new, kv_heads), as k is laid out
    k_pages.view(-1, dim).index_copy_(0, rows, k.reshape(-1, dim))
    v_pages.view(-1, dim).index_copy_(0, rows, v.reshape(-1, dim))


def paged_attention(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    page_table: torch.Tensor,
    cu_seqlens_q: list[int],
    seq_lens: list[int],
    block_mask: torch.Tensor,
    *,
    block_size: int,
    softmax_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence's new queries attend its keys in a paged cache, under a block mask.

    Args:
        q: (tokens, heads, dim), the sequences' new tokens packed in order; they are each
            sequence's last positions.
        k_pages, v_pages: (pages, page_size, dim).
        page_table: int (batch, kv_heads, max_pages): the page of each (sequence, KV head, page
            of positions); -1 for none (those keys are not read).
        cu_seqlens_q: batch + 1 offsets into ``q``.
        seq_lens: per sequence, its length with the new tokens.
        block_mask: bool (mask_heads, q_blocks, kv_blocks) over pattern blocks of ``block_size``
            tokens; query head ``h`` reads mask head ``h // (heads // mask_heads)``.
        block_size: the pattern's block (a multiple or a divisor of ``page_size``).
        softmax_scale: the score scale.

    Returns ``out`` (tokens, heads, dim) in q's dtype, computed in float32 with the causal rule
    (a row that may read no key gives zeros), and ``lse`` float32 (heads, tokens), the natural-log
    LSE of each row's scores (-inf for such a row).
    """
    num_heads, dim = q.shape[1], q.shape[2]
    kv_heads, page = page_table.shape[1], k_pages.shape[1]
    group = num_heads // kv_heads
    # Each query head's mask head; per KV head, its group's.
    head_of = torch.arange(num_heads) // (num_heads // block_mask.shape[0])
    out = torch.zeros(q.shape[0], num_heads, dim, dtype=torch.float32, device=q.device)
    lse = torch.full((num_heads, q.shape[0]), float("-inf"), device=q.device)
    table = page_table.long().to(k_pages.device)
    for b, length in enumerate(seq_lens):
        start, end = cu_seqlens_q[b], cu_seqlens_q[b + 1]
        if end == start:
            continue
        q_pos = torch.arange(length - (end - start), length)
        first, last = int(q_pos[0]) // block_size, int(q_pos[-1]) // block_size
        for h in range(kv_heads):
            heads = slice(h * group, (h + 1) * group)
            # Only the blocks some query of the group keeps: memory of what the pattern reads.
            masks = block_mask[head_of[heads], first : last + 1, : last + 1]
            blocks = masks.any(dim=1).any(dim=0).nonzero().flatten()
            k_pos = (blocks[:, None] * block_size + torch.arange(block_size)).flatten()
            k_pos = k_pos[k_pos < length]
            pages = table[b, h, (k_pos // page).to(table.device)]
            at = (pages.clamp(min=0), (k_pos % page).to(pages.device))
            keys, values = k_pages[at].float(), v_pages[at].float()  # (kept keys, dim)
            # (group, queries, kept keys): the mask at block level, then the causal rule.
            allowed = block_mask[head_of[heads]][:, q_pos // block_size][:, :, k_pos // block_size]
            allowed &= k_pos[None, None, :] <= q_pos[None, :, None]
            allowed &= (pages >= 0).cpu()[None, None, :]
            qf = q[start:end, heads].float().transpose(0, 1).to(keys.device)
            scores = (qf @ keys.T) * softmax_scale
            scores = scores.masked_fill(~allowed.to(scores.device), float("-inf"))
            probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # rows seeing nothing give 0
            out[start:end, heads] = (probs @ values).transpose(0, 1).to(out.device)
            lse[heads, start:end] = torch.logsumexp(scores, dim=-1).to(lse.device)
    return out.to(q.dtype), lse
