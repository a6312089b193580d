"""What `deimos inspect MODEL` shows: metadata, a tensor table and byte totals per GGML type.

``inspect_gguf`` returns plain data (frozen dataclasses of strings and ints, long arrays and
strings already abbreviated); ``render_inspect`` turns it into rich tables and ``inspect_text``
into plain text. Every cell is a ``rich.text.Text``, never markup: vocabularies contain tokens
like "[INST]" that rich would otherwise parse as style tags.
"""

from __future__ import annotations

import io
import os
from dataclasses import dataclass
from typing import Any

import numpy as np
from rich.console import Console, Group, RenderableType
from rich.table import Table
from rich.text import Text

from .constants import GGUFValueType
from .reader import GGUFFile

_TYPE_NAMES = {
    GGUFValueType.UINT8: "u8", GGUFValueType.INT8: "i8", GGUFValueType.UINT16: "u16",
    GGUFValueType.INT16: "i16", GGUFValueType.UINT32: "u32", GGUFValueType.INT32: "i32",
    GGUFValueType.FLOAT32: "f32", GGUFValueType.BOOL: "bool", GGUFValueType.STRING: "str",
    GGUFValueType.ARRAY: "arr", GGUFValueType.UINT64: "u64", GGUFValueType.INT64: "i64",
    GGUFValueType.FLOAT64: "f64",
}


@dataclass(frozen=True)
class MetadataRow:
    key: str
    type: str  # "u32", "str", "arr[str]"; arrays also carry their length in `count`
    count: int | None  # number of items of an array, None for a scalar
    value: str  # display form, abbreviated


@dataclass(frozen=True)
class TensorRow:
    name: str
    type: str  # GGML type name
    shape: tuple[int, ...]  # numpy order
    n_elements: int
    nbytes: int


@dataclass(frozen=True)
class TypeTotal:
    type: str
    n_tensors: int
    n_elements: int
    nbytes: int


@dataclass(frozen=True)
class InspectReport:
    path: str
    file_size: int
    version: int
    alignment: int
    data_offset: int
    metadata: tuple[MetadataRow, ...]
    tensors: tuple[TensorRow, ...]
    totals: tuple[TypeTotal, ...]  # largest first
    n_elements: int  # parameters, summed over all tensors
    tensor_bytes: int


def _show(value: Any, max_items: int, max_chars: int) -> str:
    if isinstance(value, str):
        s = repr(value)  # escapes newlines and the surrogates of undecodable bytes
        return s if len(s) <= max_chars else s[: max_chars - 1] + "…"
    if isinstance(value, (np.ndarray, list)):
        head = [_show(v, max_items, max_chars // 4) for v in list(value[:max_items])]
        more = ", …" if len(value) > max_items else ""
        return f"[{', '.join(head)}{more}]"
    if isinstance(value, np.generic):
        return str(value)  # shortest repr of the value at its own precision (float32: 1e-05)
    return repr(value)


def inspect_gguf(
    source: str | os.PathLike[str] | GGUFFile, max_items: int = 8, max_chars: int = 120
) -> InspectReport:
    """Collect the report; ``source`` is a path (opened and closed here) or an open GGUFFile."""
    if isinstance(source, GGUFFile):
        return _report(source, max_items, max_chars)
    with GGUFFile(source) as f:
        return _report(f, max_items, max_chars)


def _report(f: GGUFFile, max_items: int, max_chars: int) -> InspectReport:
    rows = []
    for key, value in f.metadata.items():
        types = f.value_types[key]
        name = _TYPE_NAMES[types[0]]
        if types[0] == GGUFValueType.ARRAY:
            name = f"arr[{_TYPE_NAMES[types[1]]}]"
        count = len(value) if types[0] == GGUFValueType.ARRAY else None
        if types[0] == GGUFValueType.FLOAT32:
            value = np.float32(value)  # shortest float32 repr: 1e-05, not 9.999999747378752e-06
        rows.append(MetadataRow(key, name, count, _show(value, max_items, max_chars)))
    tensors = tuple(
        TensorRow(t.name, t.ggml_type.name, t.shape, t.n_elements, t.nbytes)
        for t in f.tensors.values()
    )
    by_type: dict[str, list[int]] = {}
    for t in tensors:
        acc = by_type.setdefault(t.type, [0, 0, 0])
        acc[0] += 1
        acc[1] += t.n_elements
        acc[2] += t.nbytes
    totals = tuple(
        sorted((TypeTotal(k, *v) for k, v in by_type.items()), key=lambda x: -x.nbytes)
    )
    return InspectReport(
        f.path, f.file_size, f.version, f.alignment, f.data_offset, tuple(rows), tensors, totals,
        sum(t.n_elements for t in tensors), sum(t.nbytes for t in tensors),
    )


def _mib(n: int) -> str:
    return f"{n / 2**20:,.2f} MiB"


def render_inspect(report: InspectReport) -> RenderableType:
    head = Text(
        f"{report.path}\nGGUF v{report.version}, {report.file_size:,} bytes, "
        f"alignment {report.alignment}, data at byte {report.data_offset:,}; "
        f"{len(report.tensors)} tensors, {report.n_elements:,} parameters, "
        f"{_mib(report.tensor_bytes)} of tensor data"
    )
    meta = Table(title="metadata", title_justify="left")
    for col in ("key", "type", "items", "value"):
        meta.add_column(col, overflow="fold")
    for r in report.metadata:
        count = "" if r.count is None else f"{r.count:,}"
        meta.add_row(Text(r.key), Text(r.type), Text(count), Text(r.value))
    tens = Table(title="tensors", title_justify="left")
    tens.add_column("name")
    tens.add_column("type")
    tens.add_column("shape")
    tens.add_column("bytes", justify="right")
    for t in report.tensors:
        shape = " x ".join(map(str, t.shape))
        tens.add_row(Text(t.name), Text(t.type), Text(shape), Text(f"{t.nbytes:,}"))
    tot = Table(title="totals by type", title_justify="left")
    for col in ("type", "tensors", "parameters", "bytes", "share"):
        tot.add_column(col, justify="left" if col == "type" else "right")
    for t in report.totals:
        share = t.nbytes / report.tensor_bytes if report.tensor_bytes else 0.0
        tot.add_row(
            Text(t.type), Text(str(t.n_tensors)), Text(f"{t.n_elements:,}"),
            Text(_mib(t.nbytes)), Text(f"{share:.1%}"),
        )
    return Group(head, meta, tens, tot)


def inspect_text(report: InspectReport, width: int = 120) -> str:
    """The rendered report as plain text (no colour codes)."""
    console = Console(file=io.StringIO(), width=width, color_system=None, record=True)
    console.print(render_inspect(report))
    return console.export_text()
