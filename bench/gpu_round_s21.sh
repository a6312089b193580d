#!/usr/bin/env bash
# This session's GPU rounds (run from the repository root on the GPU machine):
#   bench/gpu_round_s21.sh tests   # GPU tests never run or never read (MoE, offload, gemv_rows, qwen35);
#                                  # the 8B file is made meanwhile (CPU only)
#   bench/gpu_round_s21.sh small   # gemv_rows' sweep at 2/4/8 rows; kernels a decode step at B = 1, 4, 16
#   bench/gpu_round_s21.sh check   # the changed kernels' GPU tests; the step profile (PDL on and
#                                  # off); deimos serve at 1, 16 and 64 streams
. bench/gpu_env.sh
bench/gpu_round_batch.sh setup > /dev/null 2>&1
case "${1:-}" in
tests)
  (synth llama-8b $M8 Q4_K_M llama-bpe) &
  timeout 420 python3 -m pytest -v -rfE --timeout 150 -p no:cacheprovider tests/test_moe_gpu.py \
    tests/test_offload.py tests/test_triton_gemv_rows.py tests/test_placement.py \
    tests/test_qwen35_gpu.py tests/test_triton_gated_delta.py 2>&1 | tee "$OUT/tests.txt" \
    | grep -E "PASSED|FAILED|ERROR|^E  " | cut -c1-200 | head -70
  wait; ls -la /tmp/m ;;
small)
  synth llama-8b $M8 Q4_K_M llama-bpe; idle
  for r in 2 4 8; do timeout 100 python3 bench/sweep_gemv.py $M8 --rows $r --quick 2>&1 | tail -7; done
  timeout 200 python3 bench/profile_step.py $M8 -b 1,4,16 --greedy 2>&1 | grep -v Warn | tee "$OUT/profile.txt" | tail -45; idle ;;
check)
  (synth llama-8b $M8 Q4_K_M llama-bpe) &
  timeout 240 python3 -m pytest -v -rfE --timeout 120 -p no:cacheprovider tests/test_triton_paged_attention.py \
    tests/test_sample_batch.py tests/test_engine_kernels.py tests/test_triton_kernels.py -k \
    "paged or decode or sample or topk or argmax or engine" > "$OUT/tests.txt" 2>&1
  grep -E "FAILED|ERROR|passed|failed" "$OUT/tests.txt" | cut -c1-200 | tail -15
  wait; idle
  timeout 150 python3 bench/profile_step.py $M8 -b 1,16 --greedy 2>&1 | grep -v Warn > "$OUT/profile.txt"
  DEIMOS_PDL=0 timeout 120 python3 bench/profile_step.py $M8 -b 1 --greedy 2>&1 | grep -v Warn > "$OUT/profile-nopdl.txt"
  grep -A14 "^B=" "$OUT/profile.txt" "$OUT/profile-nopdl.txt" | cut -c1-120
  LEVELS=1,16,64 bash bench/gpu_round_14b.sh serve 2>&1 | tail -12 ;;
*) echo "usage: $0 tests|small|check" >&2; exit 2 ;;
esac
