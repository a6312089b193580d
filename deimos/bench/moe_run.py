"""The MoE bench's run (deimos.bench.moe says what it measures): llama.cpp's -ncmoe runs first,
alone, under the same memory helper (deimos.bench.ncmoe); then deimos.LLM with its defaults,
its warm-up round, and either the rounds (the expert cache's counters read between phases) or
the squeeze replay (deimos.bench.squeeze)."""

from __future__ import annotations

import logging
import os
from dataclasses import asdict

import torch

from deimos.bench.contention import ContentionCheck, Nvml
from deimos.bench.llama import llama_args
from deimos.bench.memhold import MemHold
from deimos.bench.moe import (
    LlamaSqueeze,
    MemorySeen,
    MoeBenchReport,
    active_weight_bytes,
    add_phase,
    phase_numbers,
    snapshot,
)
from deimos.bench.ncmoe import (
    NcmoeSearch,
    NcmoeTry,
    expert_bytes_by_layer,
    failure_reason,
    first_guess,
    has_ncmoe,
)
from deimos.bench.roof import copy_rate
from deimos.bench.run import (
    WARMUP_GEN,
    BenchConfig,
    _llama_alone,
    run_to_end,
    time_round,
    weight_bytes_per_token,
)
from deimos.bench.squeeze import SqueezePlan, drive
from deimos.bench.stats import BenchReport, EngineResult, RoundTimes, summarize
from deimos.engine.request import Request
from deimos.kernels.sampling import SamplingParams
from deimos.models.config import ModelConfig

log = logging.getLogger("deimos")

SQUEEZE_WARM_PROMPT = 16  # the squeeze's warm-up prompt (its requests have one token)


def _free_now(device: torch.device) -> tuple[int | None, int | None]:
    """(free, total) of the card through NVML (every process), else the CUDA runtime."""
    if device.type != "cuda":
        return None, None
    from deimos.runtime.gpu_memory import nvml_reader, torch_reader

    index = device.index or 0
    return (nvml_reader(index) or torch_reader(index))()


def _free_untouched(device: torch.device) -> int | None:
    """Free bytes of the card through NVML alone: this process must not create its CUDA
    context before llama-bench has run (it would take the context's memory from llama.cpp)."""
    if device.type != "cuda":
        return None
    try:
        import pynvml

        from deimos.runtime.gpu_memory import visible_device

        pynvml.nvmlInit()
        which = visible_device(device.index or 0, os.environ.get("CUDA_VISIBLE_DEVICES"))
        h = (pynvml.nvmlDeviceGetHandleByUUID(which) if isinstance(which, str)
             else pynvml.nvmlDeviceGetHandleByIndex(which))
        return int(pynvml.nvmlDeviceGetMemoryInfo(h).free)
    except Exception:  # noqa: BLE001 - no pynvml or driver: the search starts at 0
        return None


def search_llama(cfg: BenchConfig, path, file, n_layer: int, nvml: Nvml | None,
                 ours: frozenset[int], free: int | None
                 ) -> tuple[EngineResult | None, int, list[str], NcmoeSearch | None]:
    """llama.cpp's best -ncmoe (or the one --llama-args gives): (the best run as the report's
    llama.cpp engine, runs refused, notes, the search)."""
    args = llama_args(cfg.llama_args)
    if has_ncmoe(args):
        res, refused, notes, _ = _llama_alone(cfg, path, nvml, args, ours)
        notes.append("-ncmoe from --llama-args: no search")
        if res is not None:
            res, r, more = pinned_variant(cfg, path, nvml, args, ours, res)
            refused, notes = refused + r, notes + more
        return res, refused, notes, None
    experts = expert_bytes_by_layer(file.tensors, n_layer)
    search = NcmoeSearch(n_layer, first_guess(file.file_size, experts, free))
    refused = 0
    notes: list[str] = []
    results: dict[int, EngineResult] = {}
    while (n := search.next()) is not None:
        log.info("bench: llama-bench -ncmoe %d", n)
        res, r, _, error = _llama_alone(cfg, path, nvml, [*args, "-ncmoe", str(n)], ours)
        refused += r
        if res is None and not error:  # refused (other GPU processes), not failed: stop here
            notes.append(f"-ncmoe search stopped at {n}: llama-bench refused (another GPU process)")
            break
        if res is None:
            search.record(NcmoeTry(n, error=failure_reason(error)))
        else:
            results[n] = res
            search.record(NcmoeTry(n, res.prefill, res.decode))
    best = search.best()
    if best is None:
        notes.append(f"llama.cpp: no -ncmoe fit ({search.summary() or 'none run'})")
        return None, refused, notes, search
    top = results[best.n]
    method = f"{top.method} -ncmoe {best.n}: the best of {len(search.tried)} tried ({search.summary()})"
    fastest_pp = search.best_prefill()
    if fastest_pp is not None and fastest_pp.n != best.n:
        notes.append(f"llama.cpp's fastest prefill was at -ncmoe {fastest_pp.n} "
                     f"({fastest_pp.prefill.mean:.1f} t/s); the table's is the best decode's")
    top = EngineResult("llama.cpp", top.prefill, top.decode, method)
    top, r, more = pinned_variant(cfg, path, nvml, [*args, "-ncmoe", str(best.n)], ours, top)
    return top, refused + r, notes + more, search


