#!/usr/bin/env bash
# Session 42's GPU rounds (from the repository root on the GPU machine; carry .whl-min .peer/td,
# and .whl-ggml .peer/lc for the MoE parts of bench/gpu_round_s36.sh):
#   bench/gpu_round_s42.sh gemm   # the batched decode GEMM's float16 decode against its float32
#                                 # one (bench/sweep_gemm_batch.py --decode half,f32; llama 8B's
#                                 # Q4_K and Q6_K matrices at 2, 16, 64 rows), beside gemv_q8
#                                 # once a row and matmul_f16 on an fp16 copy
#   bench/gpu_round_s42.sh moeab  # the same A/B where it matters most: qwen3moe 30B-A3B Q4_K_M's
#                                 # prefill with the whole card (moe_gemm), default against
#                                 # DEIMOS_DECODE_F16=1 (MOE: synth preset, FILE: its path)
#   bench/gpu_round_s42.sh cons   # a JSON-constrained request's cost to its batch: deimos serve on
#                                 # qwen3 4B Q4_K_M, 16 streams of 512-token prompts and 128-token
#                                 # answers with 0 and then 1 of the 16 clients constrained
. bench/gpu_env.sh
Q3=/tmp/m/qwen3-4b-Q4_K_M-qwen3.gguf
min_setup() {
  W=.whl; [ -d $W ] || W=.whl-min
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $W/*.whl
}
case "${1:-}" in
all)  # (carry .whl .whl-ggml .peer/td) the GPU tests of this session's changes, then cons,
      # gemm, moeab
  min_setup
  [ -d .whl-ggml ] && ggml_setup
  timeout ${TEST_S:-200} python3 -m pytest -q -rfE -x -m gpu -p no:cacheprovider \
    tests/test_engine_kernels.py -k "passengers" 2>&1 | cut -c1-300 | tail -6
  CONS="0 1 0 1" bash $0 cons
  timeout ${TEST_S:-200} python3 -m pytest -q -rfE -x -m gpu -p no:cacheprovider tests/test_engine_oom.py \
    -k gpu 2>&1 | grep -vE "^\s*$" | cut -c1-300 | tail -25
  ROWS=16,64 TYPES=Q4_K TAIL=12 bash $0 gemm; AB="0 1" bash $0 moeab ;;
gemm)
  min_setup; idle
  timeout ${SWEEP_S:-480} python3 bench/sweep_gemm_batch.py --shapes 8b --types ${TYPES:-Q4_K,Q6_K} \
    --rows ${ROWS:-2,16,64} --decode half,f32 2>&1 | grep -v Warn | tee "$OUT/sweep.txt" | tail -${TAIL:-40}
  idle ;;
moeab)
  min_setup; MF=${FILE:-$M30}; synth ${MOE:-qwen3moe-30b-a3b} $MF Q4_K_M qwen2; idle
  for f16 in ${AB:-0 1 0 1}; do
    DEIMOS_DECODE_F16=$f16 timeout 150 python3 -m deimos bench $MF -p 512 -n 32 -r 2 2>&1 | grep -v Warn \
      | grep -E "pp512|tg32" | sed "s/^/DEIMOS_DECODE_F16=$f16 /"
  done
  idle ;;
cons)
  min_setup
  [ -f $Q3 ] || python3 -m deimos synth qwen3-4b $Q3 --type Q4_K_M --vocab-from "$V/ggml-vocab-qwen2.gguf" \
    --chat-template "$V/templates/Qwen-Qwen3-0.6B.jinja" > /dev/null
  idle
  python3 -m deimos serve $Q3 --listen 127.0.0.1:8094 --no-tui -c 2048 > "$OUT/cons-serve.log" 2>&1 &
  S=$!
  for i in $(seq 240); do curl -sf 127.0.0.1:8094/health > /dev/null && break; kill -0 $S 2>/dev/null || break; sleep 1; done
  for n in ${CONS:-0 1 0 1}; do
    timeout 200 python3 -m deimos bench serve --url http://127.0.0.1:8094 --concurrency ${LEVEL:-16} \
      --prompt-tokens 512 --max-tokens 128 --constrained $n --json "$OUT/cons-$n.json" 2>&1 \
      | grep -E "^\| ${LEVEL:-16}" | sed "s/^/constrained=$n /"
  done
  curl -s 127.0.0.1:8094/metrics | grep -E "^deimos_(steps|tokens_per_step|preempt)" | head -8
  kill -INT $S; sleep 2; kill $S 2>/dev/null; wait $S; idle ;;
*) echo "usage: $0 gemm|moeab|cons" >&2; exit 2 ;;
esac
