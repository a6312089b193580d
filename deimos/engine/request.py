"""One generation request and its per-request state (sampler, produced tokens)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from deimos.engine.repetition import LoopGuard
from deimos.kernels.sampling import Sampler, SamplingParams, TokenLogprobs

# (output ids so far, logits [V] float32) -> logits to sample from. Called once per generated
# token, before penalties and filters; may return its input modified in place or a new tensor.
# Masking a token means setting its logit to -inf (or a very negative finite value).
LogitsProcessor = Callable[[Sequence[int], torch.Tensor], torch.Tensor]


def masks_only(processors: Sequence[LogitsProcessor]) -> bool:
    """Whether every processor is a grammar's allowed-token mask (``mask_words``: the server's
    ``Constrained``), which the device's sampler applies itself; True for none."""
    return all(hasattr(p, "mask_words") for p in processors)


class RequestError(ValueError):
    """A request that cannot be served as asked (too long for the context, bad ids...)."""


class ContextLengthError(RequestError):
    """The prompt does not fit the context with room for one generated token."""


class EngineError(RuntimeError):
    """The engine failed on a valid request (the model produced NaN logits...): a fault of the
    server, not of the request."""


@dataclass(slots=True)
class Request:
    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    stop_ids: frozenset[int] = frozenset()
    logits_processors: Sequence[LogitsProcessor] = ()
    top_logprobs: int | None = None  # None: no logprobs; k >= 0: each token's + k alternatives
    loop_guard: LoopGuard | None = None  # finish ("repetition") when the output cycles
    # filled while generating
    sampler: Sampler | None = None
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" (an end-of-generation token) | "length" | "repetition"
    cached_tokens: int = 0  # prompt tokens whose KV entries were reused
    # one per output id when top_logprobs is set: the model's distribution (raw logits,
    # before processors, penalties and temperature), as OpenAI's logprobs report it
    token_logprobs: list[TokenLogprobs] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise RequestError("the prompt is empty (no tokens)")
        if self.max_tokens < 0:
            raise RequestError(f"max_tokens must be >= 0, got {self.max_tokens}")
        if self.top_logprobs is not None and self.top_logprobs < 0:
            raise RequestError(f"top_logprobs must be >= 0, got {self.top_logprobs}")
