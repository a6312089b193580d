"""``deimos bench``: prefill and decode tokens/s of the GPU engine, round by round, optionally
beside llama-bench on the same file; no round is reported while another process uses the GPU.

With ``--vs-llama`` each engine is measured in its own best conditions, one after the other,
never interleaved (interleaving single llama-bench rounds with ours was measured to understate
llama.cpp's prefill by half): first llama-bench alone, before this process touches the GPU,
in one run with its own warm-up and ``llama_reps`` repetitions (deimos.bench.llama), the GPU
watched for other processes while it runs; then Deimos: graphs captured, one warm-up round,
then ``rounds`` rounds, each after the contention check. Both report mean ± sd and the best.

A round, as llama-bench's pp/tg tests: prefill = ``n_prompt`` random tokens into an empty
cache (in the engine's steps of 512); decode = ``n_gen`` single-token steps from an empty
cache, each step's greedy token read back and fed to the next, as generation does. Both go
through the engine (deimos.engine.Engine), so on CUDA they replay its graphs (captured before the first
round, deimos.runtime.graph); the timed prefill includes the host copy of its tokens. Times are wall clock between
device synchronizations. Decode bandwidth counts the file's weight bytes read per token
(every matrix once; the token embedding only if it is also the output projection).

A mixture-of-experts file, or ``--squeeze``, runs through ``deimos.LLM`` instead
(deimos.bench.moe_run: the expert cache's numbers, llama.cpp's -ncmoe search, the squeeze
replay; docs/bench-moe.md). ``--gpu-mem GiB``: a helper process (deimos.bench.memhold) holds
all but GiB of the card from before anything loads (llama-bench included) to the end.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from deimos.bench.contention import ContentionCheck, Nvml
from deimos.bench.llama import llama_args, run_llama_bench
from deimos.bench.memhold import MemHold
from deimos.bench.roof import copy_rate
from deimos.bench.stats import BenchReport, EngineResult, RoundTimes, Spread, summarize
from deimos.engine.engine import Engine, EngineConfig
from deimos.engine.request import Request
from deimos.gguf import GGUFFile
from deimos.kernels.sampling import SamplingParams

log = logging.getLogger("deimos")

H200_COPY_ROOF = 4.3e12  # B/s: device-to-device copy measured on the H200 (read + write)
LLAMA_ATTEMPTS = 2  # llama-bench runs tried when another GPU process spoils one
WARMUP_GEN = 4  # decode steps of Deimos's warm-up round


@dataclass(frozen=True)
class BenchConfig:
    model: str
    n_prompt: int = 512
    n_gen: int = 128
    rounds: int = 3
    device: str = "cuda"
    roof: float | None = None  # B/s; None: the device's copy rate, measured (bench/roof.py)
    vs_llama: str | None = None  # path of llama-bench
    seed: int = 0
    llama_args: str | None = None  # llama-bench's flags; None: DEFAULT_LLAMA_ARGS (-ngl 99 -fa 1)
    llama_reps: int | None = None  # llama-bench's -r; None: max(rounds, 5)
    gpu_mem: float | None = None  # GiB the engine (and llama-bench) may see: a helper holds the rest
    squeeze: bool = False  # MoE: the squeeze replay (deimos.bench.squeeze) instead of the rounds
    release: bool = False  # squeeze: the helper gives its memory back mid-run
    squeeze_requests: int = 8

    def __post_init__(self) -> None:
        for name in ("n_prompt", "n_gen", "rounds"):
            if getattr(self, name) <= 0:
                raise ValueError(f"bench: {name} must be positive, got {getattr(self, name)}")
        if self.roof is not None and self.roof <= 0:
            raise ValueError(f"bench: --roof must be positive, got {self.roof}")
        if self.llama_reps is not None and self.llama_reps <= 0:
            raise ValueError(f"bench: llama_reps must be positive, got {self.llama_reps}")
        llama_args(self.llama_args)  # a flag deimos sets itself fails here, before any load
        if self.gpu_mem is not None and self.gpu_mem <= 0:
            raise ValueError(f"bench: --gpu-mem must be positive, got {self.gpu_mem}")
        if self.gpu_mem is not None and torch.device(self.device).type != "cuda":
            raise ValueError("bench: --gpu-mem needs a CUDA device")
        if self.release and not self.squeeze:
            raise ValueError("bench: --release is a variant of --squeeze")
        if self.squeeze and self.vs_llama and self.gpu_mem is None:
            raise ValueError("bench: --squeeze with --vs-llama needs --gpu-mem (llama.cpp's best "
                             "-ncmoe is searched at that limit and at that limit less the take)")
        if self.squeeze:
            from deimos.bench.squeeze import SqueezePlan

            SqueezePlan.of(self.squeeze_requests, self.release)  # too few requests fail here

    @property
    def reps_llama(self) -> int:
        return self.llama_reps if self.llama_reps is not None else max(self.rounds, 5)


def weight_bytes_per_token(file: GGUFFile, device: str = "cuda") -> int:
    """Weight bytes a decode step reads: the file's (quantized) bytes on a GPU, which keeps
    them so; float32 on the CPU, whose reference path dequantizes every weight at load."""
    tied = "output.weight" not in file.tensors
    read = [i for n, i in file.tensors.items() if tied or n != "token_embd.weight"]
    if torch.device(device).type == "cpu":
        return sum(i.n_elements * 4 for i in read)
    return sum(i.nbytes for i in read)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_to_end(engine, req: Request, after_step=None) -> int:
    """Step ``engine`` until ``req``'s sequence finishes (``after_step()`` after each step);
    returns the tokens it made. An engine error for it is raised."""
    seq = engine.add(req)
    made = 0
    while not seq.finished:
        for out in engine.step():
            if out.error is not None:
                raise out.error
            made += out.seq is seq
        if after_step is not None:
            after_step()
    return made


def time_round(engine: Engine, n_prompt: int, n_gen: int, device: torch.device,
               rng: torch.Generator,
               between: Callable[[str], None] | None = None) -> RoundTimes:
    """Prefill ``n_prompt`` random tokens into an empty cache (a request of one output token,
    in the engine's steps of at most 512 tokens), then a greedy request of one random token
    that makes ``n_gen`` tokens (``n_gen`` forward steps, stop tokens ignored), through the
    engine's own paths (its graphs and the device sampling on CUDA): what a user's request
    runs. The prefix cache is off (every round computes its whole prompt). ``between(phase)``
    is called after each phase ("prefill", "decode"), outside the timed spans (the MoE bench
    reads the expert cache's counters there)."""
    n_vocab = engine.model.config.n_vocab
    tokens = torch.randint(0, n_vocab, (n_prompt,), generator=rng).tolist()
    greedy = SamplingParams(temperature=0.0)

    def run(req: Request) -> int:
        return run_to_end(engine, req)

    _sync(device)
    t0 = time.perf_counter()
    run(Request(tokens, 1, greedy))
    _sync(device)
    t1 = time.perf_counter()
    if between is not None:
        between("prefill")
    req = Request([int(torch.randint(0, n_vocab, (1,), generator=rng))], n_gen, greedy)
    _sync(device)
    t2 = time.perf_counter()
    made = run(req)
    _sync(device)
    t3 = time.perf_counter()
    if between is not None:
        between("decode")
    if made != n_gen:
        raise RuntimeError(f"bench: the decode round made {made} tokens, not {n_gen}")
    return RoundTimes(t1 - t0, t3 - t2, n_prompt, n_gen)


def intruders(seen: set[int], child_pid: int) -> set[int]:
    """The GPU processes seen while llama-bench ran that were not llama-bench. NVML shows the
    child's PID unless we run in a container (host PIDs); then one new process is taken for
    it, and any more are others'."""
    if child_pid in seen:
        return seen - {child_pid}
    return seen if len(seen) > 1 else set()


def _watcher(nvml: Nvml, seen: set[int]) -> Callable[[], None]:
    """A callable that adds the GPU's compute processes of the moment (but this one) to
    ``seen``."""
    mine = os.getpid()

    def watch() -> None:
        try:
            seen.update(p.pid for p in nvml.processes() if p.pid != mine)
        except Exception as e:  # noqa: BLE001 - an NVML hiccup: the other samples decide
            log.debug("bench: NVML sample failed: %s", e)

    return watch


def _llama_alone(cfg: BenchConfig, path, nvml: Nvml | None, args: list[str] | None = None,
                 ignore: frozenset[int] = frozenset()) -> tuple[EngineResult | None, int,
                                                                list[str], str]:
    """llama-bench in one run of its own, before this process touches the GPU: (its result or
    None, runs refused, notes, its error text if it failed). ``args``: its flags (default
    --llama-args); ``ignore``: GPU processes that are the bench's own (the --gpu-mem helper)."""
    args = llama_args(cfg.llama_args) if args is None else args
    reps = cfg.reps_llama
    refused = 0
    notes: list[str] = []
    mine = os.getpid()
    for attempt in range(LLAMA_ATTEMPTS):
        if attempt:
            time.sleep(5.0)
        if nvml is not None:
            busy = [p.pid for p in nvml.processes() if p.pid != mine and p.pid not in ignore]
            if busy:
                log.warning("bench: llama.cpp run refused: other GPU processes %s",
                            ", ".join(map(str, busy)))
                refused += 1
                continue
        seen: set[int] = set()
        watch = _watcher(nvml, seen) if nvml is not None and nvml.available else None
        try:
            run = run_llama_bench(cfg.vs_llama, path, cfg.n_prompt, cfg.n_gen, reps, args, watch)
            prefill, decode = Spread.of(run.prefill_ts), Spread.of(run.decode_ts)
        except (RuntimeError, ValueError, OSError) as e:
            # our rounds still count; the report says why llama.cpp has none
            log.error("bench: llama-bench: %s", e)
            notes.append(f"llama-bench failed: {str(e)[:300]}")
            return None, refused, notes, str(e)
        others = intruders(seen - ignore, run.pid)
        if others:
            log.warning("bench: llama.cpp run refused: other GPU processes %s appeared while it "
                        "ran", ", ".join(map(str, sorted(others))))
            refused += 1
            continue
        warm = ("no warm-up (--no-warmup)" if "--no-warmup" in args
                else "its own warm-up run per test")
        method = (f"llama-bench {run.build}, one run alone before Deimos loaded: {warm}, "
                  f"{reps} repetitions, flags {' '.join(args) or '(none)'}")
        return EngineResult("llama.cpp", prefill, decode, method), refused, notes, ""
    notes.append(f"llama-bench: no run without another GPU process in {LLAMA_ATTEMPTS} tries")
    return None, refused, notes, ""


def render_report(report) -> list:
    """The rich renderables of ``run_bench``'s report (a BenchReport or a MoeBenchReport)."""
    from deimos.bench.moe import MoeBenchReport, render_moe
    from deimos.bench.table import render

    return render_moe(report) if isinstance(report, MoeBenchReport) else [render(report)]


def hold_memory(cfg: BenchConfig, nvml: Nvml | None) -> tuple[MemHold | None, frozenset[int]]:
    """--gpu-mem: the helper process holding all but ``gpu_mem`` GiB of the card's free memory,
    started and holding (None without --gpu-mem), and its PIDs as NVML shows them (a container
    shows host PIDs: then the processes that appeared while it started)."""
    if cfg.gpu_mem is None:
        return None, frozenset()
    before = {p.pid for p in nvml.processes()} if nvml is not None else set()
    hold = MemHold(leave_gib=cfg.gpu_mem, device=cfg.device).start()
    try:
        held = hold.wait_ready()
        log.info("bench: --gpu-mem %g: a helper (pid %d) holds %.2f GiB, %.2f GiB left free",
                 cfg.gpu_mem, hold.pid, held.held / 2**30, held.free_after / 2**30)
        now = {p.pid for p in nvml.processes()} if nvml is not None else set()
    except BaseException:
        hold.close()
        raise
    return hold, frozenset({hold.pid} if hold.pid in now else now - before)


def run_bench(cfg: BenchConfig) -> BenchReport:
    """The rounds (and llama-bench beside them): a dense file loaded directly; a MoE file, or
    --squeeze, through deimos.LLM (deimos.bench.moe_run), which returns a MoeBenchReport. With
    --gpu-mem the memory helper runs from before anything loads to the end, whatever happens."""
    from deimos.registry import resolve

    on_gpu = torch.device(cfg.device).type == "cuda"
    nvml = Nvml() if on_gpu else None  # other processes are checked on a GPU only
    if nvml is not None and not nvml.available:
        log.warning("bench: GPU contention is not checked: %s", nvml.error)
    before = nvml.processes() if nvml is not None else []
    path = resolve(cfg.model)
    file = GGUFFile(path)
    from deimos.bench.moe import is_moe

    if cfg.squeeze and cfg.vs_llama and not is_moe(file):
        raise ValueError(f"bench: {path.name} has no routed experts: --squeeze --vs-llama compares "
                         "llama.cpp's -ncmoe settings (run --squeeze alone on a dense file)")
    hold, ours = hold_memory(cfg, nvml)
    try:
        if is_moe(file) or cfg.squeeze:
            from deimos.bench.moe_run import run_moe_bench

            return run_moe_bench(cfg, path, file, nvml, before, hold, ours)
        return _run_dense(cfg, path, file, nvml, before, ours)
    finally:
        if hold is not None:
            hold.close()


def _run_dense(cfg: BenchConfig, path, file: GGUFFile, nvml: Nvml | None, before: list,
               ours: frozenset[int]) -> BenchReport:
    from deimos.models import load_model

    theirs: EngineResult | None = None
    refused = 0
    notes: list[str] = []
    if cfg.vs_llama:
        theirs, refused, notes, _ = _llama_alone(cfg, path, nvml, ignore=ours)
    device = torch.device(cfg.device)
    model = load_model(file, device=cfg.device)
    gen = torch.Generator().manual_seed(cfg.seed)
    engine = Engine(model, EngineConfig(n_ctx=cfg.n_prompt + cfg.n_gen + 1, max_seqs=1,
                                           max_batch_tokens=512, prefix_cache=False))
    engine.warm()  # captures the graphs (compiling every kernel they run)
    # warm-up round (the eager kernels of a path without graphs compile here), not reported
    time_round(engine, cfg.n_prompt, WARMUP_GEN, device, gen)
    if cfg.roof is not None:
        roof, roof_note = cfg.roof, "--roof"
    else:
        roof, roof_note = copy_rate(device), f"copy rate measured on this {device.type.upper()}"
    check = ContentionCheck.from_snapshots(before, nvml.processes() if nvml else [], os.getpid())
    check = ContentionCheck(check.own | ours)

    def idle(what: str) -> bool:
        if nvml is None:
            return True
        others = check.others(nvml.processes())
        if others:
            log.warning("bench: %s round refused: other GPU processes %s", what,
                        ", ".join(str(p.pid) for p in others))
        return not others

    ours: list[RoundTimes] = []
    for r in range(cfg.rounds):
        if idle("deimos"):
            ours.append(time_round(engine, cfg.n_prompt, cfg.n_gen, device, gen))
            log.info("bench: round %d deimos: pp %.1f t/s, tg %.1f t/s", r, ours[-1].prefill_tps,
                     ours[-1].decode_tps)
        else:
            refused += 1
    graphs = "CUDA graphs captured, " if device.type == "cuda" else ""
    method = (f"{graphs}1 warm-up round (pp{cfg.n_prompt} + tg{WARMUP_GEN}) not reported, then "
              f"{len(ours)} rounds" + (f" of {cfg.rounds}" if len(ours) != cfg.rounds else "")
              + (", after llama.cpp's run" if cfg.vs_llama else ""))
    engines = [summarize("deimos", ours, method)]
    if theirs is not None:
        engines.append(theirs)
    return BenchReport(
        model=path.name, device=str(device), n_prompt=cfg.n_prompt, n_gen=cfg.n_gen,
        rounds=cfg.rounds, weight_bytes=weight_bytes_per_token(file, cfg.device), roof=roof,
        engines=engines, refused=refused, notes=notes, roof_source=roof_note,
        contention=("checked" if nvml.available else f"not checked: {nvml.error}") if nvml
        else "not applicable (CPU)",
    )
