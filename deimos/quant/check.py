"""``quant-check``: a quantized GGUF against a higher-precision copy of the same model.

A wrong decoder still produces fluent text, so the numbers that catch one are per tensor:
with ``q`` the decoded quantized tensor and ``r`` the decoded reference,

    rel RMS error  ||q - r|| / ||r||       cosine  q.r / (||q|| ||r||)       max |q - r|

Each is judged against what the tensor's format gives on its own: ``EXPECTED_REL_RMS[t]`` is
the rel RMS error of ggml's reference quantizer (ggml_quantize_chunk, no importance matrix;
a uniform one for the types that need one) on N(0, 1) data, 64 rows of 4096, seed 0 —
re-measured by tests/test_quant_check.py. Real weights are heavier-tailed than Gaussian and
come out up to about 1.5x higher. A tensor is flagged when its error is far above that:

- rel RMS error > ``FACTOR`` x expected (at least ``ABS_FLOOR``: an exact format must be exact), or
- cosine < 1 / sqrt(1 + (FACTOR x expected)^2), the cosine an error of that size orthogonal to
  the weights would leave; this is what catches a broken ternary decoder, whose expected
  error is already ~0.8 of the weights' norm;
- non-finite decoded values.
Names found in one file only, shape mismatches and a reference that is not of higher precision
than the quantized tensor are reported as problems too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from deimos.gguf import GGUFFile
from deimos.gguf.constants import GGML_BLOCK, GGMLType
from deimos.quant.base import dequantize

FACTOR = 3.0
ABS_FLOOR = 1e-6

# rel RMS error of ggml's quantizer on N(0, 1) (see the module docstring), 3 digits.
EXPECTED_REL_RMS: dict[GGMLType, float] = {
    GGMLType.F32: 0.0,
    GGMLType.F16: 2.07e-4,
    GGMLType.BF16: 1.66e-3,
    GGMLType.Q8_0: 5.36e-3,
    GGMLType.Q6_K: 1.78e-2,
    GGMLType.Q5_1: 3.79e-2,
    GGMLType.Q5_0: 4.28e-2,
    GGMLType.Q5_K: 3.62e-2,
    GGMLType.Q4_1: 7.83e-2,
    GGMLType.Q4_0: 8.61e-2,
    GGMLType.Q4_K: 7.15e-2,
    GGMLType.IQ4_NL: 7.62e-2,
    GGMLType.IQ4_XS: 7.68e-2,
    GGMLType.MXFP4: 0.115,
    GGMLType.Q3_K: 0.151,
    GGMLType.IQ3_S: 0.167,
    GGMLType.IQ3_XXS: 0.214,
    GGMLType.Q2_K: 0.297,
    GGMLType.IQ2_S: 0.265,
    GGMLType.IQ2_XS: 0.300,
    GGMLType.IQ2_XXS: 0.344,
    GGMLType.IQ1_M: 0.583,
    GGMLType.IQ1_S: 0.486,
    GGMLType.TQ2_0: 0.808,
    GGMLType.TQ1_0: 0.808,
}

# Elements compared per step: bounds the float32/float64 temporaries of a large tensor
# (gemma's 168M-element embedding) to a few tens of MB.
_CHUNK = 1 << 22


class QuantCheckError(ValueError):
    """The two files cannot be compared at all (no tensor in common)."""


def bits_per_weight(t: GGMLType) -> float:
    block, size = GGML_BLOCK[t]
    return 8.0 * size / block


def thresholds(t: GGMLType) -> tuple[float, float] | None:
    """(highest rel RMS error, lowest cosine) that pass for type ``t``; None if unknown."""
    expected = EXPECTED_REL_RMS.get(t)
    if expected is None:
        return None
    bound = max(FACTOR * expected, ABS_FLOOR)
    return bound, 1.0 / math.sqrt(1.0 + bound * bound)


@dataclass(frozen=True)
class TensorCheck:
    name: str
    quant_type: GGMLType
    ref_type: GGMLType
    shape: tuple[int, ...]
    rel_rms: float
    cosine: float
    max_abs: float
    flag: str | None  # why it is flagged; None when fine
    err2: float = math.nan  # ||q - r||^2 and ||r||^2, for pooling over a type
    ref2: float = math.nan

    @property
    def expected(self) -> float | None:
        return EXPECTED_REL_RMS.get(self.quant_type)


@dataclass(frozen=True)
class TypeSummary:
    """All compared tensors of one quantized type: errors pooled over their elements."""

    ggml_type: GGMLType
    n_tensors: int
    n_elements: int
    rel_rms: float  # sqrt(sum ||q - r||^2 / sum ||r||^2)
    worst_rel_rms: float
    min_cosine: float
    max_abs: float
    n_flagged: int

    @property
    def expected(self) -> float | None:
        return EXPECTED_REL_RMS.get(self.ggml_type)


@dataclass(frozen=True)
class QuantCheck:
    quant_path: Path
    ref_path: Path
    tensors: list[TensorCheck]
    by_type: list[TypeSummary]
    only_in_quant: list[str] = field(default_factory=list)
    only_in_ref: list[str] = field(default_factory=list)
    # (name, shape in the quantized file, shape in the reference)
    shape_mismatches: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = field(
        default_factory=list)
    lower_precision_ref: list[tuple[str, GGMLType, GGMLType]] = field(default_factory=list)

    @property
    def flagged(self) -> list[TensorCheck]:
        return [t for t in self.tensors if t.flag]

    @property
    def problems(self) -> list[str]:
        """One line per thing that is wrong, flagged tensors included; empty when all is well."""
        return [f"{t.name}: {t.flag}" for t in self.flagged] + self.mismatches

    @property
    def mismatches(self) -> list[str]:
        """The problems that are not flagged tensors: names, shapes, reference precision."""
        out = [f"{n}: only in the quantized file" for n in self.only_in_quant]
        out += [f"{n}: only in the reference" for n in self.only_in_ref]
        out += [f"{n}: shape {q} in the quantized file, {r} in the reference"
                for n, q, r in self.shape_mismatches]
        out += [f"{n}: reference {r.name} is not of higher precision than {q.name}"
                for n, q, r in self.lower_precision_ref]
        return out


class _Sums:
    """Running float64 sums of one tensor's comparison."""

    def __init__(self) -> None:
        self.err2 = self.ref2 = self.q2 = self.dot = self.max_abs = 0.0
        self.finite = True

    def add(self, q: np.ndarray, r: np.ndarray) -> None:
        if not (np.isfinite(q).all() and np.isfinite(r).all()):
            self.finite = False
            return
        q = q.astype(np.float64).reshape(-1)
        r = r.astype(np.float64).reshape(-1)
        d = q - r
        self.err2 += float(d @ d)
        self.ref2 += float(r @ r)
        self.q2 += float(q @ q)
        self.dot += float(q @ r)
        if d.size:
            self.max_abs = max(self.max_abs, float(np.abs(d).max()))


