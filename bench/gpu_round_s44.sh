#!/usr/bin/env bash
# Session 44's GPU round (from the repository root on the GPU machine; carry .whl .peer/lc
# .peer/td-q with Qwen's and llama-spm's vocabularies, ~64 MB with the tree):
#   bench/gpu_round_s44.sh all
#     the GPU engine tests with defer_rows on by default (the logprob-row test now compares
#     the values to float32 rounding: the held row's log-softmax runs on the host), the
#     constrained A/B through the server (bench/gpu_round_s42.sh cons, levels 0 1), then the
#     three agent sessions on qwen3 4B Q4_K_M against llama-server -np 1 (issue 17's 1.5x)
. bench/gpu_env.sh
Q3=/tmp/m/qwen3-4b-Q4_K_M-qwen3.gguf
case "${1:-}" in
all)
  setup; idle
  (python3 -m deimos synth qwen3-4b $Q3 --type Q4_K_M --vocab-from "$V/ggml-vocab-qwen2.gguf" \
    --chat-template "$V/templates/Qwen-Qwen3-0.6B.jinja" > /dev/null) &
  timeout ${TEST_S:-200} python3 -m pytest -q -rfE -m gpu -p no:cacheprovider tests/test_sample_batch.py \
    tests/test_engine_kernels.py 2>&1 | grep -E "^E |passed|failed|^FAILED" | cut -c1-300 | tail -12
  wait
  CONS="${CONS:-0 1}" bash bench/gpu_round_s42.sh cons 2>&1 | tail -6
  SESSIONS=${SESSIONS:-multi-turn long-prompt long-decode} agent $Q3 qwen3-4b ;;
*) echo "usage: $0 all" >&2; exit 2 ;;
esac
