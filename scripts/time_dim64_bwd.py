"""fwd+bwd at dim 64, 8k: Gluon dQ against the Triton one, twice each (dev aid)."""
import torch
import triton

import s2attn
from s2attn import local_stride_pattern
from s2attn.ops import backward as bwd

print(torch.cuda.get_device_name())
p = local_stride_pattern(32, 8192, 64, 16, 16)
q, k, v = (torch.randn(1, 8192, 32, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
           for _ in range(3))
g = torch.randn(1, 8192, 32, 64, device="cuda", dtype=torch.bfloat16)


def step():
    out = s2attn.sparse_attention(q, k, v, p)
    out.backward(g)


original = bwd.backward_tile_sizes
for label in ("gluon dQ", "triton dQ", "gluon dQ", "triton dQ"):
    if label.startswith("triton"):
        bwd.backward_tile_sizes = lambda *a: ((64, 64), (64, 64))
    else:
        bwd.backward_tile_sizes = original
    ms = triton.testing.do_bench(step, warmup=25, rep=200, return_mode="median")
    print(f"{label}: {ms:.3f} ms")
