#!/usr/bin/env bash
# Issue 14's second GPU round (run from the repository root on the GPU machine):
#   bench/gpu_round_14b.sh tests|sweep|steps|serve|soak   (after bench/gpu_round_batch.sh setup)
. bench/gpu_env.sh
case "${1:-}" in
tests)
  python3 -m pytest -q -x -rfE tests/test_engine_kernels.py tests/test_triton_gemm_q.py ${TESTS:-} 2>&1 \
    | tee "$OUT/tests.txt" | tail -8 ;;
sweep)
  idle; python3 bench/sweep_gemm_batch.py --shapes 8b --types ${TYPES:-Q4_K,Q6_K} --rows ${ROWS:-2,4,8,16,32,64} 2>&1 \
    | tee "$OUT/sweep.txt" | tail -16; idle ;;
steps)
  synth llama-8b $M8 Q4_K_M llama-bpe; idle
  for c in ${SLEVELS:-1 16 64}; do
    python3 bench/engine_steps.py $M8 -c $c ${SARGS:-} 2>&1 | grep -v Warning | tee -a "$OUT/steps.txt" | tail -9
  done; idle ;;
serve)
  synth llama-8b $M8 Q4_K_M llama-bpe; idle
  python3 -m deimos serve $M8 --listen 127.0.0.1:8090 --no-tui -c 1024 ${DARGS:-} > "$OUT/deimos-serve.log" 2>&1 &
  D=$!
  for i in $(seq 300); do curl -sf 127.0.0.1:8090/health > /dev/null && break; sleep 1; done
  python3 -m deimos bench serve --url http://127.0.0.1:8090 --concurrency ${LEVELS:-1,4,16,64} \
    --prompt-tokens 512 --max-tokens 128 --json "$OUT/serve-deimos.json" 2>&1 | tail -8
  kill -INT $D; wait $D; idle ;;
soak)
  synth llama-8b $M8 Q4_K_M llama-bpe; idle
  python3 tools/soak_server.py --model $M8 --ctx 1024 --requests ${SOAK_N:-1000} --clients 32 --warmup 40 \
    --max-new 96 --words 400 --max-growth-mb 512 --server-args "--device cuda" 2>&1 | tee "$OUT/soak.txt" | tail -5
  idle ;;
moe)
  synth qwen3moe-30b-a3b $M30 Q4_K_M qwen2; idle; ls -la $M30
  for c in ${MLEVELS:-1}; do
    python3 bench/engine_steps.py $M30 -c $c --max-seqs $c ${MARGS:-} 2>&1 | grep -v Warning | tee -a "$OUT/moe.txt" | tail -8
  done; idle ;;
*) echo "usage: $0 tests|sweep|steps|serve|soak" >&2; exit 2 ;;
esac
