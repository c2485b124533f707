"""Attention time and effective TFLOP/s: s2attn against SDPA flash (FlashAttention-2), cuDNN SDPA,
FlexAttention (its Triton kernels) and FA4-Flex (FlexAttention on FlashAttention-4's CuTe
block-sparse kernels, ``kernel_options={"BACKEND": "FLASH"}``) on the same inputs and pattern.

FA4-Flex needs the ``flash-attn-4`` package and its CuTe DSL dependencies; where
``flash_attn.cute`` does not import, its rows say so and the rest runs. Its forward takes 128x64
block masks, its block-sparse backward 128x128 ones.

Effective FLOPs count only what the pattern keeps (4 * dim per kept token pair and head forward,
2.5x that backward); the dense kernels are credited with the FLOPs of causal dense attention, so
their TFLOP/s is their true rate and the ratio columns compare wall-clock time.

    python benchmarks/bench_attention.py                 # the DESIGN.md table, fwd and fwd+bwd
    python benchmarks/bench_attention.py --suite extras  # head dim 64, blocks 16/32, GQA, dense
    python benchmarks/bench_attention.py --seqs 8192 --passes fwd --providers s2attn,flex

Prints a table and writes markdown, JSON and a PNG plot (time against sequence length per
provider) with the device, versions and date to benchmarks/results/.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from types import ModuleType

import torch
from run_info import cell, heading, median_ms, parser, result_stem, start, table, write_results
from shapes import BLOCK, DIM, HEADS, KV_HEADS, LOCAL_BLOCKS

import s2attn
from s2attn.ops.layout import forward_layout

PROVIDERS = ("s2attn", "flash", "cudnn", "flex", "fa4-flex")
SPARSE_PROVIDERS = ("s2attn", "flex", "fa4-flex")  # credited with the kept FLOPs


@dataclass(frozen=True)
class Case:
    name: str
    seq: int
    heads: int = HEADS
    kv_heads: int = HEADS
    dim: int = DIM
    block: int = BLOCK
    local_blocks: int = LOCAL_BLOCKS
    vert_stride: int | None = 16  # None: the all-dense pattern

    def pattern(self, lib: ModuleType = s2attn) -> s2attn.BlockPattern:
        """The case's pattern, built by ``lib`` (another tree's copy of s2attn, in an A/B)."""
        if self.vert_stride is None:
            return lib.dense_pattern(self.heads, max_seq_len=self.seq, block_size=self.block)
        return lib.local_stride_pattern(
            self.heads,
            max_seq_len=self.seq,
            block_size=self.block,
            local_blocks=self.local_blocks,
            vert_stride=self.vert_stride,
            num_kv_heads=self.kv_heads if self.kv_heads != self.heads else None,
        )


def cases(suite: str, seqs: list[int]) -> list[Case]:
    main = [Case(f"V{v}", s, vert_stride=v) for v in (16, 64) for s in seqs]
    extras = (
        [Case("V16 dim64", s, dim=64) for s in seqs if s <= 32768]
        + [
            # Small blocks keep the local window at 1024 tokens.
            Case("V16 block16", s, block=16, local_blocks=64)
            for s in seqs
            if s <= 32768
        ]
        + [Case("V16 block32", s, block=32, local_blocks=32) for s in seqs if s <= 32768]
        + [Case(f"V16 GQA{HEADS}/{KV_HEADS}", s, kv_heads=KV_HEADS) for s in seqs]
        + [Case("dense", s, vert_stride=None) for s in seqs if s <= 32768]
    )
    return {"main": main, "extras": extras, "all": main + extras}[suite]


# ----------------------------------------------------------------------------------- providers
def _sdpa(backend):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backends = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}
    sdp_backend = backends[backend]

    def make(case: Case, q, k, v, pattern):
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
        gqa = case.kv_heads != case.heads

        def run():
            with sdpa_kernel(sdp_backend):
                out = torch.nn.functional.scaled_dot_product_attention(
                    qt, kt, vt, is_causal=True, enable_gqa=gqa
                )
            return out.transpose(1, 2)

        return run

    return make


def _s2attn(case: Case, q, k, v, pattern):
    return lambda: s2attn.sparse_attention(q, k, v, pattern)


def flex_block_mask(
    pattern: s2attn.BlockPattern, seq: int, block_q: int, block_kv: int, device: str = "cuda"
):
    """FlexAttention's BlockMask for the pattern over ``block_q`` x ``block_kv`` tiles, built from
    s2attn's own tile layout (full tiles apart from partial ones) rather than by evaluating a mask
    over seq x seq tokens."""
    from torch.nn.attention.flex_attention import BlockMask

    layout = forward_layout(pattern, block_q, block_kv, device)
    q_tiles, kv_tiles = math.ceil(seq / block_q), math.ceil(seq / block_kv)
    heads, groups = layout.num_heads, layout.num_groups

    def dense_lists(offsets, cols):
        counts = (offsets[1:] - offsets[:-1]).view(heads, groups)[:, :q_tiles]
        indices = torch.zeros(heads * groups, kv_tiles, dtype=torch.int32, device=device)
        row = torch.repeat_interleave(
            torch.arange(heads * groups, device=device), (offsets[1:] - offsets[:-1]).long()
        )
        pos = torch.arange(cols.numel(), device=device) - offsets[:-1].long()[row]
        keep = cols < kv_tiles
        indices[row[keep], pos[keep]] = cols[keep]
        indices = indices.view(heads, groups, kv_tiles)[:, :q_tiles]
        return counts[None].int().contiguous(), indices[None].contiguous()

    token_blocks = pattern.mask.to(device)
    bs = pattern.block_size

    def mask_mod(b, h, q_idx, kv_idx):
        return token_blocks[h, q_idx // bs, kv_idx // bs] & (q_idx >= kv_idx)

    kv_num, kv_idx = dense_lists(layout.partial_offsets, layout.partial_cols)
    full_num, full_idx = dense_lists(layout.full_offsets, layout.full_cols)
    return BlockMask.from_kv_blocks(
        kv_num,
        kv_idx,
        full_num,
        full_idx,
        BLOCK_SIZE=(block_q, block_kv),
        mask_mod=mask_mod,
        seq_lengths=(seq, seq),
    )


def fa4_missing() -> str | None:
    """Why FA4-Flex cannot run here, or None when FlashAttention-4's CuTe kernels import."""
    try:
        import flash_attn.cute  # noqa: F401
    except Exception as exc:  # ImportError, or a CuTe DSL that fails to load
        return f"flash-attn-4 not importable ({type(exc).__name__}: {str(exc)[:60]})"
    return None