LOAD_MODE_FLAGS = ("-lm", "--load-mode", "-mmp", "--mmap")
PINNED = ("-lm", "none")  # llama-bench: the weights read into a (pinned) host copy, not mmap'd


def pinned_variant(cfg: BenchConfig, path, nvml: Nvml | None, args: list[str],
                   ours: frozenset[int], top: EngineResult) -> tuple[EngineResult, int, list[str]]:
    """llama.cpp's best setting once more with its weights in a pinned host copy (``-lm
    none``) instead of mmap'd file pages (llama-bench's default), unless ``args`` choose a load
    mode: the CPU layers' experts that its prompt batches copy to the GPU (op offload) then go
    at the bus's speed. Each test's number is the faster mode's (measured on H100s: -lm none
    pp512 ~1,750 against mmap's ~420, while mmap's decode was up to 4% faster). Returns (the
    result, runs refused, notes)."""
    if any(a in LOAD_MODE_FLAGS for a in args):
        return top, 0, []
    res, refused, _, error = _llama_alone(cfg, path, nvml, [*args, *PINNED], ours)
    if res is None:
        why = failure_reason(error) if error else "refused (another GPU process)"
        return top, refused, [f"llama.cpp with -lm none: {why}; the table's is mmap's"]
    both = (f"-lm none pp {res.prefill.mean:.1f}, tg {res.decode.mean:.2f} t/s; mmap pp "
            f"{top.prefill.mean:.1f}, tg {top.decode.mean:.2f}")
    best, mode = faster_each(top, res)
    return best, refused, [f"llama.cpp's load modes: {both}: the table's each test's faster ({mode})"]


def faster_each(mmap: EngineResult, pinned: EngineResult) -> tuple[EngineResult, str]:
    """llama.cpp's result with each test from the load mode that ran it faster (a user picks
    the mode for the work), and which: "mmap", "-lm none", or the two named per test."""
    pp_none, tg_none = pinned.prefill.mean > mmap.prefill.mean, pinned.decode.mean > mmap.decode.mean
    mode = {(True, True): "-lm none", (False, False): "mmap"}.get(
        (pp_none, tg_none), f"pp {'-lm none' if pp_none else 'mmap'}, tg {'-lm none' if tg_none else 'mmap'}")
    method = mmap.method if mode == "mmap" else f"{mmap.method}; load mode {mode}"
    return EngineResult("llama.cpp", pinned.prefill if pp_none else mmap.prefill,
                        pinned.decode if tg_none else mmap.decode, method), mode


