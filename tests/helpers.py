"""What every test module shares: the device, the dtypes to test on it, random inputs of the
attention layout, one comparison, a spy on kernel launches, a guard against allocating tensors
and a tiny Llama config."""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ON_GPU = DEVICE == "cuda"

# bf16 kernels run on the GPU only: under the Triton interpreter bf16 calls compute in float32
# (test_interpreter_bf16.py checks that), so a bf16 case there would test the float32 kernels.
DTYPES = [torch.float16, torch.bfloat16] if ON_GPU else [torch.float16, torch.float32]


def dtype_ids(dtypes) -> list[str]:
    """Test ids of dtypes: "float16", not "dtype0"."""
    return [str(d).removeprefix("torch.") for d in dtypes]


DTYPE_IDS = dtype_ids(DTYPES)

# A test's subprocess or wait is bounded by this only to end a hang, never to judge speed. The
# slowest test seen, the long-context pipeline, took 31 minutes in all beside `-n 2` and a CPU
# burner on a 2-core host at load averages of 11-18; an hour a subprocess is far past that.
HANG_GUARD_S = 3600

# Relative error (norm of the difference over the norm of the float32 reference) allowed per dtype.
REL_TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-4}

gpu_only = pytest.mark.gpu
skip_without_gpu = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device")


# What a child prints before the step that should fail on the device, and after it.
_REACHED, _NOT_ASSERTED = "reached the step", "no assertion"


def assert_fails_on_the_device(test_file: str, function: str, timeout: int = 300) -> None:
    """Run ``function(child=True)`` of the test module ``test_file`` in a fresh Python and check
    that it ends in a CUDA device assertion inside :func:`run_to_the_device_assertion`'s step. A
    device assertion leaves the process's CUDA context unusable, so a test of one cannot run in
    the test process itself."""
    folder = os.path.dirname(os.path.abspath(test_file))
    module = os.path.splitext(os.path.basename(test_file))[0]
    paths = [os.path.dirname(os.path.abspath(__file__)), folder]
    code = f"import sys; sys.path[:0] = {paths!r}; import {module}; {module}.{function}(child=True)"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout
    )
    tail = f"stdout:\n{done.stdout[-2000:]}\nstderr:\n{done.stderr[-4000:]}"
    assert _REACHED in done.stdout, tail
    assert _NOT_ASSERTED not in done.stdout and done.returncode != 0, tail
    assert "device-side assert" in done.stderr, tail


def run_to_the_device_assertion(step) -> None:
    """The child's side of :func:`assert_fails_on_the_device`: run ``step`` and wait for the
    device, with a mark before and after that the parent reads."""
    print(_REACHED, flush=True)
    step()
    torch.cuda.synchronize()
    print(_NOT_ASSERTED, flush=True)


def randn(gen: torch.Generator, *shape: int, dtype: torch.dtype, device=DEVICE) -> torch.Tensor:
    """Standard normal values drawn from ``gen`` on the CPU, so every device sees the same, then
    moved to ``device`` in ``dtype``."""
    return torch.randn(*shape, generator=gen).to(device, dtype)


def random_qkv(
    gen: torch.Generator, batch, seq_q, seq_k, heads, kv_heads, dim, dtype, device=DEVICE
) -> list[torch.Tensor]:
    """q (batch, seq_q, heads, dim) and k, v (batch, seq_k, kv_heads, dim), drawn in that order
    by :func:`randn`."""
    return [
        randn(gen, batch, seq, h, dim, dtype=dtype, device=device)
        for seq, h in ((seq_q, heads), (seq_k, kv_heads), (seq_k, kv_heads))
    ]


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.double(), expected.double()
    finite = torch.isfinite(expected)
    if not torch.equal(torch.isfinite(actual), finite):
        return float("inf")
    diff = (actual - expected).masked_fill(~finite, 0)
    ref = expected.masked_fill(~finite, 0)
    denom = ref.norm().item()
    num = diff.norm().item()
    if denom == 0:
        return num
    return num / denom


