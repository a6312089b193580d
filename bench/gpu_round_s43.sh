#!/usr/bin/env bash
# Session 43's GPU round (from the repository root on the GPU machine; carry .whl .peer/td):
#   OLD=abtree bench/gpu_round_s43.sh mask
#     batch-1 decode of this tree against an older one unpacked in OLD (`git archive REV | tar
#     -x -C OLD`, untracked so it travels): the allowed-token mask launch added to every decode
#     graph (8bea4b2) must not slow a plain stream. `deimos bench -p 512 -n 128 -r 3` (greedy
#     tg, the default) on qwen3 0.6B Q8_0 (the most launch-bound) and llama 8B Q4_K_M,
#     alternating new, old, new, old; each tree with its own Triton cache.
#   bench/gpu_round_s43.sh next   # (carry .whl .peer/td; ~4 min) first thing next session: the
#     GPU tests of the mask read by the sampler's window kernel (300e2c2, untimed) and of the
#     engine (the deferred grammar rows, c61546c, included), then the constrained A/B
#     (bench/gpu_round_s42.sh cons, levels 0 1 0 1), then bench/constrained_steps.py --defer
#     with a constrained row and with a penalized one (defer_rows, 1ad6452: off by default)
. bench/gpu_env.sh
case "${1:-}" in
mask)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  Q06=/tmp/m/qwen3-0.6b-Q8_0.gguf
  synth qwen3-0.6b $Q06 Q8_0 qwen2; [ -n "${BIG-x}" ] && synth llama-8b $M8 Q4_K_M llama-bpe; idle
  for m in $Q06 ${BIG-$M8}; do  # BIG= : the small model only
    for t in ${ORDER:-new old new old}; do
      d=$PWD; [ $t = old ] && d=$PWD/${OLD:?OLD: the older tree}
      (cd $d && PYTHONPATH=/tmp/site:$d DEIMOS_CACHE=/tmp/dc-$t TRITON_CACHE_DIR=/tmp/dc-$t/triton timeout ${RUN_S:-150} python3 -m deimos bench $m \
        -p 512 -n 128 -r ${REPS:-3} 2>&1 | grep -E "tg128|pp512" | sed "s|^|$t $(basename $m) |" \
        | tee -a "$OUT/mask.txt")
    done
  done
  idle ;;
next)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  idle
  timeout ${TEST_S:-240} python3 -m pytest -q -rfE -m gpu -p no:cacheprovider tests/test_sample_batch.py \
    tests/test_engine_kernels.py tests/test_engine_oom.py 2>&1 | grep -E "^E |passed|failed|^FAILED" \
    | cut -c1-300 | tail -12
  CONS="0 1 0 1" bash bench/gpu_round_s42.sh cons 2>&1 | tail -8
  # the deferred grammar rows (c61546c, off by default) against passengers, in the engine's loop
  for kind in "" --penalized; do
    timeout ${STEPS_S:-200} python3 bench/constrained_steps.py /tmp/m/qwen3-4b-Q4_K_M-qwen3.gguf --defer \
      $kind 2>&1 | grep "^|" | tee -a "$OUT/constrained_steps.txt"
  done ;;
*) echo "usage: $0 mask|next" >&2; exit 2 ;;
esac
