"""A quick look at a GPU: forward and backward against the float32 reference in bf16 and fp16 on a
few awkward shapes (whether two backward passes agree bit for bit too), then first timings of the
benchmark shapes. Not a test (tests/ holds those; `python -m pytest -q` on the GPU is the real
check) and not a benchmark (benchmarks/ holds those): a minute's reassurance on a new machine.

    python scripts/gpu_smoke.py
"""

import torch
import triton

import s2attn

SHAPES = [  # batch, seq, heads, dim, pattern block, causal
    (2, 2049, 8, 128, 64, True),
    (1, 1500, 4, 64, 16, True),
    (1, 1000, 4, 256, 32, False),
    (1, 777, 4, 80, 128, True),
]


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def check(dtype, batch, seq, heads, dim, block, causal) -> str:
    p = s2attn.local_stride_pattern(
        heads, max_seq_len=seq, block_size=block, local_blocks=4, vert_stride=4, causal=causal
    )
    q, k, v = (
        torch.randn(batch, seq, heads, dim, dtype=dtype, device="cuda", requires_grad=True)
        for _ in range(3)
    )
    out, lse = s2attn.sparse_attention(q, k, v, p, return_lse=True)
    g = torch.randn_like(out)
    out.backward(g)
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    s2attn.sparse_attention(q, k, v, p).backward(g)
    same = all(torch.equal(a, t.grad) for a, t in zip(grads, (q, k, v)))
    qr, kr, vr = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref, ref_lse = s2attn.attention_reference(qr, kr, vr, p, return_lse=True)
    ref.backward(g.float())
    errs = [rel(out, ref), rel(lse, ref_lse)]
    errs += [rel(a, r.grad) for a, r in zip(grads, (qr, kr, vr))]
    names = ("out", "lse", "dq", "dk", "dv")
    return " ".join(f"{n} {e:.1e}" for n, e in zip(names, errs)) + f" deterministic {same}"


def timings(seq: int, stride: int) -> str:
    p = s2attn.local_stride_pattern(
        32, max_seq_len=seq, block_size=64, local_blocks=16, vert_stride=stride
    )
    q, k, v = (
        torch.randn(1, seq, 32, 128, dtype=torch.bfloat16, device="cuda", requires_grad=True)
        for _ in range(3)
    )
    g = torch.randn_like(q)
    flops = 4 * 128 * p.kept_token_pairs(seq)
    fwd = triton.testing.do_bench(
        lambda: s2attn.sparse_attention(q, k, v, p), warmup=25, rep=100, return_mode="median"
    )
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fwd_bwd = triton.testing.do_bench(
        lambda: s2attn.sparse_attention(q, k, v, p).backward(g),
        warmup=25,
        rep=100,
        return_mode="median",
        grad_to_none=[q, k, v],
    )
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    return (
        f"density {p.density(seq):.4f} fwd {fwd:.3f} ms {flops / fwd / 1e9:.0f} TF/s | fwd+bwd "
        f"{fwd_bwd:.3f} ms {3.5 * flops / fwd_bwd / 1e9:.0f} TF/s | peak extra {peak:.2f} GiB"
    )


torch.manual_seed(0)
print(torch.cuda.get_device_name(), torch.__version__, triton.__version__)
for dtype in (torch.bfloat16, torch.float16):
    for shape in SHAPES:
        print(str(dtype)[6:], *shape, check(dtype, *shape), flush=True)
for seq in (8192, 32768, 131072):
    for stride in (16, 64):
        print(f"seq {seq} V{stride}: {timings(seq, stride)}", flush=True)