_FLEX = None


def _flex(case: Case, q, k, v, pattern, block_q: int, block_kv: int, fa4: bool = False):
    global _FLEX
    from torch.nn.attention.flex_attention import flex_attention

    if _FLEX is None:
        # Every case (shape, block mask, GQA, backward) recompiles; past dynamo's default limit of
        # 8 it would fall back to the unfused eager implementation, which materialises seq x seq
        # scores: slow, or out of memory. Allow every case its own compiled kernel.
        torch._dynamo.config.recompile_limit = 1024
        torch._dynamo.config.accumulated_recompile_limit = 4096
        _FLEX = torch.compile(flex_attention, dynamic=False)
    mask = flex_block_mask(pattern, case.seq, block_q, block_kv)
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    gqa = case.kv_heads != case.heads
    if fa4:
        options = {"BACKEND": "FLASH"}
    else:  # its default forward tile is 128x128; a 64-token block mask needs tiles that divide it
        options = None if block_q == 128 else {"BLOCK_M": block_q, "BLOCK_N": block_kv}
    return lambda: _FLEX(
        qt, kt, vt, block_mask=mask, enable_gqa=gqa, kernel_options=options
    ).transpose(1, 2)


# ---------------------------------------------------------------------------------- measuring
def _bench(make_fn, backward: bool, q, k, v) -> float:
    fn = make_fn()
    if not backward:
        return median_ms(fn)
    grad = torch.randn_like(q)

    def step():
        fn().backward(grad)

    return median_ms(step, grad_to_none=[q, k, v])


