"""One generation request and its per-request state (sampler, produced tokens)."""

from __future__ import annotations

from dataclasses import dataclass, field

from deimos.kernels.sampling import Sampler, SamplingParams


class RequestError(ValueError):
    """A request that cannot be served as asked (too long for the context, bad ids...)."""


@dataclass(slots=True)
class Request:
    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    stop_ids: frozenset[int] = frozenset()
    # filled while generating
    sampler: Sampler | None = None
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" (an end-of-generation token) | "length"
    cached_tokens: int = 0  # prompt tokens whose KV entries were reused

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise RequestError("the prompt is empty (no tokens)")
        if self.max_tokens < 0:
            raise RequestError(f"max_tokens must be >= 0, got {self.max_tokens}")
