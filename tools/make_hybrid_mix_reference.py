"""Writes tests/data/reference/synth-mix-types-hybrid.json: the per-tensor types llama-quantize
picks for the hybrid (Gated DeltaNet) presets, as tools/make_synth_mix_reference.py does for
the others (the same record format; tests/test_qwen35moe.py and tests/test_qwen3next.py check
deimos.synth's mixes against it).

    LLAMA_CPU_DIR=/tmp/llcpu python tools/make_hybrid_mix_reference.py [PRESET ...]

What these presets add to the rules: attn_qkv (llama.cpp's ATTENTION_QKV, an attn_v-like
category), attn_v in only every fourth layer (its counter), the shared expert's tensors, and
qwen3next's ssm_ba / ssm_in. Each preset's file is written with its tensor data a hole
(``write_model(data=False)``: the dry run reads only the tensor table), so the real sizes
cost no disk.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(HERE))
from make_synth_mix_reference import DONOR, LLAMA_CPP_BUILD, dry_run, test_data_dir

from deimos.synth import FTYPES, get_preset, weight_types, write_model

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


def record(preset: str, in_type: str, tmp: Path) -> dict:
    p = get_preset(preset)
    model = write_model(tmp / f"{preset}.gguf", p.arch, p, weight_types(in_type, pure=True),
                        test_data_dir() / DONOR, seed=0, data=False)
    try:
        mixes = {ft: dry_run(model, ft) for ft in FTYPES}
    finally:
        model.unlink()
    names = list(next(iter(mixes.values())))
    return {"names": names, "types": {ft: " ".join(t[n] for n in names) for ft, t in mixes.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("presets", nargs="*", default=list(PRESETS), help=", ".join(PRESETS))
    args = ap.parse_args()
    if unknown := [p for p in args.presets if p not in PRESETS]:
        ap.error(f"not a preset of this tool: {', '.join(unknown)}")
    doc = json.loads(OUT.read_text()) if OUT.exists() else {
        "generator": "tools/make_hybrid_mix_reference.py",
        "llama_cpp_build": LLAMA_CPP_BUILD,
        "vocab_from": DONOR,
        "presets": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        for preset in args.presets:
            print(f"{preset} ...", flush=True)
            doc["presets"][preset] = record(preset, PRESETS[preset], Path(tmp))
    OUT.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
