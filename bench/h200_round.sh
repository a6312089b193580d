#!/usr/bin/env bash
# One round of the GPU measurements recorded in BENCHMARKS.md, on a machine with an NVIDIA GPU:
# the gpu-marked tests, the decode profile of llama 8B Q4_K_M, and `deimos bench` against
# llama.cpp's llama-bench on the four required random-weight files.
#
#   bench/h200_round.sh VOCAB_DIR LLAMA_BENCH [OUT_DIR]
#
# VOCAB_DIR holds llama.cpp's ggml-vocab-qwen2.gguf and ggml-vocab-llama-bpe.gguf (the
# tokenizer donors; llama.cpp's models/ folder); LLAMA_BENCH is llama-bench built with CUDA.
# Measures only; run it on an otherwise idle card (every bench round checks that through NVML).
set -uo pipefail
vocab=${1:?VOCAB_DIR}; llama=${2:?LLAMA_BENCH}; out=${3:-bench-out}
mkdir -p "$out" /tmp/deimos-round
nvidia-smi --query-compute-apps=pid,name --format=csv | tee "$out/gpu-before.txt"
declare -A files=(
  [qwen3-0.6b-Q8_0]="qwen3-0.6b Q8_0 qwen2"
  [qwen3-4b-Q4_K_M]="qwen3-4b Q4_K_M qwen2"
  [llama-8b-Q4_K_M]="llama-8b Q4_K_M llama-bpe"
  [llama-8b-Q8_0]="llama-8b Q8_0 llama-bpe"
)
for name in "${!files[@]}"; do
  read -r preset type donor <<<"${files[$name]}"
  f=/tmp/deimos-round/$name.gguf
  [ -f "$f" ] || python3 -m deimos synth "$preset" "$f" --type "$type" --vocab-from "$vocab/ggml-vocab-$donor.gguf"
done
python3 -m pytest -q -rfE -m gpu tests/ -k "not real" 2>&1 | tee "$out/tests.txt" | tail -3
python3 bench/profile_decode.py /tmp/deimos-round/llama-8b-Q4_K_M.gguf --prefill 512 | tee "$out/profile.txt"
for name in qwen3-0.6b-Q8_0 qwen3-4b-Q4_K_M llama-8b-Q4_K_M llama-8b-Q8_0; do
  python3 -m deimos bench "/tmp/deimos-round/$name.gguf" -p 512 -n 128 -r 3 --vs-llama "$llama" \
    --json "$out/bench-$name.json" 2>&1 | tee "$out/bench-$name.txt" | tail -14
done
nvidia-smi --query-compute-apps=pid,name --format=csv | tee "$out/gpu-after.txt"
