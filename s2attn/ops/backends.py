"""The backends of each pass, declared as one table per pass: for each backend the tiles it walks,
the calls it takes, and its launcher. :mod:`s2attn.ops.dispatch` walks the tables; nothing else
decides which kernel runs.

A pass's tiles are those of the first backend in its table that runs on such inputs at all (its
``tiles`` rule, from the head dim, dtype and device alone, so that the layouts can be built before
the call, while ``torch.compile`` traces). The pass then runs on the first backend that walks those
tiles and takes the call (its ``takes`` rule, from the call itself: lengths, strides, switches,
:class:`~s2attn.ops.options.KernelOptions`). The last backend of every pass is Triton's, which
walks any tiles and takes every call: where it cannot run (a CPU without the interpreter) the
callers take the plain-PyTorch path over the kept blocks (``s2attn.ops.cpu``) instead.

To add a backend for a pass: its kernel and launcher in their own module (``ops/<language>/``),
its row in that pass's table here, and, for callers to pin or exclude it, its name among
``KernelOptions``' backends (``ops/options.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .env import GLUON_ENABLED, INTERPRETED, device_capability, tma_allowed
from .layout import TileLayout
from .options import KernelOptions
from .shapes import Varlen, keys_need_bounds
from .triton import backward as triton_backward
from .triton import decode as triton_decode
from .triton import forward as triton_forward

__all__ = [
    "DECODE",
    "DKDV",
    "DQ",
    "FORWARD",
    "BackwardLaunch",
    "DecodeBackend",
    "PassBackend",
    "PassCall",
    "Tiles",
    "row_delta",
    "supports_triton",
]

Tiles = tuple[int, int]  # (block_m, block_n) of the layout a kernel walks


# Not frozen, with slots: built for every pass of every call, where host time counts.
@dataclass(slots=True)
class PassCall:
    """What the choice of a pass's backend reads of the call. ``gather``: whether the layout of
    the pass (the forward's, or the backward's dQ layout) gathers lone blocks. ``grad_out``,
    ``out`` and the gradient buffers ``dq``, ``dk``, ``dv`` (None: allocated like their inputs)
    for the backward passes only."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    block_size: int
    causal: bool
    gather: bool
    varlen: Varlen | None
    softmax_scale: float
    options: KernelOptions
    grad_out: torch.Tensor | None = None
    out: torch.Tensor | None = None
    dq: torch.Tensor | None = None
    dk: torch.Tensor | None = None
    dv: torch.Tensor | None = None


@dataclass(slots=True)
class BackwardLaunch:
    """The tensors and scalars the backward's launchers share. ``delta``: each row's term
    sum(dO * O) (minus the LSE's gradient); ``stats``: each row's (LSE * log2(e), delta) padded
    to 16 bytes, set once the backends are chosen when the dK/dV one reads them, else None."""

    grad_out: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    out: torch.Tensor
    lse: torch.Tensor
    grad_lse: torch.Tensor | None
    delta: torch.Tensor
    stats: torch.Tensor | None
    dq: torch.Tensor
    dk: torch.Tensor
    dv: torch.Tensor
    varlen: Varlen | None
    packed: bool
    softmax_scale: float
    q_heads_per_pattern_head: int
    options: KernelOptions


@dataclass(frozen=True)
class PassBackend:
    """One row of a pass's table.

    tiles: (head_dim, dtype, device) -> the tiles it walks for such inputs, None where it never
        runs. Reads nothing but its arguments and the GPU's capability.
    takes: (call, tiles) -> whether it runs this call at those tiles.
    launch: the forward's ``(q, k, v, out, lse, layout, *, softmax_scale,
        q_heads_per_pattern_head, varlen, options)``; the backward passes' ``(BackwardLaunch,
        layout)``. Writes the pass's outputs in place.
    walks_any_tiles: it runs on layouts of any tiles, not only its own.
    computes_delta: (dQ) it launches before dK/dV and computes the row term ``delta`` (and the
        row statistics) on the way; otherwise Triton's row-delta kernel computes them first.
    reads_row_stats: (dK/dV) it reads ``BackwardLaunch.stats``, which then are computed.
    """

    name: str
    tiles: Callable[[int, torch.dtype, torch.device], Tiles | None]
    takes: Callable[[PassCall, Tiles], bool]
    launch: Callable[..., None]
    walks_any_tiles: bool = False
    computes_delta: bool = False
    reads_row_stats: bool = False


