"""Records and statistics of ``deimos bench agent`` (pure: no network, no clock).

Per turn, as the client saw it:
- TTFT: request sent -> the first delta that carries output (content, reasoning or a tool
  call's text); it holds the prefill of the turn's new (uncached) prompt tokens and the first
  generated token.
- new tokens: ``prompt_tokens - cached_tokens`` (the server's usage; llama-server's
  ``timings.cache_n`` where usage has no cached count).
- prefill rate: new tokens / TTFT; decode rate: (completion tokens - 1) / (E2E - TTFT).
Over the session the rates are token-weighted: the sums of tokens over the sums of times, so a
turn counts by its size. A turn whose answer came in one piece at the end (one output delta
for two or more tokens: a server that holds a reply to parse its tool calls, or a reply that
is one tool call) has no TTFT: it is left out of the rates and named. Wall time runs from the first turn
sent to the last one finished, one turn at a time.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from deimos.bench.serve_stats import Dist


@dataclass(slots=True)
class TurnRecord:
    """One turn. Times in seconds; ``sent_s`` from perf_counter."""

    turn: int  # 1-based
    max_tokens: int  # the recorded answer length, forced
    sent_s: float
    ok: bool = False
    error: str | None = None
    status: int | None = None
    ttft_s: float | None = None
    e2e_s: float = 0.0
    n_deltas: int = 0  # deltas that carried output
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    cached_from: str | None = None  # "usage" | "timings"
    completion_tokens: int | None = None  # usage's, else the output deltas
    finish_reason: str | None = None
    response_id: str | None = None
    timings: dict[str, Any] | None = None  # llama-server's own (prompt_ms, predicted_ms...)
    text: str = ""  # the answer as streamed: content, reasoning and tool calls' text, in order

    @property
    def held(self) -> bool:
        """The whole answer came in one delta at the end: TTFT not measured."""
        return self.ok and (self.completion_tokens or 0) >= 2 and self.n_deltas <= 1

    @property
    def new_tokens(self) -> int | None:
        if self.prompt_tokens is None:
            return None
        return self.prompt_tokens - (self.cached_tokens or 0)

    @property
    def measured(self) -> bool:
        return self.ok and self.ttft_s is not None and not self.held

    @property
    def prefill_tps(self) -> float | None:
        n = self.new_tokens
        if not self.measured or n is None or not self.ttft_s > 0:
            return None
        return n / self.ttft_s

    @property
    def decode_s(self) -> float | None:
        return self.e2e_s - self.ttft_s if self.measured else None

    @property
    def decode_tps(self) -> float | None:
        d, n = self.decode_s, self.completion_tokens or 0
        return (n - 1) / d if d is not None and d > 0 and n >= 2 else None

    @property
    def forced(self) -> bool:
        return self.ok and self.completion_tokens == self.max_tokens

    def to_json(self, t0: float) -> dict[str, Any]:
        d = asdict(self)
        d["sent_s"] = self.sent_s - t0
        for name in ("held", "new_tokens", "prefill_tps", "decode_tps", "forced"):
            d[name] = getattr(self, name)
        return d


def _server_rate(turns: Sequence[TurnRecord], n_key: str, ms_key: str) -> float | None:
    """Σn / Σms of the server's own timings, where every turn has them."""
    ts = [t.timings for t in turns]
    if not ts or any(not isinstance(x, dict) or not isinstance(x.get(n_key), int)
                     or not isinstance(x.get(ms_key), (int, float)) for x in ts):
        return None
    ms = sum(x[ms_key] for x in ts)
    return sum(x[n_key] for x in ts) / ms * 1e3 if ms > 0 else None


