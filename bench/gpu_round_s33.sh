#!/usr/bin/env bash
# Session 33's GPU rounds (from the repository root on the GPU machine; carry .whl .peer/td
# .peer/lc, the td folder holding the llama-spm vocabulary the GPU tests' tiny models take and
# the qwen2 one the synthesized qwen35 files take):
#   bench/gpu_round_s33.sh tests  # the hybrids' and the MoE GPU tests (the snapshot row inside a
#                                 # prefill step: eager and on the prefill graphs)
#   bench/gpu_round_s33.sh turn   # qwen35 4B Q4_K_M: the second turn of a 20k conversation
#                                 # against a fresh prompt (bench/turn_ttft.py), then pp512/tg128
#                                 # against llama-bench
. bench/gpu_env.sh
export DEIMOS_TEST_DATA=/tmp/td
Q4=/tmp/m/qwen35-4b-Q4_K_M.gguf
case "${1:-}" in
tests)
  setup; idle
  timeout ${TEST_S:-300} python3 -m pytest -q -rfE -m gpu -p no:cacheprovider tests/test_triton_gdn_inputs.py \
    tests/test_triton_gated_norm.py tests/test_triton_gated_delta.py tests/test_qwen35_gpu.py \
    tests/test_qwen35_state_pool.py tests/test_speculate.py tests/test_triton_output_gate.py \
    tests/test_triton_shared_gate.py tests/test_triton_moe.py tests/test_moe_gpu.py tests/test_qwen35moe.py \
    -k "not smol and not keeps_the_greedy" 2>&1 | tee "$OUT/gputests.txt" | grep -E "^(FAILED|ERROR|E  )|passed|failed" \
    | cut -c1-300 | tail -30
  idle ;;
turn)
  setup; synth qwen35-4b $Q4 Q4_K_M qwen2; idle
  timeout ${TURN_S:-150} python3 bench/turn_ttft.py $Q4 --ctx 20000 -r 5 2>&1 | grep -v Warn | tee "$OUT/turn.txt" | tail -4
  timeout ${BENCH_S:-200} python3 -m deimos bench $Q4 -p 512 -n 128 -r 3 --vs-llama /tmp/lc/llama-bench 2>&1 \
    | grep -v Warn | tee "$OUT/qwen35-4b.txt" | tail -8
  idle ;;
*) echo "usage: $0 tests|turn" >&2; exit 2 ;;
esac