@dataclass(frozen=True)
class DecodeBackend:
    """One row of the decode table.

    runs_on: device -> whether it runs there.
    num_splits: (batch, num_kv_heads, longest_list, device) -> its programs per (sequence, KV
        head) for a step whose longest list is ``longest_list`` pages.
    launch: :func:`s2attn.ops.triton.decode.decode`'s arguments and results.
    """

    name: str
    runs_on: Callable[[torch.device], bool]
    num_splits: Callable[[int, int, int, torch.device], int]
    launch: Callable[..., tuple[torch.Tensor, torch.Tensor]]


def supports_triton(device: torch.device) -> bool:
    """Whether the Triton kernels run on ``device``: a CUDA GPU, or the CPU under the
    interpreter. They take every call there; elsewhere callers take the PyTorch path
    over the kept blocks (``s2attn.ops.cpu``)."""
    return device.type == "cuda" or (device.type == "cpu" and INTERPRETED)


def _any_call(call: PassCall, tiles: Tiles) -> bool:
    return True


# ------------------------------------------------------------------------------------- Triton
def _triton_forward_tiles(head_dim: int, dtype: torch.dtype, device: torch.device) -> Tiles:
    """128-row tiles give the tensor cores full-height MMAs and, with 64-token blocks, merge two
    query blocks per tile (Merge-Q halves the KV traffic). 256-wide heads and fp32 halve the tile
    to stay inside shared memory. Under the interpreter, large tiles mean fewer (slow) programs.
    """
    if device.type != "cuda":
        return 64, 32
    if dtype.itemsize > 2 or head_dim > 128:
        return 64, 64 if head_dim <= 128 else 32
    return 128, 64


def _triton_dkdv_tiles(head_dim: int, dtype: torch.dtype, device: torch.device) -> Tiles:
    """dK/dV programs hold a KV tile and its two accumulators, so their query tiles stay small.
    Measured on H100 (benchmarks/tuning/sweep_tiles.py, 32k, V16, dim 128, bf16): 64x64 tiles
    with 4 warps and 2 stages were best among 20 configurations."""
    if device.type != "cuda" or dtype.itemsize > 2 or head_dim > 128:
        return 32, 64
    return 64, 64


def _triton_dq_tiles(head_dim: int, dtype: torch.dtype, device: torch.device) -> Tiles:
    """dQ programs hold one accumulator, so they take tall query tiles and narrow KV tiles; on
    2-byte inputs up to dim 128, 64x64 (the same sweep: best among 16 configurations)."""
    if device.type != "cuda" or dtype.itemsize > 2 or head_dim > 128:
        return 64, 32
    return 64, 64


def _triton_forward(
    q, k, v, out, lse, layout, *, softmax_scale, q_heads_per_pattern_head, varlen, options
) -> None:
    triton_forward.forward(
        q,
        k,
        v,
        out,
        lse,
        layout,
        softmax_scale=softmax_scale,
        q_heads_per_pattern_head=q_heads_per_pattern_head,
        varlen=varlen,
        config=options.triton_forward,
    )


def _triton_dkdv(b: BackwardLaunch, layout: TileLayout, *, contiguous: bool = True) -> None:
    """The Triton dK/dV kernel; ``contiguous`` False: only the layout's gathered KV tiles, adding
    to what another backend's contiguous pass wrote."""
    triton_backward.dkdv(
        b.grad_out,
        b.q,
        b.k,
        b.v,
        b.lse,
        b.delta,
        b.dk,
        b.dv,
        layout,
        varlen=b.varlen,
        config=b.options.triton_dkdv,
        contiguous=contiguous,
        softmax_scale=b.softmax_scale,
        q_heads_per_pattern_head=b.q_heads_per_pattern_head,
    )


