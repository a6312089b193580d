"""y = a @ b^T (Triton) for fp16 ``a [M, K]`` and ``b [N, K]``, fp32 ``y``: on the tensor cores
(``matmul_f16``), and for one row of a (``gemv_f16``, the float-weight linears' decode: a
stream of b). Oracle: ``matmul_reference`` (float64 product of the same fp16 inputs).

The float-weight linears and the long-prefill second half of the packed formats' two-phase
path (a weight dequantized to fp16 by ``dequantize_fp16``, then this product) run here.
Tiles of ``block_m x block_n`` outputs, ``block_k`` of K a step, Triton's software pipeline
for the loads (``num_stages``); program ids grouped ``GROUP_M`` row tiles at a time so the
b tiles a group reads stay in L2. Rows past M or N are clamped for loading (no masks in the
loop) and never stored; a K that ``block_k`` does not divide masks the loop's loads. Both
kernels are launched with programmatic dependent launch where the GPU has it, their first b
tile loaded before the wait (deimos.quant.triton.pdl's ``ahead``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from deimos.quant.triton.dequant_gemv import pow2_at_most
from deimos.quant.triton.pdl import ahead_on, launch_options, pdl_on, pdl_start
from deimos.switches import env_switch

GROUP_M = 8
# prefill's tiles (past 256 rows) through _matmul_tma_kernel on GPUs that have TMA (sm_90 on);
# DEIMOS_MATMUL_TMA=0 the pointer loads (bench/exp_matmul_tma.py, H100, session 51: 5-27% faster
# on llama 8B's four matrices at 512 and 2,048 rows; llama 8B at 16 / 64 requests +2% / +4%)
TMA_ON = env_switch("DEIMOS_MATMUL_TMA", True)
# 128 x 256 TMA tiles from this many of them (fewer: 128 x 128, twice the programs). H100,
# session 51, 512 rows: 96 tiles ([6144, 4096]) 46.6 us against 56.0, 64 ([4096, 4096]) 44.2
# against 30.7
WIDE_TILES = 96


class MatmulConfig(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    splits: int = 1  # K ranges computed by separate programs, summed in order by the last
    tma: bool = False  # tiles loaded by the tensor memory accelerator (_matmul_tma_kernel; no splits)


MAX_SPLITS = 8
MAX_SPLIT_PROGRAMS = 1024  # tiles x splits of a split launch: what SplitScratch holds


class SplitScratch:
    """What split-K launches on one device need: a counter a tile (zeros between launches:
    each tile's last program resets its own) and room for the partial tiles. One per model
    (its InputCache), made before any graph capture; launches on one stream in turn share it
    (with PDL a launch touches the scratch only after its wait, when the one before is done)."""

    def __init__(self, device: torch.device | str) -> None:
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:  # "cuda" is the current one: cuda:N
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.counters = torch.zeros(MAX_SPLIT_PROGRAMS, dtype=torch.int32, device=device)
        self.partials = torch.empty(MAX_SPLIT_PROGRAMS * 64 * 64, dtype=torch.float32, device=device)
        self.n_sm = (torch.cuda.get_device_properties(device).multi_processor_count
                     if device.type == "cuda" else 4)  # fmt: skip


def split_count(tiles: int, k: int, block_k: int, n_sm: int) -> int:
    """K splits for a launch of ``tiles`` programs on ``n_sm`` SMs: none when the tiles fill
    the SMs; else enough for ~2 programs an SM, each split at least 4 K steps, at most
    MAX_SPLITS (a 16-row step's narrow matrices: 64 tiles of 4096 x 4096 on 132 SMs leave half
    the SMs idle and the rest short of loads in flight)."""
    if tiles >= n_sm:
        return 1
    return max(1, min(MAX_SPLITS, -(-2 * n_sm // tiles), k // (4 * block_k), MAX_SPLIT_PROGRAMS // tiles))


@triton.jit
def tile_of(tile, tiles_m, tiles_n, GROUP: tl.constexpr):
    """Tile index -> (row tile, column tile), taken GROUP row tiles at a time so that the b
    tiles a group reads stay in L2."""
    per_group = GROUP * tiles_n
    first_m = (tile // per_group) * GROUP
    rows = tl.minimum(tiles_m - first_m, GROUP)
    return first_m + (tile % per_group) % rows, (tile % per_group) // rows


@triton.jit
def load_k(p, k0, o_k, K, EVEN_K: tl.constexpr):
    """The ``[rows, BLOCK_K]`` tile at pointers ``p`` (K step k0, columns k0 + o_k): as is
    where the steps divide K (EVEN_K), else with the columns past K read as 0."""
    if EVEN_K:
        b = tl.load(p)
    else:
        b = tl.load(p, mask=(k0 + o_k < K)[None, :], other=0.0)
    return b


@triton.jit
def _matmul_kernel(
    p_a, p_b, p_y, p_part, p_count, M, N, K, K_SPLIT, stride_am, stride_bn, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
    EVEN_K: tl.constexpr, SPLITS: tl.constexpr, PDL: tl.constexpr = False,
    AHEAD: tl.constexpr = False,
):  # fmt: skip
    """AHEAD (with PDL): the first K step's b tile (the weight: no kernel of the step writes
    it) loaded before the wait (deimos.quant.triton.pdl), a and the scratch after it."""
    if not AHEAD:
        pdl_start(PDL)
    pid = tl.program_id(0)
    i_m, i_n = tile_of(pid, tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP)
    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    o_k = tl.arange(0, BLOCK_K)
    r_m = tl.minimum(o_m, M - 1).to(tl.int64)
    r_n = tl.minimum(o_n, N - 1).to(tl.int64)
    if SPLITS == 1:
        k_lo = 0
        k_hi = K
    else:
        k_lo = tl.program_id(1) * K_SPLIT
        k_hi = tl.minimum(k_lo + K_SPLIT, K)
    p_at = p_a + r_m[:, None] * stride_am + (k_lo + o_k)[None, :]
    p_bt = p_b + r_n[:, None] * stride_bn + (k_lo + o_k)[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    first = k_lo
    if AHEAD:  # the first step peeled (masked: a split past K has no step)
        m_k = (k_lo + o_k < k_hi)[None, :]
        b_b = tl.load(p_bt, mask=m_k, other=0.0)
        pdl_start(True)
        b_a = tl.load(p_at, mask=m_k, other=0.0)
        acc = tl.dot(b_a, tl.trans(b_b), acc, out_dtype=tl.float32)
        p_at += BLOCK_K
        p_bt += BLOCK_K
        first = k_lo + BLOCK_K
    for k0 in range(first, k_hi, BLOCK_K):
        b_a = load_k(p_at, k0, o_k, K, EVEN_K)
        b_b = load_k(p_bt, k0, o_k, K, EVEN_K)
        acc = tl.dot(b_a, tl.trans(b_b), acc, out_dtype=tl.float32)
        p_at += BLOCK_K
        p_bt += BLOCK_K
    p_out = p_y + o_m[:, None].to(tl.int64) * stride_ym + o_n[None, :]
    m_out = (o_m < M)[:, None] & (o_n < N)[None, :]
    if SPLITS == 1:
        tl.store(p_out, acc, mask=m_out)
    else:
        # this split's partial tile; the tile's last program to finish sums all of them in
        # split order (the same sum whichever finishes last) and resets the tile's counter
        tile: tl.constexpr = BLOCK_M * BLOCK_N
        o_t = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        p_tile = p_part + pid.to(tl.int64) * (SPLITS * tile) + o_t
        tl.store(p_tile + tl.program_id(1) * tile, acc, cache_modifier=".cg")
        tl.debug_barrier()  # every thread's partial stored before the count says so
        done = tl.atomic_add(p_count + pid, 1, sem="acq_rel", scope="gpu")
        if done == SPLITS - 1:
            total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for i in range(SPLITS):
                total += tl.load(p_tile + i * tile, cache_modifier=".cg")
            tl.store(p_out, total, mask=m_out)
            tl.atomic_xchg(p_count + pid, 0, sem="relaxed", scope="gpu")


@triton.jit
def _matmul_tma_kernel(a_desc, b_desc, p_y, M, N, K, stride_ym, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
                       PDL: tl.constexpr = False):  # fmt: skip
    """_matmul_kernel's product (one tile a program, the same grouping, K in order) with a's
    and b's tiles loaded through tensor descriptors: the TMA unit copies each [BLOCK, BLOCK_K]
    tile to shared memory (zeros past M, N and K), no per-thread address math or masks."""
    pdl_start(PDL)
    pid = tl.program_id(0)
    i_m, i_n = tile_of(pid, tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        b_a = a_desc.load([i_m * BLOCK_M, k0])
        b_b = b_desc.load([i_n * BLOCK_N, k0])
        acc = tl.dot(b_a, tl.trans(b_b), acc, out_dtype=tl.float32)
    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    p_out = p_y + o_m[:, None].to(tl.int64) * stride_ym + o_n[None, :]
    tl.store(p_out, acc, mask=(o_m < M)[:, None] & (o_n < N)[None, :])


def tma_fits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether a and b can be read through tensor descriptors: a GPU with TMA (sm_90 on; or the
    interpreter), 16-byte aligned starts and row strides (the TMA unit's rule)."""
    if a.device.type == "cuda" and torch.cuda.get_device_capability(a.device)[0] < 9:
        return False
    return all(t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0 for t in (a, b))


