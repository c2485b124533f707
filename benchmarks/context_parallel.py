"""Context parallelism: exactness against one GPU, time and balance per rank, bytes, scaling.

Every rank builds the same full q, k, v and output gradient, takes its shard with
``s2attn.distributed.shard``, runs ``context_parallel_attention`` forward and backward, and
checks each rank's shards of the output and dq/dk/dv against the same shards of one-device
``sparse_attention`` on the whole sequence (the worst rank's relative error under 1e-2 in bf16,
2e-3 in fp16, 1e-4 in fp32). Then it times forward and forward+backward (median of ``--iters``
after a barrier; the slowest rank is reported, and its ratio to the mean rank's) and the
one-device call on the whole sequence, and reports strong-scaling efficiency (one-device time /
(W x time per rank)), the pattern's work per rank (its kept token pairs over W, summed over
heads) and the time per billion of them, the time the busiest rank's GPU spends in NCCL kernels
(the exchange, waits included: what overlapping it could save) and its share of the step, the
K/V bytes each rank receives and holds (its shard, what it receives, its chunks' compact keys),
and each call's GPU memory peak (which counts the full-sequence tensors held for the
comparison). With ``--no-reference`` (lengths one device cannot hold) each rank draws only its
shards, span by span from seeded generators, and checks sampled query rows of its output, LSE
and dq against float32 computed from keys drawn the same way (``--check-rows``).

    python benchmarks/context_parallel.py                          # world size 1
    torchrun --nproc-per-node 4 benchmarks/context_parallel.py --seq 131072
    torchrun --nproc-per-node 8 benchmarks/context_parallel.py --seq 1048576 --pattern dense
    torchrun --nproc-per-node 8 benchmarks/context_parallel.py --seq-per-rank 262144 --tag weak

Weak scaling (``--seq-per-rank``) adds work per token: a local + stride pattern keeps more pairs
per query as the sequence grows, so W ranks at W x L tokens each do more than one device at L.
``ms per G pairs`` divides that out: its ratio between two runs is the efficiency left to the
system (the exchange, the balance, the launch), the pattern's own growth aside.
    torchrun --nproc-per-node 8 benchmarks/context_parallel.py --seq 4194304 --no-reference
    torchrun --nproc-per-node 2 benchmarks/context_parallel.py --seq 512 --heads 4 --kv-heads 2 \
        --dim 32 --block-size 16 --local-blocks 2 --stride 4 --dtype float32   # CPU smoke, gloo

On a CPU (gloo, the dense-mask reference, host timers) it checks the wiring only.

The exit status is 1 when a check fails; rank 0 writes markdown and JSON to benchmarks/results/.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from run_info import (
    cell,
    environment,
    parser,
    rel_err,
    result_stem,
    table,
    versions_line,
    write_results,
)

import s2attn
from s2attn.distributed import (
    communication_bytes,
    context_parallel_attention,
    context_parallel_bytes,
    context_parallel_kv_bytes,
    shard,
)

HEADERS = [
    "pass", "ranks", "ms per rank", "slowest / mean rank", "one device ms", "efficiency",
    "kept G pairs per rank", "ms per G pairs", "NCCL ms, busiest rank", "NCCL share",
    "MiB in, busiest rank", "all-gather MiB",
    "K/V held MiB, busiest rank", "GPU peak GiB, busiest rank",
]  # fmt: skip
TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-4}
SPAN = 1 << 16  # --no-reference draws the sequence this many positions per generator
TAGS = {"q": 1, "k": 2, "v": 3, "grad": 4}  # each tensor's seeds


def span_rows(name: str, span: int, shape: tuple[int, int], dtype, device) -> torch.Tensor:
    """Positions ``span * SPAN ..`` of the virtual full tensor ``name``, (SPAN, heads, dim):
    standard normal from a generator of their own, so that any rank draws any positions alike
    without the whole sequence."""
    g = torch.Generator(device=device).manual_seed(TAGS[name] << 32 | span)
    return torch.randn(SPAN, *shape, generator=g, device=device, dtype=dtype)


def seeded_rows(name: str, positions: torch.Tensor, shape, dtype, device) -> torch.Tensor:
    """The virtual full tensor ``name``'s rows at ``positions``: (len(positions), heads, dim)."""
    out = torch.empty(len(positions), *shape, dtype=dtype, device=device)
    spans = positions // SPAN
    for span in spans.unique().tolist():
        at = (spans == span).nonzero().flatten()
        rows = (positions[at] - span * SPAN).to(device)
        out[at.to(device)] = span_rows(name, span, shape, dtype, device)[rows]
    return out


