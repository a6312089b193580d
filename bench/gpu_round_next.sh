#!/usr/bin/env bash
# The GPU checks this session could not run or could not read (run from the repository root on
# the GPU machine, one part a device call; each part under ~9 minutes):
#   bench/gpu_round_next.sh tests     # the GPU tests that failed or never ran: -v, one line a test
#   bench/gpu_round_next.sh small     # gemv_rows' sweep at 2/4/8 rows; decode kernels a step at B = 1, 4, 16
#   bench/gpu_round_next.sh soak      # the soak's GPU memory after the load-time profile step
#   bench/gpu_round_next.sh moe       # qwen3moe 30B-A3B: whole card and --gpu-mem 8 against llama.cpp
#   bench/gpu_round_next.sh squeeze   # the squeeze and its release
# Carry: .whl (with ggml-python's wheel), .peer/llama-cuda-sm90.tar.xz for moe/squeeze, the
# llama-bpe, llama-spm and qwen2 vocabularies under .peer/td. Logs under $OUT.
. bench/gpu_env.sh
bench/gpu_round_batch.sh setup > /dev/null 2>&1
case "${1:-}" in
tests)
  timeout 500 python3 -m pytest -v -rfE --timeout 240 -p no:cacheprovider tests/test_moe_gpu.py \
    tests/test_offload.py tests/test_engine_kernels.py tests/test_triton_gemv_rows.py \
    tests/test_placement.py 2>&1 | tee "$OUT/tests.txt" | grep -E "PASSED|FAILED|ERROR|^E " | head -80 ;;
small)
  synth llama-8b $M8 Q4_K_M llama-bpe; idle
  for r in 2 4 8; do timeout 170 python3 bench/sweep_gemv.py $M8 --rows $r --quick 2>&1 | tail -8; done
  python3 bench/profile_step.py $M8 -b 1,4,16 --greedy 2>&1 | grep -v Warn | tee "$OUT/profile.txt" | tail -60 ;;
soak)
  synth llama-8b $M8 Q4_K_M llama-bpe; idle
  SOAK_N=600 bench/gpu_round_14b.sh soak ;;
moe)
  synth qwen3moe-30b-a3b $M30 Q4_K_M qwen2; idle
  python3 -m deimos bench $M30 -p 512 -n 128 -r 3 --vs-llama /tmp/lc/llama-bench --json "$OUT/moe-full.json" 2>&1 | tail -15
  python3 -m deimos bench $M30 -p 512 -n 128 -r 3 --gpu-mem 8 --vs-llama /tmp/lc/llama-bench \
    --llama-args="-ngl 99 -fa 1 -t 16" --json "$OUT/moe-8g.json" 2>&1 | tail -15; idle ;;
squeeze)
  synth qwen3moe-30b-a3b $M30 Q4_K_M qwen2; idle
  python3 -m deimos bench $M30 -n 128 --gpu-mem 8 --squeeze --json "$OUT/moe-squeeze.json" 2>&1 | tail -12
  python3 -m deimos bench $M30 -n 128 --gpu-mem 8 --squeeze --release --json "$OUT/moe-release.json" 2>&1 | tail -12; idle ;;
*) echo "usage: $0 tests|small|soak|moe|squeeze" >&2; exit 2 ;;
esac
