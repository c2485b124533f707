"""Checks of user input that several entry points share: each raises an exception naming the
argument and the value it expected (never an assert, which ``python -O`` strips).

The attention entry points (``s2attn.attention``) and the KV cache with attention over it
(``s2attn.inference``) validate through these, so that one input is refused the same way
wherever it is given.
"""

from __future__ import annotations

import math
import operator

import torch

__all__ = [
    "as_int",
    "check_cu_seqlens",
    "check_heads",
    "check_int",
    "check_softmax_scale",
    "check_tensor",
]


def check_tensor(name: str, t: object) -> torch.Tensor:
    """``t`` when it is a tensor; a TypeError naming ``name`` otherwise."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    return t


def as_int(name: str, value: object) -> int:
    """``value`` as a Python int when it is integral: an int, a numpy integer, a torch integer
    scalar or 0-d tensor (anything ``operator.index`` takes); a TypeError naming ``name`` for a
    bool, a float, a string or a tensor of more than one element."""
    # A bool is an int to operator.index, and so are numpy's and torch's; numbers of blocks and
    # tokens are never True or False.
    is_bool = isinstance(value, bool) or getattr(getattr(value, "dtype", None), "kind", None) == "b"
    if isinstance(value, torch.Tensor):
        is_bool = value.dtype == torch.bool
        if value.dim() != 0:
            raise TypeError(
                f"{name} must be an integer, got a tensor of shape {tuple(value.shape)}"
            )
    if not is_bool:
        try:
            return operator.index(value)
        except TypeError:
            pass
    raise TypeError(f"{name} must be an integer, got {value!r} ({type(value).__name__})")


def check_int(name: str, value: object, minimum: int = 1) -> int:
    """``value`` as a Python int when it is integral (see :func:`as_int`) and at least
    ``minimum``: a TypeError naming ``name`` for another type, a ValueError below ``minimum``."""
    value = as_int(name, value)
    if value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value}")
    return value


def check_heads(q: torch.Tensor, k: torch.Tensor, pattern_heads: int) -> int:
    """The query heads per pattern head, for q (batch, seq_q, heads, dim) or (total, heads, dim)
    and k alike, with a pattern of ``pattern_heads`` heads: the q heads or the k/v heads.

    q, k, v in (batch, heads, seq, dim), SDPA's layout, are the common slip: then the error says
    so, and suggests ``.transpose(1, 2)`` when the heads it finds in dim 1 would have matched."""
    num_heads, num_kv_heads = q.shape[-2], k.shape[-2]
    if num_kv_heads != 0 and num_heads % num_kv_heads == 0 and pattern_heads == num_heads:
        return 1
    if num_kv_heads != 0 and num_heads % num_kv_heads == 0 and pattern_heads == num_kv_heads:
        return num_heads // num_kv_heads
    if num_kv_heads == 0 or num_heads % num_kv_heads:
        message = (
            f"q heads ({num_heads}) must be a multiple of k/v heads ({num_kv_heads}) for GQA/MQA"
        )
    else:
        message = (
            f"pattern has {pattern_heads} heads; expected the q heads ({num_heads}) "
            f"or the k/v heads ({num_kv_heads})"
        )
    if q.dim() == 4:
        message += (
            f". q, k and v must be (batch, seq, heads, dim), flash-attn's layout; q has shape "
            f"{tuple(q.shape)}, k {tuple(k.shape)}"
        )
        transposed = q.shape[1], k.shape[1]
        if (
            k.dim() == 4
            and transposed[1] != 0
            and transposed[0] % transposed[1] == 0
            and pattern_heads in transposed
        ):
            message += (
                ": they look like (batch, heads, seq, dim); pass q.transpose(1, 2), and k and v "
                "likewise"
            )
    raise ValueError(message)


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
