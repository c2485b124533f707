"""Quick GPU check: forward/backward correctness in bf16/fp16 on a few shapes and first timings.

Not a benchmark (benchmarks/ holds those) and not a test (tests/ holds those): a fast look.
"""
import time

import torch
import triton

import s2attn

torch.manual_seed(0)


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


print(torch.cuda.get_device_name(), torch.__version__, triton.__version__)
for dt in (torch.bfloat16, torch.float16):
    for B, S, H, D, bs, causal in [(2, 2049, 8, 128, 64, True), (1, 1500, 4, 64, 16, True),
                                   (1, 1000, 4, 256, 32, False), (1, 777, 4, 80, 128, True)]:
        p = s2attn.local_stride_pattern(H, S, bs, 4, 4, causal=causal)
        q, k, v = (torch.randn(B, S, H, D, dtype=dt, device="cuda", requires_grad=True) for _ in range(3))
        o, l = s2attn.sparse_attention(q, k, v, p, return_lse=True)
        g = torch.randn_like(o)
        o.backward(g)
        grads = [t.grad.clone() for t in (q, k, v)]
        for t in (q, k, v):
            t.grad = None
        s2attn.sparse_attention(q, k, v, p).backward(g)
        same = all(torch.equal(a, t.grad) for a, t in zip(grads, (q, k, v)))
        qr, kr, vr = (t.detach().float().requires_grad_() for t in (q, k, v))
        ro, rl = s2attn.attention_reference(qr, kr, vr, p, return_lse=True)
        ro.backward(g.float())
        print(dt, B, S, H, D, bs, causal, "out %.1e lse %.1e dq %.1e dk %.1e dv %.1e deterministic %s" % (
            rel(o, ro), rel(l, rl), rel(grads[0], qr.grad), rel(grads[1], kr.grad), rel(grads[2], vr.grad), same))
for S in (8192, 32768, 131072):
    for V in (16, 64):
        p = s2attn.local_stride_pattern(32, S, 64, 16, V)
        q, k, v = (torch.randn(1, S, 32, 128, dtype=torch.bfloat16, device="cuda", requires_grad=True) for _ in range(3))
        g = torch.randn_like(q)
        fl = 4 * 128 * p.kept_token_pairs(S)
        ms = triton.testing.do_bench(lambda: s2attn.sparse_attention(q, k, v, p), warmup=25, rep=100, return_mode="median")
        o = s2attn.sparse_attention(q, k, v, p)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        msb = triton.testing.do_bench(lambda: s2attn.sparse_attention(q, k, v, p).backward(g), warmup=25, rep=100,
                                      return_mode="median", grad_to_none=[q, k, v])
        peak = (torch.cuda.max_memory_allocated() - base) / 2**30
        print(f"S={S} V={V} density={p.density(S):.4f} fwd {ms:.3f} ms {fl/ms/1e9:.0f} TF/s | fwd+bwd {msb:.3f} ms "
              f"{3.5*fl/msb/1e9:.0f} TF/s | peak extra {peak:.2f} GiB")
