#!/usr/bin/env bash
# Session 52's GPU round (from the repository root on the GPU machine; carry .whl .peer/tdz .peer/lc):
#   bench/gpu_round_s52.sh first   # llama 8B Q4_K_M: deimos serve against llama-server at 16 / 64
#     streams (issue 14's record); where a 2,048-token prompt goes (q rotated in place); the decode
#     attention's tiles at 16 / 64 rows of ~600 keys; mmq's 16-row tiles (half a 16-row step)
. bench/gpu_env.sh
case "${1:-}" in
first)
  setup; idle | say
  synth llama-8b $M8 Q4_K_M llama-bpe
  DLEVELS=16,64 serve_round $M8
  timeout ${PROF_S:-60} python3 bench/profile_prefill.py $M8 -p 2048 --top 10 --gaps 2 > "$OUT/prof-prefill.txt" 2>&1
  grep -E "wall" "$OUT/prof-prefill.txt" | say
  for b in 64 16; do
    timeout ${SWEEP_S:-85} python3 bench/sweep_decode_attention.py --heads 32,8,128 -b $b --pos 600 --width 1024 \
      --budget ${BUDGET:-70} > "$OUT/attn-b$b.txt" 2>&1
    grep -E "rule|^best" "$OUT/attn-b$b.txt" | sed "s/^/B=$b /" | head -4 | say
  done
  timeout ${EXP_S:-90} python3 bench/exp_gemm_mmq.py 28672x4096 4096x4096 --rows 16 --only "elements m16,gemm_q,torch" \
    --tiles "16,128,4,3;16,128,4,4;16,128,8,3;16,256,8,3;16,64,4,4" > "$OUT/mmq16.txt" 2>&1
  grep -E "M=" "$OUT/mmq16.txt" | grep -v swap | grep -v join | cut -c1-100 | say
  idle | say ;;
*) echo "usage: $0 first" >&2; exit 2 ;;
esac
