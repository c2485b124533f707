"""The attention ops in plain PyTorch.

- :func:`attention_reference`: attention on the dense token mask, the ground truth of every
  test. It materialises a (heads, seq_q, seq_k) mask and score matrix, so it is for small shapes
  only.
- :func:`blockwise_forward`, :func:`blockwise_backward`: the same forward and its gradients over
  the kept blocks alone, in bounded memory; the call plan (``s2attn.plan``) runs them where no
  Triton backend (GPU or interpreter) is available.
- :func:`key_row_grads`: one key row's dK and dV from the query rows that read it, for checks
  that sample rows of sequences too long for a whole reference.
"""

from __future__ import annotations

import math

import torch

from .pattern import BlockPattern

__all__ = [
    "attention_reference",
    "blockwise_backward",
    "blockwise_forward",
    "key_row_grads",
    "paged_attention_reference",
    "write_pages_reference",
]


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


# ------------------------------------------------------------------------ block by block
# The CPU fallback. The dense-mask reference above holds (heads, seq_q, seq_k) scores: 11.6 GB at
# 4k tokens and 32 heads. These walk each head's kept blocks a few query blocks at a time, as the
# kernels do, so memory is bounded by one query tile times the keys that tile keeps.

# Query rows per tile: enough that per-tile Python overhead is small next to its matmuls, few
# enough that a tile's scores stay a few MB at 128k-token windows.
_TILE_ROWS = 256


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _sequence_spans(q, k, cu_seqlens_q, cu_seqlens_k):
    """(query rows, key rows) of each sequence: batch indices, or packed slices."""
    if cu_seqlens_q is None:
        return [((b,), (b,)) for b in range(q.shape[0])]
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    return [((slice(a, b),), (slice(c, d),)) for a, b, c, d in zip(cq, cq[1:], ck, ck[1:])]


