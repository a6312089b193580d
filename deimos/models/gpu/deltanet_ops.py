"""The Gated DeltaNet block on the kernel path (oracle: the CPU branch of
deimos.models.deltanet.GatedDeltaNet, itself checked against llama.cpp).

For a step of B sequences (the first ``n_decode`` one token each, then prefill chunks):
- the four projections of x through the block's linears (QuantLinear / LinearGroup on the GPU),
  read as views of their outputs (``raw_projections``);
- one launch (kernels.triton.gdn_inputs) for what the rule reads: the short causal convolution
  of every sequence with its slot's K - 1 carried inputs (advanced in place), SiLU, the q/k
  head l2 norms, g and beta (the decode rows in one launch, one row a sequence and no
  cu_seqlens: a decode step's graph reads nothing from the host; the prefill chunks in another);
- the gated delta rule on the same slots: gated_delta_decode for the decode rows and
  gated_delta_prefill for the chunks (cu_seqlens from the batch; its chunk pass, then its
  state pass);
- the per-head RMS norm times SiLU(z) in one launch (kernels.triton.gated_norm, through the
  ops: a decode row's output also quantized for the output projection's GEMV), the output
  projection.

The states live in a pool by slot (``[n_slots, Hv, Dk, Dv]`` and ``[n_slots, C, K - 1]`` per
layer): the engine's persistent one (``HybridKV.store``, slots ``HybridKV.slots`` on the device:
a decode step reads nothing from the host, so it can be a CUDA graph), or, when the batch
brings each sequence's own RecurrentState, a pool of this step's rows made for the step
(stacked, slot b = sequence b) and written back to the sequences' tensors after it.

A prefill row's snapshot (``HybridKV.snap``: (rows, slot), a block boundary inside its chunk)
is stored by the same launches into that slot of the state pool: gdn_inputs the carried conv
inputs, gated_delta_prefill the delta-rule state (its chunk grid shifted to end a chunk there).

Value head h reads key head h % Hk (llama.cpp's qwen35 converter orders the value heads so that
ggml_repeat tiles the key heads): the kernels' "tiled" head map. States are in the "kernel"
layout ``[Hv, Dk, Dv]`` (deimos.models.deltanet.RecurrentState.adopt).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from deimos.kernels.triton.gated_delta_decode import gated_delta_decode
from deimos.kernels.triton.gated_delta_prefill import gated_delta_prefill
from deimos.kernels.triton.gdn_inputs import gdn_inputs
from deimos.models.batch import Batch
from deimos.models.deltanet import StateError


def gated_delta_net(block, x: torch.Tensor, batch: Batch, states: list) -> torch.Tensor:
    """``block`` (a GatedDeltaNet) on x ``[T, D]`` for the step ``batch``, whose ``kv`` is a
    HybridKV: with a state pool (``store``, ``slots``) the slots are advanced in place; else
    ``states[b]`` is the RecurrentState of sequence b, in the "kernel" layout on x's device,
    advanced in place (lengths are the model's to move). Returns ``[T, D]``."""
    seqs = batch.seqs
    n, nd, n_seq = x.shape[0], seqs.n_decode, seqs.n_seqs
    hk, hv, dh = block.hk, block.hv, block.dh
    ssm, conv, slots, write_back = _state_rows(batch.kv, states, block, x.device)
    snap = getattr(batch.kv, "snap", None)
    if getattr(batch.kv, "snap_at", None) and any(batch.kv.snap_at):
        raise StateError("gated_delta_net: on the kernel path a snapshot inside the step is "
                         "stored into a state-pool slot (HybridKV.snap), not HybridKV.snaps")
    if snap is not None and (write_back is not None or snap.shape != (n_seq, 2)
                             or snap.dtype != torch.int32):  # fmt: skip
        raise StateError(f"gated_delta_net: HybridKV.snap {snap.dtype} {tuple(snap.shape)}: int32 "
                         f"[{n_seq}, 2] (rows, slot) a sequence, with a state pool")  # fmt: skip
    head_map = block.head_map  # qwen35's tiled, qwen3next's grouped
    mixed, z, b, alpha = block.raw_projections(x)  # views of the linears' outputs
    out = torch.empty(n, hv, dh, dtype=torch.float32, device=x.device)
    scale = dh**-0.5

    def inputs(rows: slice, sl: torch.Tensor, cu: torch.Tensor | None, max_len: int, snapshot=None):
        return gdn_inputs(mixed[rows], block.conv, conv, sl, cu, b[rows], alpha[rows],
                          block.dt_bias, block.a, hk, hv, dh, block.eps, max_len,
                          snapshot=snapshot)  # fmt: skip

    if nd:  # one row a sequence, no cu_seqlens: a decode step's graph reads nothing from the host
        q, k, v, g, beta = inputs(slice(0, nd), slots[:nd], None, 1)
        gated_delta_decode(q, k, v, g, beta, ssm, slots[:nd], scale, head_map, out=out[:nd])
    if nd < n_seq:
        cu, sl = seqs.cu_q[nd:] - nd, slots[nd:n_seq]
        longest = max(seqs.q_lens[nd:])
        sn = None if snap is None else snap[nd:]  # decode rows never snapshot
        q, k, v, g, beta = inputs(slice(nd, n), sl, cu, longest, sn)
        out[nd:].zero_()  # a graph's padding rows (past cu's end) get no output: keep them finite
        gated_delta_prefill(q, k, v, g, beta, cu, ssm, sl, scale, head_map, out=out[nd:],
                            precision=PREFILL_PRECISION if x.is_cuda else "ieee",
                            max_len=longest, snapshot=sn)  # fmt: skip
    if write_back is not None:
        write_back()
    return block.out(block.ops.rms_norm_gated(out, z, block.norm, block.eps))


# the prefill kernels' fp32 dots: tf32 on the tensor cores (qwen35 4B's 512-token prompt: 5.3 ms a
# layer in ieee fp32, on the FMA units); the oracle within 5e-3 at the real heads
# (tests/test_triton_gated_delta.py)
PREFILL_PRECISION = "tf32"


def _state_rows(kv, states: list, block, device: torch.device
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Callable[[], None] | None]:
    """(ssm pool [S, Hv, Dk, Dv], conv pool [S, C, K - 1], slots int32 [B], write_back or None)
    of the block's layer: the batch's state pool, or a pool of the sequences' own states."""
    layer, hv, dh = block.layer, block.hv, block.dh
    c, kw = block.conv.shape
    store = getattr(kv, "store", None)
    if store is not None:
        ssm, conv = store.ssm[layer], store.conv[layer]
        if (ssm.shape[1:] != (hv, dh, dh) or conv.shape[1:] != (c, kw - 1)
                or ssm.device != device or conv.device != device):  # fmt: skip
            raise ValueError(f"gated_delta_net: layer {layer}: the state pool holds "
                             f"{tuple(ssm.shape)} and {tuple(conv.shape)} on {ssm.device}, not "
                             f"[S, {hv}, {dh}, {dh}] and [S, {c}, {kw - 1}] on {device}")  # fmt: skip
        return ssm, conv, kv.slots, None
    for b, st in enumerate(states):
        s = st.ssm[layer]
        if st.layout != "kernel" or s.device != device or s.shape != (hv, dh, dh):
            raise ValueError(f"gated_delta_net: layer {layer}: sequence {b}'s state is "
                             f"{st.layout} {tuple(s.shape)} on {s.device}, not the kernel layout "
                             f"[{hv}, {dh}, {dh}] on {device} (RecurrentState.adopt)")  # fmt: skip
    # this step's pool: slot b = sequence b (one stack and one copy back per layer and step)
    ssm = torch.stack([st.ssm[layer] for st in states])
    conv = torch.stack([st.conv[layer].t() for st in states])  # [B, C, K - 1]
    slots = torch.arange(len(states), dtype=torch.int32, device=device)

    def write_back() -> None:
        torch._foreach_copy_([st.ssm[layer] for st in states], list(ssm.unbind(0)))
        torch._foreach_copy_([st.conv[layer] for st in states], [t.t() for t in conv.unbind(0)])

    return ssm, conv, slots, write_back
