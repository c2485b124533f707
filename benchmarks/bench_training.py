"""End-to-end training speed: full steps of a ~1B Llama-shaped model, dense against HHST.

Model (random weights, nothing downloaded): 16 layers, hidden 2048, 16 query / 4 KV heads of dim
128, MLP 8192, vocabulary 32000 (~1.2B parameters), batch 1, gradient checkpointing on every
layer for every variant, fused AdamW. One step = forward, backward and optimizer step on one
sequence of ``--seqs`` tokens.

Variants: dense SDPA with its FlashAttention-2 backend and with cuDNN; HHST through s2attn
(``hhst-V64``: the first ``--dense-layers`` layers dense, the rest S2 with block 64, local
16 blocks, vertical stride 64; ``hhst1-V64``: one dense layer); and the *floor*, where every
attention is replaced by an elementwise op on q and v: the time of everything but attention,
which no attention speed-up can pass. From it, each step splits into attention (step - floor)
and the rest (floor), and the ceiling on HHST's speed-up over dense is dense step / floor step.

    python benchmarks/bench_training.py                          # 8k, 32k, 128k on the GPU
    python benchmarks/bench_training.py --seqs 8192 --steps 3    # one length
    python benchmarks/bench_training.py --smoke                  # CPU: a tiny model, 2 steps

``--preset NAME`` times one of ``s2attn train``'s presets instead (its shape, S2 settings and
dense-layer placement; float32 weights under bf16 autocast, as ``s2attn train`` runs them) with
the variants ``dense``, ``hhst``, ``local``, ``s2``, the ``floor`` and ``hhst-floor``: HHST whose
S2 layers are the floor's elementwise op and whose dense layers attend, so that
1 - hhst-floor / hhst is the S2 layers' share of the HHST step::

    python benchmarks/bench_training.py --preset small --seqs 32768 131072 \
        --variants dense hhst hhst-floor floor hhst+compile hhst-floor+compile floor+compile

A preset variant ending in ``-V<N>`` has its S2 layers at vertical stride N (``hhst-V32``,
``hhst-floor-V32+compile``), so one table weighs the preset's stride against sparser ones; one
ending in ``-L<N>`` (before or after it) has their local window at N blocks
(``hhst-floor-L8-V64+compile``).

Writes markdown and JSON with the device, versions and date to benchmarks/results/.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import statistics
import sys
import time
from pathlib import Path

import shapes
import torch
from run_info import environment, result_stem, versions_line

RESULTS = Path(__file__).resolve().parent / "results"
GIB = 2**30
MODEL = dict(
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=16,
    num_key_value_heads=4,
    head_dim=128,
    vocab_size=32000,
    rope_theta=500000.0,
)
# The shape the compile measurement asks for: 8 layers, hidden 1024.
SMALL_MODEL = dict(
    hidden_size=1024,
    intermediate_size=4096,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=128,
    vocab_size=32000,
    rope_theta=500000.0,
)
SMOKE_MODEL = dict(shapes.SMOKE_MODEL, rope_theta=10000.0)
FLOOR_IMPLEMENTATION = "bench_attention_floor"
S2_FLOOR_IMPLEMENTATION = "bench_s2_layers_floor"
PRESET_VARIANTS = ("dense", "hhst", "local", "s2", "floor", "hhst-floor")


def floor_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kw):
    """No attention at all: q plus v (repeated over the GQA group), elementwise. Keeps the q and v
    projections in the graph; k's projection gets no gradient (a few % of a layer's matmuls)."""
    groups = query.shape[1] // value.shape[1]
    out = query + value.repeat_interleave(groups, dim=1)
    return out.transpose(1, 2), None


def s2_layers_floor(module, query, key, value, attention_mask, **kwargs):
    """The floor in the S2 layers, s2attn's attention in the dense ones."""
    from s2attn.integrations import transformers as s2hf

    if s2hf.layer_pattern(module.config, module.layer_idx) is None:
        return s2hf.attention_forward(module, query, key, value, attention_mask, **kwargs)
    return floor_attention(module, query, key, value, attention_mask, **kwargs)