def _tiles(pattern: BlockPattern, seq_q: int, seq_k: int, device: torch.device):
    """Per (pattern head, query tile): the tile's query rows, the key rows its blocks keep, and
    the (rows, keys) mask, the causal rule included, on ``device``. Queries are aligned
    bottom-right."""
    bs = pattern.block_size
    offset = seq_k - seq_q
    first_block, stop_block = offset // bs, -(-seq_k // bs)
    blocks_per_tile = max(1, _TILE_ROWS // bs)
    for head in range(pattern.num_heads):
        for i0 in range(first_block, stop_block, blocks_per_tile):
            i1 = min(i0 + blocks_per_tile, stop_block)
            i, j = pattern.row_blocks(head, i0, i1)
            keep = j < stop_block
            i, j = i[keep], j[keep]
            q_pos = torch.arange(max(i0 * bs, offset), min(i1 * bs, seq_k))
            if j.numel() == 0:
                yield head, (q_pos - offset).to(device), None, None
                continue
            kv_blocks, j_index = torch.unique(j, return_inverse=True)
            k_pos = (kv_blocks[:, None] * bs + torch.arange(bs)).flatten()
            k_pos = k_pos[k_pos < seq_k]
            kept = torch.zeros(i1 - i0, kv_blocks.numel(), dtype=torch.bool)
            kept[i - i0, j_index] = True
            col_of_key = torch.searchsorted(kv_blocks, k_pos // bs)
            mask = kept[q_pos // bs - i0][:, col_of_key]
            if pattern.causal:
                mask &= q_pos[:, None] >= k_pos[None, :]
            # Built on the host, where the pattern's block lists live; used where q is.
            yield head, (q_pos - offset).to(device), k_pos.to(device), mask.to(device)


def _head_map(pattern: BlockPattern, num_q_heads: int, num_kv_heads: int):
    """Per pattern head: (its query heads as a slice, its KV head)."""
    per = num_q_heads // pattern.num_heads
    return [
        (slice(h * per, (h + 1) * per), h * per // (num_q_heads // num_kv_heads))
        for h in range(pattern.num_heads)
    ]


def _tile_scores(qf, kf, q_rows, k_pos, mask, heads, kv_head, scale):
    """Masked, scaled scores (group, rows, keys) of one tile."""
    scores = qf[q_rows, heads].transpose(0, 1) @ kf[k_pos, kv_head].T * scale
    return scores.masked_fill(~mask, float("-inf"))


def blockwise_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pattern: BlockPattern,
    *,
    softmax_scale: float,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`attention_reference`'s (out, lse) on validated inputs, one query tile of one head at
    a time over the KV blocks the tile keeps: memory proportional to a tile's rows times its kept
    keys, never (seq_q, seq_k). Computes in float32 (float64 for float64 inputs); ``out`` comes
    back contiguous in q's dtype, ``lse`` (batch, heads, seq_q) or (heads, total_q) in the
    compute dtype, -inf (with output 0) for rows that attend nothing."""
    compute = _compute_dtype(q.dtype)
    num_heads, packed = q.shape[-2], cu_seqlens_q is not None
    out = torch.zeros(q.shape, dtype=compute, device=q.device)
    lse_rows = torch.full((*q.shape[:-1],), float("-inf"), dtype=compute, device=q.device)
    heads = _head_map(pattern, num_heads, k.shape[-2])
    for rows, cols in _sequence_spans(q, k, cu_seqlens_q, cu_seqlens_k):
        qs, ks, vs = q[rows], k[cols], v[cols]
        if qs.shape[0] == 0:
            continue
        qf, kf, vf = (t.to(compute) for t in (qs, ks, vs))
        seq_out, seq_lse = out[rows], lse_rows[rows]
        for head, q_rows, k_pos, mask in _tiles(pattern, qs.shape[0], ks.shape[0], q.device):
            if k_pos is None:
                continue
            group, kv_head = heads[head]
            scores = _tile_scores(qf, kf, q_rows, k_pos, mask, group, kv_head, softmax_scale)
            tile_lse = torch.logsumexp(scores, dim=-1, keepdim=True)
            probs = torch.exp(scores - tile_lse.masked_fill(tile_lse == float("-inf"), 0.0))
            seq_out[q_rows, group] = (probs @ vf[k_pos, kv_head]).transpose(0, 1)
            seq_lse[q_rows, group] = tile_lse.squeeze(-1).T
    lse = lse_rows.permute(1, 0) if packed else lse_rows.permute(0, 2, 1)
    return out.to(q.dtype), lse.contiguous()


def blockwise_backward(
    grad_out: torch.Tensor | None,
    grad_lse: torch.Tensor | None,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    pattern: BlockPattern,
    *,
    softmax_scale: float,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of :func:`blockwise_forward`, shaped and typed like q, k, v, from the
    gradients of out (None when only the LSE was used) and of lse (None when unused). Recomputes
    each tile's probabilities from the saved LSE, as the kernels do, in the same bounded memory;
    dK and dV of a GQA group's query heads add into their KV head."""
    compute = _compute_dtype(q.dtype)
    packed = cu_seqlens_q is not None
    # Strided like the inputs, as the operator's fake promises (``torch.empty_like``).
    dq, dk, dv = (torch.zeros_like(t, dtype=compute) for t in (q, k, v))
    # Per row, as (..., rows, heads): the LSE and its gradient, and delta = rowsum(dO * O).
    lse_rows = (lse.permute(1, 0) if packed else lse.permute(0, 2, 1)).to(compute)
    if grad_lse is not None:
        grad_lse = (grad_lse.permute(1, 0) if packed else grad_lse.permute(0, 2, 1)).to(compute)
    if grad_out is not None:
        delta = (grad_out.to(compute) * out.to(compute)).sum(-1)
    heads = _head_map(pattern, q.shape[-2], k.shape[-2])
    for rows, cols in _sequence_spans(q, k, cu_seqlens_q, cu_seqlens_k):
        qs, ks, vs = q[rows], k[cols], v[cols]
        if qs.shape[0] == 0 or ks.shape[0] == 0:
            continue
        qf, kf, vf = (t.to(compute) for t in (qs, ks, vs))
        dqs, dks, dvs = dq[rows], dk[cols], dv[cols]
        for head, q_rows, k_pos, mask in _tiles(pattern, qs.shape[0], ks.shape[0], q.device):
            if k_pos is None:
                continue
            group, kv_head = heads[head]
            scores = _tile_scores(qf, kf, q_rows, k_pos, mask, group, kv_head, softmax_scale)
            row_lse = lse_rows[rows][q_rows, group].T.unsqueeze(-1)
            probs = torch.exp(scores - row_lse.masked_fill(row_lse == float("-inf"), 0.0))
            d_scores = torch.zeros_like(probs)
            if grad_out is not None:
                d_out = grad_out[rows][q_rows, group].to(compute).transpose(0, 1)
                d_probs = d_out @ vf[k_pos, kv_head].T
                row_delta = delta[rows][q_rows, group].T.unsqueeze(-1)
                d_scores = probs * (d_probs - row_delta)
                dvs[k_pos, kv_head] += (probs.transpose(1, 2) @ d_out).sum(0)
            if grad_lse is not None:
                d_scores += probs * grad_lse[rows][q_rows, group].T.unsqueeze(-1)
            d_scores *= softmax_scale
            dqs[q_rows, group] += (d_scores @ kf[k_pos, kv_head]).transpose(0, 1)
            dks[k_pos, kv_head] += (
                d_scores.transpose(1, 2) @ qf[q_rows, group].transpose(0, 1)
            ).sum(0)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


# ---------------------------------------------------------------------------- over pages
# Decode and any step over a paged KV cache, read through a page table: the ground truth of the
# decode kernel, the CPU path of the compiled decode operator (``s2attn.inference.decode_step``)
# and of vLLM's layout (``s2attn.integrations.vllm_paged``, whose (block, KV head) pairs are pages).


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


def write_pages_reference(
    k: torch.Tensor,
    v: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
) -> None:
    """Store new tokens' K/V, (batch, num_new, kv_heads, dim), at positions ``seq_lens[b] + t``
    through ``page_table`` (batch, kv_heads, blocks); blocks without a page (-1) write into the
    last page of ``k_pages``/``v_pages`` (pages, page_size, dim), which nothing reads."""
    batch, num_new, kv_heads, dim = k.shape
    page = k_pages.shape[1]
    spare = (k_pages.shape[0] - 1) * page
    pos = seq_lens.long()[:, None] + torch.arange(num_new, device=k.device)  # (batch, new)
    pages = page_table.long().gather(2, (pos // page)[:, None, :].expand(batch, kv_heads, num_new))
    rows = torch.where(pages >= 0, pages * page + (pos % page)[:, None, :], spare)
    rows = rows.transpose(1, 2).reshape(-1)  # (batch, new, kv_heads), as k is laid out
    k_pages.view(-1, dim).index_copy_(0, rows, k.reshape(-1, dim))
    v_pages.view(-1, dim).index_copy_(0, rows, v.reshape(-1, dim))


def paged_attention_reference(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    page_table: torch.Tensor,
    cu_seqlens_q: list[int],
    seq_lens: list[int],
    block_mask: torch.Tensor,
    *,
    block_size: int,
    softmax_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence's new queries attend its keys in a paged cache, under a block mask.

    Args:
        q: (tokens, heads, dim), the sequences' new tokens packed in order; they are each
            sequence's last positions.
        k_pages, v_pages: (pages, page_size, dim).
        page_table: int (batch, kv_heads, max_pages): the page of each (sequence, KV head, page
            of positions); -1 for none (those keys are not read).
        cu_seqlens_q: batch + 1 offsets into ``q``.
        seq_lens: per sequence, its length with the new tokens.
        block_mask: bool (mask_heads, q_blocks, kv_blocks) over pattern blocks of ``block_size``
            tokens; query head ``h`` reads mask head ``h // (heads // mask_heads)``.
        block_size: the pattern's block (a multiple or a divisor of ``page_size``).
        softmax_scale: the score scale.

    Returns ``out`` (tokens, heads, dim) in q's dtype, computed in float32 with the causal rule
    (a row that may read no key gives zeros), and ``lse`` float32 (heads, tokens), the natural-log
    LSE of each row's scores (-inf for such a row).
    """
    num_heads, dim = q.shape[1], q.shape[2]
    kv_heads, page = page_table.shape[1], k_pages.shape[1]
    group = num_heads // kv_heads
    # Each query head's mask head; per KV head, its group's.
    head_of = torch.arange(num_heads) // (num_heads // block_mask.shape[0])
    out = torch.zeros(q.shape[0], num_heads, dim, dtype=torch.float32, device=q.device)
    lse = torch.full((num_heads, q.shape[0]), float("-inf"), device=q.device)
    table = page_table.long().to(k_pages.device)
    for b, length in enumerate(seq_lens):
        start, end = cu_seqlens_q[b], cu_seqlens_q[b + 1]
        if end == start:
            continue
        q_pos = torch.arange(length - (end - start), length)
        first, last = int(q_pos[0]) // block_size, int(q_pos[-1]) // block_size
        for h in range(kv_heads):
            heads = slice(h * group, (h + 1) * group)
            # Only the blocks some query of the group keeps: memory of what the pattern reads.
            masks = block_mask[head_of[heads], first : last + 1, : last + 1]
            blocks = masks.any(dim=1).any(dim=0).nonzero().flatten()
            k_pos = (blocks[:, None] * block_size + torch.arange(block_size)).flatten()
            k_pos = k_pos[k_pos < length]
            pages = table[b, h, (k_pos // page).to(table.device)]
            at = (pages.clamp(min=0), (k_pos % page).to(pages.device))
            keys, values = k_pages[at].float(), v_pages[at].float()  # (kept keys, dim)
            # (group, queries, kept keys): the mask at block level, then the causal rule.
            allowed = block_mask[head_of[heads]][:, q_pos // block_size][:, :, k_pos // block_size]
            allowed &= k_pos[None, None, :] <= q_pos[None, :, None]
            allowed &= (pages >= 0).cpu()[None, None, :]
            qf = q[start:end, heads].float().transpose(0, 1).to(keys.device)
            scores = (qf @ keys.T) * softmax_scale
            scores = scores.masked_fill(~allowed.to(scores.device), float("-inf"))
            probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # rows seeing nothing give 0
            out[start:end, heads] = (probs @ values).transpose(0, 1).to(out.device)
            lse[heads, start:end] = torch.logsumexp(scores, dim=-1).to(lse.device)
    return out.to(q.dtype), lse
