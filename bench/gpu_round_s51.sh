#!/usr/bin/env bash
# Session 51's GPU rounds (from the repository root on the GPU machine; carry .whl .peer/tdz .peer/lc,
# second also .peer/base):
#   bench/gpu_round_s51.sh first   # the TMA matmul at prefill's rows against the pointer loads and
#     cuBLAS; mmq's 64-row tiles (plain / SWAP / JOIN) against the fp16 copy; where a 16 / 64-row
#     llama 8B decode step goes (fp16 copies on and off); llama 8B at 16 / 64 requests, TMA off / on
. bench/gpu_env.sh
case "${1:-}" in
first)
  setup; idle | say
  (synth llama-8b $M8 Q4_K_M llama-bpe) &
  timeout ${TMA_S:-100} python3 bench/exp_matmul_tma.py -m 512 2048 > "$OUT/tma.txt" 2>&1
  grep -E "^\| [0-9]" "$OUT/tma.txt" | say
  timeout ${EXP_S:-110} python3 bench/exp_gemm_mmq.py 28672x4096 --rows 64 --only "m64 n,gemm_q,torch" \
    > "$OUT/mmq64.txt" 2>&1
  grep -E "M=" "$OUT/mmq64.txt" | cut -c1-100 | say
  wait
  timeout ${PROF_S:-90} python3 bench/profile_step.py $M8 -b 16,64 --steps 10 --top 16 > "$OUT/prof-step.txt" 2>&1
  timeout ${PROF_S:-60} python3 bench/profile_step.py $M8 -b 64 --steps 10 --top 10 --dense-weights off \
    > "$OUT/prof-step-q.txt" 2>&1
  for v in 0 1; do
    DEIMOS_MATMUL_TMA=$v timeout ${BATCH_S:-75} python3 bench/engine_batch.py $M8 -c 16,64 -n 128 > "$OUT/l8-batch-tma$v.txt" 2>&1
    grep -E "^\| (default|greedy)" "$OUT/l8-batch-tma$v.txt" | sed "s/^/tma=$v /" | say
  done
  idle | say ;;
second)  # this session's changes on the GPU: the kernels' and whole models' GPU tests, then llama 8B
  # at 16 / 64 requests against the session start (carry .peer/base: git archive 086b9ac deimos
  # bench/engine_batch.py bench/profile_prefill.py) and with each change switched off; where a
  # 2,048-token prompt goes; a 16 / 64-row decode step's kernels without PDL (their own times)
  setup; idle | say
  (synth llama-8b $M8 Q4_K_M llama-bpe) &
  timeout ${TEST_S:-150} python3 -m pytest -q -rfE -m gpu -p no:cacheprovider tests/test_triton_matmul.py \
    tests/test_triton_matmul_gated.py tests/test_gpu_model.py "tests/test_triton_gemm_q.py::test_gemm_q_gpu" \
    -k "not IQ2_XS and not Q2_K and not Q3_K and not real and not generate" > "$OUT/tests.txt" 2>&1
  tail -3 "$OUT/tests.txt" | say
  wait
  for who in base new mmqe0 tma0; do
    case $who in
    base) base timeout ${BATCH_S:-75} python3 bench/engine_batch.py $M8 -c 16,64 -n 128 > "$OUT/l8-$who.txt" 2>&1 ;;
    new) timeout ${BATCH_S:-75} python3 bench/engine_batch.py $M8 -c 16,64 -n 128 > "$OUT/l8-$who.txt" 2>&1 ;;
    mmqe0) DEIMOS_MMQ_ELEMENTS=0 timeout ${BATCH_S:-75} python3 bench/engine_batch.py $M8 -c 16,64 -n 128 > "$OUT/l8-$who.txt" 2>&1 ;;
    tma0) DEIMOS_MATMUL_TMA=0 timeout ${BATCH_S:-75} python3 bench/engine_batch.py $M8 -c 16,64 -n 128 > "$OUT/l8-$who.txt" 2>&1 ;;
    esac
    grep -E "^\| (default|greedy)" "$OUT/l8-$who.txt" | sed "s/^/$who /" | say
  done
  timeout ${PROF_S:-60} python3 bench/profile_prefill.py $M8 -p 2048 --top 10 --gaps 2 > "$OUT/prof-prefill.txt" 2>&1
  grep -E "wall|tok/s" "$OUT/prof-prefill.txt" | head -3 | say
  DEIMOS_PDL=0 timeout ${PROF_S:-90} python3 bench/profile_step.py $M8 -b 16,64 --steps 10 --top 14 > "$OUT/prof-step-nopdl.txt" 2>&1
  grep -E "a step" "$OUT/prof-step-nopdl.txt" | say
  timeout ${PROF_S:-60} python3 bench/profile_step.py $M8 -b 64 --steps 10 --top 10 --dense-weights off \
    > "$OUT/prof-step-q.txt" 2>&1
  grep -E "a step" "$OUT/prof-step-q.txt" | sed "s/^/no copies: /" | say
  timeout ${EXP_S:-60} python3 bench/exp_gemm_dense_mmq.py 28672x4096 4096x14336 6144x4096 4096x4096 --rows 48,64 \
    > "$OUT/dense-mmq.txt" 2>&1
  grep -E "^\| [0-9]" "$OUT/dense-mmq.txt" | say
  idle | say ;;
tests)  # the GPU tests second's time limit cut: gemm_q's at real shapes for the K-quants (Q4_K's
  # 64-row SWAP + JOIN rule, x in element order), a whole qwen3moe-tiny (moe_gemm through mmq_product)
  setup
  timeout ${TEST_S:-240} python3 -m pytest -q -rfE -m gpu -p no:cacheprovider "tests/test_triton_gemm_q.py::test_gemm_q_gpu" \
    tests/test_moe_gpu.py -k "Q4_K or Q5_K or Q6_K or moe" > "$OUT/tests2.txt" 2>&1
  tail -4 "$OUT/tests2.txt" ;;
attn)  # the decode attention's tiles, warps, stages and splits at llama 8B's heads, 16 and 64 rows
  # of ~600 keys in a 1,024-key table (what engine_batch's steps run)
  setup
  for b in 64 16; do
    timeout ${SWEEP_S:-85} python3 bench/sweep_decode_attention.py --heads 32,8,128 -b $b --pos 600 --width 1024 \
      --budget ${BUDGET:-70} > "$OUT/attn-b$b.txt" 2>&1
    echo "B=$b"; grep -E "rule|^best|^\| 600" "$OUT/attn-b$b.txt" | head -9
  done ;;
*) echo "usage: $0 first|second|tests|attn" >&2; exit 2 ;;
esac
