"""The FastAPI app: OpenAI routes over one ``EngineWorker``.

    app = create_app(Server(llm, worker, metrics, ...))

Handlers validate and tokenize, then hand one ``Job`` per choice (``n``; deimos.server.choices)
to the worker and turn their events into one response (JSON, or SSE with ``stream: true``).
A client that goes away cancels its jobs. Any ``model`` is accepted: the one model served
answers (as llama-server does), and responses name it by the listed id.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.concurrency import run_in_threadpool

from deimos.engine import LLM
from deimos.engine import Request as EngineRequest
from deimos.engine.request import ContextLengthError, EngineError, RequestError
from deimos.server import errors, tools
from deimos.server.choices import Choices
from deimos.server.errors import APIError, bad_request, fault, retry_after
from deimos.server.gate import Gate, Shutdown, shutting_down
from deimos.server.metrics import Metrics
from deimos.server.params import Defaults, build_request, schema_constraint
from deimos.server.protocol import ChatCompletionRequest, CompletionRequest
from deimos.server.responses import LogprobFormatter, sse, usage, usage_numbers
from deimos.server.tool_stream import ToolCallSplitter
from deimos.server.worker import Cut, Done, EngineWorker, Failed, Job, Piece, QueueFull
from deimos.tokenizer.chat import template_variables
from deimos.tokenizer.template import TemplateError

log = logging.getLogger("deimos.server")


@dataclass
class Server:
    llm: LLM
    worker: EngineWorker
    metrics: Metrics
    model_id: str  # what /v1/models lists and every response's ``model`` says
    defaults: Defaults = field(default_factory=Defaults)
    api_key: str | None = None
    shutdown: Shutdown = field(default_factory=Shutdown)
    created: int = field(default_factory=lambda: int(time.time()))
    # variables every chat request's template gets (--chat-template-kwargs; a request's own win)
    template_kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.tool_style = tools.tool_call_style(self.llm.template.source, self.llm.tokenizer)
        self.logprobs = LogprobFormatter(self.llm.tokenizer)
        self.schemas = tools.SchemaMemo()  # tool parameter schemas already checked
        self.metrics.set_engine(self.llm.engine.stats())  # /metrics has them before a step


# ---- running a request's choices ----------------------------------------------------------

QUEUE_FULL_RETRY_S = 1.0  # a full queue drains as running requests finish: retry soon


def _submit(server: Server, group: Choices) -> Choices:
    """Every job of ``group`` to the worker, or none: 503 with ``Retry-After`` while draining
    or when the queue cannot take them all."""
    if server.shutdown.draining:
        raise shutting_down(server.shutdown.grace_s)
    worker = server.worker
    if group.n > worker.max_queue:
        raise bad_request(f"n is {group.n}, but this server queues at most {worker.max_queue} "
                          "requests (--max-queue)", "n")
    busy = f"{worker.queued} requests are already waiting" if (
        worker.queued + group.n > worker.max_queue) else None
    submitted: list[Job] = []
    if busy is None:
        try:
            for job in group.jobs:
                worker.submit(job)
                submitted.append(job)
        except QueueFull as e:
            busy = str(e)
    if busy is not None:
        for job in submitted:
            job.cancelled.set()
        raise APIError(503, f"the server is busy: {busy}; retry later", code="queue_full",
                       headers=retry_after(QUEUE_FULL_RETRY_S))
    for job in group.jobs:
        server.shutdown.track(job)
    return group


@dataclass
class Answer:
    """One choice's whole answer."""

    text: list[str] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    done: Done | None = None


async def _collect(server: Server, group: Choices, request: Request) -> list[Answer] | None:
    """Every choice's whole answer (None when the client left first); a failure of any
    choice (the others are cancelled) or a shutdown cut raises as its API error."""
    answers = [Answer() for _ in range(group.n)]
    try:
        async with aclosing(group.events(request, poll=True)) as events:
            async for i, ev in events:
                if isinstance(ev, Piece):
                    answers[i].text.append(ev.text)
                    answers[i].logprobs += ev.logprobs
                elif isinstance(ev, Failed):
                    raise _failure(ev.error)
                elif isinstance(ev, Cut):
                    raise shutting_down(server.shutdown.grace_s)
                else:
                    answers[i].done = ev
    finally:
        group.close(server.shutdown)
    return answers if all(a.done is not None for a in answers) else None


