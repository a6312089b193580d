"""Random-weight GGUF files of real architectures, for tests and benchmarks (``deimos synth``).

``write_model(path, arch, preset, ggml_type, vocab_from, seed)`` writes one; ``PRESETS`` lists
the shapes (a tiny one per architecture and the real sizes); ``ggml_type`` is a llama.cpp mix
(``FTYPES``: Q4_K_M, Q8_0, ...) or one GGML type for every matrix (``weight_types``).
"""

from __future__ import annotations

from deimos.synth.presets import ARCHS, PRESETS, TYPICAL_VOCAB, SynthPreset, get_preset
from deimos.synth.mix import FTYPES, WeightTypes, weight_types
from deimos.synth.writer import planned_size, read_tokenizer, tensor_bytes, write_model

__all__ = ["ARCHS", "FTYPES", "PRESETS", "TYPICAL_VOCAB", "SynthPreset", "WeightTypes",
           "get_preset", "planned_size", "read_tokenizer", "tensor_bytes", "weight_types",
           "write_model"]
