"""Model architectures and loading: ``load_model(file)`` builds the reference model of a GGUF file."""

from __future__ import annotations

import torch

from deimos.gguf import GGUFFile
from deimos.models.blocks import DecoderModel
from deimos.models.config import ConfigError, ModelConfig
from deimos.models.gemma3 import Gemma3Model
from deimos.models.llama import LlamaModel
from deimos.models.qwen3moe import Qwen3MoeModel
from deimos.models.qwen3next import Qwen3NextModel
from deimos.models.qwen35 import Qwen35Model
from deimos.models.qwen35moe import Qwen35MoeModel
from deimos.models.weights import EXPERT_CACHE_BYTES, MemoryBudgetError, WeightError, WeightSource

ARCHITECTURES: dict[str, type[DecoderModel]] = {
    "llama": LlamaModel,
    "qwen2": LlamaModel,
    "qwen3": LlamaModel,
    "gemma3": Gemma3Model,
    "qwen3moe": Qwen3MoeModel,
    "qwen35": Qwen35Model,
    "qwen35moe": Qwen35MoeModel,
    "qwen3next": Qwen3NextModel,
}


def load_model(file: GGUFFile, device: str = "cpu", expert_device: str | None = None) -> DecoderModel:
    """The file's model on ``device``; ``expert_device``: where a MoE model's routed experts
    go (default: the device; "cpu": host copies for deimos.models.gpu.offload)."""
    config = ModelConfig.from_gguf(file.metadata, source=str(file.path), tensors=file.tensors)
    if torch.device(device).type == "cpu":
        _check_cpu_memory(file)
    return ARCHITECTURES[config.arch](config, WeightSource(file, device, expert_device=expert_device))


def _check_cpu_memory(file: GGUFFile) -> None:
    """The CPU reference holds every weight as float32: refuse, before the first one, a file
    whose weights cannot fit (a sparse file of consistent but huge shapes would otherwise
    load layer after layer until the system kills the process). Routed experts (3-D tensors)
    are dequantized as tokens reach them, into a cache of at most EXPERT_CACHE_BYTES."""
    dense = sum(t.n_elements for t in file.tensors.values() if len(t.dims) < 3)
    experts = sum(t.n_elements for t in file.tensors.values() if len(t.dims) >= 3)
    need = 4 * dense + min(4 * experts, EXPERT_CACHE_BYTES)
    free = _available_memory()
    if free is not None and need > free:
        raise MemoryBudgetError(
            f"{file.path}: the float32 CPU reference needs {need / 2**30:.1f} GiB for the "
            f"weights, only {free / 2**30:.1f} GiB of memory is available"
        )


def _available_memory() -> int | None:
    """MemAvailable + SwapFree in bytes (Linux), None where /proc/meminfo is not there."""
    try:
        with open("/proc/meminfo") as f:
            kib = {k: int(v.split()[0]) for k, v in (line.split(":", 1) for line in f if ":" in line)}
    except (OSError, ValueError):
        return None
    if "MemAvailable" not in kib:
        return None
    return (kib["MemAvailable"] + kib.get("SwapFree", 0)) * 1024


__all__ = ["ARCHITECTURES", "ConfigError", "DecoderModel", "MemoryBudgetError", "ModelConfig",
           "WeightError", "load_model"]
