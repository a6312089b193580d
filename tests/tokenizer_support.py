"""Test support for the tokenizer tests: a per-process vocab cache, llama.cpp's tokenizer
vectors, and the piece digest of tests/test_tokenizer_golden.json.

Paths are relative to $DEIMOS_TEST_DATA and go through testdata.data_file (a missing file
fails the test with how to fetch it, never skips). This module defines no tests.
"""

from __future__ import annotations

import functools
import hashlib

from testdata import LLAMA_CPP, data_file

from deimos.gguf import GGUFFile
from deimos.tokenizer import Tokenizer


def vocab_file(name: str) -> str:
    """Relative path of llama.cpp's models/ggml-vocab-<name>.gguf."""
    return f"{LLAMA_CPP}/models/ggml-vocab-{name}.gguf"


@functools.cache
def load_tokenizer(rel: str) -> Tokenizer:
    # cached: several test modules use the same 150k-token vocabs
    with GGUFFile(data_file(rel)) as f:
        return Tokenizer.from_gguf(f)


def read_vectors(rel: str) -> list[tuple[str, list[int]]]:
    """llama.cpp's .inp/.out tokenizer vectors, parsed as tests/test-tokenizer-0.cpp does."""
    raw = data_file(rel + ".inp").read_bytes().decode("utf-8")
    outs = data_file(rel + ".out").read_text(encoding="utf-8").split("\n")
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


def pieces_digest(pieces: list[bytes]) -> str:
    """sha256 over every token's piece, each prefixed by its 4-byte little-endian length (so
    piece boundaries count); tools/make_tokenizer_golden.py records it for libllama's pieces."""
    h = hashlib.sha256()
    for p in pieces:
        h.update(len(p).to_bytes(4, "little") + p)
    return h.hexdigest()
