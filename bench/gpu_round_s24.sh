#!/usr/bin/env bash
# This session's GPU rounds (run from the repository root on the GPU machine):
#   bench/gpu_round_s24.sh offload   # qwen3moe 30B-A3B with its experts on the host: the CPU's
#                                    # expert throughput (bench/cpu_experts.py), then where an
#                                    # offloaded decode token goes at 0 / 46 / 128 slots a layer
#                                    # (bench/profile_offload.py)
#   bench/gpu_round_s24.sh graphs    # the offload's decode graphs: GPU tests, the profile again,
#                                    # the whole card's decode step
#   bench/gpu_round_s24.sh next      # what this session left unmeasured (see the mode's comment)
# Carry .whl (the server stack) and .whl-ggml/{avx2,avx512} (ggml-python built both ways: the
# one the host's CPU flags allow is installed), .peer/td (the vocabularies). Logs under $OUT.
. bench/gpu_env.sh
bench/gpu_round_batch.sh setup > /dev/null 2>&1
F=$(grep -m1 ^flags /proc/cpuinfo)
if [[ $F == *avx512f* && $F == *avx512_vnni* && $F == *avx512vbmi* && $F == *avx512_bf16* ]] && ls .whl-ggml/avx512/*.whl > /dev/null 2>&1; then G=avx512; else G=avx2; fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl-ggml/$G/*.whl
echo "ggml-python: $G build; $(python3 -c 'import ggml; print("imports")' 2>&1 | tail -1)"
lscpu | grep -E "^Model name|^CPU\(s\)|^Thread|^NUMA node\(s\)" | tr -s ' '
case "${1:-}" in
offload)
  t0=$(date +%s); synth qwen3moe-30b-a3b $M30 Q4_K_M qwen2; echo "synth 30B: $(( $(date +%s) - t0 )) s"
  idle
  timeout 150 python3 bench/cpu_experts.py --quick --reps 3 --threads ${THREADS:-15} 2>&1 | grep -v Warn | tee "$OUT/cpu-experts.txt" | tail -14
  timeout ${PROF_S:-330} python3 bench/profile_offload.py $M30 --slots ${SLOTS:-0,46,128} -n ${NTOK:-16} --top 25 2>&1 \
    | grep -v Warn | tee "$OUT/profile-offload.txt" | grep -E "^(offload|slots|  [a-z ]|[ 0-9]+ +[0-9.]+ +[0-9.]+ +[0-9.]+$)|Error|error" | tail -60
  idle ;;
graphs)
  # the offload's decode graphs: the GPU tests of the handshake and the offload (and the MoE
  # whole-model checks), then the profile by cache size, then the whole card's decode step
  synth qwen3moe-30b-a3b $M30 Q4_K_M qwen2
  timeout ${TEST_S:-200} python3 -m pytest -q -rfE -m gpu --timeout 150 -p no:cacheprovider ${TESTS:-tests/test_host_link.py \
    tests/test_offload.py tests/test_moe_gpu.py} > "$OUT/tests.txt" 2>&1
  grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/tests.txt" | cut -c1-240 | tail -20
  timeout 120 python3 -m pytest -q -rfE -p no:cacheprovider tests/test_host_link.py 2>&1 | tail -2
  idle
  timeout ${PROF_S:-240} python3 bench/profile_offload.py $M30 --slots ${SLOTS:-0,46,128} -n ${NTOK:-32} --top 25 2>&1 \
    | grep -v Warn | tee "$OUT/profile-offload.txt" | grep -E "^(offload|slots|  [a-z ]|[ 0-9]+ +[0-9.]+ +[0-9.]+ +[0-9.]+ +[0-9.]+$)|Error|error" | tail -80
  [ -n "${GPUMEM:-}" ] && idle && timeout 300 python3 -m deimos bench $M30 -p 512 -n 128 -r 3 --gpu-mem 8 \
    --json "$OUT/moe-8g.json" 2>&1 | grep -v Warn | tee "$OUT/moe-8g.txt" | tail -22
  [ -n "${WHOLE:-1}" ] && timeout 120 python3 bench/profile_step.py $M30 -b 1 --greedy --steps 64 --top 3 2>&1 | grep -E "^B=" | sed "s/^/whole card PDL on: /"
  idle ;;
next)
  # what this session could not run (device time): the GPU tests of the last commits (the
  # prompt filling free slots, the hybrid MoE's offloaded graphs), the profile after a prompt
  # that fills the cache, --gpu-mem 8 and the squeeze (llama.cpp's -ncmoe search needs its
  # CUDA build carried in a call of its own first: .peer/lc, over 64 MiB with the rest)
  synth qwen3moe-30b-a3b $M30 Q4_K_M qwen2
  timeout 240 python3 -m pytest -q -rfE -m gpu --timeout 200 -p no:cacheprovider tests/test_offload.py \
    tests/test_qwen35moe.py tests/test_moe_gpu.py > "$OUT/tests.txt" 2>&1
  grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/tests.txt" | cut -c1-240 | tail -20
  idle
  timeout 200 python3 bench/profile_offload.py $M30 --slots 24,46 --shares auto,0.35,0.7 -n 48 -p 512 2>&1 \
    | grep -v Warn | tee "$OUT/profile-offload.txt" | grep -E "^(offload|slots|[ 0-9]+ +[0-9.]+ +[0-9.]+ +[0-9.]+ +[0-9.]+$)" | tail -20
  idle; L=""; [ -x /tmp/lc/llama-bench ] && L="--vs-llama /tmp/lc/llama-bench"
  timeout 420 python3 -m deimos bench $M30 -p 512 -n 128 -r 3 --gpu-mem 8 $L --json "$OUT/moe-8g.json" 2>&1 \
    | grep -v Warn | tee "$OUT/moe-8g.txt" | tail -22
  idle ;;
*) echo "usage: $0 offload|graphs|next" >&2; exit 2 ;;
esac
