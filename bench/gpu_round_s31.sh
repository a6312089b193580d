#!/usr/bin/env bash
# Session 31's GPU rounds (from the repository root on the GPU machine; carry .whl .peer/td
# .peer/lc):
#   bench/gpu_round_s31.sh a    # the hybrids' GPU tests; qwen35 4B Q4_K_M against llama-bench;
#                               # the second turn of a 20k conversation and where its time goes
#   bench/gpu_round_s31.sh sweep  # the paged prefill attention's tiles and splits
#                               # (bench/sweep_paged_prefill.py)
#   bench/gpu_round_s31.sh fusedmoe  # qwen35moe 35B-A3B Q4_K_M's pp512 and tg128 with each
#                               # DEIMOS_MOE_FUSED setting (0, router, 1): which one-token MoE
#                               # step is fastest at 256 experts
#   bench/gpu_round_s31.sh router  # the one-token router's launches (bench/sweep_router.py)
#   bench/gpu_round_s31.sh moestep  # where qwen35moe 35B-A3B's decode step goes
# The server parts need the server's wheels in .whl (fastapi, starlette, pydantic, pydantic-core,
# annotated-types, annotated-doc, typing-inspection, uvicorn, llguidance, sniffio,
# opentelemetry-api; ../shared/device/README.md) and the llama-bpe vocabulary in .peer/td; the
# whole carry must stay under 64 MiB with the tree (leave the unused vocabularies out).
#   bench/gpu_round_s31.sh serve  # llama 8B Q4_K_M: deimos serve, then llama-server (--parallel
#                               # 64), at DLEVELS / LLEVELS streams, 512-token prompts, 128-token
#                               # answers, default sampling (issue 14)
#   bench/gpu_round_s31.sh turn   # the second turn again (the prefix cache's host work cut)
#   bench/gpu_round_s31.sh next   # what this session wrote after its device time ran out (the
#                               # combine's gated add, moe_gemv_pair): the hybrid and MoE GPU
#                               # tests, qwen35moe 35B-A3B against llama-bench, its decode step
#   bench/gpu_round_s31.sh agent  # the multi-turn agent session on both servers, Hermes-3's
#                               # tool-use template on the file, the tools as a field (issue 17)
. bench/gpu_env.sh
export DEIMOS_TEST_DATA=/tmp/td
Q4=/tmp/m/qwen35-4b-Q4_K_M.gguf
M35=/tmp/m/qwen35moe-35b-Q4_K_M.gguf
gputests() {
  timeout ${TEST_S:-240} python3 -m pytest -q -rfE -m gpu -p no:cacheprovider tests/test_triton_gdn_inputs.py \
    tests/test_triton_gated_norm.py tests/test_triton_gated_delta.py tests/test_qwen35_gpu.py \
    tests/test_qwen35_state_pool.py tests/test_speculate.py tests/test_triton_output_gate.py \
    tests/test_triton_shared_gate.py -k "not smol and not keeps_the_greedy" 2>&1 | cut -c1-220 | tail -8
}
case "${1:-}" in
a)
  setup; idle; gputests
  synth qwen35-4b $Q4 Q4_K_M qwen2; idle
  timeout ${BENCH_S:-200} python3 -m deimos bench $Q4 -p 512 -n 128 -r 3 --vs-llama /tmp/lc/llama-bench 2>&1 \
    | grep -v Warn | tee "$OUT/qwen35-4b.txt" | tail -8
  timeout ${TURN_S:-120} python3 bench/turn_ttft.py $Q4 --ctx 20000 -r 3 2>&1 | grep -v Warn | tee "$OUT/turn.txt" | tail -4
  timeout ${PREFIX_S:-120} python3 bench/profile_prefix.py $Q4 --ctx 2048,20000 -n 150 2>&1 | grep -v Warn \
    | tee "$OUT/prefix.txt" | tail -30
  idle ;;
sweep)
  setup; idle
  timeout ${SWEEP_S:-260} python3 bench/sweep_paged_prefill.py --budget ${BUDGET:-230} 2>&1 | grep -v Warn \
    > "$OUT/sweep-prefill.txt"; grep "^best" "$OUT/sweep-prefill.txt"; sed -n '/^| case/,$p' "$OUT/sweep-prefill.txt"
  idle ;;
fusedmoe)
  setup; synth qwen35moe-35b-a3b $M35 Q4_K_M qwen2; idle
  for f in ${FUSED_SET:-0 router 1}; do
    echo "DEIMOS_MOE_FUSED=$f"
    DEIMOS_MOE_FUSED=$f timeout ${BENCH_S:-100} python3 -m deimos bench $M35 -p 512 -n 128 -r 2 2>&1 | grep -v Warn \
      | grep -E "pp512|tg128"
  done; idle ;;
