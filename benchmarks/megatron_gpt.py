"""Megatron-core GPT with HHST layers: it trains, and its attention equals the dense-mask reference.

Builds a Megatron-core ``GPTModel`` (random weights, nothing downloaded) from
``s2attn.integrations.megatron.get_hhst_layer_spec`` (the local, Transformer-Engine-free spec; the
first ``--dense-layers`` layers dense, the rest S2), trains it ``--steps`` steps of AdamW on bytes
of this machine's Python standard library (vocabulary 256; learning rate warmed up over 5 steps),
and checks:

* the loss falls: the mean of the last 5 steps is below 0.9x the mean of the first 5;
* one S2 layer's and one dense layer's core attention: the rank's pattern equals the head range of
  the full pattern built independently, and its output and q/k/v gradients on the inputs Megatron
  hands it equal ``s2attn.attention_reference`` in float32 (relative error under 1e-2 in bf16, or
  under twice the error of the same reference computed in bf16, whichever is larger: a trained
  layer's sharp softmax leaves dq and dk ill-conditioned in bf16 whoever computes them);
* packed sequences: a pack of two sequences (``PackedSeqParams``, thd) gives the logits of each
  sequence run alone (relative error under 2e-2 in bf16).

Tensor parallelism is the world size over ``--cp``: every rank holds its head range of every
pattern. With ``--cp N`` Megatron's context parallelism splits each sequence over N ranks (its
layout: rank r holds chunks r and 2N - 1 - r), the S2 layers run ``s2attn.distributed`` over the
context-parallel group, the gradients are averaged over it (as Megatron's data-parallel reduction
does), and the layer checks gather the sequence to compare each rank's shard with the reference
on the whole of it; packed sequences are not checked there.

    python benchmarks/megatron_gpt.py                                 # GPU, TP=1
    torchrun --nproc-per-node 2 benchmarks/megatron_gpt.py --tag tp2  # GPU, TP=2
    torchrun --nproc-per-node 2 benchmarks/megatron_gpt.py --cp 2 --tag cp2   # GPU, CP=2
    python benchmarks/megatron_gpt.py --smoke                         # CPU: a tiny model

Needs megatron-core (0.16 or later; ``pip install 's2attn[megatron]'``). Rank 0 writes markdown and
JSON with the device, versions and date to benchmarks/results/; the exit status is 1 when a check
fails.
"""

from __future__ import annotations

import os
import socket
import statistics
import sys
import sysconfig
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

if not torch.cuda.is_available():  # CPU: the kernels under the Triton interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

from run_info import environment, parser, result_stem, table, versions_line, write_results  # noqa: E402

import s2attn  # noqa: E402

with warnings.catch_warnings():  # megatron warns at import that Apex and TE are missing
    warnings.simplefilter("ignore")
    from megatron.core import package_info, parallel_state, tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.transformer_config import TransformerConfig

    from s2attn.integrations import megatron as s2mc

ATTENTION_TOL, LOGITS_TOL, LOSS_RATIO = 1e-2, 2e-2, 0.9
# A gradient whose float32 reference bf16 itself misses by more than ATTENTION_TOL passes when
# s2attn lands within this factor of the bf16 reference's own error (FlashAttention's test rule).
BASELINE_FACTOR = 2.0
WARMUP_STEPS = 5


def arguments():
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
    ap.add_argument("--smoke", action="store_true", help="CPU: a tiny model, float32")
    args = ap.parse_args()
    if args.smoke:
        args.layers, args.hidden, args.heads, args.kv_heads = 2, 64, 4, 2
        args.seq, args.batch, args.steps, args.lr = 96, 2, 10, 3e-3
        args.block_size, args.local_blocks, args.vert_stride = 16, 2, 2
    if not 0 < args.dense_layers < args.layers:
        ap.error("--dense-layers must leave at least one dense and one S2 layer")
    return args


