#!/usr/bin/env bash
# The GPU rows of issue 13 (docs/fidelity.md, docs/exactness.md), run on the GPU machine from
# the repository root after the pieces were carried there (see docs/exactness.md, "GPU rows"):
#   .peer/  llama-cuda-sm90.tar.xz, llama_ref (built here against its libllama), libggml-base.so*,
#           alice29.txt;  .whl/  the wheels the machine lacks;
#   .peer/p1/ .. .peer/p6/  the two real models cut by `split` (smol.aa smol.ab, g.aa .. g.ae).
#   tools/gpu_fidelity_round.sh setup      # assemble, install, check sha256
#   tools/gpu_fidelity_round.sh ppl        # perplexity + KLD of the variants (GPU)
#   tools/gpu_fidelity_round.sh study M    # the exactness study's GPU rows for model M (smol|gemma)
set -euo pipefail
export PYTHONUNBUFFERED=1
export PYTHONPATH=/tmp/site:$PWD
export DEIMOS_TEST_DATA=/tmp/td DEIMOS_CACHE=/tmp/dc
export LD_LIBRARY_PATH=/tmp/llc:/usr/local/cuda-13.0/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
M=$DEIMOS_TEST_DATA/models
SMOL=$M/SmolLM2-135M-Instruct.Q4_1.gguf
GEMMA=$M/gemma-3-270m-q4_k_m.gguf
V=/tmp/variants
deimos() { python3 -m deimos "$@"; }

case "${1:-}" in
setup)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl
  mkdir -p $M $DEIMOS_TEST_DATA/llama-cpu $DEIMOS_TEST_DATA/texts $DEIMOS_CACHE/texts /tmp/llc
  cat .peer/p1/smol.aa .peer/p2/smol.ab > $SMOL
  cat .peer/p3/g.aa .peer/p4/g.ab .peer/p5/g.ac .peer/p6/g.ad .peer/p1/g.ae > $GEMMA
  sha256sum $SMOL $GEMMA
  echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  $SMOL" | sha256sum -c
  echo "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818  $GEMMA" | sha256sum -c
  cp .peer/alice29.txt $DEIMOS_TEST_DATA/texts/
  cp .peer/alice29.txt $DEIMOS_CACHE/texts/
  cp -a .peer/libggml-base.so* $DEIMOS_TEST_DATA/llama-cpu/
  tar xJf .peer/llama-cuda-sm90.tar.xz -C /tmp/llc
  cp .peer/llama_ref /tmp/llc/
  nvidia-smi --query-compute-apps=pid,used_memory --format=csv
  ;;
ppl)
  mkdir -p $V
  python3 tools/requantize.py $SMOL $V/smol-F32.gguf F32 --lib $DEIMOS_TEST_DATA/llama-cpu
  for t in Q8_0 Q6_K Q5_K_M Q4_K_M IQ4_XS Q2_K; do
    python3 tools/requantize.py $V/smol-F32.gguf $V/smol-$t.gguf $t --lib $DEIMOS_TEST_DATA/llama-cpu
  done
  A="alice29 -c 512 --chunks 8"
  # the reference distribution: the F32 twin on the float32 CPU reference
  deimos perplexity $V/smol-F32.gguf $A --device cpu --kl-divergence-base $V/base-F32.bin \
    --json $OUT/ppl-cpu-F32.json > /dev/null
  deimos perplexity $GEMMA $A --device cuda --json $OUT/ppl-cuda-gemma.json > /dev/null
  for t in Q4_1 F32 Q8_0 Q6_K Q5_K_M Q4_K_M IQ4_XS Q2_K; do
    f=$V/smol-$t.gguf; [ $t = Q4_1 ] && f=$SMOL
    deimos perplexity $f --device cuda --kl-divergence-base $V/base-F32.bin --kl-divergence \
      --json $OUT/kld-cuda-$t.json > $OUT/kld-cuda-$t.txt
  done
  nvidia-smi --query-compute-apps=pid,used_memory --format=csv
  ;;
study)
  case "${2:-}" in smol) m=$SMOL ;; gemma) m=$GEMMA ;; *) echo "study smol|gemma" >&2; exit 2 ;; esac
  python3 tools/exactness_study.py --models $m --llama-cuda /tmp/llc --threads 16 \
    --paths deimos-cuda-prefill,deimos-cuda-decode,llama-cuda,llama-cuda-default \
    --out $OUT/exactness-$2.json | tee $OUT/exactness-$2.md
  ;;
*)
  echo "usage: $0 setup|ppl|study smol|gemma" >&2; exit 2 ;;
esac
