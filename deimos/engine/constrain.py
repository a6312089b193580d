"""Constrained decoding: only tokens that keep the output valid JSON (under a schema) survive.

The grammar work is llguidance's (the Rust library behind Guidance, also used by llama.cpp
and vLLM): it compiles a JSON Schema to a grammar and, at every step, computes the set of
tokens that can extend the text, as a bitmask over the vocabulary, from the byte strings of
our own tokens. It never needs a Hugging Face tokenizer.

    vocab = GrammarVocab.from_tokenizer(llm.tokenizer, llm.stop_ids)   # once per model
    c = JsonConstraint.from_schema(schema, vocab)                      # once per request
    loop: logits = c.allowed(logits); token = sample(logits); c.advance(token)

The end-of-generation tokens (``stop_ids``) are allowed exactly when the JSON is complete; once
nothing else can follow (the top-level object is closed), they are the only tokens allowed.
"""

from __future__ import annotations

import json
import weakref
from collections.abc import Iterable, Mapping
from typing import Any

import jsonschema
import llguidance
import numpy as np
import torch

from deimos.engine.jsontext import check_size
from deimos.kernels.token_mask import bits_of
from deimos.tokenizer import TokenAttr, Tokenizer

__all__ = ["GrammarVocab", "JsonConstraint", "any_object"]

# Whitespace between JSON tokens: bounded, so a model cannot fill its budget with newlines.
WHITESPACE = r"[\x20\x09\x0A\x0D]{0,32}"
OBJECT_DEPTH = 6  # json_object mode: objects and arrays nest at most this deep


def any_object(depth: int = OBJECT_DEPTH) -> dict[str, Any]:
    """response_format json_object: any JSON object whose objects and arrays nest at most
    ``depth`` deep (the top one included). Unbounded, a model can open ``{"a":{"b":...`` until
    its token budget runs out; bounded, from the deepest level only scalars can follow, so
    the grammar always leads toward a close."""
    if depth < 1:
        raise ValueError(f"depth must be >= 1, got {depth}")
    scalars = ["string", "number", "boolean", "null"]
    defs: dict[str, Any] = {"v0": {"type": scalars}}  # v{k}: a value holding <= k levels
    for k in range(1, depth):
        ref = {"$ref": f"#/$defs/v{k - 1}"}
        defs[f"v{k}"] = {"type": [*scalars, "array", "object"], "items": ref,
                         "additionalProperties": ref}
    return {"type": "object", "additionalProperties": {"$ref": f"#/$defs/v{depth - 1}"},
            "$defs": defs}


ANY_OBJECT: dict[str, Any] = any_object()
COMPILE_OPTIONS = {
    "whitespace_pattern": WHITESPACE,
    # any \uXXXX escape in strings (llguidance's default allows them for control characters
    # only), so a model trained on ASCII-escaped JSON is not pushed off its usual spelling
    "json_allow_general_unicode_escapes": True,
}


