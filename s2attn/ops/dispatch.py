"""Which kernels run a call: the entry points of the attention passes.

Two backends. The Triton kernels (``ops/triton/``) run wherever Triton does: any CUDA GPU, and the
CPU under ``TRITON_INTERPRET=1``. The warp-specialized Gluon kernels (``ops/gluon/*_sm90.py``)
take the common cases on an sm_90 GPU, pass by pass. Each (pass, backend) has one predicate,
``supports_*``; :func:`forward` and :func:`backward` allocate the outputs, ask the predicates
(unless :class:`~s2attn.ops.options.KernelOptions` pins Triton) and launch. Both backends walk
the same layouts, whose tile sizes are chosen here for the backend that will run.

Inputs are validated by the caller (``s2attn.attention``). Batched: q (batch, seq_q, heads, dim),
k and v (batch, seq_k, kv_heads, dim). Packed: q (total_q, heads, dim), k and v (total_k,
kv_heads, dim), with int32 ``cu_seqlens_q``, ``cu_seqlens_k`` (batch + 1,) and the longest
lengths. ``q_heads_per_pattern_head`` maps a query head to its layout head: 1 for layouts per
query head, the GQA group size for layouts per KV head.
"""

from __future__ import annotations

import torch

from ..layout import DecodeLayout, TileLayout
from .env import GLUON_ENABLED, INTERPRETED, POISON_OUTPUTS, device_capability, tma_allowed
from .launch import check_k_bounds, lse_dtype, sequence_lengths
from .options import KernelOptions
from .triton import backward as triton_backward
from .triton import decode as triton_decode
from .triton import forward as triton_forward
from .triton import page_write as triton_page_write

