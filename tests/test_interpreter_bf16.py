"""bfloat16 under the Triton interpreter (``TRITON_INTERPRET=1``, a CPU without a GPU): the
interpreter's ``tl.dot`` on bfloat16 tiles returns garbage, so every pass computes such calls in
float32 (``s2attn.ops.dispatch.interpreter_upcasts``). Each entry point a user reaches in bf16 is
checked here against the float32 dense-mask reference: the functional calls with their gradients,
autocast, the paged cache's prefill and decode, HF generation on dynamic and static caches, a
training step, and context parallelism."""

from __future__ import annotations

import copy

import pytest
import torch
from gloo import spawn
from helpers import assert_close, random_qkv, tiny_llama_config, write_source_corpus

import s2attn
from s2attn.distributed import context_parallel_attention, shard, unshard
from s2attn.ops.env import INTERPRETED

pytestmark = pytest.mark.skipif(not INTERPRETED, reason="only the interpreter upcasts bfloat16")

BF16 = torch.bfloat16


def _pattern(heads=4, kv_heads=None, causal=True):
    return s2attn.local_stride_pattern(
        heads, max_seq_len=256, block_size=16, local_blocks=2, vert_stride=3,
        num_kv_heads=kv_heads, causal=causal,
    )  # fmt: skip