def matmul_config(m: int, n: int, k: int, tma: bool = TMA_ON) -> MatmulConfig:
    """The launch rule, from bench/sweep_gemm.py and bench/sweep_dense.py on the H200
    (2026-11-29, llama 8B's matrices at M = 1, 16, 128, 512; BENCHMARKS.md): 16-row tiles
    with long K steps up to 16 rows (the best tile at every N there), then 128-row tiles,
    64 wide for the narrow matrices at ~128 rows (more programs), 256 wide for the wide ones,
    128 x 128 from 256 rows on. 17-64 rows: 64 x 64, between the measured ends. Past 256 rows
    the TMA kernel where ``tma`` (``TMA_ON``, and the operands fit it: ``tma_fits``; its tiles
    are not the pointer kernel's) (bench/exp_matmul_tma.py, H100, session 51): 128 x 256 with 8
    warps where that makes ``WIDE_TILES`` tiles (3 stages past 1,024 rows: 755.7 against
    782.4 us on [28672, 4096] at 2,048 rows, 4 below), else 128 x 128 with 4 warps. The
    pointer kernel past 1,024 rows: 128 x 256 with 8 warps (bench/sweep_dense.py, H100,
    session 50: 888 against 991 us on [28672, 4096])."""
    del k
    if m <= 16:
        return MatmulConfig(16, 64, 128, 4, 4)
    if m <= 64:
        return MatmulConfig(64, 64, 64, 4, 4)
    if m <= 256:
        return MatmulConfig(128, 256, 64, 8, 3) if n >= 16384 else MatmulConfig(128, 64, 64, 4, 4)
    if tma:
        if triton.cdiv(m, 128) * triton.cdiv(n, 256) >= WIDE_TILES:
            return MatmulConfig(128, 256, 64, 8, 3 if m > 1024 else 4, tma=True)
        return MatmulConfig(128, 128, 64, 4, 4, tma=True)
    if m > 1024:
        return MatmulConfig(128, 256, 64, 8, 3)
    return MatmulConfig(128, 128, 64, 4, 4)


