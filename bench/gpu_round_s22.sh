#!/usr/bin/env bash
# This session's GPU rounds (run from the repository root on the GPU machine):
#   bench/gpu_round_s22.sh tests   # every gpu-marked test (NaN fix, hybrid state pool and graphs,
#                                  # speculation, MoE); then deimos bench on the 8B file
#   bench/gpu_round_s22.sh agent   # the agent sessions against llama-server (carry
#                                  # .peer/llama-cuda-sm90.tar.xz; .whl stays from the call before)
#   bench/gpu_round_s22.sh serve   # long prompts (4k, 16k) at 1 and 8 streams, and llama-server
#                                  # with --parallel sized to the level
. bench/gpu_env.sh
bench/gpu_round_batch.sh setup > /dev/null 2>&1
case "${1:-}" in
tests)
  (synth llama-8b $M8 Q4_K_M llama-bpe) &
  timeout ${TEST_S:-420} python3 -m pytest -q -rfE -m gpu --timeout 150 -p no:cacheprovider --continue-on-collection-errors \
    ${TESTS:-tests} > "$OUT/tests.txt" 2>&1
  grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/tests.txt" | cut -c1-220 | tail -25
  wait; idle
  timeout 120 python3 -m deimos bench $M8 -p 512 -n 128 -r 3 2>&1 | grep -v Warn | tail -5 ;;
agent)
  # WHO=deimos|llama (default both): the sessions one request at a time, tools in the system
  # prompt on both; llama-server with one slot (-np 1) and its prompt cache
  # TEMPLATE=NAME: the 8B file with llama.cpp's models/templates/NAME.jinja as its chat
  # template (both engines render the same prompts; with a tool_use template send the tools
  # as a field: AGENT_ARGS=" ")
  MA=$M8
  if [ -n "${TEMPLATE:-}" ]; then
    MA=/tmp/m/llama-8b-Q4_K_M-$TEMPLATE.gguf
    [ -f $MA ] || python3 -m deimos synth llama-8b $MA --type Q4_K_M --vocab-from "$V/ggml-vocab-llama-bpe.gguf" \
      --chat-template "$V/templates/$TEMPLATE.jinja" > /dev/null
  else
    synth llama-8b $M8 Q4_K_M llama-bpe
  fi; idle
  for who in ${WHO:-deimos llama}; do
    if [ $who = deimos ]; then
      python3 -m deimos serve $MA --listen 127.0.0.1:8092 --no-tui -c 40960 > "$OUT/agent-deimos.log" 2>&1 &
    else
      /tmp/lc/llama-server -m $MA -ngl 99 -fa on -np 1 -c 40960 --jinja ${LLAMA_ARGS:-} --host 127.0.0.1 --port 8092 \
        > "$OUT/agent-llama.log" 2>&1 &
    fi
    S=$!
    for i in $(seq 240); do curl -sf 127.0.0.1:8092/health > /dev/null && break; kill -0 $S 2>/dev/null || break; sleep 1; done
    for sess in ${SESSIONS:-multi-turn long-prompt long-decode}; do
      timeout ${SESS_S:-150} python3 -m deimos bench agent $sess --url http://127.0.0.1:8092 ${AGENT_ARGS:---tools-in-system} \
        --json "$OUT/agent-$who-$sess.json" > "$OUT/agent-$who-$sess.txt" 2>&1
      echo "$who $sess"; grep -A3 "wall s" "$OUT/agent-$who-$sess.txt" | head -4
    done
    kill -INT $S; sleep 2; kill $S 2>/dev/null; wait $S; idle
  done ;;
serve)
  # WHO as above: prompts of PROMPTS tokens at 1 and 8 streams, 128-token answers, default
  # sampling; one deimos server (its pool sized from free memory), llama-server with -np equal
  # to the level and -c giving each slot the prompt and answer
  synth llama-8b $M8 Q4_K_M llama-bpe; idle
  P=${PROMPTS:-4096,16384}; PMAX=${P##*,}
  L=${LEVELS:-1,8}
  for who in ${WHO:-deimos llama}; do
    # deimos: one server for every level; llama-server: one a level (-np = the level)
    [ $who = deimos ] && runs=$L || runs=${L//,/ }
    for lvs in $runs; do
      if [ $who = deimos ]; then
        python3 -m deimos serve $M8 --listen 127.0.0.1:8093 --no-tui -c $((PMAX + 256)) > "$OUT/long-$who.log" 2>&1 &
      else
        /tmp/lc/llama-server -m $M8 -ngl 99 -fa on -np $lvs -c $(( (PMAX + 256) * lvs )) --host 127.0.0.1 \
          --port 8093 > "$OUT/long-$who-$lvs.log" 2>&1 &
      fi
      S=$!
      for i in $(seq 240); do curl -sf 127.0.0.1:8093/health > /dev/null && break; kill -0 $S 2>/dev/null || break; sleep 1; done
      for p in ${P//,/ }; do
        echo "$who streams=$lvs prompt=$p"
        timeout 200 python3 -m deimos bench serve --url http://127.0.0.1:8093 --concurrency $lvs \
          --requests 16 --warmup 2 --prompt-tokens $p --max-tokens 128 \
          --json "$OUT/long-$who-${lvs//,/_}-$p.json" 2>&1 | grep -E "^\| *[0-9]"
      done
      kill -INT $S; sleep 2; kill $S 2>/dev/null; wait $S
    done
  done; idle ;;
*) echo "usage: $0 tests|agent|serve" >&2; exit 2 ;;
esac