def _variants(provider: str, backward: bool, case: Case, q, k, v, pattern):
    """(label, maker) pairs of one provider; the best of them is reported."""
    if provider == "s2attn":
        return [("", lambda: _s2attn(case, q, k, v, pattern))]
    if provider in ("flash", "cudnn"):
        return [("", lambda: _sdpa(provider)(case, q, k, v, pattern))]
    if provider == "fa4-flex":
        if fa4_missing():
            return []
        shape = (128, 128) if backward else (128, 64)
        label = f"block {shape[0]}x{shape[1]}"
        return [(label, lambda: _flex(case, q, k, v, pattern, *shape, fa4=True))]
    # FlexAttention's backward needs 128x128 blocks; its forward may do better at 64.
    return [
        (f"block {b}", lambda b=b: _flex(case, q, k, v, pattern, b, b))
        for b in ((128,) if backward else (128, 64))
    ]


def run_case(case: Case, passes: list[str], providers: list[str]) -> list[dict]:
    torch.manual_seed(0)
    pattern = case.pattern()
    kept = pattern.kept_token_pairs(case.seq)
    dense = case.heads * case.seq * (case.seq + 1) / 2
    rows = []
    for pass_name in passes:
        backward = pass_name == "fwd+bwd"
        q = torch.randn(1, case.seq, case.heads, case.dim, device="cuda", dtype=torch.bfloat16)
        k, v = (
            torch.randn(1, case.seq, case.kv_heads, case.dim, device="cuda", dtype=torch.bfloat16)
            for _ in range(2)
        )
        for t in (q, k, v):
            t.requires_grad_(backward)
        flop_factor = 4 * case.dim * (3.5 if backward else 1.0)
        for provider in providers:
            variants = _variants(provider, backward, case, q, k, v, pattern)
            best, note, peak = math.inf, "" if variants else f"skipped: {fa4_missing()}", None
            for label, make in variants:
                try:
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                    base = torch.cuda.memory_allocated()
                    ms = _bench(make, backward, q, k, v)
                    mem = (torch.cuda.max_memory_allocated() - base) / 2**30
                except Exception as exc:  # a provider that does not run this case is reported
                    note = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:80]}"
                    torch.cuda.empty_cache()
                    continue
                if ms < best:
                    best, note, peak = ms, label, mem
            flops = (kept if provider in SPARSE_PROVIDERS else dense) * flop_factor
            row = dict(
                case=case.name,
                seq=case.seq,
                pass_=pass_name,
                provider=provider,
                ms=best if math.isfinite(best) else None,
                tflops=flops / best / 1e9 if math.isfinite(best) else None,
                density=pattern.density(case.seq),
                peak_extra_gib=peak,
                note=note,
                config=asdict(case),
            )
            rows.append(row)
            ms_txt = f"{best:9.3f} ms" if math.isfinite(best) else "      n/a   "
            tf_txt = f"{row['tflops']:6.0f} TF/s" if row["tflops"] else ""
            print(
                f"  {case.name:<12} {case.seq:>7} {pass_name:<7} {provider:<7} {ms_txt} "
                f"{tf_txt} {note}",
                flush=True,
            )
        del q, k, v
        torch.cuda.empty_cache()
    return rows


