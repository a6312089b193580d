"""Builds the kernel-backed weights of one model file on one device (used by WeightSource when
its ``kernels`` flag is set: by default on CUDA devices)."""

from __future__ import annotations

import logging
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from deimos.gguf import GGUFFile
from deimos.gguf.reader import TensorInfo
from deimos.models.gpu.linear import (
    DenseEmbedding,
    DenseLinear,
    InputCache,
    LinearGroup,
    LinearPart,
    QuantEmbedding,
    QuantLinear,
)
from deimos.models.gpu.notices import Notices
from deimos.quant import dequantize
from deimos.quant.triton import PACKED_TYPES, PackedWeight, pack

CHUNK_ELEMENTS = 1 << 23  # weights per packing job: rows are independent, so a big matrix
# (an 8B model's 525M-weight output) is packed by many threads at once


def main_tensors(file: GGUFFile) -> list[TensorInfo]:
    """The file's tensors less those of its MTP layers (the last '<arch>.nextn_predict_layers'
    of its '<arch>.block_count' blocks; the config checks those keys against the tensors)."""
    md = file.metadata
    arch = md.get("general.architecture")
    n_mtp, n_all = md.get(f"{arch}.nextn_predict_layers", 0), md.get(f"{arch}.block_count", 0)
    infos = list(file.tensors.values())
    if not isinstance(n_mtp, int) or not isinstance(n_all, int) or not 0 < n_mtp <= n_all:
        return infos
    skip = tuple(f"blk.{i}." for i in range(n_all - n_mtp, n_all))
    return [t for t in infos if not t.name.startswith(skip)]


@dataclass(frozen=True)
class PackedExperts:
    """One projection of every routed expert of a layer (a GGUF 3-D tensor, numpy shape
    [n_expert, n, k]) as one packed matrix of ``n_expert * n`` rows of ``k``: expert e is
    rows ``e * n .. e * n + n - 1`` of ``weight`` (deimos.quant.triton.layout)."""

    weight: PackedWeight
    n_expert: int
    n: int  # rows (outputs) of one expert
    k: int  # inputs
    name: str


