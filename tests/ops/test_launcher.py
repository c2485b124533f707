"""The launcher that skips Triton's per-call binding (``s2attn/ops/launcher.py``): two calls share
a compiled kernel only when Triton would have specialized their arguments alike. Its launches on
the GPU are tested where it is used: decode (inference/test_decode.py) and the Gluon kernels."""

from __future__ import annotations

import itertools

import torch
from triton._C.libtriton import native_specialize_impl
from triton.backends.nvidia.compiler import CUDABackend
from triton.tools.tensor_descriptor import TensorDescriptor

from s2attn.ops.gluon.common_sm90 import tma_descriptor
from s2attn.ops.launcher import _args_key


def _key(arg) -> tuple:
    """The memo's key of ``arg`` as a call's one argument (tensors and integers keyed inline)."""
    return _args_key((arg,))


def _specialization(arg) -> tuple:
    """What Triton 3.6 compiles ``arg`` as: its type string and specialization."""
    return native_specialize_impl(CUDABackend, arg, False, True, True)


def _arguments() -> list:
    """Arguments that differ in every way Triton specializes on, and in ways it does not."""
    buf = torch.zeros(4096, dtype=torch.float16)
    rows = torch.zeros(2, 1030, 4, 128, dtype=torch.bfloat16)
    tensors = [buf[:8], buf[8:16], buf[1:9], buf[:8].float()]  # alignment, dtype
    # Integer width, divisibility by 16, equality to one; floats, some equal to those integers.
    scalars = [16, 17, 1, True, 0, 2**31, 0.5, 0.25, 1.0, 16.0]
    gluon_descriptors = [
        tma_descriptor(rows[:, :1024], 64),  # other bases, shapes and strides
        tma_descriptor(rows[:, 2:1026], 64),
        tma_descriptor(rows[:1, :512], 64),
        tma_descriptor(rows[:, :1024], 128),  # another block shape
        tma_descriptor(rows[:, :1024].half(), 64),  # another dtype
    ]
    triton_descriptors = [
        TensorDescriptor.from_tensor(buf.view(64, 64), [16, 16]),
        TensorDescriptor.from_tensor(buf[64:].view(63, 64), [16, 16]),
        TensorDescriptor.from_tensor(buf.view(64, 64), [32, 16]),
    ]
    return tensors + scalars + gluon_descriptors + triton_descriptors


def test_keys_separate_what_triton_specializes():
    # Equal keys would launch one compiled kernel for both: Triton must have compiled them alike.
    args = _arguments()
    for a, b in itertools.combinations(args, 2):
        if _key(a) == _key(b):
            assert _specialization(a) == _specialization(b), (a, b)


def test_keys_match_across_calls_that_triton_compiles_alike():
    # And the memo is of use: calls that differ only in what goes to the launch share a key.
    buf = torch.zeros(64, dtype=torch.float16)
    assert _key(buf[:8]) == _key(buf[8:16])
    rows = torch.zeros(2, 1030, 4, 128, dtype=torch.bfloat16)
    same = [tma_descriptor(t, 64) for t in (rows[:, :1024], rows[:, 2:1026], rows[:1, :512])]
    assert len({_key(d) for d in same}) == 1
