#!/usr/bin/env bash
# Session 35's GPU rounds (from the repository root on the GPU machine; carry .whl, .peer/lc and
# .peer/td holding the llama-bpe vocabulary and the templates: 63.4 MiB with the tree).
#   bench/gpu_round_s35.sh d8     # llama 8B Q4_K_M (Hermes-3 tool_use template): deimos bench
#                                 # against llama-bench (batch 1), the batch-1 greedy step's kernels
#                                 # (PDL on and off), the engine's steps at 16 and 64 streams
#   bench/gpu_round_s35.sh soak   # the GPU soak: 1000 requests at concurrency 32 (memory flat?)
#   bench/gpu_round_s35.sh agent  # the agent sessions on deimos serve and llama-server (-np 1)
#   bench/gpu_round_s35.sh moe    # qwen3moe 30B-A3B Q4_K_M with its experts on the host: where an
#                                 # offloaded token goes (bench/profile_offload.py, 0 and 24 slots),
#                                 # then deimos bench --gpu-mem 8 beside llama.cpp's -ncmoe 33. Carry
#                                 # .whl-min (what the engine imports), .whl-ggml, .peer/lc and
#                                 # .peer/td with the qwen2 vocabulary only (61 MiB with the tree)
. bench/gpu_env.sh
T=NousResearch-Hermes-3-Llama-3.1-8B-tool_use
MA=/tmp/m/llama-8b-Q4_K_M-$T.gguf
mk8() {
  [ -f $MA ] || python3 -m deimos synth llama-8b $MA --type Q4_K_M --vocab-from "$V/ggml-vocab-llama-bpe.gguf" \
    --chat-template "$V/templates/$T.jinja" > /dev/null
}
case "${1:-}" in
d8)
  setup; mk8; idle
  timeout ${BENCH_S:-200} python3 -m deimos bench $MA -p 512 -n 128 -r 3 --vs-llama /tmp/lc/llama-bench 2>&1 \
    | grep -v Warn | tee "$OUT/llama-8b.txt" | tail -8
  timeout 120 python3 bench/profile_step.py $MA -b 1 --greedy --steps 64 2>&1 | grep -v Warn | cut -c1-160 \
    | tee "$OUT/step-b1.txt" | tail -${STEP_N:-16}
  DEIMOS_PDL=0 timeout 120 python3 bench/profile_step.py $MA -b 1 --greedy --steps 64 2>&1 | grep -v Warn \
    | cut -c1-160 | tee "$OUT/step-b1-nopdl.txt" | tail -${STEP_N:-16}
  for c in 16 64; do
    timeout 150 python3 bench/engine_steps.py $MA -c $c 2>&1 | grep -v Warn | cut -c1-200 | tee "$OUT/steps-c$c.txt" | tail -12
  done
  idle ;;
soak)
  setup; mk8; idle
  soak $MA
  idle ;;
agent)
  setup; mk8; idle
  agent $MA llama-8b ;;
moe)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl-min/*.whl
  F=$(grep -m1 ^flags /proc/cpuinfo)
  if [[ $F == *avx512f* && $F == *avx512_vnni* && $F == *avx512vbmi* && $F == *avx512_bf16* ]]; then G=avx512; else G=avx2; fi
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl-ggml/$G/*.whl
  echo "ggml-python: $G build; $(python3 -c 'import ggml; print("imports")' 2>&1 | tail -1); $(nproc) cores"
  [ -x /tmp/lc/llama-bench ] || { mkdir -p /tmp/lc && tar xJf .peer/lc/llama-cuda-sm90.tar.xz -C /tmp/lc; }
  [ -n "${TESTS:-}" ] && timeout ${TEST_S:-200} python3 -m pytest -q -rfE -m gpu -p no:cacheprovider $TESTS 2>&1 \
    | cut -c1-220 | tail -6
  [ -n "${HOSTREAD:-}" ] && timeout 120 python3 bench/host_read.py 2>&1 | grep -v Warn | tee "$OUT/host-read.txt" | tail -8
  synth qwen3moe-30b-a3b $M30 Q4_K_M qwen2; idle
  timeout ${PROF_S:-200} python3 bench/profile_offload.py $M30 --slots ${SLOTS:-0,24} --shares ${SHARES:-auto,tune} --answer ${ANSWER:-token} \
    -n ${NTOK:-32} -p 512 --top 12 2>&1 | grep -v Warn > "$OUT/profile-offload.txt"
  grep -E "^(offload|cpu side)|^  (timed|host|  cpu|    ggml|    act|  promote|eager)|GB/s" "$OUT/profile-offload.txt" | cut -c1-160
  sed -n '/^cpu side\/answer/,$p' "$OUT/profile-offload.txt"; idle
  [ -n "${NOBENCH:-}" ] || timeout ${BENCH_S:-300} python3 -m deimos bench $M30 -p 512 -n 128 -r 3 --gpu-mem 8 \
    --vs-llama /tmp/lc/llama-bench "--llama-args=${LARGS:--ngl 99 -fa 1 -t 16 -ncmoe 33}" --json "$OUT/moe-8g.json" 2>&1 \
    | grep -v Warn | tee "$OUT/moe-8g.txt" | tail -24
  idle ;;
*) echo "usage: $0 d8|soak|agent|moe" >&2; exit 2 ;;
esac
