"""The routed-expert kernels (kernels.triton.moe_route, quant.triton.moe_gemv / moe_gemm)
against their torch oracles in float64 (deimos.kernels.moe).

Oracles: ``moe_route_reference`` (float64 softmax, a stable sort: equal ids exactly, weights
to float32 rounding); ``moe_experts_reference`` on the stack decoded by
``naive.dequantize_packed`` (bit exact against deimos.quant) times, for the GEMV, the
dequantized integer activation (``quantize_x_reference``: equal up to float32 rounding, as
gemv_q8's test) and, for the grouped GEMM, the fp16 x (fp16 rounding of the decoded weights:
< 1e-3; against the product of the weights as gemm_q's decode makes them (rounded
to float16 once, or ``naive.dequantize_packed_half``), < 1e-5, which pins the decode);
``moe_align_reference`` entry for entry; ``moe_combine_reference``. Outputs are poisoned
first (NaN, or 7777 in the integer tile maps). Without CUDA the kernels run in Triton's
interpreter on tiny shapes with its big tiles.

Routing cases: 7 experts in 5 slots, ``SLOT_OF`` a permuted table with two experts off the
device (their rows must be exactly 0); ids holding expert 0, the last expert, and the last
expert chosen by every token.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kernel_checks import close  # imports kernel_device, which sets TRITON_INTERPRET: first
from kernel_device import DEVICE

from deimos.gguf.constants import GGMLType
from deimos.kernels.moe import (
    moe_align_reference,
    moe_combine_reference,
    moe_experts_reference,
    moe_max_tiles,
    moe_route_reference,
)
from deimos.kernels.triton.activation import gated_act
from deimos.kernels.triton.moe_route import moe_combine, moe_route
from deimos.kernels.triton.norm import add_rms_norm
from deimos.kernels.norm import add_rms_norm as add_rms_norm_reference
from deimos.models.gpu.dequant import permuted_columns
from deimos.quant import get_format
from deimos.quant.triton.dequant_gemv import FMT_ID
from deimos.quant.triton.gemm_q import HALF_DECODE
from deimos.quant.triton.gemv_q8 import empty_quantized, quantize_x, quantize_x_reference
from deimos.quant.triton.layout import PackedWeight, pack
from deimos.quant.triton.moe_gemm import (
    MoeGemmConfig,
    empty_tiles,
    max_tiles,
    moe_align,
    moe_block_m,
    moe_gemm,
    moe_gemm_config,
)
from deimos.quant.triton.moe_gemv import ExpertChunks, moe_gemv, moe_gemv_pair
from deimos.quant.triton.naive import dequantize_packed, dequantize_packed_half

# every kernel format, and formats packed in another's layout (Q3_K as Q6_K; Q8_0's layout
# with f16 scales (TQ2_0), f32 per 32 (IQ4_XS, MXFP4), f32 per 16 (IQ2_XS: SCALE16))
FORMATS = [*FMT_ID, GGMLType.Q3_K, GGMLType.IQ4_XS, GGMLType.IQ2_XS, GGMLType.TQ2_0, GGMLType.MXFP4]
SOME = [GGMLType.Q4_K, GGMLType.Q6_K, GGMLType.Q8_0, GGMLType.Q2_K, GGMLType.IQ2_XS]
E = 7
SLOTS = 5
SLOT_OF = [3, -1, 0, 4, -1, 1, 2]  # expert -> slot; experts 1 and 4 not on the device
SENTINEL = 7777


def _stack(t: GGMLType, n: int, k: int, seed: int, slots: int = SLOTS) -> PackedWeight:
    fmt = get_format(t)
    rows = slots * n
    blocks = fmt.random_blocks(rows * k // fmt.block_size, np.random.default_rng(seed)).reshape(rows, -1)
    return pack(blocks, t).to(DEVICE)


def _ids(t: int, k: int, seed: int, n_expert: int = E) -> torch.Tensor:
    """int32 [t, k]: distinct experts a token; column 0 is the last expert for every token,
    token 0 also picks expert 0."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(t):
        rest = torch.randperm(n_expert - 1, generator=g)[: k - 1].tolist()
        if i == 0 and k > 1 and 0 not in rest:
            rest[0] = 0
        rows.append([n_expert - 1, *rest])
    return torch.tensor(rows, dtype=torch.int32)


def _slot_of() -> torch.Tensor:
    return torch.tensor(SLOT_OF, dtype=torch.int32, device=DEVICE)


def _missing_rows(ids: torch.Tensor) -> torch.Tensor:
    return torch.tensor([SLOT_OF[e] < 0 for e in ids.reshape(-1).tolist()])


# ---- router ---------------------------------------------------------------------------------


def _logits(t: int, e: int, seed: int) -> torch.Tensor:
    """Random logits on a coarse grid (many equal values: ties), row 1 all equal, row 2 with
    its maximum at the last expert, row 3 at expert 0."""
    g = torch.Generator().manual_seed(seed)
    x = torch.round(torch.randn(t, e, generator=g) * 4) / 2
    x[1] = 0.25
    x[2, -1] = 50.0
    x[3, 0] = 50.0
    return x


@pytest.mark.parametrize("renorm", [False, True], ids=["softmax", "renorm"])
@pytest.mark.parametrize("e,k", [(7, 3), (60, 1), (128, 8), (512, 16)], ids=lambda v: str(v))
def test_moe_route(e: int, k: int, renorm: bool) -> None:
    t = 37
    logits = _logits(t, e, seed=e + k)
    w_out = torch.full((t, k), float("nan"), device=DEVICE)
    i_out = torch.full((t, k), SENTINEL, dtype=torch.int32, device=DEVICE)
    weights, ids = moe_route(logits.to(DEVICE), k, renorm, out=(w_out, i_out))
    assert weights is w_out and ids is i_out
    ref_w, ref_i = moe_route_reference(logits, k, renorm)
    assert torch.equal(ids.cpu().long(), ref_i), "ids differ from the stable sort's"
    assert ids[1].tolist() == list(range(k)), "all-equal logits: lowest ids first"
    assert ids[2, 0] == e - 1 and ids[3, 0] == 0
    close(f"route E={e} k={k} renorm={renorm}", weights, ref_w, 1e-6)
    if renorm:
        assert torch.allclose(weights.sum(dim=1).cpu().double(), torch.ones(t, dtype=torch.float64), atol=1e-6)


