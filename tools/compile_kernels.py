"""Compile every Triton kernel (deimos.quant.triton, deimos.kernels.triton) for sm_90, no GPU here.

For each launch configuration the wrappers use, the kernel goes through Triton's normal JIT
(``kernel.warmup``, same argument specialization as a real launch) behind a stub driver that
reports a ``GPUTarget("cuda", 90, 32)``. Prints kernel, config, registers, spills, shared memory
and compile time; exits 1 if any kernel fails to compile or needs more shared memory than an
H200 block may have (232,448 bytes). Registers and spills come from the cuobjdump that ships
with Triton.

    python tools/compile_kernels.py [--verbose] [--match NAME_PART] [--cover]

``--cover`` (the test suite's run) compiles each kernel's every distinct configuration once,
in one of the formats that use it (the formats taken in turn), and every format of a kernel at
least once: about a third of the jobs. A kernel's tiles decide its shared memory and most of
its registers; a format changes only the block decoding inside the tile.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

H200_SHARED_PER_BLOCK = 232_448
# the decode-step kernels are launched with programmatic dependent launch (quant.triton.pdl)
PDL_KW = {"PDL": True, "launch_pdl": True}
TARGET_ARCH = 90


class Job(NamedTuple):
    name: str  # kernel
    config: str  # what varies, for the table
    run: object  # () -> CompiledKernel


class Row(NamedTuple):
    name: str
    config: str
    ok: bool
    regs: str
    spills: str
    shared: int
    seconds: float
    error: str


class _StubDriver:
    """Just enough of a Triton driver for the JIT to compile (never to launch)."""

    def __init__(self, target: object) -> None:
        self._target = target

    def get_current_target(self) -> object:
        return self._target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_active_torch_device(self) -> object:
        import torch

        return torch.device("cpu")


def _jobs() -> list[Job]:
    """Every (kernel, constexpr config) the wrappers launch on a GPU."""
    return (_q8_jobs() + _rows_jobs() + _gemm_q_jobs() + _layer_jobs() + _paged_jobs()
            + _sample_batch_jobs() + _moe_jobs() + _shared_gate_jobs() + _gated_delta_jobs() + _host_link_jobs())


def _q8_jobs() -> list[Job]:
    """The int8-activation GEMV (dp4a inline PTX) per format, and the x quantizer."""
    import importlib

    import torch
    from triton.runtime.jit import MockTensor

    from deimos.gguf.constants import GGMLType

    # by module path: the package re-exports the function of the same name
    q = importlib.import_module("deimos.quant.triton.gemv_q8")
    from deimos.quant.triton.dequant_gemv import FMT_ID, scale16, weight_arrays
    from deimos.quant.triton.layout import KERNEL_TYPE

    # the kernels' formats, and IQ4_XS for Q8_0's layout with float32 scales (the kernels are
    # specialized on the scale dtype); the other formats packed in another's layout add none
    SAMPLE_TYPES = [*FMT_ID, GGMLType.IQ4_XS, GGMLType.IQ2_XS]  # IQ2_XS: a scale per 16 (SCALE16)

    jobs = []
    for t in SAMPLE_TYPES:
        kt = KERNEL_TYPE.get(t, t)
        # every config the shape rule gives for the model shapes we know (1024..262144 rows,
        # K = 1024..18432)
        # (EVEN: the step divides a row's groups, so loads go unmasked)
        cfgs = sorted({(q.q8_config(kt, n, k, 1), k // 32 % q.q8_config(kt, n, k, 1).block_s == 0)
                       for n in (1024, 2048, 4096, 6144, 28672, 262144)
                       for k in (1024, 2048, 2560, 3072, 4096, 9728, 14336, 18432)})
        for cfg, even in cfgs:
            sample = _packed_sample(t, 4096)
            args = [MockTensor(a.dtype) for a in weight_arrays(sample)]
            args += [MockTensor(torch.int32), MockTensor(torch.float32), MockTensor(torch.int32),
                     MockTensor(torch.float32), 4096, 4096]
            jobs.append(Job("gemv_q8_" + t.name, _describe(cfg) + f" xb={int(cfg.xb)} even={int(even)}",
                            _warm_args(q._gemv_q8_kernel, args, FMT=FMT_ID[kt], BLOCK_N=cfg.block_n,
                                       BLOCK_S=cfg.block_s, ASM=True, XB=cfg.xb, EVEN=even,
                                       SCALE16=scale16(sample), AHEAD=True,
                                       num_warps=cfg.num_warps, **PDL_KW)))
    from deimos.models.gpu import dequant

    for t in SAMPLE_TYPES:
        kt = KERNEL_TYPE.get(t, t)
        sample = _packed_sample(t, 4096)
        args = [MockTensor(a.dtype) for a in weight_arrays(sample)]
        args += [MockTensor(torch.float16), 4096, 4096]
        for dc, even, perm in ((dc, even, perm) for dc in dict.fromkeys(dequant.dequant_config(n, 4096)
                                                                    for n in (1, 28672))
                               for even in (True, False) for perm in (True, False)):  # fmt: skip
            jobs.append(Job("dequant_" + t.name,
                            f"R={dc.block_r} J={dc.block_j} w={dc.num_warps} even={int(even)} perm={int(perm)}",
                            _warm_args(dequant._dequant_kernel, args, FMT=FMT_ID[kt],
                                       BLOCK_R=dc.block_r, BLOCK_J=dc.block_j, EVEN=even,
                                       PERMUTED=perm, SCALE16=scale16(sample),
                                       num_warps=dc.num_warps)))
    from deimos.kernels.triton import matmul

    shapes = [(m, n) for m in (2, 16, 64, 128, 512) for n in (4096, 28672)]
    for mc in dict.fromkeys(matmul.matmul_config(m, n, 4096, tma=False) for m, n in shapes + [(2048, 28672)]):
        for splits in (1, 4) if mc.block_m * mc.block_n <= 64 * 64 else (1,):  # split-K: decode rows
            # a resident weight, or one just dequantized (matmul_f16 loads ahead in 16-row tiles only)
            for ahead in (True, False) if mc.block_m == 16 else (False,):
                jobs.append(Job("matmul_f16", f"M={mc.block_m} N={mc.block_n} K={mc.block_k} "
                                              f"w={mc.num_warps} st={mc.num_stages} splits={splits} "
                                              f"ahead={int(ahead)}",
                                _warm(matmul._matmul_kernel,
                                      [torch.float16, torch.float16, torch.float32, torch.float32,
                                       torch.int32] + [4096] * 7,
                                      BLOCK_M=mc.block_m, BLOCK_N=mc.block_n, BLOCK_K=mc.block_k,
                                      GROUP=matmul.GROUP_M, EVEN_K=True, SPLITS=splits, AHEAD=ahead,
                                      num_warps=mc.num_warps, num_stages=mc.num_stages, **PDL_KW)))
    from triton.tools.tensor_descriptor import TensorDescriptor

    for mc in dict.fromkeys(matmul.matmul_config(m, n, 4096, tma=True) for m in (512, 2048) for n in (4096, 28672)):
        host = torch.empty(256, 4096, dtype=torch.float16)  # descriptors need a tensor's shape only
        descs = [TensorDescriptor.from_tensor(host, [mc.block_m, mc.block_k]),
                 TensorDescriptor.from_tensor(host, [mc.block_n, mc.block_k])]
        jobs.append(Job("matmul_f16_tma", f"M={mc.block_m} N={mc.block_n} K={mc.block_k} "
                                          f"w={mc.num_warps} st={mc.num_stages}",
                        _warm(matmul._matmul_tma_kernel, descs + [torch.float32] + [4096] * 4,
                              BLOCK_M=mc.block_m, BLOCK_N=mc.block_n, BLOCK_K=mc.block_k,
                              GROUP=matmul.GROUP_M, num_warps=mc.num_warps, num_stages=mc.num_stages,
                              **PDL_KW)))
    from deimos.kernels.triton import matmul_gated as mg

    gated = [mg.gated_config(m, 14336, 4096, tma=m > 256) for m in (20, 64, 200, 512, 2048)]
    gated += [mg.gated_config(m, 14336, 4096, tma=False) for m in (512, 2048)]  # rows TMA cannot address
    for gcfg, act in ((c, a) for c in dict.fromkeys(gated) for a in mg.ACTIVATIONS.values()):
        bf = gcfg.block_n // 2
        what = f"M={gcfg.block_m} F={bf} K={gcfg.block_k} w={gcfg.num_warps} st={gcfg.num_stages} act={act}"
        kw = dict(BLOCK_M=gcfg.block_m, BLOCK_F=bf, BLOCK_K=gcfg.block_k, GROUP=matmul.GROUP_M, ACT=act,
                  num_warps=gcfg.num_warps, num_stages=gcfg.num_stages, **PDL_KW)
        if gcfg.tma:
            host = torch.empty(256, 4096, dtype=torch.float16)
            descs = [TensorDescriptor.from_tensor(host, [gcfg.block_m, gcfg.block_k]),
                     TensorDescriptor.from_tensor(host, [bf, gcfg.block_k])]
            jobs.append(Job("matmul_gated_tma", what, _warm(mg._gated_tma_kernel, descs + [torch.float16]
                                                            + [4096] * 4, **kw)))
        else:
            jobs.append(Job("matmul_gated", what, _warm(mg._gated_kernel, [torch.float16] * 3 + [4096] * 6,
                                                        EVEN_K=True, **kw)))
    gc = matmul.gemv_config(4096, 4096)
    for even in (True, False):
        jobs.append(Job("gemv_f16", f"N={gc.block_n} K={gc.block_k} w={gc.num_warps} even={int(even)}",
                        _warm(matmul._gemv_kernel, [torch.float16, torch.float16, torch.float32] + [4096] * 3,
                              BLOCK_N=gc.block_n, BLOCK_K=gc.block_k, EVEN_K=even, AHEAD=True,
                              num_warps=gc.num_warps, **PDL_KW)))
    for dt in (torch.float32, torch.float16):
        args = [MockTensor(dt), MockTensor(torch.int32), MockTensor(torch.float32),
                MockTensor(torch.int32), 4096]
        jobs.append(Job("quantize_x", f"x={dt} G={q.QUANT_BLOCK_G}",
                        _warm_args(q._quantize_x_kernel, args, BLOCK_G=q.QUANT_BLOCK_G,
                                   num_warps=4)))
    return jobs


def _rows_jobs() -> list[Job]:
    """The multi-row integer-activation GEMV (quant.triton.gemv_rows) per format at the tiles
    its rule gives for llama 8B's matrices at 2, 4 and 8 activation rows (each with the EVEN
    flag of that launch, each tile's masked variant, and its prefetch variant, which
    bench/sweep_gemv.py --rows times)."""
    import importlib

    import torch
    from triton.runtime.jit import MockTensor

    from deimos.gguf.constants import GGMLType
    from deimos.quant.triton.dequant_gemv import FMT_ID, scale16, weight_arrays
    from deimos.quant.triton.layout import KERNEL_TYPE

    gr = importlib.import_module("deimos.quant.triton.gemv_rows")
    shapes = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)]
    jobs = []
    for t in [*FMT_ID, GGMLType.IQ4_XS, GGMLType.IQ2_XS]:
        kt = KERNEL_TYPE.get(t, t)
        sample = _packed_sample(t, 4096)
        launches = set()
        for n, k in shapes:
            for rows in (2, 4, 8):
                cfg = gr.rows_config(kt, n, k, rows)
                even = k // 32 % cfg.block_s == 0
                launches.add((rows, cfg, even))
                launches.add((rows, cfg, False))
                launches.add((rows, cfg._replace(prefetch=True), even))  # the sweep's variant
        for rows, cfg, even in sorted(launches):
            args = [MockTensor(a.dtype) for a in weight_arrays(sample)]
            args += [MockTensor(torch.int32), MockTensor(torch.float32), MockTensor(torch.int32),
                     MockTensor(torch.float32), 4096, 4096]
            jobs.append(Job("gemv_rows_" + t.name,
                            f"R={rows} " + _describe(cfg)
                            + f" xb={int(cfg.xb)} even={int(even)} pf={int(cfg.prefetch)}",
                            _warm_args(gr._gemv_rows_kernel, args, FMT=FMT_ID[kt], ROWS=rows,
                                       BLOCK_N=cfg.block_n, BLOCK_S=cfg.block_s, ASM=True,
                                       XB=cfg.xb, EVEN=even, SCALE16=scale16(sample),
                                       PREFETCH=cfg.prefetch,
                                       num_warps=cfg.num_warps, **PDL_KW)))
    return jobs


def _gemm_q_jobs() -> list[Job]:
    """The batched decode GEMM (quant.triton.gemm_q) per format at the tiles its rule gives
    for llama 8B's matrices at M = 2, 16, 32, 64 (each with the EVEN/ATOMIC flags of that launch),
    and each tile's masked variant (a K its steps do not divide), unsplit (Q4_K's through mmq:
    ``mmq_config``)."""
    import importlib

    import torch
    from triton.runtime.jit import MockTensor

    from deimos.gguf.constants import GGMLType
    from deimos.quant.triton.dequant_gemv import FMT_ID, scale16, weight_arrays, words_per_group
    from deimos.quant.triton.layout import KERNEL_TYPE

    g = importlib.import_module("deimos.quant.triton.gemm_q")
    shapes = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)]
    jobs = []
    for t in [*FMT_ID, GGMLType.IQ4_XS, GGMLType.IQ2_XS]:
        kt = KERNEL_TYPE.get(t, t)
        wpg = words_per_group(kt)
        sample = _packed_sample(t, 4096)
        launches = set()  # what the kernel is specialized on (split_k is only the grid)
        for n, k in shapes:
            for m in (2, 16, 32, 64):
                cfg = g.gemm_q_config(t, n, k, m)
                _, splits, even = g.k_runs(k, wpg, cfg)
                launches.add((cfg._replace(split_k=1), even or cfg.mmq, splits > 1))
                if not cfg.mmq:  # mmq's runs are whole blocks: never masked
                    launches.add((cfg._replace(split_k=1), False, False))
        for cfg, even, atomic in sorted(launches):
            args = [MockTensor(torch.float16)] + [MockTensor(a.dtype) for a in weight_arrays(sample)]
            args += [MockTensor(torch.float32), 16, 4096, 4096, 4096, 32]
            jobs.append(Job("gemm_q_" + t.name,
                            f"M={cfg.block_m} N={cfg.block_n} J={cfg.block_j} w={cfg.num_warps} "
                            f"st={cfg.num_stages} even={int(even)} atomic={int(atomic)} mmq={int(cfg.mmq)}"
                            + (f" swap={int(cfg.swap)} join={int(cfg.join)}" if cfg.mmq else ""),
                            _warm_args(g._gemm_q_kernel, args, FMT=FMT_ID[kt], BLOCK_M=cfg.block_m,
                                       BLOCK_N=cfg.block_n, BLOCK_J=cfg.block_j, ATOMIC=atomic,
                                       EVEN=even, SCALE16=scale16(sample), ASM=True,
                                       HALF=cfg.half, MMQ=cfg.mmq, R_QW=512, R_S=64,
                                       # mmq's x as the linears hand it: in element order
                                       X_ORDER=g.ELEMENTS if cfg.mmq else g.WORDS, SWAP=cfg.swap, JOIN=cfg.join,
                                       num_warps=cfg.num_warps, num_stages=cfg.num_stages, **PDL_KW)))
    return jobs


def _packed_sample(t: object, k: int):
    import numpy as np

    from deimos.quant import get_format
    from deimos.quant.triton.layout import pack

    fmt = get_format(t)
    return pack(fmt.random_blocks(k // fmt.block_size, np.random.default_rng(0)).reshape(1, -1), t)


def _warm_args(kernel: object, args: list, **kw: object):
    return lambda: kernel.warmup(*args, grid=(1,), **kw)


def _warm(kernel: object, args: list, **kw: object):
    """A warmup of ``kernel`` with ``args`` (torch dtypes become mock pointers)."""
    import torch
    from triton.runtime.jit import MockTensor

    real = [MockTensor(a) if isinstance(a, torch.dtype) else a for a in args]
    return lambda: kernel.warmup(*real, grid=(1,), **kw)


def _layer_jobs() -> list[Job]:
    """deimos.kernels.triton: each kernel at the configs its launch rules pick for real models
    (llama 8B: D 4096, 32/8 heads of 128; gemma3: heads of 256; tiny: heads of 64)."""
    import importlib

    import torch
    import triton

    # by module path: the package re-exports functions of the same names as some modules
    activation, decode_attention, norm, rope, sampling = (
        importlib.import_module("deimos.kernels.triton." + m)
        for m in ("activation", "decode_attention", "norm", "rope",
                  "sampling")
    )

    f16, f32, i32, i64 = torch.float16, torch.float32, torch.int32, torch.int64
    jobs = []
    from triton.runtime.jit import MockTensor

    def norm_job(name: str, d: int, c, res: bool, out: str, **kw) -> Job:
        """The norm kernel at D = d and config c, with a residual (res), the integer
        activation ("+q8") or a batch's fp16 rows ("+f16"); kw: the experts' sum's arguments."""
        return Job(name + out, f"D={d} B={c.block_d} w={c.num_warps} C={c.chunk}" + (" k=8" if kw else ""),
                   _warm(norm._rms_norm_kernel, [f32] * 5 + [4096] * 4 + [d, 1e-6, i32, f32, i32],
                         HAS_RESIDUAL=res, BLOCK_D=c.block_d, QUANT=out == "+q8", CHUNK=c.chunk,
                         num_warps=c.num_warps, p_h=MockTensor(f16 if out == "+f16" else f32),
                         HALF=out == "+f16", **kw, **PDL_KW))

    for d in (576, 4096, 5376):
        for c in dict.fromkeys((norm.norm_config(d), norm.norm_config(d, 1, split=True))):
            for res in (False, True):
                for out in ("", "+q8", "+f16"):  # a decode row's integer activation, a batch's fp16
                    jobs.append(norm_job("rms_norm" + ("+add" if res else ""), d, c, res, out))
    for d in (2048, 4096):  # the experts' sum in the norm (qwen3moe 30B-A3B's 8 of 128 experts)
        mix = dict(MIX=8, p_mw=MockTensor(f32))
        # qwen35moe's: a shared expert's row and its sigmoid gate added to the sum
        shared = dict(HAS_ADD=True, p_add=MockTensor(f32), HAS_GATE=True, p_gx=MockTensor(f32),
                      p_gw=MockTensor(f32), stride_gx=d, DX=d, BLOCK_X=min(1024, d))
        for c in dict.fromkeys((norm.norm_config(d), norm.norm_config(d, 1, split=True))):
            for out in ("+q8", "+f16"):
                jobs.append(norm_job("rms_norm+mix", d, c, True, out, **mix))
            # a gated add launches at the combine's warps (norm._launch): a decode row's
            # integer activation, a prompt's fp16 rows
            for out in ("+q8", "+f16"):
                jobs.append(norm_job("rms_norm+mix+shared", d, c._replace(num_warps=norm.COMBINE_WARPS), True,
                                     out, **mix, **shared))
    for act in activation.ACTIVATIONS.values():
        for out in ("", "+q8", "+f16"):
            args = [f32] * 3 + [28672, 28672, 14336, 14336, i32, f32, i32]
            jobs.append(Job("gated_act" + out, f"act={act} B={activation.BLOCK}",
                            _warm(activation._gated_act_kernel, args, ACT=act,
                                  BLOCK_F=activation.BLOCK, QUANT=out == "+q8",
                                  p_h=MockTensor(f16 if out == "+f16" else f32),
                                  HALF=out == "+f16", num_warps=activation.NUM_WARPS, **PDL_KW)))
    for hq, hk, d in ((32, 8, 128), (8, 4, 256), (9, 3, 64)):
        for neox, norm_ in ((False, False), (True, False), (True, True)):
            args = [f32] * 6 + [i32, f32, f32, f32] + [d * (hq + 2 * hk), d] * 6 + [hq, hk, d, d, 1e-6]
            jobs.append(Job("rope", f"H={hq}+{hk} D={d} neox={int(neox)} norm={int(norm_)}",
                            _warm(rope._rope_kernel, args, NEOX=neox, HAS_K=True, TO_CACHE=True,
                                  BLOCK_H=4, BLOCK_D=d, HAS_NORM=norm_, num_warps=4, **PDL_KW)))
    for hq, hk, d, s in ((32, 8, 128, 4096), (8, 4, 256, 4096), (9, 3, 64, 2048)):
        c = decode_attention.decode_config(s, 1, hk, d)
        for rope_kw in ({}, {"ROPE": True, "NEOX": False, "HAS_NORM": False},
                        {"ROPE": True, "NEOX": True, "HAS_NORM": True}):
            args = [f32 if rope_kw else f16, f16, f16, i32, f32, f32, f32, hq * d, d, hk * d, d,
                    hk * d, d, s, hk, d, c.n_split, d**-0.5, 0,
                    f32, f32, d, d, f32, f32, f32, 1e-6, d]
            jobs.append(Job("decode_split" + ("+rope" if rope_kw else ""),
                            f"G={hq // hk} D={d} S={c.block_s} w={c.num_warps}"
                            + (f" neox={int(rope_kw['NEOX'])} norm={int(rope_kw['HAS_NORM'])}"
                               if rope_kw else ""),
                            _warm(decode_attention._decode_split_kernel, args, G=hq // hk,
                                  G_PAD=decode_attention.GROUP_ROWS, BLOCK_S=c.block_s,
                                  BLOCK_D=d, num_warps=c.num_warps, **rope_kw, **PDL_KW)))
        for quant in (False, True):
            jobs.append(Job("decode_combine" + ("+q8" if quant else ""), f"D={d} splits={c.n_split}",
                            _warm(decode_attention._decode_combine_kernel,
                                  [f32, f32, f32, f32, hq * d, d, hq, d, c.n_split, i32, f32, i32],
                                  BLOCK_SPLIT=triton.next_power_of_2(c.n_split), BLOCK_D=d,
                                  QUANT=quant, num_warps=4, **PDL_KW)))
    # (the one-sequence prefill is the paged kernel's: _paged_jobs)
    v = 262144
    n_blk = triton.cdiv(v, sampling.ARGMAX_BLOCK)
    jobs.append(Job("argmax_block", f"B={sampling.ARGMAX_BLOCK}",
                    _warm(sampling._argmax_block_kernel, [f32, f32, i32, v, v, n_blk],
                          BLOCK=sampling.ARGMAX_BLOCK, num_warps=8)))
    jobs.append(Job("argmax_final", f"B={triton.next_power_of_2(n_blk)}",
                    _warm(sampling._argmax_final_kernel, [f32, i32, i64, n_blk],
                          BLOCK=triton.next_power_of_2(n_blk), num_warps=4)))
    for k_pad in (64, 256):
        jobs.append(Job("topk_block", f"B={sampling.TOPK_BLOCK} K={k_pad}",
                        _warm(sampling._topk_block_kernel, [f32, i64, v, v, 64],
                              BLOCK=sampling.TOPK_BLOCK, K_PAD=k_pad, num_warps=8)))
        jobs.append(Job("topk_merge", f"M={sampling.TOPK_MERGE} K={k_pad}",
                        _warm(sampling._topk_merge_kernel, [i64, i64, 64, 4],
                              MERGE=sampling.TOPK_MERGE, K_PAD=k_pad, num_warps=8)))
    return jobs


