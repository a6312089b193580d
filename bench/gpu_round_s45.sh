#!/usr/bin/env bash
# Session 45's GPU round (from the repository root on the GPU machine; carry .whl .peer/td-q):
#   bench/gpu_round_s45.sh ahead
#     the GPU tests of the weight GEMVs' loads before the PDL wait (gemv_q8, the MoE down
#     projection, the router), then decode A/B in separate processes (the switch is read at
#     import): DEIMOS_PDL_AHEAD=1/0 on qwen3 4B Q4_K_M, and on qwen3moe 30B-A3B Q4_K_M with
#     DEIMOS_MOE_FUSED=0 (torch's router product + moe_route) and =router (one launch)
#   SETS="0:1 base router:1 0:0" bench/gpu_round_s45.sh moe30   # carry as ab
#     qwen3moe 30B-A3B Q4_K_M's deimos bench rounds (FUSED:AHEAD, or "base": the session's
#     start), then its step's kernels with PDL off
#   bench/gpu_round_s45.sh all  # carry as ab: the tests, qwen3moe 30B and qwen3 4B against the
#     session's start in one call (bench rounds in fresh processes, 2 rounds each)
#   bench/gpu_round_s45.sh ab   # carry .whl .peer/td-q .peer/base (git archive of the session's
#     start, 6560722: deimos, bench/engine_batch.py, bench/profile_step.py)
#     the GPU tests of the ahead loads and the batch's float16 rows, then the session's start
#     against this tree on qwen3 4B Q4_K_M: deimos bench (batch 1) and bench/engine_batch.py
#     (16 and 64 requests, default sampling and greedy), each in a fresh process
. bench/gpu_env.sh
Q3=/tmp/m/qwen3-4b-Q4_K_M-qwen3.gguf
inst() {
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
}
# tg MODEL TAG FUSED AHEAD: deimos bench's decode rounds in a fresh process
tg() {
  local J="$OUT/bench-$2-f$3-a$4-$RANDOM.json"
  DEIMOS_MOE_FUSED=$3 DEIMOS_PDL_AHEAD=$4 timeout ${BENCH_S:-150} python3 -m deimos bench $1 -p 512 -n 128 -r 3 \
    --json "$J" > "${J%.json}.txt" 2>&1
  python3 -c "import json,sys; r=json.load(open(sys.argv[1])); e=r.get('bench', r)['engines'][0]; p,d=e['prefill'],e['decode']; \
print(f\"{sys.argv[2]} fused={sys.argv[3]} ahead={sys.argv[4]}: pp512 {p['mean']:.1f} tg128 {d['mean']:.2f} \
(best {d['max']:.2f}, {e['decode_bytes_per_s']/1e9:.0f} GB/s)\")" "$J" $2 $3 $4 2>&1 | tail -1
}
# base CMD...: CMD run in the session start's tree (.peer/base), its own kernel cache
base() { (cd .peer/base && TRITON_CACHE_DIR=/tmp/tc-base PYTHONPATH=/tmp/site:$PWD "$@"); }
# b1 MODEL TAG WHO: deimos bench at batch 1 in the tree WHO (new: this one; base: .peer/base)
b1() {
  local J="$OUT/$2-$3-$RANDOM.json"
  if [ $3 = base ]; then base timeout ${BENCH_S:-150} python3 -m deimos bench $1 -p 512 -n 128 -r ${R:-3} --json $J > ${J%.json}.txt 2>&1
  else timeout ${BENCH_S:-150} python3 -m deimos bench $1 -p 512 -n 128 -r ${R:-3} --json $J > ${J%.json}.txt 2>&1; fi
  python3 -c "import json,sys; r=json.load(open(sys.argv[1])); e=r.get('bench', r)['engines'][0]; \
print(sys.argv[2], sys.argv[3], 'fused=%s: pp512 %.1f tg128 %.2f' % (sys.argv[4], e['prefill']['mean'], e['decode']['mean']))" \
    $J $2 $3 ${DEIMOS_MOE_FUSED:-0} 2>&1 | tail -1 | tee -a "$OUT/summary.txt"
}
case "${1:-}" in
all)
  # one call: the tests, then qwen3moe 30B (this tree, the start's, the one-launch router),
  # qwen3 4B at batch 1 and 16 / 64 requests, each against the session's start
  inst; idle
  (python3 -m deimos synth qwen3-4b $Q3 --type Q4_K_M --vocab-from "$V/ggml-vocab-qwen2.gguf" > /dev/null) &
  (synth qwen3moe-30b-a3b $M30 Q4_K_M qwen2) &
  timeout ${TEST_S:-150} python3 -m pytest -q -rfE -p no:cacheprovider tests/test_triton_gemv_q8.py \
    tests/test_triton_matmul.py tests/test_triton_kernels.py tests/test_engine_kernels.py tests/test_moe_gpu.py \
    -k "ahead or half or quantized or engine or graphs or grammar or moe" > "$OUT/tests.txt" 2>&1
  grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/tests.txt" | cut -c1-250 | tail -8 | tee -a "$OUT/summary.txt"
  wait; idle
  R=2 b1 $M30 q3moe30 new; R=2 b1 $M30 q3moe30 base; DEIMOS_MOE_FUSED=router R=2 b1 $M30 q3moe30 new
  R=2 b1 $Q3 q3-4b new; R=2 b1 $Q3 q3-4b base
  for who in new base; do
    if [ $who = new ]; then timeout 120 python3 bench/engine_batch.py $Q3 -c 16,64 -n 128 > "$OUT/q3-batch-$who.txt" 2>&1
    else base timeout 120 python3 bench/engine_batch.py $Q3 -c 16,64 -n 128 > "$OUT/q3-batch-$who.txt" 2>&1; fi
    grep -E "^\| (default|greedy)" "$OUT/q3-batch-$who.txt" | sed "s/^/$who /" | tee -a "$OUT/summary.txt"
  done
  idle ;;
