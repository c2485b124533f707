"""Context parallelism: exactness against one GPU, time and balance per rank, bytes, scaling.

Every rank builds the same full q, k, v and output gradient, takes its shard with
``s2attn.distributed.shard``, runs ``context_parallel_attention`` forward and backward, and
checks each rank's shards of the output and dq/dk/dv against the same shards of one-device
``sparse_attention`` on the whole sequence (the worst rank's relative error under 1e-2 in bf16,
2e-3 in fp16, 1e-4 in fp32). Then it times forward and forward+backward (median of ``--iters``
after ``--warmup`` calls, each after a barrier; the slowest rank is reported, and its ratio to
the mean rank's) and the one-device call on the whole sequence, and reports:

- strong-scaling efficiency (one-device time / (W x time per rank)), the pattern's work per rank
  (its kept token pairs over W, summed over heads) and the time per billion of them;
- ``exchange ms alone``: the call's exchange timed by itself, the slowest rank's median of 20
  after a barrier: the same ``all_to_all_single`` of K and of V, with the call's own plan, that
  the forward runs (fwd row), plus the return of their gradients that the backward runs
  (fwd+bwd row); ``exchange / step``, its share of the row's time per rank, what overlapping it
  with compute could save at most; ``agreement check ms``, the per-call check that the ranks
  agree (an all-gather and a host sync), timed alone the same way;
- the K/V bytes the busiest rank receives and holds (its shard, what it receives, its chunks'
  compact keys), against an all-gather's;
- the GPU memory peak of the timed calls (which counts the full-sequence tensors held for the
  comparison), each forward+backward starting from no gradients.

With ``--no-reference`` (lengths one device cannot hold) each rank draws only its shards, span by
span from seeded generators, and checks sampled rows against float32 computed from inputs drawn
the same way (``--check-rows``): out, LSE and dq of query rows, and dk and dv of key rows outside
every head's stripes, each summed over the queries of its local window (a stripe's key has every
later query as a reader). Rows are printed as they come, so that a run cut off says how far it
got.

    python benchmarks/context_parallel.py                          # world size 1
    torchrun --nproc-per-node 4 benchmarks/context_parallel.py --seq 131072
    torchrun --nproc-per-node 8 benchmarks/context_parallel.py --seq 1048576 --pattern dense
    torchrun --nproc-per-node 8 benchmarks/context_parallel.py --seq-per-rank 262144 --tag weak
    torchrun --nproc-per-node 4 benchmarks/context_parallel.py --seq 4194304 --no-reference \
        --iters 3 --warmup 1
    torchrun --nproc-per-node 2 benchmarks/context_parallel.py --seq 512 --heads 4 --kv-heads 2 \
        --dim 32 --block-size 16 --local-blocks 2 --stride 4 --dtype float32   # CPU smoke, gloo

Weak scaling (``--seq-per-rank``) adds work per token: a local + stride pattern keeps more pairs
per query as the sequence grows, so W ranks at W x L tokens each do more than one device at L.
``ms per G pairs`` divides that out: its ratio between two runs is the efficiency left to the
system (the exchange, the balance, the launch), the pattern's own growth aside.

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
from s2attn.distributed import communication_bytes, context_parallel_attention, shard, unshard
from s2attn.distributed.context_parallel import CallCommunication
from s2attn.reference import key_row_grads
from s2attn.rules import LocalStrideRule

HEADERS = [
    "pass", "ranks", "ms per rank", "slowest / mean rank", "one device ms", "efficiency",
    "kept G pairs per rank", "ms per G pairs", "exchange ms alone, slowest rank",
    "exchange / step", "agreement check ms", "MiB in, busiest rank", "all-gather MiB",
    "K/V held MiB, busiest rank", "GPU peak GiB, busiest rank",
]  # fmt: skip
TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-4}
SPAN = 1 << 16  # --no-reference draws the sequence this many positions per generator
TAGS = {"q": 1, "k": 2, "v": 3, "grad": 4}  # each tensor's seeds
ROW_CHUNK = 1024  # --no-reference's check computes this many rows against a span's keys at once
COMM_ITERS = 20  # timed runs of each collective alone: each is short, so more of them


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


def shared_rule_heads(pattern, kv_heads: int) -> list[slice]:
    """The pattern's heads in runs that keep the same blocks (a KV group's heads when they share
    one rule), so that the reference computes a run's heads against one set of keys at once."""
    group, rules = pattern.num_heads // kv_heads, pattern.rules
    runs = []
    for g in range(kv_heads):
        heads = range(g * group, (g + 1) * group)
        if rules is not None and len({rules[h] for h in heads}) == 1:
            runs.append(slice(heads.start, heads.stop))
        else:
            runs.extend(slice(h, h + 1) for h in heads)
    return runs


