"""Kernel-backed Linear and Embedding: the weights stay in their GGUF bytes (packed) on the device.

- ``QuantLinear`` (formats with a GEMV kernel): decode (T <= 4 rows, one per sequence) runs
  the integer-activation GEMV (gemv_q8: x turned once into two int8 planes, ``QuantizedX``,
  shared by every projection that reads the same activation; weight codes times x codes by
  dp4a; for 2..4 rows gemv_rows, each weight word decoded once for every row); a decode batch of 5 <= T <= 64 rows the batched GEMM that
  reads each packed weight once (gemm_q: a weight tile decoded in registers feeding the
  tensor cores, x in fp16 with its columns in the weight's word order; Q4_K up to 32 rows
  through mmq, which beats an fp16 copy too); longer steps (prefill)
  dequantize the weight to a transient fp16 matrix (``dequantize_fp16``, streaming near the
  copy rate) and multiply on the tensor cores (``matmul_f16``). A linear given a resident fp16
  copy (``dense``: the placement's choice, deimos.models.gpu.placement) multiplies every step
  of T >= 3 rows on it (``matmul_f16``: twice gemm_q's speed on the H200, no dequantization
  at prefill) for the memory of two bytes a weight, but for Q4_K's 5..32-row steps (mmq: 62
  us against the copy's 87 for llama 8B's gate and up at 16 rows, H100, session 49).
- ``DenseLinear``: float weights (and formats without a kernel), an fp16 matrix from load:
  ``gemv_f16`` for decode, ``matmul_f16`` for T > 1.
- ``QuantEmbedding`` / ``DenseEmbedding``: gather the token rows, dequantize only those.

Activations in and out are float32 ``[T, K]`` / ``[T, N]``; the fp16 products accumulate in
fp32 but round x to fp16 (range 65504: an activation past that would overflow).
"""

from __future__ import annotations

import os

import torch

from deimos.gguf.constants import GGMLType
from deimos.kernels.triton.matmul import SplitScratch, gemv_f16, matmul_f16
from deimos.kernels.triton.matmul_gated import matmul_gated
from deimos.models.gpu.dequant import dequantize_fp16, gather_rows, permuted_columns
from deimos.models.gpu.notices import Notices
from deimos.quant.triton.dequant_gemv import words_per_group
from deimos.quant.triton import PackedWeight
from deimos.quant.triton.gemm_q import MAX_ROWS as GEMM_ROWS
from deimos.quant.triton.gemm_q import MMQ_ROWS, takes_elements, uses_mmq
from deimos.quant.triton.gemm_q import gemm_q
from deimos.quant.triton.gemv_q8 import QuantizedX, gemv_q8, quantize_x
from deimos.quant.triton.gemv_rows import gemv_rows
from deimos.switches import env_switch


class InputCache:
    """The last activation made ready for the kernels, reused while the same tensor comes
    again (the same memory, shape, strides and dtype: a new view of it counts): q/k/v read one
    input, gate/up another, each prepared once. The kernel that makes an activation may
    ``put`` its quantized form here directly (fused norm / activation / attention). One per
    model; holding the tensor keeps its memory alive, so its address cannot be recycled.
    ``split``: the scratch of the fp16 matmul's split-K launches on the model's device (made
    here, before any graph is captured; the steps' matmuls use it in turn; none with
    DEIMOS_SPLIT_K=0, for A/B measurements, as DEIMOS_PDL=0)."""

    def __init__(self, device: torch.device | str | None = None) -> None:
        on = device is not None and os.environ.get("DEIMOS_SPLIT_K", "1") != "0"
        self.split = SplitScratch(device) if on else None
        self._x: torch.Tensor | None = None
        self._quantized: QuantizedX | None = None
        self._half: torch.Tensor | None = None
        self._permuted: dict[int, torch.Tensor] = {}  # words per group -> x's fp16 columns

    def _same(self, x: torch.Tensor) -> bool:
        c = self._x
        return c is not None and (x is c or (
            x.data_ptr() == c.data_ptr() and x.shape == c.shape and x.stride() == c.stride()
            and x.dtype == c.dtype and x.device == c.device))  # fmt: skip

    def _switch(self, x: torch.Tensor) -> None:
        if not self._same(x):
            self._x, self._quantized, self._half = x, None, None
            self._permuted = {}

    def put(self, x: torch.Tensor, quantized: QuantizedX) -> None:
        """``x``'s quantized form, made by the kernel that produced x."""
        self._x, self._quantized, self._half = x, quantized, None
        self._permuted = {}

    def put_half(self, x: torch.Tensor, half: torch.Tensor) -> None:
        """``x`` rounded to contiguous float16, made by the kernel that produced x (a batch's
        rows: no cast launch between that kernel and the matmul, which PDL then overlaps)."""
        self._x, self._quantized, self._half = x, None, half
        self._permuted = {}

    def quantized(self, x: torch.Tensor) -> QuantizedX:
        self._switch(x)
        if self._quantized is None:
            self._quantized = quantize_x(x)
        return self._quantized

    def half(self, x: torch.Tensor) -> torch.Tensor:
        self._switch(x)
        if self._half is None:
            self._half = x.to(torch.float16).contiguous()  # the kernels want unit column stride
        return self._half

    def permuted(self, x: torch.Tensor, words: int, cols: torch.Tensor) -> torch.Tensor:
        """``x`` in fp16 with its columns in the order ``cols`` of weights of ``words`` code
        words per group (every format with the same word count shares the order)."""
        half = self.half(x)
        p = self._permuted.get(words)
        if p is None:
            p = self._permuted[words] = half.index_select(1, cols)
        return p