def split_s2(variant: str) -> tuple[str, dict[str, int]]:
    """A preset variant's name and the S2 settings its suffixes ask for (the preset's where
    absent): ``-L<N>`` the local window in blocks, ``-V<N>`` the vertical stride;
    ``hhst-floor-L8-V64`` -> ``("hhst-floor", {"vert_stride": 64, "local_blocks": 8})``."""
    changes: dict[str, int] = {}
    while match := re.fullmatch(r"(.+)-([LV])(\d+)", variant):
        key = {"L": "local_blocks", "V": "vert_stride"}[match[2]]
        if key in changes:  # given twice: left in the name, which then matches no variant
            break
        changes[key], variant = int(match[3]), match[1]
    return variant, changes


def build_preset(variant: str, seq: int, args, device: str):
    """``variant`` of preset ``args.preset`` at ``seq`` tokens, float32 weights."""
    import transformers

    from s2attn.training import presets

    transformers.AttentionInterface.register(FLOOR_IMPLEMENTATION, floor_attention)
    transformers.AttentionInterface.register(S2_FLOOR_IMPLEMENTATION, s2_layers_floor)
    variant, changes = split_s2(variant)
    s2 = dataclasses.replace(presets.PRESETS[args.preset].s2, **changes)
    base = {"floor": "dense", "hhst-floor": "hhst"}.get(variant, variant)
    config = presets.model_config(args.preset, base, seq_len=seq, s2=s2)
    if variant == "floor":
        config._attn_implementation = FLOOR_IMPLEMENTATION
    elif variant == "hhst-floor":
        config._attn_implementation = S2_FLOOR_IMPLEMENTATION
    with torch.device(device):
        return presets.build_model(config, seed=0)


def build(variant: str, seq: int, args, device: str, dtype: torch.dtype):
    """The model of ``variant``; a ``+compile`` suffix compiles it with ``torch.compile``."""
    import transformers

    variant, compiled = variant.removesuffix("+compile"), variant.endswith("+compile")
    if args.preset:
        return _ready(build_preset(variant, seq, args, device), args, compiled)

    from s2attn.integrations import transformers as s2hf
    from s2attn.stack import S2Settings

    transformers.AttentionInterface.register(FLOOR_IMPLEMENTATION, floor_attention)
    shape = model_shape(args)
    impl = {"floor": FLOOR_IMPLEMENTATION}.get(variant, "sdpa")
    config = transformers.LlamaConfig(
        **shape,
        max_position_embeddings=seq,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        attn_implementation=impl,
    )
    if variant.startswith("hhst"):
        # hhst-V64: --dense-layers dense layers, stride 64; hhst1-V64: one dense layer.
        count, stride = variant[len("hhst") :].split("-V")
        dense_layers = int(count) if count else args.dense_layers
        block, local = (16, 2) if args.smoke else (64, 16)
        settings = S2Settings(
            block_size=block,
            local_blocks=local,
            vert_stride=int(stride),
            dense_layers=tuple(range(dense_layers)),
        )
        s2hf.configure(config, settings, max_seq_len=seq)
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(config).to(dtype)
    return _ready(model, args, compiled)


def _ready(model, args, compiled: bool):
    if args.checkpointing:
        model.gradient_checkpointing_enable()
    model.config.use_cache = False
    model.train()
    if compiled:
        model.compile()  # in place; the warm-up steps pay the compilation
    return model


def sdpa_backend(variant: str):
    from contextlib import nullcontext

    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {
        "dense-flash": SDPBackend.FLASH_ATTENTION,
        "dense-cudnn": SDPBackend.CUDNN_ATTENTION,
    }.get(variant.removesuffix("+compile"))
    return nullcontext() if backend is None else sdpa_kernel(backend)


