#!/usr/bin/env bash
# Session 46's GPU rounds (from the repository root on the GPU machine; carry .whl .peer/tdz
# (tools/gpu_carry.sh tdz), and .peer/lc for llama-server):
#   bench/gpu_round_s46.sh first
#     the Triton variants first built inside requests after the load's warm-up (qwen3 4B, a fresh
#     kernel cache, bench/engine_batch.py --compiles), then deimos serve against llama-server on
#     llama 8B Q4_K_M at 1, 16 and 64 streams (issue 14's measure), then qwen3moe 30B-A3B's
#     batch-1 rounds (issue 15's whole-card decode)
#   bench/gpu_round_s46.sh r2   # carry .whl .peer/tdz .peer/base (git archive of 5f0a8b6: deimos,
#     bench/engine_batch.py, bench/profile_step.py)
#     the GPU tests of the decode attention's merge in the split launch and the experts' sum in
#     the norm; the variants a fresh kernel cache builds inside the first requests (after the
#     warm-up's fix); then batch-1 decode of qwen3moe 30B-A3B and qwen3 4B: the session's start,
#     this tree with DEIMOS_ATTN_MERGE=0 (the default) and =1, qwen3moe with DEIMOS_MOE_DEFER=0
#     (fresh processes)
#   bench/gpu_round_s46.sh serve   # deimos serve on llama 8B Q4_K_M at 1, 16, 64 streams again
#   bench/gpu_round_s46.sh agent   # carry .whl .peer/lc .peer/tdz
#     the three agent sessions against llama-server -np 1 (issue 17's 1.5x) on llama 8B Q4_K_M
#     (Hermes-3's tool-use template) and qwen3 4B Q4_K_M (Qwen3's), tools sent as the field
. bench/gpu_env.sh
Q3=/tmp/m/qwen3-4b-Q4_K_M-qwen3.gguf
case "${1:-}" in
first)
  setup; idle | say
  (python3 -m deimos synth qwen3-4b $Q3 --type Q4_K_M --vocab-from "$V/ggml-vocab-qwen2.gguf" > /dev/null) &
  (synth llama-8b $M8 Q4_K_M llama-bpe) &
  (synth qwen3moe-30b-a3b $M30 Q4_K_M qwen2) &
  wait; idle
  TRITON_CACHE_DIR=/tmp/tc-fresh timeout ${BATCH_S:-200} python3 bench/engine_batch.py $Q3 -c 16,64 -n 128 --compiles \
    > "$OUT/q3-batch-compiles.txt" 2>&1
  grep -E "^\| " "$OUT/q3-batch-compiles.txt" | cut -c1-1600 | say
  serve_round $M8
  timeout ${BENCH_S:-150} python3 -m deimos bench $M30 -p 512 -n 128 -r 2 > "$OUT/q3moe30.txt" 2>&1
  grep -E "pp512|tg128" "$OUT/q3moe30.txt" | sed 's/^/q3moe30 /' | say
  idle | say ;;
agent)
  setup; idle | say
  M8H=/tmp/m/llama-8b-Q4_K_M-hermes.gguf
  ([ -f $M8H ] || python3 -m deimos synth llama-8b $M8H --type Q4_K_M --vocab-from "$V/ggml-vocab-llama-bpe.gguf" \
    --chat-template "$V/templates/NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja" > /dev/null) &
  Q3T=/tmp/m/qwen3-4b-Q4_K_M-tmpl.gguf
  ([ -f $Q3T ] || python3 -m deimos synth qwen3-4b $Q3T --type Q4_K_M --vocab-from "$V/ggml-vocab-qwen2.gguf" \
    --chat-template "$V/templates/Qwen-Qwen3-0.6B.jinja" > /dev/null) &
  wait; idle
  for m in ${MODELS:-llama-8b qwen3-4b}; do
    [ $m = llama-8b ] && F=$M8H || F=$Q3T
    SESSIONS=${SESSIONS:-multi-turn long-prompt long-decode} agent $F $m 2>&1 | say
  done ;;
r2)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  idle | say
  (python3 -m deimos synth qwen3-4b $Q3 --type Q4_K_M --vocab-from "$V/ggml-vocab-qwen2.gguf" > /dev/null) &
  (synth qwen3moe-30b-a3b $M30 Q4_K_M qwen2) &
  gputests "merge or fused_new or in_the_norm or deferred or combine or whole or engine or graphs or gpu" \
    tests/test_triton_paged_attention.py tests/test_moe_gpu.py tests/test_triton_moe.py tests/test_engine_kernels.py
  wait; idle
  TRITON_CACHE_DIR=/tmp/tc-fresh2 timeout ${BATCH_S:-150} python3 bench/engine_batch.py $Q3 -c 16,64 -n 128 --compiles \
    > "$OUT/q3-batch-compiles.txt" 2>&1
  grep -E "^\| (default|greedy|phase|warm|[0-9a-z ]+ \| [0-9])" "$OUT/q3-batch-compiles.txt" | cut -c1-700 | say
  R=2 b1n $M30 q3moe30 new 0; R=2 b1n $M30 q3moe30 new 1; R=2 b1n $M30 q3moe30 base 0
  DEIMOS_MOE_DEFER=0 R=2 b1n $M30 q3moe30-nodefer new 0
  R=2 b1n $Q3 q3-4b new 0; R=2 b1n $Q3 q3-4b new 1; R=2 b1n $Q3 q3-4b base 0
  idle | say ;;
r3)  # carry as r2: deimos serve on llama 8B at 1, 16, 64 streams after the warm-up's fix, then
  # qwen35moe 35B-A3B Q4_K_M's batch-1 decode: the session's start, this tree, and this tree
  # with DEIMOS_MOE_DEFER=0
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  M35=/tmp/m/qwen35moe-35b-Q4_K_M.gguf
  (synth qwen35moe-35b-a3b $M35 Q4_K_M qwen2) &
  synth llama-8b $M8 Q4_K_M llama-bpe; idle | say
  serve_round $M8
  wait; R=2 b1n $M35 q35moe new 0; R=2 b1n $M35 q35moe base 0
  DEIMOS_MOE_DEFER=0 R=2 b1n $M35 q35moe-nodefer new 0
  idle | say ;;
serve)  # carry .whl .peer/tdz (and .peer/lc for llama-server's rows)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  synth llama-8b $M8 Q4_K_M llama-bpe; idle | say
  serve_round $M8 ;;
*) echo "usage: $0 first|agent|r2|r3|serve" >&2; exit 2 ;;
esac
