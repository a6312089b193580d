"""Dense Q4_K matrices of a batched decode step (llama 8B's shapes): gemm_q's rule (the decode
in registers), gemm_q through mmq (``mmq_config``: its split and no split), and matmul_f16 on a
resident fp16 copy (what the engine runs when the placement gave copies). Each launch timed in
a CUDA graph (deimos.quant.triton.bench.time_graph, cycling over enough weight copies that
they come from HBM, not L2), each output checked against the copy's product. A measurement,
not a test.

    python bench/exp_gemm_dense_mmq.py [--rows 8,16,32] [NxK ...]

Past 32 rows the rule is mmq's 64-row SWAP + JOIN tile, "mmq" the plain 64-row tile at the
32-row rule's width and split, "mmq no split" the rule's tile unsplit.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from deimos.gguf.constants import GGMLType
from deimos.kernels.triton.matmul import SplitScratch, matmul_f16
from deimos.models.gpu.dequant import permuted_columns
from deimos.quant import get_format
from deimos.quant.triton.bench import time_graph
from deimos.quant.triton.gemm_q import gemm_q, gemm_q_config, mmq_config
from deimos.quant.triton.layout import PackedWeight, pack

PERIOD = 512  # random rows repeated (packing whole matrices on the host is slow)
L2_BYTES = 50e6 * 2  # copies cycled so the working set exceeds L2 twice over


def _weight(n: int, k: int, rng) -> tuple[PackedWeight, torch.Tensor]:
    fmt = get_format(GGMLType.Q4_K)
    blocks = fmt.random_blocks(PERIOD * k // 256, rng).reshape(PERIOD, -1)
    small = pack(blocks, GGMLType.Q4_K)
    reps = -(-n // PERIOD)
    w = PackedWeight(GGMLType.Q4_K, n, k, {a: v.repeat(reps, 1)[:n].contiguous().cuda()
                                           for a, v in small.tensors.items()})
    wf = torch.from_numpy(fmt.decode_blocks(blocks.reshape(-1, fmt.type_size)).reshape(PERIOD, k))
    return w, wf.repeat(reps, 1)[:n].half().cuda()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("shapes", nargs="*", default=["4096x4096", "1024x4096", "6144x4096", "14336x4096",
                                                  "28672x4096"])
    ap.add_argument("--rows", default="8,16,32")
    a = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    scratch = SplitScratch("cuda")
    print("| shape | rows | gemm_q rule us | mmq us (split) | mmq no split us | fp16 copy us | best |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for shape in a.shapes:
        n, k = (int(v) for v in shape.split("x"))
        w, w16 = _weight(n, k, rng)
        copies = max(1, int(L2_BYTES // w.nbytes))
        ws = [PackedWeight(w.ggml_type, n, k, {a: v.clone() for a, v in w.tensors.items()})
              for _ in range(copies)]
        w16s = [w16.clone() for _ in range(max(1, int(L2_BYTES // (n * k * 2))))]
        cols = permuted_columns(w).cuda()
        for m in (int(v) for v in a.rows.split(",")):
            x = torch.randn(m, k, device="cuda").half()
            xp = x[:, cols].contiguous()
            ref = x.float() @ w16.float().T
            out = torch.empty(m, n, device="cuda")
            res = {}
            mq = mmq_config(n, k, min(m, 32))
            if m > 32:  # the rule's SWAP + JOIN tile against the plain 64-row tile (32 rows' width, split)
                mq = mq._replace(block_m=64)
            cfgs = {"rule": gemm_q_config(w.ggml_type, n, k, m), "mmq": mq}
            cfgs["mmq1"] = (cfgs["rule"] if m > 32 else cfgs["mmq"])._replace(split_k=1)
            for name, cfg in cfgs.items():
                gemm_q(w, xp, out=out, cfg=cfg)
                err = ((out - ref).norm() / ref.norm()).item()
                us = time_graph([lambda wi=wi, cfg=cfg: gemm_q(wi, xp, out=out, cfg=cfg) for wi in ws]) * 1e6
                res[name] = (us, err, cfg.split_k)
            y = matmul_f16(x, w16, scratch=scratch)
            err = ((y - ref).norm() / ref.norm()).item()
            us = time_graph([lambda wi=wi: matmul_f16(x, wi, scratch=scratch, ahead=True) for wi in w16s]) * 1e6
            res["fp16"] = (us, err, 1)
            bad = [k_ for k_, v in res.items() if not v[1] < 2e-3]
            best = min(res, key=lambda k_: res[k_][0])
            print(f"| {shape} | {m} | {res['rule'][0]:.1f} | {res['mmq'][0]:.1f} ({res['mmq'][2]}) | "
                  f"{res['mmq1'][0]:.1f} | {res['fp16'][0]:.1f} | {best}{' WRONG ' + str(bad) if bad else ''} |",
                  flush=True)


if __name__ == "__main__":
    main()
