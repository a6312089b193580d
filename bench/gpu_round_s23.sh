#!/usr/bin/env bash
# This session's GPU rounds (run from the repository root on the GPU machine):
#   bench/gpu_round_s23.sh probe     # synth the 8B and 30B-A3B files; the committed MoE / hybrid
#                                    # gpu tests; what the first requests pay (bench/first_request.py)
#   bench/gpu_round_s23.sh profile   # the decode step's kernels: qwen3moe 30B-A3B at batch 1,
#                                    # llama 8B at 1, 16 and 64 (bench/profile_step.py, PDL off)
. bench/gpu_env.sh
bench/gpu_round_batch.sh setup > /dev/null 2>&1
case "${1:-}" in
probe)
  (synth llama-8b $M8 Q4_K_M llama-bpe) & (synth qwen3moe-30b-a3b $M30 Q4_K_M qwen2) &
  timeout ${TEST_S:-300} python3 -m pytest -q -rfE -m gpu --timeout 150 -p no:cacheprovider --continue-on-collection-errors \
    ${TESTS:-tests/test_qwen3next.py tests/test_qwen35moe.py tests/test_moe_gpu.py tests/test_gpu_model.py} > "$OUT/tests.txt" 2>&1
  grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/tests.txt" | cut -c1-220 | tail -25
  wait; idle
  for m in ${PROBE_MODELS:-$M8}; do
    rm -rf /tmp/fresh-cache; TRITON_CACHE_DIR=/tmp/fresh-cache timeout 240 python3 bench/first_request.py $m \
      ${PROBE_ARGS:-} 2>&1 | grep -v Warn | tee "$OUT/first-$(basename $m).txt" | tail -8
  done; idle ;;
profile)
  idle
  DEIMOS_PDL=0 timeout 200 python3 bench/profile_step.py $M30 -b 1 --greedy --steps 20 2>&1 | grep -v Warn | tee "$OUT/profile-30b.txt" | tail -24
  DEIMOS_PDL=0 timeout 200 python3 bench/profile_step.py $M8 -b ${B8:-1,16,64} --steps 20 2>&1 | grep -v Warn | tee "$OUT/profile-8b.txt" | tail -66
  idle ;;
*) echo "usage: $0 probe|profile" >&2; exit 2 ;;
esac
