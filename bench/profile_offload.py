"""Where an offloaded MoE decode token goes: the model loaded once with its routed experts on
the host (deimos.models.gpu.offload), then for each cache size of ``--slots`` (experts a layer
on the GPU; the cache fixed there, warmed by the decode before the timing) greedy decode
tokens timed plainly, then again under cProfile: the host time of the offload's parts (the
wait for the route, the CPU experts and their ggml graphs, the activation quantization, the
hits' launches, promotions, the combine) per token, and the hit rate of the timed tokens.

    python bench/profile_offload.py MODEL.gguf [--slots 0,46,128] [-n 32] [-p 64] [--top 25]
        [--shares auto,0] [--cpu pool,nopool,planes2,twographs] [--split minimax,round]

``--cpu``: the CPU side of each run: "pool" the engine's (ggml's threads made once,
offload.CPU_PLANES activation planes), "nopool" ggml making its threads each compute (the
engine before the pool), "planes1" / "planes2" / "planes3" one (llama.cpp's arithmetic), two
or three activation planes (more exact), "twographs" one plane in the two-graph layout with
the planes made in Python (the engine before _GgmlFused), "tN" the engine's with N ggml
threads; "auto" shares are calibrated again for each. ``--split``: the device's count of a
layer's misses from the share, the engine's "minimax" (offload.device_count) or "round"
(share x misses rounded, the engine before).

A measurement, not a test. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import cProfile
import logging
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from deimos.engine import LLM  # noqa: E402
from deimos.engine.request import Request  # noqa: E402
from deimos.kernels.sampling import SamplingParams  # noqa: E402
from deimos.models.gpu.offload import device_count  # noqa: E402
from deimos.runtime.cpu_experts import CpuExperts  # noqa: E402
from deimos.runtime.share_tuner import ShareTuner  # noqa: E402

# (label, function name as cProfile names it, a file it is in)
PARTS = (("offload.moe (eager steps)", "moe", "offload.py"),
         ("serve_step (graph steps)", "serve_step", "offload.py"),
         ("  wait for the device's post", "wait_posted", "host_mailbox.py"),
         ("  answer a layer", "_answer", "offload.py"),
         ("wait for route + copies", "synchronize", "streams.py"),
         ("cpu experts (all)", "__call__", "cpu_experts.py"),
         ("  ggml compute", "_compute", "cpu_experts.py"),
         ("  activation planes", "quantize", "cpu_experts.py"),
         ("hits enqueue", "_hits", "offload.py"),
         ("route enqueue", "route", "moe_ops.py"),
         ("to host", "_to_host", "offload.py"),
         ("record", "record", "expert_cache.py"),
         ("promote: claims", "claim", "expert_cache.py"),
         ("promote: the step's copy", "start_batch", "expert_cache.py"),
         ("combine", "moe_combine", "moe_route.py"),
         ("between steps", "between_steps", "offload.py"))


class Timers:
    """Wall time of a few offload functions (perf_counter around each call, ~1 us a call: far
    less than cProfile's cost on every Python call), patched in for one timed run."""

    TARGETS = (("host: a step's layers (serve_step)", "deimos.models.gpu.offload", "ExpertOffload", "serve_step"),
               ("host: wait for the device's post", "deimos.runtime.host_mailbox", "HostMailbox", "wait_posted"),
               ("host: answer a layer", "deimos.models.gpu.offload", "ExpertOffload", "_answer"),
               ("  cpu experts (all)", "deimos.runtime.cpu_experts", "CpuExperts", "__call__"),
               ("  cpu experts (token)", "deimos.runtime.cpu_experts", "CpuExperts", "token"),
               ("    planes (token)", "deimos.runtime.cpu_experts", "_Planes", "quantize_into"),
               ("    ggml compute", "deimos.runtime.cpu_experts", "_GgmlPlan", "_compute"),
               ("    activation planes", "deimos.runtime.cpu_experts", "_Planes", "quantize"),
               ("  promote: claims (in the layers)", "deimos.runtime.expert_cache", "ExpertCache", "claim"),
               ("promote: the step's copy (after them)", "deimos.runtime.expert_cache", "ExpertCache", "start_batch"),
               ("eager moe (prompt)", "deimos.models.gpu.offload", "ExpertOffload", "moe"))

    def __init__(self):
        import importlib

        self.total = {label: 0.0 for label, *_ in self.TARGETS}
        self.calls = dict.fromkeys(self.total, 0)
        self._saved = []
        for label, mod, cls, name in self.TARGETS:
            c = getattr(importlib.import_module(mod), cls)
            fn = getattr(c, name)
            self._saved.append((c, name, fn))
            setattr(c, name, self._wrap(label, fn))

    def _wrap(self, label, fn):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.total[label] += time.perf_counter() - t0
                self.calls[label] += 1
        return timed

    def close(self) -> None:
        for c, name, fn in self._saved:
            setattr(c, name, fn)


# the device's count of m missed experts at a share: the engine's, and rounding (before it)
SPLITS = {"minimax": device_count,
          "round": lambda m, share: int(m * share + 0.5) if share > 0 else 0}


def decode(llm: LLM, prompt: int, n: int, seed: int) -> tuple[float, int, float]:
    """(seconds, tokens) of n greedy decode tokens after a prompt of ``prompt`` tokens, and the
    prompt's seconds (to its first token)."""
    eng = llm.engine
    g = torch.Generator().manual_seed(seed)
    req = Request(torch.randint(0, llm.config.n_vocab, (prompt,), generator=g).tolist(), n + 2,
                  SamplingParams(temperature=0))
    torch.cuda.synchronize()
    tp = time.perf_counter()
    eng.add(req)
    while len(req.output_ids) < 1:
        eng.step()
    torch.cuda.synchronize()
    tp = time.perf_counter() - tp
    while len(req.output_ids) < 2:  # the prompt and the first token
        eng.step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    n0 = len(req.output_ids)
    while eng.has_work:
        eng.step()
    torch.cuda.synchronize()
    return time.perf_counter() - t0, len(req.output_ids) - n0, tp


def parts(stats: pstats.Stats, tokens: int) -> list[tuple[str, float, int]]:
    """(label, ms a token, calls a token) of each of PARTS: the outermost function of that name
    (nested ones of the same name are inside its time)."""
    out = []
    for label, fn, where in PARTS:
        cum, calls = 0.0, 0
        for (file, _, name), (_, nc, _, ct, _) in stats.stats.items():
            if ((name == fn and file.endswith(where)) or (file == where == "~" and f"'{fn}'" in name)) \
                    and ct > cum:
                cum, calls = ct, nc
        out.append((label, cum * 1e3 / tokens, calls // max(tokens, 1)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--slots", default="0,46,128", help="experts a layer on the GPU, one run each")
    ap.add_argument("-n", type=int, default=32, help="decode tokens a run")
    ap.add_argument("-p", type=int, default=64, help="prompt tokens")
    ap.add_argument("--top", type=int, default=20, help="cProfile's top functions by own time")
    ap.add_argument("--shares", default="auto,0", help="the device's share of the misses a run "
                    "(auto: the load's calibration; tune: the engine's tuner from there)")
    ap.add_argument("--answer", default="token", help="a decode layer's host side: token "
                    "(ExpertOffload._answer_token), rows (the general path), or both")
    ap.add_argument("--promote", default=None, help="layers promoting a miss each step, one run "
                    "each (default: the engine's)")
    ap.add_argument("--cpu", default="pool", help="CPU sides to run: pool, nopool, planes1, planes2, "
                    "planes3, twographs, tN")
    ap.add_argument("--split", default="minimax", help="the device's count of the misses: minimax, round")
    a = ap.parse_args()
    bad = [c for c in a.cpu.split(",") if c not in ("pool", "nopool", "planes1", "planes2", "planes3", "twographs")
           and not (c[:1] == "t" and c[1:].isdigit() and int(c[1:]) > 0)]
    if bad:
        ap.error(f"--cpu: unknown CPU side {bad[0]!r} (pool, nopool, planes1, planes2, planes3, twographs, tN: N ggml threads)")
    if any(r not in SPLITS for r in a.split.split(",")):
        ap.error(f"--split: {a.split!r}: the rules are {', '.join(SPLITS)}")
    for sh in a.shares.split(","):
        if sh not in ("auto", "tune"):
            try:
                if not 0 <= float(sh) <= 1:
                    raise ValueError
            except ValueError:
                ap.error(f"--shares: {sh!r} is not auto, tune or a share in [0, 1]")
    try:
        promotes = [int(v) for v in a.promote.split(",")] if a.promote else []
    except ValueError:
        ap.error(f"--promote: {a.promote!r} is not a list of layer counts")
    if any(v < 0 for v in promotes):
        ap.error("--promote: layer counts must be >= 0")
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # the calibration's rates
    llm = LLM(a.model, device="cuda", experts="cpu", expert_cache_gib=0, n_ctx=a.p + a.n + 64,
              max_seqs=1, max_batch_tokens=512, prefix_cache=False)
    off = llm.offload
    auto = off.gpu_share
    print(f"offload: {len(off.blocks)} layers, {off.n_expert} experts, cpu backend "
          f"{off.cpu.backend(0)}, {off.cpu.n_threads} ggml threads, slot {off.cache.slot_nbytes / 2**20:.1f} MiB, "
          f"calibrated device share {auto:.2f}")
    rows = []
    c = off.cpu
    cpus = {"pool": lambda: c,
            "nopool": lambda: CpuExperts(c.layers, planes=c.planes, n_threads=c.n_threads, pool=False),
            **{f"planes{p}": (lambda p=p: CpuExperts(c.layers, planes=p, n_threads=c.n_threads))
               for p in (1, 2, 3)},
            "twographs": lambda: CpuExperts(c.layers, planes=1, n_threads=c.n_threads, fused=False)}
    for name in a.cpu.split(","):  # tN: the engine's CPU side with N ggml threads
        if name[:1] == "t" and name[1:].isdigit():  # ("twographs" is a name of its own)
            cpus[name] = lambda n=int(name[1:]): CpuExperts(c.layers, planes=c.planes, n_threads=n)
    built = {}
    shares = {}
    promotes = promotes or [off.promote_layers]
    runs = [(pool, int(n), sh, ans, pr, sp) for pool in a.cpu.split(",") for n in a.slots.split(",")
            for sh in a.shares.split(",") for ans in a.answer.split(",") for pr in promotes
            for sp in a.split.split(",")]
    for pool, n_slots, share, ans, pr, sp in runs:
        off.token_path = ans == "token"
        off.split = SPLITS[sp]
        off.promote_layers = pr
        if pool not in built:
            built[pool] = cpus[pool]()
        off.cpu = built[pool]
        if share == "auto":
            if pool not in shares:
                shares[pool] = auto if pool == "pool" else off.calibrate()
            share = shares[pool]
        if share == "tune":  # the engine's: the tuner from the calibrated share
            off.tuner = ShareTuner(shares.get(pool, auto))
            share = off.tuner.share
            off.gpu_share = share = float(share)
        else:
            off.fix_share(float(share))  # fixed for this run
            share = off.gpu_share
        with torch.inference_mode():  # the cache's tables were made in the engine's steps
            off.cache.resize(min(n_slots, off.n_expert))
        decode(llm, a.p, a.n, 1)  # warm: the cache fills, the plans for each miss count exist
        c0 = off.cache.stats()
        sec, made, tp = decode(llm, a.p, a.n, 2)
        c1 = off.cache.stats()
        looked = (c1["hits"] - c0["hits"]) + (c1["misses"] - c0["misses"])
        hit = (c1["hits"] - c0["hits"]) / looked if looked else 0.0
        timers = Timers()
        try:
            tsec, tmade, _ = decode(llm, a.p, a.n, 4)
        finally:
            timers.close()
        prof = cProfile.Profile()
        prof.enable()
        psec, pmade, _ = decode(llm, a.p, a.n, 3)
        prof.disable()
        st = pstats.Stats(prof)
        ms = sec * 1e3 / made
        if off.tuner is not None:
            share = off.gpu_share  # where the tuner ended
        rows.append((f"{pool}/{ans}/p{pr}/{sp}", off.cache.n_slots, share, ms, hit, a.p / tp))
        print(f"\ncpu side {pool}, answer {ans}, promoting layers {pr}, split {sp}, slots {off.cache.n_slots}, device share {share:.2f}: {ms:.2f} ms a token ({1e3 / ms:.1f} tok/s), hit rate "
              f"{hit:.3f}; prompt {a.p} tokens {tp * 1e3:.0f} ms ({a.p / tp:.0f} tok/s); under cProfile {psec * 1e3 / pmade:.2f} ms a token; per token:")
        print(f"  timed (perf_counter, {tsec * 1e3 / tmade:.2f} ms a token; the prompt's eager "
              f"steps included, so per decode token):")
        for label, v in timers.total.items():
            print(f"  {label:34s} {v * 1e3 / tmade:8.2f} ms  {timers.calls[label] // max(tmade, 1):5d} calls")
        layers = timers.total["host: a step's layers (serve_step)"] * 1e3 / tmade
        print(f"  {'outside the layers (between steps)':34s} {tsec * 1e3 / tmade - layers:8.2f} ms  "
              "(a token's time less serve_step's: the engine's host work the device may wait for)")
        print("  cProfile:")
        for label, v, calls in parts(st, pmade):
            print(f"  {label:28s} {v:8.2f} ms  {calls:5d} calls")
        st.sort_stats("tottime").print_stats(a.top)
    print("\ncpu/answer/promote/split    slots  share  ms/token  tok/s  hit rate  prompt tok/s")
    for pool, n_slots, share, ms, hit, pp in rows:
        print(f"{pool:27s}{n_slots:5d}  {share:5.2f}  {ms:8.2f}  {1e3 / ms:5.1f}  {hit:8.3f}  {pp:12.0f}")


if __name__ == "__main__":
    main()
