#!/usr/bin/env bash
# The attention and decode benchmarks of two trees, one right after the other on one GPU, in
# alternating rounds (before, after, before, after, ...), so that a refactor's "behaviour
# unchanged" is measured on the same device and host state:
#
#     git archive C0D98B4 | (mkdir -p before && tar -x -C before)   # here, before the device call
#     OUT=$OUT ROUNDS=2 scripts/bench_before_after.sh before         # on the device
#
# BEFORE: an exported tree of the commit compared against, inside this working tree (untracked
# files travel with it to the device). Each round writes each tree's results to
# $OUT/<round>_<side>/. SEQS / CONTEXTS choose the shapes (default 32k and 128k); s2attn's own
# rows only (no FlexAttention or cuDNN), which is what a refactor can move.
set -euo pipefail
before=$(cd "${1:?usage: scripts/bench_before_after.sh BEFORE_DIR}" && pwd)
after=$PWD
out=${OUT:-$PWD/before_after}
for round in $(seq 1 "${ROUNDS:-2}"); do
    for side in before after; do
        root=$before
        [ "$side" = after ] && root=$after
        dir=$out/${round}_$side
        mkdir -p "$dir"
        (cd "$root" && PYTHONPATH=$root python3 benchmarks/bench_attention.py --providers s2attn \
            --seqs "${SEQS:-32768,131072}" --out-dir "$dir") > "$dir/attention.log" 2>&1
        (cd "$root" && PYTHONPATH=$root python3 benchmarks/bench_decode.py \
            --contexts "${CONTEXTS:-32768,131072}" --out-dir "$dir") > "$dir/decode.log" 2>&1
        echo "round $round $side: done"
    done
done
