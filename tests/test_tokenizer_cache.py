"""The tokenizer's memo of long texts (deimos.tokenizer.cache.EncodeCache). Oracle: the same
vocab's tokenizer with nothing cached (max_chars=0), on long texts with special tokens, both
vocab kinds and every flag combination."""

from __future__ import annotations

import threading

import pytest

from tokenizer_support import load_tokenizer, vocab_file

from deimos.tokenizer import Tokenizer
from deimos.tokenizer.cache import EncodeCache

SMOLLM = "models/SmolLM2-135M-Instruct.Q4_1.gguf"

PARTS = ["def f(x):\n        return x  # done\n\n", "emoji 😁🦙 and CJK 我想在apple工作 ",
         "<|im_start|>user\nHi<|im_end|>", "  spaces   and\ttabs\n", "numbers 1234567 ?!., "]


def _texts() -> list[str]:
    return [("".join(PARTS[(i + j) % len(PARTS)] for j in range(n))) for i, n in
            enumerate((20, 33, 47, 2))]


@pytest.mark.parametrize("rel", [SMOLLM, vocab_file("llama-spm")])
def test_cached_ids_are_the_uncached_ones(rel: str) -> None:
    vocab = load_tokenizer(rel).vocab
    plain = Tokenizer(vocab, EncodeCache(max_chars=0))
    tok = Tokenizer(vocab, EncodeCache(min_chars=512))
    flags = [(a, p) for a in (False, True) for p in (False, True)]
    for _ in range(2):  # the second pass: every long text a hit
        for text in _texts():
            for add, parse in flags:
                assert tok.encode(text, add, parse) == plain.encode(text, add, parse), (text[:30], add, parse)
    n_long = sum(len(t) >= tok.cache.min_chars for t in _texts())
    assert n_long == 3
    assert tok.cache.misses == n_long * len(flags) and tok.cache.hits == n_long * len(flags)
    assert len(plain.cache) == 0 and plain.cache.hits == 0
    # the default min_chars (64) keeps shorter texts too, e.g. the template's text between two
    # messages, special tokens included: the same ids
    texts = [*_texts(), ("<|im_end|>\n<|im_start|>user\n" + PARTS[0])[:90]]
    default = Tokenizer(vocab, EncodeCache())
    for _ in range(2):
        for text in texts:
            for add, parse in flags:
                assert default.encode(text, add, parse) == plain.encode(text, add, parse)
    kept = sum(len(t) >= default.cache.min_chars for t in texts)
    assert kept == 4 and default.cache.hits == default.cache.misses == kept * len(flags)


def test_a_hit_is_a_new_list() -> None:
    tok = Tokenizer(load_tokenizer(SMOLLM).vocab, EncodeCache())
    text = _texts()[0]
    first = tok.encode(text)
    want = list(first)
    first.append(-1)
    again = tok.encode(text)
    assert again == want and again is not first
    again.clear()
    assert tok.encode(text) == want


def test_least_recently_used_texts_go_first() -> None:
    cache = EncodeCache(max_chars=3000, min_chars=10)
    texts = [c * 1000 for c in "abcd"]
    calls = []

    def enc(t: str):
        return lambda: calls.append(t) or [ord(t[0])] * 3

    for t in texts[:3]:
        cache.get((t, False, False), enc(t))
    cache.get((texts[0], False, False), enc(texts[0]))  # a hit: "a" is now the newest
    cache.get((texts[3], False, False), enc(texts[3]))  # "b" goes
    assert cache.chars == 3000 and len(cache) == 3
    assert [t[0] for t in calls] == ["a", "b", "c", "d"]
    for t in (texts[0], texts[2], texts[3]):
        assert cache.get((t, False, False), enc(t)) == [ord(t[0])] * 3
    assert len(calls) == 4
    cache.get((texts[1], False, False), enc(texts[1]))
    assert calls[-1] == texts[1]
    cache.get(("short", False, False), enc("short"))  # under min_chars: never kept
    cache.get(("short", False, False), enc("short"))
    assert calls[-2:] == ["short", "short"] and len(cache) == 3
    with pytest.raises(ValueError, match="min_chars"):
        EncodeCache(min_chars=0)