def _paged_jobs() -> list[Job]:
    """The paged-cache attention kernels (block tables, blocks of 64 here; the block size is a
    runtime shift): the decode split kernel with PAGED at D = 64, 128, 256 and GQA groups 1..16,
    with and without the fused new token; the combine at B = 64 (one split: the batch alone
    fills the H200) with and without the QuantizedX; the varlen paged prefill at the same
    shapes, one launch and key-split (SPLIT: n_split 13, the rule for 150 tokens of llama 8B,
    and 16, a multiple of 16 specializes differently), and its combine (rows bounded by
    cu_q[B], empty splits' acc not read: ROWS, SPARSE; fp16 out, no PDL) at 13 splits and at
    the most the rule gives (16K // D); RoPE storing k/v at slots."""
    import importlib

    import torch
    import triton
    from triton.runtime.jit import MockTensor

    decode_attention, prefill_attention, rope = (
        importlib.import_module("deimos.kernels.triton." + m)
        for m in ("decode_attention", "prefill_attention", "rope")
    )
    f16, f32, i32, i64 = torch.float16, torch.float32, torch.int32, torch.int64
    maxb, bs_shift = 64, 6  # S = 4096
    s = maxb << bs_shift
    jobs = []
    for d in (64, 128, 256):
        for g in (1, 4, 8, 16):
            hk = 8 if g <= 4 else 2
            hq = g * hk
            c = decode_attention.decode_config(s, 8, hk, d)
            for rope_kw in ({}, {"ROPE": True, "NEOX": False, "HAS_NORM": False},
                            {"ROPE": True, "NEOX": True, "HAS_NORM": True}):  # fmt: skip
                args = [f32, f16, f16, i32, f32, f32, f32, hq * d, d, hk * d, d, hk * d, d, s, hk,
                        d, c.n_split, d**-0.5, 0, f32, f32, d, d, f32, f32, f32, 1e-6, d]
                paged = dict(PAGED=True, skn_b=(hq + 2 * hk) * d, svn_b=(hq + 2 * hk) * d,
                             p_tab=MockTensor(i32), stab_b=maxb, bs_shift=bs_shift)  # fmt: skip
                # the splits merged in the launch (the engine's decode steps), with the output
                # projection's integer activation where the step has one row
                for merge in ({}, dict(MERGE=True, p_count=MockTensor(i32), p_o=MockTensor(f16),
                                       so_b=hq * d, so_h=d, QUANT=bool(rope_kw), p_xq=MockTensor(i32),
                                       p_xd=MockTensor(f32), p_xs=MockTensor(i32))):  # fmt: skip
                    jobs.append(Job("paged_decode" + ("+rope" if rope_kw else "") + ("+merge" if merge else ""),
                                    f"G={g} D={d} S={c.block_s} w={c.num_warps}"
                                    + (f" neox={int(rope_kw['NEOX'])} norm={int(rope_kw['HAS_NORM'])}"
                                       if rope_kw else ""),
                                    _warm(decode_attention._decode_split_kernel, args, G=g,
                                          G_PAD=decode_attention.GROUP_ROWS, BLOCK_S=c.block_s,
                                          BLOCK_D=d, num_warps=c.num_warps, **rope_kw, **paged,
                                          **merge, **PDL_KW)))  # fmt: skip
        c = decode_attention.decode_config(s, 64, 8, d)
        for quant in (False, True):
            jobs.append(Job("decode_combine" + ("+q8" if quant else ""),
                            f"D={d} splits={c.n_split} (B=64)",
                            _warm(decode_attention._decode_combine_kernel,
                                  [f32, f32, f32, f32, 32 * d, d, 32, d, c.n_split, i32, f32, i32],
                                  BLOCK_SPLIT=triton.next_power_of_2(c.n_split), BLOCK_D=d,
                                  QUANT=quant, num_warps=4, **PDL_KW)))  # fmt: skip
        pc = prefill_attention.paged_prefill_config(d)
        for g in (1, 4, 8, 16):
            hk = 8 if g <= 4 else 2
            hq = g * hk
            args = [f32, f16, f16, f32, i32, i32, i32, i32, hq * d, d, hk * d, d, hk * d, d,
                    hq * d, d, maxb, d, d**-0.5, 0, bs_shift]
            jobs.append(Job("paged_prefill", f"G={g} D={d} M={pc.block_m} N={pc.block_n} "
                                             f"w={pc.num_warps} st={pc.num_stages}",
                            _warm(prefill_attention._paged_prefill_kernel, args, G=g,
                                  BLOCK_M=pc.block_m, BLOCK_N=pc.block_n, BLOCK_D=d,
                                  num_warps=pc.num_warps, num_stages=pc.num_stages)))
            for n_split in (13, 16):
                split = dict(SPLIT=True, n_split=n_split, p_m=MockTensor(f32),
                             p_l=MockTensor(f32), p_acc=MockTensor(f32))  # fmt: skip
                jobs.append(Job("paged_prefill+split",
                                f"G={g} D={d} M={pc.block_m} N={pc.block_n} w={pc.num_warps} "
                                f"st={pc.num_stages} splits={n_split}",
                                _warm(prefill_attention._paged_prefill_kernel, args, G=g,
                                      BLOCK_M=pc.block_m, BLOCK_N=pc.block_n, BLOCK_D=d,
                                      num_warps=pc.num_warps, num_stages=pc.num_stages,
                                      **split)))  # fmt: skip
        for n_split in (13, 16384 // d):
            jobs.append(Job("prefill_combine", f"D={d} splits={n_split} rows f16",
                            _warm(decode_attention._decode_combine_kernel,
                                  [f32, f32, f32, f16, 32 * d, d, 32, d, n_split, i32, f32, i32],
                                  BLOCK_SPLIT=triton.next_power_of_2(n_split), BLOCK_D=d,
                                  QUANT=False, ROWS=True, p_rows=MockTensor(i32), SPARSE=True,
                                  num_warps=4)))  # fmt: skip
    for hq, hk, d, slot_t in ((32, 8, 128, i32), (8, 4, 256, i32), (9, 3, 64, i64)):
        for neox, norm_ in ((False, False), (True, True)):
            args = [f32] * 6 + [i32, f32, f32, f32] + [d * (hq + 2 * hk), d] * 6 + [hq, hk, d, d, 1e-6]
            jobs.append(Job("rope+slots", f"H={hq}+{hk} D={d} neox={int(neox)} norm={int(norm_)} "
                                          f"slots={str(slot_t)[6:]}",
                            _warm(rope._rope_kernel, args, NEOX=neox, HAS_K=True, TO_CACHE=True,
                                  BLOCK_H=4, BLOCK_D=d, HAS_NORM=norm_, SLOTS=True,
                                  p_slot=MockTensor(slot_t), num_warps=4, **PDL_KW)))
    return jobs


def _describe(cfg: object) -> str:
    return f"N={cfg.block_n} S={cfg.block_s} warps={cfg.num_warps}"


def _sample_batch_jobs() -> list[Job]:
    """The batched sampler (kernels.triton.sample_batch) at vocabularies of 49,152, 151,936 and
    262,144 (12, 38, 64 blocks of 4096); launched without FMA contraction, as sample_rows does.
    Its merge passes are topk_merge K=256 above."""
    import importlib

    import torch
    import triton

    sb = importlib.import_module("deimos.kernels.triton.sample_batch")
    f32, f64, i32, i64 = torch.float32, torch.float64, torch.int32, torch.int64
    width = 64
    jobs = [Job("sb_penalize", f"L={sb.PEN_BLOCK} w=4",
                _warm(sb._penalize_kernel, [f32, 151936, 151936, i64, i32, f32, width, f32, f32, f32],
                      BLOCK_L=sb.PEN_BLOCK, num_warps=4, **sb.NO_FUSION))]
    for v in (49152, 151936, 262144):
        n_blk = triton.cdiv(v, sb.TOPK_BLOCK)
        for masked in (False, True):  # a graph's sampler reads the rows' masks (MASKED)
            what = f"V={v} B={sb.TOPK_BLOCK} K={sb.WINDOW} w=8 mask={int(masked)}"
            args = [f32, i64, f32, f64, i32, v, v, n_blk, f64, i32, (v + 31) // 32, i32]
            jobs.append(Job("sb_window_block", what,
                            _warm(sb._window_block_kernel, args,
                                  BLOCK=sb.TOPK_BLOCK, K_PAD=sb.WINDOW, MASKED=masked, num_warps=8,
                                  **sb.NO_FUSION)))
        jobs.append(Job("sb_window_merge", f"V={v} M={sb.TOPK_MERGE} K={sb.WINDOW} w=8",
                        _warm(sb._window_merge_kernel, [i64, i64, n_blk, 4, f64],
                              MERGE=sb.TOPK_MERGE, K_PAD=sb.WINDOW, num_warps=8)))
        nb_pad = max(2, triton.next_power_of_2(n_blk))
        args = [i64, f32, f64, i32, n_blk, v, f64, i32, f64, f64, f64, f32, v, i64, i32, f32, width,
                i64, f64, i64, f64, i64, i32]
        jobs.append(Job("sb_row", f"V={v} K={sb.WINDOW} CH={sb.RANK_CHUNK} NB={nb_pad} w=4",
                        _warm(sb._row_kernel, args, K=sb.WINDOW, CH=sb.RANK_CHUNK, NB_PAD=nb_pad,
                              BLOCK_L=sb.PEN_BLOCK, num_warps=4, **sb.NO_FUSION)))
    return jobs


def _moe_jobs() -> list[Job]:
    """The routed experts (kernels.triton.moe_route, quant.triton.moe_gemv / moe_gemm) at the
    configs their launch rules pick for qwen3moe 30B-A3B (n_embd 2048, n_ff_exp 768, E 128,
    k 8) at T = 1, 16, 64, 512 (and 2048, the default batch-token budget: block_m 64): the
    router and the combine; the decode GEMV per format on gate (768 x 2048), the fused gate/up
    (1536 x 2048) and down (2048 x 768, pair rows), on one stack and on chunked slots;
    moe_align's three passes; the grouped GEMM per format at each block_m the rule gives (x
    orders, chunked and masked variants below)."""
    import importlib

    import torch
    import triton
    from triton.runtime.jit import MockTensor

    from deimos.gguf.constants import GGMLType
    from deimos.quant.triton.dequant_gemv import FMT_ID, scale16, weight_arrays, words_per_group
    from deimos.quant.triton.layout import KERNEL_TYPE

    route = importlib.import_module("deimos.kernels.triton.moe_route")
    q = importlib.import_module("deimos.quant.triton.gemv_q8")
    mg = importlib.import_module("deimos.quant.triton.moe_gemm")
    mv = importlib.import_module("deimos.quant.triton.moe_gemv")
    f16, f32, i32 = torch.float16, torch.float32, torch.int32
    d_model, n_ff, n_exp, top_k = 2048, 768, 128, 8
    tokens = (1, 16, 64, 512, 2048)
    jobs = []
    for e, k in ((n_exp, top_k), (512, 16)):
        for renorm in (False, True):
            jobs.append(Job("moe_route", f"E={e} k={k} renorm={int(renorm)}",
                            _warm(route._route_kernel, [f32, f32, i32, e, e], TOP_K=k,
                                  K_PAD=triton.next_power_of_2(k), BLOCK_E=triton.next_power_of_2(e),
                                  RENORM=renorm, num_warps=1 if e <= 128 else 4, **PDL_KW)))
    for dt in (f32, f16):
        for add in (False, True):
            jobs.append(Job("moe_combine", f"D={d_model} k={top_k} out={str(dt)[6:]} add={int(add)}",
                            _warm(route._combine_kernel, [f32, f32, f32, dt, d_model], TOP_K=top_k,
                                  BLOCK_D=route.COMBINE_BLOCK, HAS_ADD=add, num_warps=4, **PDL_KW)))
    from triton.runtime.jit import MockTensor

    # qwen35moe's shared expert summed in the combine, its gate over x's 2048 columns
    jobs.append(Job("moe_combine", f"D={d_model} k={top_k} gated add",
                    _warm(route._combine_kernel, [f32, f32, f32, f32, d_model], TOP_K=top_k,
                          BLOCK_D=route.COMBINE_BLOCK, HAS_ADD=True, HAS_GATE=True, p_gx=MockTensor(f32),
                          p_gw=MockTensor(f32), stride_gx=d_model, DX=d_model,
                          BLOCK_X=route.COMBINE_BLOCK, num_warps=4, **PDL_KW)))
    gemv_shapes = ((n_ff, d_model, False), (2 * n_ff, d_model, False), (d_model, n_ff, True))
    i64 = torch.int64
    chunk_samples = (GGMLType.Q4_K, GGMLType.Q6_K, GGMLType.Q8_0)
    for t in [*FMT_ID, GGMLType.IQ4_XS, GGMLType.IQ2_XS]:
        kt = KERNEL_TYPE.get(t, t)
        for n, k, pair in gemv_shapes:
            sample = _packed_sample(t, k)
            arrays = weight_arrays(sample)
            cfg = mv.moe_gemv_tile(kt, n, k)
            even = k // 32 % cfg.block_s == 0
            # one stack; slots in the expert cache's chunks (only their base addresses differ:
            # three formats)
            for chunked in (False, True) if t in chunk_samples else (False,):
                args = [MockTensor(a.dtype) for a in arrays]
                args += [MockTensor(i64 if chunked else a.dtype) for a in arrays]
                args += [MockTensor(i32), MockTensor(f32), MockTensor(i32), MockTensor(f32),
                         MockTensor(i32), MockTensor(i32), n, k, n_exp, top_k]
                args += [a.stride(0) for a in arrays] + [4 if chunked else 1]
                jobs.append(Job("moe_gemv_" + t.name, f"{n}x{k} pair={int(pair)} " + _describe(cfg)
                                + f" xb={int(cfg.xb)} even={int(even)} chunked={int(chunked)}",
                                _warm_args(mv._moe_gemv_kernel, args, FMT=FMT_ID[kt],
                                           BLOCK_N=cfg.block_n, BLOCK_S=cfg.block_s, ASM=True,
                                           XB=cfg.xb, EVEN=even, SCALE16=scale16(sample),
                                           PAIR_ROWS=pair, CHUNKED=chunked, AHEAD=pair,
                                           num_warps=cfg.num_warps, **PDL_KW)))
            if not pair and t in chunk_samples:  # gate and up in one launch (moe_gemv_pair)
                two = {f"{p}2": MockTensor(a.dtype) for p, a in zip(("p_qw", "p_qh", "p_s", "p_d", "p_m"), arrays)}
                two |= {f"{p}2": MockTensor(a.dtype) for p, a in zip(("t_qw", "t_qh", "t_s", "t_d", "t_m"), arrays)}
                args = [MockTensor(a.dtype) for a in arrays] * 2
                args += [MockTensor(i32), MockTensor(f32), MockTensor(i32), MockTensor(f32),
                         MockTensor(i32), MockTensor(i32), n, k, n_exp, top_k]
                args += [a.stride(0) for a in arrays] + [1]
                jobs.append(Job("moe_gemv_" + t.name, f"{n}x{k} gate+up " + _describe(cfg),
                                _warm_args(mv._moe_gemv_kernel, args, FMT=FMT_ID[kt],
                                           BLOCK_N=cfg.block_n, BLOCK_S=cfg.block_s, ASM=True,
                                           XB=cfg.xb, EVEN=even, SCALE16=scale16(sample),
                                           PAIR_ROWS=False, CHUNKED=False, TWO=True,
                                           p_y2=MockTensor(f32), num_warps=cfg.num_warps,
                                           **two, **PDL_KW)))
    # the fused one-token step (quant.triton.moe_decode, kernels.triton.moe_router)
    md = importlib.import_module("deimos.quant.triton.moe_decode")
    mr = importlib.import_module("deimos.kernels.triton.moe_router")
    rt = mr.RouterTile()
    for e, k in ((n_exp, top_k), (512, 10)):
        jobs.append(Job("moe_router", f"E={e} D={d_model} k={k} " + str(tuple(rt)),
                        _warm(mr._router_kernel, [f32, f32, f32, i32, f32, i32, e, d_model, e // rt.block_e],
                              TOP_K=k, K_PAD=triton.next_power_of_2(k), BLOCK_E=rt.block_e,
                              BLOCK_D=rt.block_d, BLOCK_ALL=triton.next_power_of_2(e), RENORM=True,
                              num_warps=rt.num_warps, AHEAD=True, **PDL_KW)))
    for t in [*FMT_ID, GGMLType.IQ4_XS, GGMLType.IQ2_XS]:
        kt = KERNEL_TYPE.get(t, t)
        gate = _packed_sample(t, d_model)
        ga = weight_arrays(gate)
        cfg = md.gate_up_tile(kt, n_ff, d_model)
        args = [MockTensor(a.dtype) for a in ga] * 2 + [MockTensor(i32), MockTensor(f32), MockTensor(i32)] * 2
        args += [MockTensor(i32), MockTensor(i32), n_ff, d_model, n_exp, top_k] + [a.stride(0) for a in ga] * 2
        jobs.append(Job("moe_gate_up_" + t.name, f"{n_ff}x{d_model} " + _describe(cfg),
                        _warm_args(md._moe_gate_up_kernel, args, FMT_G=FMT_ID[kt], FMT_U=FMT_ID[kt],
                                   SCALE16_G=scale16(gate), SCALE16_U=scale16(gate), ACT=0,
                                   BLOCK_N=cfg.block_n, BLOCK_S=cfg.block_s, ASM=True, XB=cfg.xb,
                                   EVEN=d_model // 32 % cfg.block_s == 0, num_warps=cfg.num_warps,
                                   **PDL_KW)))
        down = _packed_sample(t, n_ff)
        da = weight_arrays(down)
        cfg = q.q8_config(kt, d_model, n_ff, 1)
        args = [MockTensor(a.dtype) for a in da] + [MockTensor(i32), MockTensor(f32), MockTensor(i32),
                                                    MockTensor(f32), MockTensor(i32), MockTensor(i32),
                                                    MockTensor(f32), d_model, n_ff, n_exp]
        args += [a.stride(0) for a in da]
        jobs.append(Job("moe_down_combine_" + t.name, f"{d_model}x{n_ff} k={top_k} " + _describe(cfg),
                        _warm_args(md._moe_down_combine_kernel, args, TOP_K=top_k, FMT=FMT_ID[kt],
                                   SCALE16=scale16(down), BLOCK_N=cfg.block_n, BLOCK_S=cfg.block_s,
                                   ASM=True, XB=cfg.xb, EVEN=n_ff // 32 % cfg.block_s == 0,
                                   num_warps=cfg.num_warps, **PDL_KW)))
    block_ms = sorted({mg.moe_block_m(t * top_k, n_exp) for t in tokens})
    for t in tokens:
        p = t * top_k
        bm = mg.moe_block_m(p, n_exp)
        nc = triton.cdiv(p, mg.ALIGN_CHUNK)
        cfg = f"P={p} E={n_exp} M={bm}"
        jobs.append(Job("moe_align_count", cfg,
                        _warm(mg._align_count_kernel, [i32, i32, p, n_exp], CHUNK=mg.ALIGN_CHUNK,
                              E_BLOCK=64, num_warps=4, **PDL_KW)))
        jobs.append(Job("moe_align_scan", cfg + f" NC={mg.scan_blocks(nc, bm)['NC_PAD']}",
                        _warm(mg._align_scan_kernel, [i32] * 5 + [nc, n_exp, mg.max_tiles(p, n_exp, bm)],
                              BLOCK_M=bm, **mg.scan_blocks(nc, bm), num_warps=4, **PDL_KW)))
        jobs.append(Job("moe_align_scatter", cfg,
                        _warm(mg._align_scatter_kernel, [i32, i32, i32, p, n_exp],
                              CHUNK=mg.ALIGN_CHUNK, num_warps=4, **PDL_KW)))
    gemm_shapes = ((n_ff, d_model, False), (2 * n_ff, d_model, False), (d_model, n_ff, True))
    mmq_types = importlib.import_module("deimos.quant.triton.mmq").MMQ_TYPES
    for t in [*FMT_ID, GGMLType.IQ4_XS, GGMLType.IQ2_XS]:
        kt = KERNEL_TYPE.get(t, t)
        wpg = words_per_group(kt)
        # x permuted for gate/up (the InputCache's copy), in element order for down (gated_act's
        # fp16 output as it is); at three formats also the other orders, masked K steps and
        # slots in the expert cache's chunks. (K is not specialized on: 768 and 2048 are both
        # multiples of 16; at these sizes the steps divide K: EVEN)
        launches = set()
        for n, k, pair in gemm_shapes:
            for bm in block_ms:
                c = mg.moe_gemm_config(kt, n, k, bm)
                even = k // 32 % (c.block_j // wpg) == 0
                launches.add((bm, c, pair, not pair, even, k, False))
                if t in chunk_samples:
                    launches.add((bm, c, pair, pair, even, k, False))
                    launches.add((bm, c, pair, not pair, even, k, True))
                    launches.add((bm, c, pair, not pair, False, k, False))
        for bm, c, pair, perm, even, k, chunked in sorted(launches):
            sample = _packed_sample(t, k)
            arrays = weight_arrays(sample)
            args = [MockTensor(f16)] + [MockTensor(a.dtype) for a in arrays]
            args += [MockTensor(i64 if chunked else a.dtype) for a in arrays]
            args += [MockTensor(f32), MockTensor(i32), MockTensor(i32), MockTensor(i32), d_model, k,
                     top_k, k] + [a.stride(0) for a in arrays] + [4 if chunked else 1]
            # Q4_K, Q5_K, Q6_K and Q8_0's layout also through deimos.quant.triton.mmq (Q4_K by
            # default, the others with mmq=True)
            for mmq in (False, True) if kt in mmq_types and k % 256 == 0 else (False,):
                jobs.append(Job("moe_gemm_" + t.name,
                                f"M={bm} N={c.block_n} J={c.block_j} w={c.num_warps} st={c.num_stages} "
                                f"K={k} pair={int(pair)} perm={int(perm)} even={int(even)} "
                                f"chunked={int(chunked)} mmq={int(mmq)}",
                                _warm_args(mg._moe_gemm_kernel, args, FMT=FMT_ID[kt], BLOCK_M=bm,
                                           BLOCK_N=c.block_n, BLOCK_J=c.block_j, PAIR_ROWS=pair,
                                           X_PERMUTED=perm, EVEN=even, SCALE16=scale16(sample),
                                           CHUNKED=chunked, ASM=True, MMQ=mmq, num_warps=c.num_warps,
                                           num_stages=c.num_stages, **PDL_KW)))
    return jobs


def _shared_gate_jobs() -> list[Job]:
    """The shared expert's gate and the MoE sum (kernels.triton.shared_gate) at qwen35moe's
    D = 2048 and qwen3next's; gated attention's output gate (kernels.triton.output_gate) at
    qwen35's 16 heads of 256."""
    import importlib

    import torch

    sg = importlib.import_module("deimos.kernels.triton.shared_gate")
    f32, i32 = torch.float32, torch.int32
    og = importlib.import_module("deimos.kernels.triton.output_gate")
    jobs = [Job("output_gate", f"H=16 D=256 quant={int(quant)}",
                _warm(og._output_gate_kernel, [f32, f32, 8192, 512, f32, 16, i32, f32, i32],
                      H=16, DH=256, BLOCK_R=16, QUANT=quant, num_warps=4, **PDL_KW))
            for quant in (False, True)]
    return jobs + [Job("shared_gate", "D=2048 w=4",
                _warm(sg._shared_gate_kernel, [f32, f32, f32, f32, f32, 2048, 2048, 2048, 2048, 2048],
                      BLOCK_D=2048, num_warps=4, **PDL_KW))]


def _host_link_jobs() -> list[Job]:
    """The offload's device-host handshake (kernels.triton.host_link) at qwen3moe's k = 8, and
    its promotions' batched copy (kernels.triton.copy_ranges) at each word size."""
    import importlib

    import torch

    hl = importlib.import_module("deimos.kernels.triton.host_link")
    i32, f32 = torch.int32, torch.float32
    jobs = []
    for bump in (True, False):
        jobs.append(Job("host_post", f"k=8 bump={int(bump)}",
                        _warm(hl._post_kernel, [i32, f32, f32, i32, f32, f32, i32, i32, i32, 1, 8, 2048],
                              BUMP=bump, BLOCK_K=8, BLOCK_D=1024, N_THREADS=128, ASM=True,
                              num_warps=4)))
    jobs.append(Job("host_wait", "D=2048",
                    _warm(hl._wait_kernel, [i32, i32, i32, f32, f32, 2048, 3, hl.MAX_SPIN],
                          BLOCK_D=1024, ASM=True, num_warps=4)))
    sf = importlib.import_module("deimos.kernels.triton.step_feed")  # a decode graph's inputs
    for b in (1, 128):
        jobs.append(Job("decode_slots", f"B={b}",
                        _warm(sf._decode_slots_kernel, [i32, torch.int64, torch.int64, b, 64, 16],
                              BLOCK=b, num_warps=1, **PDL_KW)))
        jobs.append(Job("feed", f"B={b}", _warm(sf._feed_kernel, [torch.int64] * 3 + [b], BLOCK=b,
                                                 num_warps=1, **PDL_KW)))
    cr = importlib.import_module("deimos.kernels.triton.copy_ranges")
    for word, dt in ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8)):
        jobs.append(Job("copy_ranges", f"word={word}",
                        _warm(cr._copy_ranges, [torch.int64, dt], WORD=word, BLOCK=cr.BLOCK_BYTES // word)))
    return jobs


def _gated_delta_jobs() -> list[Job]:
    """The gated delta rule (kernels.triton.gated_delta_decode / gated_delta_prefill) at Qwen3.5 /
    Qwen3-Next heads (Dk = Dv = 128; 16 key heads for 32 value heads, grouped and tiled),
    bf16 and float32 inputs; the prefill's dots in ieee and tf32; the block's fused inputs
    (kernels.triton.gdn_inputs: conv, norms, gates over those heads' 8192 channels, K = 4) and
    its gated output norm (kernels.triton.gated_norm)."""
    import importlib

    import torch

    dec = importlib.import_module("deimos.kernels.triton.gated_delta_decode")
    pre = importlib.import_module("deimos.kernels.triton.gated_delta_prefill")
    f32, bf16, i32 = torch.float32, torch.bfloat16, torch.int32
    hk, hv, d = 16, 32, 128
    jobs = []
    for x in (bf16, f32):
        for tiled in (False, True):
            bv = dec.decode_block_v(d, d)
            jobs.append(Job("gdn_decode", f"H={hv}/{hk} D={d} BV={bv} {str(x)[6:]} tiled={int(tiled)}",
                            _warm(dec._decode_kernel, [x, x, x, x, x, x, f32, i32, d**-0.5],
                                  HK=hk, HV=hv, DK=d, DV=d, BLOCK_V=bv, TILED=tiled,
                                  num_warps=4, **PDL_KW)))
    c = (2 * hk + hv) * d  # the convolution's channels: q, k and v
    gi = importlib.import_module("deimos.kernels.triton.gdn_inputs")
    for x, one, snap in ((f32, True, False), (f32, False, False), (bf16, False, False),
                         (bf16, False, True)):
        jobs.append(Job("gdn_inputs", f"H={hv}/{hk} D={d} K=4 {str(x)[6:]} one_row={int(one)} "
                        f"snap={int(snap)}",
                        _warm(gi._inputs_kernel, [x, c, f32, f32, i32, i32, i32, x, 2 * hv, 0, x,
                                                  2 * hv, 0, f32, f32, f32, 512, f32, f32, 1e-6],
                              HK=hk, HV=hv, DH=d, K=4, R=hv, BLOCK_H=hv, BLOCK_T=1 if one else gi.BLOCK_T,
                              ONE_ROW=one, SNAP=snap, num_warps=8, **PDL_KW)))
    gn = importlib.import_module("deimos.kernels.triton.gated_norm")
    for z, quant in ((f32, False), (bf16, False), (f32, True)):
        jobs.append(Job("gated_norm", f"H={hv} D={d} z={str(z)[6:]} quant={int(quant)}",
                        _warm(gn._gated_norm_kernel, [f32, z, hv * d, f32, f32, 512 * hv, 1e-6,
                                                      i32, f32, i32],
                              HV=hv, DH=d, BLOCK_R=32, QUANT=quant, num_warps=4, **PDL_KW)))
    bv, warps = pre.prefill_config(d, d)
    for x, prec, snap in ((bf16, "ieee", False), (f32, "ieee", False), (f32, "tf32", False),
                          (f32, "tf32", True)):
        tag = f"{str(x)[6:]} {prec} snap={int(snap)}"
        jobs.append(Job("gdn_chunk", f"H={hv}/{hk} D={d} w={pre.CHUNK_WARPS} {tag}",
                        _warm(pre._chunk_kernel, [x, x, x, x, x, i32, i32, f32, f32, f32, f32],
                              HK=hk, HV=hv, DK=d, DV=d, BT=pre.CHUNK, BLOCK_DV=d, TILED=False,
                              PRECISION=prec, SNAP=snap, num_warps=pre.CHUNK_WARPS)))
        jobs.append(Job("gdn_state", f"H={hv}/{hk} D={d} BV={bv} w={warps} {tag}",
                        _warm(pre._state_kernel, [x, x, x, f32, i32, i32, i32, f32, f32, f32, f32,
                                                  d**-0.5],
                              HK=hk, HV=hv, DK=d, DV=d, BT=pre.CHUNK, BLOCK_V=bv, TILED=False,
                              PRECISION=prec, SNAP=snap, num_warps=warps,
                              num_stages=pre.STATE_STAGES)))
    return jobs


def _resources(cubin: bytes) -> tuple[str, str]:
    """(registers, spill bytes) read from the cubin with Triton's cuobjdump."""
    import triton.backends.nvidia as nv

    tool = Path(nv.__file__).parent / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run(
            [str(tool), "--dump-resource-usage", f.name], capture_output=True, text=True
        ).stdout
    reg = re.search(r"REG:(\d+)", out)
    local = re.search(r"LOCAL:(\d+)", out)
    return (reg.group(1) if reg else "?", local.group(1) if local else "?")


def _family(name: str) -> tuple[str, str]:
    """A job's kernel and format: ("gemv_rows", "Q4_K") for gemv_rows_Q4_K, (name, "") for a
    kernel without one."""
    from deimos.gguf.constants import GGMLType

    for t in GGMLType:
        if name.endswith("_" + t.name):
            return name[: -len(t.name) - 1], t.name
    return name, ""


def cover(jobs: list[Job]) -> list[Job]:
    """Each (kernel, config) once, its format chosen in turn among the formats with that config,
    plus a job of every (kernel, format) the first pass left out; the job list's order kept."""
    by_config: dict[tuple[str, str], list[int]] = {}
    for i, job in enumerate(jobs):
        by_config.setdefault((_family(job.name)[0], job.config), []).append(i)
    turn: dict[str, int] = {}
    keep = set()
    for (family, _), idx in by_config.items():
        k = turn.get(family, 0)
        keep.add(idx[k % len(idx)])
        turn[family] = k + 1
    seen = {jobs[i].name for i in keep}
    for i, job in enumerate(jobs):
        if job.name not in seen:
            keep.add(i)
            seen.add(job.name)
    return [job for i, job in enumerate(jobs) if i in keep]


def _compile_share(index: int, of: int, verbose: bool, match: str = "",
                   covering: bool = False) -> list[Row]:
    """Compile jobs index, index + of, ... of the job list (in a worker process, or all of it);
    ``match``: only the kernels whose name contains it; ``covering``: the list's cover()."""
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver

    driver.set_active(_StubDriver(GPUTarget("cuda", TARGET_ARCH, 32)))
    rows = []
    jobs = [j for j in _jobs() if match in j.name]
    for job in (cover(jobs) if covering else jobs)[index::of]:
        t0 = time.perf_counter()
        try:
            kernel = job.run()
            seconds = time.perf_counter() - t0
            shared = int(kernel.metadata.shared)
            regs, spills = _resources(kernel.asm["cubin"])
            ok = shared <= H200_SHARED_PER_BLOCK
            err = "" if ok else f"needs {shared} bytes of shared memory > {H200_SHARED_PER_BLOCK}"
            rows.append(Row(job.name, job.config, ok, regs, spills, shared, seconds, err))
        except Exception as e:  # noqa: BLE001 - every failure is reported in the table
            if verbose:
                traceback.print_exc()
            msg = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
            seconds = time.perf_counter() - t0
            rows.append(Row(job.name, job.config, False, "-", "-", 0, seconds, msg))
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--verbose", action="store_true", help="print tracebacks of failures")
    ap.add_argument("--match", default="", help="only the kernels whose name contains this")
    ap.add_argument("--cover", action="store_true",
                    help="each kernel's every config once, in one of its formats (see above)")
    ap.add_argument("--jobs", type=int, default=len(os.sched_getaffinity(0)),
                    help="worker processes (default: the CPUs this process may use)")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("compile_kernels: unset TRITON_INTERPRET (the interpreter compiles nothing)")
        return 2

    import triton

    jobs = max(1, args.jobs)
    if jobs == 1:
        rows = _compile_share(0, 1, args.verbose, args.match, args.cover)
    else:  # worker processes, each with every job list and its share of it (spawned: fresh JIT state)
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(jobs, mp_context=mp.get_context("spawn")) as ex:
            parts = list(ex.map(_compile_share, range(jobs), [jobs] * jobs, [args.verbose] * jobs,
                                [args.match] * jobs, [args.cover] * jobs))
        rows = [None] * sum(len(p) for p in parts)
        for i, part in enumerate(parts):
            rows[i::jobs] = part

    print(f"triton {triton.__version__}, target sm_{TARGET_ARCH}"
          + (" (--cover: each config once)" if args.cover else ""))
    head = f"{'kernel':<15} {'config':<34} {'regs':>5} {'spill':>6} {'shared':>7} {'time s':>7}"
    print(head + "  status")
    for r in rows:
        status = "ok" if r.ok else "FAIL " + r.error
        print(
            f"{r.name:<15} {r.config:<34} {r.regs:>5} {r.spills:>6} {r.shared:>7} "
            f"{r.seconds:>7.2f}  {status}"
        )
    failed = [r for r in rows if not r.ok]
    print(f"{len(rows) - len(failed)}/{len(rows)} compiled within limits")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
