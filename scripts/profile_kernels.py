"""One forward and one backward at 32k V64 (bf16, 32 heads, dim 128), for Nsight Compute:

    ncu -k regex:"forward_kernel|dkdv_kernel|dq_kernel" -c 3 --section SpeedOfLight ... \\
        python3 scripts/profile_kernels.py
"""

import torch

import s2attn
from s2attn import local_stride_pattern

p = local_stride_pattern(32, max_seq_len=32768, block_size=64, local_blocks=16, vert_stride=64)
q, k, v = (
    torch.randn(1, 32768, 32, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    for _ in range(3)
)
out = s2attn.sparse_attention(q, k, v, p)
out.backward(torch.randn_like(out))
torch.cuda.synchronize()
print("done")
