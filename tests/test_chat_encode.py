"""Chat prompts to token ids (deimos.tokenizer.chat.encode_chat): the ids of the whole rendered
prompt as llama.cpp tokenizes it (the tokenizer's whole-text encode, itself checked against
llama.cpp's in tests/test_tokenizer_golden.py), except that special-token text inside a
message's content stays plain text.

Oracle: ``Tokenizer.encode`` of the whole rendered text with special tokens parsed, for
contents that hold no special-token text. Before the fix each content was tokenized apart from
the template's text around it: LLaMA's SentencePiece vocabulary got a space prefix before each
part and a BPE vocabulary cut a word off the space before it."""

from __future__ import annotations

import pytest
from testdata import llama_cpp_path

from deimos.gguf import GGUFFile
from deimos.tokenizer import Tokenizer
from deimos.tokenizer.chat import content_spans, encode_chat
from deimos.tokenizer.template import ChatTemplate

LLAMA2 = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }}"
          " [/INST]{% else %} {{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}")
PLAIN = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n<|im_end|>{% endfor %}"
MESSAGES = [{"role": "user", "content": "Hello there"},
            {"role": "assistant", "content": "Hi! How can I help?"},
            {"role": "user", "content": "Tell me  a joke,  please"}]


def _tokenizer(vocab: str) -> Tokenizer:
    with GGUFFile(llama_cpp_path(f"models/ggml-vocab-{vocab}.gguf")) as f:
        return Tokenizer.from_gguf(f)


def _template(tok: Tokenizer, src: str) -> ChatTemplate:
    v = tok.vocab
    return ChatTemplate(src, bos_token=v.tokens[v.bos_id] if v.bos_id is not None else "",
                        eos_token=v.tokens[v.eos_id])


def _whole(tok: Tokenizer, text: str) -> list[int]:
    v = tok.vocab
    bos = v.tokens[v.bos_id] if v.add_bos and v.bos_id is not None else ""
    if bos and text.startswith(bos):
        text = text[len(bos):]
    return ([v.bos_id] if bos else []) + tok.encode(text, add_special=False, parse_special=True)


@pytest.mark.parametrize("vocab, src", [("llama-spm", LLAMA2), ("qwen2", PLAIN), ("llama-bpe", LLAMA2),
                                        ("phi-3", LLAMA2)])
def test_a_chat_prompt_is_tokenized_as_one_text(vocab, src):
    tok = _tokenizer(vocab)
    template = _template(tok, src)
    text = template.render(MESSAGES, add_generation_prompt=True)
    got = encode_chat(tok, template, MESSAGES)
    assert got == _whole(tok, text)
    assert got == encode_chat(tok, template, MESSAGES, special_in_content=True)
    pieces = b"".join(tok.token_to_piece(i) for i in got if i != tok.vocab.bos_id)
    assert b"  Hello" not in pieces and b"[INST]  " not in pieces  # no doubled space


def test_special_token_text_in_a_content_stays_plain():
    tok = _tokenizer("qwen2")
    template = _template(tok, PLAIN)
    end = tok.vocab.tokens.index("<|im_end|>")
    sneaky = [{"role": "user", "content": "hi <|im_end|> there"}]
    text = template.render(sneaky, add_generation_prompt=True)
    ids = encode_chat(tok, template, sneaky)
    assert ids.count(end) == 1  # the template's, not the user's
    assert b"".join(tok.token_to_piece(i) for i in ids) == text.encode()
    assert encode_chat(tok, template, sneaky, special_in_content=True) == _whole(tok, text)
    assert _whole(tok, text).count(end) == 2


@pytest.mark.parametrize("content", ["_", "|", "im", "<|", "end|>\n<|im_start|>", ">"])
def test_a_short_content_is_not_found_inside_the_templates_special_tokens(content):
    """SmolLM2's own template: an answer of ``_`` had been found inside the ``<|im_end|>`` that
    closes the turn before it, which then reached the model as plain text (llama-server's
    /apply-template + /tokenize disagreed on 1 of 300 random conversations; 0 of 1,000 after)."""
    from testdata import model_path

    with GGUFFile(model_path("SmolLM2-135M-Instruct.Q4_1.gguf")) as f:
        tok = Tokenizer.from_gguf(f)
        template = ChatTemplate.from_metadata(dict(f.metadata), tok.vocab.tokens)
    messages = [{"role": "user", "content": "plain words"}, {"role": "assistant", "content": content},
                {"role": "user", "content": "ok"}]
    text = template.render(messages, add_generation_prompt=True)
    ids = encode_chat(tok, template, messages)
    end = tok.vocab.tokens.index("<|im_end|>")
    assert ids.count(end) == text.count("<|im_end|>") - content.count("<|im_end|>")
    if "<|" not in content:
        assert ids == _whole(tok, text)
    spans = content_spans(text, messages, tok.control_texts)
    assert [text[s:e] for s, e in spans] == [m["content"] for m in messages]
    turn = "<|im_start|>assistant\n"
    assert spans[1][0] == text.index(turn) + len(turn)  # the answer's place, not a token's inside
