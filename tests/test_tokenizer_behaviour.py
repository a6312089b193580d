"""Tokenizer properties with their own oracles: round trips, streaming = batch decoding,
special-token parsing, errors on bad metadata, speed."""

from __future__ import annotations

import time

import pytest

from testdata import data_file
from tokenizer_support import load_tokenizer, vocab_file

from deimos.gguf import GGUFFile
from deimos.tokenizer import Tokenizer, Vocab, VocabError

SMOLLM = "models/SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA3 = "models/gemma-3-270m-q4_k_m.gguf"

TEXTS = [
    "Hello world",
    "  two leading spaces, and a trailing one ",
    "emoji 😁🦙👨‍👩‍👧‍👦 and CJK 我想在apple工作 and 日本語",
    "numbers 1234567 and punctuation ?!.,;: 'quotes' \"double\"",
    "code:\n\tdef f(x):\n        return x  # done\n\n",
    "rare scripts: 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ꙮ 𓀀 ᚠᛇᚻ",
]


@pytest.mark.parametrize("rel", [SMOLLM, vocab_file("qwen2"), vocab_file("qwen35"), GEMMA3,
                                 vocab_file("llama-spm")])
def test_round_trip(rel: str) -> None:
    # These vocabs do no clean-up of spaces on decode, so decoding is exactly the inverse.
    tok = load_tokenizer(rel)
    assert not tok.vocab.clean_spaces
    # llama.cpp strips SPM's prefix space from the first token, except after a removed BOS
    # (llama_detokenize; the golden test checks that quirk against llama.cpp itself).
    after_bos = " " if tok.vocab.add_space_prefix and tok.vocab.add_bos else ""
    for text in TEXTS:
        assert tok.decode(tok.encode(text, add_special=False)) == text
        assert tok.decode(tok.encode(text, add_special=True), skip_special=True) == after_bos + text


@pytest.mark.parametrize("rel", [SMOLLM, GEMMA3, vocab_file("llama-spm"), vocab_file("gemma-4")])
def test_stream_decoder_matches_decode(rel: str) -> None:
    tok = load_tokenizer(rel)
    held_back = 0
    for text in TEXTS:
        ids = tok.encode(text, add_special=False)
        dec = tok.stream_decoder(strip_leading_space=True)
        chunks = [dec.feed(i) for i in ids]
        chunks.append(dec.flush())
        assert all("\ufffd" not in c for c in chunks), chunks
        held_back += sum(c == "" for c in chunks[:-1])
        # decode() minus the space clean-up (gemma-4 does it; a stream cannot look ahead)
        first = [tok.token_to_piece(ids[0], lstrip=int(tok.vocab.add_space_prefix))] if ids else []
        raw = b"".join(first + [tok.token_to_piece(i) for i in ids[1:]])
        assert "".join(chunks) == raw.decode("utf-8")
        if not tok.vocab.clean_spaces:
            assert "".join(chunks) == tok.decode(ids)
    assert held_back > 0  # some character really was split across tokens


def test_stream_decoder_holds_split_character() -> None:
    tok = load_tokenizer(GEMMA3)
    # 𓀀 is not in the gemma3 vocab: it falls back to its four UTF-8 byte tokens
    ids = tok.encode("𓀀", add_special=False)
    assert [tok.token_to_piece(i) for i in ids] == [bytes([b]) for b in "𓀀".encode()]
    dec = tok.stream_decoder()
    assert [dec.feed(i) for i in ids] == ["", "", "", "𓀀"]
    dec.feed(ids[0])
    assert dec.flush() == "\ufffd"  # an unfinished character is never emitted as bytes


def test_special_token_parsing() -> None:
    tok = load_tokenizer(SMOLLM)
    im_start, im_end = tok.token_id("<|im_start|>"), tok.token_id("<|im_end|>")
    assert im_start is not None and im_end is not None and tok.is_control(im_start)
    text = "<|im_start|>user\nHi<|im_end|>"
    parsed = tok.encode(text, add_special=False, parse_special=True)
    assert parsed[0] == im_start and parsed[-1] == im_end
    assert parsed[1:-1] == tok.encode("user\nHi", add_special=False)
    plain = tok.encode(text, add_special=False, parse_special=False)
    assert im_start not in plain and im_end not in plain
    assert tok.decode(plain) == text
    assert tok.decode(parsed) == text
    assert tok.decode(parsed, skip_special=True) == "user\nHi"
    assert tok.eot_id is not None and tok.eot_id in tok.eog_ids and tok.eos_id in tok.eog_ids


def test_add_special_follows_vocab_flags() -> None:
    gemma = load_tokenizer(GEMMA3)
    assert gemma.vocab.add_bos and not gemma.vocab.add_eos
    assert gemma.encode("hi")[0] == gemma.bos_id
    assert gemma.encode("hi", add_special=False) == gemma.encode("hi")[1:]
    smol = load_tokenizer(SMOLLM)
    assert not smol.vocab.add_bos  # tokenizer.ggml.add_bos_token = false in the file
    assert smol.encode("hi") == smol.encode("hi", add_special=False)


def _metadata(rel: str) -> dict:
    with GGUFFile(data_file(rel)) as f:
        return {k: v for k, v in f.metadata.items() if k.startswith(("tokenizer.", "general."))}


def test_bad_metadata_errors() -> None:
    md = _metadata(vocab_file("gpt-2"))
    with pytest.raises(VocabError, match="pre-tokenizer.*'no-such-pre'"):
        Vocab.from_metadata({**md, "tokenizer.ggml.pre": "no-such-pre"}, source="x.gguf")
    with pytest.raises(VocabError, match="x.gguf.*tokenizer.ggml.model.*'wordpiece9'"):
        Vocab.from_metadata({**md, "tokenizer.ggml.model": "wordpiece9"}, source="x.gguf")
    no_merges = {k: v for k, v in md.items() if k != "tokenizer.ggml.merges"}
    with pytest.raises(VocabError, match="tokenizer.ggml.merges"):
        Vocab.from_metadata(no_merges)
    no_tokens = {k: v for k, v in md.items() if k != "tokenizer.ggml.tokens"}
    with pytest.raises(VocabError, match="tokenizer.ggml.tokens"):
        Vocab.from_metadata(no_tokens)
    short_scores = {**md, "tokenizer.ggml.scores": [0.0] * 10}
    with pytest.raises(VocabError, match="tokenizer.ggml.scores"):
        Vocab.from_metadata(short_scores)
    # a missing pre-tokenizer falls back to 'default' with a warning, as in llama.cpp
    no_pre = {k: v for k, v in md.items() if k != "tokenizer.ggml.pre"}
    assert Vocab.from_metadata(no_pre).pre.name == "default"


@pytest.mark.parametrize("rel", [vocab_file("qwen2"), GEMMA3])
def test_speed(rel: str) -> None:
    md = _metadata(rel)
    t0 = time.perf_counter()
    vocab = Vocab.from_metadata(md)
    tok = Tokenizer(vocab)
    tok.encode("warm up the merge table")
    t_build = time.perf_counter() - t0
    text = (" ".join(TEXTS) * 40)[:10_000]
    t0 = time.perf_counter()
    ids = tok.encode(text)
    t_encode = time.perf_counter() - t0
    assert len(ids) > 1000
    assert t_build < 1.0, f"vocab build took {t_build:.2f}s"
    assert t_encode < 1.0, f"encoding 10 KB took {t_encode:.2f}s"
