"""The fused one-token MoE kernels (quant.triton.moe_decode) against the unfused chain they
replace (moe_gemv, gated_act, moe_combine: bit for bit at the same tile) and against the
float64 references (deimos.kernels.moe) on the dequantized stacks.

Routing as test_triton_moe's: 7 experts in 5 slots, two experts off the device (a zero row
from moe_gate_up, nothing added by moe_down_combine), ids holding expert 0 and the last expert
chosen by every token. Outputs are poisoned first (NaN; 0x7777 in the integer planes).
"""

from __future__ import annotations

import pytest
import torch
from kernel_checks import close  # imports kernel_device, which sets TRITON_INTERPRET: first
from kernel_device import DEVICE
from test_triton_moe import SLOT_OF, _ids, _missing_rows, _slot_of, _stack

from deimos.gguf.constants import GGMLType
from deimos.kernels.activation import gated_act as gated_act_reference
from deimos.kernels.moe import moe_combine_reference, moe_experts_reference, moe_route_reference
from deimos.kernels.triton.activation import gated_act
from deimos.kernels.triton.moe_route import moe_combine, moe_route
from deimos.kernels.triton.moe_router import RouterScratch, moe_router
from deimos.quant.triton.gemv_q8 import empty_quantized, q8_config, quantize_x, quantize_x_reference
from deimos.quant.triton.moe_decode import (
    down_config,
    gate_up_config,
    moe_down_combine,
    moe_gate_up,
)
from deimos.quant.triton.moe_gemv import moe_gemv, moe_gemv_tile
from deimos.quant.triton.naive import dequantize_packed

PAIRS = [(GGMLType.Q4_K, GGMLType.Q4_K), (GGMLType.Q6_K, GGMLType.Q6_K), (GGMLType.Q8_0, GGMLType.Q8_0),
         (GGMLType.Q5_K, GGMLType.Q4_K), (GGMLType.Q2_K, GGMLType.IQ2_XS)]


def _poisoned(rows: int, n: int):
    q = empty_quantized(rows, n, DEVICE)
    q.xq.fill_(0x7777)
    q.xd.fill_(float("nan"))
    q.xs.fill_(0x7777)
    return q


