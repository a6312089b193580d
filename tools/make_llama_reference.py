"""Writes tests/data/reference/<model-stem>.json: llama.cpp's greedy tokens and top-8 logits
for the raw prompts of tests/data/prompts.json, for the real test models.

    python tools/make_llama_reference.py [--n-predict 48] [MODEL.gguf ...]

Needs the llama.cpp source (headers) and its prebuilt CPU libraries; see tools/llama_ref/driver.py
for where they are looked up ($DEIMOS_TEST_DATA, $LLAMA_CPU_DIR).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "llama_ref"))
import driver  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
PROMPTS = REPO / "tests" / "data" / "prompts.json"
OUT_DIR = REPO / "tests" / "data" / "reference"
MODELS = ("SmolLM2-135M-Instruct.Q4_1.gguf", "gemma-3-270m-q4_k_m.gguf")


def write_reference(exe: Path, model: Path, n_predict: int, top_k: int) -> Path:
    command = (f"python tools/make_llama_reference.py --n-predict {n_predict} --top-k {top_k} "
               f"{model.name}")
    prompts = json.loads(PROMPTS.read_text())
    out = driver.greedy(exe, model, [p["text"] for p in prompts], n_predict, top_k)
    cases = [
        {"id": p["id"], "prompt": p["text"], **r}
        for p, r in zip(prompts, out["results"], strict=True)
    ]
    doc = {
        "generator": "tools/make_llama_reference.py",
        "command": command,
        "llama_cpp_build": driver.LLAMA_CPP_BUILD,
        "model": {
            "file": model.name,
            "sha256": driver.sha256_file(model),
            "size": model.stat().st_size,
        },
        "settings": {**driver.SETTINGS, "n_predict": n_predict, "top_k": top_k},
        "n_vocab": out["n_vocab"],
        "add_bos": out["add_bos"],
        "add_eos": out["add_eos"],
        "cases": cases,
    }
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    path = OUT_DIR / f"{model.stem}.json"
    path.write_text(driver.dump_json(doc))
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="*", type=Path,
                    help="GGUF files (default: the two test models under $DEIMOS_TEST_DATA/models)")
    ap.add_argument("--n-predict", type=int, default=48)
    ap.add_argument("--top-k", type=int, default=8)
    args = ap.parse_args()
    models = args.models or [driver.test_data_dir() / "models" / m for m in MODELS]
    exe = driver.build(driver.LlamaPaths.default())
    for model in models:
        if not model.exists():
            sys.exit(f"{model} is missing: run python tools/fetch_test_data.py")
        print(f"{model.name}: {write_reference(exe, model, args.n_predict, args.top_k)}")


if __name__ == "__main__":
    main()
