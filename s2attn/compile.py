"""The attention passes as ``torch.library`` custom operators, so that ``torch.compile`` keeps a
call inside its graph.

Two operators in namespace ``s2attn``:

- ``s2attn::forward(q, k, v, pattern_key, softmax_scale, q_heads_per_pattern_head,
  cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) -> (out, lse)``
- ``s2attn::backward(grad_out, grad_lse, q, k, v, out, lse, <the same>) -> (dq, dk, dv)``

with fake implementations (exact shapes, strides and dtypes, so the compiler allocates around
them) and the forward's autograd registered through the library. Each runs the kernels where a
Triton backend runs (a GPU, or the CPU under the interpreter) and the exact PyTorch path over the
kept blocks (``s2attn.ops.cpu.blockwise_forward``) elsewhere.

A pattern is not a tensor: the operators take an integer key (:func:`pattern_key`, the pattern's
``op_key``, given at construction) naming it among the process's live patterns. ``torch.compile``
reads the key while tracing, bakes it into the graph as a constant and guards on its value, so a
compiled graph is reused for as long as the same pattern comes back and recompiled once when
another does. Patterns are held weakly (a 128k pattern and its layouts are large): a compiled
graph runs only while its pattern is alive, which a module attribute or a global ensures.

Each operator runs the call's plan (``s2attn.plan``), which chooses the kernels, fetches the
layouts and launches; this module holds the registration and the keys its arguments carry.
"""

from __future__ import annotations

import torch

from .ops.shapes import lse_dtype
from .pattern import BlockPattern
from .plan import build_layouts_while_tracing, operator_plan

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
    plan = operator_plan(
        q,
        k,
        pattern_for_key(pattern_key),
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
    pattern = pattern_for_key(pattern_key) if isinstance(pattern_key, int) else None
    build_layouts_while_tracing(q, k, pattern, q_heads_per_pattern_head, *lengths, backward=False)
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
    plan = operator_plan(
        q,
        k,
        pattern_for_key(pattern_key),
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
    pattern = pattern_for_key(pattern_key) if isinstance(pattern_key, int) else None
    build_layouts_while_tracing(q, k, pattern, heads_per, *lengths, backward=True)
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