# ------------------------------------------------------------------------------- set-up
def init_parallel(seed: int, cp: int) -> tuple[int, int]:
    """Process group (torchrun's, or one local process) and Megatron's TP = world size / cp;
    returns (rank, TP size)."""
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
    if dist.get_world_size() % cp:
        raise SystemExit(f"--cp {cp} does not divide the world size {dist.get_world_size()}")
    tp = dist.get_world_size() // cp
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, context_parallel_size=cp
    )
    if cuda:  # Megatron initialises GPU weights under its own RNG tracker
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    torch.manual_seed(seed)
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
        hidden_dropout=0.0,
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
    device = "cuda" if cuda else "cpu"
    return config, model.to(device), device, dtype


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
    """The largest ``value`` over the ranks (each rank checks its own heads)."""
    t = torch.tensor([value], device="cuda" if torch.cuda.is_available() else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


# ------------------------------------------------------------------------------- checks
def check_layer(model, args, layer: int, ids, pos, tp: int) -> dict:
    """The layer's core attention on the inputs Megatron hands it against the dense-mask
    reference under the independently built pattern: output and gradients. Under context
    parallelism the reference runs on the whole sequence, gathered from the ranks, and each rank
    compares its shard."""
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
    expected = full[
        s2mc.tp_head_range(args.heads, parallel_state.get_tensor_model_parallel_rank(), tp)
    ]
    same_pattern = torch.equal(core.pattern.mask, expected.mask)

    q, k, v = (t.clone().requires_grad_() for t in captured["qkv"])
    out = core(q, k, v, None)
    grad = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), grad)
    cp_group = core.cp_group
    whole, part = _whole_and_part(cp_group)

    def reference(dtype: torch.dtype) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """The dense-mask reference's output and q/k/v gradients, computed in ``dtype`` on
        copies of the inputs cast to it (outside autocast, which would compute its matmuls in
        bf16 whatever ``dtype`` says)."""
        leaves = [whole(t.detach()).to(dtype).requires_grad_() for t in (q, k, v)]
        with torch.autocast(q.device.type, enabled=False):
            ref = s2attn.attention_reference(
                *(t.transpose(0, 1) for t in leaves), expected, compute_dtype=dtype
            ).transpose(0, 1)  # fmt: skip
            ref = ref.reshape(*ref.shape[:2], -1)
            ref_grads = torch.autograd.grad(ref, leaves, whole(grad).to(dtype))
            return part(ref), tuple(part(g) for g in ref_grads)

    def errors_against(result, result_grads) -> dict[str, float]:
        found = {"out": rel(result, ref)}
        found.update({f"d{n}": rel(g, r) for n, g, r in zip("qkv", result_grads, ref_grads)})
        return {name: worst(e) for name, e in found.items()}

    ref, ref_grads = reference(torch.float32)
    errors = errors_against(out, grads)
    # The same reference computed in bf16 (the dtype autocast hands the layer, whatever Megatron
    # passes in) shows how far bf16 itself lands from float32 on these activations: a trained
    # layer's sharp softmax makes dq and dk ill-conditioned (dS = P * (dP - delta) cancels), so
    # their error is judged against this one's.
    baseline = errors_against(*reference(out.dtype))
    same_pattern = worst(0.0 if same_pattern else 1.0) == 0.0
    within = all(e < max(ATTENTION_TOL, BASELINE_FACTOR * baseline[n]) for n, e in errors.items())
    return dict(
        layer=layer, kind="dense" if dense else "s2", density=expected.density(args.seq),
        same_pattern=same_pattern, errors=errors, baseline_errors=baseline,
        passed=same_pattern and within,
    )  # fmt: skip


def _whole_and_part(cp_group):
    """Gather a (seq, ...) shard into the whole sequence and cut this rank's shard back out of
    it: identities without context parallelism."""
    if cp_group is None:
        return (lambda t: t), (lambda t: t)
    from s2attn.distributed import shard, unshard

    return (lambda t: unshard(t, cp_group, seq_dim=0)), (lambda t: shard(t, cp_group, seq_dim=0))


def check_packed(model, args, tokens, device) -> dict:
    """Two sequences in one thd pack give the logits of each run alone."""
    first = args.seq // 3
    lengths = [first, args.seq - first]
    ids = tokens[:1, : args.seq].to(device)
    cu = torch.tensor([0, first, args.seq], dtype=torch.int32, device=device)
    params = PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
        max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths),
    )  # fmt: skip
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


