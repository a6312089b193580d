"""Re-quantizes a GGUF file's weight matrices to another GGML type with ggml's own quantizer.

    python tools/requantize.py SRC.gguf DST.gguf TYPE [--lib DIR]

Each weight is decoded by ``deimos.quant.dequantize`` (bit-exact with ggml's to_float) and
re-encoded by ``ggml_quantize_chunk`` of llama.cpp's libggml-base.so (ctypes; no imatrix), so
the blocks are exactly what llama-quantize would write for that type. This is how the tests
get requantized real models without llama.cpp's executables: CI has only libggml-base.so,
built from source by tools/fetch_test_data.py.

Which tensor gets which type follows llama-quantize (src/llama-quant.cpp) where it matters for
loading; a plain single-type target, no Q4_K_M-style mixes:
- only tensors of 2+ dims whose name ends in "weight" and not "_norm.weight" are quantized
  (nor ffn_gate_inp, pos/token-type embeddings); everything else is copied byte for byte;
- the output projection (``output.weight``, or ``token_embd.weight`` when the embeddings are
  tied) becomes Q8_0 when its rows do not fit the target's block, else Q6_K unless the target
  is Q8_0 (llama_tensor_get_type_impl);
- a row length that is not a multiple of the block size falls back as tensor_type_fallback:
  IQ4_XS/IQ3_*  -> IQ4_NL, Q2_K/Q3_K/TQ1_0/TQ2_0 -> Q4_0, Q4_K -> Q5_0, Q5_K -> Q5_1,
  Q6_K -> Q8_0, and F16 if even that does not fit.
Metadata is copied in file order; ``general.file_type`` becomes the matching llama_ftype.
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

_FLOATS = (GGMLType.F32, GGMLType.F16, GGMLType.BF16)

# tensor_type_fallback in llama-quant.cpp: a type whose block does not fit a row -> this one
FALLBACK = {
    GGMLType.IQ1_S: GGMLType.IQ4_NL, GGMLType.IQ1_M: GGMLType.IQ4_NL,
    GGMLType.IQ2_XXS: GGMLType.IQ4_NL, GGMLType.IQ2_XS: GGMLType.IQ4_NL,
    GGMLType.IQ2_S: GGMLType.IQ4_NL, GGMLType.IQ3_XXS: GGMLType.IQ4_NL,
    GGMLType.IQ3_S: GGMLType.IQ4_NL, GGMLType.IQ4_XS: GGMLType.IQ4_NL,
    GGMLType.Q2_K: GGMLType.Q4_0, GGMLType.Q3_K: GGMLType.Q4_0,
    GGMLType.TQ1_0: GGMLType.Q4_0, GGMLType.TQ2_0: GGMLType.Q4_0,
    GGMLType.Q4_K: GGMLType.Q5_0, GGMLType.Q5_K: GGMLType.Q5_1, GGMLType.Q6_K: GGMLType.Q8_0,
}

# general.file_type (llama_ftype in llama.h) of a file whose weights are mostly TYPE;
# single-type k-quant files are the "_S" variants.
FILE_TYPE = {
    GGMLType.F32: 0, GGMLType.F16: 1, GGMLType.Q4_0: 2, GGMLType.Q4_1: 3, GGMLType.Q8_0: 7,
    GGMLType.Q5_0: 8, GGMLType.Q5_1: 9, GGMLType.Q2_K: 10, GGMLType.Q3_K: 11,
    GGMLType.Q4_K: 14, GGMLType.Q5_K: 16, GGMLType.Q6_K: 18, GGMLType.IQ2_XXS: 19,
    GGMLType.IQ2_XS: 20, GGMLType.IQ3_XXS: 23, GGMLType.IQ1_S: 24, GGMLType.IQ4_NL: 25,
    GGMLType.IQ3_S: 26, GGMLType.IQ2_S: 28, GGMLType.IQ4_XS: 30, GGMLType.IQ1_M: 31,
    GGMLType.BF16: 32, GGMLType.TQ1_0: 36, GGMLType.TQ2_0: 37, GGMLType.MXFP4: 38,
}

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


def parse_type(name: str | GGMLType) -> GGMLType:
    try:
        return name if isinstance(name, GGMLType) else GGMLType[name.upper()]
    except KeyError:
        raise ValueError(f"unknown GGML type {name!r}") from None


def _fits(t: GGMLType, ncols: int) -> bool:
    return ncols % GGML_BLOCK[t][0] == 0


def tensor_type(name: str, dims: tuple[int, ...], target: GGMLType, tied: bool) -> GGMLType | None:
    """The type ``name`` gets for ``target`` (None: keep as is), after llama-quantize's rules."""
    if len(dims) < 2 or not name.endswith("weight") or any(s in name for s in _NOT_QUANTIZED):
        return None
    if target in _FLOATS:
        return target
    ncols = dims[0]
    t = target
    if name == "output.weight" or (tied and name == "token_embd.weight"):
        t = GGMLType.Q8_0 if not _fits(t, ncols) or t == GGMLType.Q8_0 else GGMLType.Q6_K
    if not _fits(t, ncols):
        t = FALLBACK.get(t, t)
        if not _fits(t, ncols):
            t = GGMLType.F16
    return t