def reference_rows(pos: torch.Tensor, pattern, args, dtype, device) -> tuple[torch.Tensor, ...]:
    """Float32 out, LSE and dq (rows, heads[, dim]) of the virtual full tensors' query rows at
    ``pos`` (host int64), for runs without the whole sequence anywhere: the keys each row's kept
    blocks hold are drawn span by span and folded in with an online softmax (dq as
    scale * (sum p dP k - delta sum p k), both sums rescaled like the output). Rows go ROW_CHUNK
    at a time, each against only the blocks some row of the chunk keeps."""
    heads, group, scale = args.heads, args.heads // args.kv_heads, args.dim**-0.5
    bs, q_shape, kv_shape = pattern.block_size, (heads, args.dim), (args.kv_heads, args.dim)
    f32 = dict(dtype=torch.float32, device=device)
    qr = seeded_rows("q", pos, q_shape, dtype, device).float()  # (rows, heads, dim)
    dor = seeded_rows("grad", pos, q_shape, dtype, device).float()
    rows = len(pos)
    # Finite, so that a row that sees nothing in a span rescales by exp(0), not by nan.
    m = torch.full((rows, heads), -1e30, **f32)
    l_sum = torch.zeros(rows, heads, **f32)
    o_acc, a_acc, b_acc = (torch.zeros(rows, heads, args.dim, **f32) for _ in range(3))
    # Per run of heads: the kept blocks of the rows' query blocks, as a (query block, column)
    # mask over the sorted columns any of them keeps.
    q_blocks, row_block = (pos // bs).unique(return_inverse=True)
    masks = []
    for run in shared_rule_heads(pattern, args.kv_heads):
        pairs = [pattern.row_blocks(run.start, b, b + 1) for b in q_blocks.tolist()]
        i, j = (torch.cat(t) for t in zip(*pairs))
        cols = j.unique()
        mask = torch.zeros(len(q_blocks), len(cols), dtype=torch.bool)
        mask[torch.searchsorted(q_blocks, i), torch.searchsorted(cols, j)] = True
        masks.append((run, cols.to(device), mask[row_block].to(device)))
    pos_dev, offsets = pos.to(device), torch.arange(bs, device=device)
    for span in range(-(-args.seq // SPAN)):
        lo = span * SPAN
        k_span = span_rows("k", span, kv_shape, dtype, device)
        v_span = span_rows("v", span, kv_shape, dtype, device)
        for run, cols, mask in masks:
            g = run.start // group
            in_span = (cols * bs >= lo) & (cols * bs < lo + SPAN)  # blocks never straddle spans
            for r in range(0, rows, ROW_CHUNK):
                rs = slice(r, r + ROW_CHUNK)
                seen = mask[rs][:, in_span]
                kept = seen.any(0)
                if not kept.any():
                    continue
                kp = (cols[in_span][kept][:, None] * bs + offsets).flatten()
                visible = seen[:, kept].repeat_interleave(bs, dim=1) & (kp < args.seq)
                if pattern.causal:
                    visible &= kp <= pos_dev[rs, None]
                kk, vv = (x[kp - lo, g].float() for x in (k_span, v_span))
                sc = torch.einsum("rhd,kd->rhk", qr[rs, run], kk) * scale
                sc.masked_fill_(~visible[:, None], float("-inf"))
                new_m = torch.maximum(m[rs, run], sc.amax(-1))
                keep, p = torch.exp(m[rs, run] - new_m), torch.exp(sc - new_m[..., None])
                dp = torch.einsum("rhd,kd->rhk", dor[rs, run], vv)
                m[rs, run] = new_m
                l_sum[rs, run] = l_sum[rs, run] * keep + p.sum(-1)
                o_acc[rs, run] = o_acc[rs, run] * keep[..., None] + p @ vv
                a_acc[rs, run] = a_acc[rs, run] * keep[..., None] + (p * dp) @ kk
                b_acc[rs, run] = b_acc[rs, run] * keep[..., None] + p @ kk
    out = o_acc / l_sum[..., None]
    delta = (dor * out).sum(-1, keepdim=True)
    dq = scale * (a_acc - delta * b_acc) / l_sum[..., None]
    return out, m + l_sum.log(), dq


def local_only_blocks(pattern) -> tuple[int, set[tuple[int, int]]] | None:
    """(local_blocks, the stripes' (stride, shift)) when every head is a causal local + stride
    rule with one window: a key block outside every head's stripes is then read only by the
    ``local_blocks`` query blocks from its own, so its dK and dV are cheap to recompute. None
    otherwise (a dense head, or a pattern without rules: every later query may read a key)."""
    rules = pattern.rules
    if (
        rules is None
        or not pattern.causal
        or not all(isinstance(r, LocalStrideRule) for r in rules)
    ):
        return None
    local_blocks = {r.local_blocks for r in rules}
    if len(local_blocks) != 1:  # the readers of a block would differ between heads
        return None
    return local_blocks.pop(), {(r.vert_stride, r.shift) for r in rules}


def sampled_keys(positions: torch.Tensor, pattern, count: int, gen) -> torch.Tensor:
    """Up to ``count`` of this rank's key positions outside every head's stripes: the last such
    position of each of its two chunks (their local windows reach into the next chunk, another
    rank's, so their gradients come back through the exchange), the rest at random."""
    _, stripes = local_only_blocks(pattern)
    blocks = positions // pattern.block_size
    outside = torch.ones(len(positions), dtype=torch.bool)
    for stride, shift in stripes:
        outside &= (blocks + shift) % stride != 0
    half = len(positions) // 2
    picked = []
    for chunk in (slice(0, half), slice(half, len(positions))):
        idx = outside[chunk].nonzero().flatten()
        if len(idx):
            picked.append(chunk.start + int(idx[-1]))
    candidates = outside.nonzero().flatten()
    drawn = candidates[torch.randperm(len(candidates), generator=gen)[: max(count - 2, 0)]]
    return torch.tensor(sorted(set(picked) | set(drawn.tolist())), dtype=torch.long)


def sampled_row_errors(out, lse, dq, dk, dv, pattern, positions, args, dtype, device) -> dict:
    """Relative errors, worst rank, of sampled rows of this rank's shards against float32 from
    the seeded inputs (:func:`reference_rows`), for runs without the whole sequence anywhere:
    out, LSE and dq on ``--check-rows`` query rows (the shard's first, its last, the rest at
    random); dk and dv on as many key rows outside every head's stripes
    (:func:`sampled_keys`), each summed over the queries of its local window, which read it
    alone. A key in a stripe has every later query as a reader (millions at 4M tokens) and is
    not sampled; nor are dk and dv under a pattern with a dense head."""
    rows, bs = args.check_rows, pattern.block_size
    group, scale = args.heads // args.kv_heads, args.dim**-0.5
    gen = torch.Generator().manual_seed(7 + dist.get_rank())
    drawn = torch.randint(len(positions), (max(rows - 2, 0),), generator=gen).tolist()
    local = [0, len(positions) - 1, *drawn]
    checked = [positions[local]]
    window = local_only_blocks(pattern)
    key_local, readers = torch.zeros(0, dtype=torch.long), []
    if window is not None:
        key_local = sampled_keys(positions, pattern, rows, gen)
        for s in positions[key_local].tolist():
            end = min(args.seq, (s // bs + window[0]) * bs)
            readers.append(torch.arange(s, end))
    ref_out, ref_lse, ref_dq = reference_rows(
        torch.cat(checked + readers), pattern, args, dtype, device
    )
    idx = torch.tensor(local, device=device)
    want = dict(out=ref_out[: len(local)], lse=ref_lse[: len(local)], dq=ref_dq[: len(local)])
    got = dict(out=out[0, idx], lse=lse[0, :, idx].transpose(0, 1), dq=dq[0, idx])
    if len(key_local):
        # dK, dV of key s from its readers t, every head of its KV group, then summed over the
        # group's heads.
        key_pos = positions[key_local]
        kv_shape, q_shape = (args.kv_heads, args.dim), (args.heads, args.dim)
        ks = seeded_rows("k", key_pos, kv_shape, dtype, device).float()
        vs = seeded_rows("v", key_pos, kv_shape, dtype, device).float()
        want_dk, want_dv, start = [], [], len(local)
        for n, t in enumerate(readers):
            part = slice(start, start + len(t))
            start += len(t)
            q_t = seeded_rows("q", t, q_shape, dtype, device).float()  # (readers, heads, dim)
            do_t = seeded_rows("grad", t, q_shape, dtype, device).float()
            k_h, v_h = (x[n].repeat_interleave(group, dim=0) for x in (ks, vs))  # (heads, dim)
            dk_h, dv_h = key_row_grads(q_t, do_t, ref_out[part], ref_lse[part], k_h, v_h, scale)
            want_dk.append(dk_h.view(args.kv_heads, group, -1).sum(1))
            want_dv.append(dv_h.view(args.kv_heads, group, -1).sum(1))
        kidx = key_local.to(device)
        want.update(dk=torch.stack(want_dk), dv=torch.stack(want_dv))
        got.update(dk=dk[0, kidx], dv=dv[0, kidx])
    errors = {}
    for name in ("out", "lse", "dq", "dk", "dv"):
        # Every rank takes part in each all-reduce, also where it checked no key rows.
        mine = rel_err(got[name].float(), want[name]) if name in want else 0.0
        err = torch.tensor([mine], device=device)
        dist.all_reduce(err, op=dist.ReduceOp.MAX)
        if name in want or window is not None:
            errors[name] = err.item()
    return errors


def rank_times_ms(fn, iters: int, warmup: int) -> tuple[float, float, float]:
    """The slowest rank's and the mean rank's median ms of ``fn`` over ``iters`` runs after
    ``warmup`` ones, each run started together on every rank after a barrier (their ratio is the
    balance), and the largest GPU memory peak over the ranks of the timed runs (GiB; nan on a
    CPU)."""
    on_gpu = torch.cuda.is_available()
    times = []
    for i in range(warmup + iters):
        if i == warmup and on_gpu:  # the peak of steady calls, not of the first's caches
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        dist.barrier()
        if on_gpu:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if on_gpu:
            torch.cuda.synchronize()
        if i >= warmup:
            times.append((time.perf_counter() - t0) * 1e3)
    peak = torch.cuda.max_memory_allocated() / 2**30 if on_gpu else float("nan")
    mine = torch.tensor([statistics.median(times)], device="cuda" if on_gpu else "cpu")
    slowest, total, peak = mine.clone(), mine.clone(), torch.tensor([peak], device=mine.device)
    for t, op in (
        (slowest, dist.ReduceOp.MAX),
        (total, dist.ReduceOp.SUM),
        (peak, dist.ReduceOp.MAX),
    ):
        dist.all_reduce(t, op=op)
    return slowest.item(), total.item() / dist.get_world_size(), peak.item()


def timed_ms(fn, iters: int, warmup: int = 2) -> float:
    """Median ms of ``fn`` over ``iters`` runs, each started together on every rank; the slowest
    rank's."""
    return rank_times_ms(fn, iters, warmup)[0]


def table_row(r: dict) -> list[str]:
    """A row of the results table (HEADERS) from a row of the JSON."""
    return [
        r["pass_"], str(r["world"]), f"{r['cp_ms']:.2f}", f"{r['balance']:.3f}",
        cell(r["one_device_ms"], "{:.2f}"), cell(r["efficiency"], "{:.2f}"),
        f"{r['gpairs_per_rank']:.3g}", f"{r['ms_per_gpair']:.3g}",
        cell(r["exchange_ms"], "{:.3f}"), cell(r["exchange_share"], "{:.2%}"),
        f"{r['check_ms']:.3f}", f"{r['mib_per_rank']:.1f}", f"{r['all_gather_mib']:.1f}",
        f"{r['kv_held_mib']:.1f}", f"{r['peak_gib']:.2f}",
    ]  # fmt: skip


def worst_shard_err(mine: torch.Tensor, full: torch.Tensor) -> float:
    """The largest over the ranks of the relative error of a rank's shard against the same shard
    of the one-device tensor."""
    err = torch.tensor([rel_err(mine, shard(full))], device=mine.device)
    dist.all_reduce(err, op=dist.ReduceOp.MAX)
    return err.item()


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
        from torch.distributed.tensor.experimental import context_parallel

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
                for t in leaves:  # fresh gradients, as ours get
                    t.grad = None
                F.scaled_dot_product_attention(*leaves, is_causal=True).backward(gd)

            for name, fn, factor in (("fwd", fwd, 1), ("fwd+bwd", fwd_bwd, 2)):
                rows.append(dict(pass_=name, cp_ms=timed_ms(fn, args.dense_iters, args.warmup),
                                 all_gather_mib=factor * gather))  # fmt: skip
                if dist.get_rank() == 0:  # as it comes: a run cut off by a time limit says how far
                    print(f"dense SDPA under PyTorch's CP, {name}: {rows[-1]['cp_ms']:.1f} ms",
                          flush=True)  # fmt: skip
            with torch.no_grad():
                out = F.scaled_dot_product_attention(*leaves, is_causal=True)
            # Back in sequence order. torch exports no unshard (context_parallel_unshard is
            # private and has moved between releases), but its default balancer for causal SDPA
            # (_HeadTailLoadBalancer, chosen by _create_default_load_balancer when the sequence
            # divides by 2W) gives rank r chunks r and 2W-1-r of 2W, our shard's layout: so
            # ours gathers it back. A different layout would show as a large error.
            out = unshard(out, seq_dim=2)
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
    ap.add_argument(
        "--warmup", type=int, default=2,
        help="untimed calls before the --iters timed ones (the check's call has compiled the "
        "kernels and built the layouts already: 1 saves a call's time at 4M tokens)",
    )  # fmt: skip
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
        help="with --no-reference: query rows (out, LSE, dq) and key rows (dk, dv) per rank "
        "checked against float32",
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
                    out, lse, ql.grad, kl.grad, vl.grad, pattern, positions, args, dtype, device
                )
            del out, lse
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
    for t in (ql, kl, vl):
        t.grad = None
    ok = all(e < TOL[dtype] for e in errors.values())
    if rank == 0:  # now, so that a run cut short by the timings (memory, a time limit) still says
        print("errors " + (", ".join(f"{n} {e:.1e}" for n, e in errors.items()) or "none")
              + (" (within tolerance)" if ok else " (OUT OF TOLERANCE)"), flush=True)  # fmt: skip

    def cp_fwd():
        with torch.no_grad():
            context_parallel_attention(ql, kl, vl, pattern)

    def cp_fwd_bwd():
        # Fresh gradients, as a step's zero_grad leaves them: accumulating into the last ones
        # would hold two sets at once.
        for t in (ql, kl, vl):
            t.grad = None
        context_parallel_attention(ql, kl, vl, pattern).backward(grad_local)

    def one_fwd():
        with torch.no_grad():
            s2attn.sparse_attention(qf, kf, vf, pattern)

    def one_fwd_bwd():
        for t in (qf, kf, vf):
            t.grad = None
        s2attn.sparse_attention(qf, kf, vf, pattern).backward(grad)

    # The call's communication, each part alone: the agreement check, the forward's K/V
    # exchange and the backward's return of their gradients. From this rank's own plan (cached
    # by the call above), as are its bytes: no rank builds the others' plans.
    comm = CallCommunication.of(ql.detach(), kl.detach(), vl.detach(), pattern)
    check_ms = timed_ms(comm.agreement_check, COMM_ITERS)
    exchange_ms = return_ms = None
    if comm.plan is not None:
        exchange_ms = timed_ms(comm.exchange_kv, COMM_ITERS)
        return_ms = timed_ms(comm.return_gradients, COMM_ITERS)
    sizes = torch.tensor([comm.bytes_received(), comm.kv_bytes_held()], dtype=torch.float64,
                         device="cuda" if torch.cuda.is_available() else "cpu")  # fmt: skip
    dist.all_reduce(sizes, op=dist.ReduceOp.MAX)  # the busiest rank's
    moved, held = sizes.tolist()
    gather = communication_bytes(1, args.seq, args.kv_heads, args.dim, dtype, world)
    pairs_per_rank = pattern.kept_token_pairs(args.seq) / world / 1e9
    rows = []
    for name, cp, one, bytes_moved, t_exchange in (
        ("fwd", cp_fwd, one_fwd, moved, exchange_ms),
        ("fwd+bwd", cp_fwd_bwd, one_fwd_bwd, 2 * moved,
         None if exchange_ms is None else exchange_ms + return_ms),
    ):  # fmt: skip
        t_cp, t_mean, peak = rank_times_ms(cp, args.iters, args.warmup)
        t_one = None if args.no_reference else timed_ms(one, args.iters, args.warmup)
        rows.append(
            dict(
                pass_=name, world=world, seq=args.seq, cp_ms=t_cp, balance=t_cp / t_mean,
                one_device_ms=t_one,
                efficiency=None if t_one is None else t_one / (world * t_cp),
                gpairs_per_rank=pairs_per_rank, ms_per_gpair=t_cp / pairs_per_rank,
                exchange_ms=t_exchange,
                exchange_share=None if t_exchange is None else t_exchange / t_cp,
                check_ms=check_ms, mib_per_rank=bytes_moved / 2**20,
                all_gather_mib=(gather if name == "fwd" else 2 * gather) / 2**20,
                kv_held_mib=held / 2**20, peak_gib=peak,
            )
        )  # fmt: skip
        if rank == 0:  # as it comes: a run cut off by a time limit says how far it got
            print(" | ".join(table_row(rows[-1])), flush=True)
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
            + f"; median of {args.iters} after {args.warmup} warm-up calls. "
            + (
                (
                    "Not run on one device (--no-reference); sampled rows per rank "
                    f"({args.check_rows} query rows: out, LSE, dq"
                    + ("; as many key rows outside every stripe: dk, dv" if "dk" in errors else "")
                    + ") against float32 from the seeded inputs, worst rank: "
                    if args.no_reference
                    else "Relative errors against one device, worst rank: "
                )
                + (", ".join(f"{n} {e:.1e}" for n, e in errors.items()) or "none")
                + f" ({'ok' if ok else 'FAILED'})."
            ),
            "",
            *table(HEADERS, [table_row(r) for r in rows]),
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
