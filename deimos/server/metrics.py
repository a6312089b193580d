"""Server metrics: one ``Metrics`` object per server, written by the request handlers and the
engine worker (every request the engine has taken, by id; the engine's batch and KV pool
after each step), read by ``GET /metrics`` (prometheus_client's exposition of a registry of the
server's own, never the process-global one) and the terminal dashboard.

Every method takes the lock; readers get copies (``snapshot``), never live containers.
"""

from __future__ import annotations

import os
import threading
import time
from collections import Counter, deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

if TYPE_CHECKING:  # the engine's module pulls in torch; the dashboard's tests need none
    from deimos.engine.engine import EngineStats

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
    """A request (one choice) the engine has taken: waiting for its first step or running."""

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
        self.active: dict[str, Active] = {}  # by request id, in the order they started
        self.engine: EngineStats | None = None  # the engine after its last step
        self.queued = 0
        self._memory = dict(memory or {})  # static sizes: model weights, KV cache
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Collector(self))

    # ---- writers ---------------------------------------------------------------------

    def count_request(self, route: str, status: int) -> None:
        with self._lock:
            self.requests[(route, status)] += 1

    def set_queued(self, n: int) -> None:
        with self._lock:
            self.queued = n

    def set_engine(self, stats: EngineStats) -> None:
        """The engine's numbers after a step (the worker calls this every step: an assignment)."""
        with self._lock:
            self.engine = stats

    def start(self, request_id: str, prompt_tokens: int) -> None:
        with self._lock:
            self.active[request_id] = Active(request_id, prompt_tokens)

    def progress(self, request_id: str, cached_tokens: int, generated: int) -> None:
        with self._lock:
            a = self.active.get(request_id)
            if a is not None:
                a.cached_tokens = cached_tokens
                a.generated = generated

    def finish(self, request_id: str, f: Finished, prefill_s: float, decode_s: float,
               disconnected: bool) -> None:
        with self._lock:
            self.active.pop(request_id, None)
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
        """Bytes by kind: the static sizes given at start plus the process's resident set and,
        once CUDA is in use, torch's allocated and reserved (cached) GPU memory."""
        out = dict(self._memory)
        out["process_rss"] = _rss_bytes()
        import torch

        if torch.cuda.is_initialized():
            out["gpu_allocated"] = torch.cuda.memory_allocated()
            out["gpu_reserved"] = torch.cuda.memory_reserved()
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
            now = time.monotonic()
            active = [{"id": a.id, "prompt_tokens": a.prompt_tokens,
                       "cached_tokens": a.cached_tokens, "generated": a.generated,
                       "elapsed_s": now - a.started} for a in self.active.values()]
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
                "engine": None if self.engine is None else engine_numbers(self.engine),
                "prefill_computed": self.prefill_computed,
                "ttft_mean_s": self.ttft_sum / self.ttft_count if self.ttft_count else 0.0,
            }
        snap["prefill_tps"], snap["decode_tps"] = self.recent_speeds()
        snap["memory"] = self.memory()
        return snap

    def prometheus(self) -> bytes:
        """``/metrics``: the Prometheus text exposition of this server's registry."""
        return generate_latest(self.registry)


