"""Where a prompt's prefill goes: one P-token prompt through the engine under torch.profiler
(after a warm-up prompt), the GPU kernels by total time. A measurement, not a test.

    python bench/profile_prefill.py MODEL.gguf [-p 512] [--top 20]
"""
import argparse
import sys
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
    args = ap.parse_args()
    llm = LLM(args.model, device="cuda", n_ctx=max(1024, 2 * args.p))
    prefill(llm, args.p, 0)
    prefill(llm, args.p, 1)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        prefill(llm, args.p, 2)
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.top, max_name_column_width=60))


if __name__ == "__main__":
    main()
