"""Weights of a model file, behind types that own their format.

``Linear`` is chosen by the tensor's GGML type, never by the model code: the reference
(CPU) path dequantizes to float32 once at load; the kernel path (``kernels=True``, the default
on CUDA devices) keeps the blocks packed on the device and runs the Triton kernels behind the
same ``__call__`` (deimos.models.gpu: ``QuantLinear`` for formats with a kernel, an fp16 matrix
for the others).
"""

from __future__ import annotations

import numpy as np
import torch

from deimos.gguf import GGUFFile
from deimos.gguf.constants import GGMLType
from deimos.quant import QuantError, dequantize


class WeightError(ValueError):
    """A tensor the architecture needs is missing or has the wrong shape."""


class MemoryBudgetError(RuntimeError):
    """The weights of a file cannot fit in the memory of this machine (checked before loading)."""


class Linear:
    """y = x @ W^T (+ b). W: [out, in] as stored (ggml ne0 = in)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, name: str, ggml_type: GGMLType):
        self.weight = weight
        self.bias = bias
        self.name = name
        self.ggml_type = ggml_type

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = x @ self.weight.T
        return y if self.bias is None else y + self.bias


class Embedding:
    """Rows of a [vocab, dim] table; the table may also be the (tied) output projection."""

    def __init__(self, table: torch.Tensor, name: str, ggml_type: GGMLType):
        self.table = table
        self.name = name
        self.ggml_type = ggml_type

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        n = self.table.shape[0]
        if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= n):
            raise ValueError(f"token id out of range [0, {n}) for {self.name}")
        return self.table[tokens]

    def as_linear(self) -> Linear:
        return Linear(self.table, None, self.name, self.ggml_type)


class WeightSource:
    """Reads and checks the named tensors of one GGUF file.

    ``kernels``: matrices go to the kernel-backed types of deimos.models.gpu (None: on CUDA
    devices; True on a CPU device runs them in Triton's interpreter, for tests).
    ``triton_ops``: the layer ops (norm, RoPE, attention, activation) run the Triton kernels
    (None: with the kernel-backed matrices).
    """

    def __init__(self, file: GGUFFile, device: str = "cpu", kernels: bool | None = None,
                 triton_ops: bool | None = None):
        self.file = file
        self.device = device
        self.kernels = torch.device(device).type == "cuda" if kernels is None else kernels
        # the layer ops follow the linears unless told (tests: Triton ops with reference linears)
        self.triton_ops = self.kernels if triton_ops is None else triton_ops
        self.gpu = None
        self._ops = None
        if self.kernels:
            from deimos.models.gpu import GpuWeights  # imports triton: only when asked for

            self.gpu = GpuWeights(file, device)

    def make_ops(self, cfg, freq_factors: torch.Tensor | None) -> None:
        """The model's layer ops (deimos.models.ops), matching the weights: the Triton
        kernels with the kernel-backed weights, the torch reference otherwise."""
        if self.triton_ops:
            from deimos.models.gpu.ops import TritonOps

            self._ops = TritonOps(cfg, freq_factors, self.device,
                                  self.gpu.inputs if self.gpu is not None else None)
        else:
            from deimos.models.ops import ReferenceOps

            self._ops = ReferenceOps(cfg, freq_factors)

    @property
    def ops(self):
        if self._ops is None:
            raise RuntimeError("WeightSource.ops used before make_ops")
        return self._ops

    def has(self, name: str) -> bool:
        return name in self.file.tensors

    def info(self, name: str, shape: tuple[int, ...]):
        """The checked ``TensorInfo`` of ``name``: present, with numpy-order ``shape``."""
        info = self.file.tensors.get(name)
        if info is None:
            raise WeightError(f"{self.file.path}: tensor '{name}' is missing")
        if tuple(info.shape) != tuple(shape):
            raise WeightError(
                f"{self.file.path}: tensor '{name}' has shape {tuple(info.shape)}, expected {tuple(shape)}"
            )
        return info

    def tensor(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """The tensor ``name`` as float32 of numpy-order ``shape`` ([out, in] for matrices)."""
        info = self.info(name, shape)
        try:
            data = dequantize(self.file.tensor_bytes(name), info.ggml_type, tuple(info.shape), name=name)
        except QuantError as e:  # it names the tensor and the type; the file is named here
            raise QuantError(f"{self.file.path}: {e}") from None
        return torch.from_numpy(np.ascontiguousarray(data, dtype=np.float32)).to(self.device)

    def vector(self, name: str, n: int) -> torch.Tensor:
        return self.tensor(name, (n,))

    def linear(self, name: str, n_out: int, n_in: int, bias: bool | None = False) -> Linear:
        """bias=None: load ``<name>.bias`` if the file has it."""
        b = None
        if bias or (bias is None and self.has(f"{name}.bias")):
            b = self.vector(f"{name}.bias", n_out)
        if self.gpu is not None:
            return self.gpu.linear(self.info(f"{name}.weight", (n_out, n_in)), b)
        weight = self.tensor(f"{name}.weight", (n_out, n_in))
        return Linear(weight, b, f"{name}.weight", self.file.tensors[f"{name}.weight"].ggml_type)

    def linears(self, specs: list[tuple[str, int]], n_in: int) -> list[Linear]:
        """Linears ``(name, n_out)`` that all read the same input (biases loaded when the file
        has them). The kernel path may run them as one launch (deimos.models.gpu.LinearGroup)."""
        if self.gpu is None:
            return [self.linear(name, n_out, n_in, bias=None) for name, n_out in specs]
        infos = [self.info(f"{name}.weight", (n_out, n_in)) for name, n_out in specs]
        biases = [self.vector(f"{name}.bias", n_out) if self.has(f"{name}.bias") else None
                  for name, n_out in specs]  # fmt: skip
        return self.gpu.linears(infos, biases)

    def embedding(self, name: str, n_vocab: int, dim: int) -> Embedding:
        if self.gpu is not None:
            return self.gpu.embedding(self.info(f"{name}.weight", (n_vocab, dim)))
        table = self.tensor(f"{name}.weight", (n_vocab, dim))
        return Embedding(table, f"{name}.weight", self.file.tensors[f"{name}.weight"].ggml_type)
