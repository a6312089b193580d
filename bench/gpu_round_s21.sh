#!/usr/bin/env bash
# This session's GPU rounds (run from the repository root on the GPU machine):
#   bench/gpu_round_s21.sh tests   # GPU tests never run or never read (MoE, offload, gemv_rows, qwen35);
#                                  # the 8B file is made meanwhile (CPU only)
#   bench/gpu_round_s21.sh small   # gemv_rows' sweep at 2/4/8 rows; kernels a decode step at B = 1, 4, 16
#   bench/gpu_round_s21.sh check   # the changed kernels' GPU tests; the step profile (PDL on and
#                                  # off); deimos serve at 1, 16 and 64 streams
#   bench/gpu_round_s21.sh final   # tests of what landed; deimos bench; 2/4 streams
#   bench/gpu_round_s21.sh agent   # the agent sessions against llama-server (carry
#                                  # .peer/llama-cuda-sm90.tar.xz; .whl stays from the call before)
. bench/gpu_env.sh
bench/gpu_round_batch.sh setup > /dev/null 2>&1
case "${1:-}" in
tests)
  (synth llama-8b $M8 Q4_K_M llama-bpe) &
  timeout 420 python3 -m pytest -v -rfE --timeout 150 -p no:cacheprovider tests/test_moe_gpu.py \
    tests/test_offload.py tests/test_triton_gemv_rows.py tests/test_placement.py \
    tests/test_qwen35_gpu.py tests/test_triton_gated_delta.py 2>&1 | tee "$OUT/tests.txt" \
    | grep -E "PASSED|FAILED|ERROR|^E  " | cut -c1-200 | head -70
  wait; ls -la /tmp/m ;;
small)
  synth llama-8b $M8 Q4_K_M llama-bpe; idle
  for r in 2 4 8; do timeout 100 python3 bench/sweep_gemv.py $M8 --rows $r --quick 2>&1 | tail -7; done
  timeout 200 python3 bench/profile_step.py $M8 -b 1,4,16 --greedy 2>&1 | grep -v Warn | tee "$OUT/profile.txt" | tail -45; idle ;;
check)
  (synth llama-8b $M8 Q4_K_M llama-bpe) &
  timeout 240 python3 -m pytest -v -rfE --timeout 120 -p no:cacheprovider tests/test_triton_paged_attention.py \
    tests/test_sample_batch.py tests/test_engine_kernels.py tests/test_triton_kernels.py -k \
    "paged or decode or sample or topk or argmax or engine" > "$OUT/tests.txt" 2>&1
  grep -E "FAILED|ERROR|passed|failed" "$OUT/tests.txt" | cut -c1-200 | tail -15
  wait; idle
  timeout 150 python3 bench/profile_step.py $M8 -b 1,16 --greedy 2>&1 | grep -v Warn > "$OUT/profile.txt"
  DEIMOS_PDL=0 timeout 120 python3 bench/profile_step.py $M8 -b 1 --greedy 2>&1 | grep -v Warn > "$OUT/profile-nopdl.txt"
  grep -A14 "^B=" "$OUT/profile.txt" "$OUT/profile-nopdl.txt" | cut -c1-120
  LEVELS=1,16,64 bash bench/gpu_round_14b.sh serve 2>&1 | tail -12 ;;
final)
  # the tests of what landed since `check`; batch-1 through deimos bench; 2 and 4 streams
  # (gemv_rows); the agent sessions against llama-server (tools in the system prompt on both)
  (synth llama-8b $M8 Q4_K_M llama-bpe) &
  timeout 240 python3 -m pytest -v -rfE --timeout 100 -p no:cacheprovider tests/test_engine_kernels.py \
    tests/test_placement.py tests/test_moe_gpu.py tests/test_speculate.py tests/test_triton_gemv_rows.py \
    tests/test_qwen35_gpu.py tests/test_qwen35moe.py tests/test_qwen3next.py tests/test_triton_paged_attention.py \
    -k "not tiles and not every_format" > "$OUT/tests.txt" 2>&1
  grep -E "FAILED|ERROR|passed|failed" "$OUT/tests.txt" | cut -c1-200 | tail -15
  wait; idle
  timeout 100 python3 -m deimos bench $M8 -p 512 -n 128 -r 3 2>&1 | grep -v Warn | tail -4
  LEVELS=2,4 bash bench/gpu_round_14b.sh serve 2>&1 | grep -E "^\| [0-9]" ;;
agent)
  synth llama-8b $M8 Q4_K_M llama-bpe; idle
  for who in deimos llama; do
    if [ $who = deimos ]; then
      python3 -m deimos serve $M8 --listen 127.0.0.1:8092 --no-tui -c 40960 > "$OUT/agent-deimos.log" 2>&1 &
    else
      /tmp/lc/llama-server -m $M8 -ngl 99 -fa on -np 1 -c 40960 --jinja --host 127.0.0.1 --port 8092 \
        > "$OUT/agent-llama.log" 2>&1 &
    fi
    S=$!
    for i in $(seq 240); do curl -sf 127.0.0.1:8092/health > /dev/null && break; sleep 1; done
    for sess in ${SESSIONS:-multi-turn long-prompt}; do
      timeout 150 python3 -m deimos bench agent $sess --url http://127.0.0.1:8092 --tools-in-system \
        --json "$OUT/agent-$who-$sess.json" > "$OUT/agent-$who-$sess.txt" 2>&1
      echo "$who $sess"; grep -A3 "wall s" "$OUT/agent-$who-$sess.txt" | head -4
    done
    kill -INT $S; sleep 2; kill $S 2>/dev/null; wait $S; idle
  done ;;
*) echo "usage: $0 tests|small|check|final|agent" >&2; exit 2 ;;
esac
