#!/usr/bin/env bash
# Session 50's GPU round (from the repository root on the GPU machine; carry .whl .peer/tdz
# .peer/lc .peer/base, .peer/base a git archive of dd741d0: deimos bench/engine_batch.py):
#   bench/gpu_round_s50.sh first   # llama 8B Q4_K_M at 16 / 64 requests at once, this tree
#     (Q4_K's 5..32-row steps through mmq) against dd741d0; the fp16 matmul at prefill's rows
#     against cuBLAS; the dense Q4_K products at 16-64 rows; where a 2,048-token prefill goes
#   bench/gpu_round_s50.sh diag   # where a 16 / 64-row decode step goes; fp16 tiles at 16-64 rows;
#     bench/exp_matmul_tma.py at 512 / 2,048 rows; mmq's SWAP / JOIN at 32 / 64 rows an expert
. bench/gpu_env.sh
case "${1:-}" in
first)
  setup; idle | say
  synth llama-8b $M8 Q4_K_M llama-bpe
  timeout ${BATCH_S:-150} python3 bench/engine_batch.py $M8 -c 16,64 -n 128 > "$OUT/l8-batch-new.txt" 2>&1
  grep -E "^\| (default|greedy)" "$OUT/l8-batch-new.txt" | sed "s/^/new /" | say
  timeout ${SWEEP_S:-120} python3 bench/sweep_dense.py -m 512 2048 > "$OUT/sweep-dense.txt" 2>&1
  grep -E "^ *[0-9]+ " "$OUT/sweep-dense.txt" | say
  timeout ${EXP_S:-120} python3 bench/exp_gemm_dense_mmq.py 28672x4096 4096x14336 6144x4096 --rows 16,32,48,64 \
    > "$OUT/dense-mmq.txt" 2>&1
  grep -E "^\| [0-9]" "$OUT/dense-mmq.txt" | say
  base timeout ${BATCH_S:-150} python3 bench/engine_batch.py $M8 -c 16,64 -n 128 > "$OUT/l8-batch-base.txt" 2>&1
  grep -E "^\| (default|greedy)" "$OUT/l8-batch-base.txt" | sed "s/^/base /" | say
  timeout ${PROF_S:-100} python3 bench/profile_prefill.py $M8 -p 2048 --top 14 --gaps 4 > "$OUT/prof-prefill.txt" 2>&1
  idle | say ;;
diag)  # where a 16 / 64-row llama 8B decode step goes; the fp16 matmul's tiles at 16-64 rows;
  # the TMA matmul at prefill's rows against cuBLAS; mmq's SWAP / JOIN at 64 rows an expert
  setup; idle | say
  synth llama-8b $M8 Q4_K_M llama-bpe
  timeout ${PROF_S:-90} python3 bench/profile_step.py $M8 -b 16,64 --steps 10 --top 16 > "$OUT/prof-step.txt" 2>&1
  timeout ${TMA_S:-90} python3 bench/exp_matmul_tma.py -m 512 2048 > "$OUT/tma.txt" 2>&1
  grep -E "^\| [0-9]" "$OUT/tma.txt" | say
  for v in 0 1; do
    DEIMOS_MATMUL_TMA=$v timeout ${BATCH_S:-75} python3 bench/engine_batch.py $M8 -c 16,64 -n 128 > "$OUT/l8-batch-tma$v.txt" 2>&1
    grep -E "^\| (default|greedy)" "$OUT/l8-batch-tma$v.txt" | sed "s/^/tma=$v /" | say
  done
  DEIMOS_MATMUL_TMA=1 timeout ${PROF_S:-60} python3 bench/profile_prefill.py $M8 -p 2048 --top 8 --gaps 2 > "$OUT/prof-prefill-tma.txt" 2>&1
  grep -E "_matmul|wall" "$OUT/prof-prefill-tma.txt" | cut -c1-60,150-200 | say
  timeout ${SWEEP_S:-60} python3 bench/sweep_dense.py -m 16 32 64 > "$OUT/sweep-dense-small.txt" 2>&1
  grep -E "^ *[0-9]+ " "$OUT/sweep-dense-small.txt" | say
  timeout ${EXP_S:-60} python3 bench/exp_gemm_mmq.py 196608x2048 --rows 32,64 --only elements,gemm_q > "$OUT/join.txt" 2>&1
  grep -E "x[0-9]+:|M=" "$OUT/join.txt" | cut -c1-100 | say
  idle | say ;;
last)  # diag's first two parts, for little device time: the TMA matmul at 2,048 rows, then
  # where a 16 / 64-row decode step goes
  setup; idle | say
  (synth llama-8b $M8 Q4_K_M llama-bpe) &
  timeout ${TMA_S:-70} python3 bench/exp_matmul_tma.py -m 2048 > "$OUT/tma.txt" 2>&1
  grep -E "^\| [0-9]" "$OUT/tma.txt" | say
  wait
  timeout ${PROF_S:-90} python3 bench/profile_step.py $M8 -b 16,64 --steps 10 --top 16 > "$OUT/prof-step.txt" 2>&1
  idle | say ;;
*) echo "usage: $0 first|diag|last" >&2; exit 2 ;;
esac
