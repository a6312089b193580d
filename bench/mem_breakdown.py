"""Where an offloaded MoE model's GPU memory goes under ``--gpu-mem``-style limits: a helper
process holds all but GIB of the card (deimos.bench.memhold), the engine loads as ``deimos bench``
loads it, and each part is read back (the expert cache, the prefill stager, the KV pool, the
rest of torch's allocations: weights and buffers; the process's memory outside torch's
allocator: CUDA context, cuBLAS, Triton), then again after a pp512 + tg32 round (peaks).

    python bench/mem_breakdown.py MODEL.gguf --gib 8
"""

from __future__ import annotations

import argparse

import torch

from deimos.bench.memhold import MemHold
from deimos.bench.run import time_round
from deimos.engine.llm import LLM
from deimos.runtime.gpu_memory import nvml_reader

GIB = 2**30


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--gib", type=float, default=8.0)
    ap.add_argument("-p", type=int, default=512)
    ap.add_argument("-n", type=int, default=32)
    a = ap.parse_args()
    read = nvml_reader(0) or (lambda: torch.cuda.mem_get_info(0))
    with MemHold(leave_gib=a.gib).start() as hold:
        hold.wait_ready()
        free0, _ = read()
        llm = LLM(a.model, device="cuda", n_ctx=a.p + a.n + 1, max_seqs=1, max_batch_tokens=512,
                  prefix_cache=False)
        rows = []

        def snap(label: str) -> None:
            free, _ = read()
            off, eng = llm.offload, llm.engine
            alloc, res = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
            cache = off.cache.nbytes if off is not None else 0
            stager = off.stager.nbytes if off is not None else 0
            kv = eng.pool.nbytes
            rows.append((label, {
                "used by this process (NVML)": free0 - free,
                "torch reserved": res,
                "torch allocated": alloc,
                "  expert cache": cache,
                "  prefill stager": stager,
                "  KV pool": kv,
                "  the rest (weights, buffers)": alloc - cache - stager - kv,
                "torch peak allocated": torch.cuda.max_memory_allocated(),
                "outside torch (context, cuBLAS, Triton)": free0 - free - res,
                "free": free,
            }))

        snap("after load")
        time_round(llm.engine, a.p, a.n, torch.device("cuda"), torch.Generator().manual_seed(0))
        torch.cuda.synchronize()
        snap(f"after pp{a.p}+tg{a.n}")
        print(f"{a.model}: {a.gib:g} GiB left by the helper; free at load {free0 / GIB:.2f} GiB; "
              f"slots a layer {llm.offload.cache.n_slots if llm.offload else '-'}")
        names = list(rows[0][1])
        print(f"{'GiB':42s}" + "".join(f"{lab:>20s}" for lab, _ in rows))
        for k in names:
            print(f"{k:42s}" + "".join(f"{r[k] / GIB:20.3f}" for _, r in rows))


if __name__ == "__main__":
    main()
