#!/usr/bin/env bash
# Session 36's GPU rounds (from the repository root on the GPU machine). Carry limits split them:
#   bench/gpu_round_s36.sh moe    # carry .whl-min .whl-ggml .peer/lc .peer/td (qwen2 vocabulary):
#                                 # the offload's GPU tests, bench/host_read.py, then where an
#                                 # offloaded token goes with the one-token and the general host
#                                 # answer (bench/profile_offload.py, SLOTS slots, SHARES shares,
#                                 # CPU sides, SPLIT rules)
#   bench/gpu_round_s36.sh moe8   # deimos bench --gpu-mem 8 on qwen3moe 30B-A3B beside llama.cpp's
#                                 # -ncmoe 33 under the same limit (the GPU tests in TESTS first,
#                                 # while the file is written)
#   bench/gpu_round_s36.sh llamalm # (carry as moe8) llama.cpp at 8 GiB with -lm mmap and -lm none
#   bench/gpu_round_s36.sh squeeze # (carry as moe8) the squeeze replay at 8 GiB beside llama.cpp
#                                 # restarted for 8 and for 6 GiB (REL=1: the release variant)
#   bench/gpu_round_s36.sh squeeze1 # (carry as moe8) the squeeze alone, without llama.cpp (REL=1)
#   bench/gpu_round_s36.sh next40 # (carry as moe8) session 40's changes on one host (~7 min)
#   bench/gpu_round_s36.sh moe35  # (carry as moe8) qwen35moe 35B-A3B under --gpu-mem 8 against
#                                 # llama.cpp's -ncmoe search (LARGS: fixed llama-bench flags)
#   bench/gpu_round_s36.sh q3     # carry .whl .peer/lc .peer/td (qwen2 vocabulary, templates): the
#                                 # agent sessions on qwen3 4B Q4_K_M (Qwen3's template), Deimos
#                                 # against llama-server -np 1 (after the GPU tests in TESTS)
#   bench/gpu_round_s36.sh spec   # same warm machine, carry .smol-b (the real SmolLM2-135M file's
#                                 # second piece; the first, .smol-a, rode with an earlier round):
#                                 # recorded sessions with greedy answers on deimos serve without
#                                 # speculation and with n-gram drafts (bench/agent_compare.py)
#   bench/gpu_round_s36.sh soak   # same warm machine: the GPU soak on that qwen3 4B file (1000
#                                 # requests of random lengths at concurrency 32; a template that
#                                 # needs no tools, so every request is a valid one)
. bench/gpu_env.sh
Q3=/tmp/m/qwen3-4b-Q4_K_M-qwen3.gguf
mkq3() {
  [ -f $Q3 ] || python3 -m deimos synth qwen3-4b $Q3 --type Q4_K_M --vocab-from "$V/ggml-vocab-qwen2.gguf" \
    --chat-template "$V/templates/Qwen-Qwen3-0.6B.jinja" > /dev/null
}
moe_setup() {
  for p in a b; do [ -f .smol-$p/part ] && mkdir -p /tmp/smol && cp .smol-$p/part /tmp/smol/$p; done
  W=.whl-min; [ -d $W ] || W=.whl
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $W/*.whl
  ggml_setup
  echo "ggml-python: $G build; $(python3 -c 'import ggml; print("imports")' 2>&1 | tail -1); $(nproc) CPUs, $(lscpu 2>/dev/null | grep -E "^(Thread\(s\) per core|Model name)" | tr -s " " | tr "\n" ";")"
  [ -x /tmp/lc/llama-bench ] || { mkdir -p /tmp/lc && tar xJf .peer/lc/llama-cuda-sm90.tar.xz -C /tmp/lc; }
}
case "${1:-}" in
moe)
  moe_setup; idle
  (synth qwen3moe-30b-a3b $M30 Q4_K_M qwen2) &
  [ -n "${TESTS:-}" ] && timeout ${TEST_S:-200} python3 -m pytest -q -rfE -m gpu -p no:cacheprovider $TESTS 2>&1 \
    | cut -c1-220 | tail -6
  wait
  [ -n "${HOSTREAD:-}" ] && timeout 120 python3 bench/host_read.py 2>&1 | grep -v Warn | tee "$OUT/host-read.txt" | tail -12
  # the host's memory read rate with every core (what ggml's share of the misses can reach)
  [ -n "${MEMBW:-}" ] && python3 -c "
import time, torch
torch.set_num_threads($(nproc)); a = torch.ones(1 << 29, dtype=torch.int64)  # 4 GiB
for _ in range(2): a.sum()
t = time.perf_counter(); [a.sum() for _ in range(5)]; dt = (time.perf_counter() - t) / 5
print(f'host memory: {a.numel() * 8 / dt / 1e9:.1f} GB/s read by torch.sum on $(nproc) threads')"
  idle
  timeout ${PROF_S:-240} python3 bench/profile_offload.py $M30 --slots ${SLOTS:-0} --shares ${SHARES:-tune} \
    --answer ${ANSWER:-token,rows} ${PROMOTE:+--promote $PROMOTE} ${CPU:+--cpu $CPU} ${SPLIT:+--split $SPLIT} -n ${NTOK:-32} -p 512 --top 12 2>&1 | grep -v Warn > "$OUT/profile-offload.txt"
  grep -E "^(offload|cpu side)|^  (timed|host|  cpu|    ggml|    act|  promote|promote|eager)|GB/s" "$OUT/profile-offload.txt" | cut -c1-160
  idle ;;
lite)  # little device time left: the GPU tests while the file is written, where an offloaded
       # token goes (0 slots, the tuned share, the one-token host path), then 8 GiB alone
  moe_setup; (synth qwen3moe-30b-a3b $M30 Q4_K_M qwen2) &
  [ -n "${TESTS:-}" ] && timeout ${TEST_S:-100} python3 -m pytest -q -rfE -m gpu -p no:cacheprovider $TESTS 2>&1 \
    | cut -c1-220 | tail -6
  wait; idle
  timeout ${PROF_S:-150} python3 bench/profile_offload.py $M30 --slots 0 --shares tune --answer token -n 32 -p 512 \
    --top 12 2>&1 | grep -v Warn > "$OUT/profile-offload.txt"
  grep -E "^(offload|cpu side)|^  (timed|host|  cpu|    ggml|    act|  promote|promote|eager)|GB/s|tok/s" "$OUT/profile-offload.txt" | cut -c1-160
  idle
  timeout ${BENCH_S:-200} python3 -m deimos bench $M30 -p 512 -n 128 -r 2 --gpu-mem 8 2>&1 | grep -v Warn \
    | tee "$OUT/moe-8g.txt" | tail -8
  idle ;;
moe8)
  moe_setup; (synth qwen3moe-30b-a3b $M30 Q4_K_M qwen2) &
  [ -n "${TESTS:-}" ] && timeout ${TEST_S:-200} python3 -m pytest -q -rfE -m gpu -p no:cacheprovider $TESTS 2>&1 \
    | cut -c1-220 | tail -6
  wait; idle
  # where the 8 GiB go, after the load and after a round (the cache's slots should stay)
  timeout 90 python3 bench/mem_breakdown.py $M30 --gib 8 2>&1 | grep -v Warn | tee "$OUT/mem-8g.txt" | tail -12
  timeout ${BENCH_S:-420} python3 -m deimos bench $M30 -p 512 -n 128 -r 3 --gpu-mem 8 \
    --vs-llama /tmp/lc/llama-bench "--llama-args=${LARGS:--ngl 99 -fa 1 -t 16 -ncmoe 33}" --json "$OUT/moe-8g.json" 2>&1 \
    | grep -v Warn | tee "$OUT/moe-8g.txt" | tail -24
  idle ;;
llamalm) # (carry as moe8) llama.cpp's load modes under 8 GiB at -ncmoe N (33): mmap (llama-bench's
         # default: CPU experts in pageable file pages) against none (a pinned host copy, which its
         # op-offloaded prompt batches read at PCIe speed): its best conditions for the comparison
  moe_setup; synth qwen3moe-30b-a3b $M30 Q4_K_M qwen2; idle
  sleep 100000 | python3 -m deimos.bench.memhold --leave 8 > /tmp/memhold.out 2>&1 &
  for i in $(seq 60); do grep -q "^ready" /tmp/memhold.out && break; sleep 1; done; head -1 /tmp/memhold.out
  for lm in mmap none; do
    timeout 200 /tmp/lc/llama-bench -m $M30 -p 512 -n 128 -r 3 -ngl 99 -fa 1 -t 16 -ncmoe ${N:-33} \
      -lm $lm -o md 2>&1 | grep -E "^\|" | tee -a "$OUT/llama-lm.txt"
  done
  pkill -f "sleep 100000"; sleep 2; idle ;;
squeeze) # (carry as moe8) issue 15's squeeze on qwen3moe 30B-A3B at 8 GiB: 2 GiB taken before
         # request 4 (REL=1: given back later), llama.cpp's best -ncmoe at 8 GiB and with the 2 GiB held
  moe_setup; synth qwen3moe-30b-a3b $M30 Q4_K_M qwen2; idle
  timeout ${BENCH_S:-560} python3 -m deimos bench $M30 -n 128 --gpu-mem 8 --squeeze ${REL:+--release} \
    --vs-llama /tmp/lc/llama-bench --llama-reps ${LREPS:-3} --json "$OUT/squeeze.json" 2>&1 | grep -v Warn \
    | tee "$OUT/squeeze.txt" | tail -40
  idle ;;
next40) # (carry as moe8) session 40's changes measured on one host: the offload's GPU tests,
        # where a decode token goes with the one-plane graph (_GgmlFused) against the two-graph
        # layout and the minimax split against rounding (bench/profile_offload.py), then 8 GiB
        # against llama.cpp's -ncmoe 33 (both load modes)
  moe_setup; (synth qwen3moe-30b-a3b $M30 Q4_K_M qwen2) &
  timeout ${TEST_S:-150} python3 -m pytest -q -rfE -m gpu -p no:cacheprovider tests/test_offload.py \
    tests/test_ggml_lib.py tests/test_engine_oom.py 2>&1 | cut -c1-220 | tail -4
  wait; idle
  timeout ${PROF_S:-200} python3 bench/profile_offload.py $M30 --slots 28 --shares tune --answer token \
    --cpu twographs,pool --split round,minimax -n 32 -p 512 --top 5 2>&1 | grep -v Warn > "$OUT/profile-offload.txt"
  grep -E "^offload|^expert offload" "$OUT/profile-offload.txt" | cut -c1-160; tail -5 "$OUT/profile-offload.txt"
  idle
  timeout ${BENCH_S:-300} python3 -m deimos bench $M30 -p 512 -n 128 -r 3 --gpu-mem 8 \
    --vs-llama /tmp/lc/llama-bench "--llama-args=-ngl 99 -fa 1 -t 16 -ncmoe 33" --json "$OUT/moe-8g.json" 2>&1 \
    | grep -v Warn | tee "$OUT/moe-8g.txt" | grep -E "deimos|llama|host at load|share" | cut -c1-160
  idle ;;
squeeze1) # (carry as moe8) the squeeze alone (no llama.cpp: ~2 min), REL=1 for the release;
          # the report's free-memory lines say whether the cache's sizing acted
  moe_setup; synth qwen3moe-30b-a3b $M30 Q4_K_M qwen2; idle
  timeout ${BENCH_S:-240} python3 -m deimos bench $M30 -n 128 --gpu-mem 8 --squeeze ${REL:+--release} \
    --json "$OUT/squeeze1.json" 2>&1 | grep -v Warn | tee "$OUT/squeeze1.txt" | tail -30
  idle ;;
moe35) # qwen35moe 35B-A3B Q4_K_M with 8 GiB left against llama.cpp's best -ncmoe (its search)
  moe_setup; M35=/tmp/m/qwen35moe-35b-Q4_K_M.gguf; synth qwen35moe-35b-a3b $M35 Q4_K_M qwen2; idle
  timeout 90 python3 bench/mem_breakdown.py $M35 --gib 8 2>&1 | grep -v Warn | tail -12
  timeout ${BENCH_S:-420} python3 -m deimos bench $M35 -p 512 -n 128 -r 3 --gpu-mem 8 \
    --vs-llama /tmp/lc/llama-bench ${LARGS:+"--llama-args=$LARGS"} --json "$OUT/moe35-8g.json" 2>&1 \
    | grep -v Warn | tee "$OUT/moe35-8g.txt" | tail -24
  idle ;;
q3)
  setup; (mkq3) &
  [ -n "${TESTS:-}" ] && timeout ${TEST_S:-200} python3 -m pytest -q -rfE -m gpu -p no:cacheprovider $TESTS 2>&1 \
    | cut -c1-220 | tail -8
  wait; idle
  agent $Q3 qwen3-4b ;;
spec)
  for p in a b; do [ -f .smol-$p/part ] && mkdir -p /tmp/smol && cp .smol-$p/part /tmp/smol/$p; done
  SM=/tmp/m/SmolLM2-135M-Instruct.Q4_1.gguf
  [ -f $SM ] || cat /tmp/smol/a /tmp/smol/b > $SM
  sha256sum $SM | grep -q ^b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53 \
    || { echo "SmolLM2 pieces missing or wrong (/tmp/smol: $(ls /tmp/smol 2>&1))"; exit 1; }
  setup; idle
  for how in plain ngram; do
    A=; [ $how = ngram ] && A="--speculative ngram"
    python3 -m deimos serve $SM --listen 127.0.0.1:8093 --no-tui -c 8192 $A > "$OUT/spec-$how.log" 2>&1 &
    S=$!
    for i in $(seq 120); do curl -sf 127.0.0.1:8093/health > /dev/null && break; kill -0 $S 2>/dev/null || break; sleep 1; done
    for sess in long-decode:1 multi-turn:6; do
      timeout 150 python3 -m deimos bench agent ${sess%:*} --turns ${sess#*:} --url http://127.0.0.1:8093 \
        --tools-in-system --temperature 0 --json "$OUT/spec-$how-${sess%:*}.json" > "$OUT/spec-$how-${sess%:*}.txt" 2>&1
    done
    curl -s 127.0.0.1:8093/metrics > "$OUT/spec-$how-metrics.txt"
    kill -INT $S; sleep 2; kill $S 2>/dev/null; wait $S
  done
  for sess in long-decode multi-turn; do
    echo "## $sess"; python3 bench/agent_compare.py "$OUT/spec-plain-$sess.json" "$OUT/spec-ngram-$sess.json"
  done
  grep -E "^deimos_(spec|tokens_per_step)" "$OUT/spec-ngram-metrics.txt"
  idle ;;
soak)
  setup; mkq3; idle
  soak $Q3
  idle ;;
*) echo "usage: $0 moe|lite|moe8|llamalm|squeeze|squeeze1|moe35|q3|spec|soak" >&2; exit 2 ;;
esac