# ------------------------------------------------------------------------------------ output
def markdown(rows: list[dict], env: dict) -> str:
    lines = heading(
        "Attention benchmark",
        env,
        "Batch 1, bf16, causal. Medians of `triton.testing.do_bench`. TFLOP/s: effective (the "
        "pattern's kept FLOPs) for s2attn, FlexAttention and FA4-Flex, dense causal FLOPs for "
        "SDPA. "
        "`x peer` = peer time / s2attn time.",
    )
    keyed = {}
    for r in rows:
        keyed.setdefault((r["case"], r["seq"], r["pass_"]), {})[r["provider"]] = r
    cells = []
    for (case, seq, pass_name), by in keyed.items():
        s2 = by.get("s2attn", {})
        ms = s2.get("ms")
        peer_ms = {p: by.get(p, {}).get("ms") for p in ("flash", "cudnn", "flex", "fa4-flex")}
        ratios = [cell(t / ms if t and ms else None, "{:.2f}") for t in peer_ms.values()]
        density = next(iter(by.values()))["density"]
        cells.append(
            [
                case,
                seq,
                f"{density:.4f}",
                pass_name,
                cell(ms),
                cell(s2.get("tflops"), "{:.0f}"),
                *(cell(t) for t in peer_ms.values()),
                *ratios,
                cell(s2.get("peak_extra_gib"), "{:.2f}"),
            ]
        )
    lines += table(
        [
            "case",
            "seq",
            "density",
            "pass",
            "s2attn ms",
            "TFLOP/s",
            "FA2 ms",
            "cuDNN ms",
            "Flex ms",
            "FA4-Flex ms",
            "x FA2",
            "x cuDNN",
            "x Flex",
            "x FA4-Flex",
            "s2attn peak extra GiB",
        ],
        cells,
    )
    notes = [
        f"- {r['case']} {r['seq']} {r['pass_']} {r['provider']}: {r['note']}"
        for r in rows
        if r["note"]
    ]
    if notes:
        lines += ["", "Notes:", *notes]
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path, env: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r["case"], r["pass_"]) for r in rows})
    cols = min(4, len(panels))
    nrows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 3.4 * nrows), squeeze=False)
    for ax, (case, pass_name) in zip(axes.flat, panels):
        for provider in PROVIDERS:
            pts = sorted(
                (r["seq"], r["ms"])
                for r in rows
                if (r["case"], r["pass_"], r["provider"]) == (case, pass_name, provider) and r["ms"]
            )
            if pts:
                ax.plot(*zip(*pts), marker="o", label=provider)
        ax.set(xscale="log", yscale="log", title=f"{case} {pass_name}", xlabel="seq", ylabel="ms")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    # A merged table's date lists every update; the title keeps the first and the last.
    dates = env["date"].split(", updated ")
    when = dates[0] if len(dates) == 1 else f"{dates[0]} to {dates[-1]} ({len(dates) - 1} updates)"
    fig.suptitle(f"{env['device']} · bf16 · batch 1 · {when}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = parser(__doc__)
    ap.add_argument("--suite", choices=("main", "extras", "all"), default="main")
    ap.add_argument("--seqs", default="8192,32768,131072")
    ap.add_argument("--passes", default="fwd,fwd+bwd")
    ap.add_argument("--providers", default=",".join(PROVIDERS))
    ap.add_argument("--cases", default="", help="comma-separated case names to keep (default all)")
    ap.add_argument(
        "--update",
        type=Path,
        default=None,
        help="a results JSON whose rows this run replaces (same case, seq, pass, provider); "
        "the merged table is written under that file's name",
    )
    args = ap.parse_args()
    env = start("GPU kernels")
    if env is None:
        return 2
    seqs = [int(s) for s in args.seqs.split(",")]
    passes = args.passes.split(",")
    providers = args.providers.split(",")
    selected = [
        c for c in cases(args.suite, seqs) if not args.cases or c.name in args.cases.split(",")
    ]
    rows = []
    for i, case in enumerate(selected, 1):
        print(f"[{i}/{len(selected)}] {case}", flush=True)
        rows += run_case(case, passes, providers)
    stem = result_stem(env, f"attention_{args.suite}{args.tag}")
    if args.update is not None:
        old = json.loads(args.update.read_text())
        if old["env"]["device"] != env["device"]:
            raise SystemExit(f"{args.update} was measured on {old['env']['device']}, not here")
        key = lambda r: (r["case"], r["seq"], r["pass_"], r["provider"])
        new_keys = {key(r) for r in rows}
        rows = [r for r in old["rows"] if key(r) not in new_keys] + rows
        env["date"] = f"{old['env']['date']}, updated {env['date']}"
        stem = args.update.stem
    write_results(
        args.out_dir,
        stem,
        markdown(rows, env),
        dict(env=env, rows=rows),
        plot=lambda path: plot(rows, path, env),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
