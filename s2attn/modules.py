"""``SparseAttention``: the nn.Module form of :func:`s2attn.sparse_attention`."""

from __future__ import annotations

import torch
from torch import nn

from .attention import sparse_attention
from .pattern import BlockPattern

__all__ = ["SparseAttention"]


class SparseAttention(nn.Module):
    """Attention over q/k/v restricted to a fixed block pattern; holds no weights.

    Args:
        pattern: the :class:`s2attn.BlockPattern` every call uses.
        softmax_scale: defaults to ``1 / sqrt(head_dim)``.

    ``forward`` takes the arguments of :func:`s2attn.sparse_attention` after ``pattern``, and
    follows ``torch.autocast`` as it does: inside a region q, k and v are cast to the region's
    dtype and the output comes back in it. Float32 outside autocast runs far slower on a GPU than
    bfloat16 (see :func:`s2attn.sparse_attention`). ``torch.compile`` traces it with no graph
    break; a compiled module recompiles once when ``pattern`` is replaced by another pattern.

    Example::

        >>> attn = s2attn.SparseAttention(s2attn.local_stride_pattern(
        ...     32, max_seq_len=8192, block_size=64, local_blocks=16, vert_stride=16
        ... ))
        >>> out = attn(q, k, v)  # q, k, v: (batch, seq, heads, dim)
    """

    def __init__(self, pattern: BlockPattern, softmax_scale: float | None = None):
        super().__init__()
        if not isinstance(pattern, BlockPattern):
            raise TypeError(f"pattern must be an s2attn.BlockPattern, got {type(pattern).__name__}")
        self.pattern = pattern
        self.softmax_scale = softmax_scale

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        cu_seqlens_q: torch.Tensor | None = None,
        cu_seqlens_k: torch.Tensor | None = None,
        max_seqlen_q: int | None = None,
        max_seqlen_k: int | None = None,
        return_lse: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return sparse_attention(
            q,
            k,
            v,
            self.pattern,
            softmax_scale=self.softmax_scale,
            cu_seqlens_q=cu_seqlens_q,
            cu_seqlens_k=cu_seqlens_k,
            max_seqlen_q=max_seqlen_q,
            max_seqlen_k=max_seqlen_k,
            return_lse=return_lse,
        )

    def extra_repr(self) -> str:
        return repr(self.pattern)
