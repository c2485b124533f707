"""Static checks on the Triton and Gluon kernels that the CPU interpreter cannot make.

The interpreter runs kernels as Python, so a kernel reading a module-level float (say ``LOG2E``)
works on the CPU and fails to compile on a GPU: compiled kernels may read only constexpr globals.
"""

from __future__ import annotations

import importlib
import types

import pytest
import triton.language as tl

MODULES = [
    "s2attn.ops.triton.common",
    "s2attn.ops.triton.forward",
    "s2attn.ops.triton.backward",
    "s2attn.ops.triton.row_delta",
    "s2attn.ops.triton.decode",
    "s2attn.ops.triton.page_write",
    "s2attn.ops.gluon.common_sm90",
    "s2attn.ops.gluon.forward_sm90",
    "s2attn.ops.gluon.backward_sm90",
]


def _kernels(module):
    for name, obj in vars(module).items():
        fn = getattr(obj, "fn", None)
        if isinstance(fn, types.FunctionType) and fn.__module__ == module.__name__:
            yield name, fn


@pytest.mark.parametrize("module_name", MODULES)
def test_kernels_read_only_constexpr_globals(module_name):
    module = importlib.import_module(module_name)
    kernels = dict(_kernels(module))
    assert kernels, f"no Triton kernels found in {module_name}"
    bad = []
    for name, fn in kernels.items():
        for ref in fn.__code__.co_names:
            value = fn.__globals__.get(ref)
            if isinstance(value, (bool, int, float, str)) and not isinstance(value, tl.constexpr):
                bad.append(f"{name} reads {ref} = {value!r}")
    assert not bad, "kernels read non-constexpr globals (fails to compile on a GPU): " + "; ".join(
        bad
    )
