"""llama.cpp's best ``-ncmoe`` (``--n-cpu-moe N``: the routed experts of the first N layers stay
in host memory) for ``deimos bench --vs-llama`` on a MoE file, under the bench's memory limit.

Fewer CPU layers need more GPU memory, so feasibility is monotonic in N: every N from some
boundary up fits, every N below it runs out of memory. The search (``NcmoeSearch``, pure: it
proposes, the caller runs llama-bench and records) finds that boundary from a first guess
made from the file's bytes and the free memory (``first_guess``):

1. the guess; on a failure, up by ``step`` until a run fits (all N failing: none);
2. on a fit, down by ``step`` until a run fails or N reaches 0;
3. bisection between the highest failure and the lowest fit, to the boundary;
4. the boundary + ``confirm`` (2 and 4 by default): speed is not monotonic in N near the
   boundary (the issue's run: 33 best, 36 and 40 slower, 30 out of memory), so the next
   settings up are measured too. A boundary of 0 (every expert on the GPU) needs no
   confirmation: more experts on the CPU only add work.

Every run is one llama-bench process with its own warm-up and repetitions (deimos.bench.llama).
The best is the fastest decode (tg mean), ties broken by prefill; a different N with a faster
prefill is named beside it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from deimos.bench.stats import Spread

GIB = 1 << 30
STEP = 4
CONFIRM = (2, 4)
MAX_RUNS = 10
# what llama.cpp needs on the GPU beside the weights it keeps there: its CUDA context, the
# compute buffers of a 512-token batch, the KV of one pp512 + tg128 sequence, the allocator's
# slack (measured around 1.2 GiB on the 30B-A3B; a little more, so the guess tends to fit)
LLAMA_OVERHEAD = int(1.5 * GIB)
_EXPERT = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down|gate_up)_(ch)?exps\.")
NCMOE_FLAGS = ("-ncmoe", "--n-cpu-moe")


def expert_bytes_by_layer(tensors: Mapping[str, object], n_layer: int) -> list[int]:
    """Bytes of the routed experts of each layer (the tensors -ncmoe keeps on the host, by
    llama.cpp's pattern ``blk.N.ffn_(up|down|gate)_(ch|)exps``); ``tensors``: name -> an object
    with ``nbytes`` (GGUFFile.tensors)."""
    out = [0] * n_layer
    for name, info in tensors.items():
        m = _EXPERT.match(name)
        if m and int(m.group(1)) < n_layer:
            out[int(m.group(1))] += int(info.nbytes)
    return out


def first_guess(total_bytes: int, experts_by_layer: Sequence[int], free_bytes: int | None,
                overhead: int = LLAMA_OVERHEAD) -> int:
    """The fewest first layers whose experts must leave the GPU so that the rest of the file
    plus ``overhead`` fits in ``free_bytes`` (None: unknown, 0)."""
    if free_bytes is None:
        return 0
    need = total_bytes + overhead - free_bytes
    n = 0
    while need > 0 and n < len(experts_by_layer):
        need -= experts_by_layer[n]
        n += 1
    return n


@dataclass(frozen=True)
class NcmoeTry:
    """One llama-bench run at ``-ncmoe n``: its pp and tg tokens/s, or why it failed."""

    n: int
    prefill: Spread | None = None
    decode: Spread | None = None
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.decode is not None and self.prefill is not None

    def text(self) -> str:
        if not self.ok:
            return f"-ncmoe {self.n}: {self.error or 'failed'}"
        return (f"-ncmoe {self.n}: pp {self.prefill.mean:.1f}, tg {self.decode.mean:.2f} t/s")


def failure_reason(message: str) -> str:
    """A short reason from llama-bench's error text: "out of memory" when it says so."""
    low = message.lower()
    if any(s in low for s in ("out of memory", "failed to allocate", "cudamalloc",
                              "unable to allocate", "failed to load model")):
        return "out of memory"
    lines = [x.strip() for x in message.strip().splitlines() if x.strip()]
    return (lines[-1] if lines else "failed")[:160]


class NcmoeSearch:
    """Proposes the next ``-ncmoe`` to run from the runs recorded (module docstring)."""

    def __init__(self, n_layer: int, start: int, *, step: int = STEP,
                 confirm: Sequence[int] = CONFIRM, max_runs: int = MAX_RUNS) -> None:
        if n_layer < 1 or step < 1 or max_runs < 1:
            raise ValueError(f"NcmoeSearch: n_layer {n_layer}, step {step}, max_runs {max_runs}")
        self.n_layer = n_layer
        self.start = min(max(start, 0), n_layer)
        self.step = step
        self.confirm = tuple(confirm)
        self.max_runs = max_runs
        self.tried: list[NcmoeTry] = []

    def record(self, t: NcmoeTry) -> None:
        if any(x.n == t.n for x in self.tried):
            raise ValueError(f"NcmoeSearch: -ncmoe {t.n} recorded twice")
        self.tried.append(t)

    def boundary(self) -> int | None:
        """The fewest CPU layers known to fit with a failure (or 0) right below; None while
        unknown."""
        ok = [t.n for t in self.tried if t.ok]
        if not ok:
            return None
        low = min(ok)
        below = [t.n for t in self.tried if not t.ok and t.n < low]
        if low == 0 or (below and max(below) == low - 1):
            return low
        return None

    def next(self) -> int | None:
        """The next N to run, None when the search is over."""
        if len(self.tried) >= self.max_runs:
            return None
        if not self.tried:
            return self.start
        done = {t.n for t in self.tried}
        ok = [t.n for t in self.tried if t.ok]
        if not ok:
            top = max(done)
            return None if top >= self.n_layer else min(top + self.step, self.n_layer)
        edge = self.boundary()
        if edge is None:
            low = min(ok)
            below = [t.n for t in self.tried if not t.ok and t.n < low]
            if not below:
                return max(low - self.step, 0)
            return (max(below) + low) // 2
        if edge == 0:
            return None
        for c in self.confirm:
            n = edge + c
            if n <= self.n_layer and n not in done:
                return n
        return None

    def best(self) -> NcmoeTry | None:
        """The fastest decode among the runs that fit (ties: the faster prefill)."""
        ok = [t for t in self.tried if t.ok]
        if not ok:
            return None
        return max(ok, key=lambda t: (t.decode.mean, t.prefill.mean))

    def best_prefill(self) -> NcmoeTry | None:
        ok = [t for t in self.tried if t.ok]
        return max(ok, key=lambda t: (t.prefill.mean, t.decode.mean)) if ok else None

    def summary(self) -> str:
        """The runs in the order tried, for the report's method line."""
        return "; ".join(t.text() for t in self.tried)


def has_ncmoe(args: Sequence[str]) -> bool:
    """--llama-args already sets -ncmoe/--n-cpu-moe: then it is run as given, no search."""
    return any(a in NCMOE_FLAGS or a.startswith(tuple(f + "=" for f in NCMOE_FLAGS))
               for a in args)
