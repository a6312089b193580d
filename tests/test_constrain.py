"""JSON-constrained decoding (deimos.engine.constrain, llguidance underneath).

Oracles: ``json.loads`` and ``jsonschema.validate`` (an independent validator) on what comes
out; for "end-of-generation allowed exactly when complete", ``json.loads`` of every prefix of a
tokenized JSON text. Generation uses the real SmolLM2 model through its own forward loop (the
constraint alone, no server), greedy and sampled with seeds; random walks over the allowed
sets cover both real vocabularies (49152 and 262144 tokens) without a model.
"""

from __future__ import annotations

import json
import time

import jsonschema
import numpy as np
import pytest
import torch
from testdata import model_path

from deimos.engine.constrain import OBJECT_DEPTH, GrammarVocab, JsonConstraint, any_object
from deimos.gguf import GGUFFile
from deimos.kernels.sampling import Sampler, SamplingParams
from deimos.kernels.token_mask import NEG, bits_of, n_words, set_ids
from deimos.runtime.kv_cache import KVCache
from deimos.server.processors import Constrained
from deimos.tokenizer import Tokenizer
from deimos.tokenizer.stops import end_of_generation_ids
from deimos.tokenizer.template import ChatTemplate

SMOL = "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA = "gemma-3-270m-q4_k_m.gguf"

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
    },
    "required": ["name", "age", "color"],
    "additionalProperties": False,
}
PROMPT = "Describe a person as a JSON object with a name, an age and a favourite color."


@pytest.fixture(scope="module")
def llm():
    from deimos import LLM

    return LLM(model_path(SMOL), n_ctx=256)


@pytest.fixture
def one_thread():
    """Single-token decode of a 135M model gains little from a second thread, and on a busy
    machine torch's thread hand-offs cost ten times the math; restored afterwards."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def smol_vocab(llm):
    return GrammarVocab.from_tokenizer(llm.tokenizer, llm.stop_ids)


def _tokenizer_and_stops(name: str) -> tuple[Tokenizer, frozenset[int]]:
    with GGUFFile(model_path(name)) as f:
        md = dict(f.metadata)
        tok = Tokenizer.from_gguf(f)
    template = ChatTemplate.from_metadata(md, tok.vocab.tokens)
    return tok, end_of_generation_ids(tok.vocab, template)


def generate(llm, constraint: JsonConstraint, params: SamplingParams, max_tokens: int = 48):
    """The engine's decode loop with the constraint between the logits and the sampler."""
    prompt = llm.encode_chat([{"role": "user", "content": PROMPT}])
    kv = KVCache(llm.config, len(prompt) + max_tokens + 1)

    def forward(tokens: list[int]) -> torch.Tensor:
        return kv.forward(llm.model, torch.tensor(tokens))[0]

    sampler = Sampler(params, llm.config.n_vocab)
    logits = forward(prompt)
    out: list[int] = []
    for _ in range(max_tokens):
        token = sampler.sample(constraint.allowed(logits))
        constraint.advance(token)
        if token in llm.stop_ids:
            return out, "stop"
        out.append(token)
        logits = forward([token])
    return out, "length"


def check_person(llm, ids: list[int], finish: str) -> dict:
    assert finish == "stop", f"did not finish: {llm.tokenizer.decode(ids)!r}"
    value = json.loads(llm.tokenizer.detokenize_bytes(ids))
    jsonschema.validate(value, PERSON)
    return value


def test_greedy_generation_follows_schema(llm, smol_vocab, one_thread):
    c = JsonConstraint.from_schema(PERSON, smol_vocab)
    ids, finish = generate(llm, c, SamplingParams(temperature=0))
    check_person(llm, ids, finish)
    assert c.done


@pytest.mark.parametrize("seed", [7, 1234])
def test_sampled_generation_follows_schema(llm, smol_vocab, seed, one_thread):
    c = JsonConstraint.from_schema(PERSON, smol_vocab)
    ids, finish = generate(llm, c, SamplingParams(temperature=0.8, seed=seed))
    check_person(llm, ids, finish)


def test_tokenizer_argument_builds_and_reuses_the_vocab(llm):
    a = JsonConstraint.from_schema(None, llm.tokenizer, stop_ids=llm.stop_ids)
    b = JsonConstraint.from_schema(PERSON, llm.tokenizer, stop_ids=llm.stop_ids)
    assert a.vocab is b.vocab and a.vocab.stop_ids == llm.stop_ids


def _eos_allowed_exactly_when_complete(tok: Tokenizer, vocab: GrammarVocab, schema, text: str):
    c = JsonConstraint.from_schema(schema, vocab)
    ids = tok.encode(text, add_special=False)
    stops = sorted(vocab.stop_ids)
    for i, t in enumerate(ids + [stops[0]]):
        mask = c.mask()
        prefix = tok.detokenize_bytes(ids[:i])
        try:
            complete = isinstance(json.loads(prefix), dict)
        except ValueError:
            complete = False
        assert bool(mask[stops].all()) == complete == bool(mask[stops].any()), prefix
        if complete:  # the object is closed: nothing but the end may follow
            assert int(mask.sum()) == len(stops) and c.done
        assert mask[t], f"{tok.decode([t])!r} refused after {prefix!r}"
        c.advance(t)
    assert c.done


