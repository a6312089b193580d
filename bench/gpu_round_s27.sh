#!/usr/bin/env bash
# Session 27's GPU rounds (from the repository root on the GPU machine; carry .whl, .peer/td):
#   bench/gpu_round_s27.sh gemm      # gemm_q's GPU tests, then its tile sweep on llama 8B's matrices
#                                    # (TILES: the sweep's candidates, ROWS: activation rows)
#   bench/gpu_round_s27.sh engine    # bench/engine_batch.py on llama 8B Q4_K_M (C = 1, 16, 64)
#   bench/gpu_round_s27.sh serve     # deimos bench serve at LEVELS (default 1,16,64)
# Logs under $OUT; nvidia-smi's compute apps printed before and after each timing ("busy:").
. bench/gpu_env.sh
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
case "${1:-}" in
gemm)
  idle
  timeout ${TEST_S:-200} python3 -m pytest -q -rfE -m gpu -p no:cacheprovider tests/test_triton_gemm_q.py \
    > "$OUT/tests-gemm.txt" 2>&1
  grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/tests-gemm.txt" | cut -c1-240 | tail -12
  grep -E "GB/s" "$OUT/tests-gemm.txt" | head -12
  timeout ${SWEEP_S:-300} python3 bench/sweep_gemm_batch.py --shapes 8b --types ${TYPES:-Q4_K,Q6_K} \
    --rows ${ROWS:-2,4,8,16,32,64} ${TILES:+--tiles $TILES} 2>&1 | tee "$OUT/sweep.txt" | tail -45
  idle ;;
engine)
  synth llama-8b $M8 Q4_K_M llama-bpe; idle
  timeout ${ENGINE_S:-300} python3 bench/engine_batch.py $M8 -c ${LEVELS:-1,16,64} -p 512 -n 128 ${EXTRA:-} 2>&1 \
    | grep -v Warn | tee "$OUT/engine.txt" | tail -20
  idle ;;
serve)
  synth llama-8b $M8 Q4_K_M llama-bpe; idle
  python3 -m deimos serve $M8 --listen 127.0.0.1:8090 --no-tui -c 1024 ${SERVE_ARGS:-} > "$OUT/serve-log.txt" 2>&1 &
  S=$!
  for i in $(seq 120); do curl -sf 127.0.0.1:8090/health > /dev/null && break; sleep 1; done
  timeout ${SERVE_S:-400} python3 -m deimos bench serve --url http://127.0.0.1:8090 --concurrency ${LEVELS:-1,16,64} \
    --prompt-tokens 512 --max-tokens 128 --json "$OUT/serve.json" 2>&1 | tee "$OUT/serve.txt" | tail -12
  kill -INT $S; wait $S; idle ;;
*) echo "usage: $0 gemm|engine|serve" >&2; exit 2 ;;
esac