def run_moe_bench(cfg: BenchConfig, path, file, nvml: Nvml | None, before: list,
                  hold: MemHold | None, ours: frozenset[int]) -> MoeBenchReport:
    from deimos.engine.llm import LLM

    mcfg = ModelConfig.from_gguf(file.metadata, source=str(path), tensors=file.tensors)
    device = torch.device(cfg.device)
    held = hold.held if hold is not None else None
    # the free memory llama-bench will see: the helper's reading once it held the rest
    free = held.free_after if held is not None else _free_untouched(device)
    theirs, refused, notes, search = None, 0, [], None
    if cfg.vs_llama:
        theirs, refused, notes, search = search_llama(cfg, path, file, mcfg.n_layer, nvml, ours,
                                                      free)
    llama_squeeze = None
    if cfg.vs_llama and cfg.squeeze:  # llama.cpp again, the squeeze's take held (before we load)
        llama_squeeze = squeezed_llama(cfg, path, file, mcfg.n_layer, nvml, ours, theirs, search)
    free_at_load, total = _free_now(device)
    n_ctx = (SQUEEZE_WARM_PROMPT if cfg.squeeze else cfg.n_prompt) + cfg.n_gen + 1
    llm = LLM(path, device=cfg.device, n_ctx=n_ctx, max_seqs=1, max_batch_tokens=512,
              prefix_cache=False)
    free_after_load, _ = _free_now(device)
    off = llm.offload
    placement = (f"on the {device.type.upper()}" if off is None else
                 f"offloaded ({off.cache.n_slots} of {off.n_expert} slots a layer at load)")
    memory = MemorySeen(cfg.gpu_mem, total, held.held if held else None,
                        held.free_before if held else None, free_at_load, free_after_load)
    engine = llm.engine
    gen = torch.Generator().manual_seed(cfg.seed)
    time_round(engine, SQUEEZE_WARM_PROMPT if cfg.squeeze else cfg.n_prompt, WARMUP_GEN, device,
               gen)
    check = ContentionCheck.from_snapshots(before, nvml.processes() if nvml else [], os.getpid())
    check = ContentionCheck(check.own | ours)
    others = check.others(nvml.processes()) if nvml is not None else []
    report = MoeBenchReport(path.name, placement, memory, notes=notes, llama_squeeze=llama_squeeze)
    if off is not None and off.calibrated_share is not None:
        report.notes.append(f"the device's share of a decode step's misses: {off.calibrated_share:.2f} "
                            "calibrated at load, then tuned while decoding (the table: its value at "
                            "each phase's end, and the tuner's moves)")
    if off is not None and off.calibrated_rates is not None:  # this host's bus and cores
        dev, cpu = off.calibrated_rates
        report.notes.append(f"this host at load: the device read experts from host memory at "
                            f"{dev / 1e9:.1f} GB/s, the CPU computed them at {cpu / 1e9:.1f} GB/s "
                            f"({off.cpu.n_threads} ggml threads)")
    if search is not None:
        report.ncmoe = [asdict(t) for t in search.tried]
        best = search.best()
        report.ncmoe_best = best.n if best else None
    if cfg.squeeze:
        if others:
            report.notes.append("other GPU processes before the replay: "
                                + ", ".join(str(p.pid) for p in others))
        if off is None:
            report.notes.append(f"every routed expert is {placement} (no expert cache): the "
                                "helper's memory comes out of free memory only; give --gpu-mem "
                                "to squeeze the cache")
        report.squeeze = _squeeze(cfg, llm, device, gen)
        return report

    phases: dict[str, dict[str, float]] = {}
    mark = [snapshot(off)]

    def between(phase: str) -> None:
        now = snapshot(off)
        phases[phase] = add_phase(phases.get(phase, {}), phase_numbers(mark[0], now))
        mark[0] = now

    rounds: list[RoundTimes] = []
    for r in range(cfg.rounds):
        busy = check.others(nvml.processes()) if nvml is not None else []
        if busy:
            log.warning("bench: deimos round refused: other GPU processes %s",
                        ", ".join(str(p.pid) for p in busy))
            refused += 1
            continue
        mark[0] = snapshot(off)
        rounds.append(time_round(engine, cfg.n_prompt, cfg.n_gen, device, gen, between))
        log.info("bench: round %d deimos: pp %.1f t/s, tg %.1f t/s", r, rounds[-1].prefill_tps,
                 rounds[-1].decode_tps)
    report.experts = {k: v for k, v in phases.items() if v}  # none without an expert cache
    roof, roof_note = ((cfg.roof, "--roof") if cfg.roof is not None else
                       (copy_rate(device), f"copy rate measured on this {device.type.upper()}"))
    lim = f" with --gpu-mem {cfg.gpu_mem:g}" if cfg.gpu_mem else ""
    method = (f"deimos.LLM defaults (experts {placement}){lim}, CUDA graphs captured, 1 warm-up "
              f"round (pp{cfg.n_prompt} + tg{WARMUP_GEN}) not reported, then {len(rounds)} rounds"
              + (f" of {cfg.rounds}" if len(rounds) != cfg.rounds else "")
              + (", after llama.cpp's runs" if cfg.vs_llama else ""))
    engines = [summarize("deimos", rounds, method)]
    if theirs is not None:
        engines.append(theirs)
    dense = weight_bytes_per_token(file, cfg.device)
    report.base = BenchReport(
        model=path.name, device=str(device), n_prompt=cfg.n_prompt, n_gen=cfg.n_gen,
        rounds=cfg.rounds, weight_bytes=active_weight_bytes(file, dense, mcfg.n_layer), roof=roof,
        engines=engines, refused=refused, notes=[], roof_source=roof_note,
        contention=("checked" if nvml.available else f"not checked: {nvml.error}") if nvml
        else "not applicable (CPU)")
    return report