def plan(src: GGUFFile, target: GGMLType) -> list[Plan]:
    tied = "output.weight" not in src.tensors
    out = []
    for name, info in src.tensors.items():
        new = tensor_type(name, tuple(info.dims), target, tied)
        if info.ggml_type not in GGML_BLOCK or info.ggml_type in (GGMLType.I8, GGMLType.I16,
                                                                  GGMLType.I32, GGMLType.I64):
            new = None  # integer tables are never weights
        out.append(Plan(name, tuple(info.dims), info.ggml_type, new))
    return out


def _writable(value: object) -> object:
    # strings go back as their original bytes; numpy arrays as lists (GGUFWriter's form)
    if isinstance(value, str):
        return value.encode("utf-8", "surrogateescape")
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, list):
        return [_writable(v) for v in value]
    return value


def _copy_metadata(src: GGUFFile, w: GGUFWriter, target: GGMLType) -> None:
    for key, value in src.metadata.items():
        if key in ("general.architecture", "general.alignment"):
            continue  # the writer adds the first; the second is the writer's default (32)
        types = src.value_types[key]
        sub = GGUFValueType(int(types[1])) if len(types) > 1 else None
        if key == "general.file_type":
            value = FILE_TYPE.get(target, value)
        if sub is not None and len(value) == 0:
            continue  # GGUFWriter cannot write an empty array; llama.cpp treats it as absent
        w.add_key_value(key, _writable(value), GGUFValueType(int(types[0])), sub_type=sub)
    if "general.file_type" not in src.metadata and target in FILE_TYPE:
        w.add_uint32("general.file_type", FILE_TYPE[target])
    if "general.quantization_version" not in src.metadata and target not in _FLOATS:
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


def requantize(src_path: Path, dst_path: Path, target: str | GGMLType,
               lib: Path | None = None, threads: int | None = None) -> list[Plan]:
    """Writes ``dst_path``: ``src_path`` with its weights in ``target``; returns the plan."""
    target = parse_type(target)
    if target not in FILE_TYPE:
        raise ValueError(f"{target.name} is not a weight type requantize writes")
    q = Quantizer((lib or default_lib_dir()) / "libggml-base.so")
    with GGUFFile(src_path) as src:
        if target not in _FLOATS and q.lib.ggml_quantize_requires_imatrix(int(target)):
            raise ValueError(f"{target.name} needs an importance matrix; "
                             "requantize does not make one")
        plans = plan(src, target)
        arch = src.metadata.get("general.architecture", "llama")
        w = GGUFWriter(Path(dst_path), arch)
        try:
            _copy_metadata(src, w, target)
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
    ap.add_argument("type", help="target GGML type: Q8_0, Q6_K, Q4_K, IQ4_XS, TQ2_0, F32, ...")
    ap.add_argument("--lib", type=Path, default=None, help="folder with libggml-base.so")
    args = ap.parse_args()
    plans = requantize(args.src, args.dst, args.type, args.lib)
    from collections import Counter
    counts = Counter(p.out_type.name for p in plans)
    print(f"{args.dst}: " + ", ".join(f"{n} {t}" for t, n in counts.most_common()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
