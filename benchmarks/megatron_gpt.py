"""Megatron-core GPT with HHST layers: it trains, and its attention equals the dense-mask reference.

Builds a Megatron-core ``GPTModel`` from ``s2attn.integrations.megatron.get_hhst_layer_spec`` (the
local, Transformer-Engine-free spec; the first ``--dense-layers`` layers dense, the rest S2). Its
weights are the full (TP = 1) model's, drawn from ``--seed`` and each parameter's name on every
rank, and each rank keeps its part, cut as Megatron cuts its weights: every tensor-parallel size
starts from the same model (nothing is downloaded). It trains ``--steps`` steps of AdamW on bytes
of this machine's Python standard library (vocabulary 256; the same windows on every rank;
learning rate warmed up over 5 steps), and checks:

* the loss falls: the mean of the last 5 steps is below 0.9x the mean of the first 5;
* one S2 layer's and one dense layer's core attention: the rank's pattern equals the head range of
  the full pattern built independently, and
  - its output on the inputs Megatron hands it, gathered over the ranks (heads over tensor
    parallelism, the sequence over context parallelism), equals ``s2attn.attention_reference`` in
    float32 on the gathered inputs within the forward tests' tolerance for the dtype (bf16: 1e-2
    relative error);
  - its q/k/v gradients on fresh standard-normal q/k/v of the layer's shapes (scores of unit
    variance: well conditioned) equal the float32 reference's within the backward tests'
    tolerance (bf16: 1e-2). ``--inject-dq-error 0.11`` scales dq by 1.11 to show that an 11% dq
    error fails this check;
  - its gradients on the trained activations are reported against the same reference with a loose
    guard (under 1e-2 or twice the error of the reference computed in bf16): a trained layer's
    sharp softmax leaves dq and dk ill-conditioned in bf16 whoever computes them;
* packed sequences: a pack of two sequences (``PackedSeqParams``, thd) gives the logits of each
  sequence run alone (relative error under 2e-2 in bf16); under context parallelism the
  integration must refuse the pack with an error naming it.

Tensor parallelism is the world size over ``--cp``; the query and KV heads must divide by it. With
``--cp N`` Megatron's context parallelism splits each sequence over N ranks (its layout: rank r
holds chunks r and 2N - 1 - r), the S2 layers run ``s2attn.distributed`` over the context-parallel
group and the gradients are averaged over it (as Megatron's data-parallel reduction does).
``--losses-out FILE`` writes the per-step losses (rank 0) for ``benchmarks/megatron_tp.py``, which
sets TP = 1, 2, 4 side by side.

    python benchmarks/megatron_gpt.py                                 # GPU, TP=1
    torchrun --nproc-per-node 2 benchmarks/megatron_gpt.py --tag tp2  # GPU, TP=2
    torchrun --nproc-per-node 2 benchmarks/megatron_gpt.py --cp 2 --tag cp2   # GPU, CP=2
    python benchmarks/megatron_gpt.py --smoke                         # CPU: a tiny model

Needs megatron-core (0.16 or later; ``pip install 's2attn[megatron]'``). Rank 0 writes markdown and
JSON with the device, versions and date to benchmarks/results/; the exit status is 1 when a check
fails.
"""

from __future__ import annotations

import json
import math
import os
import socket
import statistics
import sys
import sysconfig
import time
import warnings
import zlib
from pathlib import Path

import torch
import torch.distributed as dist

if not torch.cuda.is_available():  # CPU: the kernels under the Triton interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

from run_info import environment, parser, result_stem, table, versions_line, write_results

import s2attn
from s2attn.distributed import shard, unshard

with warnings.catch_warnings():  # megatron warns at import that Apex and TE are missing
    warnings.simplefilter("ignore")
    from megatron.core import package_info, parallel_state, tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.transformer_config import TransformerConfig

    from s2attn.integrations import megatron as s2mc

# The forward and backward tests' relative-error tolerances against the float32 reference
# (tests/helpers.py REL_TOL), by the dtype the layer computes in.
REL_TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-4}
LOGITS_TOL, LOSS_RATIO = 2e-2, 0.9
# The trained-activation gradients pass under this factor times the same reference's own error in
# the layer's dtype (FlashAttention's test rule): a guard against gross errors only; the
# fresh-input check holds the fixed tolerance.
BASELINE_FACTOR = 2.0
WARMUP_STEPS = 5
INIT_STD = 0.02  # Megatron's init_method_std

