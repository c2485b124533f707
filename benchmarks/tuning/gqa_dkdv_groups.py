"""Whole backward at 128k, GQA 32/8, V16, for dK/dV queue groupings (the Gluon dK/dV kernel's
``heads_per_group``) and both GQA patterns (one per query head; one per KV group): the dK/dV
group rule of docs/design.md.

Drives ``s2attn.ops.dispatch.backward`` directly, with a ``GluonDkdvConfig`` in its
``KernelOptions`` (``s2attn.ops.options``): it follows them when they change.

    python benchmarks/tuning/gqa_dkdv_groups.py
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton

import s2attn
from s2attn import local_stride_pattern
from s2attn.ops import dispatch
from s2attn.ops.layout import backward_layout, forward_layout
from s2attn.ops.options import GluonDkdvConfig, KernelOptions

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for shapes
from shapes import BLOCK, DIM, HEADS, KV_HEADS, LOCAL_BLOCKS


def time_groupings(seq: int, group_pattern: bool, groupings: list[int | None]) -> None:
    p = local_stride_pattern(
        HEADS,
        max_seq_len=seq,
        block_size=BLOCK,
        local_blocks=LOCAL_BLOCKS,
        vert_stride=16,
        num_kv_heads=KV_HEADS if group_pattern else None,
    )
    q = torch.randn(1, seq, HEADS, DIM, device="cuda", dtype=torch.bfloat16)
    k, v = (
        torch.randn(1, seq, KV_HEADS, DIM, device="cuda", dtype=torch.bfloat16) for _ in range(2)
    )
    g = torch.randn_like(q)
    out, lse = s2attn.sparse_attention(q, k, v, p, return_lse=True)
    lay_kv = backward_layout(p, 64, 64, q.device, seq // 64)
    lay_q = forward_layout(p, 128, 64, q.device)
    # A pattern per KV group: each layout head serves the group's query heads.
    per_pattern_head = HEADS // KV_HEADS if group_pattern else 1
    for hpg in groupings:
        options = KernelOptions(gluon_dkdv=GluonDkdvConfig(heads_per_group=hpg))
        ms = triton.testing.do_bench(
            lambda options=options: dispatch.backward(
                g,
                q,
                k,
                v,
                out,
                lse,
                None,
                lay_kv,
                lay_q,
                softmax_scale=DIM**-0.5,
                q_heads_per_pattern_head=per_pattern_head,
                options=options,
            ),
            warmup=5,
            rep=40,
            return_mode="median",
        )
        name = "auto" if hpg is None else hpg
        print(f"group pattern {group_pattern} heads_per_group {name}: backward {ms:.2f} ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=131072)
    ap.add_argument(
        "--groups", default="auto,1,2,4,8", help="heads_per_group values ('auto': the kernel's)"
    )
    args = ap.parse_args()
    groupings = [None if x == "auto" else int(x) for x in args.groups.split(",")]
    print(torch.cuda.get_device_name(), s2attn.__file__)
    for group_pattern in (True, False):
        time_groupings(args.seq, group_pattern, groupings)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
