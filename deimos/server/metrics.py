"""Server metrics: one ``Metrics`` object per server, written by the request handlers and the
engine worker, read by ``GET /metrics`` (Prometheus text) and the terminal dashboard.

Every method takes the lock; readers get copies (``snapshot``), never live containers.
"""

from __future__ import annotations

import os
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass, field

# seconds; the time-to-first-token histogram's upper bounds (Prometheus "le" labels)
TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
RECENT = 64  # finished requests kept for the "recent speeds" window


@dataclass(frozen=True, slots=True)
class Finished:
    """What one finished generation did (a ``RequestLog`` line's numbers)."""

    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    ttft_s: float  # queueing excluded: from the engine starting it to the first token
    prefill_tps: float  # prompt tokens actually computed (prompt - cached) per second
    decode_tps: float  # generated tokens after the first per second
    finish_reason: str


@dataclass(slots=True)
class Active:
    """The request the engine is working on now."""

    id: str
    prompt_tokens: int
    cached_tokens: int = 0
    generated: int = 0
    started: float = field(default_factory=time.monotonic)


class Metrics:
    def __init__(self, memory: dict[str, int] | None = None) -> None:
        self._lock = threading.Lock()
        self.started = time.time()
        self.requests: Counter[tuple[str, int]] = Counter()  # (route, HTTP status) -> count
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.generated_tokens = 0
        self.finish_reasons: Counter[str] = Counter()
        self.disconnects = 0
        self.ttft_buckets = [0] * len(TTFT_BUCKETS)  # non-cumulative counts per bucket
        self.ttft_over = 0  # above the last bucket
        self.ttft_sum = 0.0
        self.ttft_count = 0
        self.prefill_seconds = 0.0
        self.decode_seconds = 0.0
        self.prefill_computed = 0  # prompt tokens computed (not reused)
        self.decode_steps = 0
        self.recent: deque[Finished] = deque(maxlen=RECENT)
        self.active: Active | None = None
        self.queued = 0
        self._memory = dict(memory or {})  # static sizes: model weights, KV cache

    # ---- writers ---------------------------------------------------------------------

    def count_request(self, route: str, status: int) -> None:
        with self._lock:
            self.requests[(route, status)] += 1

    def set_queued(self, n: int) -> None:
        with self._lock:
            self.queued = n

    def start(self, request_id: str, prompt_tokens: int) -> None:
        with self._lock:
            self.active = Active(request_id, prompt_tokens)

    def progress(self, cached_tokens: int, generated: int) -> None:
        with self._lock:
            if self.active is not None:
                self.active.cached_tokens = cached_tokens
                self.active.generated = generated

    def finish(self, f: Finished, prefill_s: float, decode_s: float, disconnected: bool) -> None:
        with self._lock:
            self.active = None
            self.prompt_tokens += f.prompt_tokens
            self.cached_tokens += f.cached_tokens
            self.generated_tokens += f.completion_tokens
            self.finish_reasons[f.finish_reason] += 1
            self.disconnects += int(disconnected)
            if f.completion_tokens:
                i = next((i for i, b in enumerate(TTFT_BUCKETS) if f.ttft_s <= b), None)
                if i is None:
                    self.ttft_over += 1
                else:
                    self.ttft_buckets[i] += 1
                self.ttft_sum += f.ttft_s
                self.ttft_count += 1
                self.prefill_seconds += prefill_s
                self.prefill_computed += f.prompt_tokens - f.cached_tokens
                self.decode_seconds += decode_s
                self.decode_steps += max(f.completion_tokens - 1, 0)
            self.recent.append(f)

    # ---- readers ---------------------------------------------------------------------

    def memory(self) -> dict[str, int]:
        """Bytes by kind: the static sizes given at start plus the process's resident set."""
        out = dict(self._memory)
        out["process_rss"] = _rss_bytes()
        return out

    def recent_speeds(self) -> tuple[float, float]:
        """Mean prefill and decode tokens/s over the recent finished requests (0 if none)."""
        with self._lock:
            pre = [f.prefill_tps for f in self.recent if f.prefill_tps > 0]
            dec = [f.decode_tps for f in self.recent if f.decode_tps > 0]
        return (sum(pre) / len(pre) if pre else 0.0, sum(dec) / len(dec) if dec else 0.0)

    def snapshot(self) -> dict:
        """A consistent copy of everything, for the dashboard."""
        with self._lock:
            active = None
            if self.active is not None:
                a = self.active
                active = {"id": a.id, "prompt_tokens": a.prompt_tokens,
                          "cached_tokens": a.cached_tokens, "generated": a.generated,
                          "elapsed_s": time.monotonic() - a.started}
            snap = {
                "uptime_s": time.time() - self.started,
                "requests": {f"{r} {s}": n for (r, s), n in sorted(self.requests.items())},
                "prompt_tokens": self.prompt_tokens,
                "cached_tokens": self.cached_tokens,
                "generated_tokens": self.generated_tokens,
                "finish_reasons": dict(self.finish_reasons),
                "disconnects": self.disconnects,
                "queued": self.queued,
                "active": active,
                "ttft_mean_s": self.ttft_sum / self.ttft_count if self.ttft_count else 0.0,
            }
        snap["prefill_tps"], snap["decode_tps"] = self.recent_speeds()
        snap["memory"] = self.memory()
        return snap

    def prometheus(self) -> str:
        """The Prometheus text exposition format (version 0.0.4)."""
        lines: list[str] = []

        def metric(name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> None:
            lines.append(f"# HELP deimos_{name} {help_}")
            lines.append(f"# TYPE deimos_{name} {kind}")
            for labels, value in samples:
                lines.append(f"deimos_{name}{labels} {value:.17g}")

        mem = self.memory()
        pre_tps, dec_tps = self.recent_speeds()
        with self._lock:
            metric("requests_total", "counter", "HTTP requests by route and status",
                   [(f'{{route="{r}",status="{s}"}}', n) for (r, s), n in sorted(self.requests.items())])
            metric("prompt_tokens_total", "counter", "prompt tokens of finished generations",
                   [("", self.prompt_tokens)])
            metric("cached_tokens_total", "counter", "prompt tokens reused from the KV cache",
                   [("", self.cached_tokens)])
            metric("generated_tokens_total", "counter", "tokens generated",
                   [("", self.generated_tokens)])
            metric("finish_reason_total", "counter", "finished generations by finish reason",
                   [(f'{{reason="{k}"}}', v) for k, v in sorted(self.finish_reasons.items())])
            metric("client_disconnects_total", "counter", "generations stopped by a disconnect",
                   [("", self.disconnects)])
            metric("prefill_seconds_total", "counter", "seconds spent before first tokens",
                   [("", self.prefill_seconds)])
            metric("decode_seconds_total", "counter", "seconds spent decoding after first tokens",
                   [("", self.decode_seconds)])
            cum, samples = 0, []
            for b, n in zip(TTFT_BUCKETS, self.ttft_buckets):
                cum += n
                samples.append((f'_bucket{{le="{b}"}}', cum))
            samples.append(('_bucket{le="+Inf"}', cum + self.ttft_over))
            samples += [("_sum", self.ttft_sum), ("_count", self.ttft_count)]
            metric("time_to_first_token_seconds", "histogram",
                   "time from the engine taking a request to its first token", samples)
            metric("queue_depth", "gauge", "requests waiting for the engine", [("", self.queued)])
            metric("active_requests", "gauge", "requests being generated",
                   [("", int(self.active is not None))])
        metric("prefill_tokens_per_second", "gauge", "recent mean prefill speed", [("", pre_tps)])
        metric("decode_tokens_per_second", "gauge", "recent mean decode speed", [("", dec_tps)])
        metric("memory_bytes", "gauge", "memory by kind",
               [(f'{{kind="{k}"}}', v) for k, v in sorted(mem.items())])
        return "\n".join(lines) + "\n"


def _rss_bytes() -> int:
    try:
        with open(f"/proc/{os.getpid()}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        import resource  # not Linux: peak RSS is the best we have

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
