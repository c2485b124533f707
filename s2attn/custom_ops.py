"""The attention passes as ``torch.library`` custom operators, so that ``torch.compile`` keeps a
call inside its graph.

Two operators in namespace ``s2attn``:

- ``s2attn::forward(q, k, v, pattern_key, softmax_scale, q_heads_per_pattern_head,
  cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) -> (out, lse)``
- ``s2attn::backward(grad_out, grad_lse, q, k, v, out, lse, <the same>) -> (dq, dk, dv)``

with fake implementations (exact shapes, strides and dtypes, so the compiler allocates around
them) and the forward's autograd registered through the library. Each runs the kernels where a
Triton backend runs (a GPU, or the CPU under the interpreter) and the block-by-block reference
(``s2attn.reference.blockwise_forward``) elsewhere.

A pattern is not a tensor: the operators take an integer key (:func:`pattern_key`, the pattern's
``op_key``, given at construction) naming it among the process's live patterns. ``torch.compile``
reads the key while tracing, bakes it into the graph as a constant and guards on its value, so a
compiled graph is reused for as long as the same pattern comes back and recompiled once when
another does. Patterns are held weakly (a 128k pattern and its layouts are large): a compiled
graph runs only while its pattern is alive, which a module attribute or a global ensures.

The per-call plan (:class:`_AttentionPlan`) fetches the layouts, cached per pattern as
``s2attn.layout`` does, and launches through ``s2attn.ops.dispatch``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily

from .layout import backward_layout, forward_layout
from .ops import dispatch
from .ops.launch import lse_dtype
from .ops.options import KernelOptions
from .pattern import BlockPattern
from .reference import blockwise_backward, blockwise_forward

__all__ = ["pattern_for_key", "pattern_key"]


# --------------------------------------------------------------------------- pattern keys
def pattern_key(pattern: BlockPattern) -> int:
    """The integer that names ``pattern`` in the operators' arguments. Under ``torch.compile`` it
    is an int attribute read at trace time: a constant of the graph, guarded on its value, so a
    new pattern recompiles and the same one reuses the graph."""
    return pattern.op_key


def pattern_for_key(key: int) -> BlockPattern:
    """The live pattern registered under ``key``."""
    pattern = BlockPattern.for_op_key(key)
    if pattern is None:
        raise RuntimeError(
            f"s2attn: no live BlockPattern has key {key}: the pattern a compiled graph was traced "
            "with was garbage-collected. Keep the pattern alive (e.g. as a module attribute) "
            "while graphs that use it run."
        )
    return pattern


# ------------------------------------------------------------------------------------ the plan
@dataclass(frozen=True)
class _AttentionPlan:
    """One call's plan and its launcher: everything about the call that is not a tensor the
    autograd graph tracks, and its two passes, which fetch the layouts the plan needs (cached per
    pattern, tile sizes and device) and hand them to the kernels (``s2attn.ops.dispatch``)."""

    pattern: BlockPattern
    scale: float
    q_heads_per_pattern_head: int
    cu_seqlens_q: torch.Tensor | None
    cu_seqlens_k: torch.Tensor | None
    max_seqlen_q: int
    max_seqlen_k: int
    options: KernelOptions = dispatch.DEFAULT_OPTIONS

    def forward_layout(self, q):
        """The forward's layout (built once, then cached)."""
        block_m, block_n = dispatch.forward_tile_sizes(q.shape[-1], q.dtype, q.device)
        # A causal tile never lists KV tiles past its queries, so one layout serves every length;
        # bidirectional tiles list everything, so crop the pattern to the longest sequence.
        num_blocks = None if self.pattern.causal else self._num_blocks
        # Gathered KV tiles pack lone stride blocks smaller than block_n.
        return forward_layout(self.pattern, block_m, block_n, q.device, num_blocks, gather=True)

    def backward_layouts(self, q, k):
        """The backward's (dK/dV layout, dQ layout), built once, then cached."""
        tiles = dispatch.backward_tile_sizes(q.shape[-1], q.dtype, q.device)
        (dkdv_m, dkdv_n), (dq_m, dq_n) = tiles
        # Lone blocks smaller than a KV tile go to gathered tiles, as in the forward: in dQ's
        # lists, and in dK/dV's when each KV head has one pattern head (a gathered tile's sums
        # then belong to one KV head alone).
        gather_dq = self.options.gather_dq
        gather_dkdv = self.options.gather_dkdv and self.pattern.num_heads == k.shape[-2]
        # The per-KV-tile lists run to the end of the pattern even when causal: crop them.
        dkdv_layout = backward_layout(
            self.pattern, dkdv_m, dkdv_n, q.device, self._num_blocks, gather=gather_dkdv
        )
        num_blocks = None if self.pattern.causal else self._num_blocks
        dq_layout = forward_layout(self.pattern, dq_m, dq_n, q.device, num_blocks, gather=gather_dq)
        return dkdv_layout, dq_layout

    def forward(self, q, k, v):
        """(out, lse) of the call, as ``s2attn.ops.dispatch.forward`` returns them; where no
        Triton backend runs (a CPU without the interpreter), from the block-by-block reference."""
        if not dispatch.supports_triton(q.device):
            out, lse = blockwise_forward(q, k, v, self.pattern, **self._reference_lengths)
            return out, lse.to(lse_dtype(q.dtype))
        return dispatch.forward(
            q,
            k,
            v,
            self.forward_layout(q),
            softmax_scale=self.scale,
            q_heads_per_pattern_head=self.q_heads_per_pattern_head,
            cu_seqlens_q=self.cu_seqlens_q,
            cu_seqlens_k=self.cu_seqlens_k,
            max_seqlen_q=self.max_seqlen_q,
            max_seqlen_k=self.max_seqlen_k,
            options=self.options,
        )

    def backward(self, grad_out, grad_lse, q, k, v, out, lse, dq=None, dk=None, dv=None):
        """(dq, dk, dv), as ``s2attn.ops.dispatch.backward`` returns them; ``grad_out`` None when
        only the LSE was used."""
        if not dispatch.supports_triton(q.device):
            grads = blockwise_backward(
                grad_out, grad_lse, q, k, v, out, lse, self.pattern, **self._reference_lengths
            )
            if dq is None:
                return grads
            for given, grad in zip((dq, dk, dv), grads):
                given.copy_(grad)
            return dq, dk, dv
        dkdv_layout, dq_layout = self.backward_layouts(q, k)
        if grad_out is None:
            grad_out = torch.zeros_like(out)
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
            cu_seqlens_q=self.cu_seqlens_q,
            cu_seqlens_k=self.cu_seqlens_k,
            max_seqlen_q=self.max_seqlen_q,
            max_seqlen_k=self.max_seqlen_k,
            dq=dq,
            dk=dk,
            dv=dv,
            options=self.options,
        )

    @property
    def _reference_lengths(self) -> dict:
        return dict(
            softmax_scale=self.scale,
            cu_seqlens_q=self.cu_seqlens_q,
            cu_seqlens_k=self.cu_seqlens_k,
        )

    @property
    def _num_blocks(self) -> int:
        return math.ceil(self.max_seqlen_k / self.pattern.block_size)