def matmul_f16(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None,
               cfg: MatmulConfig | None = None, scratch: SplitScratch | None = None,
               ahead: bool = False) -> torch.Tensor:
    """float32 ``[M, N]`` = a ``[M, K]`` @ b ``[N, K]``^T, both fp16 with unit column stride
    (rows may be strided), on the same CUDA device (or the interpreter). ``out``: optional
    float32 ``[M, N]`` with unit column stride. ``scratch``: the device's SplitScratch; with
    it the rule may split K (``split_count``; a ``cfg`` with splits > 1 makes a scratch of its
    own without). Deterministic: a split tile's partials are summed in split order.
    ``ahead``: the caller's promise that b is a weight no kernel of the step writes (not a
    matrix just dequantized): with PDL its first tile is loaded before the wait, in the
    16-row tiles of decode batches (larger tiles would need more shared memory for it:
    tools/compile_kernels.py, 64 x 64 at 80 KB instead of 64)."""
    m, k, n = _check(a, b, "matmul_f16")
    out = _out(out, m, n, a.device, "matmul_f16")
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    if cfg is None:
        cfg = matmul_config(m, n, k, tma=TMA_ON and m > 256 and tma_fits(a, b))
        if scratch is not None and m <= 64:
            tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
            cfg = cfg._replace(splits=split_count(tiles, k, cfg.block_k, scratch.n_sm))
    elif not (all(pow2_at_most(v, 256) and v >= 16 for v in cfg[:3])
              and cfg.num_warps in (1, 2, 4, 8) and 1 <= cfg.num_stages <= 5
              and 1 <= cfg.splits <= MAX_SPLITS and not (cfg.tma and cfg.splits > 1)):  # fmt: skip
        raise ValueError(f"matmul_f16: bad tile {cfg} (block_m, block_n, block_k powers of two in "
                         f"16..256, num_warps 1, 2, 4 or 8, 1..5 stages, 1..{MAX_SPLITS} splits, "
                         "one with tma)")
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    if cfg.tma and cfg.splits == 1 and tma_fits(a, b):
        a_desc = TensorDescriptor.from_tensor(a, [cfg.block_m, cfg.block_k])
        b_desc = TensorDescriptor.from_tensor(b, [cfg.block_n, cfg.block_k])
        _matmul_tma_kernel[(tiles,)](
            a_desc, b_desc, out, m, n, k, out.stride(0), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
            BLOCK_K=cfg.block_k, GROUP=GROUP_M, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
            **launch_options(pdl_on(a.device)),
        )  # fmt: skip
        return out
    k_split = k
    part, count = out, out  # unused without splits
    if cfg.splits > 1:
        if tiles * cfg.splits > MAX_SPLIT_PROGRAMS or cfg.block_m * cfg.block_n > 64 * 64:
            raise ValueError(f"matmul_f16: {tiles} tiles x {cfg.splits} splits of {cfg.block_m}x"
                             f"{cfg.block_n} outputs exceed the split scratch ({MAX_SPLIT_PROGRAMS} "
                             "programs of at most 64x64)")
        if scratch is None:
            scratch = SplitScratch(a.device)
        elif scratch.device != a.device:
            raise ValueError(f"matmul_f16: the split scratch is on {scratch.device}, a on {a.device}")
        k_split = triton.cdiv(triton.cdiv(k, cfg.block_k), cfg.splits) * cfg.block_k
        part, count = scratch.partials, scratch.counters
    _matmul_kernel[(tiles, cfg.splits)](
        a, b, out, part, count, m, n, k, k_split, a.stride(0), b.stride(0), out.stride(0),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP=GROUP_M,
        EVEN_K=k % cfg.block_k == 0, SPLITS=cfg.splits, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, AHEAD=ahead and cfg.block_m == 16 and ahead_on(a.device),
        **launch_options(pdl_on(a.device)),
    )  # fmt: skip
    return out


