#!/usr/bin/env bash
# Build here what serving a Llama through vLLM 0.26.0 needs on the GPU machine (Python 3.12,
# x86_64, an H200, torch 2.11 / triton 3.6 / transformers preinstalled, no network): vLLM's
# CUDA wheel unpacked with what that never loads deleted, plus the dependency wheels the image
# lacks, as one xz-compressed tar split into parts of 52 MiB, so that each part travels with the
# working tree in one device call (at most 64 MiB).
#
#   bash scripts/vllm_gpu_wheels.sh [DIR]       # DIR defaults to wheels/vllm-gpu (git-ignored)
#
# DIR then holds vllm-gpu.tar.xz.part0, part1, ..., vllm-gpu.tar.xz.sha256 and install.sh, and
# keeps the downloaded wheels in DIR/download (pip skips those already there).
# docs/integrations.md ("vLLM on the GPU machine") gives the procedure on the GPU machine.
set -euo pipefail

DIR=${1:-wheels/vllm-gpu}
PART_SIZE=52M
VLLM_VERSION=0.26.0
# The dependency wheels, at the versions installed on the H200 where vLLM 0.26.0 ran s2attn's
# plugin tests and a 7B-shaped engine with torch.compile and CUDA graphs (2026-12-02). The rest of
# vLLM's requirements is in the GPU image or not imported when serving a Llama (tilelang, the
# CUTLASS DSL, ...); flashinfer is imported only by the GPU sampler, which
# VLLM_USE_FLASHINFER_SAMPLER=0 turns off.
DEPS=(
    annotated-types==0.8.0
    apache-tvm-ffi==0.1.15.post2
    astor==0.8.1
    blake3==1.0.11
    cachetools==8.0.2
    cbor2==6.3.0
    compressed-tensors==0.17.0
    depyf==0.20.0
    dill==0.4.1
    dnspython==2.9.2
    email-validator==2.4.0
    fastapi==0.136.3
    googleapis-common-protos==1.76.0
    httpcore2==2.16.2
    httpx2==2.16.2
    ijson==3.6.0
    interegular==0.3.3
    jiter==0.19.0
    jsonschema-specifications==2025.9.1
    jsonschema==4.26.0
    lark==1.2.2
    llguidance==1.7.6
    lm-format-enforcer==0.11.3
    loguru==0.7.3
    mistral_common==1.13.1
    msgspec==0.23.0
    openai-harmony==0.0.8
    openai==3.57.0
    opentelemetry-api==1.45.2
    opentelemetry-exporter-http-transport==0.66b2
    opentelemetry-exporter-otlp-common==0.66b2
    opentelemetry-exporter-otlp-proto-common==1.45.2
    opentelemetry-exporter-otlp-proto-grpc==1.45.2
    opentelemetry-exporter-otlp-proto-http==1.45.2
    opentelemetry-exporter-otlp==1.45.2
    opentelemetry-proto==1.45.2
    opentelemetry-sdk==1.45.2
    opentelemetry-semantic-conventions-ai==0.5.1
    opentelemetry-semantic-conventions==0.66b2
    outlines_core==0.2.14
    partial-json-parser==0.2.1.1.post7
    prometheus-fastapi-instrumentator==8.1.0
    pybase64==1.5.1
    pycountry==26.2.16
    pydantic-extra-types==2.11.1
    pydantic==2.14.4
    pydantic_core==2.50.5
    python-json-logger==4.2.0
    python-multipart==0.0.34
    pyzmq==27.3.0
    referencing==0.37.0
    rpds-py==2026.9.1
    setproctitle==1.3.8
    sniffio==1.3.1
    starlette==1.10.0
    truststore==0.10.5
    typing-inspection==0.4.5
    watchfiles==1.3.0
    xgrammar==0.2.9
)

