"""One long sequence on one GPU: host cost of the pattern and layouts, time, and exactness on rows.

    python benchmarks/long_sequence.py                        # 4,194,304 tokens (an H200: 131 GiB)
    python benchmarks/long_sequence.py --seq 8192 --heads 2 --dim 32 --dtype float32   # CPU smoke

Batch 1, a causal local-stride pattern with staggered heads (block 64, local 16 blocks, stride 64
by default), inputs made on the device. It reports:

- **compilation**: one forward+backward at ``--warm-seq`` tokens first, which compiles most of
  the kernels the long sequence uses (integer widths it changes compile again in the long call:
  run twice, and the second process reads them from Triton's disk cache);
- **host**: the wall time and the growth of the process's peak resident memory (``ru_maxrss``)
  while the pattern and its forward and backward layouts are built, i.e. what the first call
  costs beyond compiling the kernels; then the first forward+backward call itself, and its excess
  over a steady one;
- **time**: forward, and forward+backward, median of ``--iters`` runs after one warm-up, and the
  device's peak memory;
- **exactness** against the dense token mask, on rows, since the whole reference would not fit:
  ``--rows`` query rows (the first, the last, the rest random) get their output, LSE and dQ from
  a float32 reference over every key the pattern lets them see; ``--rows`` key rows get their dK
  and dV summed over every query that sees them, in float32, with each query's softmax taken
  from the kernel's LSE (itself checked on the sampled query rows). Relative errors must stay
  under 1e-2 (bf16), 2e-3 (fp16), 1e-4 (fp32).

Exit status 1 when a check fails. Writes markdown and JSON to ``benchmarks/results/``.
"""

from __future__ import annotations

import cProfile
import pstats
import resource
import statistics
import time

import torch
from run_info import environment, parser, rel_err, result_stem, table, versions_line, write_results

import s2attn
from s2attn.reference import key_row_grads

