#!/usr/bin/env bash
# FlashAttention-4's CuTe kernels on the GPU machine, for bench_attention.py's FA4-Flex provider.
#
# That machine cannot download, and a device call carries at most 64 MiB, so the wheels travel in
# two calls made back to back (git-ignored folders, made on a machine with network access):
#
#   wheels/fa4_a/  the first 60 MiB of nvidia-cutlass-dsl-libs-cu13 (cu13.whl.part_aa)
#   wheels/fa4_b/  its rest (cu13.whl.part_ab), its file name (cu13.whl.name), and the other
#                  wheels: flash-attn-4, nvidia-cutlass-dsl(-libs-base, -libs-core),
#                  quack-kernels, apache-tvm-ffi, torch-c-dlpack-ext (Python 3.12, x86_64)
#
#   call 1 (carry wheels/fa4_a): scripts/install_fa4.sh      # keeps part a in build/fa4-parts
#   call 2 (carry wheels/fa4_b): scripts/install_fa4.sh      # joins, installs into build/fa4
#   then: export PYTHONPATH=$PYTHONPATH:$PWD/build/fa4:$PWD/build/fa4/nvidia_cutlass_dsl/dsl_packages
#
# `pip install --target` into a folder on PYTHONPATH, since a .pth file is not read from there.
set -eu
parts=build/fa4-parts
target=build/fa4
mkdir -p "$parts"
if [ -d wheels/fa4_a ]; then
    cp wheels/fa4_a/cu13.whl.part_* "$parts/"
fi
if [ ! -d wheels/fa4_b ]; then
    echo "part a kept in $parts; carry wheels/fa4_b in the next call"
    exit 0
fi
cp wheels/fa4_b/cu13.whl.part_* "$parts/"
name=$(cat wheels/fa4_b/cu13.whl.name)
cat "$parts"/cu13.whl.part_* > "$parts/$name"
pip install -q --no-deps --target "$target" "$parts/$name" wheels/fa4_b/*.whl
echo "installed into $target; add $target and $target/nvidia_cutlass_dsl/dsl_packages to PYTHONPATH"