# ------------------------------------------------------------------------------- main
def main() -> int:
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=torch.cuda.is_available()):
        return _main()


def _main() -> int:
    args = arguments()
    rank, tp = init_parallel(args.seed, args.cp)
    cp_group = parallel_state.get_context_parallel_group() if args.cp > 1 else None
    _, local = _whole_and_part(cp_group)  # this rank's shard of a (seq, ...) tensor
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
        ids, labels, pos = (local(t.T).T for t in (ids, labels, pos))  # sequence dim 1
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
    ids = local(tokens[:, :-1].T).T
    pos = local(torch.arange(args.seq, device=device)[None].expand(args.batch, -1).T).T
    layers = [
        check_layer(model, args, layer, ids, pos, tp)
        for layer in (args.dense_layers, 0)  # the first S2 layer, then a dense one
    ]
    packed = check_packed(model, args, tokens, device) if cp_group is None else None
    steady = times[3:] or times
    step_ms = statistics.median(steady)
    passed = (
        loss_check["passed"]
        and (packed is None or packed["passed"])
        and all(c["passed"] for c in layers)
    )

    if rank == 0:
        env = environment()
        precision = str(dtype) + (" weights, bf16 autocast" if device == "cuda" else "")
        env.update(megatron_core=package_info.__version__, tp=tp, cp=args.cp, dtype=precision)
        rows = [["loss, mean of first 5 -> last 5 steps", f"{first:.3f} -> {last:.3f}",
                 f"< {LOSS_RATIO}x", loss_check["passed"]]]  # fmt: skip
        for c in layers:
            errs = ", ".join(
                f"{n} {e:.1e} (same-dtype ref {c['baseline_errors'][n]:.1e})"
                for n, e in c["errors"].items()
            )
            rows.append([f"layer {c['layer']} ({c['kind']}, density {c['density']:.3f}) vs "
                         f"reference; pattern = head range of full: {c['same_pattern']}", errs,
                         f"< max({ATTENTION_TOL:.0e}, {BASELINE_FACTOR:g}x same-dtype ref)",
                         c["passed"]])  # fmt: skip
        if packed is None:
            rows.append(["packed thd vs alone, logits", "not checked under CP", "", ""])
        else:
            rows.append([f"packed thd {packed['lengths']} vs alone, logits",
                         f"{packed['error']:.1e}", f"< {LOGITS_TOL:.0e}",
                         packed["passed"]])  # fmt: skip
        tokens_per_s = args.batch * args.seq / step_ms * 1e3
        rows.append(["training step, median ms (tokens/s)",
                     f"{step_ms:.1f} ({tokens_per_s:,.0f})", "", ""])  # fmt: skip
        description = (
            f"Megatron-core GPTModel, HHST spec from s2attn.integrations.megatron: "
            f"{args.layers} layers (first {args.dense_layers} dense), hidden {args.hidden}, "
            f"{args.heads} query / {args.kv_heads} KV heads, seq {args.seq}, batch {args.batch}, "
            f"block {args.block_size}, local {args.local_blocks} blocks, vertical stride "
            f"{args.vert_stride}; TP {tp}, CP {args.cp}; {dtype}; AdamW lr {args.lr} on stdlib "
            "bytes; "
            f"megatron-core {package_info.__version__}."
        )
        lines = [f"# Megatron-core HHST GPT — {env['device']}", "", versions_line(env), "",
                 description, "", *table(["check", "value", "limit", "pass"], rows), "",
                 "Losses: " + ", ".join(f"{x:.3f}" for x in losses), ""]  # fmt: skip
        payload = dict(env=env, args=vars(args) | {"out_dir": str(args.out_dir)}, losses=losses,
                       step_ms=times, loss=loss_check, layers=layers, packed=packed,
                       passed=passed, rows=rows)  # fmt: skip
        name = (
            "megatron_gpt" + (f"_{args.tag}" if args.tag else "") + ("_smoke" if args.smoke else "")
        )
        write_results(args.out_dir, result_stem(env, name), "\n".join(lines), payload)
        print("PASSED" if passed else "FAILED", flush=True)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
