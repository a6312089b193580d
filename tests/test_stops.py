"""End-of-generation ids: llama.cpp's set (``Vocab.eog_ids``) and the chat template's turn end
(``deimos.tokenizer.stops``).

Oracles: llama.cpp build 11434's own EOG sets for the vocab files it ships and for our two test
models, recorded from its load log with

    LD_LIBRARY_PATH=$LLAMA llama-completion -m FILE -p hi -n 1 -no-cnv -v 2>&1 \\
        | grep 'print_info: EOG token'

(the "print_info" lines are the final set, after llama.cpp's gpt-oss and gemma4 fix-ups); its
list of end-of-generation texts, parsed from src/llama-vocab.cpp; and, for the one-rule
synthetic vocabularies, the rules as that source states them."""

from __future__ import annotations

import re

import numpy as np
import pytest
from chat_support import read_vocab
from testdata import llama_cpp_path, model_path

from deimos.tokenizer import TokenAttr, Vocab, VocabError
from deimos.tokenizer.stops import end_of_generation_ids, template_turn_end_id
from deimos.tokenizer.template import ChatTemplate

# Not here: llama.cpp's bert-bge ("bert") and nomic-bert-moe ("t5") vocabularies, which
# Vocab does not load (embedding tokenizers deimos does not support).
LLAMA_CPP_EOG = {
    "aquila": {0, 100007},
    "baichuan": {2},
    "command-r": {0, 255001},
    "deepseek-coder": {32014},
    "deepseek-llm": {100001},
    "falcon": {11},
    "gemma-4": {1, 50, 106},
    "gpt-2": {50256},
    "gpt-neox": {0},
    "llama-bpe": {128001, 128009},
    "llama-spm": {2},
    "mpt": {0},
    "phi-3": {2, 32000, 32007},
    "qwen2": {128247, 151643, 151645},
    "qwen35": {128247, 151643, 151645},
    "refact": {0, 4, 18},
    "starcoder": {0, 4},
}


def _file_vocab(path) -> tuple[Vocab, ChatTemplate]:
    md, tokens, _ = read_vocab(path)
    vocab = Vocab.from_metadata(md, source=str(path))
    return vocab, ChatTemplate.from_metadata(md, vocab.tokens)


@pytest.mark.parametrize("name", sorted(LLAMA_CPP_EOG))
def test_llama_cpp_vocab_files(name):
    vocab, template = _file_vocab(llama_cpp_path(f"models/ggml-vocab-{name}.gguf"))
    assert vocab.eog_ids == LLAMA_CPP_EOG[name]
    # for these vocabularies the template's turn end is always one llama.cpp already has
    assert end_of_generation_ids(vocab, template) == LLAMA_CPP_EOG[name]


def test_smollm2():
    vocab, template = _file_vocab(model_path("SmolLM2-135M-Instruct.Q4_1.gguf"))
    assert vocab.eog_ids == {0, 2, 4}  # llama.cpp: <|endoftext|>, <|im_end|>, <reponame> (FIM repo)
    assert [vocab.tokens[i] for i in (0, 2)] == ["<|endoftext|>", "<|im_end|>"]
    assert template_turn_end_id(vocab, template) == 2
    assert end_of_generation_ids(vocab, template) == {0, 2, 4}


def test_gemma3():
    vocab, template = _file_vocab(model_path("gemma-3-270m-q4_k_m.gguf"))
    assert vocab.eog_ids == {1, 106, 212}  # llama.cpp: <eos>, <end_of_turn>, </s>
    assert [vocab.tokens[i] for i in (1, 106)] == ["<eos>", "<end_of_turn>"]
    # no template in the file: the built-in gemma format ends turns with <end_of_turn>
    assert template_turn_end_id(vocab, template) == 106
    assert end_of_generation_ids(vocab, template) == {1, 106, 212}


# -- synthetic vocabularies: one rule each ----------------------------------------------------

CONTROL, NORMAL = 3, 1


