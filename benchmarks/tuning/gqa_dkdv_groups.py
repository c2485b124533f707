"""Whole backward at 128k, GQA 32/8, V16, for dK/dV queue groupings (heads_per_group) and both
GQA patterns (one per query head; one per KV group): NOTES.md, "open questions".

Drives s2attn.ops internals directly (names as of commit 06a44cd: ``ops.backward.backward``'s
``launch_options`` and ``pattern_head_div``): it follows them when they change.

    python benchmarks/tuning/gqa_dkdv_groups.py
"""

import torch
import triton

import s2attn
from s2attn import local_stride_pattern
from s2attn.layout import backward_layout, forward_layout
from s2attn.ops import backward as bwd

SEQ, HEADS, KV_HEADS, DIM = 131072, 32, 8, 128


def time_groupings(group_pattern: bool) -> None:
    p = local_stride_pattern(
        HEADS, SEQ, 64, 16, 16, num_kv_heads=KV_HEADS if group_pattern else None
    )
    q = torch.randn(1, SEQ, HEADS, DIM, device="cuda", dtype=torch.bfloat16)
    k, v = (
        torch.randn(1, SEQ, KV_HEADS, DIM, device="cuda", dtype=torch.bfloat16) for _ in range(2)
    )
    g = torch.randn_like(q)
    out, lse = s2attn.sparse_attention(q, k, v, p, return_lse=True)
    lay_kv = backward_layout(p, 64, 64, q.device, SEQ // 64)
    lay_q = forward_layout(p, 128, 64, q.device)
    for hpg in (None, 1, 2, 4, 8):
        options = ({"heads_per_group": hpg}, {})
        ms = triton.testing.do_bench(
            lambda options=options: bwd.backward(
                g, q, k, v, out, lse, None, lay_kv, lay_q, softmax_scale=DIM**-0.5,
                pattern_head_div=1, launch_options=options,
            ),
            warmup=5, rep=40, return_mode="median",
        )  # fmt: skip
        print(f"group pattern {group_pattern} heads_per_group {hpg}: backward {ms:.2f} ms")


print(torch.cuda.get_device_name(), s2attn.__file__)
for group_pattern in (True, False):
    time_groupings(group_pattern)
    torch.cuda.empty_cache()