class GrammarVocab:
    """Our vocabulary as llguidance sees it: each token's bytes, control tokens marked as
    special (llguidance's convention: a leading 0xFF byte, so no grammar text can produce
    them), and the end-of-generation ids. Building one takes about a second for a 262k
    vocabulary: build it once per model."""

    __slots__ = ("ll", "n_vocab", "stop_ids")

    def __init__(self, pieces: list[bytes], stop_ids: Iterable[int], encode: Any) -> None:
        self.n_vocab = len(pieces)
        self.stop_ids = frozenset(stop_ids)
        bad = [t for t in self.stop_ids if not 0 <= t < self.n_vocab]
        if not self.stop_ids or bad:
            raise ValueError(f"stop ids must be a non-empty set of ids in [0, {self.n_vocab}), "
                             f"got {sorted(self.stop_ids)}")
        self.ll = llguidance.LLTokenizer(
            _TokenizerInfo(pieces, min(self.stop_ids), encode),
            n_vocab=self.n_vocab,
            eos_token=sorted(self.stop_ids),
        )

    @classmethod
    def from_tokenizer(cls, tokenizer: Tokenizer, stop_ids: Iterable[int] | None = None,
                       n_vocab: int | None = None) -> GrammarVocab:
        """``stop_ids``: the ids that end generation (default ``tokenizer.eog_ids``; pass
        ``LLM.stop_ids`` to include the chat template's turn end). ``n_vocab``: the model's
        logit count when it exceeds the tokenizer's (padding rows get no bytes, never allowed)."""
        v = tokenizer.vocab
        pieces = []
        for i in range(tokenizer.n_vocab):
            piece = tokenizer.token_to_piece(i)
            attr = v.attrs[i]
            if attr & TokenAttr.CONTROL or (
                attr & TokenAttr.USER_DEFINED and piece.startswith(b"<") and piece.endswith(b">")
            ):
                piece = b"\xff" + piece  # as llguidance's llama.cpp adapter marks them
            pieces.append(piece)
        if n_vocab is not None:
            if n_vocab < len(pieces):
                raise ValueError(f"n_vocab {n_vocab} is smaller than the tokenizer's {len(pieces)}")
            pieces += [b""] * (n_vocab - len(pieces))

        def encode(text: bytes | str) -> list[int]:
            # tokens that spell the text exactly: llguidance matches their bytes against it (a
            # SentencePiece space prefix in front made it panic on forced text: json_object
            # mode with LLaMA's vocabulary, found by tools/fuzz_api.py)
            if isinstance(text, bytes):
                text = text.decode("utf-8", errors="replace")
            return tokenizer.encode_verbatim(text)

        return cls(pieces, tokenizer.eog_ids if stop_ids is None else stop_ids, encode)


class _TokenizerInfo:
    """The duck type ``llguidance.LLTokenizer`` reads (its ``TokenizerWrapper`` fields); the
    call tokenizes text, which llguidance uses only for prompt healing and forced text."""

    def __init__(self, pieces: list[bytes], eos: int, encode: Any) -> None:
        self.tokens = pieces
        self.eos_token_id = eos
        self.bos_token_id = None
        self.special_token_ids: list[int] = []
        self.is_tokenizer_wrapper = True
        self._encode = encode

    def __call__(self, text: bytes | str) -> list[int]:
        return self._encode(text)


# One GrammarVocab per (tokenizer, stop set, size): from_schema given a Tokenizer must not pay
# the build on every request. Weak keys: a dropped model frees its entry.
_VOCABS: weakref.WeakKeyDictionary[Tokenizer, dict[tuple, GrammarVocab]] = \
    weakref.WeakKeyDictionary()


def _vocab_for(tokenizer: Tokenizer, stop_ids: Iterable[int] | None,
               n_vocab: int | None) -> GrammarVocab:
    key = (None if stop_ids is None else frozenset(stop_ids), n_vocab)
    per_tok = _VOCABS.setdefault(tokenizer, {})
    if key not in per_tok:
        per_tok[key] = GrammarVocab.from_tokenizer(tokenizer, stop_ids, n_vocab)
    return per_tok[key]


def _check_schema(schema: Any) -> dict[str, Any]:
    if not isinstance(schema, Mapping):
        raise ValueError(f"a JSON schema must be an object, got {type(schema).__name__}")
    schema = dict(schema)
    check_size(schema, "the JSON schema")  # before the recursive meta-validation and compiler
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        at = "".join(f"[{p!r}]" for p in e.path)
        raise ValueError(f"invalid JSON schema{' at ' + at if at else ''}: {e.message}") from None
    return schema


