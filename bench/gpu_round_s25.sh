#!/usr/bin/env bash
# This session's GPU rounds (run from the repository root on the GPU machine):
#   bench/gpu_round_s25.sh tests     # the GPU tests of the offload, the hybrid MoE offloaded, the
#                                    # MoE kernels, the handshake; then the offload's profile: ggml's
#                                    # thread pool on and off, 0 and 24 slots, after a 512-token
#                                    # prompt (its prefill timed too)
#   bench/gpu_round_s25.sh bench     # deimos bench --gpu-mem 8 (and --vs-llama with the llama.cpp
#                                    # build: carry .peer/lc in this call; over 64 MiB with .peer/td,
#                                    # which an earlier call left there)
#   bench/gpu_round_s25.sh all       # the profile (the tuner, fixed shares) then the bench with
#                                    # llama.cpp at -ncmoe 33 (the issue's best) beside it
# Carry .whl, .whl-ggml, .peer/td (vocabularies). With the llama.cpp build (.peer/lc, 41 MiB) the
# tree is over 64 MiB: carry .whl-min (gguf, llguidance, jsonschema: what the engine imports)
# instead of .whl, and .peer/td with the qwen2 vocabulary only. Logs under $OUT.
. bench/gpu_env.sh
bench/gpu_round_batch.sh setup > /dev/null 2>&1
ls .whl/*.whl > /dev/null 2>&1 || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
  --upgrade --target /tmp/site .whl-min/*.whl
F=$(grep -m1 ^flags /proc/cpuinfo)
if [[ $F == *avx512f* && $F == *avx512_vnni* && $F == *avx512vbmi* && $F == *avx512_bf16* ]] && ls .whl-ggml/avx512/*.whl > /dev/null 2>&1; then G=avx512; else G=avx2; fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl-ggml/$G/*.whl
echo "ggml-python: $G build; $(python3 -c 'import ggml; print("imports")' 2>&1 | tail -1)"
case "${1:-}" in
tests)
  t0=$(date +%s); synth qwen3moe-30b-a3b $M30 Q4_K_M qwen2; echo "synth 30B: $(( $(date +%s) - t0 )) s"
  timeout ${TEST_S:-230} python3 -m pytest -q -rfE -m gpu --timeout 200 -p no:cacheprovider ${TESTS:-tests/test_offload.py \
    tests/test_qwen35moe.py tests/test_moe_gpu.py tests/test_host_link.py} > "$OUT/tests.txt" 2>&1
  grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/tests.txt" | cut -c1-240 | tail -20
  timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_cpu_experts.py 2>&1 | tail -1
  idle
  timeout ${PROF_S:-250} python3 bench/profile_offload.py $M30 --slots ${SLOTS:-0,24} --shares ${SHARES:-auto,0} \
    --cpu ${CPUS:-pool,planes1} -n ${NTOK:-32} -p 512 --top 12 2>&1 | grep -v Warn | tee "$OUT/profile-offload.txt" \
    | grep -E "^(offload|cpu side|  [a-z ]|[a-z0-9]+ +[0-9]+ +[0-9.]+ +[0-9.]+ +[0-9.]+ +[0-9.]+ +[0-9]+$)|Error|error" | tail -80
  idle ;;
bench)
  synth qwen3moe-30b-a3b $M30 Q4_K_M qwen2
  idle; L=""; [ -x /tmp/lc/llama-bench ] && L="--vs-llama /tmp/lc/llama-bench"
  timeout ${BENCH_S:-540} python3 -m deimos bench $M30 -p 512 -n 128 -r 3 --gpu-mem 8 $L --json "$OUT/moe-8g.json" 2>&1 \
    | grep -v Warn | tee "$OUT/moe-8g.txt" | tail -30
  idle ;;
all)
  synth qwen3moe-30b-a3b $M30 Q4_K_M qwen2
  idle
  timeout ${PROF_S:-230} python3 bench/profile_offload.py $M30 --slots ${SLOTS:-0,24} --shares ${SHARES:-auto,tune,0.8,1} \
    --cpu ${CPUS:-pool} -n ${NTOK:-48} -p 512 --top 8 2>&1 | grep -v Warn > "$OUT/profile-offload.txt"
  grep -E "^(offload|cpu side)|^  (timed|host|    cpu|      ggml|      act)" "$OUT/profile-offload.txt" | cut -c1-160 | tail -50
  idle; L=""; [ -x /tmp/lc/llama-bench ] && L="--vs-llama /tmp/lc/llama-bench"
  timeout ${BENCH_S:-300} python3 -m deimos bench $M30 -p 512 -n 128 -r 3 --gpu-mem 8 $L --llama-args "${LARGS:--ngl 99 -fa 1 -t 16 -ncmoe 33}" \
    --json "$OUT/moe-8g.json" 2>&1 | grep -v Warn | tee "$OUT/moe-8g.txt" | tail -30
  idle
  sed -n '/^cpu side  slots/,$p' "$OUT/profile-offload.txt" ;;
*) echo "usage: $0 tests|bench|all" >&2; exit 2 ;;
esac
