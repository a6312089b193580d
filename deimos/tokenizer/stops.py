"""End-of-generation tokens: the ids whose sampling ends a completion.

llama.cpp's own set is ``Vocab.eog_ids`` (built with the vocab, as llama.cpp builds it).
``end_of_generation_ids`` adds the token the chat template writes right after an assistant
message (its turn-end marker), so a model that closes its turn always stops, even when that
marker is on none of llama.cpp's lists.
"""

from __future__ import annotations

from .template import ChatTemplate, TemplateError
from .vocab import TokenAttr, Vocab

__all__ = ["end_of_generation_ids", "template_turn_end_id"]

_PROBE = "DeimosAssistantProbe7f3a"  # a text no template writes by itself
_MARKER = TokenAttr.CONTROL | TokenAttr.USER_DEFINED


def template_turn_end_id(vocab: Vocab, template: ChatTemplate | None) -> int | None:
    """The control or user-defined token ``template`` writes right after an assistant
    message's text (``<|im_end|>``, ``<end_of_turn>``, ``<|eot_id|>``...), or None when it
    writes none, there is no template, or the template fails on a plain two-turn chat."""
    if template is None:
        return None
    try:
        text = template.render(
            [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": _PROBE}],
            add_generation_prompt=False,
        )
    except TemplateError:
        return None
    at = text.find(_PROBE)
    if at < 0:
        return None
    rest = text[at + len(_PROBE):]
    # the longest marker the remainder starts with (special_token_ids is longest first)
    for tid in vocab.special_token_ids:
        if vocab.attrs[tid] & _MARKER and rest.startswith(vocab.tokens[tid]):
            return tid
    return None


def end_of_generation_ids(vocab: Vocab, template: ChatTemplate | None) -> frozenset[int]:
    """Ids that end generation: llama.cpp's set (``vocab.eog_ids``) plus the chat template's
    turn-end marker."""
    turn_end = template_turn_end_id(vocab, template)
    return vocab.eog_ids if turn_end is None else vocab.eog_ids | {turn_end}