def _triton_dq(b: BackwardLaunch, layout: TileLayout) -> None:
    triton_backward.dq(
        b.grad_out,
        b.q,
        b.k,
        b.v,
        b.lse,
        b.delta,
        b.dq,
        layout,
        varlen=b.varlen,
        config=b.options.triton_dq,
        softmax_scale=b.softmax_scale,
        q_heads_per_pattern_head=b.q_heads_per_pattern_head,
    )


def row_delta(b: BackwardLaunch) -> None:
    """The row term ``delta`` (and ``stats`` when given), for dQ backends that do not compute it."""
    triton_backward.row_delta(
        b.out, b.grad_out, b.lse, b.grad_lse, b.delta, b.stats, packed=b.packed
    )


def _triton_decode(
    q, k_pages, v_pages, page_table, seq_lens, layout, *, softmax_scale, num_splits, split_counters
) -> tuple[torch.Tensor, torch.Tensor]:
    return triton_decode.decode(
        q,
        k_pages,
        v_pages,
        page_table,
        seq_lens,
        layout,
        softmax_scale=softmax_scale,
        num_splits=num_splits,
        split_counters=split_counters,
    )


# ------------------------------------------------------------------------------- Gluon, sm_90
# The Gluon modules are imported where they launch: only calls that run them load Triton's
# experimental Gluon API.
def _gluon_sm90_tiles(tiles: Tiles, *, head_dims: tuple[int, ...]):
    """A Gluon kernel's tile rule: ``tiles`` for fp16 or bf16 inputs of ``head_dims`` on an sm_90
    GPU, else None."""

    def rule(head_dim: int, dtype: torch.dtype, device: torch.device) -> Tiles | None:
        if head_dim not in head_dims or dtype not in (torch.float16, torch.bfloat16):
            return None
        if device.type != "cuda" or device_capability(device) != (9, 0):
            return None
        return tiles

    return rule


def _gluon_enabled() -> bool:
    """Compiled kernels (not the interpreter) and ``S2ATTN_HOPPER_FORWARD`` not 0."""
    return not INTERPRETED and GLUON_ENABLED


def _gluon_forward_tiles_take(call: PassCall, tiles: Tiles) -> bool:
    """What the Gluon forward and dQ kernels need of a call: batched inputs fit for bulk copies,
    no gathered entries, no key bound to check in full entries, a positive scale."""
    if call.varlen is not None or not _gluon_enabled():
        return False
    # Gathered entries (lone blocks smaller than a KV tile) are the Triton kernels' alone.
    if call.gather and call.block_size < tiles[1]:
        return False
    k = call.k
    if keys_need_bounds(call.causal, call.block_size, tiles[1], k.shape[1], False):
        return False
    return call.softmax_scale > 0 and tma_allowed(call.q.device, call.q, k, call.v)


def _gluon_forward_takes(call: PassCall, tiles: Tiles) -> bool:
    return call.options.forward_backend != "triton" and _gluon_forward_tiles_take(call, tiles)


def _gluon_dq_takes(call: PassCall, tiles: Tiles) -> bool:
    """The Gluon forward's cases, with dO and O fit for bulk copies and dQ's last dim dense."""
    return (
        call.options.dq_backend != "triton"
        and (call.dq is None or call.dq.stride(-1) == 1)
        and _gluon_forward_tiles_take(call, tiles)
        and tma_allowed(call.q.device, call.grad_out, call.out)
    )


def _gluon_dkdv_takes(call: PassCall, tiles: Tiles) -> bool:
    """Batched inputs fit for bulk copies with as many queries as keys, dK and dV (when given)
    leaving by bulk copy too."""
    q, k = call.q, call.k
    given = (t for t in (call.dk, call.dv) if t is not None)
    return (
        call.options.dkdv_backend != "triton"
        and call.varlen is None
        and q.shape[1] == k.shape[1]
        and _gluon_enabled()
        and tma_allowed(q.device, q, k, call.v, call.grad_out, *given)
    )