def _max_len(cu_seqlens: torch.Tensor | None, given: int | None, padded: int) -> int:
    """The longest sequence: ``given``, else read from ``cu_seqlens`` (a compiled varlen call
    leaves it to run time), else the padded length."""
    if given is not None:
        return given
    if cu_seqlens is None:
        return padded
    return int((cu_seqlens[1:] - cu_seqlens[:-1]).max().item())


def _plan(q, k, key, scale, q_heads_per_pattern_head, cu_q, cu_k, max_q, max_k) -> _AttentionPlan:
    return _AttentionPlan(
        pattern_for_key(key),
        scale,
        q_heads_per_pattern_head,
        cu_q,
        cu_k,
        _max_len(cu_q, max_q, q.shape[1] if q.dim() == 4 else q.shape[0]),
        _max_len(cu_k, max_k, k.shape[1] if k.dim() == 4 else k.shape[0]),
    )


def _build_layouts_while_tracing(q, k, key, q_heads_per_pattern_head, lengths, backward):
    """Build the layouts a traced call will use, from its fake implementation: then the first
    real run finds them cached. Under ``mode="reduce-overhead"`` that run is CUDA-graph trees'
    warm-up, whose allocations land in the graph's private pool, where tensors that outlive the
    run (cached layouts) are reported as untracked and the graph is refused; what is still built
    on first use goes through ``build_outside_graph_pool`` for that reason.

    Only where the kernels run and the shapes and bounds are known numbers; otherwise the first
    run builds them, as in eager mode."""
    cu_q, cu_k, max_q, max_k = lengths
    known = isinstance(key, int) and all(isinstance(n, int) for n in (*q.shape, *k.shape))
    if cu_q is not None and (max_q is None or max_k is None):
        known = False  # the bounds would be read from the offsets, which are fake here
    if not known or not dispatch.supports_triton(q.device):
        return
    with unset_fake_temporarily():
        plan = _plan(q, k, key, 1.0, q_heads_per_pattern_head, cu_q, cu_k, max_q, max_k)
        if backward:
            plan.backward_layouts(q, k)
        else:
            plan.forward_layout(q)


