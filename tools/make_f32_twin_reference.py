"""Writes tests/data/reference/<model-stem>.f32-twin.json: llama.cpp's greedy tokens and top-8
logits on the *F32 twin* of each real test model.

The twin is made by llama.cpp itself (`llama-quantize --allow-requantize MODEL TWIN F32`): the
same weights, dequantized. llama.cpp then runs without quantizing activations, so its logits
are the exact float32 function of the weights. Deimos' CPU reference computes that same
function from the quantized file (its dequantizers are bit-exact), so the two must agree to
float32 noise; on the quantized file itself llama.cpp adds Q8 activation-quantization noise
(see tests/test_model_vs_llama_cpp.py).

    python tools/make_f32_twin_reference.py [--n-predict 48] [MODEL.gguf ...]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "llama_ref"))
import driver  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
PROMPTS = REPO / "tests" / "data" / "prompts.json"
OUT_DIR = REPO / "tests" / "data" / "reference"
MODELS = ("SmolLM2-135M-Instruct.Q4_1.gguf", "gemma-3-270m-q4_k_m.gguf")


def make_twin(lib: Path, model: Path, out: Path) -> None:
    env = {**os.environ, "LD_LIBRARY_PATH": str(lib)}
    subprocess.run([str(lib / "llama-quantize"), "--allow-requantize", str(model), str(out), "F32"],
                   check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="*", default=list(MODELS))
    ap.add_argument("--n-predict", type=int, default=48)
    ap.add_argument("--top-k", type=int, default=8)
    args = ap.parse_args()
    paths = driver.LlamaPaths.default()
    exe = driver.build(paths)
    prompts = json.loads(PROMPTS.read_text())
    for name in args.models:
        model = driver.test_data_dir() / "models" / name
        with tempfile.TemporaryDirectory(prefix="f32-twin-") as tmp:
            twin = Path(tmp) / (model.stem + ".f32.gguf")
            make_twin(paths.lib, model, twin)
            out = driver.greedy(exe, twin, [p["text"] for p in prompts], args.n_predict, args.top_k)
        doc = {
            "generator": "tools/make_f32_twin_reference.py",
            "command": f"python tools/make_f32_twin_reference.py --n-predict {args.n_predict} {name}",
            "llama_cpp_build": driver.LLAMA_CPP_BUILD,
            "model": {"file": model.name, "sha256": driver.sha256_file(model),
                      "twin": "llama-quantize --allow-requantize MODEL TWIN F32"},
            "settings": {**driver.SETTINGS, "n_predict": args.n_predict, "top_k": args.top_k},
            "cases": [{"id": p["id"], "prompt": p["text"], **r}
                      for p, r in zip(prompts, out["results"], strict=True)],
        }
        path = OUT_DIR / f"{model.stem}.f32-twin.json"
        path.write_text(driver.dump_json(doc))
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