def test_the_number_of_texts_is_bounded_too() -> None:
    """Short texts (the template's text between messages) are kept from min_chars on; past
    max_entries the least recently used goes, whatever the characters held."""
    cache = EncodeCache(min_chars=4, max_entries=3)
    texts = [f"text {i:02d}" for i in range(5)]
    for t in texts:
        assert cache.get((t, False, True), lambda t=t: [len(t)]) == [len(t)]
    assert len(cache) == 3 and cache.chars == 3 * len(texts[0])
    calls = []
    for t in texts[2:]:  # the newest three: hits
        cache.get((t, False, True), lambda t=t: calls.append(t) or [0])
    cache.get((texts[0], False, True), lambda: calls.append(texts[0]) or [0])  # gone: encoded
    assert calls == [texts[0]]
    with pytest.raises(ValueError, match="max_entries"):
        EncodeCache(max_entries=-1)


def test_threads_share_one_cache() -> None:
    vocab = load_tokenizer(SMOLLM).vocab
    want = [Tokenizer(vocab, EncodeCache(max_chars=0)).encode(t) for t in _texts()]
    tok = Tokenizer(vocab, EncodeCache(max_chars=4000))  # small: entries come and go
    errors = []

    def work(k: int) -> None:
        for i in range(40):
            j = (i * 7 + k) % len(want)
            if tok.encode(_texts()[j]) != want[j]:
                errors.append((k, j))

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and tok.cache.chars <= 4000


def _partition_oracle(vocab, text: str, parse_special: bool) -> list:
    """tokenizer_st_partition written out plainly: each special token in turn (longest first),
    split out of every raw span, spaces stripped beside it as its LSTRIP / RSTRIP flags say."""
    from deimos.tokenizer.vocab import TokenAttr

    frags = [(0, len(text))]
    for tid in vocab.special_token_ids:
        attr = TokenAttr(vocab.attrs[tid])
        if not parse_special and attr & (TokenAttr.CONTROL | TokenAttr.UNKNOWN):
            continue
        tok = vocab.tokens[tid]
        out = []
        for fr in frags:
            if isinstance(fr, int):
                out.append(fr)
                continue
            s, e = fr
            while (m := text.find(tok, s, e)) >= 0:
                le = m
                while TokenAttr.LSTRIP in attr and le > s and text[le - 1] in " \t\n\v\f\r":
                    le -= 1
                if le > s:
                    out.append((s, le))
                out.append(tid)
                s = m + len(tok)
                while TokenAttr.RSTRIP in attr and s < e and text[s] in " \t\n\v\f\r":
                    s += 1
            if e > s:
                out.append((s, e))
        frags = out
    return frags


def test_the_partition_strips_beside_lstrip_and_rstrip_tokens() -> None:
    """SmolLM2's vocabulary with two special tokens given LSTRIP / RSTRIP (no vocabulary at
    hand has an LSTRIP one): the tokenizer's partition (flags read once, plain values) equals the
    oracle on random texts around them, with and without parse_special."""
    import copy
    import random

    from deimos.tokenizer.vocab import TokenAttr

    vocab = copy.copy(load_tokenizer(SMOLLM).vocab)
    vocab.attrs = list(vocab.attrs)
    vocab.__dict__.pop("special_token_ids", None)  # a cached property of the original's attrs
    control = [t for t in vocab.special_token_ids
               if TokenAttr(vocab.attrs[t]) & TokenAttr.CONTROL][:2]
    a, b = control
    vocab.attrs[a] |= TokenAttr.LSTRIP
    vocab.attrs[b] |= TokenAttr.RSTRIP | TokenAttr.LSTRIP
    tok = Tokenizer(vocab, EncodeCache(max_chars=0))
    rng = random.Random(4)
    pieces = [vocab.tokens[a], vocab.tokens[b], " ", "  \n", "\t", "word", "x y", "<|", "|>"]
    seen = set()
    for _ in range(400):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 12)))
        for parse in (False, True):
            got = tok._partition(text, parse)
            assert got == _partition_oracle(vocab, text, parse), (text, parse)
            seen |= {x for x in got if isinstance(x, int)}
    assert {a, b} <= seen  # both tokens were split out, with their spaces