router)
  setup; timeout ${ROUTER_S:-150} python3 bench/sweep_router.py --shapes ${SHAPES:-qwen35moe,qwen3moe} 2>&1 | grep -v Warn \
    | tee "$OUT/sweep-router.txt" | sed -n '/^| shape/,$p' ;;
moestep)
  setup; synth qwen35moe-35b-a3b $M35 Q4_K_M qwen2; idle
  timeout 150 python3 bench/profile_step.py $M35 -b 1 --steps 20 2>&1 | grep -v Warn | cut -c1-160 \
    | tee "$OUT/moe-step.txt" | tail -${STEP_N:-30} ;;
serve)
  setup; synth llama-8b $M8 Q4_K_M llama-bpe; idle
  python3 -m deimos serve $M8 --listen 127.0.0.1:8090 --no-tui -c 1024 > "$OUT/deimos-serve.log" 2>&1 &
  D=$!
  # stop waiting once the server has died (a missing wheel: its log's last lines say which)
  for i in $(seq 120); do curl -sf 127.0.0.1:8090/health > /dev/null && break; kill -0 $D 2>/dev/null || break; sleep 1; done
  kill -0 $D 2>/dev/null || tail -3 "$OUT/deimos-serve.log"
  timeout ${DS_S:-200} python3 -m deimos bench serve --url http://127.0.0.1:8090 --concurrency ${DLEVELS:-1,2,4,16,64} \
    --prompt-tokens 512 --max-tokens 128 --json "$OUT/serve-deimos.json" 2>&1 | grep -E "^\| *[0-9]|concurrency"
  kill -INT $D; wait $D; idle
  /tmp/lc/llama-server -m $M8 -ngl 99 -fa on --parallel 64 -c 65536 --host 127.0.0.1 --port 8091 \
    > "$OUT/llama-serve.log" 2>&1 &
  L=$!
  for i in $(seq 180); do curl -sf 127.0.0.1:8091/health > /dev/null && break; kill -0 $L 2>/dev/null || break; sleep 1; done
  timeout ${LS_S:-260} python3 -m deimos bench serve --url http://127.0.0.1:8091 --concurrency ${LLEVELS:-2,4,16,64} \
    --prompt-tokens 512 --max-tokens 128 --json "$OUT/serve-llama.json" 2>&1 | grep -E "^\| *[0-9]|concurrency"
  kill $L; wait $L; idle ;;
turn)
  setup; synth qwen35-4b $Q4 Q4_K_M qwen2; idle
  timeout ${TURN_S:-120} python3 bench/turn_ttft.py $Q4 --ctx 20000 -r 5 2>&1 | grep -v Warn | tail -2
  timeout ${PREFIX_S:-100} python3 bench/profile_prefix.py $Q4 --ctx 2048,20000 -n 150 2>&1 | grep -v Warn \
    | grep -E "^\| [0-9]" | cut -c1-200 ;;
next)
  setup; idle; gputests
  timeout ${MOE_TEST_S:-150} python3 -m pytest -q -rfE -m gpu -p no:cacheprovider tests/test_triton_moe.py \
    tests/test_moe_gpu.py tests/test_qwen35moe.py 2>&1 | cut -c1-220 | tail -4
  synth qwen35moe-35b-a3b $M35 Q4_K_M qwen2; idle
  timeout ${BENCH_S:-260} python3 -m deimos bench $M35 -p 512 -n 128 -r 3 --vs-llama /tmp/lc/llama-bench 2>&1 \
    | grep -v Warn | tee "$OUT/qwen35moe-35b.txt" | grep -E "pp512|tg128"
  timeout 120 python3 bench/profile_step.py $M35 -b 1 --steps 20 2>&1 | grep -v Warn | cut -c1-160 \
    | tee "$OUT/moe-step.txt" | tail -${STEP_N:-24}
  idle ;;
agent)
  setup
  SESSIONS=${SESSIONS:-multi-turn} AGENT_ARGS=" " TEMPLATE=NousResearch-Hermes-3-Llama-3.1-8B-tool_use SESS_S=${SESS_S:-120} \
    bash bench/gpu_round_s22.sh agent 2>&1 | tail -12 ;;
*) echo "usage: $0 a|sweep|fusedmoe|router|moestep|turn|serve|next|agent" >&2; exit 2 ;;
esac
