"""What a forward item costs beyond its entries: the forward timed on built patterns whose list
length, item count and masked entries vary independently, and a least-squares fit of the time on
(items, full entries, partial entries). The S2 patterns' own counts cannot separate them: an item
of a causal 128x64 tile carries about two masked entries, so their columns are nearly collinear.

Patterns (batch 1, 32 heads, dim 128, bf16, block 64, forward tiles 128 x 64): both query blocks
of a tile keep the same ``far`` KV blocks spread over what lies before them; ``causal`` rows add
their own block and the one before it (the diagonal: masked entries), ``bidir`` rows do not (every
entry full). Prints each pattern's counts and time, then the fit, and what it predicts for the
local-stride cases of ``bench_attention.py``.

    python benchmarks/tuning/forward_item_costs.py --seqs 16384,32768 --fars 8,16,32,64
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

import s2attn
from s2attn.ops.layout import forward_layout

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for run_info
from run_info import median_ms
from shapes import BLOCK, DIM, HEADS, LOCAL_BLOCKS

TILE_M, TILE_N = 128, 64


def built_pattern(seq: int, far: int, causal: bool) -> s2attn.BlockPattern:
    """Tile t (query blocks 2t, 2t+1) keeps ``far`` blocks spread evenly over the blocks before
    2t - 1 (all of them where there are fewer); causal rows also keep blocks 2t - 1 .. own."""
    nb = seq // BLOCK
    rows = []
    for i in range(nb):
        t = i // 2
        before = max(0, 2 * t - 1) if causal else nb
        n = min(far, before)
        picks = sorted({(j * before) // n for j in range(n)}) if n else []
        if causal:
            picks = sorted(set(picks) | {b for b in (2 * t - 1, 2 * t, i) if 0 <= b <= i})
        rows.append(picks)
    counts = torch.tensor([len(r) for r in rows] * HEADS)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)])
    cols = torch.tensor([c for _ in range(HEADS) for r in rows for c in r])
    return s2attn.BlockPattern.from_block_lists(
        offsets, cols, num_heads=HEADS, num_kv_blocks=nb, block_size=BLOCK, causal=causal
    )


def counts(pattern: s2attn.BlockPattern) -> list[int]:
    layout = forward_layout(pattern, TILE_M, TILE_N)
    return [layout.num_heads * layout.num_groups, layout.full_cols.numel(),
            layout.partial_cols.numel()]  # fmt: skip


def forward_ms(pattern: s2attn.BlockPattern, seq: int) -> float:
    q, k, v = (
        torch.randn(1, seq, HEADS, DIM, device="cuda", dtype=torch.bfloat16) for _ in range(3)
    )
    with torch.no_grad():
        return median_ms(lambda: s2attn.sparse_attention(q, k, v, pattern))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", default="16384,32768")
    ap.add_argument("--fars", default="8,16,32,64")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: this times the forward")
        return 2
    print(torch.cuda.get_device_name())
    rows, times = [], []
    print("| pattern | seq | far | items | full | partial | ms |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for seq in map(int, args.seqs.split(",")):
        for far in map(int, args.fars.split(",")):
            for causal in (False, True):
                p = built_pattern(seq, far, causal)
                c = counts(p)
                t = forward_ms(p, seq)
                rows.append(c)
                times.append(t)
                name = "causal" if causal else "bidir"
                cells = f"{name} | {seq} | {far} | {c[0]} | {c[1]} | {c[2]} | {t:.4f}"
                print(f"| {cells} |", flush=True)
    a = torch.tensor(rows, dtype=torch.float64)
    y = torch.tensor(times, dtype=torch.float64)
    fit = torch.linalg.lstsq(a, y[:, None]).solution.flatten()
    worst = ((a @ fit - y).abs() / y).max().item()
    per_item, per_full, per_partial = (fit * 1e6).tolist()  # ns of the whole GPU's time
    print(
        f"fit (ns of GPU time each): item {per_item:.2f}, full entry {per_full:.3f}, partial "
        f"entry {per_partial:.3f}; worst misfit {worst:.1%}. An item costs "
        f"{per_item / per_full:.1f} full entries, a partial entry {per_partial / per_full:.2f}."
    )
    print("| S2 case | items | full | partial | predicted ms | item share | partial share |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for seq in (8192, 32768, 131072):
        for stride in (16, 64):
            c = counts(
                s2attn.local_stride_pattern(
                    HEADS,
                    max_seq_len=seq,
                    block_size=BLOCK,
                    local_blocks=LOCAL_BLOCKS,
                    vert_stride=stride,
                )
            )
            ms = c[0] * fit[0] + c[1] * fit[1] + c[2] * fit[2]
            print(
                f"| {seq} V{stride} | {c[0]} | {c[1]} | {c[2]} | {ms:.3f} | "
                f"{c[0] * fit[0] / ms:.0%} | {c[2] * fit[2] / ms:.0%} |"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