def shard_positions(seq: int, world: int, rank: int) -> torch.Tensor:
    """The global positions of this rank's shard, in its order (chunks r and 2W-1-r)."""
    chunk = seq // (2 * world)
    ranges = [torch.arange(c * chunk, (c + 1) * chunk) for c in (rank, 2 * world - 1 - rank)]
    return torch.cat(ranges)


def sampled_row_errors(out, lse, dq, pattern, positions, args, dtype, device, rows: int) -> dict:
    """Relative errors, worst rank, of ``rows`` sampled rows of this rank's out, LSE and dq
    against float32 from the seeded inputs, for runs without the whole sequence anywhere: each
    row's visible keys are drawn span by span and folded in with an online softmax (dq as
    scale * (sum p dP k - delta sum p k), both sums rescaled like the output)."""
    heads, group, scale = args.heads, args.heads // args.kv_heads, args.dim**-0.5
    bs, q_shape, kv_shape = pattern.block_size, (heads, args.dim), (args.kv_heads, args.dim)
    gen = torch.Generator().manual_seed(7 + dist.get_rank())
    drawn = torch.randint(len(positions), (max(rows - 2, 0),), generator=gen).tolist()
    local = [0, len(positions) - 1, *drawn]
    pos = positions[local]
    f32 = dict(dtype=torch.float32, device=device)
    qr = seeded_rows("q", pos, q_shape, dtype, device).float()  # (rows, heads, dim)
    dor = seeded_rows("grad", pos, q_shape, dtype, device).float()
    # Per (row, head): its visible key positions, sorted.
    keys = {}
    for n, t in enumerate(pos.tolist()):
        for h in range(heads):
            _, j = pattern.row_blocks(h, t // bs, t // bs + 1)
            kp = (j[:, None] * bs + torch.arange(bs)).flatten()
            keys[n, h] = kp[(kp <= t) if pattern.causal else (kp < args.seq)]
    m = torch.full((len(pos), heads), float("-inf"), **f32)
    l_sum, o_acc, a_acc, b_acc = (torch.zeros(len(pos), heads, *s, **f32)
                                  for s in ((), (args.dim,), (args.dim,), (args.dim,)))  # fmt: skip
    for span in range(args.seq // SPAN + 1):
        lo, hi = span * SPAN, (span + 1) * SPAN
        if lo >= args.seq:
            break
        k_span = v_span = None
        for (n, h), kp in keys.items():
            sel = kp[(kp >= lo) & (kp < hi)]
            if sel.numel() == 0:
                continue
            if k_span is None:
                k_span = span_rows("k", span, kv_shape, dtype, device)
                v_span = span_rows("v", span, kv_shape, dtype, device)
            kk = k_span[(sel - lo).to(device), h // group].float()
            vv = v_span[(sel - lo).to(device), h // group].float()
            sc = kk @ qr[n, h] * scale
            new_m = torch.maximum(m[n, h], sc.max())
            keep, p = torch.exp(m[n, h] - new_m), torch.exp(sc - new_m)
            dp = vv @ dor[n, h]
            m[n, h] = new_m
            l_sum[n, h] = l_sum[n, h] * keep + p.sum()
            o_acc[n, h] = o_acc[n, h] * keep + p @ vv
            a_acc[n, h] = a_acc[n, h] * keep + (p * dp) @ kk
            b_acc[n, h] = b_acc[n, h] * keep + p @ kk
    o_ref = o_acc / l_sum[..., None]
    delta = (dor * o_ref).sum(-1, keepdim=True)
    dq_ref = scale * (a_acc - delta * b_acc) / l_sum[..., None]
    want = dict(out=o_ref, lse=m + l_sum.log(), dq=dq_ref)
    idx = torch.tensor(local, device=device)
    got = dict(out=out[0, idx], lse=lse[0, :, idx].transpose(0, 1), dq=dq[0, idx])
    errors = {}
    for name in want:
        err = torch.tensor([rel_err(got[name].float(), want[name])], device=device)
        dist.all_reduce(err, op=dist.ReduceOp.MAX)
        errors[name] = err.item()
    return errors


def timed_ms(fn, iters: int) -> float:
    """Median ms of ``fn`` over ``iters`` runs, each started together on every rank; the slowest
    rank's."""
    return rank_times_ms(fn, iters)[0]


def rank_times_ms(fn, iters: int) -> tuple[float, float]:
    """The slowest rank's and the mean rank's median ms of ``fn`` over ``iters`` runs, each run
    started together on every rank (their ratio is the balance)."""
    on_gpu = torch.cuda.is_available()
    times = []
    for i in range(iters + 2):
        dist.barrier()
        if on_gpu:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if on_gpu:
            torch.cuda.synchronize()
        if i >= 2:  # the first two warm up (compilation, layouts)
            times.append((time.perf_counter() - t0) * 1e3)
    mine = torch.tensor([statistics.median(times)], device="cuda" if on_gpu else "cpu")
    slowest, total = mine.clone(), mine.clone()
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    dist.all_reduce(total, op=dist.ReduceOp.SUM)
    return slowest.item(), total.item() / dist.get_world_size()


def communication_ms(fn, iters: int) -> float | None:
    """The busiest rank's GPU time in NCCL kernels per call of ``fn`` (ms, mean of ``iters``
    profiled calls): the exchange of K/V and their gradients, and the call's agreement check,
    waits for the peers included, which is what the step pays for them while nothing overlaps
    them. None on a CPU (gloo runs no kernels)."""
    if not torch.cuda.is_available():
        return None
    from torch.profiler import ProfilerActivity, profile

    dist.barrier()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    us = sum(e.device_time_total for e in prof.key_averages() if "nccl" in e.key.lower())
    mine = torch.tensor([us / iters / 1e3], device="cuda")
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)
    return mine.item()


def worst_shard_err(mine: torch.Tensor, full: torch.Tensor) -> float:
    """The largest over the ranks of the relative error of a rank's shard against the same shard
    of the one-device tensor."""
    err = torch.tensor([rel_err(mine, shard(full))], device=mine.device)
    dist.all_reduce(err, op=dist.ReduceOp.MAX)
    return err.item()


def peak_gib(fn) -> float:
    """The largest GPU memory peak over the ranks of one call of ``fn`` (GiB);
    nan on a CPU."""
    if not torch.cuda.is_available():
        return float("nan")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    mine = torch.tensor([torch.cuda.max_memory_allocated() / 2**30], device="cuda")
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)
    return mine.item()


def dense_torch_error(out, q, k, v, group: int) -> float:
    """The worst rank's relative error of dense CP's whole output against one-device SDPA on the
    whole sequence (each rank holds the whole q, k, v)."""
    import torch.nn.functional as F

    with torch.no_grad():
        qd, kd, vd = (
            t.transpose(1, 2).repeat_interleave(n, dim=1)
            for t, n in ((q, 1), (k, group), (v, group))
        )
        want = F.scaled_dot_product_attention(qd, kd, vd, is_causal=True)
        err = torch.tensor([rel_err(out.float(), want.float())], device=out.device)
    dist.all_reduce(err, op=dist.ReduceOp.MAX)
    return err.item()


def dense_torch_rows(q, k, v, grad, world: int, args) -> list[dict]:
    """Dense causal attention over the same sequence under the context parallelism PyTorch
    ships (ring attention over SDPA, GQA's K/V heads repeated), its forward and forward+backward
    timed like ours and its output, gathered back in order, checked against one-device SDPA; a
    row holds the error instead where the installed torch cannot run it."""
    import torch.nn.functional as F

    gather = communication_bytes(1, args.seq, args.kv_heads, args.dim, q.dtype, world) / 2**20
    if not torch.cuda.is_available():
        return [dict(pass_="fwd", error="not run (CUDA only)", all_gather_mib=gather)]
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.experimental import (
            context_parallel,
            context_parallel_unshard,
        )

        mesh = init_device_mesh("cuda", (world,))
        group = args.heads // args.kv_heads
        # SDPA's (batch, heads, seq, dim); the buffers are sharded in place by the context, which
        # resizes them, so they must not be part of the graph of our own call's q, k, v. They are
        # not used after it: no copies kept to restore them.
        with torch.no_grad():
            qd, kd, vd, gd = (
                t.transpose(1, 2).repeat_interleave(n, dim=1).contiguous()
                for t, n in ((q, 1), (k, group), (v, group), (grad, 1))
            )
        buffers = [qd, kd, vd, gd]
        rows = []
        with context_parallel(mesh, buffers=buffers, buffer_seq_dims=[2, 2, 2, 2],
                              no_restore_buffers=set(buffers)):  # fmt: skip
            leaves = [t.detach().requires_grad_() for t in (qd, kd, vd)]

            def fwd():
                with torch.no_grad():
                    F.scaled_dot_product_attention(*leaves, is_causal=True)

            def fwd_bwd():
                F.scaled_dot_product_attention(*leaves, is_causal=True).backward(gd)

            for name, fn, factor in (("fwd", fwd, 1), ("fwd+bwd", fwd_bwd, 2)):
                rows.append(dict(pass_=name, cp_ms=timed_ms(fn, args.dense_iters),
                                 all_gather_mib=factor * gather))  # fmt: skip
                if dist.get_rank() == 0:  # as it comes: a run cut off by a time limit says how far
                    print(f"dense SDPA under PyTorch's CP, {name}: {rows[-1]['cp_ms']:.1f} ms",
                          flush=True)  # fmt: skip
            with torch.no_grad():
                out = F.scaled_dot_product_attention(*leaves, is_causal=True)
            # Back in sequence order, whatever layout the context balanced the shards in.
            [out] = context_parallel_unshard(mesh, [out], [2])
        rows[0]["error_out"] = dense_torch_error(out, q, k, v, group)
        return rows
    except Exception as exc:  # report what the installed torch refused, keep our results
        return [dict(pass_="fwd", error=f"failed: {type(exc).__name__}: {exc}",
                     all_gather_mib=gather)]  # fmt: skip


def main() -> int:
    ap = parser(__doc__)
    for flag, default in (
        ("--seq", 32768),
        ("--heads", 32),
        ("--kv-heads", 8),
        ("--dim", 128),
        ("--block-size", 64),
        ("--local-blocks", 16),
        ("--stride", 16),
        ("--iters", 10),
    ):
        ap.add_argument(flag, type=int, default=default)
    ap.add_argument("--dense-iters", type=int, default=3, help="timed calls of --dense-torch")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument(
        "--dense-torch",
        action="store_true",
        help="also dense causal SDPA under PyTorch's context parallelism "
        "(torch.distributed.tensor.experimental.context_parallel; CUDA only)",
    )
    ap.add_argument(
        "--pattern",
        default="s2",
        choices=["s2", "dense"],
        help="s2: local + stride with staggered heads; dense: every visible block",
    )
    ap.add_argument(
        "--seq-per-rank",
        type=int,
        default=None,
        help="weak scaling: the sequence is this many tokens times the world size (over --seq)",
    )
    ap.add_argument(
        "--no-reference",
        action="store_true",
        help="for lengths one device cannot hold: each rank draws only its shards (span by span "
        "from seeded generators), no one-device time is made, and --check-rows sampled rows "
        "replace the exactness check",
    )
    ap.add_argument(
        "--check-rows", type=int, default=6,
        help="with --no-reference: query rows per rank checked against float32 (out, LSE, dq)",
    )  # fmt: skip
    args = ap.parse_args()
    if args.no_reference and args.dense_torch:
        ap.error("--dense-torch needs the full tensors that --no-reference does not make")
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if "RANK" not in os.environ:  # plain python: a group of one
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29517")
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    dtype = getattr(torch, args.dtype)
    if args.seq_per_rank is not None:
        args.seq = args.seq_per_rank * world

    if args.pattern == "dense":
        pattern = s2attn.dense_pattern(args.heads, max_seq_len=args.seq, block_size=args.block_size)
    else:
        pattern = s2attn.local_stride_pattern(
            args.heads, max_seq_len=args.seq, block_size=args.block_size,
            local_blocks=args.local_blocks, vert_stride=args.stride,
            num_kv_heads=args.kv_heads,
        )  # fmt: skip
    if args.no_reference:
        # Each rank draws only its shards (the full tensors of a 4M-token sequence would not fit
        # beside them), span by span, so that the sampled rows' keys can be drawn alike.
        positions = shard_positions(args.seq, world, rank)
        q_shape, kv_shape = (args.heads, args.dim), (args.kv_heads, args.dim)
        q, k, v, grad = (
            seeded_rows(name, positions, shape, dtype, device)[None]
            for name, shape in (("q", q_shape), ("k", kv_shape), ("v", kv_shape), ("grad", q_shape))
        )
        ql, kl, vl = (t.requires_grad_() for t in (q, k, v))
        grad_local = grad
        errors: dict[str, float] = {}
        if args.check_rows:
            out, lse = context_parallel_attention(ql, kl, vl, pattern, return_lse=True)
            out.backward(grad_local)
            with torch.no_grad():
                errors = sampled_row_errors(
                    out, lse, ql.grad, pattern, positions, args, dtype, device, args.check_rows
                )
            del out, lse
            ql.grad = kl.grad = vl.grad = None
    else:
        g = torch.Generator(device=device).manual_seed(0)
        shape_q = (1, args.seq, args.heads, args.dim)
        shape_kv = (1, args.seq, args.kv_heads, args.dim)
        q, k, v = (
            torch.randn(s, device=device, dtype=dtype, generator=g)
            for s in (shape_q, shape_kv, shape_kv)
        )
        grad = torch.randn(shape_q, device=device, dtype=dtype, generator=g)
        # Exactness: each rank's shards against the same shards of one device's call on the
        # whole sequence. Not unsharded: at 1M tokens a gathered copy per rank does not fit
        # beside the rest.
        ql, kl, vl = (shard(t).requires_grad_() for t in (q, k, v))
        grad_local = shard(grad)
        out = context_parallel_attention(ql, kl, vl, pattern)
        out.backward(grad_local)
        qf, kf, vf = (t.requires_grad_() for t in (q, k, v))
        ref = s2attn.sparse_attention(qf, kf, vf, pattern)
        ref.backward(grad)
        with torch.no_grad():
            errors = {
                name: worst_shard_err(mine, full)
                for name, mine, full in (
                    ("out", out, ref), ("dq", ql.grad, qf.grad), ("dk", kl.grad, kf.grad),
                    ("dv", vl.grad, vf.grad),
                )
            }  # fmt: skip
        del out, ref
    ok = all(e < TOL[dtype] for e in errors.values())
    if rank == 0:  # now, so that a run cut short by the timings (memory, a time limit) still says
        print("errors " + (", ".join(f"{n} {e:.1e}" for n, e in errors.items()) or "none")
              + (" (within tolerance)" if ok else " (OUT OF TOLERANCE)"), flush=True)  # fmt: skip

    def cp_fwd():
        with torch.no_grad():
            context_parallel_attention(ql, kl, vl, pattern)

    def cp_fwd_bwd():
        context_parallel_attention(ql, kl, vl, pattern).backward(grad_local)

    def one_fwd():
        with torch.no_grad():
            s2attn.sparse_attention(qf, kf, vf, pattern)

    def one_fwd_bwd():
        s2attn.sparse_attention(qf, kf, vf, pattern).backward(grad)

    rows = []
    # The busiest rank's bytes moved and K/V held, and an all-gather's for comparison.
    sizes = (pattern, 1, args.seq, args.kv_heads, args.dim, dtype, world)
    pairs_per_rank = pattern.kept_token_pairs(args.seq) / world / 1e9
    moved = max(context_parallel_bytes(*sizes))
    held = max(context_parallel_kv_bytes(*sizes))
    gather = communication_bytes(*sizes[1:])
    for name, cp, one, bytes_moved in (
        ("fwd", cp_fwd, one_fwd, moved),
        ("fwd+bwd", cp_fwd_bwd, one_fwd_bwd, 2 * moved),
    ):
        t_cp, t_mean = rank_times_ms(cp, args.iters)
        t_comm = communication_ms(cp, args.iters)
        t_one = None if args.no_reference else timed_ms(one, args.iters)
        rows.append(
            dict(
                pass_=name, world=world, seq=args.seq, cp_ms=t_cp, balance=t_cp / t_mean,
                one_device_ms=t_one,
                efficiency=None if t_one is None else t_one / (world * t_cp),
                gpairs_per_rank=pairs_per_rank, ms_per_gpair=t_cp / pairs_per_rank,
                comm_ms=t_comm, comm_share=None if t_comm is None else t_comm / t_cp,
                mib_per_rank=bytes_moved / 2**20,
                all_gather_mib=(gather if name == "fwd" else 2 * gather) / 2**20,
                kv_held_mib=held / 2**20, peak_gib=peak_gib(cp),
            )
        )  # fmt: skip
    dense_torch = []
    if args.dense_torch:
        # Our gradients are done with: at 1M tokens they are the ~15 GiB per rank that dense
        # SDPA's ring attention would otherwise lack.
        for t in (q, k, v, ql, kl, vl):
            t.grad = None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        dense_torch = dense_torch_rows(q, k, v, grad, world, args)
    if rank == 0:
        env = environment()
        lines = [
            f"# Context parallelism — {world} x {env['device']}",
            "",
            versions_line(env),
            "",
            f"seq {args.seq}, {args.heads} query / {args.kv_heads} KV heads of {args.dim}, "
            f"{args.dtype}, block {args.block_size}, "
            + (
                "dense pattern"
                if args.pattern == "dense"
                else f"local {args.local_blocks}, stride {args.stride}"
            )
            + ". "
            + (
                (
                    f"Not run on one device (--no-reference); {args.check_rows} sampled query "
                    "rows per rank against float32 from the seeded inputs, worst rank: "
                    if args.no_reference
                    else "Relative errors against one device, worst rank: "
                )
                + (", ".join(f"{n} {e:.1e}" for n, e in errors.items()) or "none")
                + f" ({'ok' if ok else 'FAILED'})."
            ),
            "",
            *table(
                HEADERS,
                [
                    [
                        r["pass_"],
                        world,
                        f"{r['cp_ms']:.2f}",
                        f"{r['balance']:.3f}",
                        cell(r["one_device_ms"], "{:.2f}"),
                        cell(r["efficiency"], "{:.2f}"),
                        f"{r['gpairs_per_rank']:.3g}",
                        f"{r['ms_per_gpair']:.3g}",
                        cell(r["comm_ms"], "{:.2f}"),
                        cell(r["comm_share"], "{:.1%}"),
                        f"{r['mib_per_rank']:.1f}",
                        f"{r['all_gather_mib']:.1f}",
                        f"{r['kv_held_mib']:.1f}",
                        f"{r['peak_gib']:.2f}",
                    ]
                    for r in rows
                ],
            ),  # fmt: skip
            "",
        ]
        for r in dense_torch:
            lines.append(
                f"Dense causal SDPA under PyTorch's context parallelism, {r['pass_']}: "
                + (f"{r['cp_ms']:.2f} ms per rank" if "cp_ms" in r else r["error"])
                + (
                    f", output against one-device SDPA: relative error {r['error_out']:.1e}"
                    if "error_out" in r
                    else ""
                )
                + f" (ring attention moves about an all-gather's {r['all_gather_mib']:.1f} MiB)."
            )
        stem = result_stem(env, f"context_parallel_w{world}{'_' + args.tag if args.tag else ''}")
        payload = dict(env=env, args=vars(args) | {"out_dir": str(args.out_dir)}, errors=errors,
                       rows=rows, dense_torch=dense_torch)  # fmt: skip
        write_results(args.out_dir, stem, "\n".join(lines), payload)
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
