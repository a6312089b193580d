"""GGUFFile against independent oracles: gguf-py's GGUFReader on the real models, files written
by gguf-py's GGUFWriter (every value type, v2 and v3), and hand-built bytes with one defect each."""

from __future__ import annotations

import math
import os
import re
import time

import gguf
import numpy as np
import pytest

from deimos.gguf import GGMLType, GGUFError, GGUFFile, GGUFValueType
from gguf_support import (
    ARRAY, BOOL, FLOAT32, INT32, STRING, T_F32, T_Q8_0, UINT8, UINT32,
    arr, build, gstr, kv, kv_str, kv_u32, tinfo, u32, u64,
)
from testdata import REAL_MODELS, llama_cpp_path, model_path

VT = gguf.GGUFValueType


# -- the real models against gguf-py ----------------------------------------------------------

def _oracle(path) -> gguf.GGUFReader:
    """gguf-py's reader over an in-memory copy of the file: it slices its np.memmap once per
    string and memmap's per-slice overhead makes a 262k-token vocabulary take ~20 s; a plain
    uint8 array holds the same bytes and runs the same parser 4x faster."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(np, "memmap", lambda p, mode="r": np.fromfile(p, dtype=np.uint8))
        return gguf.GGUFReader(path)


@pytest.fixture(scope="module", params=[*REAL_MODELS, "vocab-aquila"])
def real_pair(request):
    # ggml-vocab-aquila.gguf is a real GGUF v2 file (100k tokens, merges, no tensors).
    name = request.param
    path = llama_cpp_path("models/ggml-vocab-aquila.gguf") if name == "vocab-aquila" else model_path(name)
    with GGUFFile(path) as f:
        yield f, _oracle(path)


def _assert_same_value(key: str, mine, field) -> None:
    if isinstance(mine, np.ndarray):
        ref = np.array(field.contents(), dtype=gguf.GGUFReader.gguf_scalar_to_np[field.types[-1]])
        assert mine.dtype == ref.dtype and np.array_equal(mine, ref), key
        assert not mine.flags.writeable
    else:
        assert mine == field.contents(), key
        assert type(mine) is type(field.contents()), key


def test_real_model_matches_gguf_py(real_pair):
    f, r = real_pair
    assert f.version == (2 if "aquila" in f.path else 3)
    assert f.alignment == r.alignment and f.data_offset == r.data_offset
    fields = {k: v for k, v in r.fields.items() if not k.startswith("GGUF.")}
    assert list(f.metadata) == list(fields)
    for key, field in fields.items():
        assert list(f.value_types[key]) == [GGUFValueType(int(t)) for t in field.types], key
        _assert_same_value(key, f.metadata[key], field)
    assert list(f.tensors) == [t.name for t in r.tensors]
    for t in r.tensors:
        info = f.tensors[t.name]
        assert info.ggml_type == GGMLType(int(t.tensor_type))
        assert info.dims == tuple(int(d) for d in t.shape)
        assert info.shape == info.dims[::-1]
        assert info.n_elements == t.n_elements and info.nbytes == t.n_bytes
        assert info.offset == t.data_offset
        raw = f.tensor_bytes(t.name)
        assert raw.dtype == np.uint8 and not raw.flags.writeable
        assert np.array_equal(raw, t.data.reshape(-1).view(np.uint8)), t.name


def test_real_vocab_parses_fast():
    # The gemma file holds a 262144-token vocabulary plus scores and token types.
    path = model_path("gemma-3-270m-q4_k_m.gguf")
    best = math.inf
    for _ in range(3):
        t0 = time.perf_counter()
        GGUFFile(path).close()
        best = min(best, time.perf_counter() - t0)
    assert best < 1.0, f"parsing took {best:.2f} s"


def test_tensor_bytes_is_a_zero_copy_view():
    with GGUFFile(model_path(REAL_MODELS[0])) as f:
        name = next(iter(f.tensors))
        a, b = f.tensor_bytes(name), f.tensor_bytes(name)
        assert np.shares_memory(a, b)
        with pytest.raises(ValueError):
            a[0] = 1
    with pytest.raises(GGUFError, match="closed"):
        f.tensor_bytes(name)


# -- files written by gguf-py's GGUFWriter: every value type, v2 and v3 ----------------------

SCALARS = [
    ("t.u8", VT.UINT8, 200), ("t.i8", VT.INT8, -100), ("t.u16", VT.UINT16, 60000),
    ("t.i16", VT.INT16, -30000), ("t.u32", VT.UINT32, 4_000_000_000),
    ("t.i32", VT.INT32, -2_000_000_000), ("t.f32", VT.FLOAT32, 1.5e-5), ("t.bool", VT.BOOL, True),
    ("t.bool0", VT.BOOL, False), ("t.str", VT.STRING, "héllo ✓ 日本"),
    ("t.u64", VT.UINT64, 2**64 - 1),
    ("t.i64", VT.INT64, -(2**63)), ("t.f64", VT.FLOAT64, math.pi),
]
NUMERIC_ARRAYS = [
    (VT.UINT8, "<u1", [0, 1, 255]), (VT.INT8, "<i1", [-128, 0, 127]),
    (VT.UINT16, "<u2", [0, 65535]), (VT.INT16, "<i2", [-32768, 32767]),
    (VT.UINT32, "<u4", [0, 2**32 - 1]), (VT.INT32, "<i4", [-(2**31), 2**31 - 1, 5]),
    (VT.FLOAT32, "<f4", [0.5, -1.25, 3.0e38]), (VT.BOOL, "?", [True, False, True]),
    (VT.UINT64, "<u8", [0, 2**64 - 1]), (VT.INT64, "<i8", [-(2**63), 2**63 - 1]),
    (VT.FLOAT64, "<f8", [math.e, -0.0, 1e300]),
]
STRINGS = ["<unk>", "Ġthe", "ĠĠ", "日本語", "a" * 300, " ", "\n"]
NESTED = [[1, 2, 3], [4], [5, 6]]
NESTED_STR = [["a", "bc"], ["日"]]


def _write_all_types(path, alignment: int | None = None):
    w = gguf.GGUFWriter(str(path), arch="llama")
    if alignment is not None:
        w.add_custom_alignment(alignment)
    for key, vt, val in SCALARS:
        w.add_key_value(key, val, vt)
    for vt, _, vals in NUMERIC_ARRAYS:
        w.add_key_value(f"a.{vt.name.lower()}", vals, VT.ARRAY, sub_type=vt)
    w.add_key_value("a.str", STRINGS, VT.ARRAY, sub_type=VT.STRING)
    w.add_key_value("a.nested", NESTED, VT.ARRAY, sub_type=VT.ARRAY)
    w.add_key_value("a.nested_str", NESTED_STR, VT.ARRAY, sub_type=VT.ARRAY)
    rng = np.random.default_rng(0)
    tensors = {
        "w.f32": rng.standard_normal((3, 5), dtype=np.float32),
        "w.f16": rng.standard_normal((2, 4)).astype(np.float16),
        "w.i32": rng.integers(-9, 9, (7,), dtype=np.int32),
        "w.f64": rng.standard_normal((1, 2, 3)),
        "w.i8": rng.integers(-9, 9, (2, 2, 2, 2), dtype=np.int8),
    }
    for name, t in tensors.items():
        w.add_tensor(name, t)
    q8 = rng.integers(0, 256, (4, 2 * 34), dtype=np.uint8)  # 4 rows of 2 Q8_0 blocks
    w.add_tensor("w.q8", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tensors["w.q8"] = q8
    return tensors


@pytest.mark.parametrize("version", [2, 3])
@pytest.mark.parametrize("alignment", [None, 64])
def test_writer_file_every_value_type(tmp_path, version, alignment):
    path = tmp_path / "all.gguf"
    tensors = _write_all_types(path, alignment)
    if version == 2:  # v2 and v3 share the little-endian layout; only the version field differs
        with open(path, "r+b") as fh:
            fh.seek(4)
            fh.write(u32(2))
    with GGUFFile(path) as f:
        assert f.version == version
        assert f.alignment == (alignment or 32)
        md = f.metadata
        for key, vt, val in SCALARS:
            expected = float(np.float32(val)) if vt == VT.FLOAT32 else val
            assert md[key] == expected and type(md[key]) is type(expected), key
            assert f.value_types[key] == (GGUFValueType(vt),)
        for vt, dtype, vals in NUMERIC_ARRAYS:
            a = md[f"a.{vt.name.lower()}"]
            assert isinstance(a, np.ndarray) and a.dtype == np.dtype(dtype), vt
            assert np.array_equal(a, np.array(vals, dtype=dtype)) and not a.flags.writeable
            assert f.value_types[f"a.{vt.name.lower()}"] == (GGUFValueType.ARRAY, GGUFValueType(vt))
        assert md["a.str"] == STRINGS
        assert [x.tolist() for x in md["a.nested"]] == NESTED
        assert md["a.nested_str"] == NESTED_STR
        assert f.value_types["a.nested"] == (GGUFValueType.ARRAY, GGUFValueType.ARRAY)
        assert md["general.architecture"] == "llama"

        r = gguf.GGUFReader(path)
        assert f.data_offset == r.data_offset and f.data_offset % f.alignment == 0
        assert list(f.tensors) == list(tensors)
        for t in r.tensors:
            info = f.tensors[t.name]
            assert info.offset == t.data_offset and info.offset % f.alignment == 0
            assert info.nbytes == t.n_bytes and info.n_elements == t.n_elements
            assert info.ggml_type == GGMLType(int(t.tensor_type))
            assert f.tensor_bytes(t.name).tobytes() == tensors[t.name].tobytes()
        assert f.tensors["w.q8"].shape == (4, 64) and f.tensors["w.q8"].dims == (64, 4)
        assert f.tensors["w.i8"].shape == (2, 2, 2, 2)
        assert f.tensors["w.f64"].dims == (3, 2, 1)


def test_typed_accessors(tmp_path):
    path = tmp_path / "all.gguf"
    _write_all_types(path)
    with GGUFFile(path) as f:
        assert f.get_int("t.u32") == 4_000_000_000
        assert f.get_float("t.f64") == math.pi and f.get_float("t.u8") == 200.0
        assert f.get_str("t.str") == "héllo ✓ 日本" and f.get_bool("t.bool") is True
        assert f.get_str_list("a.str") == STRINGS
        assert f.get_array("a.int32").tolist() == [-(2**31), 2**31 - 1, 5]
        assert f.get("nope", 7) == 7 and f.get_int("nope", None) is None
        with pytest.raises(GGUFError, match=r"all\.gguf: missing metadata key 'nope'"):
            f.get_int("nope")
        with pytest.raises(GGUFError, match=r"'t\.str' is STRING, expected an integer"):
            f.get_int("t.str")
        with pytest.raises(GGUFError, match=r"'t\.bool' is BOOL, expected an integer"):
            f.get_int("t.bool")
        with pytest.raises(GGUFError, match=r"'a\.int32' is ARRAY/INT32, expected a string"):
            f.get_str("a.int32")
        with pytest.raises(GGUFError, match="no tensor named 'nope'"):
            f.tensor_bytes("nope")


def test_invalid_utf8_value_round_trips(tmp_path):
    raw = b"ok \xff\xfe bytes"
    p = tmp_path / "u.gguf"
    p.write_bytes(build([kv_str("v", raw), kv("a", ARRAY, arr(STRING, [gstr(raw)]))], []))
    with GGUFFile(p) as f:
        assert f.metadata["v"].encode("utf-8", "surrogateescape") == raw
        assert f.metadata["a"][0].encode("utf-8", "surrogateescape") == raw


# -- hand-built bytes, one defect each ----------------------------------------------------------

KVS = [kv_str("general.architecture", "llama"), kv_u32("llama.block_count", 2)]
TENSORS = [tinfo("a", [4, 2], T_F32, 0), tinfo("b", [8], T_F32, 32)]
DATA = np.arange(16, dtype=np.float32).tobytes()


def _open(tmp_path, data: bytes, name: str = "bad.gguf") -> GGUFFile:
    p = tmp_path / name
    p.write_bytes(data)
    return GGUFFile(p)


def _bad(tmp_path, data: bytes, match: str) -> GGUFError:
    with pytest.raises(GGUFError) as e:
        _open(tmp_path, data).close()
    msg = str(e.value)
    assert msg.startswith(str(tmp_path / "bad.gguf") + ": "), msg
    assert re.search(match, msg), msg
    return e.value


def test_base_file_is_valid(tmp_path):
    data = build(KVS, TENSORS, DATA)
    with _open(tmp_path, data, "ok.gguf") as f:
        assert f.metadata == {"general.architecture": "llama", "llama.block_count": 2}
        assert f.tensors["a"].shape == (2, 4) and f.tensors["b"].offset == f.data_offset + 32
        assert np.array_equal(f.tensor_bytes("b").view(np.float32), np.arange(8, 16))
    r = gguf.GGUFReader(tmp_path / "ok.gguf")
    assert [t.data_offset for t in r.tensors] == [f.tensors["a"].offset, f.tensors["b"].offset]


def test_wrong_magic(tmp_path):
    _bad(tmp_path, build(KVS, TENSORS, DATA, magic=b"GGML"), r"not a GGUF file: magic is b'GGML'")


@pytest.mark.parametrize("version", [0, 1, 4, 0xFFFFFFFF])
def test_unsupported_version(tmp_path, version):
    data = build(KVS, TENSORS, DATA, version=version)
    _bad(tmp_path, data, f"unsupported GGUF version {version}")


def test_big_endian_is_refused(tmp_path):
    data = build(KVS, TENSORS, DATA)
    data = data[:4] + (3).to_bytes(4, "big") + data[8:]
    _bad(tmp_path, data, "big-endian GGUF")


def test_empty_file(tmp_path):
    _bad(tmp_path, b"", "empty file")


def test_missing_file_and_directory(tmp_path):
    with pytest.raises(GGUFError, match="cannot open"):
        GGUFFile(tmp_path / "nope.gguf")
    with pytest.raises(GGUFError, match="cannot open"):
        GGUFFile(tmp_path)


def _truncation_points() -> dict[str, int]:
    head = 24
    key0 = head + 8 + len("general.architecture")
    kv_end = head + len(KVS[0]) + len(KVS[1])
    return {
        "in magic": 2,
        "in version": 6,
        "in tensor count": 12,
        "in kv count": 20,
        "in key length": head + 3,
        "in key bytes": head + 8 + 5,
        "in value type": key0 + 2,
        "in string value length": key0 + 4 + 5,
        "in string value bytes": key0 + 4 + 8 + 2,
        "in u32 value": kv_end - 2,
        "in tensor name": kv_end + 8,
        "in n_dims": kv_end + 9 + 2,
        "in dims": kv_end + 9 + 4 + 10,
        "in tensor type": kv_end + 9 + 4 + 16 + 2,
        "in tensor offset": kv_end + 9 + 4 + 16 + 4 + 3,
        "in data": kv_end + len(TENSORS[0]) + len(TENSORS[1]) + 40,
    }


@pytest.mark.parametrize("where", list(_truncation_points()))
def test_truncated(tmp_path, where):
    data = build(KVS, TENSORS, DATA)
    cut = _truncation_points()[where]
    assert cut < len(data)
    _bad(tmp_path, data[:cut], r"truncated|past the end|cannot fit")


def test_truncated_message_names_the_field(tmp_path):
    data = build([kv_u32("k", 1)], [])
    _bad(tmp_path, data[: 24 + 8 + 1 + 4 + 2], r"truncated file: value of metadata key 'k' needs 4")


def test_key_length_past_end(tmp_path):
    bad = u64(10**6) + b"general.architecture"
    _bad(tmp_path, build([bad + KVS[0][28 + 8:]], [], DATA, n_kv=1),
         r"metadata key #0 has length 1000000, past the end")


def test_string_value_length_past_end(tmp_path):
    _bad(tmp_path, build([kv("k", STRING, u64(2**40) + b"abc")], []),
         r"value of metadata key 'k' has length 1099511627776, past the end")


def test_string_array_item_length_past_end(tmp_path):
    items = [gstr("a"), u64(2**62) + b"xyz"]
    _bad(tmp_path, build([kv("tok", ARRAY, arr(STRING, items))], []),
         r"value of metadata key 'tok'\[1\] has length 4611686018427387904, past the end")


@pytest.mark.parametrize(
    "field,value", [("n_tensors", 2**62), ("n_kv", 2**40), ("n_kv", 2**64 - 1)]
)
def test_absurd_header_counts(tmp_path, field, value):
    data = build(KVS, TENSORS, DATA, **{field: value})
    _bad(tmp_path, data, r"count .* cannot fit in the \d+ bytes left")


@pytest.mark.parametrize("item_type", [UINT8, FLOAT32, STRING, ARRAY])
def test_absurd_array_length(tmp_path, item_type):
    data = build([kv("a", ARRAY, arr(item_type, [], count=2**61))], [], DATA)
    _bad(tmp_path, data, r"value of metadata key 'a' claims 2305843009213693952 items")


def test_tensor_data_past_end(tmp_path):
    tis = [TENSORS[0], tinfo("b", [8], T_F32, 64)]
    _bad(tmp_path, build(KVS, tis, DATA), r"tensor 'b' data \(bytes \d+\.\.\d+\) runs past the end")


def test_tensor_data_past_end_without_data(tmp_path):
    _bad(tmp_path, build(KVS, TENSORS, b""), r"tensor 'a' data .* runs past the end")


def test_overlapping_tensors(tmp_path):
    tis = [tinfo("a", [4, 2], T_F32, 0), tinfo("b", [8], T_F32, 0)]
    _bad(tmp_path, build(KVS, tis, DATA), r"tensor '(a|b)' .* overlaps tensor '(a|b)'")


def test_misaligned_tensor_offset(tmp_path):
    tis = [tinfo("a", [4], T_F32, 0), tinfo("b", [4], T_F32, 16)]
    _bad(tmp_path, build(KVS, tis, DATA), r"tensor 'b' has data offset 16, not a multiple of .* 32")


def test_custom_alignment_applies(tmp_path):
    kvs = [*KVS, kv_u32("general.alignment", 64)]
    data = build(kvs, [tinfo("a", [4], T_F32, 0), tinfo("b", [4], T_F32, 32)], DATA, alignment=64)
    _bad(tmp_path, data, r"tensor 'b' has data offset 32, not a multiple of the alignment 64")
    tis = [tinfo("a", [4], T_F32, 0), tinfo("b", [4], T_F32, 64)]
    good = build(kvs, tis, DATA * 5, alignment=64)
    with _open(tmp_path, good, "ok.gguf") as f:
        assert f.alignment == 64 and f.data_offset % 64 == 0
        assert f.tensors["b"].offset == f.data_offset + 64


@pytest.mark.parametrize("dims,match", [
    ([2**32, 2**32], r"element count of dims \[4294967296, 4294967296\] overflows"),
    ([2**62, 4], "overflows"),
    ([1, 1, 1, 1, 1], r"has 5 dimensions \(must be 1\.\.4\)"),
    ([], r"has 0 dimensions"),
    ([4, 0], r"has dimension 1 = 0 \(must be positive\)"),
    ([2**64 - 1], r"has dimension 0 = -1 \(must be positive\)"),
])
def test_bad_dims(tmp_path, dims, match):
    _bad(tmp_path, build(KVS, [tinfo("a", dims, T_F32, 0)], DATA), match)


def test_row_not_a_whole_number_of_blocks(tmp_path):
    # 33 x 32 = 1056 elements is a multiple of 32, but ggml needs whole blocks per row.
    _bad(tmp_path, build(KVS, [tinfo("q", [33, 32], T_Q8_0, 0)], b"\0" * 2048),
         r"tensor 'q' of type Q8_0: row length 33 .* not a multiple of the block size 32")
    _bad(tmp_path, build(KVS, [tinfo("q", [16], T_Q8_0, 0)], b"\0" * 64), "block size 32")


def test_duplicate_key(tmp_path):
    _bad(tmp_path, build([*KVS, kv_u32("llama.block_count", 3)], TENSORS, DATA),
         r"duplicate metadata key 'llama.block_count'")


def test_duplicate_tensor_name(tmp_path):
    tis = [tinfo("a", [4], T_F32, 0), tinfo("a", [4], T_F32, 32)]
    _bad(tmp_path, build(KVS, tis, DATA), r"duplicate tensor name 'a'")


@pytest.mark.parametrize("payload,match", [
    (kv_u32("general.alignment", 0), "general.alignment is 0, not a nonzero power of two"),
    (kv_u32("general.alignment", 48), "general.alignment is 48, not a nonzero power of two"),
    (kv("general.alignment", INT32, u32(2**32 - 64)), "general.alignment is -64"),
    (kv_str("general.alignment", "32"), "general.alignment must be an integer"),
    (kv("general.alignment", FLOAT32, u32(0x42000000)), "general.alignment must be an integer"),
])
def test_bad_alignment(tmp_path, payload, match):
    _bad(tmp_path, build([*KVS, payload], TENSORS, DATA), match)


@pytest.mark.parametrize("t", [4, 5, 31, 1000, 2**32 - 1])
def test_unknown_tensor_type(tmp_path, t):
    data = build(KVS, [tinfo("a", [32], t, 0)], DATA)
    _bad(tmp_path, data, f"tensor 'a' has unknown GGML type {t}")


@pytest.mark.parametrize("vt", [13, 255, 2**32 - 1])
def test_unknown_value_type(tmp_path, vt):
    _bad(tmp_path, build([kv("k", vt, u32(0))], []),
         f"value type of metadata key 'k' is {vt}, not a known GGUF value type")
    _bad(tmp_path, build([kv("k", ARRAY, arr(vt, [u32(0)]))], []),
         f"item type of value of metadata key 'k' is {vt}, not a known")


def test_empty_key(tmp_path):
    _bad(tmp_path, build([kv("", UINT32, u32(1))], []), r"metadata key #0 is empty")


def test_invalid_utf8_key(tmp_path):
    _bad(tmp_path, build([KVS[0], kv(b"bad\xc3(key", UINT32, u32(1))], []),
         r"metadata key #1 is not valid UTF-8: b'bad\\xc3\(key'")


def test_invalid_utf8_and_empty_tensor_name(tmp_path):
    data = build(KVS, [tinfo(b"\xff", [4], T_F32, 0)], DATA)
    _bad(tmp_path, data, r"name of tensor #0 is not valid")
    _bad(tmp_path, build(KVS, [tinfo(b"", [4], T_F32, 0)], DATA), r"name of tensor #0 is empty")


def test_bad_bools(tmp_path):
    _bad(tmp_path, build([kv("b", BOOL, b"\x02")], []), r"'b' is a bool stored as 2")
    _bad(tmp_path, build([kv("b", ARRAY, arr(BOOL, [b"\x01", b"\x07"]))], []),
         r"'b' holds a bool that is not 0 or 1")


def test_deeply_nested_array(tmp_path):
    payload = arr(UINT8, [b"\x01"])
    for _ in range(20):
        payload = arr(ARRAY, [payload])
    _bad(tmp_path, build([kv("n", ARRAY, payload)], []), "nests arrays deeper than 8")


def test_empty_arrays_are_fine(tmp_path):
    kvs = [kv("e8", ARRAY, arr(UINT8, [])), kv("es", ARRAY, arr(STRING, [])),
           kv("en", ARRAY, arr(ARRAY, []))]
    with _open(tmp_path, build(kvs, []), "ok.gguf") as f:
        assert f.metadata["e8"].shape == (0,) and f.metadata["es"] == [] and f.metadata["en"] == []
        assert f.tensors == {}


def test_close_is_idempotent_and_metadata_survives(tmp_path):
    p = tmp_path / "all.gguf"
    _write_all_types(p)
    f = GGUFFile(p)
    scores = f.metadata["a.float32"]
    f.close()
    f.close()
    assert scores.tolist()[0] == 0.5  # the view keeps the mapping alive
    assert os.path.exists(p)


# -- inspect ---------------------------------------------------------------------------------

def test_inspect_report_matches_gguf_py(real_pair):
    from deimos.gguf.inspect import inspect_gguf, inspect_text

    f, r = real_pair
    rep = inspect_gguf(f)
    assert rep.data_offset == r.data_offset and len(rep.tensors) == len(r.tensors)
    by_type: dict[str, list[int]] = {}
    for t in r.tensors:
        acc = by_type.setdefault(t.tensor_type.name, [0, 0, 0])
        acc[0] += 1
        acc[1] += int(t.n_elements)
        acc[2] += int(t.n_bytes)
    assert {t.type: [t.n_tensors, t.n_elements, t.nbytes] for t in rep.totals} == by_type
    assert rep.tensor_bytes == sum(v[2] for v in by_type.values())
    rows = {m.key: m for m in rep.metadata}
    tokens = r.fields["tokenizer.ggml.tokens"]
    tok_row = rows["tokenizer.ggml.tokens"]
    assert tok_row.type == "arr[str]" and tok_row.count == len(tokens.data)
    assert tok_row.value.startswith("[" + ", ".join(repr(tokens.contents(i)) for i in range(3)))
    assert tok_row.value.endswith(", …]") and len(tok_row.value) < 400
    text = inspect_text(rep, width=200)
    for t in r.tensors:
        assert t.name in text


def test_inspect_text_does_not_interpret_markup(tmp_path):
    from deimos.gguf.inspect import inspect_gguf, inspect_text

    p = tmp_path / "m.gguf"
    p.write_bytes(build([kv("tok", ARRAY, arr(STRING, [gstr("[bold]x[/bold]"), gstr("[INST]")])),
                         kv("eps", FLOAT32, u32(0x3727C5AC))], []))  # 1e-05 as float32
    text = inspect_text(inspect_gguf(p), width=200)
    assert "'[bold]x[/bold]'" in text and "'[INST]'" in text and "1e-05" in text
