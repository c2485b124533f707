"""Host-side profile of sparse_attention's forward launch (dev aid)."""
import cProfile
import pstats

import torch

import s2attn
from s2attn import local_stride_pattern

p = local_stride_pattern(32, 8192, 64, 16, 16)
q, k, v = (torch.randn(1, 8192, 32, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
for _ in range(5):
    s2attn.sparse_attention(q, k, v, p)
torch.cuda.synchronize()
prof = cProfile.Profile()
prof.enable()
for _ in range(200):
    s2attn.sparse_attention(q, k, v, p)
prof.disable()
torch.cuda.synchronize()
pstats.Stats(prof).sort_stats("tottime").print_stats(25)
