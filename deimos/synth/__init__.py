"""Random-weight GGUF files of real architectures, for tests and benchmarks (``deimos synth``).

``write_model(path, arch, preset, ggml_type, vocab_from, seed)`` writes one; ``PRESETS`` lists
the shapes (a tiny one per architecture and the real sizes).
"""

from __future__ import annotations

from deimos.synth.presets import ARCHS, PRESETS, SynthPreset, get_preset
from deimos.synth.mix import FTYPES, WeightTypes, weight_types
from deimos.synth.writer import read_tokenizer, tensor_bytes, write_model

__all__ = ["ARCHS", "FTYPES", "PRESETS", "SynthPreset", "WeightTypes", "get_preset", "read_tokenizer",
           "tensor_bytes", "weight_types", "write_model"]