def _md(
    *special: str,
    model: str = "gpt2",
    n_normal: int = 5,
    chat_template: str | None = None,
    **ids: int,
) -> dict:
    """Minimal metadata Vocab.from_metadata accepts: ``n_normal`` plain tokens, then
    ``special`` as control tokens. gpt2 (the default) has default eos 11, outside a vocab
    this small, so only the rule under test adds ids; ``ids`` sets tokenizer.ggml.<key>."""
    tokens = [f"w{i}" for i in range(n_normal)] + list(special)
    md = {
        "tokenizer.ggml.model": model,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": np.array(
            [NORMAL] * n_normal + [CONTROL] * len(special), dtype=np.int32
        ),
    }
    if model in ("gpt2", "gemma4"):
        md["tokenizer.ggml.pre"] = "default"
        md["tokenizer.ggml.merges"] = []
    md.update({f"tokenizer.ggml.{k}": v for k, v in ids.items()})
    if chat_template is not None:
        md["tokenizer.chat_template"] = chat_template
    return md


def _eog(md: dict) -> frozenset[int]:
    return Vocab.from_metadata(md).eog_ids


def test_metadata_ids_and_defaults():
    md = _md("<x>", "<y>", "<z>", eos_token_id=5, eot_token_id=6, eom_token_id=7)
    assert _eog(md) == {5, 6, 7}
    # no eos in metadata: the tokenizer's default (SPM: 2); out-of-range metadata: the default
    assert _eog(_md("<x>", model="llama")) == {2}
    assert _eog(_md("<x>", model="llama", eos_token_id=999)) == {2}
    assert _eog(_md("<x>", model="llama", eos_token_id=-1)) == {2}
    # gpt2's default eos (11) is outside this vocabulary: none; inside a larger one: 11
    assert _eog(_md("<x>")) == set()
    assert _eog(_md("<x>", n_normal=12)) == {11}
    # gemma4 has no default eos
    assert _eog(_md("<x>", model="gemma4", n_normal=12)) == set()
    # out-of-range eot/eom: none (no default), nothing added
    assert _eog(_md("<x>", eot_token_id=99, eom_token_id=-3)) == set()


def _llama_cpp_eog_texts() -> list[str]:
    """The texts llama.cpp's load loop marks end-of-generation, from its source."""
    src = llama_cpp_path("src/llama-vocab.cpp").read_text(encoding="utf-8")
    start = src.index("special_eog_ids.clear();")
    block = src[start:src.index("special_eog_ids.insert(t.second);", start)]
    block = block[block.index("for (const auto & t : token_to_id)"):]
    texts = re.findall(r't\.first == "((?:[^"\\]|\\.)*)"', block)
    assert len(texts) > 15 and all("\\" not in t for t in texts), texts
    return texts


@pytest.mark.parametrize("text", _llama_cpp_eog_texts())
def test_text_list(text):
    # each text alone in a vocabulary, typed NORMAL: still an ender, and made control
    md = _md(model="gpt2", n_normal=5)
    md["tokenizer.ggml.tokens"] = [*md["tokenizer.ggml.tokens"], text]
    md["tokenizer.ggml.token_type"] = np.full(6, NORMAL, dtype=np.int32)
    vocab = Vocab.from_metadata(md)
    assert vocab.eog_ids == {5}
    assert vocab.attrs[5] & TokenAttr.CONTROL


def test_fim_ids():
    # FIM pad / repo / sep found by text are enders (with the eot/eom texts)
    md = _md("<|eot_id|>", "<|eom_id|>", "<fim_pad>", "<|file_sep|>", "<reponame>")
    assert _eog(md) == {5, 6, 7, 8, 9}
    # an id from metadata replaces the text search; an out-of-range one does not
    md = _md("<fim_pad>", "<x>", fim_pad_token_id=6)
    assert _eog(md) == {6}
    md = _md("<fim_pad>", "<x>", fim_pad_token_id=99)
    assert _eog(md) == {5}
    # several candidate texts: llama.cpp takes the first its hash map yields, so which one is
    # not fixed, but exactly one of them is the FIM pad and an ender
    ids = _eog(_md("<fim_pad>", "<|fim_pad|>", "[PAD]"))
    assert len(ids) == 1 and ids <= {5, 6, 7}
    ids = _eog(_md("<|repo_name|>", "<REPO>"))
    assert len(ids) == 1 and ids <= {5, 6}


