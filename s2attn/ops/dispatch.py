"""Which kernels run a call: the choice of backend and tiles, pass by pass, and the entry points
of the attention passes.

Two backends. The Triton kernels (``ops/triton/``) run wherever Triton does: any CUDA GPU, and the
CPU under ``TRITON_INTERPRET=1``. The warp-specialized Gluon kernels (``ops/gluon/*_sm90.py``)
take the common cases on an sm_90 GPU, pass by pass. One function per pass decides which backend
runs it and at which tiles (:func:`forward_kernel`, :func:`backward_kernels`, returning a
:class:`PassKernel`): the call plan (``s2attn.plan``) builds the layouts at its tiles and hands it
to :func:`forward` and :func:`backward`, which allocate the outputs and launch its backend.

Inputs are validated by the caller (``s2attn.attention``). Batched: q (batch, seq_q, heads, dim),
k and v (batch, seq_k, kv_heads, dim). Packed: q (total_q, heads, dim), k and v (total_k,
kv_heads, dim), with their lengths as one :class:`~s2attn.ops.shapes.Varlen`.
``q_heads_per_pattern_head`` maps a query head to its layout head: 1 for layouts per query head,
the GQA group size for layouts per KV head.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from .decode_layout import DecodeLayout
from .env import GLUON_ENABLED, INTERPRETED, POISON_OUTPUTS, device_capability, tma_allowed
from .layout import TileLayout
from .options import KernelOptions
from .shapes import Varlen, keys_need_bounds, lse_dtype, sequence_lengths
from .triton import backward as triton_backward
from .triton import decode as triton_decode
from .triton import forward as triton_forward
from .triton import page_write as triton_page_write

__all__ = [
    "DEFAULT_OPTIONS",
    "PassKernel",
    "backward",
    "backward_kernels",
    "backward_tile_sizes",
    "decode",
    "decode_num_splits",
    "forward",
    "forward_kernel",
    "forward_tile_sizes",
    "interpreter_upcasts",
    "run_num_splits",
    "supports_triton",
    "write_pages",
]

DEFAULT_OPTIONS = KernelOptions()


# ------------------------------------------------------------------------------ the predicates
def interpreter_upcasts(q: torch.Tensor) -> bool:
    """Whether a call computes in float32 for want of bfloat16 under the Triton interpreter.

    The interpreter runs ``tl.dot`` on bfloat16 tiles through numpy, which has no bfloat16: the
    products come out as garbage (relative errors of 1e9), with no error raised. Loads and stores
    of bfloat16 are exact, so the passes take float32 copies of their inputs and round the results
    to bfloat16 once, as a GPU kernel rounds its float32 accumulators."""
    return INTERPRETED and q.dtype == torch.bfloat16


def supports_triton(device: torch.device) -> bool:
    """Whether the Triton kernels run on ``device``: a CUDA GPU, or the CPU under the
    interpreter. They take every call there; elsewhere callers take the PyTorch path
    over the kept blocks (``s2attn.ops.cpu``)."""
    return device.type == "cuda" or (device.type == "cpu" and INTERPRETED)


# ---------------------------------------------------------------------------------- the choice
@dataclass(frozen=True)
class PassKernel:
    """The backend that runs one pass of a call, and the tiles of the layout it walks."""

    backend: Literal["gluon", "triton"]
    block_m: int
    block_n: int

    def on(self, layout: TileLayout) -> PassKernel:
        """This choice where ``layout`` has its tiles; else the Triton kernel, which walks any."""
        if (layout.block_m, layout.block_n) == (self.block_m, self.block_n):
            return self
        return PassKernel("triton", layout.block_m, layout.block_n)


# The tiles each Gluon kernel walks; the tile rules below give them wherever that kernel can run.
_GLUON_FORWARD_TILES = _GLUON_DQ_TILES = (128, 64)
_GLUON_DKDV_TILES = (64, 64)


def forward_tile_sizes(head_dim: int, dtype: torch.dtype, device: torch.device) -> tuple[int, int]:
    """(block_m, block_n) of the forward layout, whichever backend runs it: the tiles
    :func:`forward_kernel` chooses, which depend on nothing else.

    128-row tiles give the tensor cores full-height MMAs and, with 64-token blocks, merge two query
    blocks per tile (Merge-Q halves the KV traffic). 256-wide heads and fp32 halve the tile to stay
    inside shared memory. Under the interpreter, large tiles mean fewer (slow) programs.
    """
    if device.type != "cuda":
        return 64, 32
    if dtype.itemsize > 2 or head_dim > 128:
        return 64, 64 if head_dim <= 128 else 32
    return 128, 64


def backward_tile_sizes(
    head_dim: int, dtype: torch.dtype, device: torch.device
) -> tuple[tuple[int, int], tuple[int, int]]:
    """((block_m, block_n) of the dK/dV layout, (block_m, block_n) of the dQ layout), whichever
    backends run them: the tiles :func:`backward_kernels` chooses, which depend on nothing else.

    dK/dV programs hold a KV tile and its two accumulators, so their query tiles stay small;
    dQ programs hold one accumulator, so they take tall query tiles and narrow KV tiles.
    """
    if device.type != "cuda":
        return (32, 64), (64, 32)
    if dtype.itemsize > 2 or head_dim > 128:
        return (32, 64), (64, 32)
    if head_dim == 128 and device_capability(device) == (9, 0):
        # The Gluon dQ kernel's tiles; the Triton dQ walks them too where the Gluon one declines
        # the call. At dim 64 the Gluon dQ measured no faster than the Triton one (H100, 8k
        # fwd+bwd 1.16 vs 1.11 ms), so it keeps the Triton tiles there.
        return _GLUON_DKDV_TILES, _GLUON_DQ_TILES
    # Measured on H100 (benchmarks/tuning/sweep_tiles.py, 32k, V16, dim 128, bf16): 64x64 tiles
    # with 4 warps and 2 stages were best for both kernels among 20 and 16 configurations.
    return (64, 64), (64, 64)


def _gluon_sm90_runs_on(q: torch.Tensor) -> bool:
    """What every Gluon kernel needs: compiled kernels (not the interpreter) on an sm_90 GPU,
    fp16 or bf16, head dim 64 or 128, and ``S2ATTN_HOPPER_FORWARD`` not 0."""
    if INTERPRETED or not GLUON_ENABLED or q.device.type != "cuda":
        return False
    if device_capability(q.device) != (9, 0):
        return False
    return q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] in (64, 128)


def _gluon_forward_takes(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    tiles: tuple[int, int],
    *,
    block_size: int,
    causal: bool,
    gather: bool,
    varlen: Varlen | None,
    softmax_scale: float,
) -> bool:
    """Whether the Gluon forward (and the Gluon dQ, which walks the same tiles) takes a call:
    batched inputs fit for bulk copies, its tiles without gathered entries, no key bound to check
    in full entries, a positive scale."""
    if varlen is not None or not _gluon_sm90_runs_on(q):
        return False
    # Gathered entries (lone blocks smaller than a KV tile) are the Triton kernels' alone.
    if tiles != _GLUON_FORWARD_TILES or (gather and block_size < tiles[1]):
        return False
    if keys_need_bounds(causal, block_size, tiles[1], k.shape[1], False) or softmax_scale <= 0:
        return False
    return tma_allowed(q.device, q, k, v)


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
) -> PassKernel:
    """The forward's backend and tiles, for a pattern of ``block_size`` blocks (``causal`` or not)
    whose forward layout gathers lone blocks or not (``gather``).

    The Gluon forward where it takes the call and ``options`` leave it free, else the Triton one,
    at :func:`forward_tile_sizes`' tiles either way.
    """
    tiles = forward_tile_sizes(q.shape[-1], q.dtype, q.device)
    gluon = options.forward_backend != "triton" and _gluon_forward_takes(
        q,
        k,
        v,
        tiles,
        block_size=block_size,
        causal=causal,
        gather=gather,
        varlen=varlen,
        softmax_scale=softmax_scale,
    )
    return PassKernel("gluon" if gluon else "triton", *tiles)


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
) -> tuple[PassKernel, PassKernel]:
    """(dK/dV's, dQ's) backend and tiles, as :func:`forward_kernel` chooses the forward's, at
    :func:`backward_tile_sizes`' tiles. ``dq``, ``dk``, ``dv``: the buffers the gradients go to,
    or None for ones :func:`backward` allocates like their inputs (which then qualify for bulk
    copies whenever the inputs do).

    The Gluon dK/dV kernel takes batched inputs fit for bulk copies with as many queries as keys,
    dK and dV leaving by bulk copy too; the Gluon dQ kernel takes the Gluon forward's cases at
    head dim 128, with dO and O fit for bulk copies and dQ's last dim dense.
    """
    dkdv_tiles, dq_tiles = backward_tile_sizes(q.shape[-1], q.dtype, q.device)
    gluon_dkdv = (
        options.dkdv_backend != "triton"
        and dkdv_tiles == _GLUON_DKDV_TILES
        and varlen is None
        and q.shape[1] == k.shape[1]
        and _gluon_sm90_runs_on(q)
        and tma_allowed(q.device, q, k, v, grad_out, *(t for t in (dk, dv) if t is not None))
    )
    gluon_dq = (
        options.dq_backend != "triton"
        and (dq is None or dq.stride(-1) == 1)
        and q.shape[-1] == 128
        and _gluon_forward_takes(
            q,
            k,
            v,
            dq_tiles,
            block_size=block_size,
            causal=causal,
            gather=gather_dq,
            varlen=varlen,
            softmax_scale=softmax_scale,
        )
        and tma_allowed(q.device, grad_out, out)
    )
    return (
        PassKernel("gluon" if gluon_dkdv else "triton", *dkdv_tiles),
        PassKernel("gluon" if gluon_dq else "triton", *dq_tiles),
    )


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
    tiles); None to choose it here (:func:`forward_kernel`, the Triton kernel on a layout of
    other tiles than the chosen ones).

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
        ).on(layout)
    _check_tiles(kernel, layout, "layout")
    if kernel.backend == "gluon":
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
    else:
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
    (:func:`backward_kernels`, the Triton kernels on layouts of other tiles than the chosen ones).

    ``dq``, ``dk``, ``dv`` may be given as views to write into (e.g. slices of one packed dqkv
    tensor). Up to four launches: the row term delta (by the Gluon dQ kernel when it runs, which
    then goes first), dK/dV, its gathered KV tiles, then dQ. None uses atomics, so gradients are
    the same from run to run.
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
    if kernels is None:
        dkdv_kernel, dq_kernel = backward_kernels(
            grad_out,
            q,
            k,
            v,
            out,
            dq=dq,
            dk=dk,
            dv=dv,
            block_size=dq_layout.block_size,
            causal=dq_layout.causal,
            gather_dq=dq_layout.gather_width > 0,
            varlen=varlen,
            softmax_scale=softmax_scale,
            options=options,
        )
        kernels = dkdv_kernel.on(dkdv_layout), dq_kernel.on(dq_layout)
    dkdv_kernel, dq_kernel = kernels
    _check_tiles(dkdv_kernel, dkdv_layout, "dkdv_layout")
    _check_tiles(dq_kernel, dq_layout, "dq_layout")
    gluon_dkdv, gluon_dq = dkdv_kernel.backend == "gluon", dq_kernel.backend == "gluon"
    common = dict(softmax_scale=softmax_scale, q_heads_per_pattern_head=q_heads_per_pattern_head)
    delta = torch.empty_like(lse)
    # The Gluon dK/dV kernel reads each row's (LSE * log2(e), delta) by bulk copies: rows padded
    # to 16 bytes.
    stats = None
    if gluon_dkdv:
        stats = torch.empty(
            (q.shape[0] * q.shape[-2], 2, -(-seqlen_q // 4) * 4),
            dtype=torch.float32,
            device=q.device,
        )
    if gluon_dq:
        from .gluon import backward_sm90

        # Runs first: it computes delta (and the row statistics) on the way.
        backward_sm90.dq(
            grad_out,
            q,
            k,
            v,
            out,
            lse,
            grad_lse,
            delta,
            stats,
            dq,
            dq_layout,
            config=options.gluon_dq,
            **common,
        )
    else:
        triton_backward.row_delta(out, grad_out, lse, grad_lse, delta, stats, packed=packed)
    if gluon_dkdv:
        from .gluon import backward_sm90

        backward_sm90.dkdv(
            grad_out, q, k, v, stats, dk, dv, dkdv_layout, config=options.gluon_dkdv, **common
        )
    # Gathered KV tiles' far uses (Triton only) add to what the contiguous pass wrote.
    triton_backward.dkdv(
        grad_out,
        q,
        k,
        v,
        lse,
        delta,
        dk,
        dv,
        dkdv_layout,
        varlen=varlen,
        config=options.triton_dkdv,
        contiguous=not gluon_dkdv,
        **common,
    )
    if not gluon_dq:
        triton_backward.dq(
            grad_out,
            q,
            k,
            v,
            lse,
            delta,
            dq,
            dq_layout,
            varlen=varlen,
            config=options.triton_dq,
            **common,
        )
    return dq, dk, dv


def _check_tiles(kernel: PassKernel, layout: TileLayout, name: str) -> None:
    if (layout.block_m, layout.block_n) != (kernel.block_m, kernel.block_n):
        raise ValueError(
            f"{name} has {layout.block_m}x{layout.block_n} tiles but the kernel chosen for it "
            f"walks {kernel.block_m}x{kernel.block_n}"
        )


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
    """A decode step over a paged KV cache: :func:`s2attn.ops.triton.decode.decode`'s arguments
    and results, with bfloat16 computed in float32 under the interpreter (see
    :func:`interpreter_upcasts`)."""
    upcast = interpreter_upcasts(q)
    operands = (t.float() for t in (q, k_pages, v_pages)) if upcast else (q, k_pages, v_pages)
    out, lse = triton_decode.decode(
        *operands,
        page_table,
        seq_lens,
        layout,
        softmax_scale=softmax_scale,
        num_splits=num_splits,
        split_counters=split_counters,
    )
    return (out.to(q.dtype) if upcast else out), lse


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


def decode_num_splits(
    batch: int, num_kv_heads: int, longest_list: int, device: torch.device
) -> int:
    """Programs per (sequence, KV head) of a decode step whose longest list is
    ``longest_list`` pages (:func:`s2attn.ops.triton.decode.decode_num_splits`)."""
    return triton_decode.decode_num_splits(batch, num_kv_heads, longest_list, device)


def run_num_splits(layout: DecodeLayout, batch: int, device: torch.device) -> int:
    """The split count of every step of a captured or compiled run: from the layout's longest
    list (:func:`s2attn.ops.triton.decode.run_num_splits`)."""
    return triton_decode.run_num_splits(layout, batch, device)