# Row counts by the H200 sweep (bench/sweep_gemm_batch.py, 2026-12-01, llama 8B's Q4_K and Q6_K
# matrices, sums over the five): gemv_q8 once a row beats gemm_q up to 4 rows (Q4_K 315 / 605
# us at 2 / 4 rows against 765), matmul_f16 on a resident fp16 copy beats both from 3 rows
# (~400 us from 2 to 16 rows, 476 at 64). 2..4 rows run gemv_rows (each word decoded once for
# every row: 2 rows ~0.75x gemv_q8 a row, 4 rows ~0.57x; bench/sweep_gemv.py --rows, 2026-12-02)
GEMV_ROWS = 4
DENSE_ROWS = 3
# a gated MLP's gate/up product and activation in one launch (matmul_gated) past this many
# rows: up to 16 matmul_f16's 16-row tiles load a resident weight's first tile before their
# PDL wait (``ahead``), which matmul_gated does not
GATED_ROWS = 16
# read once: gemm_q's mmq tiles take x in the elements' order and reorder it in registers (no
# permuted copy: a gather launch per matrix, ~6 us each, 0.68 ms of a 16-row llama 8B step on
# an H100, session 51's profile); DEIMOS_MMQ_ELEMENTS=0 the permuted copy
MMQ_ELEMENTS = env_switch("DEIMOS_MMQ_ELEMENTS", True)


def _check_input(x: torch.Tensor, k: int, name: str) -> None:
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"{name}: input must be [T, {k}], got {tuple(x.shape)}")


class QuantLinear:
    """y = x @ W^T (+ b), W packed ``[n, k]``.

    Decode (T == 1): the integer-activation GEMV. Prefill (T > 1): the weight dequantized to
    a transient fp16 matrix in the words' column order, x's columns permuted to match, our
    tensor-core matmul (one matrix at a time: the fp16 copy is freed to the caching allocator
    and reused by the next linear)."""

    def __init__(self, packed: PackedWeight, bias: torch.Tensor | None, name: str,
                 inputs: InputCache, notices: Notices):
        self.packed = packed
        self.bias = bias
        self.name = name
        self.ggml_type: GGMLType = packed.ggml_type
        self.inputs = inputs
        self.notices = notices
        self._cols: torch.Tensor | None = None
        self._words = words_per_group(packed.ggml_type)
        self.dense: torch.Tensor | None = None  # fp16 [n, k] in element order (placement.py)

    def _columns(self) -> torch.Tensor:
        if self._cols is None:
            self._cols = permuted_columns(self.packed)
        return self._cols

    @property
    def out_features(self) -> int:
        return self.packed.n

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        _check_input(x, self.packed.k, self.name)
        t = x.shape[0]
        operands = self._matmul_operands(x)
        if operands is not None:
            a, w, resident = operands
            y = matmul_f16(a, w, scratch=self.inputs.split, ahead=resident)
        elif t == 1:
            y = gemv_q8(self.packed, self.inputs.quantized(x))
        elif t <= GEMV_ROWS:
            y = gemv_rows(self.packed, self.inputs.quantized(x))
        elif MMQ_ELEMENTS and takes_elements(self.packed, t):
            y = gemm_q(self.packed, self.inputs.half(x), x_permuted=False)
        else:
            y = gemm_q(self.packed, self.inputs.permuted(x, self._words, self._columns()))
        return y if self.bias is None else y + self.bias

    def _matmul_operands(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, bool] | None:
        """(a, b, resident) of matmul_f16 where ``x``'s rows take that path: the resident fp16
        copy (3..64 rows, but Q4_K's 5..MMQ_ROWS, which mmq multiplies), or past GEMM_ROWS the
        weight dequantized to a transient fp16 matrix in the words' column order, x's columns
        permuted to match; None where a GEMV or gemm_q takes them."""
        t = x.shape[0]
        if t == 1 or (t <= GEMV_ROWS and (self.dense is None or t < DENSE_ROWS)):
            return None
        if self.dense is not None and not (GEMV_ROWS < t <= MMQ_ROWS and uses_mmq(self.ggml_type, t)):
            return self.inputs.half(x), self.dense, True
        if t <= GEMM_ROWS:
            return None
        return self.inputs.half(x)[:, self._columns()], dequantize_fp16(self.packed, permuted=True), False

    def gated(self, x: torch.Tensor, activation: str) -> torch.Tensor | None:
        """A fused gate/up matrix's (``gated_pair``) activation for ``x`` in one launch
        (``matmul_gated``, float16 ``[T, n / 2]``), where its rows take the matmul path and
        are more than ``GATED_ROWS``; else None (the caller multiplies, then activates)."""
        _check_input(x, self.packed.k, self.name)
        operands = self._matmul_operands(x) if x.shape[0] > GATED_ROWS else None
        return None if operands is None else matmul_gated(operands[0], operands[1], activation)


