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