class GemvConfig(NamedTuple):
    block_n: int  # rows of b a program
    block_k: int  # columns a step
    num_warps: int


@triton.jit
def _gemv_kernel(p_a, p_b, p_y, N, K, stride_bn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 EVEN_K: tl.constexpr, PDL: tl.constexpr = False, AHEAD: tl.constexpr = False):  # fmt: skip
    """y[n] = sum_k a[k] b[n, k]: products summed elementwise in float32 over the K steps,
    reduced once at the end; rows past N clamped for loading, never stored. AHEAD (with PDL):
    the first step's b loaded before the wait, as ``_matmul_kernel``'s."""
    if not AHEAD:
        pdl_start(PDL)
    o_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    o_k = tl.arange(0, BLOCK_K)
    p_bt = p_b + tl.minimum(o_n, N - 1).to(tl.int64)[:, None] * stride_bn + o_k[None, :]
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    first = 0
    if AHEAD:
        m_k = o_k < K
        b_b = tl.load(p_bt, mask=m_k[None, :], other=0.0)
        pdl_start(True)
        b_a = tl.load(p_a + o_k, mask=m_k, other=0.0)
        acc += b_b.to(tl.float32) * b_a.to(tl.float32)[None, :]
        p_bt += BLOCK_K
        first = BLOCK_K
    for k0 in range(first, K, BLOCK_K):
        if EVEN_K:
            b_b = tl.load(p_bt)
            b_a = tl.load(p_a + k0 + o_k)
        else:
            m_k = k0 + o_k < K
            b_b = tl.load(p_bt, mask=m_k[None, :], other=0.0)
            b_a = tl.load(p_a + k0 + o_k, mask=m_k, other=0.0)
        acc += b_b.to(tl.float32) * b_a.to(tl.float32)[None, :]
        p_bt += BLOCK_K
    tl.store(p_y + o_n, tl.sum(acc, axis=1), mask=o_n < N)