def views_rows_apart(
    count: int, rows: int, dim: int, row_stride: int, dtype, device: str = DEVICE
) -> list:
    """``count`` views (1, rows, 1, dim) side by side in one buffer that is never filled, their
    rows ``row_stride`` elements apart: element offsets past 2^31 for the cost of the pages the
    rows touch (virtual memory on the CPU)."""
    buf = torch.empty(rows * row_stride + count * dim, dtype=dtype, device=device)
    shape, strides = (1, rows, 1, dim), (rows * row_stride, row_stride, dim, 1)
    return [buf.as_strided(shape, strides, storage_offset=i * dim) for i in range(count)]


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str):
    """Fail unless ``actual`` is within REL_TOL[dtype] of ``expected``; print the error either way.

    Non-finite entries (LSE -inf of rows that attend nothing) must match exactly in place and sign.
    """
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    assert not torch.isnan(actual).any(), f"{what}: NaN in result (unwritten or invalid element)"
    if not torch.equal(actual.isinf(), expected.isinf()) or not torch.equal(
        actual[actual.isinf()], expected[expected.isinf()]
    ):
        raise AssertionError(f"{what}: infinities differ from the reference")
    err = relative_error(actual, expected)
    tol = REL_TOL[dtype]
    print(f"{what}: relative error {err:.2e} (tolerance {tol:.0e}, {dtype})")
    assert err < tol, f"{what}: relative error {err:.3e} >= {tol:.0e} for {dtype}"


class LaunchSpy:
    """Stands in for a Triton kernel (``monkeypatch.setattr(module, name, LaunchSpy(kernel))``)
    and records each launch's keywords in ``calls``."""

    def __init__(self, kernel):
        self.kernel, self.calls = kernel, []

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*args, **kwargs):
            self.calls.append(kwargs)
            return launch(*args, **kwargs)

        return run


def tiny_llama_config(num_layers: int = 3, **overrides):
    """A transformers ``LlamaConfig`` small enough for CPU tests: hidden 64, 4 query / 2 KV heads,
    vocabulary 128, 256 positions; ``overrides`` replace or add fields (e.g. ``head_dim``)."""
    import transformers

    fields = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=256,
        initializer_range=0.2,  # spread logits: no greedy near-ties
        bos_token_id=1,
        eos_token_id=None,
        pad_token_id=0,
    )
    return transformers.LlamaConfig(**(fields | overrides))


def write_source_corpus(root, files: int = 16, functions: int = 30) -> None:
    """Source-like files under ``root/pkg`` that fall in both splits at val_fraction 0.3, for
    training tests that must not walk site-packages."""
    from s2attn.training import data

    names = [f"pkg/mod_{i}.py" for i in range(files)]
    splits = {data.split_of(n, 0.3) for n in names}
    assert splits == {"train", "val"}, "the corpus's file names must fall in both splits"
    for i, name in enumerate(names):
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(
            "".join(
                f"def f{i}_{j}(x, y):\n    return x * {j} + y - {i}\n\n\n" for j in range(functions)
            )
        )


_TENSOR_FACTORIES = ("arange", "empty", "full", "full_like", "ones", "repeat_interleave", "zeros")


@contextlib.contextmanager
def no_tensor_allocation(monkeypatch: pytest.MonkeyPatch):
    """Within the block, torch's tensor factories fail the test: a size check that must run
    before anything is allocated raises first, or the test fails."""

    def refuse(*args, **kwargs):
        raise AssertionError("a tensor was allocated before the size check")

    with monkeypatch.context() as patch:
        for name in _TENSOR_FACTORIES:
            patch.setattr(torch, name, refuse)
        yield


# The model tests' `s2attn train` options: the tiny preset at 64 tokens on the CPU (shorter than
# its 256, long enough for the validation needles); the training rows carry no needles (4 of
# them need 96 tokens).
def tiny_train_argv(batch_size: int) -> list[str]:
    options = {
        "--preset": "tiny",
        "--seq-len": "64",
        "--batch-size": str(batch_size),
        "--device": "cpu",
        "--needle-fraction": "0",
        "--val-batches": "1",
        "--val-needles": "2",
        "--val-fraction": "0.3",
    }
    return [*(x for pair in options.items() for x in pair), "--no-progress"]


def train_args(argv: list[str], out, root, *extra: str) -> argparse.Namespace:
    """``s2attn train``'s parsed arguments: ``argv``, the corpus at ``root``, the run in ``out``,
    then ``extra``."""
    from s2attn.training import train

    parser = argparse.ArgumentParser()
    train.add_arguments(parser)
    return parser.parse_args([*argv, "--data-root", str(root), "--out", str(out), *extra])


def s2_layers_on_reference(mp: pytest.MonkeyPatch) -> None:
    """The S2 layers of the transformers integration on the exact dense-mask reference: under the
    interpreter (conftest) an S2 forward pass takes seconds, and the kernels have their own
    tests. The config still says "s2attn"."""
    import s2attn
    from s2attn.integrations import transformers as s2hf

    mp.setattr(s2hf, "sparse_attention", s2attn.attention_reference)