def _decoded_rows(f: GGUFFile, name: str):
    """The tensor's float32 values in chunks of whole rows (no full-tensor temporaries)."""
    info = f.tensors[name]
    raw = f.tensor_bytes(name)
    shape = tuple(info.shape)
    ne0 = shape[-1] if shape else 1
    n_rows = info.n_elements // ne0 if ne0 else 0
    row_bytes = raw.size // n_rows if n_rows else 0
    step = max(1, _CHUNK // max(ne0, 1))
    for i in range(0, n_rows, step):
        k = min(step, n_rows - i)
        chunk = raw[i * row_bytes:(i + k) * row_bytes]
        yield dequantize(chunk, info.ggml_type, (k, ne0), name=name)


def compare_tensor(qf: GGUFFile, rf: GGUFFile, name: str) -> TensorCheck:
    qi, ri = qf.tensors[name], rf.tensors[name]
    s = _Sums()
    for q, r in zip(_decoded_rows(qf, name), _decoded_rows(rf, name), strict=True):
        s.add(q, r)
    if not s.finite:
        return TensorCheck(name, qi.ggml_type, ri.ggml_type, tuple(qi.shape), math.nan, math.nan,
                           math.nan, "non-finite values")
    if s.ref2 > 0:
        rel = math.sqrt(s.err2 / s.ref2)
    else:
        rel = 0.0 if s.err2 == 0 else math.inf
    denom = math.sqrt(s.q2 * s.ref2)
    cos = s.dot / denom if denom > 0 else (1.0 if s.err2 == 0 else 0.0)
    flag = None
    limits = thresholds(qi.ggml_type)
    if limits is not None:
        max_rel, min_cos = limits
        t = qi.ggml_type.name
        if rel > max_rel:
            flag = (f"rel RMS error {rel:.3g} > {FACTOR:g}x the {t} expectation "
                    f"{EXPECTED_REL_RMS[qi.ggml_type]:.3g}")
        elif cos < min_cos:
            flag = f"cosine {cos:.4f} < {min_cos:.4f} (an error {FACTOR:g}x the {t} expectation)"
    return TensorCheck(name, qi.ggml_type, ri.ggml_type, tuple(qi.shape), rel, cos, s.max_abs, flag,
                       s.err2, s.ref2)


def _summaries(tensors: list[TensorCheck], qf: GGUFFile) -> list[TypeSummary]:
    out = []
    for t in sorted({c.quant_type for c in tensors}, key=lambda t: -bits_per_weight(t)):
        group = [c for c in tensors if c.quant_type == t]
        finite = [c for c in group if math.isfinite(c.rel_rms)]
        err2, ref2 = sum(c.err2 for c in finite), sum(c.ref2 for c in finite)
        if not finite:
            pooled = math.nan
        else:
            pooled = math.sqrt(err2 / ref2) if ref2 > 0 else (0.0 if err2 == 0 else math.inf)
        out.append(TypeSummary(
            t, len(group), sum(qf.tensors[c.name].n_elements for c in group), pooled,
            max(c.rel_rms for c in group), min(c.cosine for c in group),
            max(c.max_abs for c in group), sum(c.flag is not None for c in group),
        ))
    return out


def check_files(quant: str | Path, reference: str | Path) -> QuantCheck:
    """Compares every tensor present in both files (see the module docstring)."""
    with GGUFFile(quant) as qf, GGUFFile(reference) as rf:
        common = [n for n in qf.tensors if n in rf.tensors]
        only_q = [n for n in qf.tensors if n not in rf.tensors]
        only_r = [n for n in rf.tensors if n not in qf.tensors]
        mismatched = [(n, tuple(qf.tensors[n].shape), tuple(rf.tensors[n].shape)) for n in common
                      if tuple(qf.tensors[n].shape) != tuple(rf.tensors[n].shape)]
        bad = {m[0] for m in mismatched}
        same = [n for n in common if n not in bad]
        if not same:
            raise QuantCheckError(
                f"{quant} and {reference} have no tensor of the same name and shape in common "
                f"({len(common)} shared names, {len(mismatched)} of them with other shapes)")
        types = [(n, qf.tensors[n].ggml_type, rf.tensors[n].ggml_type) for n in same]
        lower = [x for x in types if bits_per_weight(x[2]) < bits_per_weight(x[1])]
        tensors = [compare_tensor(qf, rf, n) for n in same]
        return QuantCheck(Path(quant), Path(reference), tensors, _summaries(tensors, qf),
                          only_q, only_r, mismatched, lower)


# ---- rendering ---------------------------------------------------------------------------------


def _num(x: float, fmt: str) -> str:
    return "-" if x is None else ("nan" if math.isnan(x) else format(x, fmt))


def render_check(c: QuantCheck, all_tensors: bool = False):
    """A rich renderable: the per-type table, then the per-tensor table (every tensor with
    ``all_tensors``, else only the flagged ones), then the problems. Fits 80 columns."""
    from rich import box
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    def table(title: str, cols: tuple[str, ...]) -> Table:
        t = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False,
                  collapse_padding=True)
        for i, col in enumerate(cols):
            t.add_column(col, justify="left" if i == 0 else "right", no_wrap=True)
        return t

    parts: list = [Text(f"{c.quant_path.name} vs {c.ref_path.name}: {len(c.tensors)} tensors "
                        "compared", style="bold")]
    by_type = table("per type: rel RMS pooled over the type's tensors; expected = ggml on N(0,1)",
                    ("type", "bpw", "n", "rel RMS", "expected", "ratio", "min cos", "max|err|",
                     "flagged"))
    for s in c.by_type:
        ratio = s.rel_rms / s.expected if s.expected else None
        by_type.add_row(
            s.ggml_type.name, f"{bits_per_weight(s.ggml_type):.2f}", str(s.n_tensors),
            _num(s.rel_rms, ".3e"), _num(s.expected, ".2e"), _num(ratio, ".2f"),
            _num(s.min_cosine, ".6f"), _num(s.max_abs, ".2e"),
            Text(str(s.n_flagged), style="bold red" if s.n_flagged else "green"),
        )
    parts.append(by_type)
    rows = c.tensors if all_tensors else c.flagged
    if rows:
        per = table("every tensor" if all_tensors else "flagged tensors",
                    ("tensor", "type", "ref", "rel RMS", "ratio", "cosine", "max|err|", "flag"))
        for t in rows:
            ratio = t.rel_rms / t.expected if t.expected else None
            per.add_row(t.name, t.quant_type.name, t.ref_type.name, _num(t.rel_rms, ".3e"),
                        _num(ratio, ".2f"), _num(t.cosine, ".6f"), _num(t.max_abs, ".2e"),
                        Text("yes" if t.flag else "", style="bold red"))
        parts.append(per)
    if c.problems:
        parts.append(Text(f"{len(c.problems)} problem(s):", style="bold red"))
        parts += [Text(f"  {p}") for p in c.problems[:40]]
        if len(c.problems) > 40:
            parts.append(Text(f"  ... and {len(c.problems) - 40} more"))
    else:
        parts.append(Text("no problems: every tensor within its format's expected error",
                          style="green"))
    return Group(*parts)
