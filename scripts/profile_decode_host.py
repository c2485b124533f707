"""Host time of one eager decode step through ``sparse_attention_with_kvcache``: microseconds per
step, then cProfile's table of where they go. 32 query / 8 KV heads of 128, block 64, local 16,
stride 64, one new token per sequence.

On a GPU the step runs for real and the time is what the host spends enqueuing it (kernels are not
waited for), launches included. With ``--stub-launches`` (the default without a GPU) the page
write and decode kernels are replaced by no-ops, so what is left is s2attn's own Python: the part
that can be measured on any machine.

    python scripts/profile_decode_host.py --context 131072 --batch 1 [--static] [--stub-launches]
"""

import argparse
import cProfile
import pstats
import statistics
import sys
import time

import torch

import s2attn
from s2attn.ops import dispatch

ap = argparse.ArgumentParser()
ap.add_argument("--context", type=int, default=32768)
ap.add_argument("--batch", type=int, default=1)
ap.add_argument("--static", action="store_true", help="a static cache (CUDA-graph ready)")
ap.add_argument("--stub-launches", action="store_true", help="no kernels (default on a CPU)")
ap.add_argument("--steps", type=int, default=2000)
ap.add_argument("--sort", default="tottime", help="pstats key: tottime, cumulative")
args = ap.parse_args()
device = "cuda" if torch.cuda.is_available() else "cpu"
stub = args.stub_launches or device == "cpu"
if stub:
    # The kernels' host side is Triton's launcher; without them the step is s2attn's Python.
    def no_decode(q, *_, **__):
        return torch.empty_like(q), None

    dispatch.triton_decode.decode = no_decode
    dispatch.triton_page_write.write_pages = lambda *_, **__: None
    # Every module that asks whether the kernels run here: yes, as on a GPU.
    for module in list(sys.modules.values()):
        if getattr(module, "__name__", "").startswith("s2attn") and hasattr(
            module, "supports_triton"
        ):
            module.supports_triton = lambda _: True

heads, kv_heads, dim, dtype = 32, 8, 128, torch.float16
steps_room = args.steps + 4096
pattern = s2attn.local_stride_pattern(
    heads,
    max_seq_len=args.context + steps_room,
    block_size=64,
    local_blocks=16,
    vert_stride=64,
    num_kv_heads=kv_heads,
)
kv_cache = s2attn.paged_kv_cache(
    pattern, batch_size=args.batch, num_kv_heads=kv_heads, head_dim=dim, dtype=dtype,
    device=device, static=args.static,
)  # fmt: skip
prompt = torch.randn(args.batch, args.context, kv_heads, dim, dtype=dtype, device=device)
kv_cache.append(prompt, prompt)
q = torch.randn(args.batch, 1, heads, dim, dtype=dtype, device=device)
k = torch.randn(args.batch, 1, kv_heads, dim, dtype=dtype, device=device)


def step():
    s2attn.sparse_attention_with_kvcache(q, kv_cache, k, k)


for _ in range(100):
    step()
if device == "cuda":
    torch.cuda.synchronize()
times = []
for _ in range(args.steps):
    start = time.perf_counter()
    step()
    times.append((time.perf_counter() - start) * 1e6)
# The slowest steps are those where sequences enter a new block: pages are freed and allocated.
print(
    f"context {args.context}, batch {args.batch}, {'static' if args.static else 'dynamic'} "
    f"cache, {device}{' (launches stubbed)' if stub else ''}: host time per decode step "
    f"{statistics.fmean(times):.1f} us mean, {statistics.median(times):.1f} median, "
    f"{max(times):.0f} slowest"
)
profile = cProfile.Profile()
profile.enable()
for _ in range(500):
    step()
profile.disable()
pstats.Stats(profile).sort_stats(args.sort).print_stats(20)
