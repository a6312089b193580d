"""OpenAI request bodies as pydantic models (they also make the server's /openapi.json).

Strict types: ``"0.5"`` is not a temperature. Unknown fields are ignored, as clients send
extras (``user``, ``metadata``...). Ranges are OpenAI's; ``top_k``, ``min_p``,
``repetition_penalty``, ``ignore_eos`` and ``n_predict`` are llama.cpp's extensions. What the
schema cannot say (a prompt that does not fit the context, a tool schema that is not JSON
Schema) is checked in ``app``.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field
from pydantic_core import PydanticCustomError

from deimos.kernels.sampling_params import SAMPLING_BOUNDS, Bound

MAX_CHOICES = 16  # the most choices (``n``) one request may ask for


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True)


class TextPart(_Body):
    type: Literal["text"]
    text: str


class FunctionCall(_Body):
    name: str
    arguments: str = "{}"  # a JSON object, as a string (OpenAI's convention)


class ToolCall(_Body):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


class FunctionDef(_Body):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(_Body):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StreamOptions(_Body):
    include_usage: bool = False




def _within(bound: Bound) -> AfterValidator:
    """The sampler's own range check (``Bound``, with OpenAI's narrower ranges where they
    apply): a bad value is worded as ``SamplingParams`` and the CLI word it."""

    def check(value: float | int | None) -> float | int | None:
        problem = None if value is None else bound.problem(value)
        if problem is not None:
            raise PydanticCustomError("value_error", problem.replace("{", "{{").replace("}", "}}"))
        return value

    return AfterValidator(check)


def _sampling(field: str, **narrower: Any) -> AfterValidator:
    return _within(replace(SAMPLING_BOUNDS[field], **narrower))


Penalty = Annotated[float, _sampling("presence_penalty", lo=-2.0, hi=2.0)]
Stop = str | Annotated[list[str], Field(max_length=16)] | None


class _Sampling(_Body):
    """Fields shared by chat and text completions. None = the server's default."""

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: Annotated[float | None, _sampling("temperature", hi=2.0)] = None
    # OpenAI's top_p = 0: the most likely token only (params.sampling_params)
    top_p: Annotated[float | None, _sampling("top_p", lo_open=False)] = None
    top_k: Annotated[int | None, _sampling("top_k")] = None
    min_p: Annotated[float | None, _sampling("min_p")] = None
    frequency_penalty: Penalty | None = None
    presence_penalty: Penalty | None = None
    repetition_penalty: Annotated[float | None, _sampling("repetition_penalty", hi=10.0)] = None
    seed: int | None = None
    stop: Stop = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=MAX_CHOICES, description="choices to generate (decoded "
                   "together; with a seed, choice i uses seed + i)")
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    response_format: ResponseFormat | None = None
    user: str | None = None
    # llama-server's: no end-of-generation token ends the answer, only max_tokens (benchmarks)
    ignore_eos: bool = False


class ChatCompletionRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # llama-server's and vLLM's: more variables for the chat template (enable_thinking, ...)
    chat_template_kwargs: dict[str, Any] | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=20)
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1, le=1, description="only 1 is supported")
    # llama-server's name for max_tokens (-1: up to the context); max_tokens wins when both
    n_predict: int | None = Field(None, ge=-1)