__all__ = [
    "DEFAULT_OPTIONS",
    "backward",
    "backward_tile_sizes",
    "decode",
    "decode_num_splits",
    "forward",
    "forward_tile_sizes",
    "interpreter_upcasts",
    "run_num_splits",
    "supports_gluon_dkdv",
    "supports_gluon_dq",
    "supports_gluon_forward",
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
    interpreter. They take every call there; elsewhere callers use the dense-mask reference."""
    return device.type == "cuda" or (device.type == "cpu" and INTERPRETED)


def _gluon_sm90_runs_on(q: torch.Tensor) -> bool:
    """What every Gluon kernel needs: compiled kernels (not the interpreter) on an sm_90 GPU,
    fp16 or bf16, head dim 64 or 128, and ``S2ATTN_HOPPER_FORWARD`` not 0."""
    if INTERPRETED or not GLUON_ENABLED or q.device.type != "cuda":
        return False
    if device_capability(q.device) != (9, 0):
        return False
    return q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] in (64, 128)


def supports_gluon_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: TileLayout,
    *,
    varlen: bool,
    check_k_bounds: bool,
    softmax_scale: float,
) -> bool:
    """Whether the Gluon forward takes the call: batched inputs fit for bulk copies, a 128x64
    layout without gathered entries or entries of 32 bits per row or more, no key bound to check
    in full entries, a positive scale."""
    if varlen or not _gluon_sm90_runs_on(q):
        return False
    if (layout.block_m, layout.block_n) != (128, 64) or layout.gather_width:
        return False
    if check_k_bounds or softmax_scale <= 0 or layout.bits_per_row >= 32:
        return False
    return tma_allowed(q.device, q, k, v)


def supports_gluon_dq(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    dq: torch.Tensor,
    layout: TileLayout,
    *,
    varlen: bool,
    check_k_bounds: bool,
    softmax_scale: float,
) -> bool:
    """Whether the Gluon dQ kernel takes the call: the Gluon forward's cases at head dim 128,
    with dO and O fit for bulk copies and dQ's last dim dense."""
    if dq.stride(-1) != 1 or q.shape[-1] != 128:
        return False
    return supports_gluon_forward(
        q, k, v, layout, varlen=varlen, check_k_bounds=check_k_bounds, softmax_scale=softmax_scale
    ) and tma_allowed(q.device, grad_out, out)


def supports_gluon_dkdv(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
    layout: TileLayout,
    *,
    varlen: bool,
) -> bool:
    """Whether the Gluon dK/dV kernel takes the call: batched inputs fit for bulk copies, as many
    queries as keys, a 64x64 layout with fewer than 32 bits per row; dK and dV leave by bulk copy
    too."""
    if varlen or q.shape[1] != k.shape[1]:
        return False
    if (layout.block_m, layout.block_n) != (64, 64) or layout.bits_per_row >= 32:
        return False
    return _gluon_sm90_runs_on(q) and tma_allowed(q.device, q, k, v, grad_out, dk, dv)


# ---------------------------------------------------------------------------------- tile sizes
def forward_tile_sizes(head_dim: int, dtype: torch.dtype, device: torch.device) -> tuple[int, int]:
    """(block_m, block_n) of the forward layout, for either backend.

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
    """((block_m, block_n) of the dK/dV layout, (block_m, block_n) of the dQ layout).

    dK/dV programs hold a KV tile and its two accumulators, so their query tiles stay small;
    dQ programs hold one accumulator, so they take tall query tiles and narrow KV tiles.
    """
    if device.type != "cuda":
        return (32, 64), (64, 32)
    if dtype.itemsize > 2 or head_dim > 128:
        return (32, 64), (64, 32)
    if head_dim == 128 and device_capability(device) == (9, 0):
        # The Gluon dQ kernel walks the forward's 128x64 tiles. At dim 64 it measured no faster
        # than the Triton one (H100, 8k fwd+bwd 1.16 vs 1.11 ms).
        return (64, 64), (128, 64)
    # Measured on H100 (benchmarks/tuning/sweep_tiles.py, 32k, V16, dim 128, bf16): 64x64 tiles
    # with 4 warps and 2 stages were best for both kernels among 20 and 16 configurations.
    return (64, 64), (64, 64)


# ------------------------------------------------------------------------------- the passes
def forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: TileLayout,
    *,
    softmax_scale: float,
    q_heads_per_pattern_head: int,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    options: KernelOptions = DEFAULT_OPTIONS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over a forward layout, on validated inputs.

    Returns ``out`` like q and ``lse`` (batch, heads, seq_q), or (heads, total_q) when packed, in
    float32 (float64 for float64 inputs).
    """
    if interpreter_upcasts(q):
        out, lse = forward(
            *(t.float() for t in (q, k, v)),
            layout,
            softmax_scale=softmax_scale,
            q_heads_per_pattern_head=q_heads_per_pattern_head,
            cu_seqlens_q=cu_seqlens_q,
            cu_seqlens_k=cu_seqlens_k,
            max_seqlen_q=max_seqlen_q,
            max_seqlen_k=max_seqlen_k,
            options=options,
        )
        return out.to(q.dtype), lse
    varlen, batch, seqlen_q, seqlen_k = sequence_lengths(
        q, k, cu_seqlens_q, max_seqlen_q, max_seqlen_k
    )
    num_heads = q.shape[-2]
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse_shape = (num_heads, q.shape[0]) if varlen else (batch, num_heads, seqlen_q)
    lse = torch.empty(lse_shape, dtype=lse_dtype(q.dtype), device=q.device)
    if POISON_OUTPUTS:
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
    if out.numel() == 0:
        return out, lse
    if options.forward_backend != "triton" and supports_gluon_forward(
        q,
        k,
        v,
        layout,
        varlen=varlen,
        check_k_bounds=check_k_bounds(layout, seqlen_k, varlen),
        softmax_scale=softmax_scale,
    ):
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
            cu_seqlens_q=cu_seqlens_q,
            cu_seqlens_k=cu_seqlens_k,
            max_seqlen_q=max_seqlen_q,
            max_seqlen_k=max_seqlen_k,
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
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    dq: torch.Tensor | None = None,
    dk: torch.Tensor | None = None,
    dv: torch.Tensor | None = None,
    options: KernelOptions = DEFAULT_OPTIONS,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of q, k, v (shaped like them) from ``grad_out`` (like out) and ``grad_lse``
    (like lse, or None), on a backward (per-KV-tile) layout for dK/dV and a forward one for dQ.

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
            cu_seqlens_q=cu_seqlens_q,
            cu_seqlens_k=cu_seqlens_k,
            max_seqlen_q=max_seqlen_q,
            max_seqlen_k=max_seqlen_k,
            options=options,
        )
        given = (dq, dk, dv)
        return tuple(
            g.to(t.dtype) if d is None else d.copy_(g) for g, d, t in zip(grads, given, (q, k, v))
        )
    varlen, batch, seqlen_q, seqlen_k = sequence_lengths(
        q, k, cu_seqlens_q, max_seqlen_q, max_seqlen_k
    )
    dq = torch.empty_like(q) if dq is None else dq
    dk = torch.empty_like(k) if dk is None else dk
    dv = torch.empty_like(v) if dv is None else dv
    if POISON_OUTPUTS:
        for t in (dq, dk, dv):
            t.fill_(float("nan"))
    if q.numel() == 0 or k.numel() == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    lengths = dict(
        cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k,
        max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k,
    )
    common = dict(softmax_scale=softmax_scale, q_heads_per_pattern_head=q_heads_per_pattern_head)
    gluon_dkdv = options.dkdv_backend != "triton" and supports_gluon_dkdv(
        grad_out, q, k, v, dk, dv, dkdv_layout, varlen=varlen
    )
    gluon_dq = options.dq_backend != "triton" and supports_gluon_dq(
        grad_out,
        q,
        k,
        v,
        out,
        dq,
        dq_layout,
        varlen=varlen,
        check_k_bounds=check_k_bounds(dq_layout, seqlen_k, varlen),
        softmax_scale=softmax_scale,
    )
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
        triton_backward.row_delta(out, grad_out, lse, grad_lse, delta, stats, varlen=varlen)
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
        config=options.triton_dkdv,
        contiguous=not gluon_dkdv,
        **common,
        **lengths,
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
            config=options.triton_dq,
            **common,
            **lengths,
        )
    return dq, dk, dv


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
    if interpreter_upcasts(q):
        out, lse = triton_decode.decode(
            *(t.float() for t in (q, k_pages, v_pages)),
            page_table,
            seq_lens,
            layout,
            softmax_scale=softmax_scale,
            num_splits=num_splits,
            split_counters=split_counters,
        )
        return out.to(q.dtype), lse
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
) -> None:
    """A decode step's page write: :func:`s2attn.ops.triton.page_write.write_pages`."""
    triton_page_write.write_pages(k, v, k_pages, v_pages, page_table, seq_lens)


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