def gemv_config(n: int, k: int) -> GemvConfig:
    """The launch rule, from bench/sweep_dense.py on the H200 (2026-11-29, llama 8B's four
    matrix shapes, 9 tiles): 2 rows x 1024 columns a step, within 8% of the best tile on
    each and faster than cuBLAS on each (14.3 / 7.6 / 56.4 / 30.7 us against 15.2 / 9.8 /
    62.8 / 31.8)."""
    del n, k
    return GemvConfig(2, 1024, 4)


def gemv_f16(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None,
             cfg: GemvConfig | None = None, ahead: bool = False) -> torch.Tensor:
    """float32 ``[1, N]`` = a ``[1, K]`` @ b ``[N, K]``^T (both fp16, unit column stride):
    ``matmul_f16`` for one row, reading b once as a stream. ``ahead``: as matmul_f16's."""
    m, k, n = _check(a, b, "gemv_f16")
    if m != 1:
        raise ValueError(f"gemv_f16: a must be one row, got {tuple(a.shape)}")
    out = _out(out, m, n, a.device, "gemv_f16")
    if n == 0 or k == 0:
        return out.zero_()
    if cfg is None:
        cfg = gemv_config(n, k)
    elif not (pow2_at_most(cfg.block_n, 256) and pow2_at_most(cfg.block_k, 4096)
              and cfg.num_warps in (1, 2, 4, 8)):  # fmt: skip
        raise ValueError(f"gemv_f16: bad tile {cfg} (block_n a power of two up to 256, block_k "
                         "one up to 4096, num_warps 1, 2, 4 or 8)")
    _gemv_kernel[(triton.cdiv(n, cfg.block_n),)](
        a, b, out, n, k, b.stride(0), BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        EVEN_K=k % cfg.block_k == 0, num_warps=cfg.num_warps, AHEAD=ahead and ahead_on(a.device),
        **launch_options(pdl_on(a.device)),
    )  # fmt: skip
    return out


def matmul_reference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The oracle: the same product in float64 on the CPU, as float32."""
    return (a.double().cpu() @ b.double().cpu().T).float()


def _check(a: torch.Tensor, b: torch.Tensor, name: str) -> tuple[int, int, int]:
    """(M, K, N) of a product's operands, or a ValueError naming what is wrong."""
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[1]:
        raise ValueError(f"{name}: a must be [M, K] and b [N, K], got {tuple(a.shape)} and "
                         f"{tuple(b.shape)}")
    if a.dtype != torch.float16 or b.dtype != torch.float16:
        raise ValueError(f"{name}: a and b must be float16, got {a.dtype} and {b.dtype}")
    if a.device != b.device:
        raise ValueError(f"{name}: a is on {a.device}, b on {b.device}")
    if (a.shape[1] > 1 and a.stride(1) != 1) or (b.shape[1] > 1 and b.stride(1) != 1):
        raise ValueError(f"{name}: a and b need unit column stride")
    return a.shape[0], a.shape[1], b.shape[0]


def _out(out: torch.Tensor | None, m: int, n: int, device: torch.device, name: str) -> torch.Tensor:
    if out is None:
        return torch.empty((m, n), dtype=torch.float32, device=device)
    if out.shape != (m, n) or out.dtype != torch.float32 or (n > 1 and out.stride(1) != 1):
        raise ValueError(f"{name}: out must be float32 [{m}, {n}] with unit column stride, "
                         f"got {out.dtype} {tuple(out.shape)}")
    return out