ab)
  inst; idle
  (python3 -m deimos synth qwen3-4b $Q3 --type Q4_K_M --vocab-from "$V/ggml-vocab-qwen2.gguf" > /dev/null) &
  timeout ${TEST_S:-200} python3 -m pytest -q -rfE -m gpu -p no:cacheprovider tests/test_triton_gemv_q8.py \
    tests/test_triton_matmul.py tests/test_triton_kernels.py -k "ahead or half or quantized" > "$OUT/tests.txt" 2>&1
  grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/tests.txt" | cut -c1-250 | tail -8
  # the engine on the GPU: 5-row steps (the float16 rows), DeviceRows' one packed copy
  timeout ${TEST_S:-200} python3 -m pytest -q -rfE -m gpu -p no:cacheprovider tests/test_engine_kernels.py \
    > "$OUT/tests-engine.txt" 2>&1
  grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/tests-engine.txt" | cut -c1-250 | tail -8
  wait; idle
  for who in new base new base; do
    J="$OUT/q3-b1-$who-$RANDOM.json"
    if [ $who = new ]; then timeout 120 python3 -m deimos bench $Q3 -p 512 -n 128 -r 3 --json $J > ${J%.json}.txt 2>&1
    else base timeout 120 python3 -m deimos bench $Q3 -p 512 -n 128 -r 3 --json $J > ${J%.json}.txt 2>&1; fi
    python3 -c "import json,sys; e=json.load(open(sys.argv[1]))['engines'][0]; \
print(sys.argv[2], 'b1: pp512 %.1f tg128 %.2f' % (e['prefill']['mean'], e['decode']['mean']))" $J $who
  done
  for who in new base; do
    if [ $who = new ]; then timeout 150 python3 bench/engine_batch.py $Q3 -c 16,64 -n 128 > "$OUT/q3-batch-$who.txt" 2>&1
    else base timeout 150 python3 bench/engine_batch.py $Q3 -c 16,64 -n 128 > "$OUT/q3-batch-$who.txt" 2>&1; fi
    grep -E "^\| (default|greedy)" "$OUT/q3-batch-$who.txt" | sed "s/^/$who /"
  done
  idle ;;
ahead)
  inst; idle
  (python3 -m deimos synth qwen3-4b $Q3 --type Q4_K_M --vocab-from "$V/ggml-vocab-qwen2.gguf" > /dev/null) &
  (synth qwen3moe-30b-a3b $M30 Q4_K_M qwen2) &
  timeout ${TEST_S:-220} python3 -m pytest -q -rfE -m gpu -p no:cacheprovider tests/test_triton_gemv_q8.py \
    tests/test_moe_gpu.py tests/test_triton_moe.py tests/test_triton_moe_decode.py > "$OUT/tests.txt" 2>&1
  grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/tests.txt" | cut -c1-250 | tail -12
  wait; idle
  for a in 1 0 1 0; do tg $Q3 q3-4b 0 $a; done
  for fa in ${SETS:-0:0 router:1}; do tg $M30 q3moe30 ${fa%:*} ${fa#*:}; done
  idle ;;
moe30)
  inst; idle; (synth qwen3moe-30b-a3b $M30 Q4_K_M qwen2)
  for fa in ${SETS:-0:1 base router:1 0:0}; do
    if [ $fa = base ]; then
      J="$OUT/q3moe30-base-$RANDOM.json"
      base timeout ${BENCH_S:-150} python3 -m deimos bench $M30 -p 512 -n 128 -r 3 --json $J > ${J%.json}.txt 2>&1
      python3 -c "import json,sys; r=json.load(open(sys.argv[1])); e=r.get('bench', r)['engines'][0]; \
print('q3moe30 base: pp512 %.1f tg128 %.2f' % (e['prefill']['mean'], e['decode']['mean']))" $J
    else tg $M30 q3moe30 ${fa%:*} ${fa#*:}; fi
  done
  DEIMOS_PDL=0 DEIMOS_MOE_FUSED=${FUSED:-router} timeout 200 python3 bench/profile_step.py $M30 -b 1 --greedy --steps 20 \
    --top 16 2>&1 | grep -v Warn | tee "$OUT/profile-30b.txt" | tail -20
  idle ;;
*) echo "usage: $0 all|ab|ahead|moe30" >&2; exit 2 ;;
esac
