#!/usr/bin/env bash
# The GPU round of the batching work (issue 14), run on the GPU machine from the repository root:
#   bench/gpu_round_batch.sh setup          # wheels (.whl/), llama.cpp CUDA build (.peer/), test data (.peer/td)
#   bench/gpu_round_batch.sh tests          # the gpu-marked tests of the kernels and the engine
#   bench/gpu_round_batch.sh sweep          # the batched GEMM's tile sweep
#   bench/gpu_round_batch.sh engine         # engine throughput at several concurrencies (8B Q4_K_M)
#   bench/gpu_round_batch.sh serve          # deimos serve vs llama-server through deimos bench serve
# Logs go to $OUT (default /tmp/out). Measures only on an idle card (nvidia-smi before and after).
. bench/gpu_env.sh
case "${1:-}" in
setup)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  mkdir -p /tmp/lc && tar xJf .peer/lc/llama-cuda-sm90.tar.xz -C /tmp/lc
  nvidia-smi --query-compute-apps=pid,used_memory --format=csv ;;
tests)
  python3 -m pytest -q -x -rfE tests/test_triton_paged_attention.py tests/test_triton_gemm_q.py \
    tests/test_sample_batch.py tests/test_engine_kernels.py tests/test_sampling.py \
    tests/test_triton_kernels.py tests/test_gpu_model.py -k "not real" 2>&1 | tee "$OUT/tests.txt" | tail -25 ;;
sweep)
  python3 bench/sweep_gemm_batch.py 2>&1 | tee "$OUT/sweep.txt" | tail -40 ;;
engine)
  synth llama-8b $M8 Q4_K_M llama-bpe
  nvidia-smi --query-compute-apps=pid,used_memory --format=csv
  python3 bench/engine_batch.py $M8 -c ${ELEVELS:-1,16,64} -p 512 -n 128 2>&1 | tee "$OUT/engine.txt" | tail -12 ;;
serve)
  synth llama-8b $M8 Q4_K_M llama-bpe
  python3 -m deimos serve $M8 --listen 127.0.0.1:8090 --no-tui -c 1024 > "$OUT/deimos-serve.log" 2>&1 &
  D=$!
  for i in $(seq 120); do curl -sf 127.0.0.1:8090/health > /dev/null && break; sleep 1; done
  python3 -m deimos bench serve --url http://127.0.0.1:8090 --concurrency ${LEVELS:-1,4,16,64} \
    --prompt-tokens 512 --max-tokens 128 --json "$OUT/serve-deimos.json" 2>&1 | tail -12
  kill -INT $D; wait $D
  /tmp/lc/llama-server -m $M8 -ngl 99 -fa on --parallel 64 -c 65536 --host 127.0.0.1 --port 8091 \
    > "$OUT/llama-serve.log" 2>&1 &
  L=$!
  for i in $(seq 180); do curl -sf 127.0.0.1:8091/health > /dev/null && break; sleep 1; done
  python3 -m deimos bench serve --url http://127.0.0.1:8091 --concurrency ${LEVELS:-1,4,16,64} \
    --prompt-tokens 512 --max-tokens 128 --json "$OUT/serve-llama.json" 2>&1 | tail -12
  kill $L; wait $L
  nvidia-smi --query-compute-apps=pid,used_memory --format=csv ;;
*) echo "usage: $0 setup|tests|sweep|engine|serve" >&2; exit 2 ;;
esac
