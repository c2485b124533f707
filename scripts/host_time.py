"""Host time of a call (shared by the dev aids in scripts/)."""

import time

import torch


def host_ms(fn, calls: int) -> float:
    """Milliseconds of host time per call of ``fn``, over ``calls`` calls back to back after one
    warm-up; the GPU may still be busy with them when the calls return."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - t0) / calls * 1e3
    torch.cuda.synchronize()
    return host


def short_call_inputs(seq: int = 8192, stride: int = 16):
    """(pattern, q, k, v, upstream gradient) of the benchmark shape whose calls are host-bound:
    batch 1, 32 heads, dim 128, bf16, causal, block 64, local 16; prints the device."""
    from s2attn import local_stride_pattern

    pattern = local_stride_pattern(32, seq, 64, 16, stride)
    q, k, v = (
        torch.randn(1, seq, 32, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        for _ in range(3)
    )  # fmt: skip
    print(torch.cuda.get_device_name(), torch.__version__)
    return pattern, q, k, v, torch.randn_like(q)
