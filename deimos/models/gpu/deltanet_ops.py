"""The Gated DeltaNet block on the kernel path (oracle: the CPU branch of
deimos.models.deltanet.GatedDeltaNet, itself checked against llama.cpp).

For a step of B sequences (the first ``n_decode`` one token each, then prefill chunks):
- the four projections of x through the block's linears (QuantLinear / LinearGroup on the GPU);
- the short causal convolution with each sequence's K - 1 carried inputs, in torch ops on the
  device (no conv kernel yet): the decode rows in one batched expression, each prefill chunk
  by deimos.kernels.deltanet.causal_conv1d; then SiLU, the q/k head l2-norms, g and beta;
- the gated delta rule: the step's states stacked into a per-step pool ``[B, Hv, Dk, Dv]``
  (slot b = sequence b), gated_delta_decode for the decode rows and gated_delta_prefill for
  the chunks (cu_seqlens from the batch), then each state written back to its sequence's own
  tensor (one stack and one copy per layer and step: 2 x B x Hv Dk Dv x 4 bytes read and
  written, about what the decode kernel itself moves; a persistent pool owned by the engine
  would remove both, see the report);
- the per-head RMS norm (the Triton kernel), times SiLU(z), the output projection.

Value head h reads key head h % Hk (llama.cpp's qwen35 converter orders the value heads so that
ggml_repeat tiles the key heads): the kernels' "tiled" head map. States are in the "kernel"
layout ``[Hv, Dk, Dv]`` (deimos.models.deltanet.RecurrentState.adopt).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deimos.kernels.deltanet import causal_conv1d
from deimos.kernels.triton.gated_delta_decode import gated_delta_decode
from deimos.kernels.triton.gated_delta_prefill import gated_delta_prefill
from deimos.models.batch import Batch

HEAD_MAP = "tiled"  # qwen35's value head h reads key head h % Hk; a block's head_map overrides


def gated_delta_net(block, x: torch.Tensor, batch: Batch, states: list) -> torch.Tensor:
    """``block`` (a GatedDeltaNet) on x ``[T, D]`` for the step ``batch``; ``states[b]``: the
    RecurrentState of sequence b, in the "kernel" layout on x's device, advanced in place
    (its ``length`` is the model's to move). Returns ``[T, D]``."""
    seqs = batch.seqs
    n, nd, n_seq = x.shape[0], seqs.n_decode, seqs.n_seqs
    hk, hv, dh, layer = block.hk, block.hv, block.dh, block.layer
    for b, st in enumerate(states):
        s = st.ssm[layer]
        if st.layout != "kernel" or s.device != x.device or s.shape != (hv, dh, dh):
            raise ValueError(f"gated_delta_net: layer {layer}: sequence {b}'s state is "
                             f"{st.layout} {tuple(s.shape)} on {s.device}, not the kernel layout "
                             f"[{hv}, {dh}, {dh}] on {x.device} (RecurrentState.adopt)")  # fmt: skip
    head_map = getattr(block, "head_map", HEAD_MAP)
    if hasattr(block, "projections"):  # qwen3next: its own projection layouts (ssm_ba, ssm_in)
        mixed, z, beta, g = block.projections(x)
        mixed, z = mixed.float(), z.float()
        beta, g = beta.float().contiguous(), g.float().contiguous()
    else:
        mixed = block.qkv(x).float()
        z = block.gate(x).float().view(n, hv, dh)
        beta = torch.sigmoid(block.beta(x).float()).contiguous()
        g = (F.softplus(block.alpha(x).float() + block.dt_bias) * block.a).contiguous()
    y = F.silu(_conv(mixed, block.conv, states, layer, seqs.q_lens, nd))
    q = _l2_norm(y[:, : hk * dh].reshape(n, hk, dh), block.eps)
    k = _l2_norm(y[:, hk * dh : 2 * hk * dh].reshape(n, hk, dh), block.eps)
    v = y[:, 2 * hk * dh :].reshape(n, hv, dh).contiguous()
    pool = torch.stack([st.ssm[layer] for st in states])  # [B, Hv, Dk, Dv], slot b = sequence b
    slots = torch.arange(n_seq, dtype=torch.int32, device=x.device)
    out = torch.empty(n, hv, dh, dtype=torch.float32, device=x.device)
    scale = dh**-0.5
    if nd:
        gated_delta_decode(q[:nd], k[:nd], v[:nd], g[:nd], beta[:nd], pool, slots[:nd], scale,
                           head_map, out=out[:nd])  # fmt: skip
    if nd < n_seq:
        gated_delta_prefill(q[nd:], k[nd:], v[nd:], g[nd:], beta[nd:], seqs.cu_q[nd:] - nd, pool,
                            slots[nd:], scale, head_map, out=out[nd:])  # fmt: skip
    torch._foreach_copy_([st.ssm[layer] for st in states], list(pool.unbind(0)))
    o = block.ops.rms_norm(out.view(n * hv, dh), block.norm, block.eps).view(n, hv, dh)
    return block.out((o * F.silu(z)).reshape(n, hv * dh))


def _conv(mixed: torch.Tensor, weight: torch.Tensor, states: list, layer: int, q_lens: list[int],
          nd: int) -> torch.Tensor:
    """The causal convolution of every sequence's rows of ``mixed [T, C]`` (float32) with its
    carried inputs ``conv[layer] [K - 1, C]``, which it advances. Returns ``[T, C]``."""
    y = torch.empty_like(mixed)
    if nd:  # one token each: its K - 1 predecessors and itself against the K taps
        carried = torch.stack([st.conv[layer] for st in states[:nd]])  # [nd, K - 1, C]
        xin = torch.cat((carried, mixed[:nd, None]), dim=1)  # [nd, K, C]
        y[:nd] = (xin * weight.t()).sum(1)
        torch._foreach_copy_([st.conv[layer] for st in states[:nd]], list(xin[:, 1:].unbind(0)))
    t0 = nd
    for st, m in zip(states[nd:], q_lens[nd:]):
        y[t0 : t0 + m], st.conv[layer] = causal_conv1d(mixed[t0 : t0 + m], weight, st.conv[layer])
        t0 += m
    return y


def _l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """As the reference (ggml's build_gdn_l2_norm): x / sqrt(sum x^2 + eps), contiguous."""
    return (x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)).contiguous()
