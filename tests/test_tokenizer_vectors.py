"""llama.cpp's own tokenizer vectors: models/ggml-vocab-*.gguf with .inp/.out files.

Each .out line is what llama.cpp's tests/test-tokenizer-0 expects from
llama_tokenize(text, add_special=false, parse_special=false).
"""

from __future__ import annotations

import pytest

from testdata import data_file
from tokenizer_support import load_tokenizer, read_vectors, vocab_file

from deimos.gguf import GGUFFile
from deimos.tokenizer import Tokenizer, VocabError

SUPPORTED = (
    "command-r deepseek-coder deepseek-llm falcon gemma-4 gpt-2 llama-bpe llama-spm mpt phi-3 "
    "qwen2 qwen35 refact starcoder"
).split()


@pytest.mark.parametrize("name", SUPPORTED)
def test_llama_cpp_vectors(name: str) -> None:
    tok = load_tokenizer(vocab_file(name))
    cases = read_vectors(vocab_file(name))
    assert len(cases) >= 40
    for text, expected in cases:
        assert tok.encode(text, add_special=False, parse_special=False) == expected, repr(text)


@pytest.mark.parametrize("name", ["bert-bge"])
def test_unsupported_model_is_a_clear_error(name: str) -> None:
    with GGUFFile(data_file(vocab_file(name))) as f, pytest.raises(VocabError) as e:
        Tokenizer.from_gguf(f)
    msg = str(e.value)
    assert "tokenizer.ggml.model" in msg and "'bert'" in msg and "ggml-vocab-bert-bge.gguf" in msg
