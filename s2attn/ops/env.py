"""Facts of the machine and the process that decide how kernels run.

Whether Triton interprets kernels on the CPU (``TRITON_INTERPRET=1``, set before s2attn is
imported) or compiles them, the ``S2ATTN_*`` switches, each GPU's compute capability, and whether
tensors qualify for bulk tensor copies (TMA). Read here, once; the backend tables
(:mod:`s2attn.ops.backends`) decide from them which backend runs a call, and the launchers which
loads their kernels use.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
from triton.runtime.interpreter import InterpretedFunction

__all__ = [
    "GLUON_ENABLED",
    "INTERPRETED",
    "POISON_OUTPUTS",
    "device_capability",
    "tma_allowed",
]


@triton.jit
def _probe():
    pass


# Triton chooses, as each kernel is defined, whether to compile or to interpret it: s2attn's
# kernels are defined when s2attn is imported, as this one is.
INTERPRETED = isinstance(_probe, InterpretedFunction)

# Tests set this so that every output element starts as NaN: one a kernel fails to write fails.
POISON_OUTPUTS = os.environ.get("S2ATTN_POISON_OUTPUTS") == "1"

# S2ATTN_HOPPER_FORWARD=0 keeps every pass on the Triton kernels (the Gluon ones are sm_90 only).
GLUON_ENABLED = os.environ.get("S2ATTN_HOPPER_FORWARD", "1") != "0"


@functools.cache
def device_capability(device: torch.device) -> tuple[int, int]:
    """A CUDA device's compute capability, looked up once (the lookup costs host time on every
    call, which short sequences feel)."""
    return torch.cuda.get_device_capability(device)


def tma_allowed(device: torch.device, *tensors: torch.Tensor) -> bool:
    """Whether kernels may read these tensors through tensor descriptors (TMA).

    Needs a Hopper-or-newer GPU, 2-byte elements, a contiguous last dim and 16-byte aligned bases
    and strides. Sets Triton's allocator for in-kernel descriptors' workspace if none is set.
    """
    if device.type != "cuda" or device_capability(device)[0] < 9:
        return False
    for t in tensors:
        if t.element_size() != 2 or t.stride(-1) != 1 or t.data_ptr() % 16:
            return False
        if any((s * t.element_size()) % 16 for s in t.stride()[:-1]):
            return False
    _ensure_allocator()
    return True


def _torch_workspace(size: int, alignment: int, stream: int | None) -> torch.Tensor:
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _ensure_allocator() -> None:
    try:
        from triton.runtime import _allocation

        if not isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
            return  # the caller's own allocator stays
    except (ImportError, AttributeError):
        pass
    triton.set_allocator(_torch_workspace)
