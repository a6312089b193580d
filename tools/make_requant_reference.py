"""Writes tests/data/reference/requant-<model>-<TYPE>[-pure].json: llama.cpp's greedy runs on a
real test model re-quantized by tools/requantize.py, and on that variant's F32 twin.

For each TYPE (as tools/requantize.py reads it: a llama-quantize file type such as Q4_K_M, or a
GGML type; a ``-pure`` suffix is its --pure): the variant is built with tools/requantize.py (its
sha256 is recorded, so the test can check it rebuilt the very bytes llama.cpp ran); llama.cpp's
greedy tokens and top-k logits are recorded on it (llama.cpp quantizes activations inside
quantized matmuls) and on its F32 twin (``llama-quantize --allow-requantize VARIANT TWIN F32``:
the same weights dequantized by ggml, so no activation quantization).

    python tools/make_requant_reference.py [--model SmolLM2-135M-Instruct.Q4_1.gguf] [TYPE ...]

Without TYPEs: the model's variants of ``MODELS``, on its prompts and generation length (gemma's
262k-token vocabulary makes each test forward pass slow: fewer prompts, shorter runs).

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
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "llama_ref"))
sys.path.insert(0, str(HERE))
import driver  # noqa: E402
import requantize  # noqa: E402
from make_synth_mix_reference import quantize_types  # noqa: E402

REPO = HERE.parent
PROMPTS = REPO / "tests" / "data" / "prompts.json"
OUT_DIR = REPO / "tests" / "data" / "reference"


@dataclass(frozen=True)
class ModelRefs:
    """The variants of one test model and the prompts (ids of tests/data/prompts.json) and
    number of generated tokens of their references."""

    types: tuple[str, ...]
    prompt_ids: tuple[str, ...]
    n_predict: int


MODELS = {
    "SmolLM2-135M-Instruct.Q4_1.gguf": ModelRefs(
        ("Q8_0", "Q6_K", "Q4_K", "IQ4_XS-pure", "TQ2_0", "TQ1_0", "Q4_K_M"),
        ("prose", "question", "python", "json", "german", "emoji"), 32),
    # not IQ4_XS: ggml's IQ4_NL/IQ4_XS quantizer takes ~40 s of CPU per build, too much for CI
    "gemma-3-270m-q4_k_m.gguf": ModelRefs(
        ("Q8_0", "Q6_K", "Q4_K_M"), ("prose", "question", "python", "german"), 24),
}


def stem(model: str) -> str:
    return model.removesuffix(".gguf").split(".")[0]


def _cases(prompts: list[dict], out: dict) -> list[dict]:
    keep = ("prompt_tokens", "tokens", "top", "eog", "text")
    return [{"id": p["id"], **{k: r[k] for k in keep}}
            for p, r in zip(prompts, out["results"], strict=True)]


def llama_quantize_types(lib: Path, model: Path, ggml_type: str, pure: bool,
                         plans: list[requantize.Plan]) -> dict:
    """llama-quantize's own per-tensor types for the variant (``--dry-run`` on the source).
    For --pure, llama-quantize is told the output projection's type that requantize took from
    the mix (--token-embedding-type when tied, else --output-tensor-type): the non-pure
    variants check that choice."""
    args = ["--dry-run", "--allow-requantize"]
    if pure:
        tied = not any(p.name == "output.weight" for p in plans)
        out = "token_embd.weight" if tied else "output.weight"
        flag = "--token-embedding-type" if tied else "--output-tensor-type"
        args += ["--pure", flag, next(p.out_type.name for p in plans if p.name == out).lower()]
    args += [model.name, ggml_type]
    env = {**os.environ, "LD_LIBRARY_PATH": str(lib)}
    r = subprocess.run([str(lib / "llama-quantize"), *args[:-2], str(model), ggml_type],
                       capture_output=True, text=True, env=env)
    if r.returncode != 0:
        sys.exit(f"llama-quantize {' '.join(args)} failed:\n{r.stderr[-2000:]}")
    types = quantize_types(r.stdout + r.stderr)
    if len(types) != len(plans):
        sys.exit(f"llama-quantize {' '.join(args)}: {len(types)} tensor lines, "
                 f"expected {len(plans)}")
    return {"command": "llama-quantize " + " ".join(args), "types": types}


def write_reference(exe: Path, lib: Path, model: Path, variant_id: str, prompts: list[dict],
                    n_predict: int, top_k: int, tmp: Path) -> Path:
    """``variant_id``: TYPE, or TYPE-pure for ``requantize --pure``."""
    ggml_type = variant_id.removesuffix("-pure")
    pure = ggml_type != variant_id
    flag = " --pure" if pure else ""
    variant = tmp / f"{stem(model.name)}-{variant_id}.gguf"
    plans = requantize.requantize(model, variant, ggml_type, lib, pure=pure)
    # a GGML type that is no file type (Q4_K) is pure too; llama-quantize reads Q4_K as Q4_K_M
    llama_pure = requantize.parse_target(ggml_type, pure).pure
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
        "command": f"python tools/make_requant_reference.py --model {model.name} {variant_id}",
        "llama_cpp_build": driver.LLAMA_CPP_BUILD,
        "source": {"file": model.name, "sha256": driver.sha256_file(model)},
        "variant": {
            "type": ggml_type,
            "pure": llama_pure,
            "made_by": f"python tools/requantize.py {model.name} VARIANT {ggml_type}{flag}",
            "sha256": driver.sha256_file(variant),
            "size": variant.stat().st_size,
            "tensor_types": dict(Counter(p.out_type.name for p in plans).most_common()),
        },
        "llama_quantize": llama_quantize_types(lib, model, ggml_type, llama_pure, plans),
        "settings": {**driver.SETTINGS, "n_predict": n_predict, "top_k": 4},
        "cases": _cases(prompts, quant),
        "f32_twin": {
            "made_by": "llama-quantize --allow-requantize VARIANT TWIN F32",
            "top_k": top_k,
            "cases": _cases(prompts, f32),
        },
    }
    path = OUT_DIR / f"requant-{stem(model.name)}-{variant_id}.json"
    path.write_text(driver.dump_json(doc))
    return path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("types", nargs="*", help="TYPE or TYPE-pure; default: the model's MODELS")
    ap.add_argument("--model", default="SmolLM2-135M-Instruct.Q4_1.gguf", choices=list(MODELS))
    ap.add_argument("--n-predict", type=int, default=None, help="default: the model's MODELS")
    ap.add_argument("--top-k", type=int, default=8)
    args = ap.parse_args()
    refs = MODELS[args.model]
    paths = driver.LlamaPaths.default()
    exe = driver.build(paths)
    model = driver.test_data_dir() / "models" / args.model
    by_id = {p["id"]: p for p in json.loads(PROMPTS.read_text())}
    prompts = [by_id[i] for i in refs.prompt_ids]
    n_predict = args.n_predict or refs.n_predict
    with tempfile.TemporaryDirectory(prefix="requant-") as tmp:
        for t in args.types or refs.types:
            path = write_reference(exe, paths.lib, model, t, prompts, n_predict, args.top_k,
                                   Path(tmp))
            print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
