"""End-of-generation tokens: the ids whose sampling ends a completion.

``llama_cpp_eog_ids`` reproduces llama.cpp's ``special_eog_ids`` (src/llama-vocab.cpp, vocab
load): eos/eot/eom ids from metadata (eos has a per-tokenizer default), FIM pad/repo/sep ids,
and every token whose text is on llama.cpp's list of turn/sequence enders, with its two fix-ups
(gpt-oss/solar "<|end|>" is not an ender when "<|return|>"+"<|call|>" exist; gemma4/plamo "</s>"
is a normal token). ``end_of_generation_ids`` adds the token the chat template writes right after
an assistant message (its turn-end marker), so a model that closes its turn always stops.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["EOG_TEXTS", "end_of_generation_ids", "llama_cpp_eog_ids", "template_turn_end_id"]

# Token texts llama.cpp marks end-of-generation, whatever their ids (llama-vocab.cpp, build 11434).
EOG_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>",
    "<|return|>", "<|call|>",  # o200k_harmony (gpt-oss)
    "<|flush|>", "<|calls|>",  # solar-open
    "<end_of_turn>", "<|endoftext|>",
    "</s>",  # paddleocr
    "<|eom_id|>", "<EOT>", "_<EOT>",
    "[EOT]", "[EOS]",  # Kimi-K2
    "<|end_of_text|>",
    "<end_of_utterance>",  # smoldocling
    "<eos>", "<turn|>", "<|tool_response>",  # gemma4
    "<｜end▁of▁sentence｜>",  # deepseek-ocr
    "[e~[",  # minimax-m2/m3
})

# FIM tokens llama.cpp also counts as enders, found by text when metadata lacks their ids.
_FIM_TEXTS = {
    "tokenizer.ggml.fim_pad_token_id": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "tokenizer.ggml.fim_rep_token_id": (
        "<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>",
    ),
    "tokenizer.ggml.fim_sep_token_id": ("<|file_sep|>",),
}

# llama.cpp's default eos id per tokenizer.ggml.model, used when the metadata has none.
_DEFAULT_EOS = {"llama": 2, "gpt2": 11, "hybriddna": 11, "whitespace": 11, "t5": 1, "plamo2": 2}

_CONTROL, _USER_DEFINED = 3, 4  # llama_token_type values in tokenizer.ggml.token_type


def _metadata_id(metadata: Mapping[str, Any], key: str, n_vocab: int, default: int | None = None):
    """An id from metadata; like llama.cpp, an out-of-range value falls back to the default
    and an out-of-range default means "none"."""
    if default is not None and not 0 <= default < n_vocab:
        default = None
    value = metadata.get(key)
    if value is None:
        return default
    value = int(value)
    return value if 0 <= value < n_vocab else default


def llama_cpp_eog_ids(metadata: Mapping[str, Any], tokens: Sequence[str]) -> frozenset[int]:
    """llama.cpp's end-of-generation set for this vocabulary (see module docstring)."""
    n = len(tokens)
    by_text: dict[str, int] = {}
    for i, t in enumerate(tokens):
        by_text.setdefault(t, i)  # the lowest id of a duplicated text

    eog: set[int] = set()
    for key, texts in _FIM_TEXTS.items():
        tid = _metadata_id(metadata, key, n)
        if tid is None:
            # llama.cpp takes the first match of an unordered-map walk; we take the lowest id
            found = [by_text[t] for t in texts if t in by_text]
            tid = min(found) if found else None
        if tid is not None:
            eog.add(tid)

    eog.update(i for i, t in enumerate(tokens) if t in EOG_TEXTS)

    default_eos = _DEFAULT_EOS.get(str(metadata.get("tokenizer.ggml.model", "")))
    for key, default in (
        ("tokenizer.ggml.eos_token_id", default_eos),
        ("tokenizer.ggml.eot_token_id", None),
        ("tokenizer.ggml.eom_token_id", None),
    ):
        tid = _metadata_id(metadata, key, n, default)
        if tid is not None:
            eog.add(tid)

    texts = {tokens[i] for i in eog}
    has_call = "<|call|>" in texts or "<|calls|>" in texts
    if "<|end|>" in texts and has_call and ("<|return|>" in texts or "<|flush|>" in texts):
        eog -= {i for i in eog if tokens[i] == "<|end|>"}
    if "</s>" in texts and ("<|tool_response>" in texts or "<|plamo:eos|>" in texts):
        eog -= {i for i in eog if tokens[i] == "</s>"}
    return frozenset(eog)


def template_turn_end_id(
    metadata: Mapping[str, Any], tokens: Sequence[str], token_types: Sequence[int] | None
) -> int | None:
    """The control token the chat template writes right after an assistant message's text
    (``<|im_end|>``, ``<end_of_turn>``, ``<|eot_id|>``...), or None when it writes none."""
    from .template import ChatTemplate, TemplateError

    needle = "DeimosAssistantProbe7f3a"
    try:
        template = ChatTemplate.from_metadata(metadata, tokens)
        text = template.render(
            [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": needle}],
            add_generation_prompt=False,
        )
    except TemplateError:
        return None
    at = text.find(needle)
    if at < 0:
        return None
    rest = text[at + len(needle):]
    special = {
        t: i
        for i, t in enumerate(tokens)
        if t and (token_types is None or int(token_types[i]) in (_CONTROL, _USER_DEFINED))
    }
    # the longest special token the remainder starts with
    for end in range(min(len(rest), max(map(len, special), default=0)), 0, -1):
        if rest[:end] in special:
            return special[rest[:end]]
    return None


def end_of_generation_ids(
    metadata: Mapping[str, Any], tokens: Sequence[str], token_types: Sequence[int] | None
) -> frozenset[int]:
    """Ids that end generation: llama.cpp's set plus the chat template's turn-end marker.

    ``metadata`` is the GGUF metadata (``GGUFFile.metadata``); ``tokens`` and ``token_types``
    are ``tokenizer.ggml.tokens`` / ``tokenizer.ggml.token_type`` (types may be None).
    """
    if token_types is not None and len(token_types) != len(tokens):
        raise ValueError(
            f"token_types has {len(token_types)} entries but the vocabulary has {len(tokens)}"
        )
    eog = set(llama_cpp_eog_ids(metadata, tokens))
    turn_end = template_turn_end_id(metadata, tokens, token_types)
    if turn_end is not None:
        eog.add(turn_end)
    return frozenset(eog)
