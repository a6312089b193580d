"""OpenAI response objects: usage, logprobs (chat and legacy completions formats), SSE lines."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from deimos.kernels.sampling import TokenLogprobs
from deimos.server.worker import Done
from deimos.tokenizer import Tokenizer

MIN_LOGPROB = -9999.0  # JSON has no -inf; OpenAI reports such tokens with this value


def usage_numbers(dones: Done | Sequence[Done]) -> dict[str, int]:
    """A request's token counts over its choices: the prompt once, every choice's completion
    tokens; cached: the prompt tokens every choice reused from the prefix cache (the fewest)."""
    dones = [dones] if isinstance(dones, Done) else list(dones)
    return {"prompt_tokens": dones[0].prompt_tokens,
            "cached_tokens": min(d.cached_tokens for d in dones),
            "completion_tokens": sum(d.completion_tokens for d in dones)}


def usage(dones: Done | Sequence[Done]) -> dict[str, Any]:
    """OpenAI's usage object (with ``prompt_tokens_details.cached_tokens``)."""
    n = usage_numbers(dones)
    return {
        "prompt_tokens": n["prompt_tokens"],
        "completion_tokens": n["completion_tokens"],
        "total_tokens": n["prompt_tokens"] + n["completion_tokens"],
        "prompt_tokens_details": {"cached_tokens": n["cached_tokens"]},
    }


def _lp(x: float) -> float:
    return x if x > MIN_LOGPROB else MIN_LOGPROB


class LogprobFormatter:
    """Token strings and bytes for logprobs (a token may hold part of a UTF-8 character:
    its string then has U+FFFD and ``bytes`` says what it really is)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tok = tokenizer

    def _piece(self, tid: int) -> tuple[str, list[int]]:
        raw = self.tok.token_to_piece(tid)
        return raw.decode("utf-8", errors="replace"), list(raw)

    def chat(self, lps: list[TokenLogprobs]) -> list[dict[str, Any]]:
        out = []
        for lp in lps:
            text, raw = self._piece(lp.token)
            top = []
            for tid, v in zip(lp.top_ids, lp.top_logprobs):
                t, b = self._piece(tid)
                top.append({"token": t, "logprob": _lp(v), "bytes": b})
            out.append({"token": text, "logprob": _lp(lp.logprob), "bytes": raw,
                        "top_logprobs": top})
        return out

    def completion(self, lps: list[TokenLogprobs], offset: int) -> dict[str, Any]:
        """The legacy format; ``offset``: characters of text before the first token."""
        tokens, values, tops, offsets = [], [], [], []
        for lp in lps:
            text, _ = self._piece(lp.token)
            tokens.append(text)
            values.append(_lp(lp.logprob))
            top: dict[str, float] = {}
            for tid, v in zip(lp.top_ids, lp.top_logprobs):
                top.setdefault(self._piece(tid)[0], _lp(v))
            tops.append(top)
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops,
                "text_offset": offsets}


def sse(obj: dict[str, Any] | str) -> str:
    data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)
    return f"data: {data}\n\n"