# Deleted from the unpacked wheel (paths under site/): what serving a Llama on Hopper never loads.
STRIP=(
    # FlashAttention 2 (290 MiB): flash_attn_interface.py imports it in a try; sm90 runs FA3.
    vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so
    # MoE kernels: platforms/cuda.py import_kernels imports them under contextlib.suppress.
    vllm/_moe_C_stable_libtorch.abi3.so
    # The Rust frontend binary, run only by `vllm serve` with VLLM_USE_RUST_FRONTEND=1.
    vllm/vllm-rs
    # DeepGEMM builds for the other Pythons (the machine's is 3.12).
    vllm/third_party/deep_gemm/_C.cpython-310-x86_64-linux-gnu.so
    vllm/third_party/deep_gemm/_C.cpython-311-x86_64-linux-gnu.so
    vllm/third_party/deep_gemm/_C.cpython-313-x86_64-linux-gnu.so
    vllm/third_party/deep_gemm/_C.cpython-314-x86_64-linux-gnu.so
    # DeepGEMM's C++ headers, read only by its JIT for fp8 GEMMs.
    vllm/third_party/deep_gemm/include
    # The Blackwell (sm100) FMHA's C++ headers and its CUTLASS copy, read only by its JIT
    # (MiniMax-M3's sparse attention).
    vllm/third_party/fmha_sm100/csrc/include
    vllm/third_party/fmha_sm100/cutlass
)
# What the archive must hold (paths under site/): vLLM's kernels, FlashAttention 3, the 3.12
# DeepGEMM build and the metadata with vLLM's entry points (plugins are found through them).
KEEP=(
    vllm/_C_stable_libtorch.abi3.so
    vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so
    vllm/vllm_flash_attn/flash_attn_interface.py
    vllm/third_party/deep_gemm/_C.cpython-312-x86_64-linux-gnu.so
    "vllm-$VLLM_VERSION.dist-info/METADATA"
    "vllm-$VLLM_VERSION.dist-info/entry_points.txt"
)

# pip matches platform tags exactly, and some of these wheels carry only newer glibc tags
# (llguidance 1.7.6: manylinux_2_31), so the GPU machine needs glibc 2.31 or later (not checked).
FLAGS=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
for glibc in 17 24 27 28 31 34 35 36 37 38 39; do
    FLAGS+=(--platform "manylinux_2_${glibc}_x86_64")
done

fail() {
    echo "vllm_gpu_wheels.sh: $*" >&2
    exit 1
}

mkdir -p "$DIR/download"
python3 -m pip download -q "${FLAGS[@]}" -d "$DIR/download" "vllm==$VLLM_VERSION" "${DEPS[@]}"

