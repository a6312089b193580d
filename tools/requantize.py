"""Re-quantizes a GGUF file's weight matrices with ggml's own quantizer, typed as llama-quantize.

    python tools/requantize.py SRC.gguf DST.gguf TYPE [--pure] [--lib DIR]

Each weight is decoded by ``deimos.quant.dequantize`` (bit-exact with ggml's to_float) and
re-encoded by ``ggml_quantize_chunk`` of llama.cpp's libggml-base.so (ctypes; no imatrix), so
the blocks are exactly what llama-quantize would write for that type. This is how the tests
get requantized real models without llama.cpp's executables: CI has only libggml-base.so,
built from source by tools/fetch_test_data.py.

Which tensor gets which type: ``deimos.synth.mix`` (llama-quantize's rules, tested against its
own choices), named as ``deimos.synth.weight_types`` names them:
- TYPE a llama-quantize file type (Q4_K_M, Q5_K_S, IQ4_XS, Q6_K, Q8_0, TQ2_0, ...): its mix,
  as ``llama-quantize --allow-requantize SRC DST TYPE``;
- TYPE a GGML type that is no file type (Q4_K, Q5_K, ...), or any TYPE with ``--pure``: that
  type for every matrix (as ``llama-quantize --pure``) but the output projection
  (``output.weight``, or ``token_embd.weight`` when the embeddings are tied), which gets the
  type of the mix of the file type named like TYPE, else the first one whose default type is
  TYPE (Q4_K -> Q4_K_S): as ``llama-quantize --pure --output-tensor-type`` (untied) or
  ``--token-embedding-type`` (tied) with that type;
- either way llama-quantize's fallback when a row is not a multiple of the block (Q4_K ->
  Q5_0, IQ4_XS -> IQ4_NL, ...); F32/F16/BF16: every matrix that type.
Only what llama-quantize quantizes changes (tensors of 2+ dims whose name ends in "weight",
not norms, ffn_gate_inp, pos/token-type embeddings); everything else is copied byte for byte.
Metadata is copied in file order; ``general.file_type`` becomes that file type's llama_ftype.
The output is a function of the input bytes only (each tensor is quantized on its own, by
one thread, and written in file order), so the same input gives byte-identical files.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter  # noqa: E402

from deimos.gguf import GGUFFile  # noqa: E402
from deimos.gguf.constants import GGML_BLOCK, GGMLType  # noqa: E402
from deimos.quant import dequantize  # noqa: E402
from deimos.synth import mix  # noqa: E402
from deimos.synth.writer import writable_value  # noqa: E402

# general.file_type (llama_ftype) of the float targets, which have no mix
_FLOAT_FILE_TYPE = {GGMLType.F32: 0, GGMLType.F16: 1, GGMLType.BF16: 32}

_NOT_QUANTIZED = ("_norm.weight", "ffn_gate_inp.weight", "position_embd.weight",
                  "token_types.weight")


def default_lib_dir() -> Path:
    """$LLAMA_CPU_DIR, else $DEIMOS_TEST_DATA/llama-cpu (as tools/llama_ref and the tests)."""
    if os.environ.get("LLAMA_CPU_DIR"):
        return Path(os.environ["LLAMA_CPU_DIR"])
    data = os.environ.get("DEIMOS_TEST_DATA")
    root = Path(data).expanduser() if data else Path.home() / ".cache" / "deimos" / "test-data"
    return root / "llama-cpu"


@cache
def _ggml(lib_path: str) -> ctypes.CDLL:
    lib = ctypes.CDLL(lib_path)
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                        ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                                        ctypes.c_void_p]
    lib.ggml_quantize_requires_imatrix.restype = ctypes.c_bool
    lib.ggml_quantize_requires_imatrix.argtypes = [ctypes.c_int]
    lib.ggml_quantize_init.argtypes = [ctypes.c_int]
    lib.ggml_validate_row_data.restype = ctypes.c_bool
    lib.ggml_validate_row_data.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t]
    return lib


class Quantizer:
    """ggml's CPU quantizer (libggml-base.so) for float32 rows."""

    def __init__(self, lib: Path):
        if not lib.exists():
            raise FileNotFoundError(f"{lib} is missing (tools/fetch_test_data.py builds it)")
        self.lib = _ggml(str(lib))

    def quantize(self, x: np.ndarray, t: GGMLType, imatrix: np.ndarray | None = None) -> np.ndarray:
        """float32 ``x`` (last dim = row length) -> the uint8 blocks of type ``t``.

        ``imatrix``: float32 importance per column (ggml's quant_weights), or None."""
        block, size = GGML_BLOCK[t]
        x = np.ascontiguousarray(x, dtype=np.float32)
        n_per_row = x.shape[-1] if x.ndim else 1
        if n_per_row % block:
            raise ValueError(f"row length {n_per_row} is not a multiple of the {t.name} "
                             f"block {block}")
        if imatrix is not None:
            imatrix = np.ascontiguousarray(imatrix, dtype=np.float32)
            if imatrix.shape != (n_per_row,):
                raise ValueError(f"imatrix shape {imatrix.shape}, expected ({n_per_row},)")
        elif self.lib.ggml_quantize_requires_imatrix(int(t)):
            raise ValueError(f"{t.name} needs an importance matrix; requantize does not make one")
        nrows = x.size // n_per_row
        out = np.empty(x.size // block * size, dtype=np.uint8)
        self.lib.ggml_quantize_init(int(t))
        weights = None if imatrix is None else imatrix.ctypes.data
        got = self.lib.ggml_quantize_chunk(int(t), x.ctypes.data, out.ctypes.data, 0, nrows,
                                           n_per_row, weights)
        if got != out.size:
            raise RuntimeError(f"ggml_quantize_chunk({t.name}) wrote {got} bytes, "
                               f"expected {out.size}")
        if not self.lib.ggml_validate_row_data(int(t), out.ctypes.data, out.size):
            raise RuntimeError(f"ggml_quantize_chunk({t.name}) wrote invalid blocks (NaN/inf)")
        return out


@dataclass(frozen=True)
class Plan:
    """What happens to one tensor: ``new_type`` None means copied unchanged."""

    name: str
    dims: tuple[int, ...]
    src_type: GGMLType
    new_type: GGMLType | None

    @property
    def out_type(self) -> GGMLType:
        # not ``new_type or src_type``: GGMLType.F32 is 0, which is falsy
        return self.src_type if self.new_type is None else self.new_type


@dataclass(frozen=True)
class Target:
    """What TYPE means: ``matrices`` types every weight matrix, ``output`` the output
    projection (the same unless pure); ``file_type`` is written as general.file_type."""

    name: str
    matrices: mix.WeightTypes
    output: mix.WeightTypes
    file_type: int

    @property
    def pure(self) -> bool:
        """One quantized type for the matrices (llama-quantize needs --pure for that)."""
        return not self.matrices.is_mix and self.matrices.default not in _FLOAT_FILE_TYPE


def parse_target(name: str, pure: bool = False) -> Target:
    """TYPE (and --pure) as the module docstring says; ValueError for an unknown name."""
    types = mix.weight_types(name, pure=pure)  # raises, naming the known types and mixes
    if types.is_mix:
        return Target(types.name, types, types, types.ftype)
    if types.default in _FLOAT_FILE_TYPE:
        return Target(types.name, types, types, _FLOAT_FILE_TYPE[types.default])
    key = name.upper()
    if not (key in mix.FTYPES and mix.FTYPES[key][1] == types.default):
        key = next((k for k, (_, t) in mix.FTYPES.items() if t == types.default), None)
        if key is None:
            raise ValueError(f"{types.name}: no llama-quantize file type has it as its default "
                             "type, so there is no rule for the output projection")
    output = mix.weight_types(key)
    return Target(f"{types.name} (pure)", types, output, output.ftype)


def layer_counts(src: GGUFFile) -> mix.LayerCounts:
    """The model's layer, head and expert counts that the mix rules read."""
    md = src.metadata
    arch = md.get("general.architecture", "llama")

    def first(key: str, default: int | None = None) -> int:
        v = md.get(f"{arch}.{key}", default)
        if v is None:
            raise ValueError(f"{arch}.{key} is missing from the metadata")
        # per-layer arrays: llama.cpp's rules read layer 0 (hparams.n_gqa() of layer 0)
        return int(np.asarray(v).reshape(-1)[0])

    n_head = first("attention.head_count")
    return mix.LayerCounts(first("block_count"), n_head, first("attention.head_count_kv", n_head),
                           first("expert_count", 0))


def _quantizable(name: str, dims: tuple[int, ...], t: GGMLType) -> bool:
    if t not in GGML_BLOCK or t in (GGMLType.I8, GGMLType.I16, GGMLType.I32, GGMLType.I64):
        return False  # integer tables are never weights
    return len(dims) >= 2 and name.endswith("weight") and not any(s in name
                                                                  for s in _NOT_QUANTIZED)


def tensor_type(name: str, dims: tuple[int, ...], target: Target, counts: mix.LayerCounts,
                tied: bool) -> GGMLType:
    """The type of the weight matrix ``name`` for ``target`` (deimos.synth.mix's rules)."""
    out = name == "output.weight" or (tied and name == "token_embd.weight")
    return mix.matrix_type(target.output if out else target.matrices, name, dims, counts, tied)


def plan(src: GGUFFile, target: Target) -> list[Plan]:
    tied = "output.weight" not in src.tensors
    counts = layer_counts(src)
    out = []
    for name, info in src.tensors.items():
        dims = tuple(info.dims)
        new = (tensor_type(name, dims, target, counts, tied)
               if _quantizable(name, dims, info.ggml_type) else None)
        out.append(Plan(name, dims, info.ggml_type, new))
    return out


def _copy_metadata(src: GGUFFile, w: GGUFWriter, target: Target) -> None:
    for key, value in src.metadata.items():
        if key in ("general.architecture", "general.alignment"):
            continue  # the writer adds the first; the second is the writer's default (32)
        types = src.value_types[key]
        sub = GGUFValueType(int(types[1])) if len(types) > 1 else None
        if key == "general.file_type":
            value = target.file_type
        if sub is not None and len(value) == 0:
            continue  # GGUFWriter cannot write an empty array; llama.cpp treats it as absent
        w.add_key_value(key, writable_value(value), GGUFValueType(int(types[0])), sub_type=sub)
    if "general.file_type" not in src.metadata:
        w.add_uint32("general.file_type", target.file_type)
    if ("general.quantization_version" not in src.metadata
            and target.matrices.default not in _FLOAT_FILE_TYPE):
        w.add_quantization_version(2)


def _encode(src: GGUFFile, p: Plan, q: Quantizer) -> np.ndarray:
    info = src.tensors[p.name]
    raw = src.tensor_bytes(p.name)
    if p.new_type is None or p.new_type == p.src_type:
        return raw
    x = dequantize(raw, p.src_type, tuple(info.shape), name=p.name)
    if p.new_type == GGMLType.F32:
        return x.astype("<f4").reshape(-1).view(np.uint8)
    return q.quantize(x, p.new_type)


def requantize(src_path: Path, dst_path: Path, target: str, lib: Path | None = None,
               threads: int | None = None, pure: bool = False) -> list[Plan]:
    """Writes ``dst_path``: ``src_path`` with its weights typed by TYPE ``target`` (and
    ``pure``) as the module docstring says; returns the plan."""
    tgt = parse_target(target, pure)
    q = Quantizer((lib or default_lib_dir()) / "libggml-base.so")
    with GGUFFile(src_path) as src:
        plans = plan(src, tgt)
        for p in plans:
            t = p.new_type
            if t is not None and t != p.src_type and q.lib.ggml_quantize_requires_imatrix(int(t)):
                raise ValueError(f"{tgt.name}: {p.name} would be {t.name}, which needs an "
                                 "importance matrix; requantize does not make one")
        arch = src.metadata.get("general.architecture", "llama")
        w = GGUFWriter(Path(dst_path), arch)
        try:
            _copy_metadata(src, w, tgt)
            for p in plans:
                t = p.out_type
                block, size = GGML_BLOCK[t]
                n = int(np.prod(p.dims))
                w.add_tensor_info(p.name, tuple(reversed(p.dims)), np.dtype(np.float32),
                                  n // block * size, raw_dtype=GGMLQuantizationType(int(t)))
            w.write_header_to_file()
            w.write_kv_data_to_file()
            w.write_ti_data_to_file()
            # ctypes drops the GIL inside ggml, so tensors quantize in parallel; map keeps order
            with ThreadPoolExecutor(max_workers=threads or os.cpu_count() or 1) as pool:
                for data in pool.map(lambda p: _encode(src, p, q), plans):
                    w.write_tensor_data(data)
        finally:
            w.close()
    return plans


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src", type=Path)
    ap.add_argument("dst", type=Path)
    ap.add_argument("type", help="a llama-quantize file type (Q4_K_M, IQ4_XS, Q8_0, ...) or a "
                    "GGML type (Q4_K, F32, ...)")
    ap.add_argument("--pure", action="store_true",
                    help="TYPE's GGML type for every matrix but the output projection")
    ap.add_argument("--lib", type=Path, default=None, help="folder with libggml-base.so")
    args = ap.parse_args()
    try:
        plans = requantize(args.src, args.dst, args.type, args.lib, pure=args.pure)
    except ValueError as e:
        ap.error(str(e))
    from collections import Counter
    counts = Counter(p.out_type.name for p in plans)
    print(f"{args.dst}: " + ", ".join(f"{n} {t}" for t, n in counts.most_common()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
