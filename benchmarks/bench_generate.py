"""End-to-end ``generate``: tokens/s and peak memory of a ~1B-parameter Llama-style model, HHST
through s2attn with the evicting S2Cache against dense SDPA with transformers' DynamicCache.

Model: random weights (nothing is downloaded), hidden 2048, 16 layers, 32 query / 8 KV heads of
dim 64, MLP 8192, vocabulary 32000, bf16 (~1.1B parameters). HHST: ``--dense-layers`` dense
layers spread through the stack (as ``s2attn.integrations.transformers.configure`` places them),
the rest S2 (block 64, local_blocks 16, vertical stride 16 and 64). Greedy decoding
of ``--new`` tokens after a ``--prompt``-token prompt, ``--batch`` sequences.

With ``--compiled`` also static caches, whose decode step ``generate`` compiles
(``mode="reduce-overhead"``, CUDA graphs): transformers' StaticCache for dense, and
``S2Cache(static=True)`` for HHST (its decode step one s2attn operator of device work).

Per configuration: prefill time (``generate`` of one token), total time of the whole generation,
decode tokens/s = batch * (new - 1) / (total - prefill), end-to-end tokens/s = batch * new / total,
peak GPU memory above the weights during ``generate``, and the KV cache's bytes at the end (the
S2Cache's live pages; the DynamicCache's tensors).

    python benchmarks/bench_generate.py
    python benchmarks/bench_generate.py --prompt 16384 --batch 8 --strides 64

Writes markdown and JSON with the device, versions and date to benchmarks/results/.
"""

from __future__ import annotations

import sys
import time

import torch
from run_info import heading, parser, result_stem, start, table, write_results

DEVICE = "cuda"
DTYPE = torch.bfloat16
GIB = 2**30
MODEL = dict(
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=32000,
    rope_theta=500000.0,
)


def build_model(max_len: int, shape: dict = MODEL):
    """The Llama of ``shape`` with random weights (seed 0), bf16, in eval mode, on the GPU."""
    import transformers

    config = transformers.LlamaConfig(
        **shape,
        max_position_embeddings=max_len,
        bos_token_id=1,
        eos_token_id=None,
        pad_token_id=0,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = transformers.LlamaForCausalLM(config).to(DTYPE).eval()
    return model


def sync_time() -> float:
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()


def kv_bytes(cache) -> int:
    from s2attn.integrations.transformers import S2Cache

    if isinstance(cache, S2Cache):
        return cache.memory_report().get("live_bytes", 0)
    return sum(
        layer.keys.numel() * layer.keys.element_size() * 2
        for layer in cache.layers
        if getattr(layer, "keys", None) is not None
    )


def generate(model, ids, new_tokens: int, make_cache):
    cache = make_cache()
    if cache is None:  # transformers' own static cache: generate builds it, and compiles
        kwargs = dict(cache_implementation="static")
    else:
        kwargs = dict(past_key_values=cache)
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            return_dict_in_generate=True,
            **kwargs,
        )
    return out.sequences, out.past_key_values


def measure(name: str, model, ids, new_tokens: int, make_cache) -> dict:
    batch = ids.shape[0]
    print(f"  {name}: warm-up", flush=True)
    generate(model, ids[:, :1024], 4, make_cache)  # compiles the kernels
    print(f"  {name}: prefill", flush=True)
    t0 = sync_time()
    generate(model, ids, 1, make_cache)
    prefill_s = sync_time() - t0
    print(f"  {name}: prefill {prefill_s:.3f} s; generating {new_tokens} tokens", flush=True)
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    t0 = sync_time()
    tokens, cache = generate(model, ids, new_tokens, make_cache)
    total_s = sync_time() - t0
    peak_gib = (torch.cuda.max_memory_allocated() - base) / GIB if DEVICE == "cuda" else 0.0
    row = dict(
        config=name,
        batch=batch,
        prompt=ids.shape[1],
        new_tokens=new_tokens,
        prefill_s=prefill_s,
        total_s=total_s,
        decode_tok_s=batch * (new_tokens - 1) / max(total_s - prefill_s, 1e-9),
        e2e_tok_s=batch * new_tokens / total_s,
        peak_gib=peak_gib,
        kv_gib=kv_bytes(cache) / GIB,
        generated=tokens.shape[1] - ids.shape[1],
    )
    print(
        f"  {name}: total {total_s:.2f} s, decode {row['decode_tok_s']:.1f} tok/s, "
        f"end-to-end {row['e2e_tok_s']:.1f} tok/s, peak {peak_gib:.2f} GiB, "
        f"KV {row['kv_gib']:.3f} GiB",
        flush=True,
    )
    del cache
    return row


