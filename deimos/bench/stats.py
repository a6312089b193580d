"""Round statistics and the result records of ``deimos bench`` (pure: no timing, no device)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class Spread:
    """Tokens/s over rounds: mean, sample standard deviation (0 for one round), min, max (the
    best round), and the rounds' values in order."""

    mean: float
    std: float
    min: float
    max: float
    n: int
    values: tuple[float, ...] = ()

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread:
        if not values:
            raise ValueError("Spread.of: no values (every round was refused?)")
        if any(not math.isfinite(v) or v <= 0 for v in values):
            raise ValueError(f"Spread.of: rates must be finite and positive, got {list(values)}")
        n = len(values)
        mean = sum(values) / n
        var = sum((v - mean) ** 2 for v in values) / (n - 1) if n > 1 else 0.0
        return cls(mean, math.sqrt(var), min(values), max(values), n, tuple(values))

    @property
    def best(self) -> float:
        return self.max

    def text(self) -> str:
        return f"{self.mean:.2f} ± {self.std:.2f}"


@dataclass(frozen=True)
class RoundTimes:
    """One round of one engine: prefill of ``n_prompt`` tokens and decode of ``n_gen``."""

    prefill_s: float
    decode_s: float
    n_prompt: int
    n_gen: int

    @property
    def prefill_tps(self) -> float:
        return self.n_prompt / self.prefill_s

    @property
    def decode_tps(self) -> float:
        return self.n_gen / self.decode_s


@dataclass(frozen=True)
class EngineResult:
    engine: str  # "deimos" | "llama.cpp"
    prefill: Spread
    decode: Spread
    method: str = ""  # how it was measured: warm-up, repetitions, flags


@dataclass(frozen=True)
class BenchReport:
    model: str
    device: str
    n_prompt: int
    n_gen: int
    rounds: int
    weight_bytes: int  # bytes of the model's weights read per decoded token
    roof: float  # B/s
    engines: list[EngineResult]
    refused: int = 0  # rounds not reported: another process was using the GPU
    # "checked", "not checked: <why>" or "not applicable (CPU)"
    contention: str = "checked"
    notes: list[str] = field(default_factory=list)
    roof_source: str = "--roof"  # or "copy rate measured on this GPU/CPU"

    def decode_bandwidth(self, r: EngineResult) -> float:
        """Achieved B/s of decode: weight bytes per token x tokens/s."""
        return self.weight_bytes * r.decode.mean

    def ratios(self) -> dict[str, float] | None:
        """deimos / llama.cpp, when both ran: of the mean t/s ("prefill", "decode") and of the
        best round's ("prefill_best", "decode_best")."""
        by = {e.engine: e for e in self.engines}
        if "deimos" not in by or "llama.cpp" not in by:
            return None
        a, b = by["deimos"], by["llama.cpp"]
        return {"prefill": a.prefill.mean / b.prefill.mean, "decode": a.decode.mean / b.decode.mean,
                "prefill_best": a.prefill.best / b.prefill.best,
                "decode_best": a.decode.best / b.decode.best}

    def to_json(self) -> dict:
        d = asdict(self)
        for e, r in zip(d["engines"], self.engines):
            bw = self.decode_bandwidth(r)
            e["decode_bytes_per_s"] = bw
            e["decode_roof_share"] = bw / self.roof
        d["ratios"] = self.ratios()
        return d


def summarize(engine: str, rounds: Sequence[RoundTimes], method: str = "") -> EngineResult:
    return EngineResult(engine, Spread.of([r.prefill_tps for r in rounds]),
                        Spread.of([r.decode_tps for r in rounds]), method)
