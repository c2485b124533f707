"""Mixed precision: ``torch.autocast`` casts s2attn's inputs the way it casts SDPA's.

Inside an enabled autocast region for the inputs' device, attention computes at the region's
dtype (float16 or bfloat16): floating-point inputs other than float64 are cast to it, the output
comes back in it, and the casts sit in the autograd graph, so float32 leaves get float32
gradients. Outside a region, or inside ``autocast(enabled=False)``, the inputs are used as given
and float32 keeps its exact float32 path.

The public entry points take this boundary as a decorator, :func:`autocast_entry`: inside a
region it casts their tensor arguments (:func:`cast_inputs`' rule) and runs them with autocast off
(so that nothing below, the dense-mask reference's matmuls included, is cast a second time). The
boundary stays here, not on the custom operators' Autocast kernels (``s2attn.compile``):
``torch.compile`` traces it (the region's dtype is a constant of the trace and the casts land in
the graph), eager calls do not go through the operators at all (their dispatch costs host time),
and ``torch.library.register_autocast`` casts to one dtype fixed at registration, where SDPA's
rule follows the region's.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import TypeVar

import torch

__all__ = ["autocast_dtype", "autocast_entry", "cast_inputs"]

_F = TypeVar("_F", bound=Callable)

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


def autocast_entry(
    *names: str,
    compute_dtype: Callable[..., torch.dtype | None] | None = None,
    output_in_region: bool = False,
) -> Callable[[_F], _F]:
    """Decorator: the autocast boundary of an entry point whose parameters ``names`` hold its
    tensors (the first of them a tensor whose device type names the region).

    Inside an enabled region for that device type, the call runs with autocast off on those
    arguments cast by :func:`cast_inputs` to the compute dtype: the region's, or what
    ``compute_dtype`` gives when called with the entry point's own arguments (e.g. a cache's
    dtype; None runs the call as given, for its validation to judge). ``output_in_region``: the
    result (a tensor, or a tuple's first element) comes back in the region's dtype, for entry
    points that compute in another. Outside a region the call runs as given.

    Example::

        >>> @autocast_entry("q", "k", "v")
        ... def attend(q, k, v, pattern, *, softmax_scale=None): ...
    """

    def decorate(fn: _F) -> _F:
        parameters = list(inspect.signature(fn).parameters.values())
        positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        # Per named parameter: its position when it can be passed positionally, else None.
        slots = []
        for name in names:
            index = next((i for i, p in enumerate(parameters) if p.name == name), None)
            if index is None:
                raise ValueError(f"{fn.__qualname__} has no parameter {name!r}")
            slots.append((name, index if parameters[index].kind in positional else None))
        first_name, first_index = slots[0]

        @functools.wraps(fn)
        def entry(*args, **kwargs):
            if first_index is not None and first_index < len(args):
                first = args[first_index]
            else:
                first = kwargs.get(first_name)
            region = autocast_dtype(first)
            if region is None:
                return fn(*args, **kwargs)
            dtype = region if compute_dtype is None else compute_dtype(*args, **kwargs)
            if dtype is None:
                return fn(*args, **kwargs)
            device_type = first.device.type
            args, kwargs = list(args), dict(kwargs)
            for name, index in slots:
                if index is not None and index < len(args):
                    (args[index],) = cast_inputs(dtype, device_type, args[index])
                elif name in kwargs:
                    (kwargs[name],) = cast_inputs(dtype, device_type, kwargs[name])
            with torch.autocast(device_type, enabled=False):
                result = fn(*args, **kwargs)
            if not output_in_region:
                return result
            if isinstance(result, tuple):
                return (result[0].to(region), *result[1:])
            return result.to(region)

        return entry

    return decorate
