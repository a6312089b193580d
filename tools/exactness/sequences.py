"""The token sequences of the exactness study, per model: what is teacher-forced and which
positions are scored.

- ``kinds``: every prompt of tests/data/prompts.json followed by the first 16 tokens llama.cpp
  generated from it (tests/data/reference/<model>.json), so the text is fixed and recorded;
- ``repeat``: one word repeated 24 times (the issue's repeated-word case and its neighbours);
- ``long``: 1,536 tokens of real text (Alice's Adventures in Wonderland, deimos.eval.corpus),
  scored every 16th position.

Every position whose next token is in the sequence is scored (``next_tokens`` for the
per-position statistics of deimos.eval.kld); ``first_gen`` marks the position whose logits
chose the first generated token (the last prompt position), the issue's own measure.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from deimos.tokenizer import Tokenizer

REPO = Path(__file__).resolve().parents[2]
PROMPTS = REPO / "tests" / "data" / "prompts.json"
REFERENCE_DIR = REPO / "tests" / "data" / "reference"
N_GENERATED = 16
REPEAT_WORDS = ("the", "dog", "data", "no", "hello", "cat", "test", "and")
REPEAT_TIMES = 24
LONG_TOKENS = 1536
LONG_STRIDE = 16
LONG_SKIP_CHARS = 1000  # past the Project Gutenberg header, into chapter I


@dataclass(frozen=True)
class Sequence:
    group: str  # "kinds", "repeat", "long"
    id: str
    tokens: tuple[int, ...]
    positions: tuple[int, ...]  # scored; each < len(tokens) - 1
    first_gen: int | None = None  # the position that chose the first generated token

    @property
    def next_tokens(self) -> list[int]:
        return [self.tokens[p + 1] for p in self.positions]


def kinds(model_file: str) -> list[Sequence]:
    ref = json.loads((REFERENCE_DIR / f"{Path(model_file).stem}.json").read_text())
    out = []
    for case in ref["cases"]:
        prompt = case["prompt_tokens"]
        toks = tuple(prompt + case["tokens"][:N_GENERATED])
        out.append(Sequence("kinds", case["id"], toks, tuple(range(len(toks) - 1)), len(prompt) - 1))
    return out


def repeat(tok: Tokenizer) -> list[Sequence]:
    out = []
    for word in REPEAT_WORDS:
        toks = tuple(tok.encode(" ".join([word] * REPEAT_TIMES)))
        # the first generated token after 12 repetitions: the prompt
        twelve = len(tok.encode(" ".join([word] * 12))) - 1
        out.append(Sequence("repeat", f"{word} x{REPEAT_TIMES}", toks, tuple(range(len(toks) - 1)),
                            twelve))
    return out


def long(tok: Tokenizer, text: str) -> list[Sequence]:
    toks = tuple(tok.encode(text[LONG_SKIP_CHARS:LONG_SKIP_CHARS + 8 * LONG_TOKENS])[:LONG_TOKENS])
    if len(toks) < LONG_TOKENS:
        raise ValueError(f"long context: the text gives only {len(toks)} tokens")
    positions = tuple(range(LONG_STRIDE - 1, LONG_TOKENS - 1, LONG_STRIDE))
    return [Sequence("long", f"alice {LONG_TOKENS}", toks, positions)]


def all_sequences(model_file: str, tok: Tokenizer, long_text: str | None) -> list[Sequence]:
    seqs = kinds(model_file) + repeat(tok)
    return seqs + long(tok, long_text) if long_text is not None else seqs