@pytest.mark.parametrize("text", [
    '{"name": "Ada Lovelace", "age": 36, "color": "green"}',
    '{\n  "name": "Li \\"Bo\\" \\u00e9",\n  "age": 0,\n  "color": "red"\n}',
])
def test_eos_exactly_when_complete(llm, smol_vocab, text):
    _eos_allowed_exactly_when_complete(llm.tokenizer, smol_vocab, PERSON, text)


def test_json_object_mode_accepts_any_object_and_only_objects(llm, smol_vocab):
    text = '{"a": [1, 2.5e-3, {"b": null}], "c": true, "d": "é\\n"}'
    _eos_allowed_exactly_when_complete(llm.tokenizer, smol_vocab, None, text)
    for bad in ("[1, 2]", '"text"', "42"):
        c = JsonConstraint.from_schema(None, smol_vocab)
        first = llm.tokenizer.encode(bad, add_special=False)[0]
        assert not c.mask()[first]
        with pytest.raises(ValueError, match="not allowed"):
            c.advance(first)


def test_json_object_mode_nests_only_so_deep(llm, smol_vocab):
    """Forced tokens: '{"' after '":' as long as the grammar allows it. Unbounded, a model that
    prefers '{"' opens objects until its budget ends; at OBJECT_DEPTH only a scalar may follow."""
    tok = llm.tokenizer
    opener, colon = tok.encode('{"', add_special=False), tok.encode('":', add_special=False)
    key = tok.encode("a", add_special=False)
    assert len(opener) == len(colon) == len(key) == 1
    c = JsonConstraint.from_schema(None, smol_vocab)
    depth = 0
    while c.mask()[opener[0]]:
        for t in opener + key + colon:
            c.advance(t)
        depth += 1
    assert depth == OBJECT_DEPTH
    for t in tok.encode('1' + "}" * depth, add_special=False):
        c.advance(t)
    assert c.done


def test_any_object_depth_is_exact(llm, smol_vocab):
    for depth in (1, 2, 3):
        ok = '{"a": ' * depth + "1" + "}" * depth
        c = JsonConstraint.from_schema(any_object(depth), smol_vocab)
        for t in llm.tokenizer.encode(ok, add_special=False):
            c.advance(t)
        assert c.done
        c = JsonConstraint.from_schema(any_object(depth), smol_vocab)
        with pytest.raises(ValueError, match="not allowed"):
            for t in llm.tokenizer.encode('{"a": ' * (depth + 1) + "1", add_special=False):
                c.advance(t)


def test_schema_violations_are_refused(llm, smol_vocab):
    tok = llm.tokenizer
    for text in ('{"name": "x", "age": 121', '{"name": "x", "age": -1',
                 '{"name": "x", "age": 3, "color": "pink"', '{"nickname": "x"',
                 '{"name": "x", "age": 3.5'):
        c = JsonConstraint.from_schema(PERSON, smol_vocab)
        ids = tok.encode(text, add_special=False)
        with pytest.raises(ValueError, match="not allowed"):
            for t in ids:
                c.advance(t)


