"""``deimos bench agent``: replay a recorded coding-agent session (deimos.bench.sessions)
against any OpenAI-compatible server (``deimos serve``, llama-server) and time it.

One turn at a time, each request as recorded (the whole conversation so far, its tools),
streamed with usage at the end, its answer forced to the recorded length: ``max_tokens`` of
the recording plus ``ignore_eos`` (llama-server's extension, which ``deimos serve`` accepts
too), so both engines generate exactly as many tokens whatever their weights say. The
server's own answer is dropped: the next turn carries the recorded one, as the agent sent it.

Before the session, ``warmup`` short requests of random words (no shared prefix with the
session) let a server finish its lazy start-up. The statistics are in
deimos.bench.agent_stats.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from deimos.bench.agent_stats import AgentReport, TurnRecord
from deimos.bench.serve import first_model
from deimos.bench.serve_client import sse_events
from deimos.bench.sessions import load_session
from deimos.bench.words import prompt_text

CHAT_PATH = "/v1/chat/completions"


@dataclass(frozen=True)
class AgentBenchConfig:
    session: str  # a session file, or the name of a committed one (multi-turn, ...)
    url: str = "http://127.0.0.1:8080"
    model: str | None = None  # None: the first id of GET /v1/models
    api_key: str | None = None
    turns: int | None = None  # the first N turns only
    tools_in_system: bool = False  # the tool schemas as system-prompt text, no ``tools`` field
    warmup: int = 1
    sampling: dict[str, Any] | None = None  # fields sent as given (temperature...)
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.turns is not None and self.turns < 1:
            raise ValueError(f"bench agent: --turns must be >= 1, got {self.turns}")
        if self.warmup < 0:
            raise ValueError(f"bench agent: --warmup must be >= 0, got {self.warmup}")
        if not self.timeout_s > 0:
            raise ValueError(f"bench agent: --timeout must be positive, got {self.timeout_s}")
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"bench agent: --url must start with http:// or https://, got "
                             f"{self.url!r}")

    @property
    def base_url(self) -> str:
        return self.url.rstrip("/").removesuffix("/v1")


def tools_as_text(tools: list[dict[str, Any]]) -> str:
    return ("# Tools\n\nCall a tool with a JSON object {\"name\": ..., \"arguments\": {...}}. "
            "The tools:\n" + "\n".join(json.dumps(t, ensure_ascii=False) for t in tools))


def request_body(turn: dict[str, Any], model: str, *, tools_in_system: bool = False,
                 sampling: dict[str, Any] | None = None) -> dict[str, Any]:
    """The request sent for a recorded turn: its messages and tools, its max_tokens forced
    with ignore_eos, streamed with usage. ``tools_in_system``: the schemas appended to the
    system message as text (one is added if there is none) instead of a ``tools`` field."""
    messages = [dict(m) for m in turn["messages"]]
    tools = turn.get("tools") or None
    if tools and tools_in_system:
        text = tools_as_text(tools)
        if messages[0].get("role") == "system":
            messages[0]["content"] = f"{messages[0].get('content') or ''}\n\n{text}"
        else:
            messages.insert(0, {"role": "system", "content": text})
        tools = None
    body: dict[str, Any] = {"model": model, "messages": messages,
                            "max_tokens": turn["max_tokens"], "ignore_eos": True,
                            "stream": True, "stream_options": {"include_usage": True},
                            **(sampling or {})}
    if tools:
        body["tools"] = tools
    return body


def warmup_body(model: str, i: int, *, tools: bool, tools_in_system: bool = False,
                sampling: dict[str, Any] | None = None) -> dict[str, Any]:
    """Warm-up request ``i``: 32 random words, 4 tokens. When the session sends tools, one
    made-up tool goes with it, as the session sends its own (a template written for tool use,
    such as Hermes-3's, may refuse a request without tools); its name and description are
    random words, so the warm-up shares no more than the template's fixed text with the
    session."""
    words = prompt_text(0, "agent", i, 32)
    turn: dict[str, Any] = {"messages": [{"role": "user", "content": words}], "max_tokens": 4}
    if tools:
        turn["tools"] = [{"type": "function", "function": {
            "name": f"warmup_{i}", "description": prompt_text(1, "agent", i, 8),
            "parameters": {"type": "object", "properties": {}}}}]
    return request_body(turn, model, tools_in_system=tools_in_system, sampling=sampling)


def _output_text(event: dict[str, Any]) -> str:
    """The generated text an event's first choice carries: reasoning, content, then tool
    calls' names and arguments ("" when it carries none)."""
    choices = event.get("choices") or []
    if not choices or not isinstance(choices[0], dict):
        return ""
    delta = choices[0].get("delta") or {}
    if not isinstance(delta, dict):
        return ""
    parts = [x for x in (delta.get("reasoning_content"), delta.get("content")) if isinstance(x, str)]
    calls = delta.get("tool_calls")
    for c in calls if isinstance(calls, list) else ():
        fn = c.get("function") if isinstance(c, dict) else None
        if isinstance(fn, dict):
            parts += [x for x in (fn.get("name"), fn.get("arguments")) if isinstance(x, str)]
    return "".join(parts)


def _read_usage(rec: TurnRecord, event: dict[str, Any]) -> None:
    usage = event.get("usage")
    if isinstance(usage, dict):
        if isinstance(usage.get("completion_tokens"), int):
            rec.completion_tokens = usage["completion_tokens"]
        if isinstance(usage.get("prompt_tokens"), int):
            rec.prompt_tokens = usage["prompt_tokens"]
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
            rec.cached_tokens, rec.cached_from = details["cached_tokens"], "usage"
    timings = event.get("timings")
    if isinstance(timings, dict):  # llama-server's
        rec.timings = timings
        if rec.cached_from != "usage" and isinstance(timings.get("cache_n"), int):
            rec.cached_tokens, rec.cached_from = timings["cache_n"], "timings"


async def _stream(client: httpx.AsyncClient, body: dict[str, Any], rec: TurnRecord) -> None:
    done = False
    async with client.stream("POST", CHAT_PATH, json=body) as resp:
        async for now, event in sse_events(resp, rec):
            if event is None:
                done = True
                break
            text = _output_text(event)
            if text:
                rec.text += text
                if rec.ttft_s is None:
                    rec.ttft_s = now - rec.sent_s
                rec.n_deltas += 1
            for c in event.get("choices") or []:
                if isinstance(c, dict) and c.get("finish_reason"):
                    rec.finish_reason = c["finish_reason"]
            _read_usage(rec, event)
    if rec.error is not None:
        return
    if not done:
        rec.error = "broken stream: it ended before [DONE]"
        return
    if rec.completion_tokens is None:
        rec.completion_tokens = rec.n_deltas
    rec.ok = True


async def replay_turn(client: httpx.AsyncClient, body: dict[str, Any], turn: int,
                      max_tokens: int, timeout_s: float) -> TurnRecord:
    """Send one turn streamed and time it; whatever goes wrong ends up in the record."""
    rec = TurnRecord(turn=turn, max_tokens=max_tokens, sent_s=time.perf_counter())
    try:
        await asyncio.wait_for(_stream(client, body, rec), timeout_s)
    except TimeoutError:
        rec.error = f"timed out after {timeout_s:g} s"
    except httpx.TimeoutException as e:
        rec.error = f"timed out ({type(e).__name__})"
    except (httpx.HTTPError, OSError) as e:
        rec.error = f"{type(e).__name__}: {e}"
    rec.e2e_s = time.perf_counter() - rec.sent_s
    if rec.error is not None:
        rec.ok = False
    return rec


def _session_name(session: str) -> str:
    p = Path(session)
    return p.name.removesuffix(".gz").removesuffix(".jsonl") if p.suffix else session


async def run_agent_bench_async(cfg: AgentBenchConfig,
                                progress: Callable[[str], None] | None = None) -> AgentReport:
    say = progress or (lambda _: None)
    turns = load_session(cfg.session)[:cfg.turns]
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    async with httpx.AsyncClient(base_url=cfg.base_url, headers=headers, trust_env=False,
                                 timeout=httpx.Timeout(cfg.timeout_s)) as client:
        try:
            model = cfg.model or await first_model(client)
        except RuntimeError as e:  # worded for bench serve, which shares the call
            raise RuntimeError(str(e).replace("bench serve:", "bench agent:", 1)) from None
        warm = []
        tools = bool(turns and turns[0].get("tools"))
        for i in range(cfg.warmup):
            body = warmup_body(model, i, tools=tools, tools_in_system=cfg.tools_in_system,
                               sampling=cfg.sampling)
            warm.append(await replay_turn(client, body, 0, 4, cfg.timeout_s))
        report = AgentReport(url=cfg.base_url, model=model, session=_session_name(cfg.session),
                             tools_in_system=cfg.tools_in_system, sampling=dict(cfg.sampling or {}),
                             warmup_ok=sum(w.ok for w in warm),
                             warmup_failed=sum(not w.ok for w in warm))
        say(f"{model} at {cfg.base_url}: {len(turns)} turns of {report.session}"
            + (f" (warm-up: {report.warmup_failed} of {cfg.warmup} failed)"
               if report.warmup_failed else ""))
        for i, turn in enumerate(turns, 1):
            body = request_body(turn, model, tools_in_system=cfg.tools_in_system,
                                sampling=cfg.sampling)
            rec = await replay_turn(client, body, i, turn["max_tokens"], cfg.timeout_s)
            report.turns.append(rec)
            say(f"turn {i}/{len(turns)}: " + (
                f"{rec.prompt_tokens} prompt ({rec.cached_tokens} cached), "
                f"{rec.completion_tokens}/{rec.max_tokens} generated, {rec.e2e_s:.2f} s"
                if rec.ok else f"failed: {rec.error}"))
    return report


def run_agent_bench(cfg: AgentBenchConfig,
                    progress: Callable[[str], None] | None = None) -> AgentReport:
    return asyncio.run(run_agent_bench_async(cfg, progress))
