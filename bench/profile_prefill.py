"""Where a prompt's prefill goes: one P-token prompt through the engine under torch.profiler
(after a warm-up prompt), the GPU kernels by total time; then the GPU's timeline (from the
request's start: when the first kernel starts, busy time, the largest idle gaps and the
kernels around them) and the unprofiled wall time of the same prompt. A measurement, not a
test.

    python bench/profile_prefill.py MODEL.gguf [-p 512] [--top 20] [--gaps 12] [--host 30]
"""
import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from deimos.engine import LLM
from deimos.engine.request import Request
from deimos.kernels.sampling import SamplingParams


def prefill(llm: LLM, p: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    req = Request(torch.randint(0, llm.config.n_vocab, (p,), generator=g).tolist(), 1,
                  SamplingParams(temperature=0))
    llm.run_many([req])
    torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("-p", type=int, default=512)
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--gaps", type=int, default=12, help="idle gaps listed")
    ap.add_argument("--host", type=int, default=0, help="cProfile 3 prompts, print this many functions")
    args = ap.parse_args()
    llm = LLM(args.model, device="cuda", n_ctx=max(1024, 2 * args.p))
    prefill(llm, args.p, 0)
    prefill(llm, args.p, 1)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        prefill(llm, args.p, 2)
    if args.top:
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.top,
                                        max_name_column_width=60))
    timeline(prof, args.gaps)
    walls = []
    for i in range(5):
        t0 = time.perf_counter()
        prefill(llm, args.p, 10 + i)
        walls.append(time.perf_counter() - t0)
    print(f"wall (unprofiled, 5 prompts): median {statistics.median(walls) * 1e3:.2f} ms, "
          f"best {min(walls) * 1e3:.2f} ms ({args.p / min(walls):.0f} tok/s)")
    if args.host:  # the host's Python: where the time between the kernels goes
        import cProfile
        import pstats

        with cProfile.Profile() as cp:
            for i in range(3):
                prefill(llm, args.p, 20 + i)
        st = pstats.Stats(cp)
        st.sort_stats("tottime").print_stats(args.host)
        st.sort_stats("cumulative").print_stats(args.host)


def timeline(prof, n_gaps: int) -> None:
    """The GPU kernels' timeline of the profiled prompt, from the chrome trace."""
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = json.load(open(f.name))["traceEvents"]
    kernels = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
                     key=lambda e: e["ts"])
    host = [e for e in events if e.get("cat") == "cpu_op" or e.get("ph") == "X" and e.get("cat") == "python_function"]
    t_start = min(e["ts"] for e in host) if host else kernels[0]["ts"]
    busy = sum(e["dur"] for e in kernels)
    span = kernels[-1]["ts"] + kernels[-1]["dur"] - kernels[0]["ts"]
    print(f"GPU timeline: first kernel {(kernels[0]['ts'] - t_start) / 1e3:.2f} ms after the first "
          f"host op, span {span / 1e3:.2f} ms, busy {busy / 1e3:.2f} ms, {len(kernels)} kernels")
    gaps = []
    for a, b in zip(kernels, kernels[1:]):
        gap = b["ts"] - (a["ts"] + a["dur"])
        if gap > 0:
            gaps.append((gap, a["name"][:40], b["name"][:40], (b["ts"] - kernels[0]["ts"]) / 1e3))
    gaps.sort(reverse=True)
    print(f"idle: {sum(g[0] for g in gaps) / 1e3:.2f} ms in {len(gaps)} gaps; largest:")
    for gap, a, b, at in gaps[:n_gaps]:
        print(f"  {gap:8.1f} us at {at:7.2f} ms  after {a}  before {b}")
    syncs = [e for e in events if e.get("cat") == "cuda_runtime" and "Synchronize" in e.get("name", "")]
    copies = [e for e in events if e.get("cat") == "cuda_runtime" and "Memcpy" in e.get("name", "")]
    print(f"host: {len(syncs)} synchronize calls ({sum(e['dur'] for e in syncs) / 1e3:.2f} ms), "
          f"{len(copies)} memcpy calls ({sum(e['dur'] for e in copies) / 1e3:.2f} ms)")


if __name__ == "__main__":
    main()