# The one wheel in DIR/download for NAME==VERSION (wheel file names write the name lowercase
# with underscores); DIR/download may also hold other versions from earlier runs.
wheel_of() {
    local name=${1%%==*} version=${1#*==} found
    name=$(echo "$name" | tr 'A-Z.-' 'a-z__')
    found=$(find "$DIR/download" -maxdepth 1 -iname "${name}-${version}-*.whl")
    [ "$(echo "$found" | grep -c .)" = 1 ] ||
        fail "expected one wheel for $1 in $DIR/download, found: ${found:-none}"
    echo "$found"
}

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/site" "$work/deps" "$work/parts"
wheel=$(wheel_of "vllm==$VLLM_VERSION")
unzip -q "$wheel" -d "$work/site"
for path in "${STRIP[@]}"; do
    [ -e "$work/site/$path" ] || fail "$path is not in vLLM $VLLM_VERSION's wheel: check STRIP"
    rm -rf "${work:?}/site/$path"
done
for dep in "${DEPS[@]}"; do
    wheel=$(wheel_of "$dep")
    cp "$wheel" "$work/deps/"
done

# FlashAttention 3 goes first. It compresses to a tenth, most of the archive's gain, and xz -T2
# compresses 192 MiB blocks that share no history: FA3 cut by a block boundary cost 2.5 MB, the
# margin that keeps the archive to two parts.
fa3=site/vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so
(cd "$work" && { echo "$fa3" && find site deps | grep -vxF "$fa3" | LC_ALL=C sort; }) |
    tar -C "$work" --no-recursion --owner=0 --group=0 -cf - -T - |
    xz -T2 -9 >"$work/vllm-gpu.tar.xz"
split -b "$PART_SIZE" -d -a 1 "$work/vllm-gpu.tar.xz" "$work/parts/vllm-gpu.tar.xz.part"
(cd "$work" && sha256sum vllm-gpu.tar.xz) >"$work/parts/vllm-gpu.tar.xz.sha256"

# Check what the joined parts unpack to, as install.sh will read them.
cat "$work"/parts/vllm-gpu.tar.xz.part* | xz -d | tar -t >"$work/listing"
for path in "${KEEP[@]}"; do
    grep -qxF "site/$path" "$work/listing" || fail "site/$path is missing from the archive"
done
for path in "${STRIP[@]}"; do
    ! grep -q "^site/$path\(/\|$\)" "$work/listing" || fail "site/$path is still in the archive"
done
wheels=$(grep -c '^deps/.*\.whl$' "$work/listing" || true)
[ "$wheels" = "${#DEPS[@]}" ] || fail "the archive holds $wheels dependency wheels, not ${#DEPS[@]}"

rm -f "$DIR"/vllm-gpu.tar.xz.part* "$DIR"/vllm-gpu.tar.part* "$DIR"/vllm-gpu.tar.sha256
mv "$work"/parts/* "$DIR/"

cat >"$DIR/install.sh" <<'EOF'
#!/usr/bin/env bash
# On the GPU machine: check and join the parts in PARTS_DIR, unpack vLLM into SITE and install
# the dependency wheels there without an index or dependencies. SITE must not exist yet.
#
#   bash install.sh PARTS_DIR [SITE]     # SITE defaults to /tmp/site
#
# Then: export PYTHONPATH=SITE VLLM_USE_FLASHINFER_SAMPLER=0 (flashinfer is not shipped).
set -euo pipefail
parts=${1:?usage: install.sh PARTS_DIR [SITE]}
site=${2:-/tmp/site}
fail() {
    echo "install.sh: $*" >&2
    exit 1
}
[ ! -e "$site" ] || fail "$site exists: remove it or name another SITE"
[ -f "$parts/vllm-gpu.tar.xz.sha256" ] || fail "no vllm-gpu.tar.xz.sha256 in $parts"
compgen -G "$parts/vllm-gpu.tar.xz.part*" >/dev/null || fail "no vllm-gpu.tar.xz.part* in $parts"
expected=$(cut -d' ' -f1 "$parts/vllm-gpu.tar.xz.sha256")
actual=$(cat "$parts"/vllm-gpu.tar.xz.part* | sha256sum | cut -d' ' -f1)
[ "$actual" = "$expected" ] ||
    fail "the parts in $parts do not match vllm-gpu.tar.xz.sha256: one is missing or incomplete"
# Unpacked next to SITE and moved there once complete, so a failure leaves no SITE behind.
work=$(mktemp -d "$(dirname "$site")/vllm-gpu.XXXXXX")
trap 'rm -rf "$work"' EXIT
cat "$parts"/vllm-gpu.tar.xz.part* | xz -d | tar -x -C "$work"
python3 -m pip install -q --no-index --no-deps --no-compile --target "$work/site" "$work"/deps/*.whl
mv "$work/site" "$site"
echo "installed vLLM into $site; now: export PYTHONPATH=$site VLLM_USE_FLASHINFER_SAMPLER=0"
EOF
chmod +x "$DIR/install.sh"

ls -l "$DIR"
parts=$(ls "$DIR"/vllm-gpu.tar.xz.part* | wc -l)
echo "archive: $(stat -c %s "$work/vllm-gpu.tar.xz") bytes in $parts parts (one device call each)"
