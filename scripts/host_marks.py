"""Where the host's time goes inside one fwd+bwd call at 8k (dev aid): wall time between marks
set by wrappers around the call's layers (``_Call.forward/backward``, ``ops.forward/backward``,
``dq_hopper``, ``dkdv_hopper``; with --fine also their helpers and each kernel launch),
medians over 40 calls; then whole calls free-running and synchronized after each, and whether
anything in a call synchronizes with the GPU (``torch.cuda.set_sync_debug_mode``). V16, dim 128,
bf16, batch 1, 32 heads.

    python scripts/host_marks.py --fine
"""

import argparse
import statistics
import time

import torch
from host_time import short_call_inputs

import s2attn
from s2attn import attention
from s2attn.ops import backward, backward_hopper, forward, forward_hopper

ap = argparse.ArgumentParser()
ap.add_argument(
    "--fine", action="store_true",
    help="also mark the helpers inside ops.forward/backward and each kernel launch",
)  # fmt: skip
args = ap.parse_args()
p, q, k, v, g = short_call_inputs()
marks: list[tuple[str, float]] = []


def mark(name: str) -> None:
    marks.append((name, time.perf_counter()))


def wrap(owner, name: str, label: str) -> None:
    inner = getattr(owner, name)

    def marked(*args, **kwargs):
        mark(f"{label}>")
        result = inner(*args, **kwargs)
        mark(f"{label}<")
        return result

    setattr(owner, name, marked)


wrap(attention._Call, "forward", "_Call.forward")
wrap(attention._Call, "backward", "_Call.backward")
wrap(forward, "forward", "ops.forward")
wrap(backward, "backward", "ops.backward")
wrap(backward_hopper, "dq_hopper", "dq_hopper")
wrap(backward_hopper, "dkdv_hopper", "dkdv_hopper")


class MarkedKernel:
    """Marks around each launch of a kernel (``kernel[grid](...)``)."""

    def __init__(self, kernel, label: str):
        self.kernel, self.label = kernel, label

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            mark(f"{self.label}>")
            self.kernel[grid](*args, **kwargs)
            mark(f"{self.label}<")

        return launch


if args.fine:
    for module, name in (
        (forward, "_hopper_kernel_takes"), (forward_hopper, "forward_hopper"),
        (forward_hopper, "item_counter"), (forward_hopper, "_descriptor"),
        (backward, "_launch_options"), (backward, "tma_allowed"),
        (backward, "_hopper_dkdv_takes"), (backward, "_hopper_dq_takes"),
        (backward_hopper, "item_counter"), (backward_hopper, "_descriptor"),
        (backward_hopper, "row_stats_descriptor"),
    ):  # fmt: skip
        wrap(module, name, f"{module.__name__.rsplit('.', 1)[-1]}.{name}")
    for module, name in (
        (forward_hopper, "_forward_kernel"), (backward_hopper, "_dq_kernel"),
        (backward_hopper, "_dkdv_kernel"),
    ):  # fmt: skip
        setattr(module, name, MarkedKernel(getattr(module, name), f"launch {name}"))


def call():
    mark("start")
    out = s2attn.sparse_attention(q, k, v, p)
    mark("forward returned")
    grads = torch.autograd.grad(out, (q, k, v), g)
    mark("grad returned")
    del grads, out
    mark("freed")


for _ in range(5):
    call()
torch.cuda.synchronize()
torch.cuda.set_sync_debug_mode("error")
call()  # raises where a call waits for the GPU
torch.cuda.set_sync_debug_mode(0)
print("no synchronizing call in a fwd+bwd")
spans: dict[str, list[float]] = {}
totals = []
for _ in range(40):
    marks.clear()
    call()
    totals.append((marks[-1][1] - marks[0][1]) * 1e6)
    for (a, ta), (b, tb) in zip(marks, marks[1:]):
        spans.setdefault(f"{a} -> {b}", []).append((tb - ta) * 1e6)
torch.cuda.synchronize()
for span, us in spans.items():
    print(f"{span:>45}: median {statistics.median(us):7.1f} us  max {max(us):7.1f}")
print(f"{'whole call':>45}: median {statistics.median(totals):7.1f} us  max {max(totals):7.1f}")
for synced in (False, True):
    us = []
    for _ in range(40):
        t0 = time.perf_counter()
        call()
        us.append((time.perf_counter() - t0) * 1e6)
        if synced:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    how = "synchronized after each" if synced else "free-running"
    median, mean = statistics.median(us), statistics.mean(us)
    print(f"whole call, {how}: median {median:7.1f} us, mean {mean:7.1f}")
