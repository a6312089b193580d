"""Model architectures and loading: ``load_model(file)`` builds the reference model of a GGUF file."""

from __future__ import annotations

from deimos.gguf import GGUFFile
from deimos.models.blocks import DecoderModel
from deimos.models.config import ConfigError, ModelConfig
from deimos.models.gemma3 import Gemma3Model
from deimos.models.llama import LlamaModel
from deimos.models.weights import WeightError, WeightSource

ARCHITECTURES: dict[str, type[DecoderModel]] = {
    "llama": LlamaModel,
    "qwen2": LlamaModel,
    "qwen3": LlamaModel,
    "gemma3": Gemma3Model,
}


def load_model(file: GGUFFile, device: str = "cpu") -> DecoderModel:
    config = ModelConfig.from_gguf(file.metadata, source=str(file.path), tensors=file.tensors)
    return ARCHITECTURES[config.arch](config, WeightSource(file, device))


__all__ = ["ARCHITECTURES", "ConfigError", "DecoderModel", "ModelConfig", "WeightError", "load_model"]
