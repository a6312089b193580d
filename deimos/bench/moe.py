"""``deimos bench`` on a mixture-of-experts file: through ``deimos.LLM`` with its defaults, the
path that places the routed experts (on the GPU when they fit, else on the host behind the
elastic expert cache, deimos.models.gpu.offload), so the bench measures what a user gets with
no tuning flag.

Beside the speeds of the usual pp/tg rounds (deimos.bench.run.time_round) the report gives the
expert cache's numbers of each phase (slots, hit rate, CPU-computed experts per token-layer,
the missed experts the GPU read from host memory per token-layer, experts streamed for prefill,
promotions, resizes), counted over the timed rounds only; the
memory the engine saw (``--gpu-mem``: a helper process holds the rest of the card,
deimos.bench.memhold); with ``--vs-llama`` llama.cpp's best ``-ncmoe`` under the same limit
(deimos.bench.ncmoe); with ``--squeeze`` the replay of deimos.bench.squeeze.

Decode GB/s counts the bytes a token reads: everything but the routed experts, and of those
the ``n_expert_used / n_expert`` share (the experts a token is routed to).
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field

from rich.table import Table

from deimos.bench.ncmoe import expert_bytes_by_layer
from deimos.bench.squeeze import SqueezeTimeline
from deimos.bench.stats import BenchReport

log = logging.getLogger("deimos")

GIB = 1 << 30
# counters of the expert offload, summed over a phase (the rest are levels: slots, bytes)
COUNTERS = ("hits", "misses", "promotions", "cpu_experts", "host_read_experts", "streamed_experts",
            "tokens", "resizes", "share_moves")


def is_moe(file) -> bool:
    arch = file.metadata.get("general.architecture", "")
    return int(file.metadata.get(f"{arch}.expert_count", 0) or 0) > 0


def active_weight_bytes(file, dense_bytes: int, n_layer: int) -> int:
    """Weight bytes one decode token reads on a MoE file: ``dense_bytes`` (every matrix once,
    run.weight_bytes_per_token) with the routed experts counted at ``n_used / n_expert``."""
    arch = file.metadata.get("general.architecture", "")
    n_expert = int(file.metadata.get(f"{arch}.expert_count", 0) or 0)
    n_used = int(file.metadata.get(f"{arch}.expert_used_count", 0) or 0)
    if n_expert <= 0:
        return dense_bytes
    experts = sum(expert_bytes_by_layer(file.tensors, n_layer))
    return dense_bytes - experts + experts * n_used // n_expert


def snapshot(offload) -> dict[str, float]:
    """The offload's counters and levels now (None: every expert on the GPU -> {})."""
    if offload is None:
        return {}
    c = offload.cache.stats()
    s = offload.stats
    return {"slots": c["slots"], "bytes": c["bytes"], "hits": c["hits"], "misses": c["misses"],
            "promotions": c["promotions"], "cpu_experts": s.cpu_experts,
            "host_read_experts": s.host_read_experts, "streamed_experts": s.streamed_experts,
            "tokens": s.tokens, "resizes": s.resizes, "gpu_share": offload.gpu_share,
            "share_moves": offload.tuner.moves if offload.tuner is not None else 0}