def _failure(err: BaseException) -> APIError:
    """A failed generation as the client sees it: a request the engine refused is the
    client's (400); the engine failing on a valid request is the server's (500), logged."""
    if isinstance(err, ContextLengthError):
        return bad_request(str(err), code="context_length_exceeded")
    if isinstance(err, RequestError):
        return bad_request(str(err))
    if isinstance(err, EngineError):
        log.error("engine fault: %s", err)
        return APIError(500, f"the engine failed: {err}", type="server_error",
                        code="engine_error")
    return fault(err, "generation failed")


def _stream_end(server: Server, ev: Failed | Cut) -> APIError:
    return _failure(ev.error) if isinstance(ev, Failed) else shutting_down(server.shutdown.grace_s)


async def _closing(events: AsyncIterator[str], rid: str) -> AsyncIterator[str]:
    """An SSE body that always ends properly: an exception while streaming becomes a final
    error event and ``[DONE]`` (the 200 is already sent; the fault is logged once)."""
    try:
        async for line in events:
            yield line
    except Exception as e:  # noqa: BLE001 - the stream's last words instead of a cut connection
        yield sse(fault(e, f"stream {rid}").body())
        yield sse("[DONE]")


def _tps(tokens: int, seconds: float) -> float | None:
    return round(tokens / seconds, 1) if tokens > 0 and seconds > 0 else None


def _record(request: Request, group: Choices, stream: bool, dones: list[Done | None],
            **extra: Any) -> None:
    """The request log line's generation details (``gate`` writes the line)."""
    info: dict[str, Any] = {"id": group.id, "stream": stream, **extra}
    if group.n > 1:
        info["n"] = group.n
    if dones and all(d is not None for d in dones):
        first = dones[0]
        info.update(usage_numbers(dones))
        rates = [_tps(d.completion_tokens - 1, d.decode_s) for d in dones]
        info.update(
            finish_reason=first.finish_reason if group.n == 1 else [d.finish_reason for d in dones],
            queued_ms=round(min(d.queued_s for d in dones) * 1000, 1),
            ttft_ms=round(min(d.ttft_s for d in dones) * 1000, 1),
            prefill_tps=_tps(first.prompt_tokens - first.cached_tokens, first.prefill_s),
            decode_tps=round(sum(r for r in rates if r), 1) if any(rates) else None)
    request.state.deimos = info


def _disconnected(dones: list[Done | None], cut: str | None) -> dict[str, Any]:
    return {"error": cut} if cut else {"disconnected": any(d is None for d in dones)}


