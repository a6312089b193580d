#!/usr/bin/env bash
# Session 44's GPU round (from the repository root on the GPU machine; carry .whl .peer/lc
# .peer/td-q with Qwen's and llama-spm's vocabularies, ~64 MB with the tree):
#   bench/gpu_round_s44.sh all
#     the GPU engine tests with defer_rows on by default (the logprob-row test now compares
#     the values to float32 rounding: the held row's log-softmax runs on the host), the
#     constrained A/B through the server (bench/gpu_round_s42.sh cons, levels 0 1), then the
#     three agent sessions on qwen3 4B Q4_K_M against llama-server -np 1 (issue 17's 1.5x)
#   bench/gpu_round_s44.sh moe35   # carry .whl-min .whl-ggml .peer/lc .peer/td-q (Qwen's vocabulary)
#     qwen35moe 35B-A3B Q4_K_M with 8 GiB left (never run before): deimos bench --gpu-mem 8, then
#     llama-bench under the same hold at -ncmoe NCMOE (default 30; no search: device time)
. bench/gpu_env.sh
Q3=/tmp/m/qwen3-4b-Q4_K_M-qwen3.gguf
case "${1:-}" in
all)
  setup; idle
  (python3 -m deimos synth qwen3-4b $Q3 --type Q4_K_M --vocab-from "$V/ggml-vocab-qwen2.gguf" \
    --chat-template "$V/templates/Qwen-Qwen3-0.6B.jinja" > /dev/null) &
  timeout ${TEST_S:-200} python3 -m pytest -q -rfE -m gpu -p no:cacheprovider tests/test_sample_batch.py \
    tests/test_engine_kernels.py 2>&1 | grep -E "^E |passed|failed|^FAILED" | cut -c1-300 | tail -12
  wait
  CONS="${CONS:-0 1}" bash bench/gpu_round_s42.sh cons 2>&1 | tail -6
  SESSIONS=${SESSIONS:-multi-turn long-prompt long-decode} agent $Q3 qwen3-4b ;;
moe35)
  W=.whl-min; python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site $W/*.whl
  ggml_setup; [ -x /tmp/lc/llama-bench ] || { mkdir -p /tmp/lc && tar xJf .peer/lc/llama-cuda-sm90.tar.xz -C /tmp/lc; }
  M35=/tmp/m/qwen35moe-35b-Q4_K_M.gguf; synth qwen35moe-35b-a3b $M35 Q4_K_M qwen2; idle
  timeout ${BENCH_S:-150} python3 -m deimos bench $M35 -p 512 -n 128 -r 2 --gpu-mem 8 2>&1 | grep -v Warn \
    | tee "$OUT/moe35-8g.txt" | tail -14
  idle
  sleep 100000 | python3 -m deimos.bench.memhold --leave 8 > /tmp/memhold.out 2>&1 &
  for i in $(seq 60); do grep -q "^ready" /tmp/memhold.out && break; sleep 1; done; head -1 /tmp/memhold.out
  for n in ${NCMOE:-30}; do
    timeout ${LLAMA_S:-120} /tmp/lc/llama-bench -m $M35 -p 512 -n 128 -r 2 -ngl 99 -fa 1 -t 16 -ncmoe $n \
      -o md 2>&1 | grep -E "^\||error|out of memory" | tee -a "$OUT/moe35-llama.txt"
  done
  pkill -f "sleep 100000"; sleep 2; idle ;;
*) echo "usage: $0 all|moe35" >&2; exit 2 ;;
esac
