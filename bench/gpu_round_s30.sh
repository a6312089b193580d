#!/usr/bin/env bash
# Session 30's GPU rounds (from the repository root on the GPU machine; carry .whl .peer/td
# .peer/lc):
#   bench/gpu_round_s30.sh fused    # the Gated DeltaNet block's fused inputs and output norm:
#                                   # their GPU tests and the hybrids'; qwen35 4B Q4_K_M against
#                                   # llama-bench (run alone first, its own warm-up, -r 5); where
#                                   # the prompt and a decode step go
#   bench/gpu_round_s30.sh moe      # qwen35moe 35B-A3B Q4_K_M (whole card) against llama-bench;
#                                   # qwen35 4B's second turn of a 20k conversation (turn_ttft.py)
. bench/gpu_env.sh
export DEIMOS_TEST_DATA=/tmp/td
Q4=/tmp/m/qwen35-4b-Q4_K_M.gguf
gputests() {
  timeout ${TEST_S:-240} python3 -m pytest -q -rfE -m gpu -p no:cacheprovider tests/test_triton_gdn_inputs.py \
    tests/test_triton_gated_norm.py tests/test_triton_gated_delta.py tests/test_qwen35_gpu.py \
    tests/test_qwen35_state_pool.py tests/test_speculate.py -k "not smol and not keeps_the_greedy" 2>&1 | cut -c1-220 | tail -8
}
case "${1:-}" in
fused)
  setup; idle; gputests
  synth qwen35-4b $Q4 Q4_K_M qwen2; idle
  timeout ${BENCH_S:-240} python3 -m deimos bench $Q4 -p 512 -n 128 -r 3 --vs-llama /tmp/lc/llama-bench \
    --json "$OUT/qwen35-4b.json" 2>&1 | grep -v Warn | tee "$OUT/qwen35-4b.txt" | tail -14
  idle
  timeout 150 python3 bench/profile_prefill.py $Q4 -p 512 --top 16 2>&1 | grep -v Warn | cut -c1-200 \
    | tee "$OUT/prefill-profile.txt" | tail -24
  timeout 150 python3 bench/profile_step.py $Q4 -b 1 --steps 20 2>&1 | grep -v Warn | cut -c1-200 \
    | tee "$OUT/decode-profile.txt" | tail -30
  idle ;;
moe)  # qwen35moe 35B-A3B Q4_K_M on the whole card against llama-bench; qwen35 4B's second turn
  setup; idle
  timeout 120 python3 -m pytest -q -rfE -m gpu -p no:cacheprovider tests/test_qwen35moe.py tests/test_moe_gpu.py 2>&1 | tail -3
  M35=/tmp/m/qwen35moe-35b-Q4_K_M.gguf; synth qwen35moe-35b-a3b $M35 Q4_K_M qwen2; ls -la $M35; idle
  timeout ${BENCH_S:-300} python3 -m deimos bench $M35 -p 512 -n 128 -r 3 --vs-llama /tmp/lc/llama-bench \
    --json "$OUT/qwen35moe-35b.json" 2>&1 | grep -v Warn | tee "$OUT/qwen35moe-35b.txt" | tail -14
  rm -f $M35; idle
  synth qwen35-4b $Q4 Q4_K_M qwen2
  timeout ${TURN_S:-150} python3 bench/turn_ttft.py $Q4 --ctx 20000 -r 3 2>&1 | grep -v Warn | tee "$OUT/turn.txt" | tail -8
  idle ;;
diag)  # where the second turn's time goes; where qwen35moe's decode step and prompt go
  setup; synth qwen35-4b $Q4 Q4_K_M qwen2; idle
  timeout 120 python3 bench/profile_prefix.py $Q4 --ctx 2048,20000 -n 150 2>&1 | grep -v Warn | tee "$OUT/prefix.txt" | tail -5
  M35=/tmp/m/qwen35moe-35b-Q4_K_M.gguf; synth qwen35moe-35b-a3b $M35 Q4_K_M qwen2
  timeout 150 python3 bench/profile_step.py $M35 -b 1 --steps 20 2>&1 | grep -v Warn | cut -c1-160 | tee "$OUT/moe-step.txt" | tail -24
  timeout 150 python3 bench/profile_prefill.py $M35 -p 512 --top 14 --gaps 4 2>&1 | grep -v Warn | cut -c1-60,120-200 \
    | tee "$OUT/moe-prefill.txt" | tail -26
  idle ;;
final)  # the GPU tests of the hybrid path (the prefill-graph test among them); the MoE GEMM's tiles
  setup; idle; gputests
  timeout ${SWEEP_S:-200} python3 bench/sweep_moe_gemm.py --arch qwen35moe --budget ${BUDGET:-170} 2>&1 | grep -v Warn \
    | tee "$OUT/sweep-moe-gemm.txt" | tail -14
  idle ;;
moe2)  # qwen35moe 35B-A3B's prompt with the swept MoE GEMM rule (no llama.cpp: see moe's row)
  setup; M35=/tmp/m/qwen35moe-35b-Q4_K_M.gguf; synth qwen35moe-35b-a3b $M35 Q4_K_M qwen2; idle
  timeout ${BENCH_S:-110} python3 -m deimos bench $M35 -p 512 -n 32 -r 2 2>&1 | grep -v Warn | grep -E "pp512|tg32" ;;
next)  # what this session changed after its last measured round: the GPU tests, qwen35 4B and
       # qwen35moe 35B against llama-bench, the second turn (carry .whl .peer/td .peer/lc)
  setup; idle; gputests
  timeout 120 python3 -m pytest -q -rfE -m gpu -p no:cacheprovider tests/test_qwen35moe.py tests/test_moe_gpu.py 2>&1 | tail -3
  synth qwen35-4b $Q4 Q4_K_M qwen2; idle
  timeout ${BENCH_S:-240} python3 -m deimos bench $Q4 -p 512 -n 128 -r 3 --vs-llama /tmp/lc/llama-bench 2>&1 \
    | grep -v Warn | tee "$OUT/qwen35-4b.txt" | grep -E "pp512|tg128"
  timeout ${TURN_S:-150} python3 bench/turn_ttft.py $Q4 --ctx 20000 -r 3 2>&1 | grep -v Warn | tail -3
  M35=/tmp/m/qwen35moe-35b-Q4_K_M.gguf; synth qwen35moe-35b-a3b $M35 Q4_K_M qwen2; idle
  timeout ${BENCH_S:-300} python3 -m deimos bench $M35 -p 512 -n 128 -r 3 --vs-llama /tmp/lc/llama-bench 2>&1 \
    | grep -v Warn | tee "$OUT/qwen35moe-35b.txt" | grep -E "pp512|tg128"
  idle ;;
host)  # where the prefill's host time goes (cProfile), after fused
  setup; synth qwen35-4b $Q4 Q4_K_M qwen2
  timeout 200 python3 bench/profile_prefill.py $Q4 -p 512 --top 0 --gaps 0 --host ${HOST_N:-45} 2>&1 | grep -v Warn \
    | cut -c1-180 | tee "$OUT/prefill-host.txt" | grep -A${HOST_N:-45} "ncalls" | head -110 ;;
*) echo "usage: $0 fused|moe|moe2|diag|final|next|host" >&2; exit 2 ;;
esac