def measure(variant: str, seq: int, args, device: str) -> dict:
    dtype = torch.float32 if args.smoke else torch.bfloat16
    # Each variant compiles from nothing: one process runs many, and past dynamo's recompile
    # limit (8 per frame) a later variant would run eagerly under a +compile name.
    torch._dynamo.reset()
    model = build(variant, seq, args, device, dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device == "cuda")
    ids = torch.randint(0, model.config.vocab_size, (1, seq), device=device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    autocast = torch.bfloat16 if args.preset and device == "cuda" else None

    def step():
        with sdpa_backend(variant):
            with torch.autocast(device, dtype=autocast, enabled=autocast is not None):
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    times = []
    try:
        for _ in range(args.warmup):
            step()
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        for _ in range(args.steps):
            sync()
            t0 = time.perf_counter()
            step()
            sync()
            times.append(time.perf_counter() - t0)
    except RuntimeError as exc:  # out of memory, or a backend this build lacks
        first = str(exc).splitlines()[0][:100]
        print(f"  {variant} at {seq}: failed ({first})", file=sys.stderr)
        return dict(variant=variant, seq=seq, error=first)
    finally:
        peak = torch.cuda.max_memory_allocated() / GIB if device == "cuda" else 0.0
        model.to("meta")  # frees the weights, gradients and optimizer state for the next variant
        opt.state.clear()
        if device == "cuda":
            torch.cuda.empty_cache()
    step_s = statistics.median(times)
    return dict(
        variant=variant,
        seq=seq,
        step_s=step_s,
        steps=times,
        tokens_per_s=seq / step_s,
        peak_gib=peak,
    )


def model_shape(args) -> dict:
    return SMOKE_MODEL if args.smoke else SMALL_MODEL if args.model == "small" else MODEL


def preset_line(args) -> str:
    from s2attn.training import presets

    p = presets.PRESETS[args.preset]
    s2 = p.s2
    return (
        f"Preset `{args.preset}`: {p.num_layers} layers, hidden {p.hidden_size}, "
        f"{p.num_heads}/{p.num_kv_heads} heads of {p.hidden_size // p.num_heads}, MLP "
        f"{p.intermediate_size}, vocab {p.vocab_size}; HHST: dense layers "
        f"{','.join(map(str, s2.dense_layers))}, S2 block {s2.block_size}, local "
        f"{s2.local_blocks} blocks, stride {s2.vert_stride} (a variant's `-L<N>` sets the local "
        "window to N blocks, `-V<N>` the stride to N). Float32 weights under bf16 autocast "
        "(as `s2attn train`), batch 1, "
        + ("gradient checkpointing, " if args.checkpointing else "")
        + "fused AdamW; `+compile`: `model.compile()`, its compilation in the warm-up steps; "
        "floor: every attention an elementwise op on q and v; hhst-floor: the S2 layers so, the "
        f"dense ones attending. Median of {args.steps} steps after {args.warmup} warm-up. "
        "attention = step - floor (of the same compilation); S2 layers' share = 1 - hhst-floor "
        "/ hhst."
    )


def markdown(rows: list[dict], env: dict, args) -> str:
    shape = model_shape(args)
    lines = [
        "# Training step: dense against HHST"
        + ("" if args.model == "small" else ", 1.2B Llama shape"),
        "",
        f"{env['device']} · {versions_line(env)}",
        "",
        f"{shape['num_hidden_layers']} layers, hidden {shape['hidden_size']}, "
        f"{shape['num_attention_heads']}/{shape['num_key_value_heads']} heads of "
        f"{shape['head_dim']}, MLP {shape['intermediate_size']}, vocab {shape['vocab_size']}, bf16 "
        "weights, batch 1, "
        + ("gradient checkpointing, " if args.checkpointing else "")
        + "fused AdamW; `+compile`: `model.compile()`, its compilation in the warm-up steps; "
        f"HHST: first {args.dense_layers} layers dense (hhst1: one), S2 "
        "block 64, local 16 blocks. Median of "
        f"{args.steps} steps after {args.warmup} warm-up. attention = step - floor.",
        "",
        "| seq | variant | step (s) | tokens/s | vs best dense | attention (s) | rest (s) | "
        "peak GiB |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    if args.preset:
        lines[0] = f"# Training step: dense against HHST, preset `{args.preset}`"
        lines[4] = preset_line(args)
    for seq in sorted({r["seq"] for r in rows}):
        at = [r for r in rows if r["seq"] == seq and "step_s" in r]
        times = {r["variant"]: r["step_s"] for r in at}
        dense = min((r["step_s"] for r in at if r["variant"].startswith("dense")), default=None)
        for r in at:
            # The floor of the same compilation: a compiled step against a compiled floor.
            floor = times.get("floor" + ("+compile" if r["variant"].endswith("+compile") else ""))
            speed = f"{dense / r['step_s']:.2f}x" if dense else "—"
            attn = f"{r['step_s'] - floor:.3f}" if floor is not None else "—"
            rest = f"{floor:.3f}" if floor is not None else "—"
            lines.append(
                f"| {seq // 1024}k | {r['variant']} | {r['step_s']:.3f} | "
                f"{r['tokens_per_s']:,.0f} | {speed} | {attn} | {rest} | "
                f"{r['peak_gib']:.1f} |"
            )
        floor = times.get("floor")
        if floor and dense:
            lines.append(
                f"| {seq // 1024}k | ceiling (dense / floor) | | | {dense / floor:.2f}x | | | |"
            )
        for name, hhst in times.items():
            # Each HHST row beside its twin with the S2 layers left out (same stride, same
            # compilation): hhst-V32+compile against hhst-floor-V32+compile.
            if not name.startswith("hhst") or "floor" in name:
                continue
            s2_floor = times.get("hhst-floor" + name.removeprefix("hhst"))
            if s2_floor:
                lines.append(
                    f"| {seq // 1024}k | S2 layers' share of {name} | "
                    f"{hhst - s2_floor:.3f} | | {1 - s2_floor / hhst:.1%} | | | |"
                )
    for r in rows:
        if "error" in r:
            lines.append(f"\n{r['variant']} at {r['seq']}: {r['error']}")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", type=int, nargs="+", default=[8192, 32768, 131072])
    ap.add_argument(
        "--variants",
        nargs="+",
        default=None,
        help="default: dense-flash dense-cudnn hhst-V64 hhst-V16 floor; with --preset: dense "
        "hhst hhst-floor floor",
    )
    ap.add_argument("--dense-layers", type=int, default=2)
    ap.add_argument(
        "--preset",
        default=None,
        help="time an `s2attn train` preset (its shape and S2 settings) with variants of "
        f"{', '.join(PRESET_VARIANTS)} (each may end in -L<blocks>, the S2 layers' local "
        "window, -V<stride>, their vertical stride, and +compile)",
    )
    ap.add_argument(
        "--model", choices=["1b", "small"], default="1b", help="small: 8 layers, hidden 1024"
    )
    ap.add_argument(
        "--no-checkpointing",
        dest="checkpointing",
        action="store_false",
        help="no gradient checkpointing (short sequences, small models)",
    )
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny model: checks the script")
    ap.add_argument("--out-dir", type=Path, default=RESULTS)
    ap.add_argument("--name", default="training")
    args = ap.parse_args()
    device = "cpu" if args.smoke else "cuda"
    if args.variants is None:
        args.variants = (
            ["dense", "hhst", "hhst-floor", "floor"]
            if args.preset
            else ["dense-flash", "dense-cudnn", "hhst-V64", "hhst-V16", "floor"]
        )
    if args.preset:
        from s2attn.training import presets

        if args.preset not in presets.PRESETS:
            ap.error(f"--preset: choose one of {', '.join(presets.PRESETS)}")
        for v in args.variants:
            name, changes = split_s2(v.removesuffix("+compile"))
            if name not in PRESET_VARIANTS or 0 in changes.values():
                ap.error(
                    f"--variants with --preset: {v!r} is not one of {PRESET_VARIANTS}, each "
                    "optionally with -L<blocks> (the S2 layers' local window), -V<stride> (their "
                    "vertical stride) and +compile"
                )
    if args.smoke:
        args.seqs, args.steps, args.warmup = [256], 2, 1
        if not args.preset:
            args.variants = ["dense", "hhst-V4", "hhst-V4+compile", "floor"]
    env = environment()
    rows = []
    for seq in args.seqs:
        for variant in args.variants:
            row = measure(variant, seq, args, device)
            rows.append(row)
            if "step_s" in row:
                print(
                    f"{seq:>7} {variant:<12} {row['step_s'] * 1e3:9.1f} ms "
                    f"{row['tokens_per_s']:10,.0f} tok/s  peak {row['peak_gib']:.1f} GiB",
                    flush=True,
                )
    text = markdown(rows, env, args)
    print(text)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = result_stem(env, args.name)
    (args.out_dir / f"{stem}.md").write_text(text)
    (args.out_dir / f"{stem}.json").write_text(
        json.dumps(
            dict(
                environment=env,
                model=model_shape(args),
                preset=args.preset,
                dense_layers=args.dense_layers,
                rows=rows,
            ),
            indent=1,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