@pytest.mark.parametrize("model", [SMOL, GEMMA])
def test_random_walk_stays_valid(model):
    """Uniform choices among the allowed tokens always build a valid document; one mask
    step costs milliseconds even for a 262144-token vocabulary."""
    tok, stops = _tokenizer_and_stops(model)
    vocab = GrammarVocab.from_tokenizer(tok, stops)
    gen = torch.Generator().manual_seed(0)
    for walk in range(3):
        c = JsonConstraint.from_schema(PERSON, vocab)
        ids, times = [], []
        for _ in range(400):
            t0 = time.perf_counter()
            mask = c.mask()
            times.append(time.perf_counter() - t0)
            allowed = torch.nonzero(mask).squeeze(1)
            t = int(allowed[torch.randint(allowed.numel(), (1,), generator=gen)])
            c.advance(t)
            if t in stops:
                break
            ids.append(t)
        assert c.done, f"walk {walk} did not finish: {tok.decode(ids)!r}"
        jsonschema.validate(json.loads(tok.detokenize_bytes(ids)), PERSON)
    times.sort()
    median_ms = 1000 * times[len(times) // 2]
    print(f"{model}: median mask step {median_ms:.2f} ms over {len(times)} steps")
    assert median_ms < 50


@pytest.mark.parametrize("schema", [None, PERSON], ids=["json_object", "schema"])
def test_sentencepiece_vocab_with_a_space_prefix(schema):
    """LLaMA's SentencePiece vocabulary (add_space_prefix): llguidance tokenizes the text a
    grammar forces, and a space prefix in front of it made it panic on the first mask (a 500
    from the server in json_object mode, found by tools/fuzz_api.py). The forced text's tokens
    now spell it exactly, and a random walk builds a valid document."""
    from testdata import llama_cpp_path

    with GGUFFile(llama_cpp_path("models/ggml-vocab-llama-spm.gguf")) as f:
        tok = Tokenizer.from_gguf(f)
    assert tok.vocab.kind == "spm" and tok.vocab.add_space_prefix
    for text in ("{", " {", '"name": ', "  x\n", "h\u00e9llo"):
        ids = tok.encode_verbatim(text)
        assert b"".join(tok.token_to_piece(i) for i in ids) == text.encode(), text
    assert tok.encode(" {", add_special=False) != tok.encode_verbatim(" {")  # the prefix's
    stops = {tok.vocab.eos_id}
    vocab = GrammarVocab.from_tokenizer(tok, stops)
    gen = torch.Generator().manual_seed(1)
    c = JsonConstraint.from_schema(schema, vocab)
    ids = []
    for _ in range(400):
        allowed = torch.nonzero(c.mask()).squeeze(1)
        t = int(allowed[torch.randint(allowed.numel(), (1,), generator=gen)])
        c.advance(t)
        if t in stops:
            break
        ids.append(t)
    assert c.done
    value = json.loads(b"".join(tok.token_to_piece(i) for i in ids))
    assert isinstance(value, dict)
    if schema is not None:
        jsonschema.validate(value, schema)


def test_allowed_masks_with_minus_inf(llm, smol_vocab):
    c = JsonConstraint.from_schema(PERSON, smol_vocab)
    logits = torch.randn(smol_vocab.n_vocab, generator=torch.Generator().manual_seed(1))
    out = c.allowed(logits)
    mask = c.mask()
    assert torch.equal(out[mask], logits[mask])
    assert bool(torch.isneginf(out[~mask]).all())
    assert not bool(torch.isneginf(logits).any())  # input untouched
    with pytest.raises(ValueError, match="shape"):
        c.allowed(logits[:-1])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        c.advance(smol_vocab.n_vocab)


def test_mask_words_are_what_the_processor_masks(llm, smol_vocab):
    """``Constrained.mask_words`` (what the device masks a grammar's row with) allows exactly
    the tokens its host call leaves unmasked, along a walk through a value and after it is
    complete (then only the stop ids); ``set_ids`` and ``bits_of`` round-trip."""
    stops = sorted(llm.stop_ids)
    host = Constrained(JsonConstraint.from_schema(PERSON, smol_vocab), stops)
    device = Constrained(JsonConstraint.from_schema(PERSON, smol_vocab), stops)
    text = '{"name": "Ann", "age": 7, "color": "red"}'
    ids = llm.tokenizer.encode(text, add_special=False)
    words = np.zeros(n_words(smol_vocab.n_vocab), dtype=np.uint32)
    logits = torch.randn(smol_vocab.n_vocab, generator=torch.Generator().manual_seed(2))
    for n in range(len(ids) + 1):
        device.mask_words(ids[:n], words)
        allowed = bits_of(words, smol_vocab.n_vocab)
        kept = (host(ids[:n], logits) != NEG).numpy()
        assert np.array_equal(allowed, kept), f"after {n} tokens"
    assert sorted(np.flatnonzero(allowed).tolist()) == stops  # the value is complete
    with pytest.raises(ValueError, match="uint32"):
        device.constraint.mask_words(words.astype(np.int64))
    set_ids(words, [0, 31, 32, smol_vocab.n_vocab - 1])
    assert np.flatnonzero(bits_of(words, smol_vocab.n_vocab)).tolist() == \
        [0, 31, 32, smol_vocab.n_vocab - 1]


def _nested(depth: int) -> dict:
    schema: dict = {"type": "object"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


@pytest.mark.parametrize("schema, message", [
    ({"type": "strin"}, r"invalid JSON schema at \['type'\]"),
    ({"type": "object", "properties": 5}, r"invalid JSON schema at \['properties'\]"),
    ({"type": "string", "pattern": "(("}, r"invalid JSON schema at \['pattern'\]"),
    ([{"type": "object"}], "must be an object, got list"),
    ({"type": "string", "format": "bogus"}, "Unknown format: bogus"),
    ({"$ref": "#/$defs/missing"}, "missing"),
    ({"allOf": [{"type": "string"}, {"type": "integer"}]}, "Unsatisfiable"),
    (_nested(10_000), "nested too deeply"),  # was a RecursionError in the meta-validation
    ({"type": "object", "properties": {f"p{i}": {} for i in range(100_000)}}, "too large"),
])
def test_invalid_schema_is_a_clear_value_error(smol_vocab, schema, message):
    with pytest.raises(ValueError, match=message):
        JsonConstraint.from_schema(schema, smol_vocab)


def test_bad_vocab_arguments(llm):
    with pytest.raises(ValueError, match="stop ids"):
        GrammarVocab.from_tokenizer(llm.tokenizer, [llm.tokenizer.n_vocab])
    with pytest.raises(ValueError, match="smaller"):
        GrammarVocab.from_tokenizer(llm.tokenizer, None, n_vocab=10)