def _inputs(batch, seq, heads, kv_heads, dim=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return random_qkv(g, batch, seq, seq, heads, kv_heads, dim, BF16, device="cpu")


def _reference_grads(q, k, v, pattern, grad):
    leaves = [t.detach().float().requires_grad_() for t in (q, k, v)]
    out = s2attn.attention_reference(*leaves, pattern)
    out.backward(grad.float())
    return out.detach(), [t.grad for t in leaves]


@pytest.mark.parametrize("causal", [True, False])
def test_sparse_attention_forward_and_backward(causal):
    pattern = _pattern(causal=causal)
    q, k, v = (t.requires_grad_() for t in _inputs(2, 100, 4, 2))
    out, lse = s2attn.sparse_attention(q, k, v, pattern, return_lse=True)
    grad = torch.randn_like(out)
    out.backward(grad)
    ref, ref_grads = _reference_grads(q, k, v, pattern, grad)
    assert out.dtype == BF16 and q.grad.dtype == BF16
    assert_close(out, ref, BF16, "out")
    _, ref_lse = s2attn.attention_reference(*(t.detach().float() for t in (q, k, v)), pattern,
                                            return_lse=True)  # fmt: skip
    assert_close(lse, ref_lse, BF16, "lse")
    for name, got, want in zip("qkv", (q.grad, k.grad, v.grad), ref_grads):
        assert_close(got, want, BF16, f"d{name}")


def test_packed_qkv_and_varlen():
    pattern = _pattern()
    qkv = torch.randn(90, 3, 4, 32).to(BF16).requires_grad_()
    cu = torch.tensor([0, 30, 90], dtype=torch.int32)
    out = s2attn.sparse_attention_qkvpacked(qkv, pattern, cu_seqlens=cu)
    grad = torch.randn_like(out)
    out.backward(grad)
    leaf = qkv.detach().float().requires_grad_()
    q, k, v = leaf.unbind(1)
    ref = s2attn.attention_reference(q, k, v, pattern, cu_seqlens_q=cu, cu_seqlens_k=cu)
    ref.backward(grad.float())
    assert_close(out, ref, BF16, "out")
    assert_close(qkv.grad, leaf.grad, BF16, "dqkv")


def test_autocast_to_bfloat16():
    pattern = _pattern()
    q, k, v = (t.float().requires_grad_() for t in _inputs(1, 80, 4, 4))
    with torch.autocast("cpu", dtype=BF16):
        out = s2attn.sparse_attention(q, k, v, pattern)
    assert out.dtype == BF16
    grad = torch.randn_like(out)
    out.backward(grad)
    ref, ref_grads = _reference_grads(q.to(BF16), k.to(BF16), v.to(BF16), pattern, grad)
    assert_close(out, ref, BF16, "out")
    assert q.grad.dtype == torch.float32
    assert_close(q.grad, ref_grads[0], BF16, "dq")


def test_paged_cache_prefill_then_decode():
    pattern = _pattern(4, kv_heads=2)
    q, k, v = _inputs(2, 60, 4, 2)
    cache = s2attn.paged_kv_cache(pattern, batch_size=2, num_kv_heads=2, head_dim=32, dtype=BF16,
                                device="cpu")  # fmt: skip
    prompt = 50
    outs = [s2attn.sparse_attention_with_kvcache(q[:, :prompt], cache, k[:, :prompt],
                                                 v[:, :prompt])]  # fmt: skip
    for t in range(prompt, 60):
        step = slice(t, t + 1)
        outs.append(s2attn.sparse_attention_with_kvcache(q[:, step], cache, k[:, step], v[:, step]))
    ref = s2attn.attention_reference(q.float(), k.float(), v.float(), pattern)
    assert_close(torch.cat(outs, dim=1), ref, BF16, "prefill and decode")


def _tiny_llama(static: bool):
    transformers = pytest.importorskip("transformers")
    s2hf = pytest.importorskip("s2attn.integrations.transformers")
    config = tiny_llama_config(3)
    s2hf.configure(config, block_size=16, local_blocks=2, vert_stride=3, dense_layers=[1])
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(BF16).eval()
    reference = transformers.LlamaForCausalLM(copy.deepcopy(config)).eval()
    reference.load_state_dict(model.float().state_dict())
    model.to(BF16)
    reference.set_attn_implementation(s2hf.REFERENCE_IMPLEMENTATION)
    return model, reference, s2hf.S2Cache(model.config, static=static)


@pytest.mark.parametrize("static", [False, True])
def test_hf_generate_in_bfloat16(static):
    """A bf16 model on S2Cache against the same weights in float32 on the reference attention:
    the first steps' logits agree to bf16's precision (garbage gave relative errors of 1e9)."""
    model, reference, cache = _tiny_llama(static)
    ids = torch.randint(2, 128, (1, 40))
    kwargs = dict(max_new_tokens=6, do_sample=False, return_dict_in_generate=True,
                  output_scores=True)  # fmt: skip
    with torch.no_grad():
        got = model.generate(ids, past_key_values=cache, **kwargs)
        want = reference.generate(ids, **kwargs)
    scores, ref_scores = torch.stack(got.scores).float(), torch.stack(want.scores)
    err = ((scores[0] - ref_scores[0]).norm() / ref_scores[0].norm()).item()
    print(f"first step logits relative error {err:.2e}")
    assert err < 3e-2
    # Greedy tokens follow their own (bf16) logits: the argmax of each step's scores.
    assert torch.equal(got.sequences[0, 40:], scores.argmax(-1)[:, 0])


def test_training_steps_in_bfloat16_follow_the_reference():
    """bf16 weights trained a few steps through the kernels: the loss falls and follows the same
    model trained in float32 on the reference attention."""
    model, reference, _ = _tiny_llama(False)
    model.train()
    reference.train()
    ids = torch.randint(2, 128, (4, 64), generator=torch.Generator().manual_seed(1))
    losses = {}
    for name, m in (("bf16", model), ("reference", reference)):
        opt = torch.optim.SGD(m.parameters(), lr=0.5)
        losses[name] = []
        for _ in range(4):
            loss = m(ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses[name].append(loss.item())
    print(losses)
    assert losses["bf16"][-1] < losses["bf16"][0] - 0.05
    for a, b in zip(losses["bf16"], losses["reference"]):
        assert abs(a - b) < 0.05 * b


def _context_parallel_body(rank, world, pattern, inputs, expected):
    q, k, v, grad = inputs
    ql, kl, vl = (shard(t).requires_grad_() for t in (q, k, v))
    out = context_parallel_attention(ql, kl, vl, pattern)
    out.backward(shard(grad))
    ref_out, ref_dq = expected
    assert out.dtype == BF16
    assert_close(unshard(out), ref_out, BF16, f"rank {rank} out")
    assert_close(unshard(ql.grad), ref_dq, BF16, f"rank {rank} dq")


def test_context_parallelism_in_bfloat16():
    pattern = _pattern(4, kv_heads=2)
    q, k, v = _inputs(1, 128, 4, 2, dim=16)
    grad = torch.randn(1, 128, 4, 16).to(BF16)
    ref, ref_grads = _reference_grads(q, k, v, pattern, grad)
    spawn(2, _context_parallel_body, pattern, (q, k, v, grad), (ref, ref_grads[0]), kernels=True)


def test_s2attn_train_in_bfloat16_learns(tmp_path):
    """`s2attn train --precision bf16` through the interpreted kernels: the loss falls (with the
    interpreter's garbage bf16 products it stayed flat: 5.54 -> 5.58 in 10 steps)."""
    import argparse
    import json

    from s2attn.training import train

    write_source_corpus(tmp_path / "corpus", files=8)
    parser = argparse.ArgumentParser()
    train.add_arguments(parser)
    out = tmp_path / "run"
    options = {
        "--preset": "tiny",
        "--precision": "bf16",
        "--device": "cpu",
        "--seq-len": "64",
        "--batch-size": "4",
        "--steps": "10",
        "--log-every": "1",
        "--val-every": "0",
        "--val-batches": "0",
        "--val-needles": "0",
        "--needle-fraction": "0",
        "--lr": "1e-2",
        "--warmup-steps": "2",
        "--data-root": str(tmp_path / "corpus"),
        "--val-fraction": "0.3",
        "--out": str(out),
    }
    args = parser.parse_args([*(x for pair in options.items() for x in pair), "--no-progress"])
    assert train.run(args) == 0
    losses = [json.loads(line)["loss_nats"] for line in (out / "metrics.jsonl").open()]
    print(losses)
    assert losses[-1] < losses[0] - 0.5