READER_CHUNK = 1 << 16
TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-4}


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed_s(fn, iters: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(iters):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def visible_keys(coords, row: int, block: int) -> torch.Tensor:
    """The key positions query ``row`` may attend under one head's kept blocks ``coords``."""
    _, i, j = coords
    blocks = j[i == row // block]
    keys = (blocks[:, None] * block + torch.arange(block, device=blocks.device)).reshape(-1)
    return keys[keys <= row]


def readers(coords, key: int, block: int, seq: int) -> torch.Tensor:
    """The query positions that may attend ``key`` under one head's kept blocks ``coords``."""
    _, i, j = coords
    blocks = i[j == key // block]
    rows = (blocks[:, None] * block + torch.arange(block, device=blocks.device)).reshape(-1)
    return rows[(rows >= key) & (rows < seq)]


def check_rows(q, k, v, do, out, lse, dq, dk, dv, pattern, args, gen) -> dict:
    """Relative errors of the sampled rows against the float32 reference (see the module doc)."""
    seq, heads, dim = q.shape[1], q.shape[2], q.shape[3]
    group = heads // k.shape[2]
    bs = pattern.block_size
    scale = dim**-0.5
    extra = max(args.rows - 2, 0)
    rows = [0, seq - 1, *torch.randint(1, seq - 1, (extra,), generator=gen).tolist()]
    keys = [0, seq - 1, *torch.randint(1, seq - 1, (extra,), generator=gen).tolist()]
    got = {"out": [], "lse": [], "dq": [], "dk": [], "dv": []}
    want = {name: [] for name in got}
    f32 = lambda t: t.float()
    for h in range(heads):
        coords = pattern.block_coordinates(heads=slice(h, h + 1), device=q.device)
        kvh = h // group
        for t in rows:
            s = visible_keys(coords, t, bs)
            kt, vt = f32(k[0, s, kvh]), f32(v[0, s, kvh])
            scores = (kt @ f32(q[0, t, h])) * scale
            row_lse = torch.logsumexp(scores, 0)
            p = torch.exp(scores - row_lse)
            o = p @ vt
            dp = vt @ f32(do[0, t, h])
            ds = p * (dp - (f32(do[0, t, h]) * o).sum())
            want["out"].append(o), got["out"].append(out[0, t, h])
            want["lse"].append(row_lse[None]), got["lse"].append(lse[0, h, t][None])
            want["dq"].append(scale * ds @ kt), got["dq"].append(dq[0, t, h])
        for s_key in keys:
            # A key in a stride column has millions of readers at 4M tokens: sum over them in
            # chunks, so the float32 copies stay small next to the inputs filling the GPU.
            dv_part, dk_part = torch.zeros(2, dim, device=q.device)
            for r in readers(coords, s_key, bs, seq).split(READER_CHUNK):
                dk_r, dv_r = key_row_grads(
                    f32(q[0, r, h]),
                    f32(do[0, r, h]),
                    f32(out[0, r, h]),
                    lse[0, h, r].float(),
                    f32(k[0, s_key, kvh]),
                    f32(v[0, s_key, kvh]),
                    scale,
                )
                dv_part += dv_r
                dk_part += dk_r
            # dK/dV of a KV head sum over its query heads: collect per query head, add below.
            want["dv"].append((h, s_key, dv_part)), want["dk"].append((h, s_key, dk_part))
    for name in ("dk", "dv"):
        sums: dict[tuple[int, int], torch.Tensor] = {}
        for h, s_key, part in want[name]:
            key = (h // group, s_key)
            sums[key] = sums[key] + part if key in sums else part
        grad = dk if name == "dk" else dv
        want[name] = list(sums.values())
        got[name] = [grad[0, s_key, kvh] for kvh, s_key in sums]
    return {name: rel_err(torch.stack(got[name]).float(), torch.stack(want[name])) for name in got}


def main() -> int:
    ap = parser(__doc__)
    defaults = (("--seq", 4_194_304), ("--heads", 16), ("--kv-heads", None), ("--dim", 128),
                ("--block-size", 64), ("--local-blocks", 16), ("--stride", 64), ("--iters", 3),
                ("--rows", 8), ("--seed", 0), ("--warm-seq", 65536))  # fmt: skip
    for flag, default in defaults:
        ap.add_argument(flag, type=int, default=default)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument(
        "--profile-first",
        action="store_true",
        help="print cProfile's table of the first forward+backward's host time (where it goes)",
    )
    args = ap.parse_args()
    args.kv_heads = args.kv_heads or args.heads
    dtype = getattr(torch, args.dtype)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    env = environment()
    print(f"{env['device']} · torch {env['torch']} · triton {env['triton']} · {env['date']}")

    # Compilation apart: the same call on a short sequence compiles most kernels the long one
    # launches. Not all: Triton also specializes on integer arguments' width and divisibility,
    # which long sequences change (at 1M tokens three kernels compiled again after a 65k warm-up,
    # and a 2M warm-up did not spare 4M its excess); run the script twice and the second process
    # finds those kernels in Triton's disk cache, which leaves the host cost beyond compilation.
    # The warm-up's backward takes a tensor gradient as the long call's does (a first such
    # backward imports more of torch, ~2 s).
    t0 = time.perf_counter()
    warm = [torch.randn(1, args.warm_seq, h, args.dim, device=device, dtype=dtype)
            for h in (args.heads, args.kv_heads, args.kv_heads)]  # fmt: skip
    warm = [t.requires_grad_() for t in warm]
    warm_pattern = s2attn.local_stride_pattern(
        args.heads, max_seq_len=args.warm_seq, block_size=args.block_size,
        local_blocks=args.local_blocks, vert_stride=args.stride,
        num_kv_heads=args.kv_heads,
    )  # fmt: skip
    warm_out = s2attn.sparse_attention(*warm, warm_pattern)
    warm_out.backward(torch.randn_like(warm_out))
    del warm_out
    sync()
    compile_s = time.perf_counter() - t0
    del warm
    print(f"compilation (fwd+bwd at {args.warm_seq:,} tokens): {compile_s:.2f} s")

    gen = torch.Generator(device=device).manual_seed(args.seed)
    shape = (1, args.seq, args.heads, args.dim)
    kv_shape = (1, args.seq, args.kv_heads, args.dim)
    q = torch.randn(shape, device=device, dtype=dtype, generator=gen)
    k = torch.randn(kv_shape, device=device, dtype=dtype, generator=gen)
    v = torch.randn(kv_shape, device=device, dtype=dtype, generator=gen)
    do = torch.randn(shape, device=device, dtype=dtype, generator=gen)
    sync()

    # The host part of the first call: the pattern and both layouts, built as the call builds
    # them (its plan), then cached.
    rss0, t0 = peak_rss_gib(), time.perf_counter()
    pattern = s2attn.local_stride_pattern(
        args.heads, max_seq_len=args.seq, block_size=args.block_size,
        local_blocks=args.local_blocks, vert_stride=args.stride,
        num_kv_heads=args.kv_heads,
    )  # fmt: skip
    from s2attn.plan import AttentionPlan

    AttentionPlan(pattern, 1.0, 1).build_layouts(q, k)
    sync()
    host_s, host_gib = time.perf_counter() - t0, peak_rss_gib() - rss0
    print(f"pattern and layouts: {host_s:.2f} s, peak host memory +{host_gib:.2f} GiB")

    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))

    def forward():
        return s2attn.sparse_attention(qg, kg, vg, pattern, return_lse=True)

    def forward_backward():
        # Fresh gradients each time: accumulating into the last ones would hold two sets at once
        # (48 GiB more at 4M tokens, 16 heads).
        for t in (qg, kg, vg):
            t.grad = None
        out, _ = forward()
        out.backward(do)

    profile = cProfile.Profile() if args.profile_first else None
    t0 = time.perf_counter()
    if profile:
        profile.enable()
    forward_backward()
    sync()
    if profile:
        profile.disable()
    first_s = time.perf_counter() - t0
    if profile:
        pstats.Stats(profile).sort_stats("cumulative").print_stats(30)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    with torch.no_grad():
        fwd_s = timed_s(forward, args.iters)
    fwd_bwd_s = timed_s(forward_backward, args.iters)
    gpu_gib = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None

    out, lse = forward()
    for t in (qg, kg, vg):
        t.grad = None
    out.backward(do)
    errors = check_rows(q, k, v, do, out.detach(), lse.detach(), qg.grad, kg.grad, vg.grad,
                        pattern, args, torch.Generator().manual_seed(args.seed + 1))  # fmt: skip
    tol = TOL[dtype]
    ok = all(e < tol for e in errors.values())
    for name, e in errors.items():
        print(f"{name}: relative error {e:.2e} on sampled rows (tolerance {tol:.0e})")

    kept = pattern.num_kept_blocks
    rows = [[
        f"{args.seq:,}", f"{kept / 1e6:.1f}M", f"{host_s:.2f}",
        f"{host_gib:.2f}", f"{compile_s:.1f}", f"{first_s:.2f}", f"{first_s - fwd_bwd_s:.2f}",
        f"{fwd_s * 1e3:.1f}", f"{fwd_bwd_s * 1e3:.1f}",
        "n/a" if gpu_gib is None else f"{gpu_gib:.1f}",
        " / ".join(f"{errors[n]:.1e}" for n in ("out", "lse", "dq", "dk", "dv")),
    ]]  # fmt: skip
    header = ["tokens", "kept blocks", "pattern+layouts s", "host GiB (peak growth)",
              "compile s", "first fwd+bwd s", "first minus steady s", "fwd ms", "fwd+bwd ms",
              "GPU peak GiB",
              "rel. err out / lse / dq / dk / dv"]  # fmt: skip
    md = "\n".join([
        f"# One long sequence — {env['device']}", "", versions_line(env), "",
        f"Batch 1, {args.heads} heads ({args.kv_heads} KV) of dim {args.dim}, {args.dtype}, "
        f"causal, block {args.block_size}, local {args.local_blocks} blocks, stride {args.stride}, "
        f"staggered heads. Errors on {args.rows} query and {args.rows} key rows against float32 "
        f"(tolerance {tol:.0e}): {'pass' if ok else 'FAIL'}.", "",
        *table(header, rows), "",
    ])  # fmt: skip
    payload = dict(env=env, args=vars(args) | {"out_dir": str(args.out_dir)}, rows=[dict(
        seq=args.seq, kept_blocks=kept, host_s=host_s, host_gib=host_gib, compile_s=compile_s,
        first_s=first_s,
        fwd_ms=fwd_s * 1e3, fwd_bwd_ms=fwd_bwd_s * 1e3, gpu_peak_gib=gpu_gib, errors=errors,
        passed=ok,
    )])  # fmt: skip
    write_results(args.out_dir, result_stem(env, "long_sequence" + args.tag), md, payload)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
