"""How evenly the forward's work items spread over the programs (dev aid, CPU only): per program
sums of (entries + a per-item cost) on the benchmark patterns, for the former static striding
(program p took items p, p + P, ..., every other full round reversed: the "snake" order), for
programs taking items from a counter in the kernel's order (what the kernels do since NOTES
change 29), and for longest-first taking. Prints max/mean: the slowest program against the
average, what the tail costs.

    python scripts/item_balance.py --programs 132
"""

import argparse
import heapq

import torch

from s2attn import local_stride_pattern
from s2attn.layout import forward_layout

ap = argparse.ArgumentParser()
ap.add_argument("--programs", type=int, default=132, help="persistent programs (SMs)")
ap.add_argument("--per-item", default="0,6", help="per-item costs to try, in entries")
args = ap.parse_args()
P = args.programs


def makespan(costs):
    """Max/mean program load when programs take ``costs`` in order as they finish."""
    heap = [0.0] * P
    for c in costs:
        heapq.heappush(heap, heapq.heappop(heap) + c)
    return max(heap) / (sum(costs) / P)


print(f"{'seq':>7} {'V':>3} {'a':>2} {'items/P':>8} {'static':>7} {'counter':>8} {'longest':>8}")
for seq in (8192, 32768, 131072):
    for stride in (16, 64):
        pattern = local_stride_pattern(32, seq, 64, 16, stride)
        layout = forward_layout(pattern, 128, 64, torch.device("cpu"), gather=True)
        entries = (layout.full_offsets.diff() + layout.partial_offsets.diff()).tolist()
        tiles = layout.num_groups
        items = 32 * tiles
        for a in (float(x) for x in args.per_item.split(",")):
            # Item t: head t // tiles, heaviest (last) tile first.
            costs = [
                a + entries[(t // tiles) * tiles + tiles - 1 - t % tiles] for t in range(items)
            ]
            load = [0.0] * P
            for t in range(items):
                rnd, pid = divmod(t, P)
                flip = rnd % 2 == 1 and (rnd + 1) * P <= items
                load[pid] += costs[rnd * P + (P - 1 - pid) if flip else t]
            static = max(load) / (sum(load) / P)
            longest = makespan(sorted(costs, reverse=True))
            print(
                f"{seq:>7} {stride:>3} {a:>2.0f} {items / P:>8.1f} {static:>7.3f} "
                f"{makespan(costs):>8.3f} {longest:>8.3f}"
            )