@pytest.mark.parametrize(
    ("texts", "removed"),
    [
        (("<|return|>", "<|call|>"), True),  # gpt-oss
        (("<|flush|>", "<|calls|>"), True),  # solar-open
        (("<|return|>", "<|calls|>"), True),  # llama.cpp counts either call marker
        (("<|flush|>", "<|call|>"), True),
        (("<|return|>",), False),
        (("<|call|>",), False),
        (("<|return|>", "<|flush|>"), False),
    ],
    ids=["gpt-oss", "solar-open", "return+calls", "flush+call", "return", "call", "no-call"],
)
def test_harmony_end_is_not_eog(texts, removed):
    vocab = Vocab.from_metadata(_md("<|end|>", *texts))
    others = set(range(6, 6 + len(texts)))
    assert vocab.eog_ids == (others if removed else others | {5})
    if removed:
        assert vocab.attrs[5] == TokenAttr.USER_DEFINED


def test_gemma4_slash_s_is_normal():
    vocab = Vocab.from_metadata(_md("</s>", "<|tool_response>"))
    assert vocab.eog_ids == {6}
    assert vocab.attrs[5] == TokenAttr.NORMAL
    # plamo: its eos "<|plamo:eos|>" (here from metadata) has the same effect
    assert _eog(_md("</s>", "<|plamo:eos|>", eos_token_id=6)) == {6}
    # paddleocr: "</s>" alone ends generation
    assert _eog(_md("</s>")) == {5}


def test_short_token_types():
    md = _md("<|im_end|>")
    md["tokenizer.ggml.token_type"] = md["tokenizer.ggml.token_type"][:3]
    with pytest.raises(VocabError, match="token_type' has 3 entries, fewer than the 6 tokens"):
        Vocab.from_metadata(md)


# -- the chat template's turn end ----------------------------------------------------------------

_TURNS = (
    "{% for m in messages %}<|turn_start|>{{ m.role }}\n{{ m.content }}<|turn_stop|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|turn_start|>assistant\n{% endif %}"
)


def test_template_turn_end_added():
    # a template whose turn-end token is on no list: it still ends generation
    md = _md("<|turn_start|>", "<|turn_stop|>", chat_template=_TURNS)
    vocab = Vocab.from_metadata(md)
    template = ChatTemplate.from_metadata(md, vocab.tokens)
    assert vocab.eog_ids == set()
    assert template_turn_end_id(vocab, template) == 6
    assert end_of_generation_ids(vocab, template) == {6}
    assert end_of_generation_ids(vocab, None) == set()
    # a normal token after the content is not a turn-end marker
    md["tokenizer.ggml.token_type"][6] = NORMAL
    vocab = Vocab.from_metadata(md)
    assert end_of_generation_ids(vocab, template) == set()


def test_turn_end_is_longest_marker():
    # "<|turn_stop|>" and its prefix "<|turn" are both control tokens: the longer one is the end
    md = _md("<|turn_start|>", "<|turn", "<|turn_stop|>", chat_template=_TURNS)
    vocab = Vocab.from_metadata(md)
    assert template_turn_end_id(vocab, ChatTemplate.from_metadata(md, vocab.tokens)) == 7


def test_broken_template_adds_nothing():
    md = _md("<|im_end|>", chat_template="{{ raise_exception('no') }}")
    vocab = Vocab.from_metadata(md)
    template = ChatTemplate.from_metadata(md, vocab.tokens)
    assert template_turn_end_id(vocab, template) is None
    assert end_of_generation_ids(vocab, template) == {5}
