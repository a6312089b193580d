"""Writes tests/data/reference/synth-mix-types-hybrid.json: the per-tensor types llama-quantize
picks for the hybrid (Gated DeltaNet) presets, as tools/make_synth_mix_reference.py does for
the others (the same record format; tests/test_qwen35moe.py and tests/test_qwen3next.py check
deimos.synth's mixes against it).

    LLAMA_CPU_DIR=/tmp/llcpu python tools/make_hybrid_mix_reference.py [PRESET ...]

What these presets add to the rules: attn_qkv (llama.cpp's ATTENTION_QKV, an attn_v-like
category), attn_v in only every fourth layer (its counter), the shared expert's tensors, and
qwen3next's ssm_ba / ssm_in.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(HERE))
from make_synth_mix_reference import run

OUT = REPO / "tests" / "data" / "reference" / "synth-mix-types-hybrid.json"
# preset -> input type of the written file (any type whose blocks fit the rows: the dry run
# reads only the tensor table)
PRESETS = {
    "qwen35-tiny": "F32",
    "qwen35moe-tiny": "F32",
    "qwen3next-tiny": "F32",
    "qwen3next-tiny-ssmin": "F32",
    "qwen35-4b": "Q8_0",
    "qwen35moe-35b-a3b": "Q8_0",
    "qwen3next-80b-a3b": "Q8_0",
}


def main() -> None:
    run(PRESETS, OUT, "tools/make_hybrid_mix_reference.py", __doc__)


if __name__ == "__main__":
    main()