def phase_numbers(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """The expert cache's numbers of the steps between two snapshots: the counters' sums, the
    hit rate and CPU experts per token-layer of those steps, the slots at the end."""
    if not after:
        return {}
    d = {k: after[k] - before.get(k, 0) for k in COUNTERS}
    looked = d["hits"] + d["misses"]
    d["hit_rate"] = d["hits"] / looked if looked else 0.0
    d["cpu_experts_per_token"] = d["cpu_experts"] / d["tokens"] if d["tokens"] else 0.0
    d["host_read_per_token"] = d["host_read_experts"] / d["tokens"] if d["tokens"] else 0.0
    d["slots"] = after["slots"]
    d["cache_gib"] = after["bytes"] / GIB
    d["gpu_share"] = after["gpu_share"]  # the device's share of the misses at the phase's end
    return d


def add_phase(total: dict[str, float], part: dict[str, float]) -> dict[str, float]:
    """Two phases' numbers as one (counters summed, rates recomputed, the later levels)."""
    if not part:
        return total
    if not total:
        return dict(part)
    out = {k: total[k] + part[k] for k in COUNTERS}
    looked = out["hits"] + out["misses"]
    out["hit_rate"] = out["hits"] / looked if looked else 0.0
    out["cpu_experts_per_token"] = out["cpu_experts"] / out["tokens"] if out["tokens"] else 0.0
    out["host_read_per_token"] = out["host_read_experts"] / out["tokens"] if out["tokens"] else 0.0
    out["slots"], out["cache_gib"], out["gpu_share"] = part["slots"], part["cache_gib"], part["gpu_share"]
    return out


@dataclass(frozen=True)
class MemorySeen:
    """The card as the engine saw it: ``limit_gib`` (--gpu-mem), what the helper holds, the free
    memory before the helper, when the engine loaded (NVML, every process) and after the load."""

    limit_gib: float | None
    total: int | None = None
    held: int | None = None
    free_before_hold: int | None = None
    free_at_load: int | None = None
    free_after_load: int | None = None


@dataclass
class LlamaSqueeze:
    """llama.cpp under the squeeze's limits: it cannot give memory back to a process that
    wants some, so what it runs at once the other program holds its share is a restart with
    more expert layers on the CPU: its best -ncmoe at the bench's limit and at that limit less
    the squeeze's take (the same helper process, holding and rewriting it). Decode t/s of each
    best; None where no setting fit."""

    take_gib: float
    before_ncmoe: int | None
    before_tps: float | None
    squeezed_ncmoe: int | None
    squeezed_tps: float | None
    tried: list[dict] = field(default_factory=list)  # the squeezed search's runs (NcmoeTry)
    notes: list[str] = field(default_factory=list)

    @property
    def kept(self) -> float | None:
        if not self.before_tps or self.squeezed_tps is None:
            return None
        return self.squeezed_tps / self.before_tps

    def lines(self) -> list[str]:
        def one(n: int | None, tps: float | None) -> str:
            if tps is None:
                return "no -ncmoe fit"
            return f"{tps:.2f} t/s (--llama-args' -ncmoe)" if n is None else f"-ncmoe {n}: {tps:.2f} t/s"

        kept = self.kept
        return [f"llama.cpp, restarted for each limit (it keeps its memory; without a restart the "
                f"other program's {self.take_gib:g} GiB are not there to take): "
                f"{one(self.before_ncmoe, self.before_tps)} before, "
                f"{one(self.squeezed_ncmoe, self.squeezed_tps)} with {self.take_gib:g} GiB less"
                + (f": kept {kept:.1%}" if kept is not None else ""), *self.notes]


@dataclass
class MoeBenchReport:
    """A MoE bench's report: the usual rounds (``base``; None for a squeeze replay), the
    experts' placement and numbers per phase, the memory, llama.cpp's -ncmoe runs, the squeeze."""

    model: str
    placement: str  # "gpu" (every expert on the device) or "offloaded (N of E slots a layer)"
    memory: MemorySeen
    base: BenchReport | None = None
    experts: dict[str, dict[str, float]] = field(default_factory=dict)  # phase -> numbers
    ncmoe: list[dict] = field(default_factory=list)  # NcmoeTry as dicts, in the order tried
    ncmoe_best: int | None = None
    squeeze: SqueezeTimeline | None = None
    llama_squeeze: LlamaSqueeze | None = None
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        d = {"model": self.model, "placement": self.placement, "memory": asdict(self.memory),
             "experts": self.experts, "ncmoe": self.ncmoe, "ncmoe_best": self.ncmoe_best,
             "notes": self.notes}
        if self.base is not None:
            d["bench"] = self.base.to_json()
        if self.squeeze is not None:
            d["squeeze"] = self.squeeze.to_json()
        if self.llama_squeeze is not None:
            d["llama_squeeze"] = {**asdict(self.llama_squeeze), "kept": self.llama_squeeze.kept}
        return d


def _gib(b: int | None) -> str:
    return "-" if b is None else f"{b / GIB:.2f} GiB"


def render_moe(r: MoeBenchReport) -> list:
    """The rich renderables of a MoE report, after the usual table (deimos.bench.table)."""
    from deimos.bench.table import render

    out: list = []
    if r.base is not None:
        out.append(render(r.base))
    m = r.memory
    limit = f"--gpu-mem {m.limit_gib:g}: a helper holds {_gib(m.held)}" if m.limit_gib else \
        "the whole card"
    out.append(f"{r.model}: routed experts {r.placement}; {limit}")
    mem = Table()
    for col in ("memory", "GiB"):
        mem.add_column(col, justify="left" if col == "memory" else "right")
    for name, v in (("card", m.total), ("free before the helper", m.free_before_hold),
                    ("free when the engine loaded", m.free_at_load),
                    ("free after the load", m.free_after_load)):
        if v is not None:
            mem.add_row(name, f"{v / GIB:.2f}")
    if mem.row_count:
        out.append(mem)
    if r.experts:
        t = Table(title="expert cache over the timed rounds (per layer; rates of the phase)")
        for col in ("phase", "slots", "GiB", "hit rate", "CPU experts/token", "GPU-read/token",
                    "device share", "share moves", "streamed", "promotions", "resizes"):
            t.add_column(col, justify="left" if col == "phase" else "right")
        for phase, n in r.experts.items():
            t.add_row(phase, str(int(n["slots"])), f"{n['cache_gib']:.2f}", f"{n['hit_rate']:.1%}",
                      f"{n['cpu_experts_per_token']:.2f}", f"{n.get('host_read_per_token', 0.0):.2f}",
                      f"{n.get('gpu_share', 0.0):.2f}", str(int(n.get("share_moves", 0))),
                      str(int(n["streamed_experts"])),
                      str(int(n["promotions"])), str(int(n["resizes"])))
        out.append(t)
    if r.ncmoe:
        t = Table(title="llama.cpp's -ncmoe search (in the order run)")
        for col in ("-ncmoe", "pp t/s", "tg t/s", ""):
            t.add_column(col, justify="right" if col != "" else "left")
        for x in r.ncmoe:
            ok = x.get("decode") is not None
            t.add_row(str(x["n"]), f"{x['prefill']['mean']:.1f}" if ok else "-",
                      f"{x['decode']['mean']:.2f}" if ok else "-",
                      "best" if x["n"] == r.ncmoe_best else ("" if ok else x.get("error", "")))
        out.append(t)
    if r.squeeze is not None:
        out.append(render_squeeze(r.squeeze))
    if r.llama_squeeze is not None:
        out.append("\n".join(r.llama_squeeze.lines()))
    if r.notes:
        out.append("\n".join(r.notes))
    return out


def render_squeeze(tl: SqueezeTimeline) -> Table:
    s = tl.summary()
    plan = tl.plan
    rel = (f", released before request {plan.release_before + 1}"
           if plan.release_before is not None else "")
    t = Table(title=f"squeeze: {plan.take_gib:g} GiB taken before request {plan.take_before + 1} "
                    f"of {plan.requests}{rel}")
    for col in ("request", "phase", "start s", "tg t/s", "slots start", "slots end"):
        t.add_column(col, justify="left" if col == "phase" else "right")
    for q in tl.requests:
        t.add_row(str(q.index + 1), q.phase, f"{q.start:.2f}", f"{q.tps:.2f}",
                  str(q.slots_start if q.slots_start is not None else "-"),
                  str(q.slots_end if q.slots_end is not None else "-"))
    lines = [f"decode before {s.before_tps:.2f} t/s, squeezed {s.squeezed_tps:.2f} t/s: kept "
             f"{s.kept:.1%}" + (f"; after the release {s.released_tps:.2f} t/s"
                                if s.released_tps is not None else ""),
             f"slots a layer: {s.slots_before} before, {s.slots_squeezed} at the fewest while "
             f"squeezed, {s.slots_end} at the end"
             + (f"; {s.slots_regrown} at the most after the release" if plan.release_before
                is not None else "")
             + ("" if s.regrow_s is None else f", back to {s.slots_before} {s.regrow_s:.2f} s "
                                              f"after it")]
    if s.taken_s is not None:
        lines.append(f"the helper held {_gib(s.held_bytes)} {s.taken_s:.2f} s after it started")
    elif plan.take_before < plan.requests:
        lines.append("the helper never said it held its memory")
    changes = []
    last = object()
    for x in tl.samples:
        if x.slots != last:
            changes.append(f"{x.t:.2f}s:{x.slots}")
            last = x.slots
    lines.append("slots over time (t:slots, at each change): " + " ".join(changes[:40])
                 + (" ..." if len(changes) > 40 else ""))
    for phase in ("before", "squeezed", "released"):  # what the sizing read (below headroom: shrink)
        m = [x for x in tl.samples if x.free is not None and plan.phase(x.request) == phase]
        if m:
            low = min(m, key=lambda x: x.free)
            lines.append(f"{phase}: free memory (the sizing's reader) at least {_gib(low.free)} "
                         f"(headroom {_gib(low.headroom)}) at {low.t:.2f}s")
    lines += [f"{e.t:.2f}s {e.what} {e.detail}".rstrip()
              for e in sorted(tl.events, key=lambda e: e.t)]
    t.caption = "\n".join(lines)
    return t
