"""Routed experts computed on the CPU: the decode misses of the GPU expert cache.

A layer's experts stay in their GGUF bytes, read zero-copy from the memory-mapped file
(``GGUFFile.tensor_bytes``): ``gate``, ``up`` numpy ``[E, n_ff, n_embd]`` and ``down``
``[E, n_embd, n_ff]``. A miss is (token row, expert, weight); for each token

    out[t] = sum over its misses (t, e, w), in the order given, of
             w * down[e] @ (silu(gate[e] @ x[t]) * (up[e] @ x[t]))

Two backends (``CpuExperts(backend=...)``), chosen by measurement (bench/cpu_experts.py):

- ``"ggml"`` (the default where installed): ggml's own CPU kernels (the ``ggml-python``
  package: ctypes over libggml-cpu, the library llama.cpp's CPU backend is) run
  ``ggml_mul_mat_id`` on the 3-D tensors as they are in the file, the GIL released while they
  run. ggml multiplies a quantized weight by 8-bit activation blocks (Q8_K for the k- and IQ
  formats, Q8_0 for the 32-element ones): what llama.cpp computes, 1-2% relative error
  against float32 products on Gaussian activations. So activations go in as ``planes``
  (default 2) blocks quantized here: plane 1 = q8(x) (byte for byte ggml's own), plane 2 =
  q8(x - plane 1), the products summed: the GPU decode GEMV's two-int8-plane trick
  (deimos.quant.triton.gemv_q8); 7e-5 relative error, 3 planes 4e-7 (float32's level). Each
  row is scaled by a power of two (exact) so that Q8_0's float16 scales stay normal. With one
  plane (the expert offload's: deimos.models.gpu.offload.CPU_PLANES) a layer is one graph fed
  float32 rows that ggml quantizes itself, llama.cpp's own path (``_GgmlFused``). ggml-python's
  C functions are taken from its own library files (deimos.runtime.ggml_lib).
- ``"exact"``: deimos.quant's bit-exact decode of each expert touched (kept, float32, in an
  LRU cache of ``cache_bytes``), float32 torch matmuls. Any format. A cold miss decodes in
  numpy: 20x slower than ggml; a cached one reads 7x ggml's bytes.

Measured on this machine's shared cores, one thread, a 30B-A3B layer (E 128, n_embd 2048,
n_ff_exp 768), one token's 8 experts from memory (best call): ggml Q4_K_M mix 5.6 ms with 1
plane, 5.4 ms with 2, 7.6 ms with 3 (3.2-4.5 GB/s of quantized bytes); exact 13 ms warm,
129 ms cold. torch's quantized CPU matmuls were measured and not used: int4pack
(``_weight_int4pack_mm_for_cpu``, 2.7 ms) needs a repacked copy in 32-groups with bf16
scales and bf16 activations (Q4_K not exact, Q6_K and Q8_0 not representable); int8pack
(``_weight_int8pack_mm``, 5.5 ms) has one scale per output row (Q8_0's per-32 scales would be
requantized). ``"auto"``: ggml where it is installed and the layer's formats have an 8-bit
activation type there, else exact.

One caller at a time per ``CpuExperts`` (its buffers are reused); run it in a thread of its
own to overlap the GPU.
"""

from __future__ import annotations

import ctypes
import os
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from deimos.gguf import GGUFFile
from deimos.gguf.constants import GGML_BLOCK, GGMLType
from deimos.quant import dequantize
from deimos.runtime.ggml_lib import GgmlLib

EXACT_CACHE_BYTES = 2 << 30  # the exact backend's decoded experts (float32), all layers
BACKENDS = ("auto", "ggml", "exact")