class GpuWeights:
    def __init__(self, file: GGUFFile, device: str | torch.device,
                 expert_device: str | torch.device | None = None):
        """``expert_device``: where the routed experts' packed stacks go (default ``device``;
        "cpu": a host copy, for a model whose experts do not fit: deimos.models.gpu.offload)."""
        self.file = file
        self.device = torch.device(device)
        self.expert_device = torch.device(expert_device) if expert_device is not None else self.device
        self.inputs = InputCache(self.device)  # shared by every linear of the model
        self.notices = Notices()
        self._packed_all = self._pack_all()

    def _rows(self, info: TensorInfo) -> np.ndarray:
        rows = info.shape[0]
        return np.asarray(self.file.tensor_bytes(info.name)).reshape(rows, -1)

    def _pack_all(self) -> dict[str, PackedWeight]:
        """Every 2-D tensor of a kernel format, packed on CPU threads in row chunks (numpy
        releases the GIL) and moved to the device chunk by chunk; MTP layers' tensors stay in
        the file until a drafter asks for them (``load_mtp`` packs them then, one by one)."""
        jobs = []
        for info in main_tensors(self.file):
            if len(info.shape) == 2 and info.ggml_type in PACKED_TYPES:
                rows, step = info.shape[0], max(1, CHUNK_ELEMENTS // info.shape[1])
                jobs += [(info, r, min(rows, r + step)) for r in range(0, rows, step)]

        def work(job: tuple[TensorInfo, int, int]) -> PackedWeight:
            info, a, b = job
            return pack(self._rows(info)[a:b], info.ggml_type, info.name).to(self.device)

        with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as ex:
            parts = list(ex.map(work, jobs))
        by_name: dict[str, list[PackedWeight]] = {}
        for (info, _, _), part in zip(jobs, parts):
            by_name.setdefault(info.name, []).append(part)
        out = {}
        for name, ps in by_name.items():
            first = ps[0]
            if len(ps) == 1:
                out[name] = first
                continue
            tensors = {k: torch.cat([p.tensors[k] for p in ps]) for k in first.tensors}
            out[name] = PackedWeight(first.ggml_type, sum(p.n for p in ps), first.k, tensors)
        return out

    def _packed(self, info: TensorInfo) -> PackedWeight | None:
        if info.name in self._packed_all:
            packed = self._packed_all[info.name]
            if packed.ggml_type != info.ggml_type:
                t, k = info.ggml_type.name, packed.ggml_type.name
                bits = packed.nbytes * 8 / (packed.n * packed.k)
                self.notices.once(
                    f"as:{t}", f"{t} ({info.name} and any later {t} tensor) runs in {k}'s GPU layout: "
                    f"the same values, {bits:.2f} bits per weight", logging.INFO)
            return packed
        if info.ggml_type not in PACKED_TYPES:
            t = info.ggml_type.name
            self.notices.once(
                f"dense:{t}", f"no GPU kernel for {t} ({info.name} and any later {t} tensor): "
                "dequantized once to fp16 on the device", logging.WARNING)
            return None
        return pack(self._rows(info), info.ggml_type, info.name).to(self.device)

    def _dense(self, info: TensorInfo) -> torch.Tensor:
        data = dequantize(self.file.tensor_bytes(info.name), info.ggml_type, tuple(info.shape),
                          name=info.name)
        return torch.from_numpy(np.ascontiguousarray(data)).to(self.device, torch.float16)

    def linear(self, info: TensorInfo, bias: torch.Tensor | None) -> QuantLinear | DenseLinear:
        packed = self._packed(info)
        if packed is None:
            return DenseLinear(self._dense(info), bias, info.name, info.ggml_type, self.inputs)
        return QuantLinear(packed, bias, info.name, self.inputs, self.notices)

    def linears(self, infos: list[TensorInfo], biases: list[torch.Tensor | None]) -> list:
        """Linears that read one input: those whose packed arrays stack (``stack_key``: one
        kernel format, K and scale layout) as parts of one concatenated matrix (``LinearGroup``:
        one launch; e.g. q and k when v has another format, as Q4_K_M files mix), the others
        one by one. In the order given."""
        packs = [self._packed(i) for i in infos]
        by_format: dict[tuple, list[int]] = {}
        for i, p in enumerate(packs):
            if p is not None:
                by_format.setdefault(p.stack_key, []).append(i)
        out: list = [None] * len(infos)
        for members in by_format.values():
            if len(members) > 1:
                for i, part in zip(members, self._fused([infos[i] for i in members],
                                                        [packs[i] for i in members],
                                                        [biases[i] for i in members])):  # fmt: skip
                    out[i] = part
        return [o if o is not None else self.linear(i, b) for o, i, b in zip(out, infos, biases)]

    def _fused(self, infos: list[TensorInfo], packs: list[PackedWeight],
               biases: list[torch.Tensor | None]) -> list[LinearPart]:
        first = packs[0]
        tensors = {k: torch.cat([p.tensors[k] for p in packs]) for k in first.tensors}
        for info in infos:  # the separate copies are not needed any more
            self._packed_all.pop(info.name, None)
        fused = PackedWeight(first.ggml_type, sum(p.n for p in packs), first.k, tensors)
        name = "+".join(i.name for i in infos)
        group = LinearGroup(QuantLinear(fused, None, name, self.inputs, self.notices), len(infos))
        parts, lo = [], 0
        for info, p, b in zip(infos, packs, biases):
            parts.append(LinearPart(group, lo, lo + p.n, b, info.name))
            lo += p.n
        return parts

    def experts(self, info: TensorInfo) -> PackedExperts:
        """A 3-D expert tensor packed on the device. GGUF stores expert after expert, each
        row-major, so the bytes viewed as [n_expert * n, row_bytes] are the stacked rows;
        packed in row chunks on CPU threads, as the matrices are."""
        if len(info.shape) != 3:
            raise ValueError(f"{self.file.path}: tensor '{info.name}' has shape {tuple(info.shape)}, "
                             "expected the 3-D [n_expert, n, k] of routed experts")
        if info.ggml_type not in PACKED_TYPES:
            have = ", ".join(t.name for t in PACKED_TYPES)
            raise ValueError(f"{self.file.path}: tensor '{info.name}' is {info.ggml_type.name}: "
                             f"routed experts have a GPU layout only in {have}")
        n_expert, n, k = info.shape
        rows = np.asarray(self.file.tensor_bytes(info.name)).reshape(n_expert * n, -1)
        step = max(1, CHUNK_ELEMENTS // k)

        def work(a: int) -> PackedWeight:
            return pack(rows[a:a + step], info.ggml_type, info.name).to(self.expert_device)

        with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as ex:
            parts = list(ex.map(work, range(0, n_expert * n, step)))
        first = parts[0]
        weight = first if len(parts) == 1 else PackedWeight(
            first.ggml_type, n_expert * n, first.k,
            {key: torch.cat([p.tensors[key] for p in parts]) for key in first.tensors})
        if weight.ggml_type != info.ggml_type:
            t, kt = info.ggml_type.name, weight.ggml_type.name
            self.notices.once(f"as:{t}", f"{t} ({info.name} and any later {t} tensor) runs in {kt}'s "
                              "GPU layout: the same values", logging.INFO)
        return PackedExperts(weight, n_expert, n, k, info.name)

    def embedding(self, info: TensorInfo) -> QuantEmbedding | DenseEmbedding:
        packed = self._packed(info)
        if packed is None:
            return DenseEmbedding(self._dense(info), info.name, info.ggml_type, self.inputs)
        return QuantEmbedding(packed, info.name, self.inputs, self.notices)
