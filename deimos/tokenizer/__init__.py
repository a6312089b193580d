"""Tokenizer from GGUF metadata, with token ids identical to llama.cpp's.

``Tokenizer`` (encode / decode / stream decoding) over a ``Vocab`` (tokens, scores,
attributes, merges, special ids). BPE (``tokenizer.ggml.model`` "gpt2", "gemma4") with
llama.cpp's pre-tokenizers, and SentencePiece ("llama"). The chat template and stop
logic live in ``template.py`` / ``stops.py``.
"""

from __future__ import annotations

from .pretok import PRE_TOKENIZERS, PreTokenizer
from .tokenizer import StreamDecoder, Tokenizer
from .vocab import TokenAttr, TokenType, Vocab, VocabError

__all__ = [
    "PRE_TOKENIZERS",
    "PreTokenizer",
    "StreamDecoder",
    "TokenAttr",
    "TokenType",
    "Tokenizer",
    "Vocab",
    "VocabError",
]
