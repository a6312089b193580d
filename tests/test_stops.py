"""End-of-generation ids. Oracle: llama.cpp build 11434's own EOG sets for the vocab files it
ships and for our two test models, recorded from its load log with

    LD_LIBRARY_PATH=$LLAMA llama-completion -m FILE -p hi -n 1 -no-cnv -v 2>&1 \\
        | grep 'print_info: EOG token'

(the "print_info" lines are the final set, after llama.cpp's gpt-oss and gemma4 fix-ups)."""

from __future__ import annotations

import numpy as np
import pytest
from chat_support import read_vocab
from testdata import llama_cpp_path, model_path

from deimos.tokenizer.stops import (
    end_of_generation_ids,
    llama_cpp_eog_ids,
    template_turn_end_id,
)

LLAMA_CPP_EOG = {
    "aquila": {0, 100007},
    "baichuan": {2},
    "bert-bge": {0},
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
    "nomic-bert-moe": {2},
    "phi-3": {2, 32000, 32007},
    "qwen2": {128247, 151643, 151645},
    "qwen35": {128247, 151643, 151645},
    "refact": {0, 4, 18},
    "starcoder": {0, 4},
}


@pytest.mark.parametrize("name", sorted(LLAMA_CPP_EOG))
def test_llama_cpp_vocab_files(name):
    md, tokens, types = read_vocab(llama_cpp_path(f"models/ggml-vocab-{name}.gguf"))
    assert llama_cpp_eog_ids(md, tokens) == LLAMA_CPP_EOG[name]
    # for these vocabularies the template's turn end is always one llama.cpp already has
    assert end_of_generation_ids(md, tokens, types) == LLAMA_CPP_EOG[name]


def test_smollm2():
    md, tokens, types = read_vocab(model_path("SmolLM2-135M-Instruct.Q4_1.gguf"))
    ids = end_of_generation_ids(md, tokens, types)
    assert ids == {0, 2, 4}  # llama.cpp: <|endoftext|>, <|im_end|>, <reponame> (FIM repo)
    assert [tokens[i] for i in (0, 2)] == ["<|endoftext|>", "<|im_end|>"]
    assert template_turn_end_id(md, tokens, types) == 2


def test_gemma3():
    md, tokens, types = read_vocab(model_path("gemma-3-270m-q4_k_m.gguf"))
    ids = end_of_generation_ids(md, tokens, types)
    assert ids == {1, 106, 212}  # llama.cpp: <eos>, <end_of_turn>, </s>
    assert [tokens[i] for i in (1, 106)] == ["<eos>", "<end_of_turn>"]
    # no template in the file: the built-in gemma format ends turns with <end_of_turn>
    assert template_turn_end_id(md, tokens, types) == 106


# -- synthetic vocabularies: one rule each ----------------------------------------------------

CONTROL, NORMAL = 3, 1


def _vocab(*special: str, n_normal: int = 5):
    tokens = [f"w{i}" for i in range(n_normal)] + list(special)
    types = np.array([NORMAL] * n_normal + [CONTROL] * len(special), dtype=np.int32)
    return tokens, types


def test_metadata_ids_and_defaults():
    tokens, types = _vocab("<x>", "<y>", "<z>")
    md = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.eos_token_id": 5,
        "tokenizer.ggml.eot_token_id": 6,
        "tokenizer.ggml.eom_token_id": 7,
    }
    assert llama_cpp_eog_ids(md, tokens) == {5, 6, 7}
    # no eos in metadata: the tokenizer's default (SPM: 2); out of range metadata: default
    assert llama_cpp_eog_ids({"tokenizer.ggml.model": "llama"}, tokens) == {2}
    bad = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.eos_token_id": 999}
    assert llama_cpp_eog_ids(bad, tokens) == {2}
    # gpt2's default eos (11) is outside this vocabulary: none
    assert llama_cpp_eog_ids({"tokenizer.ggml.model": "gpt2"}, tokens) == set()


def test_text_list_and_fim():
    tokens, types = _vocab("<|eot_id|>", "<|eom_id|>", "<fim_pad>", "<|fim_pad|>", "<|file_sep|>")
    md = {"tokenizer.ggml.model": "bert"}  # no default eos
    assert llama_cpp_eog_ids(md, tokens) == {5, 6, 7, 9}  # lowest-id fim_pad text
    md["tokenizer.ggml.fim_pad_token_id"] = 8
    assert llama_cpp_eog_ids(md, tokens) == {5, 6, 8, 9}


def test_harmony_end_is_not_eog():
    tokens, _ = _vocab("<|end|>", "<|return|>", "<|call|>")
    assert llama_cpp_eog_ids({"tokenizer.ggml.model": "bert"}, tokens) == {6, 7}
    tokens, _ = _vocab("<|end|>", "<|return|>")
    assert llama_cpp_eog_ids({"tokenizer.ggml.model": "bert"}, tokens) == {5, 6}


def test_gemma4_slash_s_is_normal():
    tokens, _ = _vocab("</s>", "<|tool_response>")
    assert llama_cpp_eog_ids({"tokenizer.ggml.model": "bert"}, tokens) == {6}


def test_template_turn_end_added():
    # a template whose turn-end token is on no list: it still ends generation
    tokens, types = _vocab("<|turn_start|>", "<|turn_stop|>")
    md = {
        "tokenizer.ggml.model": "bert",
        "tokenizer.chat_template": (
            "{% for m in messages %}<|turn_start|>{{ m.role }}\n{{ m.content }}<|turn_stop|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|turn_start|>assistant\n{% endif %}"
        ),
    }
    assert llama_cpp_eog_ids(md, tokens) == set()
    assert end_of_generation_ids(md, tokens, types) == {6}
    # a normal token after the content is not a turn-end marker
    types[6] = NORMAL
    assert end_of_generation_ids(md, tokens, types) == set()


def test_broken_template_adds_nothing():
    tokens, types = _vocab("<|im_end|>")
    md = {"tokenizer.ggml.model": "bert", "tokenizer.chat_template": "{{ raise_exception('no') }}"}
    assert end_of_generation_ids(md, tokens, types) == {5}


def test_mismatched_token_types():
    tokens, types = _vocab("<|im_end|>")
    with pytest.raises(ValueError, match="token_types has 3 entries but the vocabulary has 6"):
        end_of_generation_ids({}, tokens, types[:3])
