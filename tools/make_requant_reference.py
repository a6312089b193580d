"""Writes tests/data/reference/requant-<model>-<type>.json: llama.cpp's greedy runs on a real
test model re-quantized by tools/requantize.py, and on that variant's F32 twin.

For each target type: the variant is built with tools/requantize.py (its sha256 is recorded, so
the test can check it rebuilt the very bytes llama.cpp ran); llama.cpp's greedy tokens and
top-k logits are recorded on it (llama.cpp quantizes activations inside quantized matmuls) and
on its F32 twin (``llama-quantize --allow-requantize VARIANT TWIN F32``: the same weights
dequantized by ggml, so no activation quantization).

    python tools/make_requant_reference.py [--model SmolLM2-135M-Instruct.Q4_1.gguf] [TYPE ...]

Needs the prebuilt llama.cpp CPU binaries (llama-quantize, libllama) besides libggml-base.so.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "llama_ref"))
sys.path.insert(0, str(HERE))
import driver  # noqa: E402
import requantize  # noqa: E402

REPO = HERE.parent
PROMPTS = REPO / "tests" / "data" / "prompts.json"
OUT_DIR = REPO / "tests" / "data" / "reference"
TYPES = ("Q8_0", "Q6_K", "Q4_K", "IQ4_XS", "TQ2_0", "TQ1_0")
PROMPT_IDS = ("prose", "question", "python", "json", "german", "emoji")


def stem(model: str) -> str:
    return model.removesuffix(".gguf").split(".")[0]


def _cases(prompts: list[dict], out: dict) -> list[dict]:
    keep = ("prompt_tokens", "tokens", "top", "eog", "text")
    return [{"id": p["id"], **{k: r[k] for k in keep}}
            for p, r in zip(prompts, out["results"], strict=True)]


def write_reference(exe: Path, lib: Path, model: Path, ggml_type: str, prompts: list[dict],
                    n_predict: int, top_k: int, tmp: Path) -> Path:
    variant = tmp / f"{stem(model.name)}-{ggml_type}.gguf"
    plans = requantize.requantize(model, variant, ggml_type, lib)
    twin = tmp / f"{variant.stem}.f32.gguf"
    env = {**os.environ, "LD_LIBRARY_PATH": str(lib)}
    subprocess.run([str(lib / "llama-quantize"), "--allow-requantize", str(variant), str(twin),
                    "F32"], check=True, env=env, capture_output=True)
    texts = [p["text"] for p in prompts]
    # top-4 on the variant (the test reads the top two), top-8 on the twin (logit errors)
    quant = driver.greedy(exe, variant, texts, n_predict, 4)
    f32 = driver.greedy(exe, twin, texts, n_predict, top_k)
    doc = {
        "generator": "tools/make_requant_reference.py",
        "command": f"python tools/make_requant_reference.py --model {model.name} {ggml_type}",
        "llama_cpp_build": driver.LLAMA_CPP_BUILD,
        "source": {"file": model.name, "sha256": driver.sha256_file(model)},
        "variant": {
            "type": ggml_type,
            "made_by": f"python tools/requantize.py {model.name} VARIANT {ggml_type}",
            "sha256": driver.sha256_file(variant),
            "size": variant.stat().st_size,
            "tensor_types": dict(Counter(p.out_type.name for p in plans).most_common()),
        },
        "settings": {**driver.SETTINGS, "n_predict": n_predict, "top_k": 4},
        "cases": _cases(prompts, quant),
        "f32_twin": {
            "made_by": "llama-quantize --allow-requantize VARIANT TWIN F32",
            "top_k": top_k,
            "cases": _cases(prompts, f32),
        },
    }
    path = OUT_DIR / f"requant-{stem(model.name)}-{ggml_type}.json"
    path.write_text(driver.dump_json(doc))
    return path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("types", nargs="*", default=list(TYPES))
    ap.add_argument("--model", default="SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--n-predict", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=8)
    args = ap.parse_args()
    paths = driver.LlamaPaths.default()
    exe = driver.build(paths)
    model = driver.test_data_dir() / "models" / args.model
    prompts = [p for p in json.loads(PROMPTS.read_text()) if p["id"] in PROMPT_IDS]
    with tempfile.TemporaryDirectory(prefix="requant-") as tmp:
        for t in args.types:
            path = write_reference(exe, paths.lib, model, t, prompts, args.n_predict, args.top_k,
                                   Path(tmp))
            print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
