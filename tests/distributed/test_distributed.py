"""Context parallelism over gloo: 1, 2 and 4 CPU processes against the one-process reference."""

from __future__ import annotations

import pytest
import torch
from gloo import spawn
from helpers import assert_close, randn, random_qkv, views_rows_apart

import s2attn
from s2attn.distributed import (
    communication_bytes,
    context_parallel_attention,
    context_parallel_bytes,
    context_parallel_kv_bytes,
    shard,
    unshard,
)

DTYPE = torch.float32


def _inputs(batch, seq, heads, kv_heads, dim, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = random_qkv(g, batch, seq, seq, heads, kv_heads, dim, DTYPE, device="cpu")
    grad = randn(g, batch, seq, heads, dim, dtype=DTYPE, device="cpu")
    return q, k, v, grad


def _compare_body(rank, world, pattern, shape, expected):
    """Forward, LSE and gradients of the sharded call, unsharded, against the one-process ones."""
    q, k, v, grad = _inputs(*shape)
    ql, kl, vl = (shard(t).requires_grad_() for t in (q, k, v))
    out, lse = context_parallel_attention(ql, kl, vl, pattern, return_lse=True)
    out.backward(shard(grad))
    exp_out, exp_lse, exp_dq, exp_dk, exp_dv = expected
    with torch.no_grad():
        assert_close(unshard(out), exp_out, DTYPE, f"rank {rank} out")
        assert_close(unshard(lse, seq_dim=2), exp_lse, DTYPE, f"rank {rank} lse")
        assert_close(unshard(ql.grad), exp_dq, DTYPE, f"rank {rank} dq")
        assert_close(unshard(kl.grad), exp_dk, DTYPE, f"rank {rank} dk")
        assert_close(unshard(vl.grad), exp_dv, DTYPE, f"rank {rank} dv")


def _expected(pattern, shape):
    """The whole sequence in one process, by the dense-mask reference (the ground truth)."""
    q, k, v, grad = _inputs(*shape)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out, lse = s2attn.attention_reference(q, k, v, pattern, return_lse=True)
    out.backward(grad)
    return out.detach(), lse.detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize(
    "world, heads, kv_heads, dense_heads, kernels, causal",
    [
        (2, 4, 4, 0, True, True),
        (4, 4, 2, 0, False, True),
        (2, 4, 2, 2, False, True),
        (2, 4, 2, 0, True, False),
        (4, 4, 2, 2, False, False),
    ],
    ids=["2ranks-kernels", "4ranks-gqa", "2ranks-gqa-dense-heads", "2ranks-bidir-kernels",
         "4ranks-bidir-dense-head"],
)  # fmt: skip
def test_matches_one_process(world, heads, kv_heads, dense_heads, kernels, causal):
    # seq 96 is not a multiple of the block (16) per chunk with 4 ranks (12 tokens): causal
    # chunks need not align to blocks (bidirectional ones must: 128 tokens, chunks of 16). A dense
    # head next to sparse ones reads far more blocks than they do.
    seq = 96 if world == 4 and causal else 128
    pattern = s2attn.local_stride_pattern(
        heads, max_seq_len=128, block_size=16, local_blocks=2, vert_stride=3, num_kv_heads=kv_heads,
        num_dense_heads=dense_heads, causal=causal,
    )  # fmt: skip
    shape = (2, seq, heads, kv_heads, 16)
    spawn(world, _compare_body, pattern, shape, _expected(pattern, shape), kernels=kernels)


@pytest.mark.parametrize("world, causal", [(2, True), (4, True), (2, False), (4, False)])
def test_user_pattern_matches_one_process(world, causal):
    """A random user pattern (lists, not rules): heads of one KV group read different far blocks
    (so the compact keys pad the shorter lists), causal rows keep blocks past the diagonal (never
    visible), and bidirectional rows read blocks after their chunk."""
    g = torch.Generator().manual_seed(world + 10 * causal)
    mask = torch.rand(4, 8, 8, generator=g) < 0.3
    mask |= torch.eye(8, dtype=torch.bool)  # every query row keeps a block
    pattern = s2attn.BlockPattern(mask, block_size=16, causal=causal)
    seq = 96 if world == 4 and causal else 128  # unaligned causal chunks of 12 tokens
    shape = (1, seq, 4, 2, 16)
    spawn(world, _compare_body, pattern, shape, _expected(pattern, shape))


def _wide_strides_body(rank, world, pattern, shape, expected):
    """Each rank's q shard and its gradient's upstream sit 2^27 elements a row apart in a buffer
    never filled (16 GiB of virtual memory), so a chunk's rows 16.. pass 2^31 elements: the
    kernels must form those offsets in 64 bits (4M tokens over two GPUs faulted when they did
    not)."""
    q, k, v, grad = (t.half() for t in _inputs(*shape))
    local = shard(q)
    # On the CPU like every gloo rank's tensors (on a GPU machine too, where DEVICE is CUDA).
    ql, gl = views_rows_apart(2, local.shape[1], local.shape[-1], 2**27, torch.float16, "cpu")
    ql.copy_(local)
    gl.copy_(shard(grad))
    ql.requires_grad_()
    kl, vl = (shard(t).requires_grad_() for t in (k, v))
    out = context_parallel_attention(ql, kl, vl, pattern)
    out.backward(gl)
    exp_out, exp_dq = expected
    with torch.no_grad():
        assert_close(unshard(out), exp_out, torch.float16, f"rank {rank} out")
        assert_close(unshard(ql.grad), exp_dq, torch.float16, f"rank {rank} dq")


def test_shards_with_element_offsets_past_2_31():
    pattern = s2attn.local_stride_pattern(
        1, max_seq_len=128, block_size=16, local_blocks=2, vert_stride=3
    )
    shape = (1, 128, 1, 1, 16)
    q, k, v, grad = (t.half().float() for t in _inputs(*shape))
    q.requires_grad_()
    out = s2attn.attention_reference(q, k, v, pattern)
    out.backward(grad)
    spawn(2, _wide_strides_body, pattern, shape, (out.detach(), q.grad), kernels=True)


def _one_rank_body(rank, world, pattern, shape):
    q, k, v, _ = _inputs(*shape)
    out = context_parallel_attention(q, k, v, pattern, softmax_scale=0.3)
    assert torch.equal(out, s2attn.sparse_attention(q, k, v, pattern, softmax_scale=0.3))
    assert torch.equal(shard(q), q) and torch.equal(unshard(q), q)


def test_group_of_one_is_sparse_attention():
    pattern = s2attn.local_stride_pattern(
        2, max_seq_len=64, block_size=16, local_blocks=2, vert_stride=2
    )
    spawn(1, _one_rank_body, pattern, (1, 64, 2, 2, 16))


def _errors_body(rank, world, pattern):
    q, k, v, _ = _inputs(1, 64, 2, 2, 16)
    with pytest.raises(ValueError, match=r"must divide by 2 \* world size = 4"):
        shard(q[:, :62])
    ql, kl, vl = (shard(t) for t in (q, k, v))
    # Rank 1 alone passes a shorter shard: every rank must raise, none may hang.
    bad_q = ql[:, :8] if rank == 1 else ql
    bad_kv = (kl[:, :8], vl[:, :8]) if rank == 1 else (kl, vl)
    with pytest.raises(ValueError, match=r"ranks \[1\] disagree with rank 0"):
        context_parallel_attention(bad_q, *bad_kv, pattern)
    # Rank 1 alone builds its pattern with another stride (a rule pattern: hashed by its rules).
    other = s2attn.local_stride_pattern(
        2, max_seq_len=64, block_size=16, local_blocks=2, vert_stride=3
    )
    with pytest.raises(ValueError, match=r"ranks \[1\] disagree with rank 0"):
        context_parallel_attention(ql, kl, vl, other if rank == 1 else pattern)
    # Rank 0 alone gives a bad dtype: every rank hears of it, with rank 0's reason.
    bad_v = vl.double() if rank == 0 else vl
    with pytest.raises(ValueError, match=r"rank\(s\) \[0\].*one dtype"):
        context_parallel_attention(ql, kl, bad_v, pattern)
    with pytest.raises(ValueError, match="exceeds the pattern's max_seq_len 32"):
        context_parallel_attention(ql, kl, vl, pattern.crop(2))
    bidirectional = s2attn.local_stride_pattern(
        2, max_seq_len=64, block_size=16, local_blocks=2, vert_stride=2, causal=False
    )
    with pytest.raises(ValueError, match="bidirectional pattern needs chunks of whole blocks"):
        context_parallel_attention(ql[:, :12], kl[:, :12], vl[:, :12], bidirectional)
    # After all that the group still works.
    context_parallel_attention(ql, kl, vl, pattern)


def test_bad_input_raises_on_every_rank():
    pattern = s2attn.local_stride_pattern(
        2, max_seq_len=64, block_size=16, local_blocks=2, vert_stride=2
    )
    spawn(2, _errors_body, pattern)


def _lost_plan_body(rank, world, pattern):
    from s2attn.distributed import plan

    q, k, v, _ = _inputs(1, 64, 2, 2, 16)
    ql, kl, vl = (shard(t) for t in (q, k, v))
    first = context_parallel_attention(ql, kl, vl, pattern)
    if rank == 0:  # e.g. its pattern was rebuilt: the others still hold theirs
        plan._PLANS.clear()
    again = context_parallel_attention(ql, kl, vl, pattern)
    assert torch.equal(first, again)
    assert plan.cached_exchange_plan(pattern, 64, world, rank, 2, ql.device) is not None


def test_a_rank_without_its_plan_rebuilds_it_with_the_others():
    """Plans are built collectively (each rank sends the others its requests): when one rank
    lacks its cached plan, every rank takes part in building it, rather than one waiting alone
    in a collective."""
    pattern = s2attn.local_stride_pattern(
        2, max_seq_len=64, block_size=16, local_blocks=2, vert_stride=2
    )
    spawn(2, _lost_plan_body, pattern)


def _communication_body(rank, world, pattern, shape):
    from s2attn.distributed.context_parallel import CallCommunication

    q, k, v, _ = _inputs(*shape)
    ql, kl, vl = (shard(t) for t in (q, k, v))
    context_parallel_attention(ql, kl, vl, pattern)
    comm = CallCommunication.of(ql, kl, vl, pattern)
    batch, seq, _, kv_heads, dim = shape
    sizes = (pattern, batch, seq, kv_heads, dim, DTYPE, world)
    assert comm.bytes_received() == context_parallel_bytes(*sizes)[rank]
    assert comm.kv_bytes_held() == context_parallel_kv_bytes(*sizes)[rank]
    comm.agreement_check()
    if world == 1:
        assert comm.plan is None
        return
    received_k, received_v = comm.exchange_kv()
    assert received_k.shape == received_v.shape == (batch, sum(comm.plan.recv), dim)
    assert received_k.numel() > 0
    dk, dv = comm.return_gradients()  # of zeros: what it moves, not what it computes, is timed
    assert dk.shape == dv.shape == kl.shape and not dk.any()


def test_the_calls_communication_runs_alone():
    """What the benchmark times: one call's agreement check, K/V exchange and gradients' return,
    each alone, from the rank's own plan; its bytes are the rank's entries of
    context_parallel_bytes and context_parallel_kv_bytes."""
    pattern = s2attn.local_stride_pattern(
        4, max_seq_len=128, block_size=16, local_blocks=2, vert_stride=3, num_kv_heads=2
    )
    for world in (1, 2, 4):
        spawn(world, _communication_body, pattern, (1, 128, 4, 2, 16))


def test_only_the_tokens_read_move():
    """Each rank receives only the K/V tokens its queries read, per KV head: a few percent of an
    all-gather under a strided S2 pattern, every earlier token under a dense causal one (the
    last chunk's owner, rank 0, needs all; rank W-1 only the chunks before W), and everything
    under a dense bidirectional one."""
    seq, world, kv, dim = 2048, 4, 4, 16
    full = communication_bytes(1, seq, kv, dim, torch.float16, world)
    s2 = s2attn.local_stride_pattern(
        8, max_seq_len=seq, block_size=16, local_blocks=4, vert_stride=16, num_kv_heads=kv
    )
    got = context_parallel_bytes(s2, 1, seq, kv, dim, torch.float16, world)
    print("S2 / all-gather per rank:", [round(b / full, 3) for b in got])
    assert max(got) <= full / 8
    causal = s2attn.dense_pattern(kv, max_seq_len=seq, block_size=16)
    got = context_parallel_bytes(causal, 1, seq, kv, dim, torch.float16, world)
    assert [b / full for b in got] == pytest.approx([1, 5 / 6, 4 / 6, 3 / 6])
    bidir = s2attn.dense_pattern(kv, max_seq_len=seq, block_size=16, causal=False)
    assert context_parallel_bytes(bidir, 1, seq, kv, dim, torch.float16, world) == [full] * world


def test_a_rank_holds_keys_in_proportion_to_what_it_reads():
    """No rank lays K/V out over the whole sequence. Under S2 a rank holds its own tokens twice
    (its shard, and its chunks' tails of the compact keys) and, beyond them, the far blocks it
    reads and receives: under a tenth of an all-gather here. Under a dense causal pattern the
    last chunk's owner (rank 0) needs every earlier token, and no more."""
    seq, world, kv, dim = 8192, 8, 2, 16
    full = 2 * seq * kv * dim * 2  # K and V of the whole sequence, fp16
    own = full // world
    s2 = s2attn.local_stride_pattern(
        8, max_seq_len=seq, block_size=16, local_blocks=4, vert_stride=32, num_kv_heads=kv
    )
    for rank, held in enumerate(context_parallel_kv_bytes(s2, 1, seq, kv, dim, torch.float16,
                                                          world)):  # fmt: skip
        print(f"rank {rank}: K/V held beyond its own / the whole sequence's "
              f"{(held - 2 * own) / full:.3f}")  # fmt: skip
        assert 0 < held - 2 * own < full / 10
    # Dense: rank 0's early chunk (0) reads itself; its late one (2W - 1) every token.
    dense = s2attn.dense_pattern(kv, max_seq_len=seq, block_size=16)
    got = context_parallel_kv_bytes(dense, 1, seq, kv, dim, torch.float16, world)[0]
    assert got == own + (full - own) + own // 2 + full
    assert context_parallel_kv_bytes(s2, 1, seq, kv, dim, torch.float16, 1) == [full]


def test_communication_bytes():
    # K and V, fp16, 3 of the 4 ranks' quarters received.
    assert communication_bytes(1, 1024, 2, 64, torch.float16, 4) == 2 * 1024 * 2 * 64 * 2 * 3 // 4
    assert communication_bytes(1, 1024, 2, 64, torch.float16, 1) == 0
