"""Chat prompts to token ids: the template's own text may hold special tokens, message
contents may not.

The rendered prompt is split into the template's text (its special tokens parsed:
``<|im_start|>`` becomes one control token) and each message's content (plain text, so a user
who types ``<|im_end|>`` cannot close the turn), unless the caller asks for special tokens in
contents too; the text between two special tokens is then tokenized as one, as llama.cpp
tokenizes a whole prompt.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .template import ChatTemplate
from .tokenizer import ControlTexts, Tokenizer

# the variables encode_chat and the template's rendering set themselves
RESERVED_VARIABLES = frozenset({"messages", "tools", "add_generation_prompt", "bos_token",
                                "eos_token", "special_in_content"})


def template_variables(variables: Mapping[str, Any] | None) -> dict[str, Any]:
    """More template variables by name (a request's ``chat_template_kwargs``, the server's
    ``--chat-template-kwargs``), as a dict; ValueError naming a key that is no plain name or
    one of the engine's own (``RESERVED_VARIABLES``)."""
    for key in variables or ():
        if (not isinstance(key, str) or key in RESERVED_VARIABLES or not key.isidentifier()
                or key.startswith("_")):
            raise ValueError(f"{key!r} cannot be set (a template variable name, not one of "
                             + ", ".join(sorted(RESERVED_VARIABLES)) + ")")
    return dict(variables or {})


def content_spans(text: str, messages: Sequence[Mapping[str, Any]],
                  controls: ControlTexts | None = None) -> list[tuple[int, int]]:
    """(start, end) of each message content in the rendered ``text``, in order; a content the
    template changed (e.g. trimmed) is found by its stripped form; one not found is skipped.
    A place that would cut through one of ``controls`` (the vocabulary's control-token texts)
    is not the content: a short content such as ``_`` had been found inside the template's
    ``<|im_end|>``, which then went to the model as plain text."""
    spans: list[tuple[int, int]] = []
    at = 0
    for m in messages:
        content = m.get("content")
        if not isinstance(content, str) or not content:
            continue
        for needle in (content, content.strip()):
            i = text.find(needle, at) if needle else -1
            while i >= 0 and controls is not None and (controls.inside(text, i)
                                                        or controls.inside(text, i + len(needle))):
                i = text.find(needle, i + 1)
            if i >= 0:
                spans.append((i, i + len(needle)))
                at = i + len(needle)
                break
    return spans


def encode_chat(
    tokenizer: Tokenizer,
    template: ChatTemplate,
    messages: Sequence[Mapping[str, Any]],
    *,
    special_in_content: bool = False,
    **template_kwargs: Any,
) -> list[int]:
    text = template.render(messages, add_generation_prompt=True, **template_kwargs)
    vocab = tokenizer.vocab
    bos = tokenizer.bos_id
    if vocab.add_bos and bos is not None and text.startswith(vocab.tokens[bos]):
        text = text[len(vocab.tokens[bos]):]  # the template wrote BOS itself: add it once
    ids: list[int] = [bos] if vocab.add_bos and bos is not None else []
    # the text between two special tokens is tokenized as one, contents and the template's
    # text around them together, as llama.cpp tokenizes the whole prompt: split at a content's
    # edges, a SentencePiece vocabulary put its space prefix before each part and a BPE one
    # cut words off the spaces before them (Llama 2's "[INST] {content} [/INST]")
    run: list[str] = []

    def flush() -> None:
        if run:
            ids.extend(tokenizer.encode("".join(run), add_special=False, parse_special=False))
            run.clear()

    pos = 0
    spans = [] if special_in_content else content_spans(text, messages, tokenizer.control_texts)
    for start, end in spans + [(len(text), len(text))]:
        if start > pos:  # the template's text: its special tokens are parsed
            for fr in tokenizer.partition(text[pos:start], parse_special=True):
                if isinstance(fr, int):
                    flush()
                    ids.append(fr)
                else:
                    run.append(text[pos + fr[0] : pos + fr[1]])
        if end > start:  # a content: plain text
            run.append(text[start:end])
        pos = end
    flush()
    if vocab.add_eos and tokenizer.eos_id is not None:
        ids.append(tokenizer.eos_id)
    return ids
