#!/usr/bin/env bash
# Session 48's GPU rounds (from the repository root on the GPU machine; carry .whl .peer/tdz
# .peer/base, .peer/base a git archive of 5f0a8b6):
#   bench/gpu_round_s48.sh mmq   # the Q4_K GEMM variants of bench/exp_gemm_mmq.py against
#     gemm_q and a float16 copy's matmul; the MoE GPU tests (mmq.q4k_product in moe_gemm
#     included); qwen3moe 30B-A3B pp512 / tg128 with DEIMOS_MOE_MMQ=0 and 1
#   bench/gpu_round_s48.sh kern   # the kernels alone and the mmq GPU tests (~4 min)
. bench/gpu_env.sh
# b1e TAG ENV...: deimos bench of M30 at batch 1 in this tree under ENV (a fresh process)
b1e() {
  local tag=$1; shift
  local J="$OUT/$tag-$RANDOM.json"
  env "$@" timeout ${BENCH_S:-120} python3 -m deimos bench $M30 -p 512 -n 128 -r ${R:-2} --json $J > ${J%.json}.txt 2>&1
  python3 -c "import json,sys; r=json.load(open(sys.argv[1])); e=r.get('bench', r)['engines'][0]; \
print(sys.argv[2], 'pp512 %.1f tg128 %.2f' % (e['prefill']['mean'], e['decode']['mean']))" $J "$tag $*" 2>&1 | tail -1 | say
}
case "${1:-}" in
mmq)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  idle | say
  (synth qwen3moe-30b-a3b $M30 Q4_K_M qwen2) &
  timeout ${EXP_S:-200} python3 bench/exp_gemm_mmq.py ${SHAPES:-196608x2048 262144x768 28672x4096} --q6k > "$OUT/mmq.txt" 2>&1
  grep -E "x[0-9]+:|M=" "$OUT/mmq.txt" | sort -t' ' -k1,1 -s | cut -c1-100 > "$OUT/mmq-short.txt"
  wait; b1e mmq0 DEIMOS_MOE_MMQ=0; b1e mmq1 DEIMOS_MOE_MMQ=1
  gputests "mmq or gemm or gpu" tests/test_triton_moe.py tests/test_moe_gpu.py
  idle | say ;;
kern)  # the least of mmq: the kernels alone at the expert-like stacks, the mmq GPU tests
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  idle | say
  timeout ${EXP_S:-170} python3 bench/exp_gemm_mmq.py ${SHAPES:-196608x2048} --rows ${ROWS:-16,32} --q6k > "$OUT/mmq.txt" 2>&1
  grep -E "x[0-9]+:|M=" "$OUT/mmq.txt" | cut -c1-100 > "$OUT/mmq-short.txt"
  gputests "mmq" tests/test_triton_moe.py
  idle | say ;;
*) echo "usage: $0 mmq|kern" >&2; exit 2 ;;
esac