def _streaming(body: AsyncIterator[str], rid: str) -> StreamingResponse:
    return StreamingResponse(_closing(body, rid), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


# ---- chat ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class ChatPlan:
    ids: list[int]
    tool_names: set[str] | None  # functions a reply may call; None: tools are off
    prefix: str = ""  # the start of a forced tool call: in the prompt, part of the reply
    forced_schema: dict[str, Any] | None = None  # the call's JSON, for constrained decoding


def _forced_call(style: str, tool_list: list[dict[str, Any]], names: set[str]
                 ) -> tuple[str, dict[str, Any]]:
    """tool_choice "required" or a named function: the reply is the call, decoded under a
    JSON schema of ``{"name", "arguments"}`` after the format's opening text."""
    key = "parameters" if style == "llama3" else "arguments"
    options = [{"type": "object", "additionalProperties": False, "required": ["name", key],
                "properties": {"name": {"const": t["function"]["name"]},
                               key: t["function"].get("parameters") or {"type": "object"}}}
               for t in tool_list if t["function"]["name"] in names]
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    return ("" if style == "llama3" else "<tool_call>\n"), schema


def _template_kwargs(server: Server, kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """The template's extra variables: the server's (``--chat-template-kwargs``), then the
    request's ``chat_template_kwargs`` over them (a 400 naming a key the engine sets itself)."""
    try:
        return {**server.template_kwargs, **template_variables(kwargs)}
    except ValueError as e:
        raise bad_request(f"chat_template_kwargs: {e}", "chat_template_kwargs") from None


def _chat_prompt(server: Server, body: ChatCompletionRequest) -> ChatPlan:
    tool_list = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
    choice = body.tool_choice
    choice = choice.model_dump() if hasattr(choice, "model_dump") else choice
    try:
        if tool_list is not None:
            tools.validate_tools(tool_list, server.schemas)
    except ValueError as e:
        raise bad_request(str(e), "tools", "invalid_tools") from None
    try:
        tools.validate_tool_choice(choice, tool_list)
    except ValueError as e:
        raise bad_request(str(e), "tool_choice") from None
    use_tools = bool(tool_list) and choice != "none"
    if use_tools and server.tool_style == "none":
        raise bad_request("this model's chat template has no tool-call format deimos can "
                          "parse; send the request without tools", "tools", "unsupported")
    messages = []
    for m in body.messages:
        d = m.model_dump(exclude_none=True)
        if d["role"] == "developer":
            d["role"] = "system"
        messages.append(d)
    llm = server.llm
    kwargs = _template_kwargs(server, body.chat_template_kwargs)
    try:
        msgs, tmpl_tools = tools.prepare_chat(messages, tool_list if use_tools else None,
                                              llm.template.source, server.tool_style)
        ids = llm.encode_chat(msgs, tools=tmpl_tools, **kwargs)
    except TemplateError as e:
        raise bad_request(f"the chat template cannot render these messages: {e}",
                          "messages") from None
    except ValueError as e:
        raise bad_request(str(e), "messages") from None
    if not use_tools:
        return ChatPlan(ids, None)
    if isinstance(choice, dict):
        names = {choice["function"]["name"]}
    else:
        names = {t["function"]["name"] for t in tool_list or ()}
    if choice == "required" or isinstance(choice, dict):
        prefix, schema = _forced_call(server.tool_style, tool_list or [], names)
        if prefix:
            ids = ids + llm.tokenizer.encode(prefix, add_special=False, parse_special=True)
        return ChatPlan(ids, names, prefix, schema)
    return ChatPlan(ids, names)


def _chat_requests(server: Server, body: ChatCompletionRequest, plan: ChatPlan,
                   top: int | None) -> list[tuple[EngineRequest, list[str]]]:
    """One engine request per choice, each with its own constraint state (a forced tool
    call's schema is compiled for each)."""
    requested = body.max_completion_tokens or body.max_tokens
    out = []
    for i in range(body.n):
        forced = None
        if plan.forced_schema is not None:
            forced = schema_constraint(plan.forced_schema, server.llm, "tools")
        out.append(build_request(body, plan.ids, server.llm, server.defaults,
                                 requested_max=requested, top_logprobs=top,
                                 prompt_param="messages", forced=forced, choice=i))
    return out


async def chat_completions(server: Server, body: ChatCompletionRequest, request: Request):
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
    top = (body.top_logprobs or 0) if body.logprobs else None
    plan = await run_in_threadpool(_chat_prompt, server, body)
    tool_names = plan.tool_names
    reqs = await run_in_threadpool(_chat_requests, server, body, plan, top)
    group = _submit(server, Choices(f"chatcmpl-{uuid.uuid4().hex[:24]}", reqs,
                                    asyncio.get_running_loop()))
    head = {"id": group.id, "created": int(time.time()), "model": server.model_id,
            "system_fingerprint": "deimos"}

    def reply(text: str) -> tuple[str | None, list]:
        """The content and tool calls of a whole answer."""
        if tool_names is None:
            return text, []
        return tools.parse_tool_calls(plan.prefix + text, server.tool_style, tool_names)

    def finish_reason(done: Done, calls: list) -> str:
        return "tool_calls" if calls else done.finish_reason

    if not body.stream:
        answers = await _collect(server, group, request)
        if answers is None:  # the client left
            _record(request, group, False, [], disconnected=True)
            return JSONResponse({}, status_code=499)
        choices = []
        for i, a in enumerate(answers):
            content, calls = reply("".join(a.text))
            message: dict[str, Any] = {"role": "assistant", "content": content}
            if calls:
                message["tool_calls"] = calls
            choices.append({
                "index": i, "message": message,
                "logprobs": {"content": server.logprobs.chat(a.logprobs)} if top is not None
                else None,
                "finish_reason": finish_reason(a.done, calls)})
        dones = [a.done for a in answers]
        _record(request, group, False, dones)
        return {**head, "object": "chat.completion", "choices": choices, "usage": usage(dones)}

    include_usage = bool(body.stream_options and body.stream_options.include_usage)

    def chunk(i: int, delta: dict, finish: str | None = None,
              logprobs: list | None = None) -> str:
        choice = {"index": i, "delta": delta, "logprobs": None, "finish_reason": finish}
        if logprobs is not None:
            choice["logprobs"] = {"content": server.logprobs.chat(logprobs)}
        return sse({**head, "object": "chat.completion.chunk", "choices": [choice]})

    async def stream() -> AsyncIterator[str]:
        dones: list[Done | None] = [None] * group.n
        cut = None
        # with tools on, content goes out as it is written and only what may be a call is
        # held, then parsed with the whole reply (tool_stream); a forced call is held whole
        splits = [None if tool_names is None else ToolCallSplitter(
            server.tool_style, tool_names, plan.prefix, hold=plan.forced_schema is not None)
            for _ in range(group.n)]

        def lps(marks: list) -> list | None:
            return marks if top is not None and marks else None

        try:
            for i in range(group.n):
                yield chunk(i, {"role": "assistant", "content": ""})
            async for i, ev in group.events(request, poll=False):
                split = splits[i]
                if isinstance(ev, Piece):
                    if split is None:
                        yield chunk(i, {"content": ev.text},
                                    logprobs=ev.logprobs if top is not None else None)
                        continue
                    text, marks = split.feed(ev.text, ev.logprobs)
                    if text or marks:
                        yield chunk(i, {"content": text}, logprobs=lps(marks))
                elif isinstance(ev, (Failed, Cut)):
                    err = _stream_end(server, ev)
                    cut = err.code
                    yield sse(err.body())
                    yield sse("[DONE]")
                    return
                else:
                    dones[i] = ev
                    calls: list = []
                    marks = []  # the held tokens' logprobs go with the first chunk left
                    if split is not None:
                        end = split.finish()
                        calls, marks = end.calls, end.marks
                        if end.content:
                            yield chunk(i, {"content": end.content}, logprobs=lps(marks))
                            marks = []
                        if calls:
                            yield chunk(i, {"tool_calls": [{"index": k, **c}
                                                           for k, c in enumerate(calls)]},
                                        logprobs=lps(marks))
                            marks = []
                    yield chunk(i, {}, finish_reason(ev, calls), logprobs=lps(marks))
            if include_usage:
                yield sse({**head, "object": "chat.completion.chunk", "choices": [],
                           "usage": usage(dones)})
            yield sse("[DONE]")
        finally:
            group.close(server.shutdown)  # the client left mid-stream: free the engine at once
            _record(request, group, True, dones, **_disconnected(dones, cut))

    return _streaming(stream(), group.id)


# ---- text completions ---------------------------------------------------------------------


def _completion_prompt(server: Server, body: CompletionRequest) -> tuple[list[int], str]:
    p = body.prompt
    if isinstance(p, list) and p and isinstance(p[0], (str, list)):
        if len(p) != 1:
            raise bad_request(f"one prompt per request is supported, got {len(p)}", "prompt")
        p = p[0]
    if isinstance(p, str):
        try:
            return server.llm.encode_raw(p), p
        except ValueError as e:  # e.g. a lone surrogate: not encodable as UTF-8
            raise bad_request(f"the prompt cannot be tokenized: {e}", "prompt") from None
    if not p:
        raise bad_request("the prompt is empty", "prompt")
    n_vocab = server.llm.config.n_vocab
    bad = next((t for t in p if not 0 <= t < n_vocab), None)
    if bad is not None:
        raise bad_request(f"prompt token id {bad} is outside the vocabulary [0, {n_vocab})",
                          "prompt")
    return list(p), server.llm.tokenizer.decode(p)


def _completion_requests(server: Server, body: CompletionRequest, prompt_ids: list[int]
                         ) -> list[tuple[EngineRequest, list[str]]]:
    requested = body.max_tokens
    if requested is None and body.n_predict is not None:  # llama-server's name for it
        if body.n_predict == 0:
            raise bad_request("'n_predict': must be -1 (up to the context) or >= 1, got 0",
                              "n_predict", "invalid_value")
        if body.n_predict > 0:  # as llama-server: at most what the context holds
            requested = min(body.n_predict, max(server.llm.n_ctx - len(prompt_ids), 1))
    return [build_request(body, prompt_ids, server.llm, server.defaults,
                          requested_max=requested, top_logprobs=body.logprobs,
                          prompt_param="prompt", choice=i) for i in range(body.n)]


async def completions(server: Server, body: CompletionRequest, request: Request):
    if body.suffix:
        raise bad_request("suffix is not supported", "suffix", "unsupported")
    if body.echo and body.logprobs is not None:
        raise bad_request("echo with logprobs (prompt logprobs) is not supported", "echo",
                          "unsupported")
    prompt_ids, prompt_text = await run_in_threadpool(_completion_prompt, server, body)
    reqs = await run_in_threadpool(_completion_requests, server, body, prompt_ids)
    group = _submit(server, Choices(f"cmpl-{uuid.uuid4().hex[:24]}", reqs,
                                    asyncio.get_running_loop()))
    head = {"id": group.id, "object": "text_completion", "created": int(time.time()),
            "model": server.model_id, "system_fingerprint": "deimos"}
    echo = prompt_text if body.echo else ""
    want_lps = body.logprobs is not None

    if not body.stream:
        answers = await _collect(server, group, request)
        if answers is None:
            _record(request, group, False, [], disconnected=True)
            return JSONResponse({}, status_code=499)
        choices = [{"text": echo + "".join(a.text), "index": i,
                    "logprobs": server.logprobs.completion(a.logprobs, len(echo))
                    if want_lps else None,
                    "finish_reason": a.done.finish_reason} for i, a in enumerate(answers)]
        dones = [a.done for a in answers]
        _record(request, group, False, dones)
        return {**head, "choices": choices, "usage": usage(dones)}

    include_usage = bool(body.stream_options and body.stream_options.include_usage)

    def chunk(i: int, text: str, finish: str | None = None, logprobs: dict | None = None) -> str:
        return sse({**head, "choices": [{"text": text, "index": i, "logprobs": logprobs,
                                         "finish_reason": finish}]})

    async def stream() -> AsyncIterator[str]:
        dones: list[Done | None] = [None] * group.n
        cut = None
        offsets = [len(echo)] * group.n  # characters of each choice's text so far
        try:
            if echo:
                for i in range(group.n):
                    yield chunk(i, echo)
            async for i, ev in group.events(request, poll=False):
                if isinstance(ev, Piece):
                    lp = server.logprobs.completion(ev.logprobs, offsets[i]) if want_lps else None
                    offsets[i] += len(ev.text)
                    yield chunk(i, ev.text, logprobs=lp)
                elif isinstance(ev, (Failed, Cut)):
                    err = _stream_end(server, ev)
                    cut = err.code
                    yield sse(err.body())
                    yield sse("[DONE]")
                    return
                else:
                    dones[i] = ev
                    yield chunk(i, "", ev.finish_reason)
            if include_usage:
                yield sse({**head, "choices": [], "usage": usage(dones)})
            yield sse("[DONE]")
        finally:
            group.close(server.shutdown)  # the client left mid-stream: free the engine at once
            _record(request, group, True, dones, **_disconnected(dones, cut))

    return _streaming(stream(), group.id)


# ---- the app ------------------------------------------------------------------------------


def create_app(server: Server) -> FastAPI:
    app = FastAPI(title="deimos", summary="OpenAI-compatible API of the Deimos engine",
                  version="0.1.0")
    errors.install(app)

    @app.post("/v1/chat/completions")
    async def _chat(body: ChatCompletionRequest, request: Request):
        return await chat_completions(server, body, request)

    @app.post("/v1/completions")
    async def _completions(body: CompletionRequest, request: Request):
        return await completions(server, body, request)

    def model_card() -> dict[str, Any]:
        llm = server.llm
        return {"id": server.model_id, "object": "model", "created": server.created,
                "owned_by": "deimos", "context_length": llm.n_ctx,
                "architecture": llm.config.arch}

    @app.get("/v1/models")
    async def _models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model:path}")
    async def _model(model: str):
        return model_card()  # any id names the one model served (as llama-server)

    @app.get("/health")
    async def _health():
        return {"status": "ok"}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def _metrics():
        return Response(server.metrics.prometheus(), media_type=CONTENT_TYPE_LATEST)

    def openapi() -> dict[str, Any]:
        # the served model's id as the example "model" (any id is accepted: one model is
        # served), so generated clients and schema fuzzers start from the listed name
        if app.openapi_schema is None:
            schema = FastAPI.openapi(app)
            for name in ("ChatCompletionRequest", "CompletionRequest"):
                props = schema["components"]["schemas"][name]["properties"]
                props["model"]["examples"] = [server.model_id]
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    app.add_middleware(Gate, server=server)
    return app
