"""Records and statistics of ``deimos bench serve`` (pure: no network, no clock).

Latencies, as vLLM's benchmark_serving counts them:
- TTFT: request sent -> the first delta that carries content (text, or a reasoning model's
  ``reasoning_content``); a role-only or empty delta is not content.
- ITL: the gaps between consecutive content deltas. A delta that carries several tokens (a
  server may merge tokens, e.g. while a UTF-8 character is incomplete) counts its gap once;
  ``tokens_per_delta`` says how often that happened.
- TPOT: per request, (E2E - TTFT) / (completion tokens - 1): the mean time per output token
  after the first, immune to how tokens were grouped into deltas.
- E2E: request sent -> the stream's end.
A level's wall time runs from its first request sent to its last one finished; output
tokens/s = the completion tokens of its successful requests / that wall time.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) by linear interpolation between the closest ranks (numpy's
    default method)."""
    if not values:
        raise ValueError("percentile: no values")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile: q must be in [0, 100], got {q}")
    s = sorted(values)
    rank = q / 100 * (len(s) - 1)
    lo = math.floor(rank)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (rank - lo)


@dataclass(frozen=True)
class Dist:
    """p50, p95, p99, mean and count of a latency (seconds); None where there was no sample."""

    p50: float | None
    p95: float | None
    p99: float | None
    mean: float | None
    n: int

    @classmethod
    def of(cls, values: Sequence[float]) -> Dist:
        if not values:
            return cls(None, None, None, None, 0)
        return cls(percentile(values, 50), percentile(values, 95), percentile(values, 99),
                   sum(values) / len(values), len(values))


@dataclass(slots=True)
class RequestRecord:
    """One request, as the client saw it. Times in seconds; ``sent_s`` from perf_counter."""

    level: int  # the concurrency it ran at
    index: int
    warmup: bool
    sent_s: float
    ok: bool = False
    error: str | None = None  # "HTTP 503: ...", "broken stream: ...", "timed out after ...", ...
    status: int | None = None
    ttft_s: float | None = None
    e2e_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    n_deltas: int = 0  # deltas that carried content
    usage_completion_tokens: int | None = None
    prompt_tokens: int | None = None  # usage.prompt_tokens
    finish_reason: str | None = None
    response_id: str | None = None  # the stream's "id": the server's logs name it
    constrained: bool = False  # sent with a JSON schema (bench serve --constrained)

    @property
    def completion_tokens(self) -> int:
        """usage.completion_tokens, or without usage the number of content deltas."""
        if self.usage_completion_tokens is not None:
            return self.usage_completion_tokens
        return self.n_deltas

    @property
    def tpot_s(self) -> float | None:
        n = self.completion_tokens
        if self.ttft_s is None or n < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (n - 1)

    def to_json(self, t0: float) -> dict:
        d = asdict(self)
        d["sent_s"] = self.sent_s - t0  # from the level's first request
        d["completion_tokens"] = self.completion_tokens
        d["tokens_from_usage"] = self.usage_completion_tokens is not None
        d["tpot_s"] = self.tpot_s
        return d


@dataclass(frozen=True)
class LevelSummary:
    concurrency: int
    requests: int
    ok: int
    failed: int
    errors: dict[str, int]  # error text (cut at 120 characters) -> count
    wall_s: float
    output_tokens: int
    prompt_tokens: int
    output_tps: float
    total_tps: float  # (prompt + completion tokens) / wall time
    mean_prompt_tokens: float | None
    tokens_from_usage: int  # requests whose completion tokens came from usage
    tokens_per_delta: float | None  # completion tokens / content deltas (1.0: one per delta)
    ttft: Dist
    itl: Dist
    tpot: Dist
    e2e: Dist
    warmup_ok: int = 0
    warmup_failed: int = 0
    plain: LevelSummary | None = None  # with constrained requests: the plain ones' alone
    constrained: LevelSummary | None = None  # and the constrained ones' alone


def summarize_level(concurrency: int, records: Sequence[RequestRecord],
                    warmup: Sequence[RequestRecord] = (), wall: float | None = None) -> LevelSummary:
    """The level's statistics over its measured (not warm-up) requests; where some were
    constrained, also over the plain ones alone (``plain``: their tokens over their own span,
    from the first sent to the last finished: a constrained request, a token every other step,
    can end the level after the plain ones, and their rate is not to count that tail), and
    over the constrained ones alone (``constrained``: their own inter-token gaps).
    ``wall``: the time the rates are taken over (default: the records')."""
    if wall is None:
        wall = (max(r.sent_s + r.e2e_s for r in records) - min(r.sent_s for r in records)
                if records else 0.0)
    plain = constrained = None
    if any(r.constrained for r in records) and not all(r.constrained for r in records):
        plain = summarize_level(concurrency, [r for r in records if not r.constrained])
        constrained = summarize_level(concurrency, [r for r in records if r.constrained])
    ok = [r for r in records if r.ok]
    failed = [r for r in records if not r.ok]
    out = sum(r.completion_tokens for r in ok)
    prompt = [r.prompt_tokens for r in ok if r.prompt_tokens is not None]
    deltas = sum(r.n_deltas for r in ok)
    errors = Counter((r.error or "?")[:120] for r in failed)
    return LevelSummary(
        concurrency=concurrency, requests=len(records), ok=len(ok), failed=len(failed),
        errors=dict(errors.most_common()), wall_s=wall, output_tokens=out,
        prompt_tokens=sum(prompt),
        output_tps=out / wall if wall > 0 else 0.0,
        total_tps=(out + sum(prompt)) / wall if wall > 0 else 0.0,
        mean_prompt_tokens=sum(prompt) / len(prompt) if prompt else None,
        tokens_from_usage=sum(1 for r in ok if r.usage_completion_tokens is not None),
        tokens_per_delta=out / deltas if deltas else None,
        ttft=Dist.of([r.ttft_s for r in ok if r.ttft_s is not None]),
        itl=Dist.of([g for r in ok for g in r.itl_s]),
        tpot=Dist.of([t for r in ok if (t := r.tpot_s) is not None]),
        e2e=Dist.of([r.e2e_s for r in ok]),
        warmup_ok=sum(1 for r in warmup if r.ok),
        warmup_failed=sum(1 for r in warmup if not r.ok),
        plain=plain,
        constrained=constrained,
    )