def _x(rows: int, k: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, k, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("n_ff", [64, 96], ids=["whole-tile", "part-tile"])
@pytest.mark.parametrize("fmts", PAIRS, ids=lambda p: f"{p[0].name}-{p[1].name}")
def test_moe_gate_up(fmts: tuple[GGMLType, GGMLType], n_ff: int) -> None:
    """Equal to moe_gemv (gate), moe_gemv (up) and gated_act's quantized output at the same
    tile, for 2 tokens x 3 experts; close to the float64 act(gate x) * up x."""
    k, n_tok, top_k = 256, 2, 3
    gate = _stack(fmts[0], n_ff, k, seed=3)
    up = _stack(fmts[1], n_ff, k, seed=4)
    ids = _ids(n_tok, top_k, seed=5).to(DEVICE)
    x = _x(n_tok, k, seed=6)
    qx = quantize_x(x.to(DEVICE))
    cfg = gate_up_config(gate, n_ff)
    got = moe_gate_up(gate, up, n_ff, qx, ids, _slot_of(), "silu", out=_poisoned(n_tok * top_k, n_ff), cfg=cfg)
    g = moe_gemv(gate, n_ff, qx, ids, _slot_of(), "token", cfg=cfg)
    u = moe_gemv(up, n_ff, qx, ids, _slot_of(), "token", cfg=cfg)
    want = empty_quantized(n_tok * top_k, n_ff, DEVICE)
    gated_act(g, u, "silu", quantized=want)
    for name, a, b in zip(("codes", "scales", "sums"), got, want):
        assert torch.equal(a.cpu(), b.cpu()), f"{name} differ from the unfused chain's"
    # the codes dequantized against float64 products of the dequantized stacks
    xr = quantize_x_reference(x)
    gr = moe_experts_reference(dequantize_packed(gate), n_ff, xr, ids, _slot_of(), "token")
    ur = moe_experts_reference(dequantize_packed(up), n_ff, xr, ids, _slot_of(), "token")
    ref = gated_act_reference(gr, ur, "silu")
    # the activation's values are pinned through a down GEMV on it (the planes' packing is
    # gemv_q8's own, tested there)
    miss = _missing_rows(ids.cpu())
    assert miss.any() and (~miss).any()
    assert torch.equal(got.xd.cpu()[miss], torch.zeros(int(miss.sum()), n_ff // 32))
    d = 48
    down = _stack(GGMLType.Q8_0, d, n_ff, seed=7)
    y = moe_gemv(down, d, got, ids, _slot_of(), "pair")
    y_ref = moe_experts_reference(dequantize_packed(down), d, ref, ids, _slot_of(), "pair")
    close(f"gate_up {fmts[0].name}/{fmts[1].name} through a down GEMV", y, y_ref, 2e-3)


@pytest.mark.parametrize("t", [GGMLType.Q4_K, GGMLType.Q6_K, GGMLType.Q8_0, GGMLType.Q5_0],
                         ids=lambda t: t.name)
def test_moe_down_combine(t: GGMLType) -> None:
    """Equal to moe_gemv (pair rows) then moe_combine at the same tile, 3 tokens x 4 experts,
    D = 70 (a part tile); close to the float64 weighted sum; experts off the device add 0."""
    d, n_ff, n_tok, top_k = 70, 256, 3, 4
    down = _stack(t, d, n_ff, seed=9)
    ids = _ids(n_tok, top_k, seed=10).to(DEVICE)
    a = _x(n_tok * top_k, n_ff, seed=11)
    qa = quantize_x(a[:8].to(DEVICE)), quantize_x(a[8:].to(DEVICE))
    qa = type(qa[0])(*(torch.cat([qa[0][i], qa[1][i]]) for i in range(3)))
    weights = torch.rand(n_tok, top_k, generator=torch.Generator().manual_seed(12)).to(DEVICE)
    cfg = down_config(down, d)
    out = torch.full((n_tok, d), float("nan"), device=DEVICE)
    got = moe_down_combine(down, d, qa, ids, weights, _slot_of(), out=out, cfg=cfg)
    assert got is out
    want = moe_combine(moe_gemv(down, d, qa, ids, _slot_of(), "pair", cfg=cfg), weights)
    assert torch.equal(got.cpu(), want.cpu()), "differs from moe_gemv + moe_combine"
    y_ref = moe_experts_reference(dequantize_packed(down), d, quantize_x_reference(a), ids, _slot_of(), "pair")
    close(f"down_combine {t.name}", got, moe_combine_reference(y_ref, weights.cpu()), 1e-5)
    assert any(SLOT_OF[e] < 0 for e in ids.cpu().reshape(-1).tolist())


def test_moe_decode_bad_input() -> None:
    k, n_ff = 256, 64
    gate = _stack(GGMLType.Q4_K, n_ff, k, seed=1)
    ids = _ids(1, 2, seed=1).to(DEVICE)
    qx = quantize_x(_x(1, k, seed=1).to(DEVICE))
    with pytest.raises(ValueError, match="unknown activation"):
        moe_gate_up(gate, gate, n_ff, qx, ids, _slot_of(), "relu")
    with pytest.raises(ValueError, match="not a multiple of 32"):
        moe_gate_up(gate, gate, n_ff, qx, ids, _slot_of(), "silu", cfg=gate_up_config(gate, n_ff)._replace(block_n=16))
    with pytest.raises(ValueError, match=r"x must be \[1, 256\]"):
        moe_gate_up(gate, gate, n_ff, quantize_x(_x(2, k, seed=1).to(DEVICE)), ids, _slot_of(), "silu")
    other = _stack(GGMLType.Q4_K, n_ff, 512, seed=2)
    with pytest.raises(ValueError, match="gate .* and up .* differ"):
        moe_gate_up(gate, other, n_ff, qx, ids, _slot_of(), "silu")
    down = _stack(GGMLType.Q8_0, 32, n_ff, seed=3)
    qa = quantize_x(_x(2, n_ff, seed=2).to(DEVICE))
    w = torch.rand(1, 2, device=DEVICE)
    with pytest.raises(ValueError, match="weights must be contiguous float32"):
        moe_down_combine(down, 32, qa, ids, w.double(), _slot_of())
    with pytest.raises(ValueError, match=r"activation must be \[2, 64\]"):
        moe_down_combine(down, 32, quantize_x(_x(1, n_ff, seed=2).to(DEVICE)), ids, w, _slot_of())
    with pytest.raises(ValueError, match="not whole slots"):
        moe_down_combine(down, 33, qa, ids, w, _slot_of())


# ---- the fused router -----------------------------------------------------------------------


def _grid_case(t: int, e: int, d: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x and W_r on coarse grids (every product and sum exact in float32, so any summation
    order gives the same logits), W_r's rows 1 and 2 equal (a tie), the last expert's row
    large (chosen by every token)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-4, 5, (t, d), generator=g).float() / 4
    w = torch.randint(-8, 9, (e, d), generator=g).float() / 8
    w[2] = w[1]
    w[-1] = x.sign().sum(0).sign()  # aligned with the tokens' signs
    return x, w


@pytest.mark.parametrize("case", [(1, 128, 2048, 8), (3, 20, 96, 4), (8, 7, 64, 7)],
                         ids=["qwen3moe", "part-split", "k=E-1"])
@pytest.mark.parametrize("renorm", [False, True], ids=["softmax", "renorm"])
def test_moe_router_exact(case: tuple[int, int, int, int], renorm: bool) -> None:
    """Exact logits: ids and weights equal moe_route's on x W_r^T (ties lowest id first), and
    the ids the float64 reference's; twice in a row (the counters back at 0 each time)."""
    t, e, d, k = case
    x, w = _grid_case(t, e, d, seed=e + t)
    scratch = RouterScratch()(e, torch.device(DEVICE))
    want = moe_route((x @ w.T).to(DEVICE), k, renorm)
    ref_w, ref_ids = moe_route_reference(x.double() @ w.double().T, k, renorm)
    for _ in range(2):
        got = moe_router(x.to(DEVICE), w.to(DEVICE), k, renorm, scratch)
        assert torch.equal(got[1].cpu(), want[1].cpu()) and torch.equal(got[0].cpu(), want[0].cpu())
        assert torch.equal(got[1].cpu().long(), ref_ids)
        close("router weights", got[0], ref_w, 1e-6)
        assert not scratch[1].cpu().any(), "a counter was left non-zero"


def test_moe_router_random() -> None:
    """Normal x and W_r at qwen3moe's shapes, 2 tokens: the reference's ids, weights to float32."""
    t, e, d, k = 2, 128, 2048, 8
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(t, d, generator=g), torch.randn(e, d, generator=g) * 0.02
    got = moe_router(x.to(DEVICE), w.to(DEVICE), k, True, RouterScratch()(e, torch.device(DEVICE)))
    ref_w, ref_ids = moe_route_reference(x.double() @ w.double().T, k, True)
    assert torch.equal(got[1].cpu().long(), ref_ids)
    close("router weights", got[0], ref_w, 1e-5)


def test_moe_router_bad_input() -> None:
    scratch = RouterScratch()(8, torch.device(DEVICE))
    w = torch.zeros(8, 64, device=DEVICE)
    with pytest.raises(ValueError, match="at most 8"):
        moe_router(torch.zeros(9, 64, device=DEVICE), w, 2, True, scratch)
    with pytest.raises(ValueError, match=r"router must be contiguous float32 \[E, 32\]"):
        moe_router(torch.zeros(1, 32, device=DEVICE), w, 2, True, scratch)
    with pytest.raises(ValueError, match="k = 9"):
        moe_router(torch.zeros(1, 64, device=DEVICE), w, 9, True, scratch)
    with pytest.raises(ValueError, match="scratch for E = 8"):
        moe_router(torch.zeros(1, 64, device=DEVICE), torch.zeros(4, 64, device=DEVICE), 2, True, scratch)


@pytest.mark.parametrize("case", [(GGMLType.Q4_K, 40, 2048, "token"), (GGMLType.Q6_K, 48, 768, "pair")],
                         ids=["Q4_K-gate", "Q6_K-down"])
def test_moe_gemv_swept_tiles(case) -> None:
    """The tiles moe_gemv's GPU rule takes from the sweep (moe_gemv_tile) give the reference's
    products: 2 tokens x 3 experts, a part tile of rows."""
    t, n, k, x_rows = case
    w = _stack(t, n, k, seed=21)
    ids = _ids(2, 3, seed=22).to(DEVICE)
    rows = 2 if x_rows == "token" else 6
    x = _x(rows, k, seed=23)
    cfg = moe_gemv_tile(t, n, k)
    assert cfg != q8_config(t, n, k, 1)  # the swept tile, not gemv_q8's rule
    y = moe_gemv(w, n, quantize_x(x.to(DEVICE)), ids, _slot_of(), x_rows, cfg=cfg)
    ref = moe_experts_reference(dequantize_packed(w), n, quantize_x_reference(x), ids, _slot_of(), x_rows)
    close(f"moe_gemv {t.name} at {tuple(cfg)}", y, ref, 1e-5)


def test_a_bad_fusion_switch_is_named() -> None:
    """DEIMOS_MOE_FUSED other than 0, router or 1: a named error when the ops are imported."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "DEIMOS_MOE_FUSED": "yes"}
    r = subprocess.run([sys.executable, "-c", "import deimos.models.gpu.moe_ops"], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "DEIMOS_MOE_FUSED must be 0, router or 1, got 'yes'" in r.stderr