class JsonConstraint:
    """One request's JSON grammar state. Not thread-safe; one per sequence."""

    __slots__ = ("vocab", "_matcher", "_bits", "_stopped")

    def __init__(self, vocab: GrammarVocab, grammar: str) -> None:
        self.vocab = vocab
        self._matcher = llguidance.LLMatcher(vocab.ll, grammar, log_level=0)
        if self._matcher.is_error():
            raise ValueError(f"unsupported or invalid JSON schema: {self._matcher.get_error()}")
        self._bits = np.zeros((vocab.n_vocab + 31) // 32, dtype="<u4")
        self._stopped = False

    @classmethod
    def from_schema(cls, schema: Mapping[str, Any] | None, tokenizer: Tokenizer | GrammarVocab,
                    *, stop_ids: Iterable[int] | None = None,
                    n_vocab: int | None = None) -> JsonConstraint:
        """A constraint for ``schema`` (a JSON Schema; None = any JSON object). ``tokenizer``:
        a ``GrammarVocab`` (build one per model) or a ``Tokenizer`` (its ``GrammarVocab`` is
        built on first use and reused). Raises ValueError naming the problem for an invalid
        schema or one using features the grammar compiler does not support."""
        if isinstance(tokenizer, GrammarVocab):
            vocab = tokenizer
        else:
            vocab = _vocab_for(tokenizer, stop_ids, n_vocab)
        schema = ANY_OBJECT if schema is None else _check_schema(schema)
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(
                json.dumps(schema), overrides=COMPILE_OPTIONS)
        except (ValueError, TypeError) as e:
            raise ValueError(f"invalid JSON schema: {e}") from None
        return cls(vocab, grammar)

    @property
    def done(self) -> bool:
        """True once the JSON is complete and nothing but an end-of-generation token may follow
        (or one was taken)."""
        return self._stopped or self._matcher.is_stopped()

    def mask_words(self, out: np.ndarray) -> None:
        """The allowed tokens now as bit words into ``out`` (uint32 [n_words(n_vocab)],
        contiguous): bit j of word w allows token 32 w + j (deimos.kernels.token_mask)."""
        if out.dtype != np.uint32 or out.shape != self._bits.shape or not out.flags.c_contiguous:
            raise ValueError(f"mask_words: out must be contiguous uint32 {self._bits.shape}, "
                             f"got {out.dtype} {out.shape}")
        self._matcher.unsafe_compute_mask_ptr(out.ctypes.data, out.nbytes)
        if self._matcher.is_error():
            raise RuntimeError(f"JSON grammar failed: {self._matcher.get_error()}")

    def mask(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """The allowed tokens now: bool [n_vocab] on ``device``."""
        self.mask_words(self._bits)
        # the words are little-endian, so the bytes' bits in little order are the tokens in
        # id order. numpy, not torch: a tiny torch op can stall for tens of ms on thread
        # hand-offs when the cores are busy.
        return torch.from_numpy(bits_of(self._bits, self.vocab.n_vocab)).to(device)

    def allowed(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` [n_vocab] with every token that would break the JSON set to -inf (a new
        tensor; the input is not changed)."""
        if logits.dim() != 1 or logits.numel() != self.vocab.n_vocab:
            raise ValueError(f"logits must have shape [{self.vocab.n_vocab}], "
                             f"got {tuple(logits.shape)}")
        if logits.device.type == "cpu":  # in numpy for the reason given in mask()
            bits = self.mask().numpy()
            return torch.from_numpy(np.where(bits, logits.detach().numpy(), np.float32("-inf")))
        return logits.masked_fill(~self.mask(logits.device), float("-inf"))

    def advance(self, token_id: int) -> None:
        """Take the sampled token; ValueError if the grammar does not allow it."""
        if self._stopped:
            raise ValueError("the constraint already took an end-of-generation token")
        if not 0 <= token_id < self.vocab.n_vocab:
            raise ValueError(
                f"token {token_id} is outside the vocabulary [0, {self.vocab.n_vocab})")
        if not self._matcher.consume_token(token_id):
            raise ValueError(f"token {token_id} is not allowed here by the JSON grammar "
                             f"({self._matcher.get_error()})")
        if token_id in self.vocab.stop_ids:
            self._stopped = True
