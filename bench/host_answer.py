"""The host's own work in a captured one-token offload step's layer (``ExpertOffload._answer_token``:
the split of the misses, the device's table, the flags, the cache's statistics, the promotion's
claim), ggml's compute left out: what the host adds to each MoE layer's critical path besides
the CPU's products.

    python bench/host_answer.py [--file PATH] [--slots 28] [--share 0.3] [--calls 2000] [--reps 3]

One 2-layer file of qwen3moe 30B-A3B's widths (128 experts, 8 a token, Q4_K_M mix; written to
--file when absent, ~0.8 GB); a host-side mailbox of plain arrays (the flags as the real one
writes them); each call routes a random set of 8 distinct experts. ``CpuExperts.token`` is
replaced by nothing, so that only the host's bookkeeping is timed (bench/cpu_token_parts.py
times the rest). Prints the median and the mean us a layer, the best of ``--reps`` passes. A
measurement, not a test.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # the kernel model's modules without a GPU

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from deimos.gguf import GGUFFile  # noqa: E402
from deimos.models import ARCHITECTURES  # noqa: E402
from deimos.models.config import ModelConfig  # noqa: E402
from deimos.models.gpu.offload import ExpertOffload  # noqa: E402
from deimos.models.weights import WeightSource  # noqa: E402
from deimos.synth import write_model  # noqa: E402
from deimos.synth.presets import get_preset  # noqa: E402


class Box:
    """A HostMailbox's host side as plain arrays (one row: a one-token step)."""

    POSTED, DECIDED, DONE = 0, 1, 2

    def __init__(self, n_layer: int, k: int, d: int, n_expert: int):
        self.np_ids = np.zeros((n_layer, 1, k), dtype=np.int32)
        self.np_weights = np.full((n_layer, 1, k), 0.125, dtype=np.float32)
        self.np_x = np.ones((n_layer, 1, d), dtype=np.float32)
        self.np_out = np.zeros((n_layer, 1, d), dtype=np.float32)
        self.np_table = np.full((n_layer, n_expert), -1, dtype=np.int32)
        self.np_flags = np.zeros((n_layer, 3), dtype=np.int32)
        self.step = 1
        self.answered = -1

    def decide(self, layer: int) -> None:
        self.np_flags[layer, self.DECIDED] = self.step

    def answer(self, layer: int) -> None:
        self.np_flags[layer, self.DONE] = self.step
        self.answered = layer
        self.at = time.perf_counter()  # when the device may go on


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--file", default="/tmp/deimos-bench/qwen3moe-30b-widths-2l.gguf")
    ap.add_argument("--slots", type=int, default=28)
    ap.add_argument("--share", type=float, default=0.3)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    path = Path(a.file)
    if not path.exists():
        from testdata import llama_cpp_path

        path.parent.mkdir(parents=True, exist_ok=True)
        preset = dataclasses.replace(get_preset("qwen3moe-30b-a3b"), name="qwen3moe-30b-widths-2l", n_layer=2)
        write_model(path, "qwen3moe", preset, "Q4_K_M", llama_cpp_path("models/ggml-vocab-llama-spm.gguf"))
    f = GGUFFile(path)
    cfg = ModelConfig.from_gguf(f.metadata, source=str(path), tensors=f.tensors)
    model = ARCHITECTURES[cfg.arch](cfg, WeightSource(f, "cpu", kernels=True, expert_device="cpu"))
    off = ExpertOffload(model, f, torch.device("cpu"), n_slots=a.slots)
    for lay in off.cache.layers:  # experts 0..slots-1 resident (as the cache's table says)
        lay.slot_of_host[: a.slots] = np.arange(a.slots)
    off.fix_share(a.share)
    off.cpu.token = lambda *args: None  # ggml's compute left out (bench/cpu_token_parts.py)
    n_layer, k = len(off.blocks), off.blocks[0].n_expert_used
    box = Box(n_layer, k, cfg.n_embd, off.n_expert)
    off.mailbox = box
    rng = np.random.default_rng(1)
    routes = np.stack([rng.permutation(off.n_expert)[:k] for _ in range(a.calls)]).astype(np.int32)
    best = None
    for _ in range(a.reps):
        times, answered = [], []
        off._promo_ok = False  # no promotion claimed (serve_step's state while a copy runs)
        for c in range(a.calls):
            i = c % n_layer
            box.np_ids[i, 0] = routes[c]
            t = time.perf_counter()
            off._answer_token(i, promote=False)
            times.append(time.perf_counter() - t)
            answered.append(box.at - t)
        if best is None or statistics.median(times) < statistics.median(best[0]):
            best = times, answered
    st = off.stats
    print(f"{a.slots} slots, share {a.share} ({st.cpu_experts / st.tokens:.2f} CPU and "
          f"{st.host_read_experts / st.tokens:.2f} device-read misses a layer), us a layer, "
          f"median / mean: until the answer {statistics.median(best[1]) * 1e6:.1f} / "
          f"{statistics.fmean(best[1]) * 1e6:.1f} (the device waits), in all "
          f"{statistics.median(best[0]) * 1e6:.1f} / {statistics.fmean(best[0]) * 1e6:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