def test_moe_route_strided_rows() -> None:
    """Logits as a column slice of a wider matrix (the router's output beside others)."""
    wide = _logits(5, 40, seed=3)
    weights, ids = moe_route(wide.to(DEVICE)[:, 8:], 4, True)
    ref_w, ref_i = moe_route_reference(wide[:, 8:], 4, True)
    assert torch.equal(ids.cpu().long(), ref_i)
    close("route strided", weights, ref_w, 1e-6)


def test_moe_route_bad_input() -> None:
    x = torch.zeros(3, 8, device=DEVICE)
    with pytest.raises(ValueError, match="float32"):
        moe_route(x.half(), 2, True)
    with pytest.raises(ValueError, match="k = 9"):
        moe_route(x, 9, True)
    with pytest.raises(ValueError, match="k = 0"):
        moe_route(x, 0, True)
    with pytest.raises(ValueError, match="E = 513"):
        moe_route(torch.zeros(1, 513, device=DEVICE), 2, True)
    with pytest.raises(ValueError, match="unit column stride"):
        moe_route(torch.zeros(8, 3, device=DEVICE).T, 2, True)
    with pytest.raises(ValueError, match="out ids"):
        moe_route(x, 2, True, out=(torch.empty(3, 2, device=DEVICE), torch.empty(3, 2, device=DEVICE)))


# ---- decode GEMV ----------------------------------------------------------------------------


def _gemv_case(t: GGMLType, x_rows: str, n: int, k: int, n_tok: int, top_k: int, seed: int):
    w = _stack(t, n, k, seed)
    ids = _ids(n_tok, top_k, seed)
    rows = n_tok if x_rows == "token" else n_tok * top_k
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(seed + 1))
    return w, ids, x


def _check_gemv(w: PackedWeight, n: int, x: torch.Tensor, ids: torch.Tensor, x_rows: str, what: str):
    qx = _quantized(x)
    out = torch.full((ids.numel(), n), float("nan"), device=DEVICE)
    y = moe_gemv(w, n, qx, ids.to(DEVICE), _slot_of(), x_rows, out=out)
    assert y is out
    ref = moe_experts_reference(dequantize_packed(w), n, quantize_x_reference(x), ids,
                                _slot_of(), x_rows)  # fmt: skip
    miss = _missing_rows(ids)
    assert miss.any() and (~miss).any()
    assert torch.equal(y.cpu()[miss], torch.zeros(int(miss.sum()), n)), f"{what}: rows of experts off the device"
    close(what, y, ref, 1e-5)
    return y


def _quantized(x: torch.Tensor):
    """quantize_x (at most 8 rows a call) over any number of rows."""
    parts = [quantize_x(x[i : i + 8].to(DEVICE)) for i in range(0, x.shape[0], 8)]
    return type(parts[0])(*(torch.cat([p[j] for p in parts]) for j in range(3)))


@pytest.mark.parametrize("x_rows", ["token", "pair"])
@pytest.mark.parametrize("t", FORMATS, ids=lambda t: t.name)
def test_moe_gemv_formats(t: GGMLType, x_rows: str) -> None:
    """Odd rows a slot (37), 3 tokens x 3 experts; token rows (gate/up) or pair rows (down)."""
    n, k = 37, 512
    w, ids, x = _gemv_case(t, x_rows, n, k, 3, 3, seed=11)
    _check_gemv(w, n, x, ids, x_rows, f"gemv {t.name} {x_rows}")


@pytest.mark.parametrize("t", [GGMLType.Q4_K, GGMLType.Q8_0], ids=lambda t: t.name)
def test_moe_gemv_batch(t: GGMLType) -> None:
    """Batched decode through the GEMV: 5 tokens x 4 experts (20 pairs, pair rows past
    quantize_x's 8), K = 256 in a part step of the interpreter's tile."""
    n, k = 70, 256
    w, ids, x = _gemv_case(t, "pair", n, k, 5, 4, seed=2)
    _check_gemv(w, n, x, ids, "pair", f"gemv {t.name} 5x4")


