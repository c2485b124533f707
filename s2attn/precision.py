"""Mixed precision: ``torch.autocast`` casts s2attn's inputs the way it casts SDPA's.

Inside an enabled autocast region for the inputs' device, attention computes at the region's
dtype (float16 or bfloat16): floating-point inputs other than float64 are cast to it, the output
comes back in it, and the casts sit in the autograd graph, so float32 leaves get float32
gradients. Outside a region, or inside ``autocast(enabled=False)``, the inputs are used as given
and float32 keeps its exact float32 path.

The public entry points ask :func:`autocast_dtype` at their boundary and, inside a region, call
themselves again on :func:`cast_inputs`' tensors with autocast off (so that nothing below, the
dense-mask reference's matmuls included, is cast a second time). The boundary stays here, not on
the custom operators' Autocast kernels (``s2attn.custom_ops``): ``torch.compile`` traces it (the
region's dtype is a constant of the trace and the casts land in the graph), eager calls do not go
through the operators at all (their dispatch costs host time), and
``torch.library.register_autocast`` casts to one dtype fixed at registration, where SDPA's rule
follows the region's.
"""

from __future__ import annotations

import torch

__all__ = ["autocast_dtype", "cast_inputs"]

# Device types that have autocast, asked once here: torch.compile (torch 2.11) cannot trace
# torch.amp.is_autocast_available, while a lookup in a constant set traces to nothing.
_AUTOCAST_DEVICE_TYPES = frozenset(
    d
    for d in ("cpu", "cuda", "xpu", "mps", "hpu", "xla", "mtia", "maia", "ipu", "privateuseone")
    if torch.amp.is_autocast_available(d)
)


def autocast_dtype(x: object) -> torch.dtype | None:
    """The dtype of the enabled autocast region for tensor ``x``'s device type, else None (also
    for a non-tensor ``x``, which the caller's validation then reports)."""
    if not isinstance(x, torch.Tensor):
        return None
    device_type = x.device.type
    # Devices without autocast (meta, for one) make torch.is_autocast_enabled raise.
    # Any other device type (a renamed privateuseone backend) is asked directly.
    if device_type not in _AUTOCAST_DEVICE_TYPES and (
        device_type in ("meta", "lazy") or not torch.amp.is_autocast_available(device_type)
    ):
        return None
    if not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type)


def cast_inputs(
    dtype: torch.dtype, device_type: str, *tensors: torch.Tensor | None
) -> tuple[torch.Tensor | None, ...]:
    """``tensors`` with the floating-point ones on ``device_type`` cast to ``dtype``; float64,
    integer tensors (``cu_seqlens``), other devices' tensors and None pass unchanged, as under
    autocast's own rule for SDPA. A tensor already in ``dtype`` is returned as is (no copy)."""
    return tuple(
        t.to(dtype)
        if isinstance(t, torch.Tensor)
        and t.is_floating_point()
        and t.dtype != torch.float64
        and t.device.type == device_type
        else t
        for t in tensors
    )
