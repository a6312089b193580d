"""Benchmarks that report physics: ``deimos bench`` (prefill/decode tokens/s, decode GB/s and
its share of the roof, optionally beside llama-bench) and ``deimos bench serve`` (an
OpenAI-compatible server's throughput and latencies at several concurrencies).

The names below load on first use: ``deimos bench serve`` (deimos.bench.serve) is a plain HTTP
client and must not pull torch and the engine in with the package.
"""

from __future__ import annotations

from importlib import import_module

_EXPORTS = {"H200_COPY_ROOF": "run", "BenchConfig": "run", "run_bench": "run",
            "BenchReport": "stats", "EngineResult": "stats", "RoundTimes": "stats",
            "Spread": "stats", "summarize": "stats"}

__all__ = ["H200_COPY_ROOF", "BenchConfig", "BenchReport", "EngineResult", "RoundTimes", "Spread",
           "run_bench", "summarize"]


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(import_module(f"deimos.bench.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'deimos.bench' has no attribute {name!r}")