def _interleave(a: PackedWeight, b: PackedWeight, slots: int) -> PackedWeight:
    """Two stacks of the same format -> one of 2n rows a slot (a's n rows, then b's)."""
    def cat(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.cat([x.reshape(slots, -1, x.shape[1]), y.reshape(slots, -1, y.shape[1])],
                         dim=1).reshape(-1, x.shape[1])  # fmt: skip

    return PackedWeight(a.ggml_type, a.n + b.n, a.k, {name: cat(a.tensors[name], b.tensors[name])
                                                      for name in a.tensors})


def test_moe_gemv_gate_up_one_stack() -> None:
    """gate and up as one stack of 2 n_ff rows a slot: the two halves of one launch equal two
    launches on their own stacks."""
    n_ff, k = 24, 256
    gate = _stack(GGMLType.Q4_K, n_ff, k, seed=1)
    up = _stack(GGMLType.Q4_K, n_ff, k, seed=2)
    gu = _interleave(gate, up, SLOTS)
    ids = _ids(3, 2, seed=4).to(DEVICE)
    qx = quantize_x(torch.randn(3, k, generator=torch.Generator().manual_seed(5)).to(DEVICE))
    y = moe_gemv(gu, 2 * n_ff, qx, ids, _slot_of(), "token")
    assert torch.equal(y[:, :n_ff], moe_gemv(gate, n_ff, qx, ids, _slot_of(), "token"))
    assert torch.equal(y[:, n_ff:], moe_gemv(up, n_ff, qx, ids, _slot_of(), "token"))


@pytest.mark.parametrize("t", [GGMLType.Q4_K, GGMLType.Q6_K], ids=lambda t: t.name)
def test_moe_gemv_pair_equals_two_launches(t: GGMLType) -> None:
    """gate and up in one launch (moe_gemv_pair, grid axis 2 picks the stack): each output
    equals its own moe_gemv launch, on one stack each and on slots in chunks (a chunk not
    allocated); stacks of two formats fall back to two launches with the same results."""
    n_ff, k = 24, 256
    gate, up = _stack(t, n_ff, k, seed=1), _stack(t, n_ff, k, seed=2)
    ids = _ids(3, 2, seed=4).to(DEVICE)
    qx = quantize_x(torch.randn(3, k, generator=torch.Generator().manual_seed(5)).to(DEVICE))
    want_g = moe_gemv(gate, n_ff, qx, ids, _slot_of(), "token")
    want_u = moe_gemv(up, n_ff, qx, ids, _slot_of(), "token")
    assert not torch.equal(want_g, want_u)
    g, u = moe_gemv_pair(gate, up, n_ff, qx, ids, _slot_of(), "token")
    assert torch.equal(g, want_g) and torch.equal(u, want_u)
    slot_of = torch.tensor([3, -1, 0, -1, -1, 1, 2], dtype=torch.int32, device=DEVICE)  # slot 4 off
    tg, cg, keep_g = _chunked(gate, n_ff, 2, missing=2)
    tu, cu, keep_u = _chunked(up, n_ff, 2, missing=2)
    g, u = moe_gemv_pair(tg, tu, n_ff, qx, ids, slot_of, "token", cg, cu)
    assert torch.equal(g, moe_gemv(gate, n_ff, qx, ids, slot_of, "token"))
    assert torch.equal(u, moe_gemv(up, n_ff, qx, ids, slot_of, "token"))
    with pytest.raises(ValueError, match=r"x must be \[3, 256\] \(token rows\), got \[2, 256\]"):
        moe_gemv_pair(gate, up, n_ff, quantize_x(torch.zeros(2, k, device=DEVICE)), ids, _slot_of(), "token")
    other = _stack(GGMLType.Q8_0, n_ff, k, seed=3)
    g, u = moe_gemv_pair(gate, other, n_ff, qx, ids, _slot_of(), "token")
    assert torch.equal(g, want_g) and torch.equal(u, moe_gemv(other, n_ff, qx, ids, _slot_of(), "token"))


def test_moe_gemv_ids_out_of_range() -> None:
    """An id outside [0, E) reads nothing and gives a zero row."""
    n, k = 16, 256
    w = _stack(GGMLType.Q8_0, n, k, seed=3)
    ids = torch.tensor([[0, E], [-1, 6]], dtype=torch.int32, device=DEVICE)
    qx = quantize_x(torch.randn(2, k, generator=torch.Generator().manual_seed(1)).to(DEVICE))
    y = moe_gemv(w, n, qx, ids, _slot_of(), "token", out=torch.full((4, n), float("nan"), device=DEVICE))
    assert torch.equal(y[1].cpu(), torch.zeros(n)) and torch.equal(y[2].cpu(), torch.zeros(n))
    assert y[0].abs().sum() > 0 and y[3].abs().sum() > 0


def test_moe_gemv_bad_input() -> None:
    n, k = 16, 256
    w = _stack(GGMLType.Q4_K, n, k, seed=0)
    ids = _ids(2, 2, seed=0).to(DEVICE)
    qx = quantize_x(torch.zeros(2, k, device=DEVICE))
    slot_of = _slot_of()
    with pytest.raises(ValueError, match="whole slots of n = 15"):
        moe_gemv(w, 15, qx, ids, slot_of, "token")
    with pytest.raises(ValueError, match="x_rows must be"):
        moe_gemv(w, n, qx, ids, slot_of, "row")
    with pytest.raises(ValueError, match=r"x must be \[4, 256\] \(pair rows\)"):
        moe_gemv(w, n, qx, ids, slot_of, "pair")
    with pytest.raises(ValueError, match="ids must be contiguous int32"):
        moe_gemv(w, n, qx, ids.long(), slot_of, "token")
    with pytest.raises(ValueError, match="slot_of must be contiguous int32"):
        moe_gemv(w, n, qx, ids, slot_of[None], "token")
    with pytest.raises(ValueError, match="slot_of is empty"):
        moe_gemv(w, n, qx, ids, slot_of[:0], "token")
    with pytest.raises(ValueError, match="out must be"):
        moe_gemv(w, n, qx, ids, slot_of, "token", out=torch.empty(4, n + 1, device=DEVICE))
    f16 = PackedWeight(GGMLType.F16, 8, k, {"qw": torch.zeros(8, 128, dtype=torch.int32)})
    with pytest.raises(ValueError, match="no kernel for F16"):
        moe_gemv(f16, 8, qx, ids, slot_of, "token")


def _chunked(w: PackedWeight, n: int, spc: int, missing: int) -> tuple[PackedWeight, ExpertChunks, list]:
    """The stack's slots copied into chunks of ``spc`` slots, each array of each chunk its own
    allocation (as runtime.expert_cache lays them out), chunk ``missing`` not allocated
    (address 0: no slot of SLOT_OF points there). Returns (a one-slot template weight, the
    tables, the chunks to keep alive)."""
    n_chunks = -(-SLOTS // spc)
    keep, tables = [], {}
    for name, t in w.tensors.items():
        ptrs = []
        for c in range(n_chunks):
            if c == missing:
                ptrs.append(0)
                continue
            buf = torch.full((spc * n, *t.shape[1:]), -1, dtype=t.dtype, device=DEVICE)
            rows = t[c * spc * n : min((c + 1) * spc, SLOTS) * n]
            buf[: rows.shape[0]] = rows
            keep.append(buf)
            ptrs.append(buf.data_ptr())
        tables[name] = torch.tensor(ptrs, dtype=torch.int64, device=DEVICE)
    template = PackedWeight(w.ggml_type, n, w.k, {a: t[:n].clone() for a, t in w.tensors.items()})
    return template, ExpertChunks(tables, spc), keep


@pytest.mark.parametrize("t", [GGMLType.Q5_K, GGMLType.IQ2_XS, GGMLType.Q4_K, GGMLType.Q6_K],
                         ids=lambda t: t.name)
def test_moe_chunked_slots(t: GGMLType) -> None:
    """Slots in chunks of 2 (3 chunks for 5 slots; slot 4 unused, so its chunk is not
    allocated): both kernels give exactly what they give on the one stack (Q4_K through mmq
    by default, Q5_K and Q6_K asked to)."""
    n, k = 29, 256
    w = _stack(t, n, k, seed=41)
    slot_of_host = [3, -1, 0, -1, -1, 1, 2]  # expert 3 (slot 4, chunk 2) off the device
    slot_of = torch.tensor(slot_of_host, dtype=torch.int32, device=DEVICE)
    template, chunks, keep = _chunked(w, n, 2, missing=2)
    ids = _ids(4, 3, seed=41).to(DEVICE)
    qx = quantize_x(torch.randn(4, k, generator=torch.Generator().manual_seed(42)).to(DEVICE))
    flat = moe_gemv(w, n, qx, ids, slot_of, "token")
    got = moe_gemv(template, n, qx, ids, slot_of, "token", chunks=chunks,
                   out=torch.full_like(flat, float("nan")))  # fmt: skip
    assert torch.equal(got, flat)
    tiles = moe_align(ids, E, 16)
    x = torch.randn(4, k, generator=torch.Generator().manual_seed(43)).half().to(DEVICE)
    mmq = True if t in (GGMLType.Q5_K, GGMLType.Q6_K) else None
    flat = moe_gemm(x, w, n, tiles, slot_of, "token", x_permuted=False, mmq=mmq)
    got = moe_gemm(x, template, n, tiles, slot_of, "token", x_permuted=False, chunks=chunks,
                   out=torch.full_like(flat, float("nan")), mmq=mmq)  # fmt: skip
    assert torch.equal(got, flat)
    assert flat.abs().sum() > 0
    del keep


def test_moe_chunked_bad_input() -> None:
    n, k = 16, 256
    w = _stack(GGMLType.Q4_K, n, k, seed=0)
    template, chunks, _ = _chunked(w, n, 2, missing=-1)
    ids = _ids(2, 2, seed=0).to(DEVICE)
    qx = quantize_x(torch.zeros(2, k, device=DEVICE))
    with pytest.raises(ValueError, match="chunk tables for"):
        moe_gemv(template, n, qx, ids, _slot_of(), "token",
                 chunks=ExpertChunks({"qw": chunks.tables["qw"]}, 2))  # fmt: skip
    with pytest.raises(ValueError, match="chunk table 'qw' must be contiguous int64"):
        moe_gemv(template, n, qx, ids, _slot_of(), "token",
                 chunks=ExpertChunks({**chunks.tables, "qw": chunks.tables["qw"].int()}, 2))  # fmt: skip
    with pytest.raises(ValueError, match="slots_per_chunk must be >= 1"):
        moe_gemv(template, n, qx, ids, _slot_of(), "token", chunks=ExpertChunks(chunks.tables, 0))


# ---- grouping -------------------------------------------------------------------------------


def _poisoned_tiles(t: int, k: int, n_expert: int, block_m: int):
    out = empty_tiles(t, k, n_expert, block_m, DEVICE)
    for a in out[:3]:
        a.fill_(SENTINEL)
    return out


# (T, k, E, block_m): one tile; odd T with several tiles of the expert every token picks;
# 1204 pairs (10 chunks of the count/scatter passes) over 130 experts (3 expert blocks of the
# scan, E not a power of two); every expert once (the tile bound is tight); 64-row tiles
ALIGN_CASES = [(3, 3, 7, 16), (37, 2, 5, 16), (301, 4, 130, 32), (130, 1, 130, 16), (45, 3, 9, 64)]


@pytest.mark.parametrize("case", ALIGN_CASES, ids=lambda c: "t{}_k{}_e{}_m{}".format(*c))
def test_moe_align(case: tuple[int, int, int, int]) -> None:
    t, k, n_expert, block_m = case
    if t == n_expert and k == 1:
        ids = torch.randperm(t, generator=torch.Generator().manual_seed(0)).int()[:, None]
    else:
        ids = _ids(t, k, seed=t, n_expert=n_expert)
    out = moe_align(ids.to(DEVICE), n_expert, block_m, out=_poisoned_tiles(t, k, n_expert, block_m))
    order, tile_expert, n_tiles = moe_align_reference(ids, n_expert, block_m)
    assert out.max_tiles == moe_max_tiles(t * k, n_expert, block_m) == max_tiles(t * k, n_expert, block_m)
    assert int(out.n_tiles.item()) == n_tiles <= out.max_tiles
    assert torch.equal(out.tile_expert.cpu(), tile_expert)
    assert torch.equal(out.order.cpu(), order)
    if t == n_expert and k == 1:
        assert n_tiles == out.max_tiles


def test_moe_align_ids_out_of_range() -> None:
    """Ids outside [0, E) are left out of every tile (the tiles of the others unchanged)."""
    ids = torch.tensor([[0, 6], [7, 2], [-1, 6]], dtype=torch.int32)
    out = moe_align(ids.to(DEVICE), E, 16, out=_poisoned_tiles(3, 2, E, 16))
    order, tile_expert, n_tiles = moe_align_reference(ids, E, 16)
    assert int(out.n_tiles.item()) == n_tiles == 3
    assert torch.equal(out.order.cpu(), order) and torch.equal(out.tile_expert.cpu(), tile_expert)
    assert sorted(v for v in order.tolist() if v >= 0) == [0, 1, 3, 5]


def test_moe_align_bad_input() -> None:
    ids = _ids(3, 2, seed=0).to(DEVICE)
    with pytest.raises(ValueError, match="ids must be contiguous int32"):
        moe_align(ids.long(), E, 16)
    with pytest.raises(ValueError, match="block_m = 24"):
        moe_align(ids, E, 24)
    with pytest.raises(ValueError, match="block_m = 128"):
        moe_align(ids, E, 128)
    with pytest.raises(ValueError, match="n_expert = 0"):
        moe_align(ids, 0, 16)
    with pytest.raises(ValueError, match="out must be empty_tiles"):
        moe_align(ids, E, 16, out=empty_tiles(3, 2, E, 32, DEVICE))


def test_moe_block_m_rule() -> None:
    """qwen3moe 30B-A3B (E 128, k 8): decode batches in 16-row tiles, prefill in 32/64."""
    assert [moe_block_m(t * 8, 128) for t in (1, 16, 64, 256, 512, 2048)] == [16, 16, 16, 16, 32, 64]


# ---- grouped GEMM ---------------------------------------------------------------------------


def _check_gemm(w: PackedWeight, n: int, x: torch.Tensor, ids: torch.Tensor, x_rows: str,
                permuted: bool, block_m: int, cfg: MoeGemmConfig | None, what: str,
                mmq: bool | None = False) -> torch.Tensor:
    """moe_gemm against the oracles; ``mmq`` False by default: the register decode's tests
    (the default path, mmq for Q4_K up to 32 rows, is tested with None)."""
    tiles = moe_align(ids.to(DEVICE), E, block_m)
    xk = x[:, permuted_columns(w).cpu()].contiguous() if permuted else x
    out = torch.full((ids.numel(), n), float("nan"), device=DEVICE)
    y = moe_gemm(xk.to(DEVICE), w, n, tiles, _slot_of(), x_rows, x_permuted=permuted, out=out, cfg=cfg,
                 mmq=mmq)
    assert y is out
    wd = dequantize_packed(w)
    miss = _missing_rows(ids)
    assert torch.equal(y.cpu()[miss], torch.zeros(int(miss.sum()), n)), f"{what}: rows of experts off the device"
    close(what, y, moe_experts_reference(wd, n, x, ids, _slot_of(), x_rows), 1e-3)
    # what the tensor cores multiply: the weights as gemm_q.decode_tile makes them (rounded to
    # float16 once, or with DEIMOS_DECODE_F16=1 decoded in float16)
    w16 = dequantize_packed_half(w) if HALF_DECODE else wd.half()
    ref16 = moe_experts_reference(w16.float(), n, x, ids, _slot_of(), x_rows)
    close(what + " (fp16 weights)", y, ref16, 1e-5)
    return y


@pytest.mark.parametrize("t", FORMATS, ids=lambda t: t.name)
def test_moe_gemm_formats(t: GGMLType) -> None:
    """Every format: 19 tokens x 3 experts (the last expert in 2 tiles of 16), token rows,
    x permuted."""
    n, k = 37, 512
    w = _stack(t, n, k, seed=21)
    ids = _ids(19, 3, seed=21)
    x = torch.randn(19, k, generator=torch.Generator().manual_seed(22)).half()
    _check_gemm(w, n, x, ids, "token", True, 16, None, f"gemm {t.name}")


@pytest.mark.parametrize("permuted", [True, False], ids=["permuted", "elements"])
@pytest.mark.parametrize("t", SOME, ids=lambda t: t.name)
def test_moe_gemm_pair_rows(t: GGMLType, permuted: bool) -> None:
    """Pair rows (down) with x in the words' or the elements' column order, 32-row tiles."""
    n, k = 45, 256
    w = _stack(t, n, k, seed=31)
    ids = _ids(7, 3, seed=31)
    x = torch.randn(21, k, generator=torch.Generator().manual_seed(32)).half()
    _check_gemm(w, n, x, ids, "pair", permuted, 32, None, f"gemm {t.name} pair permuted={permuted}")


# narrow tiles, not the interpreter's: several K steps a row (Q4_K at K = 512: EVEN) and a part
# step (K = 416 / 96: 13 and 3 groups of formats with blocks of 32)
TILES = [MoeGemmConfig(16, 8, 4, 2), MoeGemmConfig(32, 16, 4, 3)]


@pytest.mark.parametrize("cfg", TILES, ids=lambda c: "n{}_j{}_w{}_s{}".format(*c))
@pytest.mark.parametrize("t,k", [(GGMLType.Q4_K, 512), (GGMLType.Q8_0, 416), (GGMLType.Q5_0, 96)],
                         ids=lambda v: getattr(v, "name", str(v)))
def test_moe_gemm_tiles(t: GGMLType, k: int, cfg: MoeGemmConfig) -> None:
    n = 33
    w = _stack(t, n, k, seed=k)
    ids = _ids(5, 2, seed=k)
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(k + 1)).half()
    _check_gemm(w, n, x, ids, "token", False, 16, cfg, f"gemm {t.name} k={k} {cfg}")


@pytest.mark.parametrize("block_m", [16, 32, 64])
@pytest.mark.parametrize("t", [GGMLType.Q6_K, GGMLType.Q2_K], ids=lambda t: t.name)
def test_moe_gemm_rule_tiles(t: GGMLType, block_m: int) -> None:
    """The GPU rule's tile for each tile height, on a small stack."""
    n, k = 70, 256
    cfg = moe_gemm_config(t, 2048, 768, block_m)
    w = _stack(t, n, k, seed=block_m)
    ids = _ids(9, 2, seed=block_m)
    x = torch.randn(18, k, generator=torch.Generator().manual_seed(3)).half()
    _check_gemm(w, n, x, ids, "pair", True, block_m, cfg, f"gemm {t.name} m={block_m} {cfg}")


@pytest.mark.parametrize("block_m", [16, 32, 64])
@pytest.mark.parametrize("permuted", [True, False], ids=["permuted", "elements"])
@pytest.mark.parametrize("x_rows", ["token", "pair"])
@pytest.mark.parametrize("t", [GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K, GGMLType.Q8_0, GGMLType.IQ4_XS,
                               GGMLType.IQ2_XS], ids=lambda t: t.name)
def test_moe_gemm_mmq(t: GGMLType, x_rows: str, permuted: bool, block_m: int) -> None:
    """Q4_K, Q5_K, Q6_K and Q8_0's layout (Q8_0, IQ4_XS: float32 scales, IQ2_XS: one a 16)
    through deimos.quant.triton.mmq (codes decoded in the dot's operand
    layout): the same float16 weights as the other paths (1e-5 of the product on them), token
    and pair rows, x in either column order, every tile height, K of 3 blocks."""
    n, k = 40, 768
    w = _stack(t, n, k, seed=block_m + 7)
    ids = _ids(11, 3, seed=block_m)
    x = torch.randn(11 if x_rows == "token" else 33, k, generator=torch.Generator().manual_seed(block_m)).half()
    _check_gemm(w, n, x, ids, x_rows, permuted, block_m, None,
                f"mmq {t.name} {x_rows} permuted={permuted} m={block_m}", mmq=True)
    if t == GGMLType.Q4_K:  # the default: mmq up to 32 rows an expert, the register decode at 64
        _check_gemm(w, n, x, ids, x_rows, permuted, block_m, None,
                    f"default {t.name} {x_rows} permuted={permuted} m={block_m}", mmq=None)


def test_moe_gemm_bad_input() -> None:
    n, k = 16, 256
    w = _stack(GGMLType.Q4_K, n, k, seed=0)
    ids = _ids(3, 2, seed=0).to(DEVICE)
    tiles = moe_align(ids, E, 16)
    x = torch.zeros(3, k, dtype=torch.float16, device=DEVICE)
    slot_of = _slot_of()
    with pytest.raises(ValueError, match=r"x must be float16 \[3, 256\]"):
        moe_gemm(x.float(), w, n, tiles, slot_of, "token")
    with pytest.raises(ValueError, match=r"x must be float16 \[6, 256\] \(pair rows\)"):
        moe_gemm(x, w, n, tiles, slot_of, "pair")
    with pytest.raises(ValueError, match="unit column stride"):
        moe_gemm(torch.zeros(k, 3, dtype=torch.float16, device=DEVICE).T, w, n, tiles, slot_of, "token")
    with pytest.raises(ValueError, match="whole slots"):
        moe_gemm(x, w, 17, tiles, slot_of, "token")
    with pytest.raises(ValueError, match="bad tile"):
        moe_gemm(x, w, n, tiles, slot_of, "token", cfg=MoeGemmConfig(24, 16, 4, 2))
    with pytest.raises(ValueError, match="bad tile"):
        moe_gemm(x, w, n, tiles, slot_of, "token", cfg=MoeGemmConfig(16, 2, 4, 2))
    with pytest.raises(ValueError, match="out must be"):
        moe_gemm(x, w, n, tiles, slot_of, "token", out=torch.empty(6, n, dtype=torch.float16, device=DEVICE))
    with pytest.raises(ValueError, match="slot_of has 6 experts, the tiles were made for 7"):
        moe_gemm(x, w, n, tiles, slot_of[:6], "token")


# ---- combine and a whole layer --------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["f32", "f16"])
@pytest.mark.parametrize("add", [False, True], ids=["plain", "add"])
def test_moe_combine(add: bool, dtype: torch.dtype) -> None:
    t, k, d = 5, 8, 1100  # d past one block of 1024
    g = torch.Generator().manual_seed(7)
    y = torch.randn(t * k, d, generator=g)
    weights = torch.rand(t, k, generator=g)
    extra = torch.randn(t, d, generator=g) if add else None
    out = torch.full((t, d), float("nan"), dtype=dtype, device=DEVICE)
    got = moe_combine(y.to(DEVICE), weights.to(DEVICE), None if extra is None else extra.to(DEVICE), out=out)
    assert got is out
    close(f"combine add={add} {dtype}", got, moe_combine_reference(y, weights, extra),
          1e-6 if dtype == torch.float32 else 1e-3)  # fmt: skip


@pytest.mark.parametrize("t,d", [(1, 2048), (3, 1100), (9, 256)], ids=["decode-row", "rows", "more"])
def test_combine_in_the_norm(t: int, d: int) -> None:
    """add_rms_norm(y, residual, ..., mix=weights): the experts' weighted sum, the residual
    add, the norm (and the decode row's integer activation, a batch's float16 rows) in one
    launch, bit for bit the unfused moe_combine then add_rms_norm; against the references."""
    k = 8
    g = torch.Generator().manual_seed(11)
    y = torch.randn(t * k, d, generator=g).to(DEVICE)
    weights = torch.rand(t, k, generator=g).to(DEVICE)
    residual = torch.randn(t, d, generator=g).to(DEVICE)
    w = (1 + 0.1 * torch.randn(d, generator=g)).to(DEVICE)
    q1 = empty_quantized(t, d, DEVICE) if t == 1 else None
    q2 = empty_quantized(t, d, DEVICE) if t == 1 else None
    h1 = torch.empty(t, d, dtype=torch.float16, device=DEVICE) if t > 1 else None
    h2 = torch.empty(t, d, dtype=torch.float16, device=DEVICE) if t > 1 else None
    y1, r1 = add_rms_norm(moe_combine(y, weights), residual, w, 1e-6, quantized=q1, half=h1)
    y2, r2 = add_rms_norm(y, residual, w, 1e-6, quantized=q2, half=h2, mix=weights)
    assert torch.equal(r1, r2) and torch.equal(y1, y2)
    if t == 1:
        assert all(torch.equal(a, b) for a, b in zip(q1, q2))
    else:
        assert torch.equal(h1, h2)
    ref_y, ref_r = add_rms_norm_reference(moe_combine_reference(y.cpu(), weights.cpu()), residual.cpu(), w.cpu(), 1e-6)
    close("mixed residual", r2, ref_r, 1e-5)
    close("mixed norm", y2, ref_y, 1e-5)
    # without a residual: the sum itself is r'
    y3, r3 = add_rms_norm(y, None, w, 1e-6, mix=weights)
    assert torch.equal(r3, moe_combine(y, weights))
    close("mixed, no residual", y3, add_rms_norm_reference(r3.cpu(), None, w.cpu(), 1e-6)[0], 1e-5)
    # a shared expert's row, gated by sigmoid(x . g) (qwen35moe): as the combine that adds it
    shared = torch.randn(t, d, generator=g).to(DEVICE)
    gx, gw = torch.randn(t, 300, generator=g).to(DEVICE), torch.randn(300, generator=g).to(DEVICE)
    y4, r4 = add_rms_norm(moe_combine(y, weights, add=shared, gate=(gx, gw)), residual, w, 1e-6)
    y5, r5 = add_rms_norm(y, residual, w, 1e-6, mix=weights, add=shared, gate=(gx, gw))
    assert torch.equal(r4, r5) and torch.equal(y4, y5)


def test_combine_in_the_norm_outputs_over_its_inputs() -> None:
    """A decode row's norm is split over programs that each read the whole row; an output
    that is the added row or the gate's x (written by one program while the others still read
    it) makes the launch keep each row in one program: the same result as fresh outputs."""
    t, k, d = 1, 4, 1024
    g = torch.Generator().manual_seed(3)
    y, weights = torch.randn(t * k, d, generator=g).to(DEVICE), torch.rand(t, k, generator=g).to(DEVICE)
    add, residual = torch.randn(t, d, generator=g).to(DEVICE), torch.randn(t, d, generator=g).to(DEVICE)
    w, gx = torch.rand(d, generator=g).to(DEVICE), torch.randn(t, d, generator=g).to(DEVICE)
    gw = (0.1 * torch.randn(d, generator=g)).to(DEVICE)
    want, _ = add_rms_norm(y, residual, w, 1e-6, mix=weights, add=add.clone(), gate=(gx.clone(), gw))
    a2 = add.clone()
    got, _ = add_rms_norm(y, residual, w, 1e-6, mix=weights, add=a2, gate=(gx.clone(), gw), out=a2)
    assert torch.equal(got, want)
    x2 = gx.clone()
    got, _ = add_rms_norm(y, residual, w, 1e-6, mix=weights, add=add.clone(), gate=(x2, gw), out=x2)
    assert torch.equal(got, want)


def test_gated_sum_in_the_norm_uses_the_combines_warps(monkeypatch) -> None:
    """The gate's dot is a reduction whose order follows the warps a launch has: a norm that
    gates an added row launches with moe_combine's (COMBINE_WARPS), whatever its own config
    gives the row (here 8 warps for 9 rows of 4096), so both sum the gate to the same bits. Up
    to D = 2048 every norm takes COMBINE_WARPS (then a row's sum of squares is summed alike with
    the gated sum in the launch or not)."""
    from deimos.kernels.triton import norm as norm_mod
    from deimos.kernels.triton.moe_route import COMBINE_WARPS

    seen = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *a, **kw: seen.append((bool(kw.get("HAS_GATE")), kw["num_warps"]))

    monkeypatch.setattr(norm_mod, "_rms_norm_kernel", Recorder())
    for dd in (64, 256, 1000, 2048):
        assert {norm_mod.norm_config(dd, tt, split).num_warps for tt in (1, 9, 512)
                for split in (False, True)} == {COMBINE_WARPS}  # fmt: skip
    t, k, d = 9, 8, 4096
    assert norm_mod.norm_config(d, t).num_warps != COMBINE_WARPS
    y, weights = torch.zeros(t * k, d), torch.zeros(t, k)
    gate = (torch.zeros(t, 300), torch.zeros(300))
    add_rms_norm(y, None, torch.ones(d), 1e-6, mix=weights, add=torch.zeros(t, d), gate=gate)
    add_rms_norm(y, None, torch.ones(d), 1e-6, mix=weights, add=torch.zeros(t, d))
    assert seen == [(True, COMBINE_WARPS), (False, norm_mod.norm_config(d, t).num_warps)]


def test_combine_in_the_norm_bad_input() -> None:
    y = torch.zeros(6, 32, device=DEVICE)
    w = torch.ones(32, device=DEVICE)
    mix = torch.zeros(3, 2, device=DEVICE)
    with pytest.raises(ValueError, match=r"with mix, x must be contiguous float32 \[6, D\]"):
        add_rms_norm(y[:4], None, w, 1e-6, mix=mix)
    with pytest.raises(ValueError, match="mix must be contiguous float32"):
        add_rms_norm(y, None, w, 1e-6, mix=mix.double())
    with pytest.raises(ValueError, match="does not match the 3 tokens"):
        add_rms_norm(y, torch.zeros(2, 32, device=DEVICE), w, 1e-6, mix=mix)
    with pytest.raises(ValueError, match="not the 3 tokens"):
        add_rms_norm(y, None, w, 1e-6, mix=mix, out=torch.zeros(2, 32, device=DEVICE))
    with pytest.raises(ValueError, match="add must be contiguous float32"):
        add_rms_norm(y, None, w, 1e-6, mix=mix, add=torch.zeros(3, 31, device=DEVICE))
    with pytest.raises(ValueError, match="a gate scales the added rows"):
        add_rms_norm(y, None, w, 1e-6, mix=mix, gate=(torch.zeros(3, 8, device=DEVICE), torch.zeros(8, device=DEVICE)))
    with pytest.raises(ValueError, match="add and gate go with mix"):
        add_rms_norm(y[:3], None, w, 1e-6, add=torch.zeros(3, 32, device=DEVICE))


def test_moe_combine_bad_input() -> None:
    y = torch.zeros(6, 8, device=DEVICE)
    w = torch.zeros(3, 2, device=DEVICE)
    with pytest.raises(ValueError, match=r"y must be contiguous float32 \[6, D\]"):
        moe_combine(y[:4], w)
    with pytest.raises(ValueError, match="weights must be"):
        moe_combine(y, w.double())
    with pytest.raises(ValueError, match="add must be"):
        moe_combine(y, w, add=torch.zeros(3, 9, device=DEVICE))
    with pytest.raises(ValueError, match="dtype must be"):
        moe_combine(y, w, dtype=torch.bfloat16)


def _layer_reference(x, gate, up, down, n_ff, weights, ids):
    """The routed experts of a qwen3moe layer in float64 (dense dequantized weights)."""
    g = moe_experts_reference(dequantize_packed(gate), n_ff, x, ids, _slot_of(), "token")
    u = moe_experts_reference(dequantize_packed(up), n_ff, x, ids, _slot_of(), "token")
    a = torch.nn.functional.silu(g) * u
    y = moe_experts_reference(dequantize_packed(down), down.n // SLOTS, a, ids, _slot_of(), "pair")
    return moe_combine_reference(y, weights)


@pytest.mark.parametrize("path", ["decode", "grouped"])
def test_moe_layer(path: str) -> None:
    """router -> gate/up (one stack) -> SwiGLU -> down -> combine, wired as a model step does:
    the decode path on integer activations (gated_act writes the down GEMV's QuantizedX), the
    grouped path with one tile map for both GEMMs and x in element order. Against the float64
    layer on the same routing."""
    t, k, d, n_ff = 3, 2, 256, 256
    gate, up = _stack(GGMLType.Q4_K, n_ff, d, seed=1), _stack(GGMLType.Q4_K, n_ff, d, seed=2)
    down = _stack(GGMLType.Q6_K, d, n_ff, seed=3)
    gu = _interleave(gate, up, SLOTS)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(t, d, generator=g)
    logits = torch.randn(t, E, generator=g)
    logits[0, 1] = 9.0  # token 0 picks expert 1 (off the device: its part is the CPU's)
    weights, ids = moe_route(logits.to(DEVICE), k, True)
    slot_of = _slot_of()
    if path == "decode":
        h = moe_gemv(gu, 2 * n_ff, quantize_x(x.to(DEVICE)), ids, slot_of, "token")
        qa = empty_quantized(t * k, n_ff, DEVICE)
        gated_act(h[:, :n_ff], h[:, n_ff:], "silu", quantized=qa)
        y = moe_gemv(down, d, qa, ids, slot_of, "pair")
    else:
        tiles = moe_align(ids, E, 16)
        h = moe_gemm(x.half().to(DEVICE), gu, 2 * n_ff, tiles, slot_of, "token", x_permuted=False)
        a = gated_act(h[:, :n_ff], h[:, n_ff:], "silu", out=torch.empty(t * k, n_ff, dtype=torch.float16,
                                                                        device=DEVICE))  # fmt: skip
        y = moe_gemm(a, down, d, tiles, slot_of, "pair", x_permuted=False)
    out = moe_combine(y, weights)
    assert ids[0, 0] == 1
    ref = _layer_reference(x, gate, up, down, n_ff, weights.cpu().double(), ids.cpu())
    close(f"layer {path}", out, ref, 2e-3 if path == "grouped" else 1e-4)


@pytest.mark.parametrize("dx", [48, 1100], ids=["small", "two-blocks"])
def test_moe_combine_gated_add(dx: int) -> None:
    """The combine with a gated add (a shared expert's rows scaled by sigmoid(x . g), the sum
    of kernels.triton.shared_gate in the same launch) against the reference combine plus
    deimos.models.moe.shared_gate_add's gate, on strided x rows."""
    from deimos.models.moe import shared_gate_add

    t, k, d = 3, 4, 40
    g = torch.Generator().manual_seed(11)
    y = torch.randn(t * k, d, generator=g)
    weights = torch.rand(t, k, generator=g)
    shared = torch.randn(t, d, generator=g)
    x = torch.randn(t, dx + 8, generator=g)[:, :dx]  # rows with a stride of dx + 8
    gw = torch.randn(dx, generator=g) / dx**0.5
    got = moe_combine(y.to(DEVICE), weights.to(DEVICE), shared.to(DEVICE), gate=(x.to(DEVICE), gw.to(DEVICE)))
    routed = moe_combine_reference(y, weights)
    want = shared_gate_add(routed, shared.double(), x.double(), gw.double())
    close(f"gated combine dx={dx}", got, want, 1e-5)
    with pytest.raises(ValueError, match="needs add"):
        moe_combine(y.to(DEVICE), weights.to(DEVICE), gate=(x.to(DEVICE), gw.to(DEVICE)))
    with pytest.raises(ValueError, match=r"gate weight must be contiguous float32 \[%d\]" % dx):
        moe_combine(y.to(DEVICE), weights.to(DEVICE), shared.to(DEVICE),
                    gate=(x.to(DEVICE), gw[:-1].to(DEVICE)))
    with pytest.raises(ValueError, match=r"gate x must be float \[3, Dx\]"):
        moe_combine(y.to(DEVICE), weights.to(DEVICE), shared.to(DEVICE),
                    gate=(x[:2].to(DEVICE), gw.to(DEVICE)))


def test_moe_gemm_mmq_default_formats(monkeypatch) -> None:
    """moe_gemm's mmq argument: by default Q4_K only (Q6_K's mmq measured slower than gemm_q)
    and tiles up to 32 rows (slower at 64), none with DEIMOS_MOE_MMQ=0; mmq=True takes every
    format mmq has a product for at every tile."""
    from deimos.quant.triton import moe_gemm as mg

    monkeypatch.setattr(mg, "MMQ_ON", True)
    types = (GGMLType.Q4_K, GGMLType.Q6_K, GGMLType.Q5_K, GGMLType.Q8_0, GGMLType.Q2_K)
    assert [mg._use_mmq(None, t, m) for t in types for m in mg.BLOCK_MS] == [True, True, False] + [False] * 12
    assert [mg._use_mmq(True, t, 64) for t in types] == [True, True, True, True, False]
    assert not mg._use_mmq(True, GGMLType.Q8_0, 16, 800)  # K not whole blocks of 256
    assert not mg._use_mmq(False, GGMLType.Q4_K, 16)
    monkeypatch.setattr(mg, "MMQ_ON", False)
    assert not mg._use_mmq(None, GGMLType.Q4_K, 16)


def test_mmq_swap_and_join_variants(capsys: pytest.CaptureFixture[str]) -> None:
    """mmq.q4k_product's SWAP (weights first) and JOIN (one K = 32 dot a group) variants, through
    bench/exp_gemm_mmq.py's engine kernel (where they are measured), against the float32
    product: each within the float16 weights' rounding."""
    import importlib.util
    import re

    from testdata import REPO

    spec = importlib.util.spec_from_file_location("exp_gemm_mmq", REPO / "bench" / "exp_gemm_mmq.py")
    exp = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(exp)
    if exp.DEV != "cpu":
        pytest.skip("the interpreter's run (on a GPU the bench times it)")
    exp.main(["256x512", "--rows", "16,32", "--only", "swap,join"])
    text = capsys.readouterr().out
    errs = [float(e) for e in re.findall(r"err ([0-9.e+-]+)", text)]
    assert "FAILED" not in text and len(errs) == 6, text
    assert max(errs) < 1e-3, text
