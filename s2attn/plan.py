"""One call's plan: everything about an attention call that is not a tensor the autograd graph
tracks (the pattern, the scale, how query heads map to pattern heads, the packed sequences'
lengths, the kernel options), and the call's two passes.

Each pass asks ``s2attn.ops.dispatch`` which backend runs it and at which tiles, fetches the
layouts at those tiles (built once, then cached per pattern, tiles and device by
``s2attn.ops.layout``) and launches that backend on them. Where no Triton backend runs (a CPU
without the interpreter), the plain-PyTorch path over the kept blocks (``s2attn.ops.cpu``) runs
instead.

The eager calls (``s2attn.attention``'s autograd Functions) build a plan from validated inputs;
the registered operators (``s2attn.compile``) build one from their arguments
(:func:`operator_plan`), and their fake implementations build its layouts while
``torch.compile`` traces (:func:`build_layouts_while_tracing`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily

from .ops import dispatch
from .ops.cpu import blockwise_backward, blockwise_forward
from .ops.layout import TileLayout, backward_layout, forward_layout
from .ops.options import KernelOptions
from .ops.shapes import Varlen, lse_dtype
from .pattern import BlockPattern

__all__ = ["AttentionPlan", "Varlen", "build_layouts_while_tracing", "operator_plan"]

# The forward layouts gather lone pattern blocks smaller than a KV tile into shared tiles.
_FORWARD_GATHER = True


@dataclass(frozen=True)
class AttentionPlan:
    """One call's plan and its launcher. ``varlen``: the packed sequences' lengths, None for
    batched tensors."""

    pattern: BlockPattern
    scale: float
    q_heads_per_pattern_head: int
    varlen: Varlen | None = None
    options: KernelOptions = dispatch.DEFAULT_OPTIONS

    # --------------------------------------------------------------------------- the passes
    def forward(self, q, k, v):
        """(out, lse) of the call, as ``s2attn.ops.dispatch.forward`` returns them; where no
        Triton backend runs, from the plain-PyTorch path over the kept blocks."""
        if not dispatch.supports_triton(q.device):
            out, lse = blockwise_forward(q, k, v, self.pattern, **self._cpu_args)
            return out, lse.to(lse_dtype(q.dtype))
        kernel = dispatch.forward_kernel(
            q,
            k,
            v,
            block_size=self.pattern.block_size,
            causal=self.pattern.causal,
            gather=_FORWARD_GATHER,
            varlen=self.varlen,
            softmax_scale=self.scale,
            options=self.options,
        )
        return dispatch.forward(
            q,
            k,
            v,
            self.forward_layout(k, (kernel.block_m, kernel.block_n)),
            softmax_scale=self.scale,
            q_heads_per_pattern_head=self.q_heads_per_pattern_head,
            varlen=self.varlen,
            kernel=kernel,
            options=self.options,
        )

    def backward(self, grad_out, grad_lse, q, k, v, out, lse, dq=None, dk=None, dv=None):
        """(dq, dk, dv), as ``s2attn.ops.dispatch.backward`` returns them; ``grad_out`` None when
        only the LSE was used. ``dq``, ``dk``, ``dv``: views to write the gradients into, or
        None."""
        if not dispatch.supports_triton(q.device):
            grads = blockwise_backward(
                grad_out, grad_lse, q, k, v, out, lse, self.pattern, **self._cpu_args
            )
            if dq is None:
                return grads
            for given, grad in zip((dq, dk, dv), grads):
                given.copy_(grad)
            return dq, dk, dv
        if grad_out is None:
            grad_out = torch.zeros_like(out)
        kernels = dispatch.backward_kernels(
            grad_out,
            q,
            k,
            v,
            out,
            dq=dq,
            dk=dk,
            dv=dv,
            block_size=self.pattern.block_size,
            causal=self.pattern.causal,
            gather_dq=self.options.gather_dq,
            varlen=self.varlen,
            softmax_scale=self.scale,
            options=self.options,
        )
        dkdv_kernel, dq_kernel = kernels
        dkdv_layout, dq_layout = self.backward_layouts(
            k, (dkdv_kernel.block_m, dkdv_kernel.block_n), (dq_kernel.block_m, dq_kernel.block_n)
        )
        return dispatch.backward(
            grad_out,
            q,
            k,
            v,
            out,
            lse,
            grad_lse,
            dkdv_layout,
            dq_layout,
            softmax_scale=self.scale,
            q_heads_per_pattern_head=self.q_heads_per_pattern_head,
            varlen=self.varlen,
            kernels=kernels,
            dq=dq,
            dk=dk,
            dv=dv,
            options=self.options,
        )

    # -------------------------------------------------------------------------- the layouts
    def build_layouts(
        self, q: torch.Tensor, k: torch.Tensor, *, forward: bool = True, backward: bool = True
    ) -> None:
        """Build the layouts the forward and the backward pass will fetch, unless cached: at the
        tiles the passes' choice of kernels gives, which depend on q's head dim, dtype and device
        alone (``dispatch.forward_tile_sizes``, ``backward_tile_sizes``), so q and k may be fake
        tensors here."""
        head_dim, dtype, device = q.shape[-1], q.dtype, q.device
        if forward:
            self.forward_layout(k, dispatch.forward_tile_sizes(head_dim, dtype, device))
        if backward:
            self.backward_layouts(k, *dispatch.backward_tile_sizes(head_dim, dtype, device))

    def forward_layout(self, k: torch.Tensor, tiles: tuple[int, int]) -> TileLayout:
        """The forward's layout at ``tiles`` (built once, then cached)."""
        # A causal tile never lists KV tiles past its queries, so one layout serves every length;
        # bidirectional tiles list everything, so crop the pattern to the longest sequence.
        num_blocks = None if self.pattern.causal else self._num_blocks(k)
        # Gathered KV tiles pack lone stride blocks smaller than block_n.
        return forward_layout(self.pattern, *tiles, k.device, num_blocks, gather=_FORWARD_GATHER)

    def backward_layouts(
        self, k: torch.Tensor, dkdv_tiles: tuple[int, int], dq_tiles: tuple[int, int]
    ) -> tuple[TileLayout, TileLayout]:
        """The backward's (dK/dV layout, dQ layout) at those tiles, built once, then cached."""
        # Lone blocks smaller than a KV tile go to gathered tiles, as in the forward: in dQ's
        # lists, and in dK/dV's when each KV head has one pattern head (a gathered tile's sums
        # then belong to one KV head alone).
        gather_dq = self.options.gather_dq
        gather_dkdv = self.options.gather_dkdv and self.pattern.num_heads == k.shape[-2]
        # The per-KV-tile lists run to the end of the pattern even when causal: crop them.
        dkdv_layout = backward_layout(
            self.pattern, *dkdv_tiles, k.device, self._num_blocks(k), gather=gather_dkdv
        )
        num_blocks = None if self.pattern.causal else self._num_blocks(k)
        dq_layout = forward_layout(self.pattern, *dq_tiles, k.device, num_blocks, gather=gather_dq)
        return dkdv_layout, dq_layout

    @property
    def _cpu_args(self) -> dict:
        varlen = self.varlen
        return dict(
            softmax_scale=self.scale,
            cu_seqlens_q=None if varlen is None else varlen.cu_seqlens_q,
            cu_seqlens_k=None if varlen is None else varlen.cu_seqlens_k,
        )

    def _num_blocks(self, k: torch.Tensor) -> int:
        """Pattern blocks the longest key sequence spans."""
        seqlen_k = k.shape[1] if self.varlen is None else self.varlen.max_seqlen_k
        return math.ceil(seqlen_k / self.pattern.block_size)


