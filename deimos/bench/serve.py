"""``deimos bench serve``: drive any OpenAI-compatible server (``deimos serve``, llama.cpp's
llama-server, vLLM...) at several concurrencies and report throughput and latencies.

Per concurrency level C: ``warmup`` requests first (not counted), then C client tasks, each
sending its next request when its previous one ends, until the level's ``requests`` are done.
Every request is streamed with usage at the end, ``max_tokens`` tokens and ``ignore_eos``
(so a server that honours it generates exactly that many), and a prompt of random common
words (deimos.bench.words) distinct per request, so no prefix cache makes one free. Its
length is calibrated first on the server itself: probe requests of ``max_tokens`` 1 read
``usage.prompt_tokens`` (chat template included) and fit the word count to the target.

``constrained`` (``--constrained N``): N of a level's client tasks send JSON-schema-constrained
requests (serve_client.constrained_body) among the plain ones; the level's statistics are then
also given for the plain requests alone, which is what a constrained neighbour may cost them
(run the level with 0 beside it), and for the constrained ones alone (their own rate).

No sampling field is sent unless given, so each server samples with its own defaults; both
``deimos serve`` and llama-server default to llama.cpp's sampler chain (temperature 0.8,
top-k 40, top-p 0.95, min-p 0.05). The statistics are in deimos.bench.serve_stats.
"""

from __future__ import annotations

import asyncio
import itertools
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from deimos.bench.serve_client import constrained_body, request_body, timed_request
from deimos.bench.serve_stats import Calibration, RequestRecord, ServeReport, summarize_level
from deimos.bench.words import prompt_text

CALIBRATION_PROBES = 4  # requests at most to fit the word count


@dataclass(frozen=True)
class ServeBenchConfig:
    url: str = "http://127.0.0.1:8080"
    model: str | None = None  # None: the first id of GET /v1/models
    api_key: str | None = None
    concurrency: tuple[int, ...] = (1, 4, 16, 64)
    prompt_tokens: int = 512
    max_tokens: int = 128
    requests: int | None = None  # per level; None: 4 x concurrency, at least 8
    warmup: int | None = None  # per level; None: the concurrency, at least 1
    endpoint: str = "chat"  # "chat" | "completions"
    sampling: dict[str, Any] = field(default_factory=dict)  # fields sent as given
    seed: int = 0  # of the prompts' words
    timeout_s: float = 600.0  # a request running longer is cut and counted as failed
    constrained: int = 0  # client tasks a level that send JSON-schema-constrained requests

    def __post_init__(self) -> None:
        if not self.concurrency or any(c < 1 for c in self.concurrency):
            raise ValueError(f"bench serve: --concurrency needs levels >= 1, got "
                             f"{self.concurrency}")
        for name in ("prompt_tokens", "max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"bench serve: {name} must be >= 1, got {getattr(self, name)}")
        if self.requests is not None and self.requests < 1:
            raise ValueError(f"bench serve: --requests must be >= 1, got {self.requests}")
        if self.warmup is not None and self.warmup < 0:
            raise ValueError(f"bench serve: --warmup must be >= 0, got {self.warmup}")
        if self.endpoint not in ("chat", "completions"):
            raise ValueError(f"bench serve: endpoint must be chat or completions, got "
                             f"{self.endpoint!r}")
        if self.constrained < 0 or self.constrained >= min(self.concurrency):
            raise ValueError(f"bench serve: --constrained must leave plain clients at every "
                             f"level (0 .. {min(self.concurrency) - 1}), got {self.constrained}")
        if not self.timeout_s > 0:
            raise ValueError(f"bench serve: --timeout must be positive, got {self.timeout_s}")
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"bench serve: --url must start with http:// or https://, got "
                             f"{self.url!r}")

    @property
    def base_url(self) -> str:
        """The server's root: a trailing / or /v1 (an OpenAI client's base URL) dropped."""
        return self.url.rstrip("/").removesuffix("/v1")

    def requests_at(self, c: int) -> int:
        return self.requests if self.requests is not None else max(4 * c, 8)

    def warmup_at(self, c: int) -> int:
        return self.warmup if self.warmup is not None else max(c, 1)


def api_key_from_env() -> str | None:
    return os.environ.get("DEIMOS_API_KEY") or os.environ.get("OPENAI_API_KEY") or None


async def first_model(client: httpx.AsyncClient) -> str:
    """The first id of GET /v1/models."""
    try:
        r = await client.get("/v1/models")
    except httpx.HTTPError as e:
        raise RuntimeError(f"bench serve: GET /v1/models: {type(e).__name__}: {e} "
                           "(is the server up? --url)") from None
    if r.status_code != 200:
        raise RuntimeError(f"bench serve: GET /v1/models answered {r.status_code}: {r.text[:200]}")
    try:
        return str(r.json()["data"][0]["id"])
    except (ValueError, KeyError, IndexError, TypeError):
        raise RuntimeError(f"bench serve: GET /v1/models has no model id: {r.text[:200]}") from None