@dataclass(frozen=True)
class Calibration:
    """The prompt length search: (words, usage.prompt_tokens) of each probe request."""

    words: int  # words per prompt chosen
    probes: list[tuple[int, int]]
    note: str | None = None  # why it could not do better (a failed probe, a template too long)


@dataclass
class ServeReport:
    url: str
    model: str
    endpoint: str  # "chat" | "completions"
    prompt_tokens: int  # the target
    max_tokens: int
    seed: int
    sampling: dict  # the sampling fields sent (empty: each server's own defaults)
    calibration: Calibration
    levels: list[LevelSummary] = field(default_factory=list)
    records: list[RequestRecord] = field(default_factory=list)

    def to_json(self) -> dict:
        d = {k: v for k, v in asdict(self).items() if k != "records"}
        # times from each level's first measured request (warm-up ones come out negative)
        starts: dict[int, float] = {}
        for r in self.records:
            if not r.warmup:
                starts[r.level] = min(starts.get(r.level, r.sent_s), r.sent_s)
        for r in self.records:
            starts.setdefault(r.level, r.sent_s)
        d["records"] = [r.to_json(starts[r.level]) for r in self.records]
        return d


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.1f}"


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def markdown(report: ServeReport) -> str:
    """The report as a markdown table, with a few lines on what was measured and how."""
    cal = report.calibration
    prompt = [lv.mean_prompt_tokens for lv in report.levels if lv.mean_prompt_tokens is not None]
    measured = f", measured mean {sum(prompt) / len(prompt):.1f}" if prompt else ""
    sampling = (", ".join(f"{k}={v}" for k, v in report.sampling.items())
                or "none sent (each server's defaults)")
    lines = [
        (f"**{report.model}** at {report.url} ({report.endpoint}, streamed, ignore_eos): prompt "
         f"{report.prompt_tokens} tokens target ({cal.words} random words{measured}), "
         f"max_tokens {report.max_tokens}; sampling: {sampling}"),
        "",
        ("| concurrency | ok | failed | wall s | out tok/s | total tok/s | TTFT p50 ms | "
         "TTFT p95 ms | ITL p50 ms | ITL p95 ms | TPOT p50 ms | E2E p50 s |"),
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for lv in report.levels:
        for name, row in ((str(lv.concurrency), lv),
                          (f"{lv.concurrency} (plain only)", lv.plain),
                          (f"{lv.concurrency} (constrained only)", lv.constrained)):
            if row is None:
                continue
            lines.append(
                f"| {name} | {row.ok} | {row.failed} | {row.wall_s:.2f} | {row.output_tps:.1f} | "
                f"{row.total_tps:.1f} | {_ms(row.ttft.p50)} | {_ms(row.ttft.p95)} | "
                f"{_ms(row.itl.p50)} | {_ms(row.itl.p95)} | {_ms(row.tpot.p50)} | "
                f"{_s(row.e2e.p50)} |")
    lines.append("")
    lines.append("ITL: gaps between content deltas; a delta carrying several tokens counts its "
                 "gap once (as vLLM's benchmark_serving). TPOT: (E2E - TTFT) / (tokens - 1).")
    merged = [f"c={lv.concurrency}: {lv.tokens_per_delta:.2f}" for lv in report.levels
              if lv.tokens_per_delta is not None and lv.tokens_per_delta > 1.005]
    if merged:
        lines.append(f"Tokens per delta above 1 ({'; '.join(merged)}): ITL overstates the "
                     "per-token gap there; TPOT does not.")
    for lv in report.levels:
        if lv.errors:
            shown = "; ".join(f"{n} x {e}" for e, n in lv.errors.items())
            lines.append(f"c={lv.concurrency} failures: {shown}")
        if lv.ok and lv.tokens_from_usage < lv.ok:
            lines.append(f"c={lv.concurrency}: {lv.ok - lv.tokens_from_usage} request(s) without "
                         "usage: their tokens are counted as deltas")
    if cal.note:
        lines.append(f"calibration: {cal.note}")
    return "\n".join(lines)
