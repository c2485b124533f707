"""benchmarks/context_parallel.py's check without the whole sequence (--no-reference), on gloo
ranks: its float32 rows from the seeded inputs against the dense-mask reference's, and a wrong
gradient found."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from gloo import spawn

import s2attn
from s2attn.distributed import context_parallel_attention

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _bench():
    sys.path.insert(0, str(BENCHMARKS))
    import context_parallel

    return context_parallel


def _args(seq, heads, kv_heads, dim, check_rows=6):
    from argparse import Namespace

    return Namespace(seq=seq, heads=heads, kv_heads=kv_heads, dim=dim, check_rows=check_rows)


def _sampled_rows_body(rank, world, pattern, args, expect_keys):
    bench = _bench()
    bench.SPAN = 64  # spans of four blocks: rows read keys from several
    positions = bench.shard_positions(args.seq, world, rank)
    shapes = dict(q=(args.heads, args.dim), k=(args.kv_heads, args.dim))
    shapes.update(v=shapes["k"], grad=shapes["q"])
    q, k, v, grad = (
        bench.seeded_rows(n, positions, shapes[n], torch.float32, "cpu")[None]
        for n in ("q", "k", "v", "grad")
    )
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out, lse = context_parallel_attention(q, k, v, pattern, return_lse=True)
    out.backward(grad)
    got = (out.detach(), lse.detach(), q.grad, k.grad, v.grad)
    errors = bench.sampled_row_errors(*got, pattern, positions, args, torch.float32, "cpu")
    assert sorted(errors) == sorted(["out", "lse", "dq"] + ["dk", "dv"] * expect_keys)
    assert max(errors.values()) < 1e-5, errors
    if expect_keys:  # a wrong gradient on the shard's rows is caught
        wrong = bench.sampled_row_errors(out.detach(), lse.detach(), q.grad, k.grad * 1.01,
                                         v.grad.roll(1, 1), pattern, positions, args,
                                         torch.float32, "cpu")  # fmt: skip
        assert wrong["dk"] > 5e-3 and wrong["dv"] > 0.1, wrong


def test_sampled_rows_match_the_reference():
    """Query rows (out, LSE, dq) and key rows outside every stripe (dk, dv, summed over their
    local windows' queries, some on the next rank), over spans of the sequence smaller than a
    shard; a dense pattern's keys have every later query as a reader and go unchecked."""
    args = _args(seq=256, heads=4, kv_heads=2, dim=16)
    s2 = s2attn.local_stride_pattern(
        4, max_seq_len=256, block_size=16, local_blocks=2, vert_stride=4, num_kv_heads=2
    )
    spawn(2, _sampled_rows_body, s2, args, True)
    dense = s2attn.dense_pattern(4, max_seq_len=256, block_size=16)
    spawn(2, _sampled_rows_body, dense, args, False)
