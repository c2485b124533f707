"""Quick GPU check: correctness in bf16/fp16 on a few shapes and a first timing (not a benchmark)."""
import torch, triton, s2attn, time
torch.manual_seed(0)
def rel(a,b): return ((a.float()-b.float()).norm()/b.float().norm()).item()
print(torch.cuda.get_device_name(), torch.__version__, triton.__version__)
for dt in (torch.bfloat16, torch.float16):
    for (B,S,H,D,bs,causal) in [(2,2049,8,128,64,True),(1,1500,4,64,16,True),(1,1000,4,256,32,False),(1,777,4,80,128,True)]:
        p = s2attn.local_stride_pattern(H, S, bs, 4, 4, causal=causal)
        q,k,v = (torch.randn(B,S,H,D,dtype=dt,device='cuda') for _ in range(3))
        o,l = s2attn.sparse_attention(q,k,v,p,return_lse=True)
        ro,rl = s2attn.attention_reference(q.float(),k.float(),v.float(),p,return_lse=True)
        print(dt,B,S,H,D,bs,causal,"err %.2e lse %.2e"%(rel(o,ro),rel(l,rl)))
for S in (8192, 32768, 131072):
    for V in (16, 64):
        p = s2attn.local_stride_pattern(32, S, 64, 16, V)
        q,k,v = (torch.randn(1,S,32,128,dtype=torch.bfloat16,device='cuda') for _ in range(3))
        t0=time.time(); s2attn.sparse_attention(q,k,v,p); torch.cuda.synchronize(); first=time.time()-t0
        ms = triton.testing.do_bench(lambda: s2attn.sparse_attention(q,k,v,p), warmup=25, rep=100, return_mode='median')
        fl = 4*128*p.kept_token_pairs(S)
        print(f"S={S} V={V} density={p.density(S):.4f} first_call={first:.2f}s {ms:.3f} ms {fl/ms/1e9:.0f} eff TFLOP/s")
