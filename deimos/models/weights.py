"""Weights of a model file, behind types that own their format.

``Linear`` is chosen by the tensor's GGML type, never by the model code: the reference
(CPU) path dequantizes to float32 once at load; the kernel path (``kernels=True``, the default
on CUDA devices) keeps the blocks packed on the device and runs the Triton kernels behind the
same ``__call__`` (deimos.models.gpu: ``QuantLinear`` for formats with a kernel, an fp16 matrix
for the others).

``Experts`` (one projection of every routed expert, a GGUF 3-D tensor) stays in its GGUF bytes
on the reference path: an expert is dequantized when a token first goes to it and kept in the
model's ``ExpertCache`` (least recently used out past its byte budget), so that a file whose
experts would not fit as float32 still runs. The kernel path packs them (deimos.models.gpu
``PackedExperts``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import numpy as np
import torch

from deimos.gguf import GGUFFile
from deimos.gguf.constants import GGMLType
from deimos.quant import QuantError, dequantize, get_format


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


EXPERT_CACHE_BYTES = 4 << 30  # the reference's dequantized experts, all layers together


class ExpertCache:
    """Dequantized experts of one model, keyed by (tensor name, expert), within ``budget``
    bytes: the least recently used go first. One thread at a time (the engine's)."""

    def __init__(self, budget: int = EXPERT_CACHE_BYTES):
        self.budget = budget
        self.nbytes = 0
        self.hits = self.misses = 0
        self._entries: OrderedDict[tuple[str, int], torch.Tensor] = OrderedDict()

    def get(self, key: tuple[str, int], make: Callable[[], torch.Tensor]) -> torch.Tensor:
        value = self._entries.get(key)
        if value is not None:
            self.hits += 1
            self._entries.move_to_end(key)
            return value
        self.misses += 1
        value = make()
        size = value.numel() * value.element_size()
        while self._entries and self.nbytes + size > self.budget:
            _, old = self._entries.popitem(last=False)
            self.nbytes -= old.numel() * old.element_size()
        if size <= self.budget:
            self._entries[key] = value
            self.nbytes += size
        return value


class Experts:
    """One projection of every routed expert of a layer: the GGUF 3-D tensor, numpy shape
    ``[n_expert, n_out, n_in]`` (ggml ne = [n_in, n_out, n_expert]) in one GGML type.
    ``experts[e]`` is expert e's float32 ``[n_out, n_in]`` matrix, dequantized (deimos.quant,
    as ``Linear``) on first use and held in the shared ``ExpertCache``."""

    def __init__(self, raw: np.ndarray, ggml_type: GGMLType, shape: tuple[int, int, int], name: str,
                 source: str, cache: ExpertCache, device: str | torch.device = "cpu"):
        self.raw = raw  # uint8 [n_expert, bytes of one expert]: views of the memory-mapped file
        self.ggml_type = ggml_type
        self.n_expert, self.out_features, self.in_features = shape
        self.name = name
        self.source = source
        self.cache = cache
        self.device = device

    def __len__(self) -> int:
        return self.n_expert

    def __getitem__(self, e: int) -> torch.Tensor:
        if not 0 <= e < self.n_expert:
            raise IndexError(f"{self.name}: expert {e} out of range [0, {self.n_expert})")
        return self.cache.get((self.name, e), lambda: self._dequantize(e))

    def _dequantize(self, e: int) -> torch.Tensor:
        try:
            data = dequantize(self.raw[e], self.ggml_type, (self.out_features, self.in_features),
                              name=f"{self.name}[{e}]")
        except QuantError as err:
            raise QuantError(f"{self.source}: {err}") from None
        return torch.from_numpy(np.ascontiguousarray(data, dtype=np.float32)).to(self.device)


class WeightSource:
    """Reads and checks the named tensors of one GGUF file.

    ``kernels``: matrices go to the kernel-backed types of deimos.models.gpu (None: on CUDA
    devices; True on a CPU device runs them in Triton's interpreter, for tests).
    ``triton_ops``: the layer ops (norm, RoPE, attention, activation) run the Triton kernels
    (None: with the kernel-backed matrices).
    """

    def __init__(self, file: GGUFFile, device: str = "cpu", kernels: bool | None = None,
                 triton_ops: bool | None = None, expert_cache_bytes: int = EXPERT_CACHE_BYTES,
                 expert_device: str | None = None):
        self.file = file
        self.device = device
        self.expert_cache = ExpertCache(expert_cache_bytes)  # the reference path's experts
        self.kernels = torch.device(device).type == "cuda" if kernels is None else kernels
        # the layer ops follow the linears unless told (tests: Triton ops with reference linears)
        self.triton_ops = self.kernels if triton_ops is None else triton_ops
        self.gpu = None
        self._ops = None
        if self.kernels:
            from deimos.models.gpu import GpuWeights  # imports triton: only when asked for

            self.gpu = GpuWeights(file, device, expert_device)

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

    def experts(self, name: str, n_expert: int, n_out: int, n_in: int):
        """The 3-D tensor ``<name>.weight`` of numpy shape [n_expert, n_out, n_in]: ``Experts``
        (the reference), or on the kernel path deimos.models.gpu ``PackedExperts``."""
        info = self.info(f"{name}.weight", (n_expert, n_out, n_in))
        if self.gpu is not None:
            return self.gpu.experts(info)
        # what dequantize would refuse at the first token, refused at load
        try:
            fmt = get_format(info.ggml_type, info.name)
        except QuantError as e:
            raise QuantError(f"{self.file.path}: {e}") from None
        if n_in % fmt.block_size:
            raise QuantError(f"{self.file.path}: tensor '{info.name}' ({fmt.name}): rows of {n_in} "
                             f"are not a multiple of the block size {fmt.block_size}")
        raw = self.file.tensor_bytes(info.name).reshape(n_expert, -1)
        return Experts(raw, info.ggml_type, (n_expert, n_out, n_in), info.name, str(self.file.path),
                       self.expert_cache, self.device)

    def embedding(self, name: str, n_vocab: int, dim: int) -> Embedding:
        if self.gpu is not None:
            return self.gpu.embedding(self.info(f"{name}.weight", (n_vocab, dim)))
        table = self.tensor(f"{name}.weight", (n_vocab, dim))
        return Embedding(table, f"{name}.weight", self.file.tensors[f"{name}.weight"].ggml_type)