# -------------------------------------------------------------------------------- the forward
@torch.library.custom_op("s2attn::forward", mutates_args=())
def attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pattern_key: int,
    softmax_scale: float,
    q_heads_per_pattern_head: int,
    cu_seqlens_q: torch.Tensor | None,
    cu_seqlens_k: torch.Tensor | None,
    max_seqlen_q: int | None,
    max_seqlen_k: int | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) on validated inputs: out (batch, seq_q, heads, dim) or (total_q, heads, dim),
    contiguous in q's dtype; lse (batch, heads, seq_q) or (heads, total_q), float32 (float64 for
    float64 inputs)."""
    plan = _plan(
        q,
        k,
        pattern_key,
        softmax_scale,
        q_heads_per_pattern_head,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
    )
    return plan.forward(q, k, v)


@attention_forward.register_fake
def _(q, k, v, pattern_key, softmax_scale, q_heads_per_pattern_head, *lengths):
    _build_layouts_while_tracing(q, k, pattern_key, q_heads_per_pattern_head, lengths, False)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if q.dim() == 3:
        lse_shape = (q.shape[1], q.shape[0])
    else:
        lse_shape = (q.shape[0], q.shape[2], q.shape[1])
    return out, torch.empty(lse_shape, dtype=lse_dtype(q.dtype), device=q.device)


# ------------------------------------------------------------------------------- the backward
@torch.library.custom_op("s2attn::backward", mutates_args=())
def attention_backward(
    grad_out: torch.Tensor | None,
    grad_lse: torch.Tensor | None,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    pattern_key: int,
    softmax_scale: float,
    q_heads_per_pattern_head: int,
    cu_seqlens_q: torch.Tensor | None,
    cu_seqlens_k: torch.Tensor | None,
    max_seqlen_q: int | None,
    max_seqlen_k: int | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv), each ``torch.empty_like`` its input, from the forward's inputs and outputs
    and the gradients of out (None when only the LSE was used) and lse (None when unused)."""
    plan = _plan(
        q,
        k,
        pattern_key,
        softmax_scale,
        q_heads_per_pattern_head,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
    )
    return plan.backward(grad_out, grad_lse, q, k, v, out, lse)


@attention_backward.register_fake
def _(grad_out, grad_lse, q, k, v, out, lse, pattern_key, softmax_scale, heads_per, *lengths):
    _build_layouts_while_tracing(q, k, pattern_key, heads_per, lengths, True)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


# ------------------------------------------------------------------------------- the autograd
_NON_TENSOR_ARGS = 7  # pattern_key through max_seqlen_k: passed on to the backward as they came


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, *args = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.args = args
    # Keeps the pattern alive until the backward (eager autograd; a compiled graph relies on
    # its owner, see the module docstring).
    ctx.pattern = BlockPattern.for_op_key(args[0]) if isinstance(args[0], int) else None
    ctx.set_materialize_grads(False)


def _backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = attention_backward(grad_out, grad_lse, q, k, v, out, lse, *ctx.args)
    return (dq, dk, dv) + (None,) * _NON_TENSOR_ARGS


attention_forward.register_autograd(_backward, setup_context=_setup_context)
