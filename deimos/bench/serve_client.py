"""One streamed request to an OpenAI-compatible server, timed delta by delta (httpx, asyncio).

Whatever goes wrong (an HTTP error status, a refused connection, a stream cut before
``[DONE]``, an ``error`` event in the stream, a request past its deadline) ends up in the
record as ``ok=False`` with the reason; nothing here raises for a server's behaviour.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx

from deimos.bench.serve_stats import RequestRecord

PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}


# A JSON-constrained request's schema (``--constrained``): an array of at least 512 short
# strings, so the answer runs to max_tokens as the others do (a constrained request cannot
# send ignore_eos: its end comes when the JSON is complete)
LONG_JSON_SCHEMA: dict[str, Any] = {
    "type": "array", "minItems": 512, "items": {"type": "string", "maxLength": 12}}


def constrained_body(body: dict[str, Any]) -> dict[str, Any]:
    """``body`` made a JSON-schema-constrained request (response_format json_schema,
    ``LONG_JSON_SCHEMA``), without ignore_eos."""
    out = {k: v for k, v in body.items() if k != "ignore_eos"}
    out["response_format"] = {"type": "json_schema",
                              "json_schema": {"name": "words", "schema": LONG_JSON_SCHEMA}}
    return out


def request_body(endpoint: str, model: str, prompt: str, max_tokens: int,
                 sampling: dict[str, Any]) -> dict[str, Any]:
    """A streamed request with usage at the end and ``ignore_eos`` (llama-server honours it,
    and so generates exactly ``max_tokens``; a server that does not know it ignores it)."""
    body: dict[str, Any] = {"model": model, "stream": True,
                            "stream_options": {"include_usage": True},
                            "max_tokens": max_tokens, "ignore_eos": True, **sampling}
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


def _content(event: dict[str, Any], endpoint: str) -> str:
    """The text an event's first choice carries (chat: content or reasoning_content)."""
    choices = event.get("choices") or []
    if not choices or not isinstance(choices[0], dict):
        return ""
    c = choices[0]
    if endpoint == "chat":
        delta = c.get("delta") or {}
        return (delta.get("content") or "") + (delta.get("reasoning_content") or "")
    return c.get("text") or ""


async def _sse_lines(resp: httpx.Response):
    """The stream's lines, cut at line feeds only. (httpx's ``aiter_lines`` also cuts at the
    other Unicode line boundaries, U+2028, U+0085 ..., which a generated text carries raw in
    its JSON: seen at concurrency 64 on both servers, H200, 2026-12-01.)"""
    buf = b""
    async for chunk in resp.aiter_bytes():
        buf += chunk
        *lines, buf = buf.split(b"\n")
        for line in lines:
            yield line.rstrip(b"\r").decode("utf-8", errors="replace")
    if buf:
        yield buf.rstrip(b"\r").decode("utf-8", errors="replace")


async def sse_events(resp: httpx.Response, rec) -> AsyncIterator[tuple[float, dict | None]]:
    """The data events of a streamed OpenAI response as (arrival time, event dict), then
    (time, None) at ``[DONE]``. ``rec`` (a request's record: ``status``, ``error``,
    ``response_id``) gets the HTTP status, the response id, and the reason the stream is
    broken (not 200, an event that is not JSON, an error event), after which nothing more is
    yielded."""
    rec.status = resp.status_code
    if resp.status_code != 200:
        text = (await resp.aread()).decode(errors="replace")
        rec.error = f"HTTP {resp.status_code}: {' '.join(text.split())[:200]}"
        return
    async for line in _sse_lines(resp):
        if not line.startswith("data:"):
            continue  # blank separators, ": ping" comments, "event:" lines
        payload = line[5:].strip()
        now = time.perf_counter()
        if payload == "[DONE]":
            yield now, None
            return
        try:
            event = json.loads(payload)
        except json.JSONDecodeError:
            rec.error = f"broken stream: an event is not JSON: {payload[:120]!r}"
            return
        if not isinstance(event, dict):
            continue
        if event.get("error") is not None:
            err = event["error"]
            msg = err.get("message", err) if isinstance(err, dict) else err
            rec.error = f"error event: {str(msg)[:200]}"
            return
        if rec.response_id is None and isinstance(event.get("id"), str):
            rec.response_id = event["id"]
        yield now, event


async def _stream(client: httpx.AsyncClient, endpoint: str, body: dict[str, Any],
                  rec: RequestRecord) -> None:
    last: float | None = None
    done = False
    async with client.stream("POST", PATHS[endpoint], json=body) as resp:
        async for now, event in sse_events(resp, rec):
            if event is None:
                done = True
                break
            if _content(event, endpoint):
                if last is None:
                    rec.ttft_s = now - rec.sent_s
                else:
                    rec.itl_s.append(now - last)
                last = now
                rec.n_deltas += 1
            for c in event.get("choices") or []:
                if isinstance(c, dict) and c.get("finish_reason"):
                    rec.finish_reason = c["finish_reason"]
            usage = event.get("usage")
            if isinstance(usage, dict):
                if isinstance(usage.get("completion_tokens"), int):
                    rec.usage_completion_tokens = usage["completion_tokens"]
                if isinstance(usage.get("prompt_tokens"), int):
                    rec.prompt_tokens = usage["prompt_tokens"]
    if rec.error is not None:
        return
    if not done:
        rec.error = "broken stream: it ended before [DONE]"
        return
    rec.ok = True


async def timed_request(client: httpx.AsyncClient, endpoint: str, body: dict[str, Any], *,
                        level: int, index: int, warmup: bool, timeout_s: float,
                        constrained: bool = False) -> RequestRecord:
    """Send ``body`` streamed and time it; a request still running after ``timeout_s`` is cut
    and counted as failed."""
    rec = RequestRecord(level=level, index=index, warmup=warmup, sent_s=time.perf_counter(),
                        constrained=constrained)
    try:
        await asyncio.wait_for(_stream(client, endpoint, body, rec), timeout_s)
    except TimeoutError:  # asyncio.wait_for's deadline
        rec.error = f"timed out after {timeout_s:g} s"
    except httpx.TimeoutException as e:
        rec.error = f"timed out ({type(e).__name__})"
    except (httpx.RemoteProtocolError, httpx.ReadError) as e:
        rec.error = f"broken stream: {type(e).__name__}: {e}"
    except httpx.HTTPError as e:  # connection refused, DNS, ...
        rec.error = f"{type(e).__name__}: {e}"
    except OSError as e:
        rec.error = f"{type(e).__name__}: {e}"
    rec.e2e_s = time.perf_counter() - rec.sent_s
    if rec.error is not None:
        rec.ok = False
    return rec