def squeezed_llama(cfg: BenchConfig, path, file, n_layer: int, nvml: Nvml | None,
                   ours: frozenset[int], before: EngineResult | None,
                   search: NcmoeSearch | None, make_hold=None) -> LlamaSqueeze:
    """llama.cpp's best -ncmoe again while a second helper holds the squeeze's take (and
    rewrites it, as in our replay): what llama.cpp runs at when another program holds that
    memory (deimos.bench.moe.LlamaSqueeze). ``before``/``search``: the search at the bench's
    own limit. ``make_hold``: the helper's factory (tests)."""
    plan = SqueezePlan.of(cfg.squeeze_requests, cfg.release)
    hold = (make_hold or (lambda: MemHold(take_gib=plan.take_gib, rewrite_ms=plan.rewrite_ms,
                                          device=cfg.device)))()
    best = search.best() if search is not None else None
    out = LlamaSqueeze(plan.take_gib, best.n if best else None,
                       before.decode.mean if before is not None else None, None, None)
    with hold:
        try:
            held = hold.wait_ready()
        except RuntimeError as e:
            out.notes.append(f"llama.cpp's squeezed search not run: the helper failed ({e})")
            return out
        mine = ours | {hold.pid} if hold.pid is not None else ours
        after, _, notes, s2 = search_llama(cfg, path, file, n_layer, nvml, mine, held.free_after)
    out.notes += [f"squeezed: {n}" for n in notes]
    if after is not None:
        b2 = s2.best() if s2 is not None else None
        out.squeezed_ncmoe = b2.n if b2 else None
        out.squeezed_tps = after.decode.mean
    if s2 is not None:
        out.tried = [asdict(t) for t in s2.tried]
    return out


def _squeeze(cfg: BenchConfig, llm, device: torch.device, gen: torch.Generator):
    plan = SqueezePlan.of(cfg.squeeze_requests, cfg.release)
    engine = llm.engine
    n_vocab = llm.config.n_vocab
    greedy = SamplingParams(temperature=0.0)
    off = llm.offload

    def run_request(i: int, after_step) -> int:
        tok = int(torch.randint(0, n_vocab, (1,), generator=gen))
        made = run_to_end(engine, Request([tok], cfg.n_gen, greedy), after_step)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return made

    def slots() -> int | None:
        return None if off is None else off.cache.n_slots

    def make_hold() -> MemHold:
        return MemHold(take_gib=plan.take_gib, rewrite_ms=plan.rewrite_ms, device=str(device))

    def memory() -> tuple[int | None, int | None]:
        if off is None or off.sizer is None:
            return None, None
        return off.memory.free(), off.sizer.headroom

    return drive(plan, run_request, slots, make_hold, memory=memory)