def _gluon_forward(
    q, k, v, out, lse, layout, *, softmax_scale, q_heads_per_pattern_head, varlen, options
) -> None:
    from .gluon import forward_sm90

    forward_sm90.forward(
        q,
        k,
        v,
        out,
        lse,
        layout,
        softmax_scale=softmax_scale,
        q_heads_per_pattern_head=q_heads_per_pattern_head,
        config=options.gluon_forward,
    )


def _gluon_dkdv(b: BackwardLaunch, layout: TileLayout) -> None:
    """The Gluon dK/dV kernel over the contiguous lists, then Triton's over the gathered KV
    tiles' far uses (the Gluon kernel takes none)."""
    from .gluon import backward_sm90

    backward_sm90.dkdv(
        b.grad_out,
        b.q,
        b.k,
        b.v,
        b.stats,
        b.dk,
        b.dv,
        layout,
        config=b.options.gluon_dkdv,
        softmax_scale=b.softmax_scale,
        q_heads_per_pattern_head=b.q_heads_per_pattern_head,
    )
    _triton_dkdv(b, layout, contiguous=False)


def _gluon_dq(b: BackwardLaunch, layout: TileLayout) -> None:
    from .gluon import backward_sm90

    backward_sm90.dq(
        b.grad_out,
        b.q,
        b.k,
        b.v,
        b.out,
        b.lse,
        b.grad_lse,
        b.delta,
        b.stats,
        b.dq,
        layout,
        config=b.options.gluon_dq,
        softmax_scale=b.softmax_scale,
        q_heads_per_pattern_head=b.q_heads_per_pattern_head,
    )


# ----------------------------------------------------------------------------------- the tables
# In order of preference. The Gluon kernels' tiles are the Triton kernels' on the same inputs,
# except dQ's at dim 128, which the Triton dQ then walks too where the Gluon one declines a call.
FORWARD: tuple[PassBackend, ...] = (
    PassBackend(
        "gluon",
        tiles=_gluon_sm90_tiles((128, 64), head_dims=(64, 128)),
        takes=_gluon_forward_takes,
        launch=_gluon_forward,
    ),
    PassBackend(
        "triton",
        tiles=_triton_forward_tiles,
        takes=_any_call,
        launch=_triton_forward,
        walks_any_tiles=True,
    ),
)
DKDV: tuple[PassBackend, ...] = (
    PassBackend(
        "gluon",
        tiles=_gluon_sm90_tiles((64, 64), head_dims=(64, 128)),
        takes=_gluon_dkdv_takes,
        launch=_gluon_dkdv,
        reads_row_stats=True,
    ),
    PassBackend(
        "triton",
        tiles=_triton_dkdv_tiles,
        takes=_any_call,
        launch=_triton_dkdv,
        walks_any_tiles=True,
    ),
)
DQ: tuple[PassBackend, ...] = (
    # At dim 64 the Gluon dQ measured no faster than the Triton one (H100, 8k fwd+bwd 1.16 vs
    # 1.11 ms): it runs at dim 128 alone, and dim 64 keeps the Triton tiles.
    PassBackend(
        "gluon",
        tiles=_gluon_sm90_tiles((128, 64), head_dims=(128,)),
        takes=_gluon_dq_takes,
        launch=_gluon_dq,
        computes_delta=True,
    ),
    PassBackend(
        "triton",
        tiles=_triton_dq_tiles,
        takes=_any_call,
        launch=_triton_dq,
        walks_any_tiles=True,
    ),
)
DECODE: tuple[DecodeBackend, ...] = (
    DecodeBackend(
        "triton",
        # Looked up at each call, as the launchers look up their kernels: a stand-in patched
        # over the module's name (scripts/profile_decode_host.py stubs the kernels) holds here.
        runs_on=lambda device: supports_triton(device),
        num_splits=triton_decode.decode_num_splits,
        launch=_triton_decode,
    ),
)
