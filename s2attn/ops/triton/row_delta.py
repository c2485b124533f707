"""The backward's first pass in Triton: delta = rowsum(dO * O) - dLSE per query row (the softmax
Jacobian term; the LSE gradient enters here, since dLSE/dS = P), for the dK/dV and dQ kernels of
``backward.py``; optionally also the row statistics that the Gluon dK/dV kernel
(``ops/gluon/backward_sm90.py``) reads by bulk copies.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..launcher import launcher_for
from .common import as_batched, cdiv, lse_strides, padded_head_dim

__all__ = ["row_delta"]


@triton.jit
def _row_delta_kernel(
    Out, dOut, Lse, dLse, Delta, Stats,
    stride_ob, stride_os, stride_oh, stride_od,
    stride_gb, stride_gs, stride_gh, stride_gd,
    stride_lb, stride_lh, stride_ls,
    stride_dlb, stride_dlh, stride_dls,
    seqlen, num_heads, stats_seq,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, HAS_DLSE: tl.constexpr,
    HAS_STATS: tl.constexpr,
):
    """delta per query row; with HAS_STATS also the Gluon dK/dV kernel's row statistics: rows
    (LSE * log2(e), delta) of a (batch * heads, 2, stats_seq) tensor it reads by bulk copies."""
    bh = tl.program_id(0)
    b = bh // num_heads
    h = bh % num_heads
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (rows < seqlen)[:, None] & (offs_d < HEAD_DIM)[None, :]
    o = tl.load(
        Out + b.to(tl.int64) * stride_ob + h * stride_oh
        + rows[:, None].to(tl.int64) * stride_os + offs_d[None, :] * stride_od,
        mask=mask, other=0.0,
    ).to(Delta.dtype.element_ty)
    do = tl.load(
        dOut + b.to(tl.int64) * stride_gb + h * stride_gh
        + rows[:, None].to(tl.int64) * stride_gs + offs_d[None, :] * stride_gd,
        mask=mask, other=0.0,
    ).to(Delta.dtype.element_ty)
    delta = tl.sum(o * do, axis=1)
    l_off = b.to(tl.int64) * stride_lb + h * stride_lh + rows.to(tl.int64) * stride_ls
    if HAS_DLSE:
        # dLSE comes from autograd in any layout (e.g. expanded by lse.sum()): its own strides.
        dl_off = b.to(tl.int64) * stride_dlb + h * stride_dlh + rows.to(tl.int64) * stride_dls
        delta -= tl.load(dLse + dl_off, mask=rows < seqlen, other=0.0)
    tl.store(Delta + l_off, delta, mask=rows < seqlen)
    if HAS_STATS:
        lse = tl.load(Lse + l_off, mask=rows < seqlen, other=0.0) * 1.4426950408889634
        s_off = bh.to(tl.int64) * 2 * stats_seq + rows
        tl.store(Stats + s_off, lse, mask=rows < seqlen)
        tl.store(Stats + stats_seq + s_off, delta, mask=rows < seqlen)



def row_delta(
    out: torch.Tensor,
    grad_out: torch.Tensor,
    lse: torch.Tensor,
    grad_lse: torch.Tensor | None,
    delta: torch.Tensor,
    stats: torch.Tensor | None,
    *,
    packed: bool,
) -> None:
    """Fill ``delta`` (like ``lse``) with rowsum(dO * O) - dLSE; with ``stats`` also the Gluon
    dK/dV kernel's row statistics, (batch * heads, 2, padded seq) float32."""
    (o4, o_st), (g4, g_st) = as_batched(out, packed), as_batched(grad_out, packed)
    num_heads, head_dim = out.shape[-2], out.shape[-1]
    rows_total = out.shape[0] if packed else out.shape[1]
    l_st = lse_strides(lse, packed)
    launcher_for(_row_delta_kernel)[(o4.shape[0] * num_heads, cdiv(rows_total, 64))](
        o4, g4, lse, grad_lse if grad_lse is not None else lse, delta,
        delta if stats is None else stats,
        *o_st, *g_st, *l_st, *(l_st if grad_lse is None else lse_strides(grad_lse, packed)),
        rows_total, num_heads, 0 if stats is None else stats.shape[-1],
        HEAD_DIM=head_dim, BLOCK_D=padded_head_dim(head_dim), BLOCK_M=64,
        HAS_DLSE=grad_lse is not None, HAS_STATS=stats is not None,
    )
