"""The FastAPI app: OpenAI routes over one ``EngineWorker``.

    app = create_app(Server(llm, worker, metrics, ...))

Handlers validate and tokenize, then hand a ``Job`` to the worker and turn its events into a
response (JSON, or SSE with ``stream: true``). A client that goes away cancels its job.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.concurrency import run_in_threadpool

from deimos.engine import LLM
from deimos.engine.request import ContextLengthError, EngineError, RequestError
from deimos.server import errors, tools
from deimos.server.errors import APIError, bad_request, fault
from deimos.server.gate import Gate, Shutdown, shutting_down
from deimos.server.metrics import Metrics
from deimos.server.params import Defaults, build_request, schema_constraint
from deimos.server.protocol import ChatCompletionRequest, CompletionRequest
from deimos.server.responses import LogprobFormatter, sse, usage
from deimos.server.worker import Cut, Done, EngineWorker, Failed, Job, Piece, QueueFull
from deimos.tokenizer.template import TemplateError

log = logging.getLogger("deimos.server")

DISCONNECT_POLL_S = 0.25


@dataclass
class Server:
    llm: LLM
    worker: EngineWorker
    metrics: Metrics
    model_id: str
    aliases: frozenset[str] = frozenset()
    defaults: Defaults = field(default_factory=Defaults)
    api_key: str | None = None
    shutdown: Shutdown = field(default_factory=Shutdown)
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        self.tool_style = tools.tool_call_style(self.llm.template.source, self.llm.tokenizer)
        self.logprobs = LogprobFormatter(self.llm.tokenizer)

    def check_model(self, model: str) -> None:
        if model != self.model_id and model not in self.aliases:
            raise APIError(404, f"the model {model!r} does not exist; this server serves "
                                f"{self.model_id!r}", param="model", code="model_not_found")


# ---- running a job ------------------------------------------------------------------------


def _submit(server: Server, job: Job) -> Job:
    if server.shutdown.draining:
        raise shutting_down()
    try:
        server.worker.submit(job)
    except QueueFull as e:
        raise APIError(503, f"the server is busy: {e}; retry later", code="queue_full") from None
    server.shutdown.track(job)
    return job


Event = Piece | Done | Failed | Cut


async def _events(server: Server, job: Job, request: Request, poll: bool
                  ) -> AsyncIterator[Event]:
    """The job's events; cancels the job when the consumer stops early or (``poll``) the
    client disconnects. A streaming response learns of a disconnect by being cancelled."""
    try:
        while True:
            if poll:
                try:
                    ev = await asyncio.wait_for(job.events.get(), DISCONNECT_POLL_S)
                except TimeoutError:
                    if await request.is_disconnected():
                        job.cancelled.set()
                        return
                    continue
            else:
                ev = await job.events.get()
            yield ev
            if not isinstance(ev, Piece):
                return
    finally:
        job.cancelled.set()  # no-op once done; otherwise frees the engine at the next token
        server.shutdown.untrack(job)


async def _collect(server: Server, job: Job, request: Request
                   ) -> tuple[list[str], list, Done | None]:
    """A whole answer: its text pieces, their logprobs and the final event (None when the
    client left first); a failure or a shutdown cut raises as its API error."""
    text, lps, done = [], [], None
    async for ev in _events(server, job, request, poll=True):
        if isinstance(ev, Piece):
            text.append(ev.text)
            lps += ev.logprobs
        elif isinstance(ev, Failed):
            raise _failure(ev.error)
        elif isinstance(ev, Cut):
            raise shutting_down()
        else:
            done = ev
    return text, lps, done


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


async def _closing(events: AsyncIterator[str], job: Job) -> AsyncIterator[str]:
    """An SSE body that always ends properly: an exception while streaming becomes a final
    error event and ``[DONE]`` (the 200 is already sent; the fault is logged once)."""
    try:
        async for line in events:
            yield line
    except Exception as e:  # noqa: BLE001 - the stream's last words instead of a cut connection
        yield sse(fault(e, f"stream {job.id}").body())
        yield sse("[DONE]")


def _record(request: Request, job: Job, stream: bool, done: Done | None, **extra: Any) -> None:
    info: dict[str, Any] = {"id": job.id, "stream": stream, **extra}
    if done is not None:
        info.update(
            prompt_tokens=done.prompt_tokens, cached_tokens=done.cached_tokens,
            completion_tokens=done.completion_tokens, finish_reason=done.finish_reason,
            queued_ms=round(done.queued_s * 1000, 1), ttft_ms=round(done.ttft_s * 1000, 1),
            prefill_tps=round((done.prompt_tokens - done.cached_tokens) / done.prefill_s, 1)
            if done.prefill_s > 0 else None,
            decode_tps=round((done.completion_tokens - 1) / done.decode_s, 1)
            if done.completion_tokens > 1 and done.decode_s > 0 else None)
    request.state.deimos = info


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


def _chat_prompt(server: Server, body: ChatCompletionRequest) -> ChatPlan:
    tool_list = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
    choice = body.tool_choice
    choice = choice.model_dump() if hasattr(choice, "model_dump") else choice
    try:
        if tool_list is not None:
            tools.validate_tools(tool_list)
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
    try:
        msgs, tmpl_tools = tools.prepare_chat(messages, tool_list if use_tools else None,
                                              llm.template.source, server.tool_style)
        ids = llm.encode_chat(msgs, tools=tmpl_tools)
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


async def chat_completions(server: Server, body: ChatCompletionRequest, request: Request):
    server.check_model(body.model)
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
    top = (body.top_logprobs or 0) if body.logprobs else None
    plan = await run_in_threadpool(_chat_prompt, server, body)
    tool_names = plan.tool_names
    forced = None
    if plan.forced_schema is not None:
        forced = await run_in_threadpool(schema_constraint, plan.forced_schema, server.llm,
                                         "tools")
    requested = body.max_completion_tokens or body.max_tokens
    req, stops = await run_in_threadpool(
        lambda: build_request(body, plan.ids, server.llm, server.defaults, requested_max=requested,
                              top_logprobs=top, prompt_param="messages", forced=forced))
    job = _submit(server, Job(f"chatcmpl-{uuid.uuid4().hex[:24]}", req, stops,
                              asyncio.get_running_loop()))
    head = {"id": job.id, "created": int(time.time()), "model": server.model_id,
            "system_fingerprint": "deimos"}

    def finish_reason(done: Done, calls: list) -> str:
        return "tool_calls" if calls else done.finish_reason

    if not body.stream:
        text, lps, done = await _collect(server, job, request)
        if done is None:  # the client left
            _record(request, job, False, None, disconnected=True)
            return JSONResponse({}, status_code=499)
        content: str | None = "".join(text)
        calls: list = []
        if tool_names is not None:
            content, calls = tools.parse_tool_calls(plan.prefix + content, server.tool_style,
                                                    tool_names)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = calls
        choice = {"index": 0, "message": message,
                  "logprobs": {"content": server.logprobs.chat(lps)} if top is not None else None,
                  "finish_reason": finish_reason(done, calls)}
        _record(request, job, False, done)
        return {**head, "object": "chat.completion", "choices": [choice], "usage": usage(done)}

    include_usage = bool(body.stream_options and body.stream_options.include_usage)

    def chunk(delta: dict, finish: str | None = None, logprobs: list | None = None) -> str:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        if logprobs is not None:
            choice["logprobs"] = {"content": server.logprobs.chat(logprobs)}
        return sse({**head, "object": "chat.completion.chunk", "choices": [choice]})

    async def stream() -> AsyncIterator[str]:
        done = cut = None
        held: list[str] = []  # with tools on, the reply is parsed whole before it is sent
        held_lps: list = []
        try:
            yield chunk({"role": "assistant", "content": ""})
            async for ev in _events(server, job, request, poll=False):
                if isinstance(ev, Piece):
                    if tool_names is not None:
                        held.append(ev.text)
                        held_lps += ev.logprobs
                    else:
                        yield chunk({"content": ev.text},
                                    logprobs=ev.logprobs if top is not None else None)
                elif isinstance(ev, (Failed, Cut)):
                    err = _failure(ev.error) if isinstance(ev, Failed) else shutting_down()
                    cut = err.code
                    yield sse(err.body())
                    yield sse("[DONE]")
                    return
                else:
                    done = ev
            calls: list = []
            if tool_names is not None:
                content, calls = tools.parse_tool_calls(plan.prefix + "".join(held),
                                                        server.tool_style, tool_names)
                if calls:
                    yield chunk({"tool_calls": [{"index": i, **c} for i, c in enumerate(calls)]})
                elif content:
                    yield chunk({"content": content},
                                logprobs=held_lps if top is not None else None)
            yield chunk({}, finish_reason(done, calls))
            if include_usage:
                yield sse({**head, "object": "chat.completion.chunk", "choices": [],
                           "usage": usage(done)})
            yield sse("[DONE]")
        finally:
            job.cancelled.set()  # the client left mid-stream: free the engine at once
            _record(request, job, True, done, **({"error": cut} if cut else
                                                 {"disconnected": done is None}))

    return StreamingResponse(_closing(stream(), job), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


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


async def completions(server: Server, body: CompletionRequest, request: Request):
    server.check_model(body.model)
    if body.suffix:
        raise bad_request("suffix is not supported", "suffix", "unsupported")
    if body.echo and body.logprobs is not None:
        raise bad_request("echo with logprobs (prompt logprobs) is not supported", "echo",
                          "unsupported")
    prompt_ids, prompt_text = await run_in_threadpool(_completion_prompt, server, body)
    req, stops = await run_in_threadpool(
        lambda: build_request(body, prompt_ids, server.llm, server.defaults,
                              requested_max=body.max_tokens, top_logprobs=body.logprobs,
                              prompt_param="prompt"))
    job = _submit(server, Job(f"cmpl-{uuid.uuid4().hex[:24]}", req, stops,
                              asyncio.get_running_loop()))
    head = {"id": job.id, "object": "text_completion", "created": int(time.time()),
            "model": server.model_id, "system_fingerprint": "deimos"}
    echo = prompt_text if body.echo else ""
    want_lps = body.logprobs is not None

    if not body.stream:
        pieces, lps, done = await _collect(server, job, request)
        text = [echo, *pieces]
        if done is None:
            _record(request, job, False, None, disconnected=True)
            return JSONResponse({}, status_code=499)
        choice = {"text": "".join(text), "index": 0,
                  "logprobs": server.logprobs.completion(lps, 0) if want_lps else None,
                  "finish_reason": done.finish_reason}
        _record(request, job, False, done)
        return {**head, "choices": [choice], "usage": usage(done)}

    include_usage = bool(body.stream_options and body.stream_options.include_usage)

    def chunk(text: str, finish: str | None = None, logprobs: dict | None = None) -> str:
        return sse({**head, "choices": [{"text": text, "index": 0, "logprobs": logprobs,
                                         "finish_reason": finish}]})

    async def stream() -> AsyncIterator[str]:
        done = cut = None
        offset = 0
        try:
            if echo:
                yield chunk(echo)
            async for ev in _events(server, job, request, poll=False):
                if isinstance(ev, Piece):
                    lp = server.logprobs.completion(ev.logprobs, offset) if want_lps else None
                    offset += len(ev.text)
                    yield chunk(ev.text, logprobs=lp)
                elif isinstance(ev, (Failed, Cut)):
                    err = _failure(ev.error) if isinstance(ev, Failed) else shutting_down()
                    cut = err.code
                    yield sse(err.body())
                    yield sse("[DONE]")
                    return
                else:
                    done = ev
            yield chunk("", done.finish_reason)
            if include_usage:
                yield sse({**head, "choices": [], "usage": usage(done)})
            yield sse("[DONE]")
        finally:
            job.cancelled.set()  # the client left mid-stream: free the engine at once
            _record(request, job, True, done, **({"error": cut} if cut else
                                                 {"disconnected": done is None}))

    return StreamingResponse(_closing(stream(), job), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


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
        server.check_model(model)
        return model_card()

    @app.get("/health")
    async def _health():
        return {"status": "ok"}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def _metrics():
        return Response(server.metrics.prometheus(), media_type=CONTENT_TYPE_LATEST)

    def openapi() -> dict[str, Any]:
        # the served model's id as the only valid "model", so generated clients (and schema
        # fuzzers) can build requests that reach the engine
        if app.openapi_schema is None:
            schema = FastAPI.openapi(app)
            for name in ("ChatCompletionRequest", "CompletionRequest"):
                props = schema["components"]["schemas"][name]["properties"]
                props["model"]["enum"] = [server.model_id]
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    app.add_middleware(Gate, server=server)
    return app
