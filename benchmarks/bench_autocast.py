"""Mixed-precision training speed (issue 26): a small HHST Llama's step under autocast against the
same model with bfloat16 weights, with dense SDPA beside it.

Model (random weights, nothing downloaded): 8 layers, hidden 512, 8 query / 4 KV heads of dim 64,
MLP 1376, byte vocabulary (256); batch 16 of 4096 tokens. HHST: layers 0 and 4 dense, the others
S2 (block 64, local 4 blocks, vertical stride 8), all through s2attn; dense: every layer SDPA.
Precisions: float32 weights inside ``torch.autocast("cuda", dtype=torch.bfloat16)`` (how HF
Trainer's ``bf16=True``, Lightning's ``bf16-mixed`` and plain AMP train), bfloat16 weights with no
autocast, and (``--precisions fp32,...``) float32 with no autocast.

One step = forward with the language-model loss, backward, fused AdamW step, gradients to None.
Per setup: the median and fastest step over ``--steps`` steps after ``--warmup``, tokens/s from
the median, and peak GPU memory over the timed steps. The issue's targets: HHST under autocast
within 5% of its bfloat16-weights step, and faster than dense under autocast. A second table
times one S2 layer's attention alone (forward+backward, ``do_bench`` median) at the same shape,
float32 against bfloat16 inputs and float32 inputs under autocast, with SDPA for scale.

    python benchmarks/bench_autocast.py                       # the table, on the GPU
    python benchmarks/bench_autocast.py --steps 40 --precisions autocast,bf16,fp32
    python benchmarks/bench_autocast.py --smoke               # CPU: a tiny model, 2 steps

Writes markdown and JSON with the device, versions and date to benchmarks/results/.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
import torch.nn.functional as F
from run_info import (
    cell,
    environment,
    heading,
    median_ms,
    parser,
    result_stem,
    start,
    table,
    write_results,
)
from shapes import SMOKE_MODEL

import s2attn

GIB = 2**30
MODEL = dict(
    hidden_size=512,
    intermediate_size=1376,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
    vocab_size=256,
)
PRECISIONS = {
    "autocast": "float32 weights + autocast(bf16)",
    "bf16": "bfloat16 weights, no autocast",
    "fp32": "float32 weights, no autocast",
}
ATTENTIONS = {"dense": "dense SDPA", "hhst": "HHST (s2attn)"}


def build(attention: str, precision: str, args, shape: dict, device: str):
    import transformers

    from s2attn.integrations import transformers as s2hf

    config = transformers.LlamaConfig(
        **shape,
        max_position_embeddings=args.seq,
        bos_token_id=0,
        eos_token_id=None,
        pad_token_id=None,
        attn_implementation="sdpa",
    )
    if attention == "hhst":
        s2hf.configure(
            config,
            block_size=args.block_size,
            local_blocks=args.local_blocks,
            vert_stride=args.vert_stride,
            dense_layers=args.dense_layers,
        )
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(config)
    if precision == "bf16":
        model = model.to(torch.bfloat16)
    # Fused AdamW is CUDA-only; the smoke run takes the default implementation.
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device == "cuda" or None)
    return model.train(), opt


def sync(device: str) -> float:
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()


def measure(attention: str, precision: str, args, shape: dict, device: str) -> dict:
    model, opt = build(attention, precision, args, shape, device)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, shape["vocab_size"], (args.batch, args.seq), generator=gen).to(device)
    autocast = precision == "autocast"

    def step() -> torch.Tensor:
        with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    for _ in range(args.warmup):
        step()
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(args.steps):
        t0 = sync(device)
        loss = step()
        times.append((sync(device) - t0) * 1e3)
    loss = float(loss)
    if not torch.isfinite(torch.tensor(loss)):
        raise RuntimeError(f"{attention} / {precision}: loss {loss} is not finite")
    ms = statistics.median(times)
    row = dict(
        attention=attention,
        precision=precision,
        step_ms=ms,
        min_ms=min(times),
        tokens_per_s=args.batch * args.seq / ms * 1e3,
        loss=loss,
        peak_gib=torch.cuda.max_memory_allocated() / GIB if device == "cuda" else None,
    )
    print(
        f"  {ATTENTIONS[attention]:15s} {PRECISIONS[precision]:34s} {ms:9.1f} ms/step "
        f"(min {min(times):.1f})  loss {loss:.3f}",
        flush=True,
    )
    return row


# --------------------------------------------------------------------------- attention alone
def attention_rows(args, shape: dict, device: str) -> list[dict]:
    """One S2 layer's attention forward+backward at the model's shape, and SDPA's, per input
    precision: what the step's attention costs each way."""
    heads, kv_heads, dim = (
        shape[k] for k in ("num_attention_heads", "num_key_value_heads", "head_dim")
    )
    pattern = s2attn.local_stride_pattern(
        heads,
        max_seq_len=args.seq,
        block_size=args.block_size,
        local_blocks=args.local_blocks,
        vert_stride=args.vert_stride,
        num_kv_heads=kv_heads,
    )
    gen = torch.Generator().manual_seed(2)
    shapes = [(args.batch, args.seq, h, dim) for h in (heads, kv_heads, kv_heads)]
    base = [torch.randn(s, generator=gen).to(device) for s in shapes]

    def s2(q, k, v):
        return s2attn.sparse_attention(q, k, v, pattern)

    def sdpa(q, k, v):
        # KV heads repeated by hand, as transformers does: not every SDPA backend takes
        # enable_gqa, and float32 would then fall back to the math kernel's full score matrix.
        group = heads // kv_heads
        k, v = (t.repeat_interleave(group, dim=2).transpose(1, 2) for t in (k, v))
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, is_causal=True)
        return out.transpose(1, 2)

    rows = []
    for provider, fn in (("s2attn", s2), ("sdpa", sdpa)):
        for precision in ("fp32", "bf16", "autocast"):
            dtype = torch.bfloat16 if precision == "bf16" else torch.float32
            q, k, v = (t.to(dtype).requires_grad_() for t in base)
            grad = torch.randn_like(base[0]).to(torch.bfloat16 if precision != "fp32" else dtype)

            def run():
                with torch.autocast(device, dtype=torch.bfloat16, enabled=precision == "autocast"):
                    out = fn(q, k, v)
                out.backward(grad)

            ms = time_ms(run, device, grad_to_none=[q, k, v])
            rows.append(dict(provider=provider, precision=precision, ms=ms))
            label = input_label(precision)
            print(f"  attention {provider:7s} {label:34s} {ms:8.2f} ms", flush=True)
    return rows


