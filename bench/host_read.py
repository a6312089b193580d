"""How fast the device computes routed experts that live in pinned host memory: the offload's
device share of a decode layer's misses (deimos.models.gpu.offload: the expert GEMVs reading
their rows over PCIe through a one-chunk address table), against the same GEMVs on experts
in device memory, and against the copy engine moving those experts' bytes to the device
(what a copy-then-compute path would pay before its device-speed GEMVs).

    python bench/host_read.py [--experts 1,2,4,8] [--shape 30b]

A qwen3moe 30B-A3B layer's experts (gate/up Q4_K 768 x 2048, down Q6_K 2048 x 768), 64 of
them; each timed call reads k experts no call before it in the graph read (distinct sets,
cycled), one token. A measurement, not a test. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from deimos.gguf.constants import GGMLType  # noqa: E402
from deimos.models.gpu.moe_ops import expert_products  # noqa: E402
from deimos.quant import get_format  # noqa: E402
from deimos.quant.triton.bench import time_graph  # noqa: E402
from deimos.quant.triton.layout import PackedWeight, pack  # noqa: E402
from deimos.quant.triton.moe_gemv import ExpertChunks  # noqa: E402

E, FF, D = 64, 768, 2048
PARTS = {"gate": (GGMLType.Q4_K, FF, D), "up": (GGMLType.Q4_K, FF, D), "down": (GGMLType.Q6_K, D, FF)}


def stacks(seed: int) -> dict[str, PackedWeight]:
    rng = np.random.default_rng(seed)
    out = {}
    for part, (t, n, k) in PARTS.items():
        fmt = get_format(t)
        blocks = fmt.random_blocks(E * n * k // fmt.block_size, rng).reshape(E * n, -1)
        out[part] = pack(blocks, t)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", default="1,2,4,8")
    a = ap.parse_args()
    dev = torch.device("cuda")
    host = stacks(0)
    pinned = {p: PackedWeight(w.ggml_type, w.n, w.k, {n: v.pin_memory() for n, v in w.tensors.items()})
              for p, w in host.items()}
    device = {p: PackedWeight(w.ggml_type, w.n, w.k, {n: v.to(dev) for n, v in w.tensors.items()})
              for p, w in host.items()}
    templates = {p: PackedWeight(w.ggml_type, 1, w.k, {n: torch.zeros((1, *v.shape[1:]), dtype=v.dtype, device=dev)
                                                     for n, v in w.tensors.items()})
                 for p, w in host.items()}
    chunks = {p: ExpertChunks({n: torch.tensor([v.data_ptr()], dtype=torch.int64, device=dev)
                               for n, v in sorted(w.tensors.items())}, E)
              for p, w in pinned.items()}
    per_expert = sum(v.numel() * v.element_size() for w in host.values() for v in w.tensors.values()) // E
    block = SimpleNamespace(n_expert_used=8, n_ff=FF, activation="silu", n_expert=E)
    x = torch.randn(1, D, device=dev)
    print(f"one expert: {per_expert / 2**20:.2f} MiB (gate, up, down); {E} experts")
    print("| k | host-read GEMVs us | GB/s | device GEMVs us | copy engine us | GB/s |")
    print("|---:|---:|---:|---:|---:|---:|")
    for k in (int(s) for s in a.experts.split(",")):
        sets = [np.arange(i * k, (i + 1) * k) % E for i in range(max(1, E // k))]
        # a token's 8 ids: the k read ones, then experts the table leaves off the device (skipped)
        ids = [torch.tensor((np.arange(8) + s[0]).reshape(1, 8) % E, dtype=torch.int32, device=dev)
               for s in sets]
        tables = []
        for s in sets:
            t = torch.full((E,), -1, dtype=torch.int32)
            t[torch.from_numpy(s)] = torch.from_numpy(s.astype(np.int32))
            tables.append(t.to(dev))
        t_host = time_graph([lambda i=i: expert_products(x, block, ids[i], tables[i], templates, chunks)
                             for i in range(len(sets))], calls=len(sets) * 2)
        t_dev = time_graph([lambda i=i: expert_products(x, block, ids[i], tables[i], device)
                            for i in range(len(sets))], calls=len(sets) * 2)
        # each packed tensor holds E experts' rows along its first axis (not always w.n of them)
        dst = {p: {n: torch.empty((k * (v.shape[0] // E), *v.shape[1:]), dtype=v.dtype, device=dev)
                   for n, v in w.tensors.items()} for p, w in pinned.items()}

        def copy(s):
            for p, w in pinned.items():
                for n, v in w.tensors.items():
                    r = v.shape[0] // E
                    for j, e in enumerate(s.tolist()):
                        dst[p][n][j * r:(j + 1) * r].copy_(v[e * r:(e + 1) * r], non_blocking=True)
        t_copy = time_graph([lambda s=s: copy(s) for s in sets], calls=len(sets) * 2)
        nb = k * per_expert
        print(f"| {k} | {t_host * 1e6:.1f} | {nb / t_host / 1e9:.1f} | {t_dev * 1e6:.1f} | "
              f"{t_copy * 1e6:.1f} | {nb / t_copy / 1e9:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
