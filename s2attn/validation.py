"""Checks of user input that several entry points share: each raises an exception naming the
argument and the value it expected (never an assert, which ``python -O`` strips).

The attention entry points (``s2attn.attention``) and the KV cache with attention over it
(``s2attn.inference``) validate through these, so that one input is refused the same way
wherever it is given.
"""

from __future__ import annotations

import math

import torch

__all__ = ["check_cu_seqlens", "check_int", "check_softmax_scale", "check_tensor"]


def check_tensor(name: str, t: object) -> torch.Tensor:
    """``t`` when it is a tensor; a TypeError naming ``name`` otherwise."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    return t


def check_int(name: str, value: object, minimum: int = 1) -> int:
    """``value`` when it is an integer (not a bool) of at least ``minimum``."""
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def check_softmax_scale(softmax_scale: object, head_dim: int) -> float:
    """The score scale: ``1 / sqrt(head_dim)`` when None, else a finite number."""
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    if not isinstance(softmax_scale, (int, float)) or not math.isfinite(softmax_scale):
        raise ValueError(f"softmax_scale must be a finite number, got {softmax_scale!r}")
    return float(softmax_scale)


def check_cu_seqlens(
    name: str,
    cu: torch.Tensor | None,
    total: int,
    device: torch.device,
    batch_size: int | None = None,
) -> list[int]:
    """Validate packed-sequence offsets (int32, 1-D, from 0, non-decreasing, ending at ``total``;
    ``batch_size + 1`` of them when given) and return them as a list."""
    if cu is None:
        raise ValueError(f"{name} is required for packed (3-D) inputs")
    check_tensor(name, cu)
    if cu.dtype != torch.int32:
        raise TypeError(f"{name} must have dtype torch.int32, got {cu.dtype}")
    if cu.dim() != 1 or cu.numel() < 2:
        raise ValueError(
            f"{name} must be 1-D with batch + 1 >= 2 entries, got shape {tuple(cu.shape)}"
        )
    if batch_size is not None and cu.numel() != batch_size + 1:
        raise ValueError(f"{name} must hold batch + 1 = {batch_size + 1} offsets, got {cu.numel()}")
    if cu.device != device:
        raise ValueError(f"{name} is on {cu.device}, but the data is on {device}")
    values = cu.tolist()
    if values[0] != 0:
        raise ValueError(f"{name} must start at 0, got {values[0]}")
    if any(b < a for a, b in zip(values, values[1:])):
        raise ValueError(f"{name} must be non-decreasing, got {values}")
    if values[-1] != total:
        raise ValueError(
            f"{name}[-1] = {values[-1]} disagrees with the packed tensor's {total} tokens"
        )
    return values