@dataclass(frozen=True)
class ExpertMatrix:
    """One projection of every expert of a layer: ``raw`` uint8 ``[E, n_out, row_bytes]``, the
    GGUF bytes (numpy shape [E, n_out, n_in] in ``ggml_type``; ggml ne = [n_in, n_out, E])."""

    raw: np.ndarray
    ggml_type: GGMLType
    n_out: int
    n_in: int
    name: str = "?"

    def __post_init__(self) -> None:
        bs, ts = GGML_BLOCK[GGMLType(self.ggml_type)]
        if self.n_in % bs:
            raise ValueError(f"{self.name}: rows of {self.n_in} are not whole {bs}-element blocks")
        r = self.raw
        if r.dtype != np.uint8 or r.ndim != 3 or r.shape[1:] != (self.n_out, self.n_in // bs * ts):
            raise ValueError(f"{self.name}: want uint8 [E, {self.n_out}, {self.n_in // bs * ts}], "
                             f"got {r.dtype} {r.shape}")
        if not r.flags.c_contiguous:
            raise ValueError(f"{self.name}: raw bytes must be contiguous")

    @property
    def n_expert(self) -> int:
        return self.raw.shape[0]

    @classmethod
    def from_gguf(cls, f: GGUFFile, name: str) -> ExpertMatrix:
        info = f.tensors.get(name)
        if info is None or len(info.shape) != 3:
            raise ValueError(f"{f.path}: no 3-D tensor {name!r}")
        e, n_out, n_in = info.shape
        raw = f.tensor_bytes(name).reshape(e, n_out, -1)
        return cls(raw, info.ggml_type, n_out, n_in, name)


@dataclass(frozen=True)
class LayerExperts:
    """A layer's routed experts: gate, up ``[E, F, D]``, down ``[E, D, F]``."""

    gate: ExpertMatrix
    up: ExpertMatrix
    down: ExpertMatrix

    def __post_init__(self) -> None:
        g, u, d = self.gate, self.up, self.down
        e, f, dim = g.n_expert, g.n_out, g.n_in
        if (u.n_expert, u.n_out, u.n_in) != (e, f, dim) or (d.n_expert, d.n_out, d.n_in) != (e, dim, f):
            raise ValueError(f"experts of {g.name}: gate {(e, f, dim)}, up {(u.n_expert, u.n_out, u.n_in)}, "
                             f"down {(d.n_expert, d.n_out, d.n_in)} disagree")

    @property
    def n_expert(self) -> int:
        return self.gate.n_expert

    @property
    def n_embd(self) -> int:
        return self.gate.n_in

    @property
    def n_ff(self) -> int:
        return self.gate.n_out

    @classmethod
    def from_gguf(cls, f: GGUFFile, layer: int) -> LayerExperts:
        p = f"blk.{layer}.ffn_"
        return cls(*(ExpertMatrix.from_gguf(f, f"{p}{w}_exps.weight") for w in ("gate", "up", "down")))


def one_row(rows: np.ndarray) -> bool:
    """Whether every miss is the same token's (a decode step): no grouping needed."""
    return bool(rows[0] == rows[-1] and (rows == rows[0]).all())


def moe_misses_reference(x: torch.Tensor, layer: LayerExperts, rows, experts, weights) -> torch.Tensor:
    """The oracle, float64: deimos.quant's decode of each expert, products and sums in float64.
    x [T, D] -> [T, D] float64."""
    x = x.to(torch.float64)
    out = torch.zeros_like(x)
    for r, e, w in zip(np.asarray(rows).tolist(), np.asarray(experts).tolist(), np.asarray(weights).tolist()):
        m = [torch.from_numpy(dequantize(t.raw[e], t.ggml_type, (t.n_out, t.n_in))).double()
             for t in (layer.gate, layer.up, layer.down)]
        g, u = m[0] @ x[r], m[1] @ x[r]
        out[r] += w * (m[2] @ (torch.nn.functional.silu(g) * u))
    return out


def default_threads() -> int:
    """ggml's threads: every CPU this process may run on but one. ggml's threads meet at
    spinning barriers: one thread more than the free cores (the engine's own thread, or any
    other process) and each barrier waits for a time slice (measured on 2 shared cores: 5 ms a
    decode call with 1 thread, 48 ms median with 2 while another process held a core)."""
    return max(1, len(os.sched_getaffinity(0)) - 1)


class CpuExperts:
    """``experts(layer, x, rows, experts, weights)``: the misses' sum for every token.

    - ``layers``: every MoE layer's ``LayerExperts`` (index = the layer number used in calls);
    - ``backend``: "auto", "ggml" or "exact" (module docstring); ``planes``: ggml's activation
      planes (1 = llama.cpp's arithmetic, 2 = 7e-5, 3 = 4e-7 relative error); ``n_threads``: ggml's
      threads (``default_threads()``); ``cache_bytes``: the exact backend's cache; ``pool``:
      ggml's threads made once (``_ThreadPool``), else made by each compute (for comparison);
      ``fused``: with one plane, one graph that quantizes x and h itself (``_GgmlFused``), else
      the two-graph layout with the planes made here (for comparison).
    """

    def __init__(self, layers: Sequence[LayerExperts], *, backend: str = "auto", planes: int = 2,
                 n_threads: int | None = None, cache_bytes: int = EXACT_CACHE_BYTES,
                 pool: bool = True, fused: bool = True):
        if backend not in BACKENDS:
            raise ValueError(f"CpuExperts: backend must be one of {BACKENDS}, got {backend!r}")
        if planes not in (1, 2, 3):
            raise ValueError(f"CpuExperts: planes must be 1, 2 or 3, got {planes}")
        self.layers = list(layers)
        self.planes = planes
        self.n_threads = n_threads or default_threads()
        self._cache = _DecodedCache(cache_bytes)
        ggml = _ggml_module() if backend != "exact" else None
        if backend == "ggml" and ggml is None:
            raise ValueError("CpuExperts: backend 'ggml' needs the ggml-python package")
        self._ggml: list[_GgmlLayer | None] = []
        self._pool = None
        for i, lay in enumerate(self.layers):
            fit = ggml is not None and all(_act_type(ggml, m.ggml_type) is not None
                                           for m in (lay.gate, lay.up, lay.down))
            if backend == "ggml" and not fit:
                raise ValueError(f"CpuExperts: layer {i}'s formats have no 8-bit activation type in ggml")
            if fit and pool and self._pool is None:
                self._pool = _ThreadPool(ggml, self.n_threads)
            self._ggml.append(_GgmlLayer(ggml, lay, planes, self.n_threads, self._pool, fused=fused)
                              if fit else None)

    def backend(self, layer: int) -> str:
        return "ggml" if self._ggml[layer] is not None else "exact"

    def __call__(self, layer: int, x: torch.Tensor, rows, experts, weights,
                 out: torch.Tensor | None = None) -> torch.Tensor:
        """x float32 [T, D] (CPU); rows, experts int [M], weights float [M] (numpy, lists or CPU
        tensors). Returns float32 [T, D]: ``out`` with the misses added when given, else zeros
        plus the misses: a row's weighted sum (one dot product when every miss is one row's)."""
        lay = self.layers[layer]
        if x.dtype != torch.float32 or x.ndim != 2 or x.shape[1] != lay.n_embd or x.device.type != "cpu":
            raise ValueError(f"CpuExperts: want x float32 [T, {lay.n_embd}] on the CPU, got "
                             f"{x.dtype} {tuple(x.shape)} on {x.device}")
        rows = np.asarray(rows, dtype=np.int64).reshape(-1)
        experts = np.asarray(experts, dtype=np.int64).reshape(-1)
        weights = np.asarray(weights, dtype=np.float32).reshape(-1)
        if not rows.size == experts.size == weights.size:
            raise ValueError(f"CpuExperts: {rows.size} rows, {experts.size} experts, {weights.size} weights")
        if rows.size and (rows.min() < 0 or rows.max() >= x.shape[0]):
            raise ValueError(f"CpuExperts: a row outside [0, {x.shape[0]})")
        if experts.size and (experts.min() < 0 or experts.max() >= lay.n_expert):
            raise ValueError(f"CpuExperts: an expert outside [0, {lay.n_expert})")
        if out is None:
            out = torch.zeros_like(x)
        elif out.shape != x.shape or out.dtype != torch.float32 or out.device.type != "cpu":
            raise ValueError(f"CpuExperts: out must be float32 {tuple(x.shape)} on the CPU")
        if not rows.size:
            return out
        g = self._ggml[layer]
        y = g(x.numpy(), rows, experts) if g is not None else self._exact(layer, x.numpy()[rows], experts)
        # numpy, one thread: a torch op here would wake its thread pool right after ggml's
        o = out.numpy()
        if one_row(rows):  # one token's misses (decode)
            o[rows[0]] += weights @ y
        else:
            np.add.at(o, rows, y * weights[:, None])
        return out

    def token(self, layer: int, x: np.ndarray, experts: np.ndarray, weights: np.ndarray,
              out: np.ndarray) -> None:
        """One token's misses (a decode step), with the least host work: x float32 [D] and
        ``out`` float32 [D] (numpy, the sum added to it), experts int [M] (distinct, as one
        token's routing gives them) and weights float32 [M]. What ``__call__`` computes for
        rows of that token alone, bit for bit."""
        lay = self.layers[layer]
        m = experts.shape[0]
        if not m:
            return
        if x.shape != (lay.n_embd,) or out.shape != (lay.n_embd,) or weights.shape != (m,):
            raise ValueError(f"CpuExperts.token: x {x.shape}, out {out.shape}, weights {weights.shape} "
                             f"for {m} experts of width {lay.n_embd}")
        if not 0 <= int(experts.min()) <= int(experts.max()) < lay.n_expert:
            raise ValueError(f"CpuExperts: an expert outside [0, {lay.n_expert})")
        g = self._ggml[layer]
        if g is None:
            self(layer, torch.from_numpy(x.reshape(1, -1)), np.zeros(m, np.int64), experts, weights,
                 out=torch.from_numpy(out.reshape(1, -1)))
            return
        g.token(x, experts, weights.astype(np.float32, copy=False), out)

    def _exact(self, layer: int, xm: np.ndarray, experts: np.ndarray) -> np.ndarray:
        lay = self.layers[layer]
        x = torch.from_numpy(xm)
        y = torch.empty_like(x)
        for e in np.unique(experts).tolist():
            sel = torch.from_numpy(np.flatnonzero(experts == e))
            wg, wu, wd = (self._cache.get((layer, i, e), m) for i, m in enumerate((lay.gate, lay.up, lay.down)))
            h = x[sel]
            y[sel] = (torch.nn.functional.silu(h @ wg.T) * (h @ wu.T)) @ wd.T
        return y.numpy()


class _DecodedCache:
    """Decoded float32 experts keyed by (layer, projection, expert), least recently used out
    past ``budget`` bytes."""

    def __init__(self, budget: int):
        self.budget = budget
        self.nbytes = 0
        self._entries: OrderedDict[tuple[int, int, int], torch.Tensor] = OrderedDict()

    def get(self, key: tuple[int, int, int], m: ExpertMatrix) -> torch.Tensor:
        w = self._entries.get(key)
        if w is not None:
            self._entries.move_to_end(key)
            return w
        w = torch.from_numpy(dequantize(m.raw[key[2]], m.ggml_type, (m.n_out, m.n_in), m.name))
        size = w.numel() * 4
        while self._entries and self.nbytes + size > self.budget:
            self.nbytes -= self._entries.popitem(last=False)[1].numel() * 4
        if size <= self.budget:
            self._entries[key] = w
            self.nbytes += size
        return w


# ---- ggml ---------------------------------------------------------------------------------------

_Q8_K, _Q8_0 = 15, 8  # ggml's activation block types (GGMLType.Q8_K, Q8_0)
GRAPH_NODES = 32  # a plan's graphs: stage 1 with 3 planes and Q8_0 scaling is 15 nodes
PLAN_BUCKET = 16  # above this many misses a layer's plans are made for multiples of it
MAX_PLANS = 24  # plans a layer keeps (least recently used out): 16 exact counts and buckets
# Q8_K: float32 d | int8 qs[256] | int16 bsums[16] (sums of 16 codes, for the k-quants' mins)
_Q8K_DTYPE = np.dtype([("d", "<f4"), ("qs", "i1", 256), ("bsums", "<i2", 16)])
_Q8_0_DTYPE = np.dtype([("d", "<f2"), ("qs", "i1", 32)])  # float16 d | int8 qs[32]
_GGML: list = []


def _ggml_module():
    """The ggml-python module, its C functions from its own files (``GgmlLib``: not another
    ggml found on LD_LIBRARY_PATH), initialized once; None when it is not installed."""
    if not _GGML:
        try:
            import ggml
        except ImportError:
            _GGML.append(None)
        else:
            lib = GgmlLib(ggml)
            lib.ggml_cpu_init()
            _GGML.append(lib)
    return _GGML[0]


def _act_type(ggml, t: GGMLType) -> int | None:
    """The activation block type ggml dots ``t`` with, when it is one quantized here."""
    try:
        traits = ggml.ggml_get_type_traits_cpu(int(t)).contents
    except (ValueError, OSError):
        return None
    if not traits.vec_dot:
        return None
    return traits.vec_dot_type if traits.vec_dot_type in (_Q8_K, _Q8_0) else None


def quantize_planes(x: np.ndarray, act_type: int, planes: int) -> np.ndarray:
    """float32 [R, K] -> activation blocks [R, planes, K / block] (structured: Q8_K or Q8_0):
    plane 1 = q8(x), plane i + 1 = q8(x - planes 1..i). One plane is ggml's own quantization of x
    (quantize_row_q8_K_ref; the x86 quantize_row_q8_0: d = amax / 127, codes rint(x * 127 / amax))."""
    n = 256 if act_type == _Q8_K else 32
    r, k = x.shape
    xb = x.reshape(r, k // n, n).astype(np.float32, copy=True)
    out = np.empty((r, planes, k // n), dtype=_Q8K_DTYPE if act_type == _Q8_K else _Q8_0_DTYPE)
    for p in range(planes):
        ax = np.abs(xb)
        amax = ax.max(-1)
        nz = amax > 0
        with np.errstate(divide="ignore"):
            if act_type == _Q8_K:  # iscale = -127 / (the signed value of largest magnitude, first)
                mx = np.take_along_axis(xb, ax.argmax(-1)[..., None], -1)[..., 0]
                iscale = np.where(nz, np.float32(-127) / mx, np.float32(0))
                q = np.minimum(np.rint(iscale[..., None] * xb), 127).astype(np.int8)
                d = np.where(nz, np.float32(1) / iscale, np.float32(0))
                out["bsums"][:, p] = q.reshape(r, k // n, 16, 16).sum(-1, dtype=np.int16)
            else:
                iscale = np.where(nz, np.float32(127) / amax, np.float32(0))
                q = np.rint(xb * iscale[..., None]).astype(np.int8)
                d = (amax / np.float32(127)).astype(np.float16)
        out["d"][:, p] = d
        out["qs"][:, p] = q
        xb -= d.astype(np.float32)[..., None] * q.astype(np.float32)
    return out


class _Planes:
    """``quantize_planes`` with ggml's own quantizer (the CPU type traits' ``from_float``, one
    call a plane over every row: the blocks are row-major either way); the residual between
    planes in numpy. Byte for byte what quantize_planes gives where ggml's x86 quantizer
    rounds as its reference does (checked in the tests), at a few microseconds a call instead
    of ~100 (numpy's many small operations)."""

    def __init__(self, ggml, act_type: int, planes: int):
        ff = ggml.ggml_get_type_traits_cpu(act_type).contents.from_float
        # from_float(const float *x, void *y, int64_t k), called with integer addresses: ctypes'
        # pointer objects and numpy's .ctypes cost microseconds a call, on a decode's path
        self.from_float = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)(
            ctypes.cast(ff, ctypes.c_void_p).value)
        self.n = 256 if act_type == _Q8_K else 32
        self.dtype = _Q8K_DTYPE if act_type == _Q8_K else _Q8_0_DTYPE
        self.planes = planes

    def target(self, out: np.ndarray) -> _PlanesTarget:
        """``out`` [planes, R, K / block] (structured) prepared for ``quantize_into``: a buffer
        that is written again and again (a plan's) pays for its views once."""
        return _PlanesTarget(self, out)

    def quantize_into(self, x: np.ndarray, t: _PlanesTarget) -> None:
        """x float32 [R, K] -> ``t``'s buffer [planes, R, K / block], each plane where it goes."""
        if x.shape != t.shape:
            raise ValueError(f"planes: x {x.shape} for a buffer of rows {t.shape}")
        resid = t.resid
        np.copyto(resid, x)  # the residual is rewritten
        if t.bsums is not None:
            t.bsums[...] = 0  # ggml skips an all-zero block's bsums: no stale sums from a last call
        n = resid.size
        for p in range(self.planes):
            self.from_float(t.src, t.addr[p], n)
            if p + 1 < self.planes:
                d = t.d[p]
                if t.d32 is not None:  # Q8_0's float16 scales, widened as quantize_planes does
                    np.copyto(t.d32, d)
                    d = t.d32
                np.multiply(d[..., None], t.qs[p], out=t.prod)
                resid -= t.prod.reshape(resid.shape)

    def quantize(self, x: np.ndarray, out: np.ndarray) -> np.ndarray:
        """x float32 [R, K] -> ``out`` [R, planes, K / block] (structured): the rows layout
        (a planes-first buffer written again and again takes ``target`` / ``quantize_into``)."""
        r, k = x.shape
        tmp = np.empty((self.planes, r, k // self.n), dtype=self.dtype)
        self.quantize_into(x, self.target(tmp))
        out[...] = tmp.transpose(1, 0, 2)
        return out


class _PlanesTarget:
    """A planes-first buffer's addresses and field views for ``_Planes.quantize_into``, and the
    residual's scratch."""

    def __init__(self, q: _Planes, out: np.ndarray):
        p, r, nb = out.shape
        if p != q.planes or out.dtype != q.dtype or not out.flags.c_contiguous:
            raise ValueError(f"planes: want a contiguous {q.planes}-plane buffer of {q.dtype}, got "
                             f"{out.dtype} {out.shape}")
        self.out = out  # kept: the addresses point into it
        self.shape = (r, nb * q.n)
        base, step = out.ctypes.data, out[0].nbytes
        self.addr = [base + i * step for i in range(p)]
        self.d = [out[i]["d"] for i in range(p)]
        self.qs = [out[i]["qs"] for i in range(p)]
        self.bsums = out["bsums"] if q.dtype is _Q8K_DTYPE else None
        self.d32 = None if q.dtype is _Q8K_DTYPE else np.empty((r, nb), np.float32)
        self.resid = np.empty(self.shape, np.float32)
        self.src = self.resid.ctypes.data
        self.prod = np.empty((r, nb, q.n), np.float32)


def _pow2_rows(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x [R, K] scaled by a power of two per row (exact) so each row's largest |x| is in
    [64, 128): Q8_0's float16 scales then stay normal. Returns (scaled x, exponents to undo)."""
    _, e = np.frexp(np.abs(x).max(-1))
    shift = (7 - e).astype(np.int32)
    return np.ldexp(x, shift[:, None]), shift


class _ThreadPool:
    """ggml's worker threads, made once for every layer's graphs. Without one each
    ``ggml_graph_compute`` makes and joins its own threads (a disposable pool): two computes a
    layer, 96 a decode token of qwen3moe, each starting n_threads - 1 threads. ggml's default
    parameters: the workers poll for the next graph a while (its "hybrid polling") before they
    sleep, as llama.cpp's do between a token's graphs."""

    def __init__(self, ggml, n_threads: int):
        self.g, self.n_threads = ggml, n_threads
        params = ggml.ggml_threadpool_params_default(n_threads)
        self.ptr = ggml.ggml_threadpool_new(ctypes.byref(params))
        if not self.ptr:
            raise RuntimeError(f"ggml_threadpool_new failed for {n_threads} threads")

    def __del__(self) -> None:
        if getattr(self, "ptr", None):
            self.g.ggml_threadpool_free(self.ptr)
            self.ptr = None


class _GgmlLayer:
    """One layer's graphs: stage 1 (gate and up on the activation planes of x, each summed over
    its planes, then h = silu(g) * u by ggml's swiglu), stage 2 (down on the planes of h,
    quantized here), kept per miss count M; computed by ``pool``'s threads (None: ggml's
    disposable pool a compute). The sums and the middle in the graphs saved ~33 us of numpy a
    decode layer here (80 -> 47 us around ggml's compute, one thread; bench/cpu_token_parts.py)."""

    def __init__(self, ggml, lay: LayerExperts, planes: int, n_threads: int,
                 pool: _ThreadPool | None, bucket: int = PLAN_BUCKET, fused: bool = True):
        self.g, self.lay, self.planes, self.n_threads, self.pool = ggml, lay, planes, n_threads, pool
        self.fused = fused and planes == 1  # one graph, ggml's own quantization (_GgmlFused)
        self.bucket = bucket
        self.act = {i: _act_type(ggml, m.ggml_type) for i, m in enumerate((lay.gate, lay.up, lay.down))}
        self.quant = {a: _Planes(ggml, a, planes) for a in set(self.act.values())}
        self.pow2 = _Q8_0 in self.act.values()  # x's rows scaled into Q8_0's float16 range
        self._plans: OrderedDict[int, _GgmlFused | _GgmlPlan] = OrderedDict()
        # by miss count (at most the experts a token uses): one plane, ggml's own quantization
        self._tokens: dict[int, _GgmlFused | _GgmlToken] = {}

    def token(self, x: np.ndarray, experts: np.ndarray, weights: np.ndarray, out: np.ndarray) -> None:
        """One token's misses (a decode step): x float32 [D], experts [M], weights [M]; their
        weighted sum added to ``out`` [D]."""
        m = experts.shape[0]
        plan = self._tokens.get(m)
        if plan is None:
            plan = self._tokens[m] = _GgmlFused(self, m, token=True) if self.fused else _GgmlToken(self, m)
        plan.token(x, experts, weights, out)

    def __call__(self, x: np.ndarray, rows: np.ndarray, experts: np.ndarray) -> np.ndarray:
        """x [T, D], the misses' rows and experts [M] -> [M, D] (unweighted): the plan's own
        buffer, rewritten by the next call with as many misses (read it before). Above
        ``bucket`` misses the plan is the next multiple of ``bucket``'s, its last rows
        repeating the last miss (their products dropped; each row's are its own): a batched
        decode's miss count changes every step, and a plan per count held up to 64 plans of
        megabytes a layer (64 streams: ~200 misses a layer, ~20 GB over 48 layers)."""
        m = rows.shape[0]
        mb = m if m <= self.bucket else -(-m // self.bucket) * self.bucket
        if mb > m:
            pad = mb - m
            rows = np.concatenate([rows, np.repeat(rows[-1:], pad)])
            experts = np.concatenate([experts, np.repeat(experts[-1:], pad)])
        plan = self._plans.get(mb)
        if plan is None:
            plan = self._plans[mb] = _GgmlFused(self, mb, token=False) if self.fused else _GgmlPlan(self, mb)
            if len(self._plans) > MAX_PLANS:
                self._plans.popitem(last=False)
        else:
            self._plans.move_to_end(mb)
        return plan.run(x, rows, experts)[:m]


class _GgmlGraphs:
    """A ggml context of graph metadata for one layer, its tensors bound to numpy buffers
    (``_bind``), the layer's weights bound to their GGUF bytes, graphs planned for the
    layer's threads (``_graph``) and computed (``_compute``)."""

    def __init__(self, layer: _GgmlLayer, graphs: int):
        g = layer.g
        self.layer = layer
        size = 64 * g.ggml_tensor_overhead() + graphs * g.ggml_graph_overhead_custom(GRAPH_NODES, False)
        self.ctx = g.ggml_init(g.ggml_init_params(mem_size=size, mem_buffer=None, no_alloc=True))
        self._keep: list[np.ndarray] = []

    def _bind(self, t, arr: np.ndarray):
        if self.layer.g.ggml_nbytes(t) != arr.nbytes:
            raise AssertionError(f"ggml tensor of {self.layer.g.ggml_nbytes(t)} bytes bound to {arr.nbytes}")
        self._keep.append(arr)
        t.contents.data = arr.ctypes.data
        return t

    def _weight(self, m: ExpertMatrix):
        t = self.layer.g.ggml_new_tensor_3d(self.ctx, int(m.ggml_type), m.n_in, m.n_out, m.n_expert)
        return self._bind(t, m.raw)

    def _graph(self, outs: list):
        g = self.layer.g
        graph = g.ggml_new_graph_custom(self.ctx, GRAPH_NODES, False)
        for o in outs:
            g.ggml_build_forward_expand(graph, o)
        plan = g.ggml_graph_plan(graph, self.layer.n_threads, self.layer.pool.ptr if self.layer.pool else None)
        work = np.empty(max(plan.work_size, 1), np.uint8)
        self._keep.append(work)
        plan.work_data = ctypes.cast(work.ctypes.data, ctypes.POINTER(ctypes.c_uint8))
        return graph, plan

    def _compute(self, graph, plan) -> None:
        if self.layer.g.ggml_graph_compute(graph, ctypes.pointer(plan)) != 0:
            raise RuntimeError("ggml_graph_compute failed")

    def __del__(self) -> None:
        if getattr(self, "ctx", None) is not None:
            self.layer.g.ggml_free(self.ctx)


class _GgmlFused(_GgmlGraphs):
    """M misses in one graph with one activation plane that ggml quantizes itself, as
    llama.cpp's CPU layers do: float32 rows -> gate and up (ggml_mul_mat_id) -> h =
    swiglu(gate, up) -> down -> y [M, D] (unweighted). Two layouts: ``token`` (a decode step's
    misses: one ggml "token" whose expert list is the M experts, ids [1, M], x [D] broadcast to
    them) and rows (each miss a "token" of one expert, ids [M, 1], x's row of the miss). The
    products of the two-graph plans with one plane, bit for bit where x's and h's rows need no
    power-of-two scaling (Q8_K activations always; Q8_0 rows whose float16 scales are normal),
    with no activation blocks made here, one compute and no numpy between the stages."""

    def __init__(self, layer: _GgmlLayer, m: int, token: bool):
        super().__init__(layer, 1)
        g, lay = layer.g, layer.lay
        d, f = lay.n_embd, lay.n_ff
        n0, n1 = (m, 1) if token else (1, m)  # ggml's ids [n0, n1]: n1 "tokens" of n0 experts
        self.ids_buf = np.empty((n1, n0), np.int32)
        ids = self._bind(g.ggml_new_tensor_2d(self.ctx, g.GGML_TYPE_I32, n0, n1), self.ids_buf)
        self.x = np.empty((n1, d), np.float32)
        x = self._bind(g.ggml_new_tensor_3d(self.ctx, g.GGML_TYPE_F32, d, 1, n1), self.x)
        w = [self._weight(t) for t in (lay.gate, lay.up, lay.down)]
        gate, up = (self._bind(g.ggml_mul_mat_id(self.ctx, w[i], x, ids), np.empty((m, f), np.float32))
                    for i in (0, 1))
        h = self._bind(g.ggml_swiglu_split(self.ctx, gate, up), np.empty((m, f), np.float32))
        self.y = np.empty((m, d), np.float32)
        y = self._bind(g.ggml_mul_mat_id(self.ctx, w[2], h, ids), self.y)
        self.graph, self.plan = self._graph([y])

    def token(self, x: np.ndarray, experts: np.ndarray, weights: np.ndarray, out: np.ndarray) -> None:
        """The token layout: x [D], experts [M], weights [M]; the weighted sum added to ``out``."""
        self.ids_buf[0] = experts
        np.copyto(self.x[0], x)
        self._compute(self.graph, self.plan)
        out += weights @ self.y

    def run(self, x: np.ndarray, rows: np.ndarray, experts: np.ndarray) -> np.ndarray:
        """The rows layout: x [T, D], the misses' rows and experts [M] -> y [M, D] (the plan's
        buffer)."""
        self.ids_buf[:, 0] = experts
        np.take(x, rows, axis=0, out=self.x)
        self._compute(self.graph, self.plan)
        return self.y


class _GgmlPlan(_GgmlGraphs):
    """The two graphs of one layer for M misses, every tensor bound to a numpy buffer. The
    general layout: each miss a ggml "token" whose expert list is its expert once a plane
    (ids [M, planes]), stage 1 reading x's planes of the miss's row ([M, planes, D]).
    ``token``: ``_GgmlToken``'s layout (there)."""

    def __init__(self, layer: _GgmlLayer, m: int, token: bool = False):
        super().__init__(layer, 2)
        g, lay, p = layer.g, layer.lay, layer.planes
        d, f = lay.n_embd, lay.n_ff
        # ggml's ids [n0, n1]: n1 "tokens" of n0 experts; x [D, xb1, xb2] (xb1 1: broadcast)
        n0, n1, xb1, xb2 = (m, p, 1, p) if token else (p, m, p, m)
        self.planes_first = token  # the planes are the buffers' first axis (else the second)
        self.ids_buf = np.empty((n1, n0), np.int32)
        self.ids = self._bind(g.ggml_new_tensor_2d(self.ctx, g.GGML_TYPE_I32, n0, n1), self.ids_buf)
        w = [self._weight(t) for t in (lay.gate, lay.up, lay.down)]
        # stage 1: one activation tensor per activation type of gate / up
        self.x_in: dict[int, tuple] = {}
        for i in (0, 1):
            a = layer.act[i]
            if a not in self.x_in:
                buf = np.empty((xb2, xb1, d // _block(a)), dtype=_act_dtype(a))
                self.x_in[a] = (self._bind(g.ggml_new_tensor_3d(self.ctx, a, d, xb1, xb2), buf), buf)
        outs = [self._bind(g.ggml_mul_mat_id(self.ctx, w[i], self.x_in[layer.act[i]][0], self.ids),
                           np.empty((n1, n0, f), np.float32)) for i in (0, 1)]
        # the middle in the same graph, on ggml's threads: each product summed over its planes
        # (in plane order), unscaled by x's powers of two (Q8_0 activations; exact), then
        # h = silu(gate) * up (ggml's swiglu): one compute and no numpy between the products
        scale, self.scale_buf = self._scale(m, layer.pow2)
        gu = [self._plane_sum(o, f, m, p, scale)[0] for o in outs]
        self.h = np.empty((m, f), np.float32)
        h = self._bind(g.ggml_swiglu_split(self.ctx, gu[0], gu[1]), self.h)
        self.graph1, self.plan1 = self._graph([h])
        a = layer.act[2]
        self.h_in = np.empty((n1, n0, f // _block(a)), dtype=_act_dtype(a))
        h = self._bind(g.ggml_new_tensor_3d(self.ctx, a, f, n0, n1), self.h_in)
        y = self._bind(g.ggml_mul_mat_id(self.ctx, w[2], h, self.ids), np.empty((n1, n0, d), np.float32))
        # summed over h's planes (unscaled by h's powers of two for Q8_0) in the same graph
        scale2, self.scale2_buf = self._scale(m, a == _Q8_0)
        ysum, self.y_sum = self._plane_sum(y, d, m, p, scale2)  # [M, D]
        self.graph2, self.plan2 = self._graph([ysum])
        # the token layout's buffers are planes first: their views made once (_PlanesTarget)
        self.h_target = layer.quant[a].target(self.h_in) if token else None

    def _scale(self, m: int, on: bool):
        """A per-miss factor [1, M] for ``_plane_sum`` (a power of two, set before each compute)
        and its buffer; (None, None) when ``on`` is false."""
        if not on:
            return None, None
        buf = np.ones((m, 1), np.float32)
        return self._bind(self.layer.g.ggml_new_tensor_2d(self.ctx, self.layer.g.GGML_TYPE_F32, 1, m), buf), buf

    def _plane_sum(self, t, f: int, m: int, planes: int, scale):
        """A product [F, M] (a graph node, and the buffer its result is in) from ``t``, the
        mul_mat_id output of every plane: ne [F, M, planes] in the token layout, [F, planes, M]
        in the rows one; summed in plane order, times ``scale`` [1, M] when given."""
        g, nb = self.layer.g, t.contents.nb
        row, plane = (nb[1], nb[2]) if self.planes_first else (nb[2], nb[1])
        views = [g.ggml_view_2d(self.ctx, t, f, m, row, q * plane) for q in range(planes)]
        nodes = [g.ggml_cont(self.ctx, views[0])] if planes == 1 else []
        for v in views[1:]:
            nodes.append(g.ggml_add(self.ctx, nodes[-1] if nodes else views[0], v))
        if scale is not None:
            nodes.append(g.ggml_mul(self.ctx, nodes[-1], scale))
        bufs = [np.empty((m, f), np.float32) for _ in nodes]
        for n, b in zip(nodes, bufs):
            self._bind(n, b)
        return nodes[-1], bufs[-1]

    def run(self, x: np.ndarray, rows: np.ndarray, experts: np.ndarray) -> np.ndarray:
        lay = self.layer
        self.ids_buf[:] = experts[:, None]
        if one_row(rows):  # one token's misses (decode)
            uniq, inv = rows[:1], np.zeros(rows.size, dtype=np.intp)
        else:  # a token's misses share its planes
            uniq, inv = np.unique(rows, return_inverse=True)
        # Q8_0's float16 scales want rows scaled into range (exactly, by powers of two); Q8_K's
        # scales are float32
        pow2 = lay.pow2
        xu, sx = _pow2_rows(x[uniq]) if pow2 else (x[uniq], None)
        for a, (_, buf) in self.x_in.items():
            q = lay.quant[a].quantize(xu, np.empty((uniq.size, *buf.shape[1:]), dtype=buf.dtype))
            buf[:] = q[inv]
        if pow2:
            self.scale_buf[:, 0] = np.ldexp(np.float32(1), -sx[inv])
        return self._products()

    def _products(self) -> np.ndarray:
        """With x's planes (and their unscaling) in place: graph 1 (gate and up, summed over
        their planes, h = silu(gate) * up), h quantized into planes, graph 2; returns the
        misses' down products [M, D] (unweighted)."""
        lay = self.layer
        self._compute(self.graph1, self.plan1)
        h = self.h
        if lay.act[2] == _Q8_0:
            hs, sh = _pow2_rows(h)
            self.scale2_buf[:, 0] = np.ldexp(np.float32(1), -sh)
            self._quantize_h(_Q8_0, hs)
        else:
            self._quantize_h(lay.act[2], h)
        self._compute(self.graph2, self.plan2)
        return self.y_sum

    def _quantize_h(self, act: int, h: np.ndarray) -> None:
        if self.h_target is not None:
            self.layer.quant[act].quantize_into(h, self.h_target)
        else:
            self.layer.quant[act].quantize(h, self.h_in)


class _GgmlToken(_GgmlPlan):
    """The two graphs of one layer for one token's M misses (a decode step), laid out so that
    nothing is repeated per miss: each activation plane is a ggml "token" whose expert list
    is the M missed experts (ids [planes, M]); stage 1 takes x's planes once ([planes, 1, D]:
    broadcast over the M experts), stage 2 each expert's own row of h's planes ([planes, M,
    F]). The same dot products as ``_GgmlPlan``'s, so the same sums, bit for bit."""

    def __init__(self, layer: _GgmlLayer, m: int):
        super().__init__(layer, m, token=True)
        self.x_targets = [(layer.quant[a], layer.quant[a].target(buf)) for a, (_, buf) in self.x_in.items()]

    def token(self, x: np.ndarray, experts: np.ndarray, weights: np.ndarray, out: np.ndarray) -> None:
        lay = self.layer
        self.ids_buf[:] = experts
        xr = x.reshape(1, -1)
        xr, sx = _pow2_rows(xr) if lay.pow2 else (xr, None)
        for q, t in self.x_targets:
            q.quantize_into(xr, t)
        if sx is not None:
            self.scale_buf.fill(np.ldexp(np.float32(1), -sx[0]))
        out += weights @ self._products()


def _block(act_type: int) -> int:
    return 256 if act_type == _Q8_K else 32


def _act_dtype(act_type: int) -> np.dtype:
    return _Q8K_DTYPE if act_type == _Q8_K else _Q8_0_DTYPE