class DenseLinear:
    """A format without a GPU kernel: W dequantized once at load, fp16 ``[n, k]``."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, name: str,
                 ggml_type: GGMLType, inputs: InputCache):
        self.weight = weight
        self.bias = bias
        self.name = name
        self.ggml_type = ggml_type
        self.inputs = inputs

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    @property
    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        _check_input(x, self.weight.shape[1], self.name)
        if x.shape[0] == 1:
            y = gemv_f16(self.inputs.half(x), self.weight, ahead=True)
        else:
            y = matmul_f16(self.inputs.half(x), self.weight, scratch=self.inputs.split, ahead=True)
        return y if self.bias is None else y + self.bias


def _check_tokens(tokens: torch.Tensor, n: int, name: str) -> None:
    # host tensors are checked here; on a device the gather's own bounds assert fires instead
    # (a check here would cost a device-to-host sync every step)
    if tokens.device.type == "cpu" and tokens.numel():
        if int(tokens.min()) < 0 or int(tokens.max()) >= n:
            raise ValueError(f"token id out of range [0, {n}) for {name}")


class QuantEmbedding:
    """Rows of a packed ``[vocab, dim]`` table, dequantized on the device (float32 out)."""

    def __init__(self, packed: PackedWeight, name: str, inputs: InputCache, notices: Notices):
        self.packed = packed
        self.name = name
        self.ggml_type = packed.ggml_type
        self.inputs = inputs
        self.notices = notices

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        _check_tokens(tokens, self.packed.n, self.name)
        rows = tokens.to(self.packed.device, torch.long)
        return dequantize_fp16(gather_rows(self.packed, rows)).float()

    def as_linear(self) -> QuantLinear:
        return QuantLinear(self.packed, None, self.name, self.inputs, self.notices)


class DenseEmbedding:
    """A table without a GPU kernel: fp16 ``[vocab, dim]`` on the device."""

    def __init__(self, table: torch.Tensor, name: str, ggml_type: GGMLType, inputs: InputCache):
        self.table = table
        self.name = name
        self.ggml_type = ggml_type
        self.inputs = inputs

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        _check_tokens(tokens, self.table.shape[0], self.name)
        return self.table[tokens.to(self.table.device, torch.long)].float()

    def as_linear(self) -> DenseLinear:
        return DenseLinear(self.table, None, self.name, self.ggml_type, self.inputs)


class LinearGroup:
    """Linears that read the same input (q/k/v, gate/up), of one format, packed as one matrix
    of their concatenated rows: one launch computes every part's output. The output of the
    last input is kept (by identity, as ``InputCache``) for the parts to slice."""

    def __init__(self, linear: QuantLinear, n_parts: int = 1):
        self.linear = linear
        self.n_parts = n_parts
        self._x: torch.Tensor | None = None
        self._y: torch.Tensor | None = None
        self._left = 0

    def output(self, x: torch.Tensor) -> torch.Tensor:
        """The whole matrix's output for ``x``, computed once for its parts; let go of once
        every part has read it (kept past the layer it would hold a layer's activations for
        the rest of the step: 235 MB a layer for 8B's gate/up at 2048 tokens)."""
        if x is not self._x or self._y is None:
            self._x, self._y, self._left = x, self.linear(x), self.n_parts
        y = self._y
        self._left -= 1
        if self._left <= 0:
            self._x = self._y = None
        return y


class LinearPart:
    """Columns ``lo:hi`` of a ``LinearGroup``'s output (a view; + its own bias)."""

    def __init__(self, group: LinearGroup, lo: int, hi: int, bias: torch.Tensor | None, name: str):
        self.group = group
        self.lo, self.hi = lo, hi
        self.bias = bias
        self.name = name
        self.ggml_type: GGMLType = group.linear.ggml_type

    @property
    def out_features(self) -> int:
        return self.hi - self.lo

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self.group.output(x)[:, self.lo : self.hi]
        return y if self.bias is None else y + self.bias


def gated_pair(gate, up) -> QuantLinear | None:
    """The one matrix behind a gated MLP's ``gate`` and ``up`` when they are a LinearGroup's
    two parts (a group's matrix is a QuantLinear: source.py fuses packed weights only), gate's
    rows first, up's next and as many, without biases (``matmul_gated``'s [2F, K] operand:
    its ``gated``); else None."""
    if not (isinstance(gate, LinearPart) and isinstance(up, LinearPart) and gate.group is up.group):
        return None
    linear = gate.group.linear
    if (gate.group.n_parts == 2 and gate.lo == 0 and gate.hi == up.lo and up.hi == 2 * gate.hi
            and linear.out_features == up.hi and gate.bias is None and up.bias is None):  # fmt: skip
        return linear
    return None
