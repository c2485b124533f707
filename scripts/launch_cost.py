"""Host cost of the pieces of one sparse_attention call at 8k (dev aid): the whole forward and
fwd+bwd, one Gluon forward launch through Triton's dispatcher and straight to its compiled
launcher, descriptor building, the input checks and a bare autograd.Function. Microseconds of
host time per call (``host_time.host_ms``), median of five runs.

    python scripts/launch_cost.py
"""

import statistics

import torch
from host_time import host_ms, short_call_inputs

import s2attn
from s2attn.ops import common, forward_hopper

p, q, k, v, g = short_call_inputs()


def us(fn, calls=200):
    return statistics.median(host_ms(fn, calls) for _ in range(5)) * 1e3


class Recorder:
    """Stands in for the Gluon forward kernel for one call and keeps its launch arguments."""

    def __init__(self, kernel):
        self.kernel, self.launch = kernel, None

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launch = (grid, args, kwargs)
            return self.kernel[grid](*args, **kwargs)

        return launch


kernel = forward_hopper._forward_kernel
recorder = forward_hopper._forward_kernel = Recorder(kernel)
s2attn.sparse_attention(q, k, v, p)
forward_hopper._forward_kernel = kernel
grid, args, kwargs = recorder.launch
device = torch.cuda.current_device()
compiled = kernel.run(*args, grid=grid, warmup=False, **kwargs)
bound, _, _ = kernel.device_caches[device][4](*args, **kwargs)
bound = list(bound.values())
stream = torch.cuda.current_stream().cuda_stream


def direct():
    compiled.run(grid[0], 1, 1, stream, compiled.function, compiled.packed_metadata, None,
                 None, None, *bound)  # fmt: skip


class Bare(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.detach()

    @staticmethod
    def backward(ctx, grad):
        return grad


x = torch.randn(4, device="cuda", requires_grad=True)
q0, k0, v0 = (t.detach() for t in (q, k, v))
gx = torch.randn(4, device="cuda")
rows = {
    "fwd+bwd call": lambda: torch.autograd.grad(s2attn.sparse_attention(q, k, v, p), (q, k, v), g),
    "forward call (no grad)": lambda: s2attn.sparse_attention(
        q.detach(), k.detach(), v.detach(), p
    ),
    "forward call (grad)": lambda: s2attn.sparse_attention(q, k, v, p),
    "forward kernel through the dispatcher": lambda: kernel[grid](*args, **kwargs),
    "forward kernel, compiled launcher": direct,
    "3 descriptors": lambda: [forward_hopper._descriptor(t, 64) for t in (q, k, v)],
    "item counter": lambda: forward_hopper.item_counter(q.device),
    "tma_allowed(q, k, v)": lambda: common.tma_allowed(q.device, q, k, v),
    "bare autograd fwd+bwd": lambda: torch.autograd.grad(Bare.apply(x), (x,), gx),
    "torch.empty_like(q)": lambda: torch.empty_like(q),
}
for name, fn in rows.items():
    print(f"{name:>40}: {us(fn):8.1f} us")
