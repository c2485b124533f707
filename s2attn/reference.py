"""The ground truth the kernels and the CPU paths (``s2attn.ops.cpu``) are tested against, in
plain PyTorch.

- :func:`attention_reference`: attention on the dense token mask, the ground truth of every
  test. It materialises a (heads, seq_q, seq_k) mask and score matrix, so it is for small shapes
  only.
- :func:`key_row_grads`: one key row's dK and dV from the query rows that read it, for checks
  that sample rows of sequences too long for a whole reference.
"""

from __future__ import annotations

import math

import torch

from .pattern import BlockPattern

__all__ = ["attention_reference", "key_row_grads"]


def _expand_pattern_heads(mask: torch.Tensor, num_q_heads: int) -> torch.Tensor:
    """(pattern_heads, sq, sk) -> (num_q_heads, sq, sk): per-KV-head patterns serve their group."""
    if mask.shape[0] == num_q_heads:
        return mask
    return mask.repeat_interleave(num_q_heads // mask.shape[0], dim=0)


def _attend_one(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pattern: BlockPattern,
    scale: float,
    compute_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence: q (sq, hq, d), k/v (sk, hk, d) -> out (sq, hq, d), lse (hq, sq)."""
    sq, hq, _ = q.shape
    sk, hk, _ = k.shape
    if sq == 0:
        return q.new_zeros(q.shape, dtype=compute_dtype), q.new_zeros(hq, 0, dtype=compute_dtype)
    mask = _expand_pattern_heads(pattern.token_mask(sq, sk), hq).to(q.device)
    qf = q.to(compute_dtype).transpose(0, 1)
    kf = k.to(compute_dtype).transpose(0, 1).repeat_interleave(hq // hk, dim=0)
    vf = v.to(compute_dtype).transpose(0, 1).repeat_interleave(hq // hk, dim=0)
    scores = (qf @ kf.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # -inf for rows that attend nothing
    probs = torch.exp(scores - lse.masked_fill(lse == float("-inf"), 0.0)[..., None])
    out = (probs @ vf).transpose(0, 1)
    return out, lse


def attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pattern: BlockPattern,
    *,
    softmax_scale: float | None = None,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    return_lse: bool = False,
    compute_dtype: torch.dtype = torch.float32,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention restricted to ``pattern.token_mask``, computed in ``compute_dtype``.

    Shapes follow :func:`s2attn.sparse_attention`: q (batch, seq_q, heads, dim) and k/v (batch,
    seq_k, kv_heads, dim), or packed (total, heads, dim) with ``cu_seqlens_q``/``cu_seqlens_k``.
    Returns ``out`` in q's dtype (compute in float64 by passing ``compute_dtype=torch.float64``),
    and with ``return_lse`` the float32 natural-log LSE of shape (batch, heads, seq_q), or
    (heads, total_q) for packed inputs. Rows that attend nothing give 0 and LSE -inf.
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else softmax_scale
    if cu_seqlens_q is None:
        outs, lses = zip(
            *(
                _attend_one(q[b], k[b], v[b], pattern, scale, compute_dtype)
                for b in range(q.shape[0])
            )
        )
        out, lse = torch.stack(outs), torch.stack(lses)
    else:
        cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
        outs, lses = zip(
            *(
                _attend_one(
                    q[cq[b] : cq[b + 1]],
                    k[ck[b] : ck[b + 1]],
                    v[ck[b] : ck[b + 1]],
                    pattern,
                    scale,
                    compute_dtype,
                )
                for b in range(len(cq) - 1)
            )
        )
        out, lse = torch.cat(outs), torch.cat(lses, dim=1)
    out = out.to(q.dtype)
    return (out, lse.float()) if return_lse else out


def key_row_grads(
    q: torch.Tensor,
    grad_out: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """dK and dV of one key row, summed over the query rows that read it: ``q``, ``grad_out``
    and ``out`` (readers, ..., dim), those rows' natural-log ``lse`` (readers, ...), and the key's
    ``k`` and ``v`` (..., dim), where ``...`` is any run of heads. Each reader's probability of
    the key comes from its LSE, so the other keys it reads need not be at hand:
    p = exp(q . k * scale - lse), dV = sum p dO, dK = scale * sum p (dO . v - dO . out) q."""
    p = torch.exp((q * k).sum(-1) * scale - lse)
    ds = p * ((grad_out * v).sum(-1) - (grad_out * out).sum(-1))
    return scale * (ds[..., None] * q).sum(0), (p[..., None] * grad_out).sum(0)