class _Collector(Collector):
    """``Metrics``' numbers as Prometheus families, read under its lock at scrape time (a
    custom collector: the counts live in one place, which the dashboard reads too)."""

    def __init__(self, m: Metrics) -> None:
        self.m = m

    def collect(self) -> Iterator[Metric]:
        m = self.m
        mem = m.memory()
        pre_tps, dec_tps = m.recent_speeds()

        def counter(name: str, help_: str, value: float) -> CounterMetricFamily:
            return CounterMetricFamily(f"deimos_{name}", help_, value=value)

        def gauge(name: str, help_: str, value: float) -> GaugeMetricFamily:
            return GaugeMetricFamily(f"deimos_{name}", help_, value=value)

        with m._lock:
            requests = CounterMetricFamily("deimos_requests", "HTTP requests by route and status",
                                           labels=["route", "status"])
            for (route, status), n in sorted(m.requests.items()):
                requests.add_metric([route, str(status)], n)
            reasons = CounterMetricFamily("deimos_finish_reason",
                                          "finished generations by finish reason",
                                          labels=["reason"])
            for reason, n in sorted(m.finish_reasons.items()):
                reasons.add_metric([reason], n)
            cum, buckets = 0, []
            for bound, n in zip(TTFT_BUCKETS, m.ttft_buckets):
                cum += n
                buckets.append((str(bound), cum))
            buckets.append(("+Inf", cum + m.ttft_over))
            families = [
                requests,
                counter("prompt_tokens", "prompt tokens of finished generations",
                        m.prompt_tokens),
                counter("cached_tokens", "prompt tokens reused from the KV cache",
                        m.cached_tokens),
                counter("generated_tokens", "tokens generated", m.generated_tokens),
                reasons,
                counter("client_disconnects", "generations stopped by a disconnect",
                        m.disconnects),
                counter("prefill_seconds", "seconds spent before first tokens",
                        m.prefill_seconds),
                counter("decode_seconds", "seconds spent decoding after first tokens",
                        m.decode_seconds),
                HistogramMetricFamily(
                    "deimos_time_to_first_token_seconds",
                    "time from the engine taking a request to its first token",
                    buckets=buckets, sum_value=m.ttft_sum),
                gauge("queue_depth", "requests waiting for the engine", m.queued),
                gauge("active_requests", "requests (choices) the engine has taken",
                      len(m.active)),
            ]
            engine = m.engine
        if engine is not None:
            e = engine_numbers(engine)
            families += [
                gauge("running_sequences", "sequences in the running batch", e["running"]),
                gauge("waiting_sequences", "sequences waiting for a batch slot or KV blocks",
                      e["waiting"]),
                gauge("kv_blocks_used", "KV blocks held by sequences", e["kv_blocks_used"]),
                gauge("kv_blocks_free", "KV blocks that can be handed out (free or cached)",
                      e["kv_blocks_free"]),
                gauge("kv_blocks_cached", "free KV blocks holding a reusable prefix",
                      e["kv_blocks_cached"]),
                gauge("kv_block_size", "tokens per KV block", e["block_size"]),
                gauge("prefix_cache_hit_rate", "prompt tokens found in the prefix cache over "
                      "prompt tokens looked up", e["prefix_hit_rate"]),
                counter("prefix_cache_hit_tokens", "prompt tokens found in the prefix cache",
                        e["prefix_hit_tokens"]),
                counter("prefix_cache_query_tokens", "prompt tokens looked up in the prefix "
                        "cache", e["prefix_query_tokens"]),
                counter("preemptions", "sequences preempted (KV blocks dropped, recomputed "
                        "later) for want of KV blocks, or after a step ran out of device memory",
                        e["preemptions"]),
                counter("spec_drafted_tokens", "speculative drafts verified", e["spec_drafted"]),
                counter("spec_accepted_tokens", "speculative drafts accepted",
                        e["spec_accepted"]),
                gauge("spec_acceptance_rate", "speculative drafts accepted over drafts verified",
                      e["spec_acceptance_rate"]),
                counter("spec_verify_steps", "engine steps that verified drafts",
                        e["spec_verify_steps"]),
                gauge("tokens_per_step", "tokens a sequence's step chose, on average (1 without "
                      "speculative decoding)", e["tokens_per_step"]),
            ]
            for name, value in sorted((e["experts"] or {}).items()):  # an offloaded MoE model
                families.append(gauge(name, EXPERT_HELP.get(name, name.replace("_", " ")), value))
        families += [
            gauge("prefill_tokens_per_second", "recent mean prefill speed", pre_tps),
            gauge("decode_tokens_per_second", "recent mean decode speed", dec_tps),
        ]
        memory = GaugeMetricFamily("deimos_memory_bytes", "memory by kind", labels=["kind"])
        for kind, n in sorted(mem.items()):
            memory.add_metric([kind], n)
        families.append(memory)
        yield from families


EXPERT_HELP = {
    "expert_slots": "GPU expert cache slots a MoE layer",
    "expert_cache_bytes": "GPU memory of the expert cache",
    "expert_hit_rate": "routed experts found in the GPU cache over experts routed",
    "cpu_experts_per_token": "routed experts computed on the CPU per token and layer",
    "expert_promotions": "experts copied into the GPU cache",
    "expert_resizes": "times the expert cache changed size (free GPU memory)",
    "streamed_experts": "experts copied to the GPU for one prompt chunk (not cached)",
    "host_read_experts": "missed experts a decode step's kernels read from host memory over PCIe",
    "gpu_share": "share of a decode step's missed experts the GPU reads (calibrated at load)",
}


def engine_numbers(st: EngineStats) -> dict[str, float]:
    """The engine's stats as plain numbers, with the prefix cache's hit rate, the drafts'
    acceptance rate and the tokens a sequence's step chose."""
    q = st.prefix_query_tokens
    return {"running": st.running, "waiting": st.waiting, "kv_blocks_used": st.kv_blocks_used,
            "kv_blocks_free": st.kv_blocks_free, "kv_blocks_cached": st.kv_blocks_cached,
            "block_size": st.block_size, "prefix_hit_tokens": st.prefix_hit_tokens,
            "prefix_query_tokens": q, "prefix_hit_rate": st.prefix_hit_tokens / q if q else 0.0,
            "preemptions": st.preemptions, "experts": dict(st.experts) if st.experts else None,
            "spec_drafted": st.spec_drafted, "spec_accepted": st.spec_accepted,
            "spec_acceptance_rate": st.spec_accepted / st.spec_drafted if st.spec_drafted else 0.0,
            "spec_verify_steps": st.spec_verify_steps,
            "tokens_per_step": st.tokens_chosen / st.token_rows if st.token_rows else 0.0}


def _rss_bytes() -> int:
    try:
        with open(f"/proc/{os.getpid()}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        import resource  # not Linux: peak RSS is the best we have

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
