"""Which kernels run a call, and the entry points of the passes: forward, backward (dK/dV, dQ)
and decode.

The backends of each pass are one table in :mod:`s2attn.ops.backends` (the tiles each walks, the
calls it takes, its launcher); this module walks them. :func:`forward_kernel` and
:func:`backward_kernels` return the chosen :class:`PassKernel` (backend and tiles) of a call: the
call plan (``s2attn.plan``) builds the layouts at its tiles and hands it to :func:`forward` and
:func:`backward`, which allocate the outputs and launch its backend. :func:`decode` launches the
first decode backend that runs on the device.

Inputs are validated by the caller (``s2attn.attention``). Batched: q (batch, seq_q, heads, dim),
k and v (batch, seq_k, kv_heads, dim). Packed: q (total_q, heads, dim), k and v (total_k,
kv_heads, dim), with their lengths as one :class:`~s2attn.ops.shapes.Varlen`.
``q_heads_per_pattern_head`` maps a query head to its layout head: 1 for layouts per query head,
the GQA group size for layouts per KV head.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .backends import (
    DECODE,
    DKDV,
    DQ,
    FORWARD,
    BackwardLaunch,
    DecodeBackend,
    PassBackend,
    PassCall,
    Tiles,
    row_delta,
    supports_triton,
)
from .decode_layout import DecodeLayout
from .env import INTERPRETED, POISON_OUTPUTS
from .layout import TileLayout
from .options import KernelOptions
from .shapes import Varlen, lse_dtype, sequence_lengths
from .triton import decode as triton_decode
from .triton import page_tables as triton_page_tables
from .triton import page_write as triton_page_write

__all__ = [
    "DEFAULT_OPTIONS",
    "MAX_DECODE_ROWS",
    "PassKernel",
    "backward",
    "backward_kernels",
    "backward_tile_sizes",
    "decode",
    "decode_num_splits",
    "decode_page_tables",
    "forward",
    "forward_kernel",
    "forward_tile_sizes",
    "interpreter_upcasts",
    "supports_triton",
    "write_pages",
]

DEFAULT_OPTIONS = KernelOptions()


def interpreter_upcasts(q: torch.Tensor) -> bool:
    """Whether a call computes in float32 for want of bfloat16 under the Triton interpreter.

    The interpreter runs ``tl.dot`` on bfloat16 tiles through numpy, which has no bfloat16: the
    products come out as garbage (relative errors of 1e9), with no error raised. Loads and stores
    of bfloat16 are exact, so the passes take float32 copies of their inputs and round the results
    to bfloat16 once, as a GPU kernel rounds its float32 accumulators."""
    return INTERPRETED and q.dtype == torch.bfloat16


# ---------------------------------------------------------------------------------- the choice
@dataclass(frozen=True)
class PassKernel:
    """The backend that runs one pass of a call (a name in that pass's table), and the tiles of
    the layout it walks."""

    backend: str
    block_m: int
    block_n: int


def _pass_tiles(
    table: tuple[PassBackend, ...], head_dim: int, dtype: torch.dtype, device: torch.device
) -> Tiles:
    """A pass's tiles: the first backend's that runs on such inputs (Triton's, last, always
    does)."""
    return next(t for b in table if (t := b.tiles(head_dim, dtype, device)) is not None)


def _choose(table: tuple[PassBackend, ...], call: PassCall, tiles: Tiles | None) -> PassKernel:
    """The first backend of ``table`` that runs on such inputs, walks ``tiles`` (None: the
    pass's own, those of the first backend that runs on such inputs) and takes ``call``."""
    q = call.q
    head_dim, dtype, device = q.shape[-1], q.dtype, q.device
    for backend in table:
        own = backend.tiles(head_dim, dtype, device)
        if own is None:
            continue
        if tiles is None:
            tiles = own
        if (own == tiles or backend.walks_any_tiles) and backend.takes(call, tiles):
            return PassKernel(backend.name, *tiles)
    raise RuntimeError(f"no backend of {[b.name for b in table]} takes the call at {tiles} tiles")


def _backend(table: tuple[PassBackend, ...], kernel: PassKernel) -> PassBackend:
    for backend in table:
        if backend.name == kernel.backend:
            return backend
    raise ValueError(
        f"kernel.backend is {kernel.backend!r}; this pass has {[b.name for b in table]}"
    )


def forward_tile_sizes(head_dim: int, dtype: torch.dtype, device: torch.device) -> Tiles:
    """(block_m, block_n) of the forward layout, whichever backend runs it: the tiles
    :func:`forward_kernel` chooses, which depend on nothing else."""
    return _pass_tiles(FORWARD, head_dim, dtype, device)


def backward_tile_sizes(
    head_dim: int, dtype: torch.dtype, device: torch.device
) -> tuple[Tiles, Tiles]:
    """((block_m, block_n) of the dK/dV layout, (block_m, block_n) of the dQ layout), whichever
    backends run them: the tiles :func:`backward_kernels` chooses, which depend on nothing else."""
    return _pass_tiles(DKDV, head_dim, dtype, device), _pass_tiles(DQ, head_dim, dtype, device)


def forward_kernel(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    block_size: int,
    causal: bool,
    gather: bool,
    varlen: Varlen | None,
    softmax_scale: float,
    options: KernelOptions = DEFAULT_OPTIONS,
    tiles: Tiles | None = None,
) -> PassKernel:
    """The forward's backend and tiles, for a pattern of ``block_size`` blocks (``causal`` or not)
    whose forward layout gathers lone blocks or not (``gather``): at :func:`forward_tile_sizes`'
    tiles, or at ``tiles`` (a layout's built at others), the first backend of
    ``backends.FORWARD`` that walks them and takes the call."""
    call = PassCall(q, k, v, block_size, causal, gather, varlen, softmax_scale, options)
    return _choose(FORWARD, call, tiles)


def backward_kernels(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    *,
    dq: torch.Tensor | None = None,
    dk: torch.Tensor | None = None,
    dv: torch.Tensor | None = None,
    block_size: int,
    causal: bool,
    gather_dq: bool,
    varlen: Varlen | None,
    softmax_scale: float,
    options: KernelOptions = DEFAULT_OPTIONS,
    tiles: tuple[Tiles, Tiles] | None = None,
) -> tuple[PassKernel, PassKernel]:
    """(dK/dV's, dQ's) backend and tiles, as :func:`forward_kernel` chooses the forward's, from
    ``backends.DKDV`` and ``backends.DQ``: at :func:`backward_tile_sizes`' tiles, or at ``tiles``
    (dK/dV's and dQ's, of layouts built at others). ``dq``, ``dk``, ``dv``: the buffers the
    gradients go to, or None for ones :func:`backward` allocates like their inputs (which then
    qualify for bulk copies whenever the inputs do)."""
    call = PassCall(
        q,
        k,
        v,
        block_size,
        causal,
        gather_dq,
        varlen,
        softmax_scale,
        options,
        grad_out=grad_out,
        out=out,
        dq=dq,
        dk=dk,
        dv=dv,
    )
    dkdv_tiles, dq_tiles = (None, None) if tiles is None else tiles
    return _choose(DKDV, call, dkdv_tiles), _choose(DQ, call, dq_tiles)


def _tiles(layout: TileLayout) -> Tiles:
    return layout.block_m, layout.block_n


# ------------------------------------------------------------------------------- the passes
def forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: TileLayout,
    *,
    softmax_scale: float,
    q_heads_per_pattern_head: int,
    varlen: Varlen | None = None,
    kernel: PassKernel | None = None,
    options: KernelOptions = DEFAULT_OPTIONS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over a forward layout, on validated inputs, by ``kernel`` (built at the layout's
    tiles); None to choose it here (:func:`forward_kernel` at the layout's tiles).

    Returns ``out`` like q and ``lse`` (batch, heads, seq_q), or (heads, total_q) when packed, in
    float32 (float64 for float64 inputs).
    """
    if interpreter_upcasts(q):
        out, lse = forward(
            *(t.float() for t in (q, k, v)),
            layout,
            softmax_scale=softmax_scale,
            q_heads_per_pattern_head=q_heads_per_pattern_head,
            varlen=varlen,
            kernel=kernel,
            options=options,
        )
        return out.to(q.dtype), lse
    packed, batch, seqlen_q, _ = sequence_lengths(q, k, varlen)
    num_heads = q.shape[-2]
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse_shape = (num_heads, q.shape[0]) if packed else (batch, num_heads, seqlen_q)
    lse = torch.empty(lse_shape, dtype=lse_dtype(q.dtype), device=q.device)
    if POISON_OUTPUTS:
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
    if out.numel() == 0:
        return out, lse
    if kernel is None:
        kernel = forward_kernel(
            q,
            k,
            v,
            block_size=layout.block_size,
            causal=layout.causal,
            gather=layout.gather_width > 0,
            varlen=varlen,
            softmax_scale=softmax_scale,
            options=options,
            tiles=_tiles(layout),
        )
    _check_tiles(kernel, layout, "layout")
    _backend(FORWARD, kernel).launch(
        q,
        k,
        v,
        out,
        lse,
        layout,
        softmax_scale=softmax_scale,
        q_heads_per_pattern_head=q_heads_per_pattern_head,
        varlen=varlen,
        options=options,
    )
    return out, lse


def backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    grad_lse: torch.Tensor | None,
    dkdv_layout: TileLayout,
    dq_layout: TileLayout,
    *,
    softmax_scale: float,
    q_heads_per_pattern_head: int,
    varlen: Varlen | None = None,
    kernels: tuple[PassKernel, PassKernel] | None = None,
    dq: torch.Tensor | None = None,
    dk: torch.Tensor | None = None,
    dv: torch.Tensor | None = None,
    options: KernelOptions = DEFAULT_OPTIONS,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of q, k, v (shaped like them) from ``grad_out`` (like out) and ``grad_lse``
    (like lse, or None), on a backward (per-KV-tile) layout for dK/dV and a forward one for dQ,
    by ``kernels`` (dK/dV's and dQ's, built at the layouts' tiles); None to choose them here
    (:func:`backward_kernels` at the layouts' tiles).

    ``dq``, ``dk``, ``dv`` may be given as views to write into (e.g. slices of one packed dqkv
    tensor). Up to four launches: the row term delta (by the dQ backend when it computes it on
    the way, which then goes first), dK/dV, its gathered KV tiles, then dQ. None uses atomics,
    so gradients are the same from run to run.
    """
    if interpreter_upcasts(q):
        grads = backward(
            *(t.float() for t in (grad_out, q, k, v, out)),
            lse,
            grad_lse,
            dkdv_layout,
            dq_layout,
            softmax_scale=softmax_scale,
            q_heads_per_pattern_head=q_heads_per_pattern_head,
            varlen=varlen,
            kernels=kernels,
            options=options,
        )
        given = (dq, dk, dv)
        return tuple(
            g.to(t.dtype) if d is None else d.copy_(g) for g, d, t in zip(grads, given, (q, k, v))
        )
    packed, _, seqlen_q, _ = sequence_lengths(q, k, varlen)
    dq = torch.empty_like(q) if dq is None else dq
    dk = torch.empty_like(k) if dk is None else dk
    dv = torch.empty_like(v) if dv is None else dv
    if POISON_OUTPUTS:
        for t in (dq, dk, dv):
            t.fill_(float("nan"))
    if q.numel() == 0 or k.numel() == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    launch = BackwardLaunch(
        grad_out=grad_out,
        q=q,
        k=k,
        v=v,
        out=out,
        lse=lse,
        grad_lse=grad_lse,
        delta=torch.empty_like(lse),
        stats=None,
        dq=dq,
        dk=dk,
        dv=dv,
        varlen=varlen,
        packed=packed,
        softmax_scale=softmax_scale,
        q_heads_per_pattern_head=q_heads_per_pattern_head,
        options=options,
    )
    _launch_backward(launch, dkdv_layout, dq_layout, kernels, seqlen_q)
    return dq, dk, dv


def _launch_backward(
    launch: BackwardLaunch,
    dkdv_layout: TileLayout,
    dq_layout: TileLayout,
    kernels: tuple[PassKernel, PassKernel] | None,
    seqlen_q: int,
) -> None:
    """:func:`backward`'s launches, in order, by ``kernels`` or those chosen at the layouts'
    tiles."""
    if kernels is None:
        kernels = backward_kernels(
            launch.grad_out,
            launch.q,
            launch.k,
            launch.v,
            launch.out,
            dq=launch.dq,
            dk=launch.dk,
            dv=launch.dv,
            block_size=dq_layout.block_size,
            causal=dq_layout.causal,
            gather_dq=dq_layout.gather_width > 0,
            varlen=launch.varlen,
            softmax_scale=launch.softmax_scale,
            options=launch.options,
            tiles=(_tiles(dkdv_layout), _tiles(dq_layout)),
        )
    dkdv_kernel, dq_kernel = kernels
    _check_tiles(dkdv_kernel, dkdv_layout, "dkdv_layout")
    _check_tiles(dq_kernel, dq_layout, "dq_layout")
    dkdv_backend, dq_backend = _backend(DKDV, dkdv_kernel), _backend(DQ, dq_kernel)
    if dkdv_backend.reads_row_stats:
        # Read by bulk copies: rows padded to 16 bytes.
        q = launch.q
        stats_shape = (q.shape[0] * q.shape[-2], 2, -(-seqlen_q // 4) * 4)
        launch.stats = torch.empty(stats_shape, dtype=torch.float32, device=q.device)
    if dq_backend.computes_delta:
        dq_backend.launch(launch, dq_layout)
    else:
        row_delta(launch)
    dkdv_backend.launch(launch, dkdv_layout)
    if not dq_backend.computes_delta:
        dq_backend.launch(launch, dq_layout)


def _check_tiles(kernel: PassKernel, layout: TileLayout, name: str) -> None:
    if (layout.block_m, layout.block_n) != (kernel.block_m, kernel.block_n):
        raise ValueError(
            f"{name} has {layout.block_m}x{layout.block_n} tiles but the kernel chosen for it "
            f"walks {kernel.block_m}x{kernel.block_n}"
        )


def _decode_backend(device: torch.device) -> DecodeBackend | None:
    """The first backend of ``backends.DECODE`` that runs on ``device``, None if none does."""
    return next((backend for backend in DECODE if backend.runs_on(device)), None)


def decode(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    layout: DecodeLayout,
    *,
    softmax_scale: float,
    num_splits: int = 1,
    split_counters: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A decode step over a paged KV cache by the first decode backend that runs on q's device:
    :func:`s2attn.ops.triton.decode.decode`'s arguments and results, with bfloat16 computed in
    float32 under the interpreter (see :func:`interpreter_upcasts`). Where none runs, a
    RuntimeError (callers take ``s2attn.ops.cpu.paged_attention`` there)."""
    backend = _decode_backend(q.device)
    if backend is None:
        raise RuntimeError(
            f"no decode kernel runs on {q.device} (Triton's need a CUDA GPU or TRITON_INTERPRET=1);"
            " s2attn.ops.cpu.paged_attention computes the same in PyTorch"
        )
    upcast = interpreter_upcasts(q)
    operands = (t.float() for t in (q, k_pages, v_pages)) if upcast else (q, k_pages, v_pages)
    out, lse = backend.launch(
        *operands,
        page_table,
        seq_lens,
        layout,
        softmax_scale=softmax_scale,
        num_splits=num_splits,
        split_counters=split_counters,
    )
    return (out.to(q.dtype) if upcast else out), lse


def decode_num_splits(
    batch: int, num_kv_heads: int, longest_list: int, device: torch.device
) -> int:
    """Programs per (sequence, KV head) of a decode step whose longest list is ``longest_list``
    pages, by the rule of the decode backend that runs on ``device`` (1 where none does: the
    PyTorch path takes no splits)."""
    backend = _decode_backend(device)
    return 1 if backend is None else backend.num_splits(batch, num_kv_heads, longest_list, device)


# ------------------------------------------------------------------------- the paged cache
# Query rows (new tokens times the GQA group) one decode program holds.
MAX_DECODE_ROWS = triton_decode.MAX_DECODE_ROWS


def write_pages(
    k: torch.Tensor,
    v: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    advance: bool = False,
) -> None:
    """A decode step's page write, and with ``advance`` its length update in the same launch:
    :func:`s2attn.ops.triton.page_write.write_pages`."""
    triton_page_write.write_pages(k, v, k_pages, v_pages, page_table, seq_lens, advance=advance)


# A decode step's per-KV-head page table, lengths and new positions over pages of whole blocks, in
# one launch (no other backend composes them).
decode_page_tables = triton_page_tables.decode_page_tables