def _next_words(probes: list[tuple[int, int]], target: int) -> int:
    """The word count to try next, on the line tokens = template overhead + rate x words:
    after one probe with a rate of 1 (the words are one token each in the vocabularies we
    know), after two or more through the last two distinct ones."""
    w1, p1 = probes[-1]
    rate = 1.0
    distinct = [(w, p) for w, p in probes[:-1] if w != w1]
    if distinct:
        w0, p0 = distinct[-1]
        rate = (p1 - p0) / (w1 - w0) if p1 != p0 else 1.0
        rate = rate if rate > 0 else 1.0
    return max(1, w1 + round((target - p1) / rate))


async def calibrate(client: httpx.AsyncClient, cfg: ServeBenchConfig, model: str) -> Calibration:
    """Fit the word count so that a prompt is within ``tol`` tokens of the target."""
    target = cfg.prompt_tokens
    tol = max(2, target // 100)
    words = target  # the words are about one token each (deimos.bench.words)
    probes: list[tuple[int, int]] = []
    for i in range(CALIBRATION_PROBES):
        body = request_body(cfg.endpoint, model, prompt_text(cfg.seed, "calibrate", i, words), 1,
                            cfg.sampling)
        rec = await timed_request(client, cfg.endpoint, body, level=0, index=i, warmup=True,
                                  timeout_s=cfg.timeout_s)
        if not rec.ok or rec.prompt_tokens is None:
            why = rec.error or "no usage.prompt_tokens in the stream"
            best = _best(probes, target)
            return Calibration(best or words, probes, f"probe {i} failed ({why}); "
                               + ("kept the best probe" if best else "prompts not calibrated"))
        probes.append((words, rec.prompt_tokens))
        if abs(rec.prompt_tokens - target) <= tol:
            break
        nxt = _next_words(probes, target)
        if nxt in (w for w, _ in probes):
            break
        words = nxt
    best = _best(probes, target)
    p = dict(probes)[best]
    note = None
    if abs(p - target) > tol:
        note = (f"the closest prompt has {p} tokens, not {target} "
                f"({'the template alone is longer' if best == 1 else 'could not fit closer'})")
    return Calibration(best, probes, note)


def _best(probes: list[tuple[int, int]], target: int) -> int | None:
    return min(probes, key=lambda wp: abs(wp[1] - target))[0] if probes else None


async def run_level(client: httpx.AsyncClient, cfg: ServeBenchConfig, model: str, words: int,
                    c: int, n: int, warmup: bool) -> list[RequestRecord]:
    """``n`` requests by ``c`` client tasks, each sending its next when its last one ends."""
    tag = f"{'warmup' if warmup else 'run'}/{c}"
    counter = itertools.count()
    records: list[RequestRecord] = []

    async def client_task(constrained: bool) -> None:
        while (i := next(counter)) < n:
            body = request_body(cfg.endpoint, model, prompt_text(cfg.seed, tag, i, words),
                                cfg.max_tokens, cfg.sampling)
            if constrained:
                body = constrained_body(body)
            records.append(await timed_request(client, cfg.endpoint, body, level=c, index=i,
                                               warmup=warmup, timeout_s=cfg.timeout_s,
                                               constrained=constrained))

    await asyncio.gather(*(client_task(j < cfg.constrained) for j in range(min(c, n))))
    records.sort(key=lambda r: r.index)
    return records


async def run_serve_bench_async(cfg: ServeBenchConfig,
                                progress: Callable[[str], None] | None = None) -> ServeReport:
    """Calibrate, then each level: warm-up, measured requests. ``progress`` gets a line per
    step."""
    say = progress or (lambda _: None)
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    n_conn = max(cfg.concurrency) + 4
    # timeouts per phase as long as the whole request's: a slow server is measured, and a
    # hung one is cut by timed_request's deadline. trust_env=False: no proxy in between.
    limits = httpx.Limits(max_connections=n_conn, max_keepalive_connections=n_conn)
    async with httpx.AsyncClient(base_url=cfg.base_url, headers=headers, trust_env=False,
                                 timeout=httpx.Timeout(cfg.timeout_s), limits=limits) as client:
        model = cfg.model or await first_model(client)
        cal = await calibrate(client, cfg, model)
        say(f"{model} at {cfg.base_url}: {cal.words} words per prompt (probes, words -> "
            f"tokens: {', '.join(f'{w} -> {p}' for w, p in cal.probes) or 'none'})"
            + (f"; {cal.note}" if cal.note else ""))
        report = ServeReport(url=cfg.base_url, model=model, endpoint=cfg.endpoint,
                             prompt_tokens=cfg.prompt_tokens, max_tokens=cfg.max_tokens,
                             seed=cfg.seed, sampling=dict(cfg.sampling), calibration=cal)
        for c in cfg.concurrency:
            warm = await run_level(client, cfg, model, cal.words, c, cfg.warmup_at(c), True)
            recs = await run_level(client, cfg, model, cal.words, c, cfg.requests_at(c), False)
            lv = summarize_level(c, recs, warm)
            report.levels.append(lv)
            report.records += warm + recs
            say(f"concurrency {c}: {lv.ok} ok, {lv.failed} failed, {lv.output_tps:.1f} output "
                f"tok/s (warm-up: {lv.warmup_ok} ok, {lv.warmup_failed} failed)")
    return report


def run_serve_bench(cfg: ServeBenchConfig,
                    progress: Callable[[str], None] | None = None) -> ServeReport:
    return asyncio.run(run_serve_bench_async(cfg, progress))
