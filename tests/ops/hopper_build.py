"""Builds one Gluon kernel launch for sm_90a on any machine and prints ptxas's verbose report
(used by test_hopper_build.py, in a process of its own: the build needs the compiler, which
``TRITON_INTERPRET=1`` replaces at import).

    python tests/ops/hopper_build.py forward-128
    python tests/ops/hopper_build.py decode-128      # the Triton decode kernel, 5 splits, 1 token
    python tests/ops/hopper_build.py decode_p16-128  # the same, page ids prefetched 16 at a time
    python tests/ops/hopper_build.py --sass dq-128   # its machine code (nvdisasm) instead

Each launcher runs on CPU tensors with its kernel swapped for a recorder, so the build takes
exactly the arguments and options a real launch passes.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.experimental.gluon._runtime import GluonASTSource, GluonJITFunction
from triton.runtime.jit import mangle_type

from s2attn import local_stride_pattern
from s2attn.inference import paged_kv_cache
from s2attn.ops.gluon import backward_sm90, forward_sm90
from s2attn.ops.layout import backward_layout, forward_layout
from s2attn.ops.options import (
    GluonDkdvConfig,
    GluonDqConfig,
    GluonForwardConfig,
    TritonDecodeConfig,
)
from s2attn.ops.triton import decode as triton_decode

PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
SEQ, HEADS = 1024, 4


class _Recorder:
    """Stands in for a Gluon kernel: ``kernel[grid](*args, **kwargs)`` records the call."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.calls = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((args, kwargs))


def _decode_launch(dim: int, prefetch: int = 0) -> tuple:
    """The Triton decode kernel's launch for a 7B-shaped layer (32/8 heads, block 64, local 16,
    stride 64; a 2000-token context, one new token, 5 splits): it spilled at 4 warps when this
    case was added (255 registers; its page loads are 64-bit pointer tensors). ``prefetch``: its
    ``prefetch_entries`` (case ``decode_p16-128``: 16)."""
    pattern = local_stride_pattern(
        8, max_seq_len=4096, block_size=64, local_blocks=16, vert_stride=64
    )
    cache = paged_kv_cache(pattern, batch_size=1, num_kv_heads=8, head_dim=dim,
                         dtype=torch.bfloat16, device="cpu", max_seq_len=4096)  # fmt: skip
    kv = torch.randn(1, 2000, 8, dim, dtype=torch.bfloat16)
    cache.append(kv, kv)
    recorder = _Recorder(triton_decode._decode_kernel)
    triton_decode._DECODE = recorder
    triton_decode.decode(
        torch.randn(1, 1, 32, dim, dtype=torch.bfloat16), cache.k_pages, cache.v_pages,
        cache.page_table, cache.seq_lens, cache.decode_layout, softmax_scale=0.1, num_splits=5,
        split_counters=torch.zeros(8, dtype=torch.int32),
        config=TritonDecodeConfig(prefetch_entries=prefetch),
    )  # fmt: skip
    ((args, kwargs),) = recorder.calls
    return recorder.kernel, args, kwargs


def _launch(case: str) -> tuple:
    """(kernel, args, kwargs) of the launch the case's launcher makes."""
    name, dim = case.rsplit("-", 1)
    if name == "decode" or name.startswith("decode_p"):
        return _decode_launch(int(dim), int(name.removeprefix("decode").removeprefix("_p") or 0))
    q, k, v, out, grad_out, grad = (
        torch.empty(1, SEQ, HEADS, int(dim), dtype=torch.bfloat16) for _ in range(6)
    )
    lse, delta = torch.empty(1, HEADS, SEQ), torch.empty(1, HEADS, SEQ)
    stats = torch.empty(HEADS, 2, SEQ)
    pattern = local_stride_pattern(
        HEADS, max_seq_len=SEQ, block_size=64, local_blocks=4, vert_stride=3
    )
    for module in (forward_sm90, backward_sm90):
        module.num_sms = lambda device: 132
        module.item_counter = lambda device: torch.zeros(1, dtype=torch.int32)
    module, launcher_name = {
        "forward": (forward_sm90, "_FORWARD"),
        "dq": (backward_sm90, "_DQ"),
        "dkdv": (backward_sm90, "_DKDV"),
    }[name]
    recorder = _Recorder(getattr(module, launcher_name).kernel)
    setattr(module, launcher_name, recorder)
    if name == "forward":
        forward_sm90.forward(
            q,
            k,
            v,
            out,
            lse,
            forward_layout(pattern, 128, 64, "cpu"),
            softmax_scale=0.1,
            q_heads_per_pattern_head=1,
            config=GluonForwardConfig(),
        )
    elif name == "dq":
        backward_sm90.dq(
            grad_out,
            q,
            k,
            v,
            out,
            lse,
            None,
            delta,
            stats,
            grad,
            forward_layout(pattern, 128, 64, "cpu"),
            softmax_scale=0.1,
            q_heads_per_pattern_head=1,
            config=GluonDqConfig(),
        )
    else:
        backward_sm90.dkdv(
            grad_out,
            q,
            k,
            v,
            stats,
            grad,
            torch.empty_like(grad),
            backward_layout(pattern, 64, 64, "cpu", SEQ // 64),
            softmax_scale=0.1,
            q_heads_per_pattern_head=1,
            config=GluonDkdvConfig(),
        )
    ((args, kwargs),) = recorder.calls
    return recorder.kernel, args, kwargs


def _ptx(case: str) -> tuple[str, list[str]]:
    """The case's PTX for sm_90a and the ptxas flags its launch implies."""
    kernel, args, kwargs = _launch(case)
    launch_options = ("num_warps", "num_stages", "maxnreg")
    options = {key: kwargs.pop(key) for key in launch_options if key in kwargs}
    values = dict(zip(kernel.arg_names, args), **kwargs)
    signature, constexprs = {}, {}
    for i, (name, param) in enumerate(zip(kernel.arg_names, kernel.params)):
        value = values[name]
        if param.is_constexpr:
            signature[name] = "constexpr"
            constexprs[(i,)] = value
        else:
            signature[name] = "fp32" if isinstance(value, float) else mangle_type(value)
    source_type = GluonASTSource if isinstance(kernel, GluonJITFunction) else ASTSource
    source = source_type(kernel, signature, constexprs)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 128), options=options)
    flags = [f"--maxrregcount={options['maxnreg']}"] if "maxnreg" in options else []
    return compiled.asm["ptx"], flags


def _ptxas(ptx: str, flags: list[str], cubin: str) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        source = os.path.join(tmp, "kernel.ptx")
        Path(source).write_text(ptx)
        cmd = [os.fspath(PTXAS), "-arch=sm_90a", "-v", source, "-o", cubin, *flags]
        done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:  # say what ptxas said: its exit status alone tells nothing
        raise RuntimeError(f"ptxas exited with {done.returncode}:\n{done.stdout}{done.stderr}")
    return done.stdout + done.stderr


def ptxas_report(case: str) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        return _ptxas(*_ptx(case), os.path.join(tmp, "kernel.o"))


def sass(case: str) -> str:
    """The case's sm_90a machine code as nvdisasm prints it."""
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "kernel.cubin")
        _ptxas(*_ptx(case), cubin)
        done = subprocess.run(
            [os.fspath(PTXAS.with_name("nvdisasm")), "-c", cubin],
            capture_output=True,
            text=True,
            check=True,
        )
    return done.stdout


if __name__ == "__main__":
    if sys.argv[1] == "--sass":
        print(sass(sys.argv[2]))
    else:
        print(ptxas_report(sys.argv[1]))
