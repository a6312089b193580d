"""Benchmarks that report physics: ``deimos bench`` (prefill/decode tokens/s, decode GB/s and
its share of the roof, optionally against llama-bench round by round)."""

from __future__ import annotations

from deimos.bench.run import H200_COPY_ROOF, BenchConfig, run_bench
from deimos.bench.stats import BenchReport, EngineResult, RoundTimes, Spread, summarize

__all__ = ["H200_COPY_ROOF", "BenchConfig", "BenchReport", "EngineResult", "RoundTimes", "Spread",
           "run_bench", "summarize"]