@dataclass(frozen=True)
class AgentSummary:
    turns: int
    ok: int
    failed: int
    errors: dict[str, int]  # error text (cut at 120 characters) -> count
    wall_s: float
    prompt_tokens: int  # over the ok turns
    cached_tokens: int
    new_tokens: int
    completion_tokens: int
    forced_turns: int  # ok turns whose completion was exactly max_tokens
    not_forced: list[int]  # the ok turns that were not
    held: list[int]  # turns without a TTFT (the answer in one piece)
    cache_unknown: list[int]  # ok turns whose server gave no cached count
    prefill_tps: float | None  # Σ new tokens / Σ TTFT over the measured turns
    decode_tps: float | None  # Σ (completion - 1) / Σ (E2E - TTFT) over the measured turns
    ttft_s: float  # Σ TTFT of the measured turns
    decode_s: float  # Σ (E2E - TTFT) of the measured turns
    ttft: Dist
    ttft_max_s: float | None
    server_prefill_tps: float | None = None  # llama-server's timings: Σ prompt_n / Σ prompt_ms
    server_decode_tps: float | None = None  # Σ predicted_n / Σ predicted_ms


def summarize(turns: Sequence[TurnRecord]) -> AgentSummary:
    ok = [t for t in turns if t.ok]
    measured = [t for t in ok if t.measured and t.new_tokens is not None]
    wall = (max(t.sent_s + t.e2e_s for t in turns) - min(t.sent_s for t in turns)) if turns else 0.0
    ttft = sum(t.ttft_s for t in measured)
    dec = [t for t in measured if (t.completion_tokens or 0) >= 2]
    dec_s = sum(t.decode_s for t in dec)
    dec_n = sum(t.completion_tokens - 1 for t in dec)
    new = sum(t.new_tokens for t in measured)
    return AgentSummary(
        turns=len(turns), ok=len(ok), failed=len(turns) - len(ok),
        errors=dict(Counter((t.error or "?")[:120] for t in turns if not t.ok).most_common()),
        wall_s=wall,
        prompt_tokens=sum(t.prompt_tokens or 0 for t in ok),
        cached_tokens=sum(t.cached_tokens or 0 for t in ok),
        new_tokens=sum(t.new_tokens or 0 for t in ok),
        completion_tokens=sum(t.completion_tokens or 0 for t in ok),
        forced_turns=sum(t.forced for t in ok), not_forced=[t.turn for t in ok if not t.forced],
        held=[t.turn for t in ok if t.held],
        cache_unknown=[t.turn for t in ok if t.cached_tokens is None],
        prefill_tps=new / ttft if measured and ttft > 0 else None,
        decode_tps=dec_n / dec_s if dec and dec_s > 0 else None,
        ttft_s=ttft, decode_s=dec_s,
        ttft=Dist.of([t.ttft_s for t in measured]),
        ttft_max_s=max((t.ttft_s for t in measured), default=None),
        server_prefill_tps=_server_rate(ok, "prompt_n", "prompt_ms"),
        server_decode_tps=_server_rate(ok, "predicted_n", "predicted_ms"),
    )


@dataclass
class AgentReport:
    url: str
    model: str
    session: str
    tools_in_system: bool
    sampling: dict[str, Any]
    warmup_ok: int
    warmup_failed: int
    turns: list[TurnRecord] = field(default_factory=list)

    @property
    def summary(self) -> AgentSummary:
        return summarize(self.turns)

    @property
    def answers_sha256(self) -> str:
        """A digest of every turn's answer text in order (failed turns as null): two replays
        whose digests agree generated the same text, turn by turn."""
        texts = [t.text if t.ok else None for t in self.turns]
        return hashlib.sha256(json.dumps(texts).encode()).hexdigest()

    def to_json(self) -> dict[str, Any]:
        d = {k: v for k, v in asdict(self).items() if k != "turns"}
        d["summary"] = asdict(self.summary)
        d["answers_sha256"] = self.answers_sha256
        t0 = min((t.sent_s for t in self.turns), default=0.0)
        d["turns"] = [t.to_json(t0) for t in self.turns]
        return d


