#!/usr/bin/env bash
# Session 49's GPU round (from the repository root on the GPU machine; carry .whl .peer/tdz
# .peer/lc):
#   bench/gpu_round_s49.sh mmq   # the Q4_K product with x loaded whole and reordered in
#     registers (bench/exp_gemm_mmq.py, expert-like stacks); qwen3moe 30B-A3B and qwen35moe
#     35B-A3B pp512 / tg128 with DEIMOS_MOE_MMQ=0 and 1, llama-bench beside qwen3moe; the MoE
#     and norm GPU tests
#   bench/gpu_round_s49.sh dense   # llama 8B, 16 and 64 requests: this tree against dd741d0
#     (carry .peer/base too: git archive dd741d0 deimos bench/engine_batch.py)
#   bench/gpu_round_s49.sh join   # mmq's weights-first (SWAP) and K = 32 (JOIN) dots at 16-64
#     rows against gemm_q (the 64-row tiles, where mmq lost: wgmma waits after every K = 16 dot);
#     Q5_K's mmq (new), Q6_K's (its high bits now one contiguous load), Q8_0's layout (new:
#     Q8_0, IQ4_XS) against gemm_q
#   bench/gpu_round_s49.sh steps   # a 4,096-token qwen3moe prompt in steps of 2,048 (gemm_q's
#     64-row tiles) against 512 (mmq): which prefills faster (TTFT)
#   bench/gpu_round_s49.sh ab   # qwen3moe batch 1: DEIMOS_ATTN_MERGE 0 / 1, DEIMOS_MOE_DEFER=0
#   bench/gpu_round_s49.sh batch   # qwen3moe 30B-A3B, 16 and 64 requests at once, mmq off / on
. bench/gpu_env.sh
M35=/tmp/m/qwen35moe-35b-Q4_K_M.gguf
# b1m MODEL TAG ENV...: deimos bench at batch 1 under ENV (a fresh process); EXTRA: more flags
b1m() {
  local m=$1 tag=$2; shift 2
  local J="$OUT/$tag-$RANDOM.json"
  env "$@" timeout ${BENCH_S:-150} python3 -m deimos bench $m -p 512 -n 128 -r ${R:-2} ${EXTRA:-} --json $J > ${J%.json}.txt 2>&1
  python3 -c "import json,sys; r=json.load(open(sys.argv[1])); es=r.get('bench', r)['engines']; \
print(sys.argv[2], ' | '.join('%s pp512 %.1f tg128 %.2f' % (e.get('engine','?'), e['prefill']['mean'], e['decode']['mean']) for e in es))" \
    $J "$tag $*" 2>&1 | tail -1 | say
}
case "${1:-}" in
mmq)
  setup; idle | say
  (synth qwen3moe-30b-a3b $M30 Q4_K_M qwen2; synth qwen35moe-35b-a3b $M35 Q4_K_M qwen2) &
  timeout ${EXP_S:-150} python3 bench/exp_gemm_mmq.py ${SHAPES:-196608x2048 262144x768} --rows ${ROWS:-16,32,64} > "$OUT/mmq.txt" 2>&1
  grep -E "x[0-9]+:|M=" "$OUT/mmq.txt" | grep -v int8 | cut -c1-100 > "$OUT/mmq-short.txt"
  wait; idle | say
  b1m $M30 q3-mmq0 DEIMOS_MOE_MMQ=0
  EXTRA="--vs-llama /tmp/lc/llama-bench" b1m $M30 q3-mmq1 DEIMOS_MOE_MMQ=1
  b1m $M35 q35-mmq0 DEIMOS_MOE_MMQ=0
  b1m $M35 q35-mmq1 DEIMOS_MOE_MMQ=1
  gputests "mmq or gemm or gpu or norm" tests/test_triton_moe.py tests/test_moe_gpu.py tests/test_triton_gated_norm.py
  idle | say ;;
batch)  # qwen3moe 30B-A3B, 16 and 64 requests at once (bench/engine_batch.py), mmq off and on
  setup; idle | say
  synth qwen3moe-30b-a3b $M30 Q4_K_M qwen2
  for v in 0 1; do
    DEIMOS_MOE_MMQ=$v timeout ${BATCH_S:-200} python3 bench/engine_batch.py $M30 -c 16,64 -n 128 > "$OUT/batch-mmq$v.txt" 2>&1
    grep -E "^\|" "$OUT/batch-mmq$v.txt" | sed "s/^/mmq=$v /" | say
  done
  idle | say ;;
ab)  # session 46's switches at batch 1 on qwen3moe 30B-A3B (attention merge, the sum in the norm)
  setup; idle | say
  synth qwen3moe-30b-a3b $M30 Q4_K_M qwen2
  b1m $M30 q3 DEIMOS_ATTN_MERGE=0; b1m $M30 q3 DEIMOS_ATTN_MERGE=1; b1m $M30 q3 DEIMOS_MOE_DEFER=0
  gputests "merge" tests/test_triton_paged_attention.py
  idle | say ;;
dense)  # llama 8B Q4_K_M, 16 and 64 requests at once and batch 1: this tree (Q4_K's 5..32-row
  # steps through mmq) against .peer/base (a git archive of dd741d0: deimos, bench/engine_batch.py)
  setup; idle | say
  synth llama-8b $M8 Q4_K_M llama-bpe
  timeout ${BATCH_S:-150} python3 bench/engine_batch.py $M8 -c 16,64 -n 128 > "$OUT/l8-batch-new.txt" 2>&1
  grep -E "^\| (default|greedy)" "$OUT/l8-batch-new.txt" | sed "s/^/new /" | say
  base timeout ${BATCH_S:-150} python3 bench/engine_batch.py $M8 -c 16,64 -n 128 > "$OUT/l8-batch-base.txt" 2>&1
  grep -E "^\| (default|greedy)" "$OUT/l8-batch-base.txt" | sed "s/^/base /" | say
  gputests "Q4_K or greedy_matches or mixed_steps" tests/test_triton_gemm_q.py tests/test_engine_kernels.py
  idle | say ;;
join)  # mmq's SWAP / JOIN variants at 16, 32, 64 rows an expert against gemm_q (~3 min)
  setup; idle | say
  timeout ${EXP_S:-240} python3 bench/exp_gemm_mmq.py ${SHAPES:-196608x2048} --rows ${ROWS:-16,32,64} \
    --only elements,gemm_q --q5k --q6k --q8 > "$OUT/join.txt" 2>&1
  grep -E "x[0-9]+:|M=" "$OUT/join.txt" | cut -c1-100 | say
  idle | say ;;
steps)  # qwen3moe 30B-A3B, one 4,096-token prompt in steps of 2,048 tokens (64-row expert
  # tiles: gemm_q) against steps of 512 (32-row tiles: mmq, the experts read 4x as often): TTFT
  setup; idle | say
  synth qwen3moe-30b-a3b $M30 Q4_K_M qwen2
  for mbt in 2048 512; do
    timeout ${BATCH_S:-150} python3 bench/engine_batch.py $M30 -c 1,4 -p 4096 -n 16 --ctx 4352 \
      --max-batch-tokens $mbt > "$OUT/steps-$mbt.txt" 2>&1
    grep -E "^\| (default|greedy)" "$OUT/steps-$mbt.txt" | sed "s/^/max-batch-tokens $mbt /" | say
  done
  idle | say ;;
*) echo "usage: $0 mmq|batch|ab|dense|join|steps" >&2; exit 2 ;;
esac
