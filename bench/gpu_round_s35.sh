#!/usr/bin/env bash
# Session 35's GPU rounds (from the repository root on the GPU machine; carry .whl, .peer/lc and
# .peer/td holding the llama-bpe vocabulary and the templates: 63.4 MiB with the tree).
#   bench/gpu_round_s35.sh d8     # llama 8B Q4_K_M (Hermes-3 tool_use template): deimos bench
#                                 # against llama-bench (batch 1), the batch-1 greedy step's kernels
#                                 # (PDL on and off), the engine's steps at 16 and 64 streams
#   bench/gpu_round_s35.sh soak   # the GPU soak: 1000 requests at concurrency 32 (memory flat?)
#   bench/gpu_round_s35.sh agent  # the agent sessions on deimos serve and llama-server (-np 1)
. bench/gpu_env.sh
T=NousResearch-Hermes-3-Llama-3.1-8B-tool_use
MA=/tmp/m/llama-8b-Q4_K_M-$T.gguf
mk8() {
  [ -f $MA ] || python3 -m deimos synth llama-8b $MA --type Q4_K_M --vocab-from "$V/ggml-vocab-llama-bpe.gguf" \
    --chat-template "$V/templates/$T.jinja" > /dev/null
}
case "${1:-}" in
d8)
  setup; mk8; idle
  timeout ${BENCH_S:-200} python3 -m deimos bench $MA -p 512 -n 128 -r 3 --vs-llama /tmp/lc/llama-bench 2>&1 \
    | grep -v Warn | tee "$OUT/llama-8b.txt" | tail -8
  timeout 120 python3 bench/profile_step.py $MA -b 1 --greedy --steps 64 2>&1 | grep -v Warn | cut -c1-160 \
    | tee "$OUT/step-b1.txt" | tail -${STEP_N:-16}
  DEIMOS_PDL=0 timeout 120 python3 bench/profile_step.py $MA -b 1 --greedy --steps 64 2>&1 | grep -v Warn \
    | cut -c1-160 | tee "$OUT/step-b1-nopdl.txt" | tail -${STEP_N:-16}
  for c in 16 64; do
    timeout 150 python3 bench/engine_steps.py $MA -c $c 2>&1 | grep -v Warn | cut -c1-200 | tee "$OUT/steps-c$c.txt" | tail -12
  done
  idle ;;
soak)
  setup; mk8; idle
  timeout ${SOAK_S:-400} python3 tools/soak_server.py --model $MA --ctx 1024 --requests 1000 --clients 32 \
    --max-new 96 --words 400 --server-args "--device cuda" 2>&1 | tee "$OUT/soak.txt" | tail -15
  idle ;;
agent)
  setup; mk8; idle
  agent $MA llama-8b ;;
*) echo "usage: $0 d8|soak|agent" >&2; exit 2 ;;
esac
