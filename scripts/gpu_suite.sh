#!/usr/bin/env bash
# The test suite on every visible GPU at once: the test files dealt out by size, one `pytest -n W`
# per GPU (one process per GPU is compile-bound), each GPU's log in LOG_DIR (default: .).
#
#     LOG_DIR=$OUT [SUITE_TIMEOUT=300] [TEST_TIMEOUT=240] [SUITE_SKIP='test_a.py|test_b.py'] \
#         [SUITE_RESUME=dir] scripts/gpu_suite.sh [WORKERS]
#
# SUITE_TIMEOUT (seconds) stops each GPU's pytest when it runs past it (SIGINT, as Ctrl-C: pytest
# still prints the failures so far with their tracebacks), so a device call keeps time for the
# work after the suite. SUITE_SKIP (an extended regex) leaves out test files already run.
# TEST_TIMEOUT (seconds, default 240) fails a single test that runs past it, where pytest-timeout
# is installed (the GPU machine has it): a kernel that deadlocks then shows up by name in the log
# instead of silently holding the whole call until SUITE_TIMEOUT.
# SUITE_RESUME: a folder holding an earlier call's gpu_suite_*.log files; the tests they passed
# are left out (tests/conftest.py reads their ids), so on one GPU, where the whole suite takes
# longer than one call, the next call goes on where the last was cut off.
#
# A machine's device time counts by the wall clock, whatever its GPU count: on one H100 the suite
# takes about 14 minutes over two calls, so a 4-GPU machine, where lent, runs it in one.
#
# Exit status: 0 when every GPU's run passed. Each log ends with pytest's summary of failures and
# the slowest tests.
set -u
workers=${1:-8}
log_dir=${LOG_DIR:-.}
gpus=$(python -c "import torch; print(torch.cuda.device_count())")
if [ "$gpus" -lt 1 ]; then
    echo "no GPU visible" >&2
    exit 2
fi
if [ -n "${SUITE_RESUME:-}" ]; then
    passed=$(mktemp)
    # Whole ids, to the line's end: a parametrized id may hold spaces.
    sed -nE 's/.*PASSED (tests\/.*[^ ]) *$/\1/p' "$SUITE_RESUME"/gpu_suite_*.log | sort -u > "$passed"
    echo "resuming: $(wc -l < "$passed") tests passed before are left out"
    export SUITE_PASSED=$passed
fi
# Largest files first, each to the GPU with the fewest bytes so far: a rough balance.
mapfile -t files < <(find tests -name "test_*.py" -printf "%s %p\n" | sort -rn | cut -d" " -f2- |
    grep -Ev "${SUITE_SKIP:-^$}")
declare -a load sel
for ((g = 0; g < gpus; g++)); do load[g]=0; sel[g]=""; done
for f in "${files[@]}"; do
    best=0
    for ((g = 1; g < gpus; g++)); do
        if [ "${load[g]}" -lt "${load[best]}" ]; then best=$g; fi
    done
    load[best]=$((load[best] + $(stat -c %s "$f")))
    sel[best]="${sel[best]} $f"
done
per_test=()
if python -c "import pytest_timeout" 2>/dev/null; then
    per_test=(--timeout "${TEST_TIMEOUT:-240}")
fi
# Every pytest worker's torch would take a thread per core for its CPU work (the model tests
# train on the CPU): dozens of workers on one host then oversubscribe it many times over, and
# fixtures that take seconds alone run past the per-test timeout. Share the cores out instead.
cores=$(nproc)
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$((cores / (gpus * workers) > 0 ? cores / (gpus * workers) : 1))}
# The GPUs by the ids the caller's CUDA_VISIBLE_DEVICES gives (CUDA_VISIBLE_DEVICES=2,3 runs on
# those two, not on 0 and 1), or 0, 1, ... where it is unset.
IFS=, read -r -a ids <<< "${CUDA_VISIBLE_DEVICES:-$(seq -s, 0 $((gpus - 1)))}"
pids=()
for ((g = 0; g < gpus; g++)); do
    # shellcheck disable=SC2086  # the file list is meant to split into words
    CUDA_VISIBLE_DEVICES=${ids[g]} ${SUITE_TIMEOUT:+timeout -s INT -k 60 $SUITE_TIMEOUT} python -m pytest -n "$workers" -v -rfE --durations=30 -p no:cacheprovider "${per_test[@]}" ${sel[g]} \
        > "$log_dir/gpu_suite_$g.log" 2>&1 &
    pids+=($!)
done
status=0
for ((g = 0; g < gpus; g++)); do
    wait "${pids[g]}" || status=1
    echo "GPU $g:$(tail -n 1 "$log_dir/gpu_suite_$g.log")"
done
exit $status