SMOKE = dict(layers=2, hidden=64, heads=4, kv_heads=2, seq=96, batch=1, steps=10, lr=3e-3)
SMOKE.update(block_size=16, local_blocks=2, vert_stride=2)


def arguments(argv: list[str] | None = None):
    ap = parser(__doc__)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--dense-layers", type=int, default=1, help="dense layers from the first")
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--local-blocks", type=int, default=4)
    ap.add_argument("--vert-stride", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cp", type=int, default=1, help="context-parallel size (divides the world)")
    ap.add_argument("--losses-out", type=Path, help="write the per-step losses here (JSON)")
    ap.add_argument(
        "--inject-dq-error",
        type=float,
        default=0.0,
        help="scale the checked layers' dq by 1 + this: shows the gradient check fails",
    )
    ap.add_argument("--smoke", action="store_true", help="CPU: a tiny model, float32")
    args = ap.parse_args(argv)
    if args.smoke:  # the tiny model's sizes, where the command line does not set them
        ap.set_defaults(**SMOKE)
        args = ap.parse_args(argv)
    if not 0 < args.dense_layers < args.layers:
        ap.error("--dense-layers must leave at least one dense and one S2 layer")
    if args.steps < 10:
        ap.error("--steps must be at least 10 (the loss check compares the first and last 5)")
    return args


# ------------------------------------------------------------------------------- set-up
def init_parallel(args) -> tuple[int, int]:
    """Process group (torchrun's, or one local process) and Megatron's TP = world size / cp;
    returns (rank, TP size). Sizes that do not divide raise on every rank before any collective,
    so no rank waits for another."""
    cuda = torch.cuda.is_available()
    backend = "nccl" if cuda else "gloo"
    if "RANK" in os.environ:  # under torchrun
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend)
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group(
            backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1
        )
    world = dist.get_world_size()
    if world % args.cp:
        raise SystemExit(f"--cp {args.cp} does not divide the world size {world}")
    tp = world // args.cp
    for flag, heads in (("--heads", args.heads), ("--kv-heads", args.kv_heads)):
        # KV heads too: with fewer KV heads than ranks Megatron replicates them, and the full
        # weights would no longer be cut the same way at every TP size.
        if heads % tp:
            raise SystemExit(
                f"{flag} {heads} does not divide by the tensor-parallel size {tp} (world size "
                f"{world} / --cp {args.cp}): every rank must hold the same number of heads"
            )
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, context_parallel_size=args.cp
    )
    if cuda:  # Megatron initialises GPU weights under its own RNG tracker
        tensor_parallel.model_parallel_cuda_manual_seed(args.seed)
    torch.manual_seed(args.seed)
    return dist.get_rank(), tp


def build(args, tp: int):
    cuda = torch.cuda.is_available()
    # Float32 weights; on CUDA the steps run under bf16 autocast (see main), which s2attn follows.
    # Megatron's own bf16 path needs its Float16Module wrapper around the model.
    dtype = torch.float32
    config = TransformerConfig(
        num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
        num_query_groups=args.kv_heads, ffn_hidden_size=4 * args.hidden,
        tensor_model_parallel_size=tp, context_parallel_size=args.cp, attention_dropout=0.0,
        hidden_dropout=0.0, init_method_std=INIT_STD,
        params_dtype=dtype, use_cpu_initialization=not cuda,
    )  # fmt: skip
    spec = s2mc.get_hhst_layer_spec(
        config, max_seq_len=args.seq, dense_layers=args.dense_layers, block_size=args.block_size,
        local_blocks=args.local_blocks, vert_stride=args.vert_stride,
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # 0.19 warns that GPTModel is deprecated
        model = GPTModel(
            config, spec, vocab_size=256, max_sequence_length=args.seq,
            # RoPE's tables are built on CUDA only; the CPU smoke run uses learned positions.
            position_embedding_type="rope" if cuda else "learned_absolute",
        )  # fmt: skip
    full_model_weights(model, args.seed, args.layers)
    device = "cuda" if cuda else "cpu"
    return config, model.to(device), device, dtype


def full_model_weights(model: torch.nn.Module, seed: int, num_layers: int) -> None:
    """Set every weight matrix to this rank's part of the full model's, drawn on the CPU from
    ``seed`` and the parameter's name: Megatron's own initialisation draws per rank (on the GPU,
    from a per-rank seed), so TP sizes would start from different models. The part is cut as
    Megatron cuts a full weight (``_initialize_affine_weight_cpu``: chunks of the partition
    dimension of size part / stride, rank r taking every TP-th from r). Vectors (biases, norm
    weights) are left alone: Megatron sets them to 0 and 1 at every TP size."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    rank = parallel_state.get_tensor_model_parallel_rank()
    # Megatron's output_layer_init_method: the residual branches' last projections scaled down.
    scaled = ("linear_proj.weight", "linear_fc2.weight")
    for name, p in model.named_parameters():
        if p.dim() < 2:
            continue
        parallel = getattr(p, "tensor_model_parallel", False) and tp > 1
        shape = list(p.shape)
        if parallel:
            shape[p.partition_dim] *= tp
        gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        std = INIT_STD / math.sqrt(2 * num_layers) if name.endswith(scaled) else INIT_STD
        full = torch.randn(shape, generator=gen) * std
        if parallel:
            piece = p.shape[p.partition_dim] // p.partition_stride
            full = torch.cat(full.split(piece, p.partition_dim)[rank::tp], p.partition_dim)
        with torch.no_grad():
            p.copy_(full)


def byte_corpus(limit: int = 16 << 20) -> torch.Tensor:
    """Bytes of the standard library's Python files, in a fixed order, up to ``limit``."""
    chunks, size = [], 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        size += len(data)
        if size >= limit:
            break
    return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8).long()


