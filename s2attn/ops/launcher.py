"""Launching a Triton or Gluon kernel again without Triton's per-call binding.

A decode step launches kernels of a few microseconds of GPU work, once per layer per token, and
an 8k forward+backward three kernels of a few hundred, so the host's cost of a launch decides or
bounds their speed. ``kernel[grid](...)`` pays Triton's binder (each argument's specialization),
its cache key and launch metadata on every call: 40-50 µs per launch under cProfile on the GPU
hosts here, for the decode kernel's 39 arguments, more than the kernel takes. :class:`Launcher`
remembers the compiled kernel that Triton chose for a set of arguments and launches it directly
when the same kind of arguments come again (a decode step's host time: 137 -> 121 µs, 2 x H200
host; ``docs/design.md``, #36).

What Triton specializes a compiled kernel on is a function of each argument's *value* for
integers (its width, divisibility by 16, equality to 1), of a tensor's dtype and the 16-byte
alignment of its address, and of a tensor descriptor's dtype, block shape and shared-memory
layout (its base, shape and strides go to the launch, which builds the TMA descriptor each
time). The memo's key holds exactly those for tensors and descriptors and the whole value for
every other argument, so two calls with the same key would have made the same compiled kernel:
a hit cannot launch a kernel specialized for other arguments. Anything else (the interpreter,
launch hooks such as a profiler's, arguments not on a GPU) takes Triton's own path.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
from triton import knobs
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonTensorDescriptor
from triton.runtime.jit import JITFunction
from triton.tools.tensor_descriptor import TensorDescriptor

# Keys are few in practice (one per shape and dtype of the calls a model makes); the bound only
# keeps a pathological caller (every call a new shape) from growing the memo without end.
_MAX_KEYS = 256


def _hooked(hook: Any) -> bool:
    """Whether a launch hook is set: Triton 3.6 keeps each as a chain of hooks, empty when none."""
    return hook is not None and bool(getattr(hook, "calls", True))


_DESCRIPTORS = (GluonTensorDescriptor, TensorDescriptor)


def _arg_key(arg: Any) -> Any:
    # Plain tensors never reach here (_args_key keys them inline); their subclasses do.
    if isinstance(arg, torch.Tensor):
        return (arg.dtype, arg.data_ptr() & 15)
    if isinstance(arg, _DESCRIPTORS):
        # A descriptor's base is 16-byte aligned by construction.
        layout = getattr(arg, "layout", None)
        return (type(arg), arg.base.dtype, tuple(arg.block_shape), layout, arg.padding)
    return (type(arg), arg)


def _args_key(args: tuple) -> tuple:
    """The memo's key of a call's positional arguments, each as :func:`_arg_key` keys it. Plain
    tensors and integers, nearly all of a launch's arguments, are keyed inline: a call of
    :func:`_arg_key` for each was the largest host cost of an eager decode step under cProfile
    (63 calls a step; H200 host, 2026-11-27)."""
    return tuple(
        [
            (a.dtype, a.data_ptr() & 15) if type(a) is torch.Tensor
            else a if type(a) is int  # never equal to another type's key, which is a tuple
            else _arg_key(a)
            for a in args
        ]
    )  # fmt: skip


def _on_gpu(arg: Any) -> bool:
    base = arg.base if isinstance(arg, _DESCRIPTORS) else arg
    return isinstance(base, torch.Tensor) and base.device.type == "cuda"


class Launcher:
    """``Launcher(kernel)[grid](*args, **kwargs)`` launches ``kernel`` as ``kernel[grid]`` would,
    reusing the compiled kernel of an earlier call whose arguments Triton would have specialized
    the same way.

    Positional arguments are the kernel's leading parameters; keyword arguments name the rest
    (constexprs) and launch options (``num_warps``, ``num_stages``).
    """

    def __init__(self, kernel: Any):
        self.kernel = kernel
        self.direct = isinstance(kernel, JITFunction)  # False under the interpreter
        self.names = [p.name for p in kernel.params] if self.direct else []
        self.compiled: dict[tuple, Any] = {}

    def __getitem__(self, grid: tuple[int, ...]):
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def launch(self, grid: tuple[int, ...], args: tuple, kwargs: dict) -> None:
        if (
            not self.direct
            or not _on_gpu(args[0])
            or _hooked(knobs.runtime.launch_enter_hook)
            or _hooked(knobs.runtime.launch_exit_hook)
            or self.kernel.pre_run_hooks
        ):
            self.kernel[grid](*args, **kwargs)
            return
        # Triton compiles for, and launches on, the current device and stream (not the tensors').
        device = triton.runtime.driver.active.get_current_device()
        key = (device, knobs.runtime.debug, _args_key(args), tuple(kwargs.items()))
        compiled = self.compiled.get(key)
        if compiled is None:
            compiled = self.kernel[grid](*args, **kwargs)
            if hasattr(compiled, "result"):  # Triton's asynchronous compilation mode
                compiled = compiled.result()
            if set(self.names[len(args) :]) <= kwargs.keys():  # else defaults fill the rest
                if len(self.compiled) >= _MAX_KEYS:
                    self.compiled.clear()
                self.compiled[key] = compiled
            return
        # The launcher takes every parameter in the signature's order, constexprs included (it
        # skips them), after the grid, stream, function and Triton's launch metadata and hooks
        # (none here: a hook sends the call down Triton's own path above).
        bound = args + tuple(kwargs[name] for name in self.names[len(args) :])
        grid3 = (*grid, 1, 1)
        stream = triton.runtime.driver.active.get_current_stream(device)
        compiled.run(
            grid3[0], grid3[1], grid3[2], stream, compiled.function, compiled.packed_metadata,
            None, None, None, *bound,
        )  # fmt: skip


def launcher_for(kernel: Any) -> Any:
    """``kernel``'s :class:`Launcher`, made on its first launch and kept on the kernel. A stand-in
    that is not a Triton kernel (a test's spy or recorder) is returned as it is, so it sees
    every call."""
    if not isinstance(kernel, JITFunction):
        return kernel
    launcher = kernel.__dict__.get("_s2attn_launcher")
    if launcher is None:
        launcher = kernel._s2attn_launcher = Launcher(kernel)
    return launcher
