"""Routed experts (a mixture-of-experts MLP): the block the models hold and its float32 reference.

For each token x [D] of a layer with E experts, k of them used (llama.cpp's build_moe_ffn with
softmax gating, as its qwen3moe graph calls it):
    probs   = softmax(router @ x)                       [E]
    ids     = the k largest probs, largest first         [k]  (equal probs: the lower id first)
    weights = probs[ids], rescaled to sum 1 when the model says so (the sum clamped at 2^-14)
    out     = sum over the slots s = 0 .. k-1, in that order, of
              weights[s] * down[ids[s]] @ (silu(gate[ids[s]] @ x) * (up[ids[s]] @ x))

Ties: llama.cpp selects with ggml_argsort_top_k, on the CPU a std::sort of the expert ids by
descending prob. libstdc++ insertion-sorts a range of at most 16 elements (stably), so for
E <= 16 its order is the stable one used here; for larger E its order among exactly equal
probs is unspecified. Selection is on the softmax output (not the logits), as there: logits a
few ulps apart can round to one prob, and then the lower id wins in both.

The model calls ``ops.moe(x, block)`` (deimos.models.ops): the reference ops run
``moe_reference`` below; other ops may route and compute differently (on the device).

qwen35moe and qwen3next add a shared expert that every token goes through (``SharedExpert``,
llama.cpp's build_layer_ffn for both): a SwiGLU MLP of its own width whose output is scaled by
sigmoid(x . ffn_gate_inp_shexp), then added to the routed experts' sum (``MoEShared``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from deimos.kernels.activation import gated_act
from deimos.models.config import ModelConfig

if TYPE_CHECKING:
    from deimos.models.weights import WeightSource

WEIGHT_SUM_MIN = 6.103515625e-5  # llama.cpp clamps the weight sum at f16's smallest normal


class MoE:
    """The routed-expert MLP of layer ``layer``: ``block(x)`` with x [T, D] -> [T, D].

    - ``router``: float32 [E, D] (``blk.N.ffn_gate_inp``);
    - ``gate``, ``up`` [E, F, D] and ``down`` [E, D, F] (``blk.N.ffn_{gate,up,down}_exps``):
      deimos.models.weights ``Experts`` on the reference path (``gate[e]``: expert e's float32
      matrix), deimos.models.gpu ``PackedExperts`` on the kernel path;
    - ``n_expert`` E, ``n_expert_used`` k, ``n_ff`` F, ``normalize`` (rescale the k weights to
      sum 1), ``activation`` ("silu": SwiGLU experts), ``layer``.
    """

    def __init__(self, cfg: ModelConfig, layer: int, w: WeightSource):
        p = f"blk.{layer}"
        e, f, d = cfg.n_expert, cfg.n_ff_exp, cfg.n_embd
        self.router = w.tensor(f"{p}.ffn_gate_inp.weight", (e, d))
        self.gate = w.experts(f"{p}.ffn_gate_exps", e, f, d)
        self.up = w.experts(f"{p}.ffn_up_exps", e, f, d)
        self.down = w.experts(f"{p}.ffn_down_exps", e, d, f)
        self.n_expert, self.n_expert_used, self.n_ff = e, cfg.n_expert_used, f
        self.normalize = cfg.expert_weights_norm
        self.activation = cfg.activation
        self.layer = layer
        self.ops = w.ops

    def __call__(self, x: torch.Tensor, defer: bool = False):
        """``defer``: the caller hands the output only to the ops' next add_rms_norm (Ops.moe)."""
        return self.ops.moe(x, self, defer=defer)


