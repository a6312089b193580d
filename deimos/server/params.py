"""A validated request body plus its prompt ids -> an engine ``Request`` (sampling, length
limit, stop strings, logits processors). Everything the schema could not check is checked
here and refused with a 400 that names the parameter."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from deimos.engine import LLM, Request
from deimos.engine.jsontext import JsonTooLarge, check_size
from deimos.kernels.sampling import SamplingError, SamplingParams
from deimos.server.errors import APIError, bad_request
from deimos.server.processors import Constrained, LogitBias
from deimos.server.protocol import ResponseFormat, _Sampling


@dataclass(frozen=True)
class Defaults:
    """What a request leaves out: the server's sampling flags and max_tokens (None: up to the
    context)."""

    sampling: SamplingParams = SamplingParams()
    max_tokens: int | None = None


def sampling_params(body: _Sampling, d: SamplingParams, choice: int = 0) -> SamplingParams:
    """``choice``: the index among the request's ``n``; with a seed (the request's, or the
    server's default) choice i is seeded seed + i, so the choices differ and each is
    reproducible."""

    def pick(value: Any, default: Any) -> Any:
        return default if value is None else value

    top_k, top_p = pick(body.top_k, d.top_k), pick(body.top_p, d.top_p)
    if top_p == 0:  # OpenAI allows top_p = 0: only the most likely token
        top_k, top_p = 1, 1.0
    seed = d.seed if body.seed is None else body.seed
    try:
        return SamplingParams(
            temperature=pick(body.temperature, d.temperature), top_k=top_k, top_p=top_p,
            min_p=pick(body.min_p, d.min_p),
            repetition_penalty=pick(body.repetition_penalty, d.repetition_penalty),
            presence_penalty=pick(body.presence_penalty, d.presence_penalty),
            frequency_penalty=pick(body.frequency_penalty, d.frequency_penalty),
            penalty_last_n=d.penalty_last_n,
            seed=None if seed is None else (seed + choice) % 2**64,
        )
    except SamplingError as e:  # worded as the schema's checks (errors._validation_error)
        raise bad_request(f"'{e.field}': {e.problem}", e.field, "invalid_value") from None


def max_new_tokens(requested: int | None, n_prompt: int, n_ctx: int, default: int | None,
                   prompt_param: str) -> int:
    if n_prompt >= n_ctx:
        raise bad_request(
            f"the prompt has {n_prompt} tokens; this server's context holds {n_ctx} "
            "(prompt plus at least one generated token)", prompt_param, "context_length_exceeded")
    room = n_ctx - n_prompt
    if requested is None:
        return room if default is None else min(default, room)
    if requested > room:
        raise bad_request(
            f"max_tokens is {requested}, but the prompt has {n_prompt} tokens and the context "
            f"holds {n_ctx}: at most {room} can be generated", "max_tokens",
            "context_length_exceeded")
    return requested


def stop_strings(stop: str | list[str] | None) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if any(not s for s in stops):
        raise bad_request("stop strings must be non-empty", "stop")
    return stops


def logit_bias(bias: dict[str, float] | None, n_vocab: int) -> LogitBias | None:
    if not bias:
        return None
    ids: dict[int, float] = {}
    for key, value in bias.items():
        try:
            tid = int(key)
        except ValueError:
            tid = -1
        if not 0 <= tid < n_vocab:
            raise bad_request(f"logit_bias key {key!r} is not a token id in [0, {n_vocab})",
                              "logit_bias")
        ids[tid] = value
    return LogitBias(ids)


def json_constraint(fmt: ResponseFormat | None, llm: LLM) -> Constrained | None:
    """The decoding constraint of ``response_format`` (None for text)."""
    if fmt is None or fmt.type == "text":
        return None
    schema: dict[str, Any] | None = None
    if fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise bad_request("response_format of type 'json_schema' needs json_schema.schema",
                              "response_format.json_schema")
        schema = fmt.json_schema.schema_
    return schema_constraint(schema, llm, "response_format.json_schema.schema")


def schema_constraint(schema: dict[str, Any] | None, llm: LLM, param: str) -> Constrained:
    """Decoding constrained to JSON matching ``schema`` (None: any object)."""
    if schema is not None:
        import jsonschema

        try:  # before anything recursive walks it
            check_size(schema, param)
        except JsonTooLarge as e:
            raise bad_request(str(e), param, "schema_too_large") from None

        try:
            jsonschema.validators.validator_for(schema).check_schema(schema)
        except jsonschema.SchemaError as e:
            raise bad_request(f"{param} is not a valid JSON Schema: {e.message}", param) from None
    try:
        from deimos.engine.constrain import JsonConstraint
    except ImportError:
        raise APIError(400, "JSON-constrained output is not available in this build",
                       param=param, code="unsupported") from None
    try:
        constraint = JsonConstraint.from_schema(schema, llm.tokenizer, stop_ids=llm.stop_ids,
                                                n_vocab=llm.config.n_vocab)
    except (ValueError, TypeError, KeyError, RecursionError) as e:
        raise bad_request(f"{param}: cannot constrain decoding to this schema: {e}",
                          param) from None
    return Constrained(constraint, llm.stop_ids)


def build_request(body: _Sampling, prompt_ids: list[int], llm: LLM, defaults: Defaults, *,
                  requested_max: int | None, top_logprobs: int | None, prompt_param: str,
                  forced: Constrained | None = None, choice: int = 0
                  ) -> tuple[Request, list[str]]:
    """``forced``: a constraint that replaces ``response_format``'s (a forced tool call).
    ``choice``: which of the body's ``n`` choices (its seed; each choice needs a request of
    its own, with its own constraint state)."""
    n_vocab = llm.config.n_vocab
    bad = next((t for t in prompt_ids if not 0 <= t < n_vocab), None)
    if bad is not None:
        raise bad_request(f"prompt token id {bad} is outside the vocabulary [0, {n_vocab})",
                          prompt_param)
    if not prompt_ids:
        raise bad_request("the prompt is empty", prompt_param)
    sampling = sampling_params(body, defaults.sampling, choice)
    n = max_new_tokens(requested_max, len(prompt_ids), llm.n_ctx, defaults.max_tokens,
                       prompt_param)
    stops = stop_strings(body.stop)
    constraint = forced or json_constraint(body.response_format, llm)
    if body.ignore_eos and constraint is not None:
        raise bad_request("ignore_eos cannot be used with JSON output (response_format, or a "
                          "forced tool call): the JSON ends with an end-of-generation token",
                          "ignore_eos", "unsupported")
    processors = [p for p in (logit_bias(body.logit_bias, n_vocab), constraint) if p is not None]
    # ignore_eos: no end-of-generation token ends the answer (max_tokens or the context do)
    stop_ids = frozenset() if body.ignore_eos else llm.stop_ids
    req = Request(prompt_ids, n, sampling, stop_ids, logits_processors=processors,
                  top_logprobs=top_logprobs)
    return req, stops
