#!/usr/bin/env bash
# This session's GPU rounds (run from the repository root on the GPU machine):
#   bench/gpu_round_s23.sh sweep     # the one-token MoE kernels' tiles (bench/sweep_moe.py), then:
#   bench/gpu_round_s23.sh probe     # what the first requests pay (bench/first_request.py, 8B)
#   bench/gpu_round_s23.sh moe       # synth the 30B-A3B (and 8B) files; the MoE gpu tests; the
#                                    # 30B's batch-1 decode step, fused and unfused (PDL on: wall
#                                    # time; then PDL off: each kernel's own time)
#   bench/gpu_round_s23.sh final     # sweep + probe + the 30B's step with the router fused / not
#   bench/gpu_round_s23.sh profile   # llama 8B's decode step at 1, 16 and 64 (PDL off)
. bench/gpu_env.sh
bench/gpu_round_batch.sh setup > /dev/null 2>&1
case "${1:-}" in
moe)
  (synth llama-8b $M8 Q4_K_M llama-bpe) & (synth qwen3moe-30b-a3b $M30 Q4_K_M qwen2) &
  timeout ${TEST_S:-240} python3 -m pytest -q -rfE -m gpu --timeout 150 -p no:cacheprovider --continue-on-collection-errors \
    ${TESTS:-tests/test_moe_gpu.py tests/test_qwen35moe.py tests/test_qwen3next.py} > "$OUT/tests.txt" 2>&1
  grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/tests.txt" | cut -c1-220 | tail -25
  timeout ${TEST_S:-240} python3 -m pytest -q -rfE -m "not gpu" -p no:cacheprovider tests/test_triton_moe_decode.py tests/test_triton_moe.py > "$OUT/tests-cuda.txt" 2>&1
  tail -3 "$OUT/tests-cuda.txt"
  wait; idle
  for fused in ${FUSED_MODES:-1 router 0}; do
    DEIMOS_MOE_FUSED=$fused timeout 200 python3 bench/profile_step.py $M30 -b 1 --greedy --steps 64 --top 4 2>&1 | grep -E "^B=" | sed "s/^/fused=$fused PDL on: /"
    DEIMOS_PDL=0 DEIMOS_MOE_FUSED=$fused timeout 200 python3 bench/profile_step.py $M30 -b 1 --greedy --steps 20 --top 30 2>&1 | grep -v Warn | tee "$OUT/profile-30b-fused$fused.txt" | tail -32
  done; idle ;;
sweep)
  # the one-token MoE kernels' tiles (bench/sweep_moe.py), then the probe below
  (synth llama-8b $M8 Q4_K_M llama-bpe) &
  idle; timeout 330 python3 bench/sweep_moe.py --quick 2>&1 | grep -v Warn | tee "$OUT/sweep-moe.txt" | grep -v "^  "
  wait
  if [ -n "${ATTN:-}" ]; then  # the 30B's attention GEMVs (gemv_q8 on its shapes)
    synth qwen3moe-30b-a3b $M30 Q4_K_M qwen2
    timeout 200 python3 bench/sweep_gemv.py $M30 --quick 2>&1 | grep -v Warn | tee "$OUT/sweep-gemv-30b.txt" | tail -20
  fi ;&
probe)
  idle
  for m in ${PROBE_MODELS:-$M8}; do
    rm -rf /tmp/fresh-cache; TRITON_CACHE_DIR=/tmp/fresh-cache timeout 240 python3 bench/first_request.py $m \
      ${PROBE_ARGS:-} 2>&1 | grep -v Warn | tee "$OUT/first-$(basename $m).txt" | tail -8
  done; idle ;;
final)
  # one call: the MoE tiles' sweep, the first requests' probe (8B), the 30B's decode step with
  # the router fused and unfused (PDL on: wall time a step)
  (synth llama-8b $M8 Q4_K_M llama-bpe; synth qwen3moe-30b-a3b $M30 Q4_K_M qwen2) &
  idle; timeout 230 python3 bench/sweep_moe.py --quick 2>&1 | grep -v Warn | tee "$OUT/sweep-moe.txt" | grep -v "^  " | grep -v "^    top"
  wait
  rm -rf /tmp/fresh-cache; TRITON_CACHE_DIR=/tmp/fresh-cache timeout 130 python3 bench/first_request.py $M8 2>&1 \
    | grep -v Warn | tee "$OUT/first-8b.txt" | tail -7
  for fused in ${FUSED_MODES:-router 0}; do
    DEIMOS_MOE_FUSED=$fused timeout 70 python3 bench/profile_step.py $M30 -b 1 --greedy --steps 64 --top 3 2>&1 \
      | grep -E "^B=" | sed "s/^/fused=$fused PDL on: /"
  done; idle ;;
profile)
  idle
  DEIMOS_PDL=0 timeout 200 python3 bench/profile_step.py $M8 -b ${B8:-1,16,64} --steps 20 2>&1 | grep -v Warn | tee "$OUT/profile-8b.txt" | tail -66
  idle ;;
*) echo "usage: $0 moe|sweep|probe|final|profile" >&2; exit 2 ;;
esac