# ------------------------------------------------------------------------ from the operators
def _max_len(cu_seqlens: torch.Tensor, given: int | None) -> int:
    """The longest sequence: ``given``, else read from ``cu_seqlens`` (a compiled varlen call
    leaves it to run time)."""
    if given is not None:
        return given
    return int((cu_seqlens[1:] - cu_seqlens[:-1]).max().item())


def operator_plan(
    q: torch.Tensor,
    k: torch.Tensor,
    pattern: BlockPattern,
    scale: float,
    q_heads_per_pattern_head: int,
    cu_seqlens_q: torch.Tensor | None,
    cu_seqlens_k: torch.Tensor | None,
    max_seqlen_q: int | None,
    max_seqlen_k: int | None,
) -> AttentionPlan:
    """The plan of a registered operator's call, from its arguments: packed when
    ``cu_seqlens_q`` is given, the longest lengths read from the offsets where not given."""
    varlen = None
    if cu_seqlens_q is not None:
        varlen = Varlen(
            cu_seqlens_q,
            cu_seqlens_k,
            _max_len(cu_seqlens_q, max_seqlen_q),
            _max_len(cu_seqlens_k, max_seqlen_k),
        )
    return AttentionPlan(pattern, scale, q_heads_per_pattern_head, varlen)


def build_layouts_while_tracing(
    q: torch.Tensor,
    k: torch.Tensor,
    pattern: BlockPattern | None,
    q_heads_per_pattern_head: int,
    cu_seqlens_q: torch.Tensor | None,
    cu_seqlens_k: torch.Tensor | None,
    max_seqlen_q: int | None,
    max_seqlen_k: int | None,
    *,
    backward: bool,
) -> None:
    """Build the layouts a traced call will use, from an operator's fake implementation (fake
    ``q`` and ``k``; ``pattern`` None when its key is not a known number): then the first real
    run finds them cached. Under ``mode="reduce-overhead"`` that run is CUDA-graph trees'
    warm-up, whose allocations land in the graph's private pool, where tensors that outlive the
    run (cached layouts) are reported as untracked and the graph is refused; what is still built
    on first use goes through ``build_outside_graph_pool`` for that reason.

    Only where the kernels run and the shapes and bounds are known numbers; otherwise the first
    run builds them, as in eager mode."""
    known = pattern is not None and all(isinstance(n, int) for n in (*q.shape, *k.shape))
    if cu_seqlens_q is not None and (max_seqlen_q is None or max_seqlen_k is None):
        known = False  # the bounds would be read from the offsets, which are fake here
    if not known or not dispatch.supports_triton(q.device):
        return
    with unset_fake_temporarily():
        plan = operator_plan(
            q,
            k,
            pattern,
            1.0,
            q_heads_per_pattern_head,
            cu_seqlens_q,
            cu_seqlens_k,
            max_seqlen_q,
            max_seqlen_k,
        )
        plan.build_layouts(q, k, forward=not backward, backward=backward)