def batches(corpus: torch.Tensor, batch: int, seq: int, seed: int):
    """Random windows of ``seq + 1`` bytes; the same on every rank (the same generator seed)."""
    gen = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(0, corpus.numel() - seq - 1, (batch,), generator=gen)
        yield torch.stack([corpus[s : s + seq + 1] for s in starts.tolist()])


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def worst(value: float) -> float:
    """The largest ``value`` over the ranks."""
    t = torch.tensor([value], device="cuda" if torch.cuda.is_available() else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


# ------------------------------------------------------------------------------- checks
class Split:
    """How a rank's (seq, batch, heads, dim) tensors of one layer sit in the whole layer's: its
    head range (tensor parallelism) and its shard of the sequence (context parallelism)."""

    def __init__(self, heads: int, tp: int, cp_group):
        self.tp_group = parallel_state.get_tensor_model_parallel_group() if tp > 1 else None
        self.cp_group = cp_group
        self.tp = tp
        self.tp_rank = parallel_state.get_tensor_model_parallel_rank()
        self.heads = s2mc.tp_head_range(heads, self.tp_rank, tp)

    def whole(self, t: torch.Tensor) -> torch.Tensor:
        """Every rank's part gathered: heads in rank order, the sequence unsharded."""
        t = t.detach().contiguous()
        if self.tp_group is not None:
            parts = [torch.empty_like(t) for _ in range(self.tp)]
            dist.all_gather(parts, t, group=self.tp_group)
            t = torch.cat(parts, dim=2)
        return t if self.cp_group is None else unshard(t, self.cp_group, seq_dim=0)

    def part(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's part of a whole tensor (the same on every rank)."""
        per_rank = t.shape[2] // self.tp  # query heads or KV heads
        t = t[:, :, self.tp_rank * per_rank : (self.tp_rank + 1) * per_rank]
        return t if self.cp_group is None else shard(t, self.cp_group, seq_dim=0)


def run_core(core, q, k, v, grad_whole, split: Split, inject_dq: float):
    """The core attention's output and q/k/v gradients on this rank's parts, gathered whole;
    ``inject_dq`` scales dq by ``1 + inject_dq`` (a dq that far off, for the self-check)."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = core(q, k, v, None)
    out = out.reshape(*out.shape[:2], -1, q.shape[-1])
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), split.part(grad_whole).to(out.dtype))
    dq = dq * (1 + inject_dq)
    return split.whole(out), tuple(split.whole(g) for g in (dq, dk, dv))


def reference(q, k, v, grad, pattern, dtype: torch.dtype):
    """The dense-mask reference's output and q/k/v gradients on whole (seq, batch, heads, dim)
    tensors, computed in ``dtype`` on copies cast to it (outside autocast, which would compute its
    matmuls in bf16 whatever ``dtype`` says)."""
    leaves = [t.to(dtype).requires_grad_() for t in (q, k, v)]
    with torch.autocast(q.device.type, enabled=False):
        out = s2attn.attention_reference(
            *(t.transpose(0, 1) for t in leaves), pattern, compute_dtype=dtype
        ).transpose(0, 1)
        grads = torch.autograd.grad(out, leaves, grad.to(dtype))
    return out.detach(), grads


def errors(result, result_grads, ref, ref_grads) -> dict[str, float]:
    found = {"out": rel(result, ref)}
    found.update({f"d{n}": rel(g, r) for n, g, r in zip("qkv", result_grads, ref_grads)})
    return found


def check_layer(model, args, layer: int, ids, pos, tp: int) -> dict:
    """The layer's core attention against the dense-mask reference under the independently built
    pattern, every comparison on the whole layer (gathered over the tensor- and context-parallel
    ranks): the output and the gradients on the activations Megatron hands it, and the gradients
    on fresh standard-normal inputs of the same shapes."""
    core = model.decoder.layers[layer].self_attention.core_attention
    captured = {}

    def hook(module, inputs, output):
        captured["qkv"] = [t.detach() for t in inputs[:3]]

    handle = core.register_forward_hook(hook)
    with torch.no_grad():
        model(ids, pos, None)
    handle.remove()
    dense = layer < args.dense_layers
    if dense:
        full = s2attn.dense_pattern(args.heads, max_seq_len=args.seq, block_size=args.block_size)
    else:
        full = s2attn.local_stride_pattern(
            args.heads, max_seq_len=args.seq, block_size=args.block_size,
            local_blocks=args.local_blocks, vert_stride=args.vert_stride,
            num_kv_heads=args.kv_heads,
        )  # fmt: skip
    split = Split(args.heads, tp, core.cp_group)
    same_pattern = worst(0.0 if torch.equal(core.pattern.mask, full[split.heads].mask) else 1.0)

    q, k, v = captured["qkv"]
    # What the layer computes in: the autocast region's dtype where one is on (the layer casts
    # to it; Megatron's rotary embedding hands over float32 q and k under bf16 autocast).
    on = torch.is_autocast_enabled(q.device.type)
    dtype = torch.get_autocast_dtype(q.device.type) if on else q.dtype
    tol = REL_TOL[dtype]
    gen = torch.Generator().manual_seed(args.seed + 1 + layer)
    whole_shape = (args.seq, args.batch, args.heads, q.shape[-1])
    grad = torch.randn(whole_shape, generator=gen).to(q.device)

    # Trained activations: the output within the forward tests' tolerance, no factor; the
    # gradients against the guard.
    out, grads = run_core(core, q, k, v, grad, split, args.inject_dq_error)
    whole_qkv = [split.whole(t) for t in (q, k, v)]
    ref = reference(*whole_qkv, grad, full, torch.float32)
    trained = errors(out, grads, *ref)
    baseline = errors(*reference(*whole_qkv, grad, full, dtype), *ref)
    guard = {n: max(tol, BASELINE_FACTOR * baseline[n]) for n in ("dq", "dk", "dv")}

    # Fresh inputs: q, k, v standard normal, so the scores q.k / sqrt(dim) have unit variance.
    fresh_qkv = [
        torch.randn(args.seq, args.batch, h, q.shape[-1], generator=gen).to(q.device, dtype)
        for h in (args.heads, args.kv_heads, args.kv_heads)
    ]
    parts = [split.part(t) for t in fresh_qkv]
    out_f, grads_f = run_core(core, *parts, grad, split, args.inject_dq_error)
    fresh = errors(out_f, grads_f, *reference(*fresh_qkv, grad, full, torch.float32))

    checks = dict(
        out=trained["out"] < tol,
        trained_grads=all(trained[n] < guard[n] for n in guard),
        fresh=all(e < tol for e in fresh.values()),
    )
    return dict(
        layer=layer, kind="dense" if dense else "s2", density=full.density(args.seq),
        dtype=str(dtype), tol=tol, same_pattern=same_pattern == 0.0, trained=trained,
        baseline=baseline, guard=guard, fresh=fresh, checks=checks,
        passed=same_pattern == 0.0 and all(checks.values()),
    )  # fmt: skip


def packed_params(lengths: list[int], device) -> PackedSeqParams:
    cu = torch.tensor([0, *lengths], device=device).cumsum(0).to(torch.int32)
    longest = max(lengths)
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        max_seqlen_q=longest,
        max_seqlen_kv=longest,
    )


def check_packed(model, args, tokens, device) -> dict:
    """Two sequences in one thd pack give the logits of each run alone."""
    first = args.seq // 3
    lengths = [first, args.seq - first]
    ids = tokens[:1, : args.seq].to(device)
    params = packed_params(lengths, device)
    pos = torch.cat([torch.arange(n, device=device) for n in lengths])[None]
    with torch.no_grad():
        packed = model(ids, pos, None, packed_seq_params=params)
        alone = torch.cat(
            [
                model(ids[:, a:b], torch.arange(b - a, device=device)[None], None)
                for a, b in ((0, first), (first, args.seq))
            ],
            dim=1,
        )
    error = worst(rel(packed, alone))
    return dict(lengths=lengths, error=error, passed=error < LOGITS_TOL)


def check_packed_refused(model, ids, pos, device) -> dict:
    """Under context parallelism a pack of two sequences (this rank's tokens) is refused by the
    integration, on every rank, with an error that names it."""
    half = ids.shape[1] // 2
    params = packed_params([half, ids.shape[1] - half], device)
    try:
        with torch.no_grad():
            model(ids[:1], pos[:1], None, packed_seq_params=params)
    except NotImplementedError as exc:
        message = str(exc)
    else:
        message = ""
    named = "packed sequences" in message and "context parallelism" in message
    return dict(error=message, passed=worst(0.0 if named else 1.0) == 0.0)


# ------------------------------------------------------------------------------- main
def main() -> int:
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=torch.cuda.is_available()):
        return _main()


def _main() -> int:
    args = arguments()
    rank, tp = init_parallel(args)
    cp_group = parallel_state.get_context_parallel_group() if args.cp > 1 else None

    def local(t):  # this rank's shard of a (batch, seq) tensor
        return t if cp_group is None else shard(t, cp_group, seq_dim=1)

    config, model, device, dtype = build(args, tp)
    corpus = byte_corpus(1 << 20 if args.smoke else 16 << 20)
    data = batches(corpus, args.batch, args.seq, args.seed)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    if rank == 0:
        kinds = [
            "dense" if layer.self_attention.core_attention.is_dense else "s2"
            for layer in model.decoder.layers
        ]
        print(f"GPTModel: {args.layers} layers {kinds}, hidden {args.hidden}, {args.heads} heads "
              f"/ {args.kv_heads} KV, seq {args.seq}, batch {args.batch}, TP {tp}, CP {args.cp}, "
              f"{dtype}, "
              f"megatron-core {package_info.__version__}", flush=True)  # fmt: skip

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95))
    # Linear warm-up over the first steps: Adam's first updates at the full rate spike the loss.
    warmup = max(1, min(WARMUP_STEPS, args.steps // 4))
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup))
    losses, times = [], []
    model.train()
    for step in range(args.steps):
        tokens = next(data).to(device)
        ids, labels = tokens[:, :-1], tokens[:, 1:]
        pos = torch.arange(args.seq, device=device)[None].expand(args.batch, -1)
        ids, labels, pos = local(ids), local(labels), local(pos)
        sync()
        t0 = time.perf_counter()
        loss = model(ids, pos, None, labels=labels).float().mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if cp_group is not None:  # each rank's loss is a mean over its shard: average them
            for p in model.parameters():
                dist.all_reduce(p.grad, group=cp_group)
                p.grad /= args.cp
            loss = loss.detach()
            dist.all_reduce(loss, group=cp_group)
            loss /= args.cp
        optimizer.step()
        schedule.step()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
        losses.append(loss.item())
        if rank == 0:
            print(f"step {step:3d}  loss {losses[-1]:.4f}  {times[-1]:8.1f} ms", flush=True)

    first, last = statistics.mean(losses[:5]), statistics.mean(losses[-5:])
    loss_check = dict(first5=first, last5=last, passed=last < LOSS_RATIO * first)
    tokens = next(data).to(device)
    ids = local(tokens[:, :-1])
    pos = local(torch.arange(args.seq, device=device)[None].expand(args.batch, -1))
    layers = [
        check_layer(model, args, layer, ids, pos, tp)
        for layer in (args.dense_layers, 0)  # the first S2 layer, then a dense one
    ]
    if cp_group is None:
        packed = check_packed(model, args, tokens, device)
    else:
        packed = check_packed_refused(model, ids, pos, device)
    steady = times[3:] or times
    step_ms = statistics.median(steady)
    passed = loss_check["passed"] and packed["passed"] and all(c["passed"] for c in layers)

    if rank == 0:
        env = environment()
        precision = str(dtype) + (" weights, bf16 autocast" if device == "cuda" else "")
        env.update(megatron_core=package_info.__version__, tp=tp, cp=args.cp, dtype=precision)
        rows = [["loss, mean of first 5 -> last 5 steps", f"{first:.3f} -> {last:.3f}",
                 f"< {LOSS_RATIO}x", loss_check["passed"]]]  # fmt: skip
        for c in layers:
            name = f"layer {c['layer']} ({c['kind']}, density {c['density']:.3f})"
            rows += [
                [f"{name}: pattern = head range of the full pattern", "", "", c["same_pattern"]],
                [
                    f"{name}: out, gathered over ranks, vs float32 reference ({c['dtype']})",
                    f"{c['trained']['out']:.1e}",
                    f"< {c['tol']:.0e}",
                    c["checks"]["out"],
                ],
                [
                    f"{name}: dq, dk, dv on fresh N(0, 1) q/k/v vs float32 reference",
                    ", ".join(f"{c['fresh'][n]:.1e}" for n in ("dq", "dk", "dv")),
                    f"< {c['tol']:.0e}",
                    c["checks"]["fresh"],
                ],
                [
                    f"{name}: dq, dk, dv on trained activations (guard; same-dtype reference's "
                    "error)",
                    ", ".join(
                        f"{c['trained'][n]:.1e} ({c['baseline'][n]:.1e})"
                        for n in ("dq", "dk", "dv")
                    ),
                    f"< max({c['tol']:.0e}, {BASELINE_FACTOR:g}x same-dtype ref)",
                    c["checks"]["trained_grads"],
                ],
            ]
        if cp_group is None:
            rows.append([f"packed thd {packed['lengths']} vs alone, logits",
                         f"{packed['error']:.1e}", f"< {LOGITS_TOL:.0e}",
                         packed["passed"]])  # fmt: skip
        else:
            rows.append(
                [
                    "packed thd under CP: refused",
                    packed["error"][:90] or "not refused",
                    "an error naming it",
                    packed["passed"],
                ]
            )
        tokens_per_s = args.batch * args.seq / step_ms * 1e3
        rows.append(["training step, median ms (tokens/s)",
                     f"{step_ms:.1f} ({tokens_per_s:,.0f})", "", ""])  # fmt: skip
        description = (
            f"Megatron-core GPTModel, HHST spec from s2attn.integrations.megatron: "
            f"{args.layers} layers (first {args.dense_layers} dense), hidden {args.hidden}, "
            f"{args.heads} query / {args.kv_heads} KV heads, seq {args.seq}, batch {args.batch}, "
            f"block {args.block_size}, local {args.local_blocks} blocks, vertical stride "
            f"{args.vert_stride}; TP {tp}, CP {args.cp}; {precision}; AdamW lr {args.lr} on "
            f"stdlib bytes, {args.steps} steps, seed {args.seed}; "
            f"megatron-core {package_info.__version__}."
            + (
                f" dq scaled by {1 + args.inject_dq_error:g} (self-check)."
                if args.inject_dq_error
                else ""
            )
        )
        lines = [f"# Megatron-core HHST GPT — {env['device']}", "", versions_line(env), "",
                 description, "", *table(["check", "value", "limit", "pass"], rows), "",
                 "Losses: " + ", ".join(f"{x:.3f}" for x in losses), ""]  # fmt: skip
        payload = dict(env=env, args=vars(args) | {"out_dir": str(args.out_dir),
                       "losses_out": str(args.losses_out)}, losses=losses,
                       step_ms=times, loss=loss_check, layers=layers, packed=packed,
                       passed=passed, rows=rows)  # fmt: skip
        name = (
            "megatron_gpt" + (f"_{args.tag}" if args.tag else "") + ("_smoke" if args.smoke else "")
        )
        write_results(args.out_dir, result_stem(env, name), "\n".join(lines), payload)
        if args.losses_out is not None:
            args.losses_out.parent.mkdir(parents=True, exist_ok=True)
            args.losses_out.write_text(
                json.dumps(
                    dict(
                        tp=tp,
                        cp=args.cp,
                        device=env["device"],
                        precision=precision,
                        losses=losses,
                        passed=passed,
                    )
                )
            )
        print("PASSED" if passed else "FAILED", flush=True)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
