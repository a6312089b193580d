#!/usr/bin/env bash
# The last GPU round of session 22 (from the repository root on the GPU machine; carry .whl
# and .peer/td): the changed kernels' and tests' gpu cases, where a cached-prefix turn's time
# goes now, and Deimos on the agent sessions with a real chat template (Hermes-3 Llama-3.1
# tool_use, the tools as a field). llama-server's side: `WHO=llama TEMPLATE=... agent` after it.
. bench/gpu_env.sh
bench/gpu_round_batch.sh setup > /dev/null 2>&1
T=NousResearch-Hermes-3-Llama-3.1-8B-tool_use
MA=/tmp/m/llama-8b-Q4_K_M-$T.gguf
(python3 -m deimos synth llama-8b $MA --type Q4_K_M --vocab-from "$V/ggml-vocab-llama-bpe.gguf" \
  --chat-template "$V/templates/$T.jinja" > /dev/null) &
timeout ${TEST_S:-150} python3 -m pytest -q -rfE -m gpu --timeout 100 -p no:cacheprovider ${TESTS:-} \
  > "$OUT/tests.txt" 2>&1
grep -E "^(FAILED|ERROR)|passed|failed|split|prefill.*ms" "$OUT/tests.txt" | cut -c1-220 | tail -14
wait; idle
timeout 100 python3 bench/profile_prefix.py $MA --ctx 2048,30000 -n 150 2>&1 | grep -E "^\||host" | cut -c1-200
SESSIONS="multi-turn long-prompt" AGENT_ARGS=" " WHO=deimos TEMPLATE=$T SESS_S=80 bash bench/gpu_round_s22.sh agent 2>&1 | tail -8
