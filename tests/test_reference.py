"""The reference's helpers that are not the dense-mask attention itself, against autograd."""

from __future__ import annotations

import torch

from s2attn.reference import key_row_grads


def test_key_row_grads_match_autograd():
    """One key's dK and dV from its readers' LSE equal autograd's over softmax attention in which
    those readers also see other keys (float64, fresh random inputs, two heads)."""
    gen = torch.Generator().manual_seed(11)
    readers, keys, heads, dim, scale = 5, 7, 2, 8, 0.4
    q, grad_out = (
        torch.randn(readers, heads, dim, generator=gen, dtype=torch.float64) for _ in "qo"
    )
    k, v = (
        torch.randn(keys, heads, dim, generator=gen, dtype=torch.float64).requires_grad_()
        for _ in "kv"
    )
    scores = torch.einsum("rhd,khd->rhk", q, k) * scale
    out = torch.einsum("rhk,khd->rhd", scores.softmax(-1), v)
    dk, dv = torch.autograd.grad((out * grad_out).sum(), (k, v))
    lse = scores.logsumexp(-1)
    got_dk, got_dv = key_row_grads(
        q, grad_out, out.detach(), lse.detach(), k[3].detach(), v[3].detach(), scale
    )
    torch.testing.assert_close(got_dk, dk[3], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(got_dv, dv[3], rtol=1e-10, atol=1e-12)
