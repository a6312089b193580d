"""Differential fuzzing of the tokenizer against llama.cpp's: random texts through
``Tokenizer.encode`` and ``llama_tokenize`` (libllama via ctypes, vocab-only loads), for every
vocabulary of tools/make_tokenizer_golden.py and the three (add_special, parse_special)
settings, and llama.cpp's ids back through ``detokenize_bytes`` and ``llama_detokenize``
(special tokens kept as text, and removed); every disagreement printed with the text.

    LD_LIBRARY_PATH=DIR python tools/fuzz_tokenizer.py DIR/libllama.so [--cases 2000] [--seed 1]
        [--vocabs llama-spm,qwen2]

The texts join random pieces: words of several scripts, digits and numbers, punctuation and
brackets, runs of spaces, tabs, newlines and carriage returns, no-break and other Unicode
spaces, emoji with joiners and variation selectors, combining marks, SentencePiece's U+2581,
code, each vocabulary's own special-token texts (some with spaces around them) and rare
characters (private use, control characters, NUL). Exit status 1 when any case disagrees.
llama.cpp's build is the one the golden file names (``LLAMA_CPP_BUILD``); it is an instrument,
not a dependency.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tools"), str(REPO / "tests")]

from make_tokenizer_golden import VOCABS, _Llama  # noqa: E402
from testdata import data_dir  # noqa: E402

from deimos.gguf import GGUFFile  # noqa: E402
from deimos.tokenizer import Tokenizer  # noqa: E402

WORDS = ["hello", "World", "the", "I'm", "we'LL", "don't", "Ünïcödé", "naïve", "straße", "ǅ",
         "Привет", "мир", "γειά", "שלום", "مرحبا", "नमस्ते", "สวัสดี", "안녕하세요", "こんにちは",
         "漢字", "中文字符", "ｶﾀｶﾅ", "ＡＢＣ", "ﬁ", "x²", "½", "٣٤٥"]
PUNCT = list(".,;:!?-_'\"`()[]{}<>/\\|@#$%^&*+=~") + ["...", "—", "–", "“", "”", "‘", "’", "…", "«»"]
SPACES = [" ", "  ", "   ", "\t", "\n", "\n\n", "\r\n", "\r", " \n ", "\u00a0", "\u2009", "\u3000",
          "\u200b", "\u2581", "\u2581\u2581", "\f", "\v"]
EMOJI = ["😁", "🚀", "🦙", "👨\u200d👩\u200d👧", "😶\u200d🌫\ufe0f", "✅", "❤\ufe0f", "🇫🇷", "👍🏽"]
RARE = ["\x00", "\x01", "\x7f", "\ue000", "\U0010fffd", "\ufffd", "\u0301", "e\u0301", "\u0308\u0323",
        "\U0001d11e", "\u202e", "\ufeff"]
CODE = ["def f(x):\n    return x", "for (int i = 0; i < n; ++i) {", "</div>", "{\"a\": [1, 2]}",
        "x = y**2  # c", "SELECT * FROM t;"]


def random_text(rng: random.Random, specials: list[str]) -> str:
    parts = []
    for _ in range(rng.randint(1, 14)):
        kind = rng.random()
        if kind < 0.3:
            parts.append(rng.choice(WORDS))
        elif kind < 0.45:
            parts.append(str(rng.choice([rng.randint(0, 9), rng.randint(0, 10**9), rng.random()])))
        elif kind < 0.6:
            parts.append(rng.choice(SPACES))
        elif kind < 0.7:
            parts.append(rng.choice(PUNCT))
        elif kind < 0.77:
            parts.append(rng.choice(EMOJI))
        elif kind < 0.83:
            parts.append(rng.choice(RARE))
        elif kind < 0.9:
            parts.append(rng.choice(CODE))
        elif specials:
            s = rng.choice(specials)
            parts.append(rng.choice(["", " ", "\n"]) + s + rng.choice(["", " ", "\n"]))
    return "".join(parts)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("libllama")
    ap.add_argument("--cases", type=int, default=2000, help="texts per vocabulary")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--vocabs", default="", help="comma-separated names (default: all)")
    ap.add_argument("--show", type=int, default=5, help="disagreements printed per vocabulary")
    a = ap.parse_args()
    llama = _Llama(a.libllama)
    wanted = set(filter(None, a.vocabs.split(",")))
    bad_total = 0
    for name, rel in VOCABS:
        if wanted and name not in wanted:
            continue
        path = data_dir() / rel
        with GGUFFile(path) as f:
            tok = Tokenizer.from_gguf(f)
        _, v = llama.load(str(path))
        specials = [tok.vocab.tokens[i] for i in tok.vocab.special_token_ids][:200]
        rng = random.Random(f"{a.seed}:{name}")
        bad = 0
        for _ in range(a.cases):
            text = random_text(rng, specials)
            for add_special, parse_special in ((False, False), (True, False), (True, True)):
                ours = tok.encode(text, add_special=add_special, parse_special=parse_special)
                theirs = llama.tokenize(v, text, add_special, parse_special)
                if ours != theirs:
                    bad += 1
                    if bad <= a.show:
                        at = next((i for i, (x, y) in enumerate(zip(ours, theirs)) if x != y),
                                  min(len(ours), len(theirs)))
                        print(f"  {name} add_special={add_special} parse_special={parse_special} "
                              f"{text!r}\n    first difference at {at}: ours {ours[at:at + 6]} "
                              f"llama.cpp {theirs[at:at + 6]}")
                # and back: llama_detokenize of the same ids, both ways of treating specials
                for remove, unparse in ((False, True), (True, False)):
                    back = tok.detokenize_bytes(theirs, remove_special=remove, unparse_special=unparse)
                    want = llama.detokenize(v, theirs, remove, unparse)
                    if back != want:
                        bad += 1
                        if bad <= a.show:
                            print(f"  {name} detokenize remove_special={remove} unparse_special="
                                  f"{unparse} of {theirs[:12]}: ours {back[:60]!r} llama.cpp "
                                  f"{want[:60]!r}")
        print(f"{name}: {a.cases} texts x 3 settings, encoded and decoded back two ways: "
              f"{bad} disagreements")
        bad_total += bad
    return 1 if bad_total else 0


if __name__ == "__main__":
    sys.exit(main())
