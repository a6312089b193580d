"""Which form each quantized linear keeps on the device, decided after loading, from free memory.

Every quantized linear keeps its packed GGUF bytes (the decode GEMV reads them). A linear may
also get a resident fp16 copy (``QuantLinear.dense``): batched decode steps of 3 or more rows
(but Q4_K's of 5..32 rows: gemm_q's mmq beats the copy there, deimos.models.gpu.linear) and
every prefill then multiply on it with the tensor cores, with no dequantization in the step
(H200, llama 8B Q4_K_M: the linears of a 16-row decode step ~9.5 ms on the packed bytes, ~4.9
on the copies; BENCHMARKS.md). It costs two bytes a weight (8B: ~16 GB beside ~4.9 GB of
packed weights), taken from what the KV pool would otherwise get.

``mode``: "off" never; "on" every linear (a clear error when the card cannot hold them);
"auto" (the default) only when all the copies fit in ``AUTO_FRACTION`` of the memory free
after loading, less a reserve: a 141 GB card serving an 8B model gets them, a 24 GB card keeps
its memory for the KV cache. All or none in "auto", so that a step's speed does not depend on
which layers happened to fit.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from deimos.models.gpu.dequant import dequantize_fp16
from deimos.models.gpu.linear import LinearGroup, LinearPart, QuantLinear
from deimos.models.gpu.source import main_tensors

log = logging.getLogger("deimos")

MODES = ("auto", "on", "off")
AUTO_FRACTION = 0.5  # of the memory free after loading (the rest: KV pool, activations)
RESERVE_BYTES = 4 * 2**30  # kept free in any case (the step's activations, graph pools)


@dataclass(frozen=True)
class DensePlan:
    linears: int  # quantized linears of the model
    dense: int  # those given an fp16 copy
    bytes: int  # the copies' bytes
    reason: str


def quant_linears(model) -> list[QuantLinear]:
    """Every QuantLinear a model calls (a group's shared matrix once), in model order."""
    seen: dict[int, QuantLinear] = {}

    def visit(obj, depth: int) -> None:
        if depth > 6 or obj is None or isinstance(obj, (torch.Tensor, str, int, float, bool)):
            return
        if isinstance(obj, QuantLinear):
            seen.setdefault(id(obj), obj)
            return
        if isinstance(obj, LinearPart):
            visit(obj.group, depth + 1)
            return
        if isinstance(obj, LinearGroup):
            visit(obj.linear, depth + 1)
            return
        if isinstance(obj, (list, tuple)):
            for o in obj:
                visit(o, depth + 1)
            return
        for v in getattr(obj, "__dict__", {}).values():
            visit(v, depth + 1)

    visit(getattr(model, "layers", []), 0)
    visit(getattr(model, "lm_head", None), 0)
    return list(seen.values())


def dense_bytes(lin: QuantLinear) -> int:
    return lin.packed.n * lin.packed.k * 2


def place_dense(model, mode: str = "auto", free_bytes: int | None = None) -> DensePlan:
    """Give the model's quantized linears their fp16 copies per ``mode`` (module docstring).
    ``free_bytes``: the device's free memory (default: asked of the driver)."""
    if mode not in MODES:
        raise ValueError(f"dense weights must be one of {', '.join(MODES)}, got {mode!r}")
    lins = quant_linears(model)
    need = sum(dense_bytes(lin) for lin in lins)
    if not lins or mode == "off":
        return DensePlan(len(lins), 0, 0, "off" if lins else "no quantized linears")
    device = lins[0].packed.device
    if device.type != "cuda" and mode == "auto":
        return DensePlan(len(lins), 0, 0, "auto: not on a GPU")
    if free_bytes is None and device.type == "cuda":
        free_bytes, _ = torch.cuda.mem_get_info(device)
    if mode == "auto":
        room = AUTO_FRACTION * max(0, (free_bytes or 0) - RESERVE_BYTES)
        if need > room:
            reason = (f"auto: fp16 copies ({need / 2**30:.1f} GiB) exceed half the free memory "
                      f"({(free_bytes or 0) / 2**30:.1f} GiB) less {RESERVE_BYTES / 2**30:.0f} GiB")
            return DensePlan(len(lins), 0, 0, reason)
    elif free_bytes is not None and need > free_bytes - RESERVE_BYTES:
        raise ValueError(f"--dense-weights on: the fp16 copies need {need / 2**30:.1f} GiB, the device "
                         f"has {free_bytes / 2**30:.1f} GiB free (less a {RESERVE_BYTES / 2**30:.0f} GiB "
                         "reserve); use auto or off")
    for lin in lins:
        lin.dense = dequantize_fp16(lin.packed)  # element order: x needs no column permutation
    log.info("dense weights: fp16 copies of %d quantized linears, %.1f GiB", len(lins), need / 2**30)
    return DensePlan(len(lins), len(lins), need, mode)


# ---- routed experts ----------------------------------------------------------------------------

EXPERT_MODES = ("auto", "gpu", "cpu")


@dataclass(frozen=True)
class ExpertPlan:
    device: str  # where the experts' packed stacks are loaded: "gpu" or "cpu" (host copies)
    expert_bytes: int
    other_bytes: int
    reason: str


def expert_bytes(file, mtp: bool = False) -> tuple[int, int]:
    """(routed experts' bytes, every other tensor's bytes) of a GGUF file's main layers (with
    ``mtp``, its MTP layers' too: what ``load_mtp`` puts on the device when MTP drafting is
    asked for): its blocks as stored, which is what the packed layouts take within a few
    percent."""
    # an MTP layer's tensors are loaded on the GPU path only for MTP drafting (load_mtp)
    infos = list(file.tensors.values()) if mtp else main_tensors(file)
    experts = sum(t.nbytes for t in infos if len(t.dims) >= 3)
    return experts, sum(t.nbytes for t in infos if len(t.dims) < 3)


def plan_experts(file, mode: str = "auto", free_bytes: int | None = None,
                 reserve_bytes: int = 0, mtp: bool = False) -> ExpertPlan:
    """Where a MoE file's routed experts go, decided before loading. "auto": on the GPU when
    every weight fits in the free memory less ``reserve_bytes`` (the KV pool's share and the
    step's activations) and the cache's headroom (runtime.gpu_memory); else host copies with a
    GPU cache of slots (deimos.models.gpu.offload). "gpu" / "cpu" force it. ``mtp``: MTP
    drafting is asked for, so the MTP layers' weights (a MoE layer's experts among them) are
    counted as going on the device too."""
    if mode not in EXPERT_MODES:
        raise ValueError(f"experts must be one of {', '.join(EXPERT_MODES)}, got {mode!r}")
    e, other = expert_bytes(file, mtp=mtp)
    if e == 0:
        return ExpertPlan("gpu", 0, other, "no routed experts")
    if mode != "auto":
        return ExpertPlan(mode, e, other, mode)
    if free_bytes is None:
        free_bytes, _ = torch.cuda.mem_get_info()
    from deimos.runtime.gpu_memory import headroom

    room = free_bytes - reserve_bytes - headroom(free_bytes)
    if e + other <= room:
        return ExpertPlan("gpu", e, other, f"auto: {(e + other) / 2**30:.1f} GiB of weights fit")
    return ExpertPlan("cpu", e, other, f"auto: {(e + other) / 2**30:.1f} GiB of weights, "
                      f"{max(room, 0) / 2**30:.1f} GiB free for them: experts on the host, a GPU cache")


KV_CONTEXTS_SHARE = 0.25  # a second context's KV, when two take at most this share of the room


def offload_kv_tokens(n_ctx: int, kv_bytes_per_token: int, other_bytes: int, step_bytes: int,
                      free_bytes: int, name: str = "the model", stage_bytes: int = 0) -> int:
    """The KV pool of a model whose experts are offloaded, in tokens, decided before loading:
    the room is the free memory less the weights that go on the device (``other_bytes``), the
    step's activations, the prompt staging ring (``stage_bytes``: runtime.expert_stream) and
    the headroom (runtime.gpu_memory); what the pool does not take is
    the expert cache's. Two contexts (a second sequence, a prefix kept for the next turn) when
    they take at most KV_CONTEXTS_SHARE of the room, else one: an agent's 40k-token context of
    qwen3moe 30B-A3B is 3.8 GiB of KV a context, on an 8 GB card all it can spare. A context
    whose KV does not fit at all is an error naming the longest that would."""
    from deimos.runtime.gpu_memory import headroom

    room = free_bytes - other_bytes - step_bytes - stage_bytes - headroom(free_bytes)  # the engine's card
    one = n_ctx * kv_bytes_per_token
    if one > room:
        most = max(0, room) // kv_bytes_per_token // 256 * 256
        raise ValueError(
            f"{name}: a {n_ctx}-token context needs {one / 2**30:.1f} GiB of KV cache, and "
            f"{max(room, 0) / 2**30:.1f} GiB of the GPU's {free_bytes / 2**30:.1f} GiB free are "
            f"left beside {other_bytes / 2**30:.1f} GiB of weights and the step's room"
            + (f": use a context of at most {most} tokens (-c / n_ctx)" if most >= 256
               else ": the GPU is too small for this model even with its experts on the host"))
    return 2 * n_ctx if 2 * one <= KV_CONTEXTS_SHARE * room else n_ctx