def route(logits: torch.Tensor, k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (weights [T, k] in the logits' float type, at least float32;
    ids [T, k] int64), each row's experts by descending softmax prob, equal probs by id."""
    if logits.ndim != 2 or not 1 <= k <= logits.shape[1]:
        raise ValueError(f"route: want logits [T, E] and 1 <= k <= E, got {tuple(logits.shape)}, k={k}")
    probs = torch.softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
    ids = torch.sort(probs, dim=-1, descending=True, stable=True).indices[:, :k]
    weights = probs.gather(1, ids)
    if normalize:
        weights = weights / weights.sum(-1, keepdim=True).clamp_min(WEIGHT_SUM_MIN)
    return weights, ids


def moe_reference(x: torch.Tensor, block: MoE) -> torch.Tensor:
    """The float32 reference of ``block`` (reference-path ``Experts``): x [T, D] -> [T, D] in
    ``promote_types(x.dtype, float32)`` (float64 stays float64). Each expert's tokens run
    together through its dequantized matrices; the slots are summed in slot order."""
    n, d = x.shape
    dtype = torch.promote_types(x.dtype, torch.float32)
    x = x.to(dtype)
    weights, ids = route(x @ block.router.to(dtype).T, block.n_expert_used, block.normalize)
    k = ids.shape[1]
    slots = x.new_empty((n * k, d))  # row t * k + s: token t's weighted output of slot s
    flat_ids, flat_w = ids.reshape(-1), weights.reshape(-1, 1)
    for e in torch.unique(flat_ids).tolist():
        rows = torch.nonzero(flat_ids == e).squeeze(1)
        h = x[rows // k]
        act = gated_act(h @ block.gate[e].to(dtype).T, h @ block.up[e].to(dtype).T, block.activation)
        slots[rows] = (act @ block.down[e].to(dtype).T) * flat_w[rows]
    slots = slots.view(n, k, d)
    out = slots[:, 0]
    for s in range(1, k):
        out = out + slots[:, s]
    return out


class SharedExpert:
    """The shared expert of layer ``layer``: ``block(x)`` with x [T, D] -> [T, D],
        sigmoid(x . gate_inp) * down(silu(gate x) * up x)
    - ``gate``, ``up`` [Fs, D], ``down`` [D, Fs] (``blk.N.ffn_{gate,up,down}_shexp``): linears,
      Fs = ``cfg.n_ff_shexp``;
    - ``gate_inp`` [D] float32 (``blk.N.ffn_gate_inp_shexp``): one scalar gate per token.
    """

    def __init__(self, cfg: ModelConfig, layer: int, w: WeightSource):
        p = f"blk.{layer}"
        f, d = cfg.n_ff_shexp, cfg.n_embd
        self.gate, self.up = w.linears([(f"{p}.ffn_gate_shexp", f), (f"{p}.ffn_up_shexp", f)], d)
        self.down = w.linear(f"{p}.ffn_down_shexp", d, f, bias=None)
        self.gate_inp = w.vector(f"{p}.ffn_gate_inp_shexp.weight", d)
        self.activation = cfg.activation
        self.layer = layer
        self.ops = w.ops

    def product(self, x: torch.Tensor) -> torch.Tensor:
        """The expert before its gate: down(act(gate x) * up x)."""
        return self.down(self.ops.gated_act(self.gate(x), self.up(x), self.activation))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.product(x) * torch.sigmoid(x @ self.gate_inp.to(x.dtype))[:, None]


class MoEShared:
    """Routed experts plus the shared expert (qwen35moe, qwen3next): ``moe(x) + shared(x)``.
    ``moe`` is the routed block the GPU expert placement and offload look for."""

    def __init__(self, cfg: ModelConfig, layer: int, w: WeightSource):
        self.moe = MoE(cfg, layer, w)
        self.shared = SharedExpert(cfg, layer, w)

    def __call__(self, x: torch.Tensor, defer: bool = False):
        """``defer``: as MoE's."""
        return self.shared.ops.moe_shared(x, self, defer=defer)


def shared_gate_add(routed: torch.Tensor, shared: torch.Tensor, x: torch.Tensor,
                    gate_inp: torch.Tensor) -> torch.Tensor:
    """The MoE block's sum: ``routed + shared * sigmoid(x . gate_inp)`` per token (x's dtype,
    as ``SharedExpert``)."""
    return routed + shared * torch.sigmoid(x @ gate_inp.to(x.dtype))[:, None]


def shared_expert_reference(x: torch.Tensor, block: SharedExpert) -> torch.Tensor:
    """The float32 reference of ``block`` (reference-path ``Linear``s): x [T, D] -> [T, D] in
    ``promote_types(x.dtype, float32)``, from the weight matrices."""
    dtype = torch.promote_types(x.dtype, torch.float32)
    x = x.to(dtype)
    act = gated_act(x @ block.gate.weight.to(dtype).T, x @ block.up.weight.to(dtype).T, block.activation)
    return (act @ block.down.weight.to(dtype).T) * torch.sigmoid(x @ block.gate_inp.to(dtype))[:, None]