def markdown(rows: list[dict], env: dict, args, params: int) -> str:
    import transformers

    versions = (
        f"{env['date']} · torch {env['torch']} · triton {env['triton']} · transformers "
        f"{transformers.__version__} · s2attn {env['s2attn']}"
    )
    lines = heading(
        "generate benchmark",
        env,
        f"Llama-style, {params / 1e9:.2f}B parameters, random weights, bf16: {MODEL}. Batch "
        f"{args.batch}, prompt {args.prompt}, {args.new} new tokens, greedy. HHST: "
        f"{args.dense_layers} dense layers spread through the stack, the rest S2 (block 64, "
        "local_blocks 16). Peak: GPU "
        "memory above the weights during `generate`. KV: the cache's bytes at the end.",
        versions,
    )
    lines += table(
        [
            "config",
            "prefill s",
            "total s",
            "decode tok/s",
            "end-to-end tok/s",
            "peak GiB",
            "KV GiB",
        ],
        (
            [
                r["config"],
                f"{r['prefill_s']:.3f}",
                f"{r['total_s']:.2f}",
                f"{r['decode_tok_s']:.1f}",
                f"{r['e2e_tok_s']:.1f}",
                f"{r['peak_gib']:.2f}",
                f"{r['kv_gib']:.3f}",
            ]
            for r in rows
        ),
    )
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = parser(__doc__)
    ap.add_argument("--prompt", type=int, default=32768)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--strides", default="16,64")
    ap.add_argument("--dense-layers", type=int, default=2)
    ap.add_argument("--skip-dense", action="store_true", help="only the S2 configurations")
    ap.add_argument(
        "--compiled",
        action="store_true",
        help="also static caches, whose decode step generate compiles (reduce-overhead): "
        "transformers' StaticCache for dense, S2Cache(static=True) for HHST",
    )
    args = ap.parse_args()
    env = start("a GPU model")
    if env is None:
        return 2
    from transformers import DynamicCache

    from s2attn.integrations import transformers as s2hf

    max_len = args.prompt + args.new + 64
    model = build_model(max_len)
    params = sum(p.numel() for p in model.parameters())
    print(f"model: {params / 1e9:.2f}B parameters", flush=True)
    torch.manual_seed(1)
    ids = torch.randint(2, MODEL["vocab_size"], (args.batch, args.prompt), device=DEVICE)

    rows = []
    if not args.skip_dense:
        model.set_attn_implementation("sdpa")
        print("[dense] SDPA + DynamicCache", flush=True)
        rows.append(
            measure("dense SDPA", model, ids, args.new, lambda: DynamicCache(config=model.config))
        )
        if args.compiled:
            print("[dense] SDPA + StaticCache, compiled decode", flush=True)
            rows.append(measure("dense SDPA static+compiled", model, ids, args.new, lambda: None))
    for stride in [int(s) for s in args.strides.split(",")]:
        s2hf.configure(
            model.config,
            block_size=64,
            local_blocks=16,
            vert_stride=stride,
            dense_layers=args.dense_layers,
            max_seq_len=max_len,
        )
        name = f"HHST V{stride}"
        print(f"[{name}] s2attn + S2Cache", flush=True)
        rows.append(measure(name, model, ids, args.new, lambda: s2hf.S2Cache(model.config)))
        if args.compiled:
            # One cache, reset between calls: a compiled graph holds its tensors.
            static = s2hf.S2Cache(model.config, static=True)
            print(f"[{name}] s2attn + S2Cache(static=True), compiled decode", flush=True)
            rows.append(measure(f"{name} static+compiled", model, ids, args.new,
                                lambda: (static.reset(), static)[1]))  # fmt: skip

    stem = result_stem(env, f"generate{args.tag}")
    payload = dict(env=env, model=MODEL, args={k: str(v) for k, v in vars(args).items()}, rows=rows)
    write_results(args.out_dir, stem, markdown(rows, env, args, params), payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