def _f(x: float | None, fmt: str = ".1f") -> str:
    return "-" if x is None else format(x, fmt)


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.1f}"


def _turns(xs: list[int]) -> str:
    return ", ".join(map(str, xs[:12])) + (f" (+{len(xs) - 12} more)" if len(xs) > 12 else "")


def markdown(report: AgentReport) -> str:
    """The summary line, the per-turn table and the notes."""
    s = report.summary
    how = "tools in the system prompt" if report.tools_in_system else "tools as recorded"
    sampling = ", ".join(f"{k}={v}" for k, v in report.sampling.items()) or "server defaults"
    lines = [
        (f"**{report.model}** at {report.url}: session {report.session}, {s.turns} turns one at "
         f"a time, streamed, answers forced to their recorded length (max_tokens + ignore_eos); "
         f"{how}; sampling: {sampling}"),
        "",
        ("| wall s | turns ok | prompt tok | cached tok | new tok | generated tok | prefill tok/s "
         "| decode tok/s | TTFT p50 ms | TTFT max ms |"),
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        (f"| {s.wall_s:.2f} | {s.ok}/{s.turns} | {s.prompt_tokens} | {s.cached_tokens} | "
         f"{s.new_tokens} | {s.completion_tokens} | {_f(s.prefill_tps)} | {_f(s.decode_tps)} | "
         f"{_ms(s.ttft.p50)} | {_ms(s.ttft_max_s)} |"),
        "",
        ("| turn | prompt | cached | new | generated / forced | TTFT ms | prefill tok/s | "
         "decode tok/s | E2E s |"),
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for t in report.turns:
        if not t.ok:
            lines.append(f"| {t.turn} | failed: {(t.error or '?')[:80]} | | | | | | | {t.e2e_s:.2f} |")
            continue
        gen = f"{t.completion_tokens} / {t.max_tokens}" + ("" if t.forced else " !")
        lines.append(
            f"| {t.turn} | {_f(t.prompt_tokens, 'd')} | {_f(t.cached_tokens, 'd')} | "
            f"{_f(t.new_tokens, 'd')} | {gen} | {'held' if t.held else _ms(t.ttft_s)} | "
            f"{_f(t.prefill_tps)} | {_f(t.decode_tps)} | {t.e2e_s:.2f} |")
    lines.append("")
    lines.append("prefill = new (uncached) prompt tokens / TTFT; decode = (generated - 1) / "
                 "(E2E - TTFT); both token-weighted over the turns (sums over sums).")
    lines.append(f"Answers' text: sha256 {report.answers_sha256[:16]} (equal digests: the same "
                 "text turn by turn).")
    if s.server_prefill_tps is not None or s.server_decode_tps is not None:
        lines.append(f"The server's own timings: prefill {_f(s.server_prefill_tps)} tok/s, "
                     f"decode {_f(s.server_decode_tps)} tok/s.")
    if s.not_forced:
        lines.append(f"Not forced to length (the server ended early; ignore_eos ignored?): "
                     f"turns {_turns(s.not_forced)}.")
    if s.held:
        lines.append(f"Answer sent in one piece at the end, no TTFT (left out of the rates): "
                     f"turns {_turns(s.held)}. A server that holds replies while tools are on "
                     "(or a reply that is a tool call, sent whole): --tools-in-system sends the "
                     "schemas as system-prompt text instead.")
    if s.cache_unknown:
        lines.append(f"No cached-token count from the server: turns {_turns(s.cache_unknown)} "
                     "(counted as all new).")
    if report.turns and report.turns[0].ok and (report.turns[0].cached_tokens or 0) > 0:
        lines.append("Turn 1 found cached tokens: the server still held an earlier replay's "
                     "prefix (restart it for a cold run).")
    if s.errors:
        lines.append("Failures: " + "; ".join(f"{n} x {e}" for e, n in s.errors.items()))
    return "\n".join(lines)
