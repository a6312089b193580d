#!/usr/bin/env bash
# Session 47's GPU rounds (from the repository root on the GPU machine; carry .whl .peer/tdz
# .peer/base, .peer/base a git archive of 5f0a8b6: deimos, bench/engine_batch.py):
#   bench/gpu_round_s47.sh a   # the GPU tests of session 46's kernels (the decode attention's
#     merge, the experts' sum in the norm); qwen3moe 30B-A3B batch-1 decode: 5f0a8b6, this
#     tree (DEIMOS_ATTN_MERGE=0 and 1), this tree with DEIMOS_MOE_DEFER=0; then the quantized
#     GEMMs under Nsight Compute where the machine has it (bench/gemm_parts.py: stalls, pipes)
#   bench/gpu_round_s47.sh b   # the variants a fresh kernel cache builds inside the first
#     requests (after 852f2af's warm-up fix); qwen3 4B batch-1 decode, 5f0a8b6 against this
#     tree's merge 0 and 1; the prefill MoE GEMM's tiles at qwen3moe's shapes (never swept);
#     qwen35moe 35B-A3B batch-1, 5f0a8b6 against this tree
#   bench/gpu_round_s47.sh serve   # deimos serve on llama 8B at 1, 16, 64 streams
. bench/gpu_env.sh
Q3=/tmp/m/qwen3-4b-Q4_K_M-qwen3.gguf
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
prof() {  # prof WHICH [ARGS]: one launch under ncu, its headline metrics
  [ -n "$NCU" ] || { echo "no ncu on this machine" | say; return; }
  timeout 120 $NCU -k regex:"gemm" --launch-skip 1 --launch-count 1 --section SpeedOfLight \
    --section WarpStateStats --section Occupancy --section SchedulerStats --section InstructionStats \
    --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --page raw \
    python3 bench/gemm_parts.py --which "$@" > "$OUT/ncu-$1.txt" 2>&1
  grep -E "gpu__time_duration.sum|dram__throughput.avg.pct_of_peak_sustained_elapsed|sm__throughput.avg.pct|sm__warps_active.avg.pct|smsp__issue_active.avg.pct|issue_stalled_[a-z_]*_per_issue_active|inst_executed_pipe_[a-z_]*.avg.pct|pipe_tensor[a-z_]*cycles_active.avg.pct|registers_per_thread|mem_shared.*pct|ERROR" \
    "$OUT/ncu-$1.txt" | sed "s/^ */$1 /" | cut -c1-150 | say
}
case "${1:-}" in
a)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  idle | say
  (synth qwen3moe-30b-a3b $M30 Q4_K_M qwen2) &
  gputests "merge or fused_new or in_the_norm or deferred or combine or whole or engine or graphs or gpu" \
    tests/test_triton_paged_attention.py tests/test_moe_gpu.py tests/test_triton_moe.py tests/test_engine_kernels.py
  wait; idle
  b1n $M30 q3moe30 new 0; b1n $M30 q3moe30 new 1; [ "${BASE:-1}" = 0 ] || b1n $M30 q3moe30 base 0
  DEIMOS_MOE_DEFER=0 b1n $M30 q3moe30-nodefer new 0
  python3 bench/gemm_parts.py --which moe --time 2>&1 | tail -1 | say
  python3 bench/gemm_parts.py --which gemm_q --rows 16 --time 2>&1 | tail -1 | say
  prof moe; prof gemm_q --rows 16
  idle | say ;;
min)  # the least of a: the GPU tests, then qwen3moe's decode with the sum in the norm on and off
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  idle | say
  (synth qwen3moe-30b-a3b $M30 Q4_K_M qwen2) &
  gputests "merge or in_the_norm or deferred or combine or shared or gpu" tests/test_triton_paged_attention.py tests/test_moe_gpu.py tests/test_triton_moe.py
  wait; b1n $M30 q3moe30 new 0; DEIMOS_MOE_DEFER=0 b1n $M30 q3moe30-nodefer new 0
  idle | say ;;
b)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  idle | say
  M35=/tmp/m/qwen35moe-35b-Q4_K_M.gguf
  (synth qwen35moe-35b-a3b $M35 Q4_K_M qwen2) &
  python3 -m deimos synth qwen3-4b $Q3 --type Q4_K_M --vocab-from "$V/ggml-vocab-qwen2.gguf" > /dev/null
  TRITON_CACHE_DIR=/tmp/tc-fresh2 timeout ${BATCH_S:-150} python3 bench/engine_batch.py $Q3 -c 16,64 -n 128 --compiles \
    > "$OUT/q3-batch-compiles.txt" 2>&1
  grep -E "^\| " "$OUT/q3-batch-compiles.txt" | cut -c1-700 | say
  b1n $Q3 q3-4b new 0; b1n $Q3 q3-4b new 1; b1n $Q3 q3-4b base 0
  timeout 100 python3 bench/sweep_moe_gemm.py --arch qwen3moe --down Q6_K --budget 80 > "$OUT/sweep-moe-q3.txt" 2>&1
  grep -E "^\\| (gate|down)|WRONG" "$OUT/sweep-moe-q3.txt" | say
  wait; b1n $M35 q35moe new 0; b1n $M35 q35moe base 0
  idle | say ;;
serve)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  synth llama-8b $M8 Q4_K_M llama-bpe; idle | say
  python3 -m deimos serve $M8 --listen 127.0.0.1:8090 --no-tui -c 1024 > "$OUT/deimos-serve.log" 2>&1 &
  D=$!
  for i in $(seq 150); do curl -sf 127.0.0.1:8090/health > /dev/null && break; kill -0 $D 2>/dev/null || break; sleep 1; done
  timeout ${DS_S:-200} python3 -m deimos bench serve --url http://127.0.0.1:8090 --concurrency ${DLEVELS:-1,16,64} \
    --prompt-tokens 512 --max-tokens 128 --json "$OUT/serve-deimos.json" 2>&1 | grep -E "^\| *[0-9]" | sed 's/^/deimos /' | say
  kill -INT $D; wait $D; idle | say ;;
*) echo "usage: $0 a|min|b|serve" >&2; exit 2 ;;
esac