def input_label(precision: str) -> str:
    return PRECISIONS[precision].replace("weights", "inputs")


def time_ms(fn, device: str, grad_to_none) -> float:
    if device == "cuda":
        return median_ms(fn, grad_to_none=grad_to_none)
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


# ------------------------------------------------------------------------------------ output
def markdown(rows: list[dict], attn_rows: list[dict], env: dict, args, shape: dict) -> str:
    lines = heading(
        "Mixed-precision training step",
        env,
        f"Llama, {shape['num_hidden_layers']} layers, hidden {shape['hidden_size']}, "
        f"{shape['num_attention_heads']} query / {shape['num_key_value_heads']} KV heads of "
        f"{shape['head_dim']}, MLP {shape['intermediate_size']}, vocabulary "
        f"{shape['vocab_size']}; batch {args.batch} x {args.seq} tokens. HHST: layers "
        f"{args.dense_layers} dense, the rest S2 (block {args.block_size}, local "
        f"{args.local_blocks} blocks, vertical stride {args.vert_stride}), all through s2attn. "
        f"Step = forward + loss, backward, AdamW (fused on CUDA); median (and fastest) of "
        f"{args.steps} steps after {args.warmup} warm-up steps.",
    )
    by = {(r["attention"], r["precision"]): r for r in rows}
    cells = []
    for precision in args.precisions:
        dense, hhst = by.get(("dense", precision)), by.get(("hhst", precision))
        cells.append(
            [
                PRECISIONS[precision],
                *(cell(r and r["step_ms"], "{:.1f}") for r in (dense, hhst)),
                cell(dense and hhst and dense["step_ms"] / hhst["step_ms"], "{:.2f}x"),
                *(cell(r and r["peak_gib"], "{:.2f}") for r in (dense, hhst)),
                *(cell(r and r["tokens_per_s"], "{:,.0f}") for r in (dense, hhst)),
            ]
        )
    lines += table(
        [
            "setup",
            "dense SDPA step ms",
            "HHST step ms",
            "HHST speed-up",
            "dense peak GiB",
            "HHST peak GiB",
            "dense tokens/s",
            "HHST tokens/s",
        ],
        cells,
    )
    checks = []
    auto, bf16 = by.get(("hhst", "autocast")), by.get(("hhst", "bf16"))
    if auto and bf16:
        ratio = auto["step_ms"] / bf16["step_ms"]
        checks.append(
            f"- HHST under autocast / HHST with bf16 weights: {ratio:.3f} "
            f"(target <= 1.05: {'met' if ratio <= 1.05 else 'NOT met'})"
        )
    dense_auto, dense_bf16 = by.get(("dense", "autocast")), by.get(("dense", "bf16"))
    if dense_auto and dense_bf16:
        # What autocast itself costs outside attention (weight casts, float32 gradients and
        # optimizer state, a float32 residual stream): the floor for the ratio above.
        checks.append(
            f"- dense under autocast / dense with bf16 weights: "
            f"{dense_auto['step_ms'] / dense_bf16['step_ms']:.3f} (autocast's own cost)"
        )
    if auto and dense_auto:
        ratio = dense_auto["step_ms"] / auto["step_ms"]
        checks.append(
            f"- dense / HHST, both under autocast: {ratio:.2f}x "
            f"(target > 1: {'met' if ratio > 1 else 'NOT met'})"
        )
    if checks:
        lines += ["", *checks]
    if attn_rows:
        lines += ["", "One layer's attention alone, forward+backward (ms, `do_bench` median):", ""]
        arow = {(r["provider"], r["precision"]): r["ms"] for r in attn_rows}
        lines += table(
            ["inputs", "s2attn (S2 pattern)", "SDPA (dense causal)"],
            [
                [
                    input_label(p),
                    cell(arow.get(("s2attn", p)), "{:.2f}"),
                    cell(arow.get(("sdpa", p)), "{:.2f}"),
                ]
                for p in ("fp32", "bf16", "autocast")
            ],
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = parser(__doc__)
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny model: checks the script")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--local-blocks", type=int, default=4)
    ap.add_argument("--vert-stride", type=int, default=8)
    ap.add_argument("--dense-layers", default="0,4", help="indices of the HHST dense layers")
    ap.add_argument("--precisions", default="autocast,bf16", help=f"of {', '.join(PRECISIONS)}")
    ap.add_argument("--attentions", default="dense,hhst")
    ap.add_argument("--no-attention-table", action="store_true")
    args = ap.parse_args()
    args.precisions = args.precisions.split(",")
    args.dense_layers = [int(i) for i in args.dense_layers.split(",") if i]
    if any(p not in PRECISIONS for p in args.precisions):
        ap.error(f"--precisions takes {', '.join(PRECISIONS)}, got {args.precisions}")
    attentions = args.attentions.split(",")
    if any(a not in ATTENTIONS for a in attentions):
        ap.error(f"--attentions takes {', '.join(ATTENTIONS)}, got {attentions}")
    if args.smoke:
        device, shape = "cpu", SMOKE_MODEL
        args.batch, args.seq, args.steps, args.warmup = 2, 128, 2, 1
        args.block_size, args.local_blocks, args.vert_stride = 16, 2, 4
        args.dense_layers = [0]
        args.tag = args.tag or "_smoke"
        env = environment()
    else:
        device, shape = "cuda", MODEL
        env = start("training steps")
        if env is None:
            return 2
    rows = []
    for precision in args.precisions:
        for attention in attentions:
            rows.append(measure(attention, precision, args, shape, device))
            if device == "cuda":  # the last model is gone: start the next from a clean pool
                torch.cuda.empty_cache()
    attn_rows = [] if args.no_attention_table else attention_rows(args, shape, device)
    settings = {k: v for k, v in vars(args).items() if k != "out_dir"}
    write_results(
        args.out_dir,
        result_stem(env, f"autocast{args.tag}"),
        markdown(rows, attn_rows, env, args, shape),
        dict(env=env, model=shape, settings=settings, rows=rows, attention_rows=attn_rows),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
