"""Fuzzing a whole model load: mutated GGUF files through everything ``deimos run`` does.

    python tools/fuzz_gguf.py --cases 2000 --seed 1 [--timeout 60] [--keep DIR]

Bases: small valid models written by deimos.synth (llama, qwen2, qwen3, gemma3, qwen3moe and
qwen35 (hybrid) tiny presets;
Q8_0, F16, Q4_0 and a Q4_K_M mix; donors cut from real vocabularies: SentencePiece with byte
tokens, byte-level BPE with merges, chat templates) and the header of the real SmolLM2 file
(its tensor data a sparse hole). Each case mutates a base: metadata values of the
architecture's keys (0, -1 through signed types, 2**31 - 1, 2**64 - 1, NaN/inf, wrong types,
per-layer arrays, removed or added keys), the tokenizer arrays (tokens, scores, token types,
merges, special ids, flags, the chat template), tensors (dropped, renamed, other dims or GGML
type, layers removed or added) and raw bytes of the header. The case then goes through
``deimos.LLM(path, device="cpu")`` (GGUFFile, ModelConfig.from_gguf, load_model, Tokenizer,
chat template) and a chat generation of two tokens with the CLI's default sampling.

Each case runs in a worker process under a watchdog (time and resident memory) and is
counted as: ran (loaded and generated), clean (one of the project's named errors, naming the
file, or for template/context errors the key), unclear (a named error whose message does not
name the file), wrong (any other exception: the bug this hunts), crash (the worker died),
hang (past the timeout), memory (past the memory limit). Exit status 0 when there are no
unclear/wrong/crash/hang/memory cases. Deterministic for a seed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import struct
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from testdata import LLAMA_CPP, data_dir  # noqa: E402

from deimos.gguf import GGUFFile  # noqa: E402
from deimos.gguf.constants import GGML_BLOCK, GGMLType  # noqa: E402

OUTCOMES = ("ran", "clean", "unclear", "wrong", "crash", "hang", "memory")
BAD = ("unclear", "wrong", "crash", "hang", "memory")
MEMORY_EXIT = 86

# ---- a GGUF file as data, and its bytes ------------------------------------------------------

# GGUF value types
U8, I8, U16, I16, U32, I32, F32, BOOL, STR, ARR, U64, I64, F64 = range(13)
_PACK = {U8: "<B", I8: "<b", U16: "<H", I16: "<h", U32: "<I", I32: "<i", F32: "<f", BOOL: "<?",
         U64: "<Q", I64: "<q", F64: "<d"}
_NP = {U8: "<u1", I8: "<i1", U16: "<u2", I16: "<i2", U32: "<u4", I32: "<i4", F32: "<f4",
       BOOL: "<u1", U64: "<u8", I64: "<i8", F64: "<f8"}


@dataclass
class KV:
    key: str
    vtype: int
    value: Any
    item: int | None = None  # item type of an array (nested arrays: ARR, items are KV-less lists)


@dataclass
class Tensor:
    name: str
    dims: tuple[int, ...]
    ggml_type: int
    data: bytes | None  # None: a hole (the bytes are read as zeros)


@dataclass
class Image:
    kvs: list[KV]
    tensors: list[Tensor]
    version: int = 3
    alignment: int = 32
    extend_to: int = 0  # the base's full size for sparse images

    def get(self, key: str) -> KV | None:
        return next((kv for kv in self.kvs if kv.key == key), None)

    def copy(self) -> Image:
        return replace(self, kvs=[replace(kv) for kv in self.kvs],
                       tensors=[replace(t) for t in self.tensors])


def read_image(path: Path, with_data: bool = True) -> Image:
    with GGUFFile(path) as f:
        kvs = []
        for key, value in f.metadata.items():
            types = f.value_types[key]
            kvs.append(KV(key, int(types[0]), value, int(types[1]) if len(types) > 1 else None))
        tensors = [Tensor(t.name, t.dims, int(t.ggml_type),
                          bytes(f.tensor_bytes(t.name)) if with_data else None)
                   for t in f.tensors.values()]
        return Image(kvs, tensors, f.version, f.alignment, 0 if with_data else f.file_size)


def _scalar(vtype: int, value: Any) -> bytes:
    if vtype == STR:
        raw = value if isinstance(value, bytes) else str(value).encode("utf-8", "surrogateescape")
        return struct.pack("<Q", len(raw)) + raw
    if vtype in (F32, F64):
        return struct.pack(_PACK[vtype], float(value))
    if vtype == BOOL:
        return struct.pack("<B", int(value) & 0xFF)
    size = struct.calcsize(_PACK[vtype])
    return (int(value) % 2 ** (8 * size)).to_bytes(size, "little")  # signed: two's complement


def _value(vtype: int, value: Any, item: int | None) -> bytes:
    if vtype != ARR:
        return _scalar(vtype, value)
    assert item is not None
    out = struct.pack("<IQ", item, len(value))
    if item == ARR:
        return out + b"".join(_value(ARR, v, _item_of(v)) for v in value)
    if item == STR:
        return out + b"".join(_scalar(STR, v) for v in value)
    arr = np.asarray(value)
    if arr.dtype.kind == "f" and item not in (F32, F64):
        arr = np.nan_to_num(arr)
    if item in (F32, F64):
        return out + arr.astype(_NP[item]).tobytes()
    return out + np.array([int(v) % 2 ** (8 * np.dtype(_NP[item]).itemsize) for v in arr.tolist()],
                          dtype=np.uint64).astype(_NP[item].replace("i", "u")).tobytes()


def _item_of(v: Any) -> int:
    return STR if v and isinstance(v[0], str) else I32


def serialize(img: Image) -> bytes:
    out = [b"GGUF", struct.pack("<IQQ", img.version, len(img.tensors), len(img.kvs))]
    for kv in img.kvs:
        out += [_scalar(STR, kv.key), struct.pack("<I", kv.vtype), _value(kv.vtype, kv.value, kv.item)]
    offsets, pos = [], 0
    for t in img.tensors:
        offsets.append(pos)
        pos += -(-_nbytes(t) // img.alignment) * img.alignment
    for t, off in zip(img.tensors, offsets):
        out += [_scalar(STR, t.name), struct.pack("<I", len(t.dims)),
                b"".join(struct.pack("<Q", d % 2**64) for d in t.dims), struct.pack("<IQ", t.ggml_type, off)]
    head = b"".join(out)
    head += b"\0" * (-len(head) % img.alignment)
    if img.extend_to:  # sparse: header only, the data section stays a hole
        return head
    body = bytearray()
    for t in img.tensors:
        data = t.data or b""
        body += data[:_nbytes(t)].ljust(_nbytes(t), b"\0")
        body += b"\0" * (-len(body) % img.alignment)
    return head + bytes(body)


def _nbytes(t: Tensor) -> int:
    try:
        block, size = GGML_BLOCK[GGMLType(t.ggml_type)]
    except ValueError:
        return 0
    n = math.prod(t.dims)
    return max(0, n // block * size)


def write_case(img: Image, path: Path) -> None:
    data = serialize(img)
    with open(path, "wb") as fh:
        fh.write(data)
        if img.extend_to:
            need = len(data) + sum(-(-_nbytes(t) // img.alignment) * img.alignment for t in img.tensors)
            # a hole up to the data's end (at most 1 TiB: no disk blocks, but a file system limit)
            fh.truncate(max(len(data), min(need, 1 << 40)))


# ---- bases ------------------------------------------------------------------------------------

VOCAB_SPM = f"{LLAMA_CPP}/models/ggml-vocab-llama-spm.gguf"
VOCAB_GPT2 = f"{LLAMA_CPP}/models/ggml-vocab-gpt-2.gguf"
SMOL = "models/SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA = "models/gemma-3-270m-q4_k_m.gguf"

# (name, synth preset, GGML type or mix, donor, tokens kept)
BASES = (
    ("llama-spm-q8", "llama-tiny", "Q8_0", VOCAB_SPM, 600),
    ("qwen3-smol-f16", "qwen3-tiny", "F16", SMOL, 800),
    ("gemma3-gemma-q8", "gemma3-tiny", "Q8_0", GEMMA, 1000),
    ("qwen2-smol-q4", "qwen2-tiny", "Q4_0", SMOL, 800),
    ("llamak-gpt2-q4km", "llama-tiny-k", "Q4_K_M", VOCAB_GPT2, 700),
    ("qwen3moe-spm-q8", "qwen3moe-tiny", "Q8_0", VOCAB_SPM, 600),
    ("qwen35-spm-q8", "qwen35-tiny", "Q8_0", VOCAB_SPM, 600),
    ("qwen35moe-spm-q8", "qwen35moe-tiny", "Q8_0", VOCAB_SPM, 600),
    ("qwen3next-spm-q8", "qwen3next-tiny", "Q8_0", VOCAB_SPM, 600),
)
REAL = "smollm2-header"


def cut_donor(src: Path, n_keep: int, out: Path) -> Path:
    """A donor vocabulary: the first ``n_keep`` tokens of a real one, the merges whose
    parts and result are all kept, the other tokenizer keys as they are."""
    img = read_image(src, with_data=False)
    tokens = img.get("tokenizer.ggml.tokens").value[:n_keep]
    kept = set(tokens)
    kvs = [KV("general.architecture", STR, "llama")]
    for kv in img.kvs:
        if not kv.key.startswith("tokenizer."):
            continue
        v = kv.value
        if kv.key == "tokenizer.ggml.merges":
            v = [m for m in v if " " in m[1:] and m.replace(" ", "", 1) in kept
                 and all(p in kept for p in m.split(" ", 1))]
        elif kv.vtype == ARR and len(v) == len(img.get("tokenizer.ggml.tokens").value):
            v = v[:n_keep]
        elif kv.key.endswith("_token_id") and not 0 <= v < n_keep:
            continue  # a special token cut away: the tokenizer model's default applies
        kvs.append(replace(kv, value=v))
    write_case(Image(kvs, []), out)
    return out


def build_bases(work: Path, with_real: bool = True) -> dict[str, Image]:
    from deimos.synth import write_model

    bases = {}
    for name, preset, gtype, donor, n_keep in BASES:
        path = work / f"{name}.gguf"
        if not path.exists():
            d = cut_donor(data_dir() / donor, n_keep, work / f"{name}.donor.gguf")
            write_model(path, preset.split("-")[0], preset, gtype, d, seed=1, workers=1)
        bases[name] = read_image(path)
    if with_real:
        bases[REAL] = read_image(data_dir() / SMOL, with_data=False)
    return bases


# ---- mutations --------------------------------------------------------------------------------

ARCH_KEYS = ("context_length", "embedding_length", "block_count", "feed_forward_length",
             "attention.head_count", "attention.head_count_kv", "attention.key_length",
             "attention.value_length", "attention.layer_norm_rms_epsilon", "rope.freq_base",
             "rope.dimension_count", "rope.scaling.type", "rope.scaling.factor", "attention.scale",
             "attention.sliding_window", "attention.sliding_window_pattern", "rope.freq_base_swa",
             "final_logit_softcapping", "vocab_size")
TOK_KEYS = ("tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
            "tokenizer.ggml.unknown_token_id", "tokenizer.ggml.padding_token_id",
            "tokenizer.ggml.eot_token_id", "tokenizer.ggml.add_bos_token",
            "tokenizer.ggml.add_eos_token", "tokenizer.ggml.add_space_prefix",
            "tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.chat_template")
INTS = (0, 1, 2, 3, -1, -2, 7, 31, 33, 64, 255, 4096, 2**16 - 1, 2**31 - 1, 2**31, 2**32 - 1, 2**32,
        2**63 - 1, 2**64 - 1, -(2**31), -(2**63))
FLOATS = (0.0, -0.0, 1.0, -1.0, 1e-45, 1e38, 3.4e38, -3.4e38, float("nan"), float("inf"),
          float("-inf"), 1e-12, 0.5)
INT_TYPES = (U8, I8, U16, I16, U32, I32, U64, I64)
TEMPLATES = ("{{ messages[0]['content'] }}", "{% for m in messages %}{{ m.content }}{% endfor %}",
             "{{ raise_exception('no') }}", "{% if %}", "{{ x.y.z }}", "{{ (messages|length) / 0 }}",
             "{% for i in range(10**9) %}{% endfor %}", "", "{{ '<|im_end|>' * 3 }}")


def _some_value(rng: random.Random, orig: Any) -> tuple[int, Any, int | None]:
    """(value type, value, item type) of a replacement value."""
    r = rng.random()
    if isinstance(orig, int) and not isinstance(orig, bool) and r < 0.25:
        return rng.choice((U32, I32, U64)), rng.choice((orig - 1, orig + 1, orig * 2, orig // 2, orig * 1000)), None
    if r < 0.55:
        return rng.choice(INT_TYPES), rng.choice(INTS), None
    if r < 0.75:
        return rng.choice((F32, F64)), rng.choice(FLOATS), None
    if r < 0.8:
        return BOOL, rng.random() < 0.5, None
    if r < 0.87:
        return STR, rng.choice(("", "linear", "yarn", "12", "nan", "\udcff")), None
    n = rng.choice((0, 1, 2, 6, 100))
    item = rng.choice((U32, I32, F32, STR, BOOL))
    vals = [rng.choice(INTS) if item != STR else "x" for _ in range(n)]
    if item == F32:
        vals = [rng.choice(FLOATS) for _ in range(n)]
    return ARR, vals, item


def _set(img: Image, key: str, vtype: int, value: Any, item: int | None = None) -> None:
    kv = img.get(key)
    if kv is None:
        img.kvs.append(KV(key, vtype, value, item))
    else:
        kv.vtype, kv.value, kv.item = vtype, value, item


def _arch(img: Image) -> str:
    kv = img.get("general.architecture")
    return kv.value if kv and isinstance(kv.value, str) else "llama"


def _n_layer(img: Image) -> int:
    kv = img.get(f"{_arch(img)}.block_count")
    return kv.value if kv and isinstance(kv.value, int) and 0 < kv.value < 64 else 2


def m_arch_value(img: Image, rng: random.Random) -> str:
    key = f"{_arch(img)}.{rng.choice(ARCH_KEYS)}"
    kv = img.get(key)
    vtype, value, item = _some_value(rng, kv.value if kv else 0)
    _set(img, key, vtype, value, item)
    return f"{key} = {value!r:.40} ({vtype})"


def m_arch_delete(img: Image, rng: random.Random) -> str:
    key = f"{_arch(img)}.{rng.choice(ARCH_KEYS)}"
    img.kvs = [kv for kv in img.kvs if kv.key != key]
    return f"del {key}"


def m_per_layer(img: Image, rng: random.Random) -> str:
    keys = ("attention.head_count", "attention.head_count_kv", "feed_forward_length",
            "attention.sliding_window_pattern")
    key = f"{_arch(img)}.{rng.choice(keys)}"
    kv = img.get(key)
    base = kv.value if kv and isinstance(kv.value, int) else 2
    n = _n_layer(img) + rng.choice((0, 0, 0, -1, 1))
    vals = [base] * max(n, 0)
    if vals and rng.random() < 0.4:
        vals[rng.randrange(len(vals))] = rng.choice(INTS)
    _set(img, key, ARR, vals, rng.choice((U32, I32, U8, BOOL)))
    return f"{key} = per-layer {vals[:6]}"


def m_architecture(img: Image, rng: random.Random) -> str:
    old = _arch(img)
    new = rng.choice(("llama", "qwen2", "qwen3", "gemma3", "gpt2", "", "qwen3moe"))
    if rng.random() < 0.1:
        _set(img, "general.architecture", U32, 7)
        return "general.architecture = 7"
    _set(img, "general.architecture", STR, new)
    for kv in img.kvs:
        if kv.key.startswith(old + "."):
            kv.key = new + kv.key[len(old):]
    return f"architecture {old} -> {new}"


def m_tok_scalar(img: Image, rng: random.Random) -> str:
    key = rng.choice(TOK_KEYS)
    n = len(_tokens(img))
    if key == "tokenizer.chat_template":
        _set(img, key, STR, rng.choice(TEMPLATES))
    elif key in ("tokenizer.ggml.model", "tokenizer.ggml.pre"):
        _set(img, key, STR, rng.choice(("llama", "gpt2", "gemma4", "bert", "qwen2", "smollm", "", "default")))
    elif rng.random() < 0.5:
        _set(img, key, rng.choice((U32, I32)), rng.choice((n - 1, n, n + 1, -1, 0, 2**31 - 1)))
    else:
        vtype, value, item = _some_value(rng, 0)
        _set(img, key, vtype, value, item)
    kv = img.get(key)
    return f"{key} = {kv.value!r:.40}"


def _tokens(img: Image) -> list:
    kv = img.get("tokenizer.ggml.tokens")
    return kv.value if kv and isinstance(kv.value, list) else []


def m_tok_array(img: Image, rng: random.Random) -> str:
    toks = _tokens(img)
    n = len(toks)
    what = rng.choice(("tokens", "scores", "token_type", "merges", "byte", "dup", "empty", "item"))
    key = f"tokenizer.ggml.{ 'tokens' if what in ('dup', 'empty') else what}"
    if what == "byte":  # a BYTE-type token whose text is not <0xNN>
        tt = img.get("tokenizer.ggml.token_type")
        if tt is None or not n:
            return "no token_type"
        arr = np.array(tt.value, dtype=np.int64)
        if not len(arr):
            return "empty token_type"
        i = rng.randrange(min(n, len(arr)))
        arr[i] = 6
        tt.value = arr
        return f"token {i} {toks[i]!r:.20} typed BYTE"
    kv = img.get(key)
    if kv is None:
        return f"no {key}"
    v = list(kv.value) if not isinstance(kv.value, np.ndarray) else kv.value.tolist()
    if what == "dup" and n > 2:
        v[rng.randrange(n)] = v[rng.randrange(n)]
    elif what == "empty" and n:
        v[rng.randrange(n)] = ""
    elif what == "item":
        kv.item = rng.choice((U32, I32, F32, STR, U8))
        if kv.item == STR:
            v = [str(x) for x in v]
        elif not v or isinstance(v[0], str):
            v = list(range(len(v)))
    else:
        r = rng.random()
        if r < 0.3:
            v = v[: rng.randrange(len(v) + 1)]
        elif r < 0.45:
            v = v + v[: rng.randrange(1, 50)]
        elif v:
            i = rng.randrange(len(v))
            if isinstance(v[i], str):
                v[i] = rng.choice(("", " ", "a", "a b c", "Ġ", "\udcff", "<0x0A>", "<0xZZ>", v[i] + " x"))
            elif isinstance(v[i], float):
                v[i] = rng.choice(FLOATS)
            else:
                v[i] = rng.choice(INTS)
    kv.value = v
    return f"{key}: {what}"


def m_tensor(img: Image, rng: random.Random) -> str:
    if not img.tensors:
        return "no tensors"
    t = rng.choice(img.tensors)
    r = rng.random()
    if r < 0.2:
        img.tensors.remove(t)
        return f"drop {t.name}"
    if r < 0.3:
        old, t.name = t.name, rng.choice((
            "blk.99.attn_q.weight", "blk.2147483647.x", t.name.replace("blk.0.", "blk.1."),
            t.name + ".x", "output.weight", "rope_freqs.weight"))
        if sum(x.name == t.name for x in img.tensors) > 1:
            t.name = old
        return f"rename {old} -> {t.name}"
    if r < 0.55:
        old = t.dims
        block = GGML_BLOCK[GGMLType(t.ggml_type)][0]
        dims = list(t.dims)
        i = rng.randrange(len(dims))
        c = rng.random()
        if c < 0.3 and len(dims) > 1:
            dims.reverse()
        elif c < 0.5:
            dims[i] = dims[i] + (block if i == 0 else 1) * rng.choice((1, -1))
        elif c < 0.6:
            dims.append(1)
        elif c < 0.7 and len(dims) > 1:
            dims = [math.prod(dims)]
        else:
            dims[i] = rng.choice((block, block * 2, dims[i] * 2, dims[i] // 2 or 1))
        t.dims = tuple(max(d, 1) for d in dims)
        if t.data is not None:
            grow = min(256, max(0, _nbytes(t) - len(t.data)))
            t.data = t.data + bytes(rng.getrandbits(8) for _ in range(grow))
        return f"{t.name} dims {old} -> {t.dims}"
    if r < 0.75:
        old = GGMLType(t.ggml_type).name
        choices = [g for g in GGMLType if t.dims[0] % GGML_BLOCK[g][0] == 0]
        t.ggml_type = int(rng.choice(choices))
        return f"{t.name} type {old} -> {GGMLType(t.ggml_type).name}"
    if r < 0.9 and t.data is not None:
        data = bytearray(t.data)
        for _ in range(rng.randint(1, 16)):
            data[rng.randrange(len(data))] = rng.choice((0xFF, 0x7F, 0x7C, 0x00, rng.getrandbits(8)))
        t.data = bytes(data)
        return f"{t.name} data bytes"
    layer = rng.choice(("blk.0.", f"blk.{_n_layer(img) - 1}."))
    if rng.random() < 0.5:
        img.tensors = [x for x in img.tensors if not x.name.startswith(layer)]
        return f"drop layer {layer}"
    extra = [replace(x, name=x.name.replace(layer, f"blk.{_n_layer(img)}.")) for x in img.tensors
             if x.name.startswith(layer)]
    img.tensors += extra
    return f"duplicate layer {layer}"


def m_heads(img: Image, rng: random.Random) -> str:
    """Head counts and sizes changed together so that the q/k/v shapes still match: the
    file loads, and runs with unusual head layouts (1 head, GQA ratios, wide heads, short
    rotary parts)."""
    a = _arch(img)
    q = next((t for t in img.tensors if t.name == "blk.0.attn_q.weight"), None)
    k = next((t for t in img.tensors if t.name == "blk.0.attn_k.weight"), None)
    if q is None or k is None:
        return "no attn_q"
    q_rows, k_rows = q.dims[1], k.dims[1]
    dims = [d for d in (2, 4, 8, 16, 32, 64, 128, 256) if q_rows % d == 0 and k_rows % d == 0
            and (q_rows // d) % (k_rows // d) == 0]
    if not dims:
        return "no head layout"
    hd = rng.choice(dims)
    _set(img, f"{a}.attention.head_count", U32, q_rows // hd)
    _set(img, f"{a}.attention.head_count_kv", U32, k_rows // hd)
    _set(img, f"{a}.attention.key_length", U32, hd)
    _set(img, f"{a}.attention.value_length", U32, hd)
    rd = rng.choice([d for d in (2, hd // 2, hd) if d % 2 == 0])
    _set(img, f"{a}.rope.dimension_count", U32, rd)
    return f"heads {q_rows // hd}/{k_rows // hd} x {hd}, rope {rd}"


def m_small(img: Image, rng: random.Random) -> str:
    """Small but valid sizes: a context shorter than the prompt, a window of 1 or 2 tokens,
    extreme but finite floats."""
    a = _arch(img)
    key, vtype, value = rng.choice((
        ("context_length", U32, rng.choice((1, 2, 8, 60, 64))),
        ("attention.sliding_window", U32, rng.choice((1, 2, 3))),
        ("attention.sliding_window_pattern", U32, rng.choice((0, 1, 2, 1000))),
        ("attention.scale", F32, rng.choice((1e-30, 1e30, 3e38))),
        ("final_logit_softcapping", F32, rng.choice((1e-30, 1e-3, 1e30))),
        ("rope.freq_base", F32, rng.choice((1e-30, 1.0, 3e38))),
        ("attention.layer_norm_rms_epsilon", F32, rng.choice((1e-45, 1e30))),
        ("rope.scaling.factor", F32, rng.choice((1e-30, 1e30, 0.5)))))
    _set(img, f"{a}.{key}", vtype, value)
    return f"{a}.{key} = {value!r}"


def m_pretokenizer(img: Image, rng: random.Random) -> str:
    from deimos.tokenizer import PRE_TOKENIZERS

    name = rng.choice(sorted(PRE_TOKENIZERS))
    _set(img, "tokenizer.ggml.pre", STR, name)
    return f"tokenizer.ggml.pre = {name}"


def m_scale_ffn(img: Image, rng: random.Random) -> str:
    """feed_forward_length and the ffn tensors scaled together (consistent): on the sparse
    base a model far too big for any machine's memory (x4096: 1.3 TB as float32; x65536: a
    file past the 1 TiB hole), on the others a wider MLP of zero weights. (A big model that
    does fit would load until the worker's memory watchdog: not a fault, so not drawn.)"""
    a = _arch(img)
    k = rng.choice((4096, 65536)) if img.extend_to else 2
    kv = img.get(f"{a}.feed_forward_length")
    if kv is None or not isinstance(kv.value, int):
        return "no feed_forward_length"
    n_ff = kv.value
    _set(img, f"{a}.feed_forward_length", U32, n_ff * k)
    for t in img.tensors:
        if t.name.endswith(("ffn_gate.weight", "ffn_up.weight")):
            t.dims = (t.dims[0], n_ff * k)
        elif t.name.endswith("ffn_down.weight"):
            t.dims = (n_ff * k, t.dims[1])
    return f"ffn x{k}"


def m_shrink_vocab(img: Image, rng: random.Random) -> str:
    """The vocabulary cut to its first m tokens with the embedding and output rows: consistent
    shapes, but special ids, byte tokens and merges may point past the end."""
    n = len(_tokens(img))
    if not n:
        return "no tokens"
    m = rng.choice((1, 2, 3, 5, 17, 100, max(1, n // 2), n - 1))
    for kv in img.kvs:
        if kv.key in ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type"):
            kv.value = kv.value[:m]
    for t in img.tensors:
        if t.name in ("token_embd.weight", "output.weight") and len(t.dims) == 2:
            t.dims = (t.dims[0], m)
            if t.data is not None:
                t.data = t.data[:_nbytes(t)]
    return f"vocab cut to {m} of {n}"


def m_token_types(img: Image, rng: random.Random) -> str:
    """Token types changed in place (control, user-defined, unused, unknown values)."""
    tt = img.get("tokenizer.ggml.token_type")
    toks = _tokens(img)
    if tt is None or not toks or not isinstance(tt.value, np.ndarray):
        return "no token_type"
    arr = np.array(tt.value, dtype=np.int64)
    for _ in range(rng.choice((1, 5, 50)) if len(arr) else 0):
        arr[rng.randrange(min(len(toks), len(arr)))] = rng.choice((0, 1, 2, 3, 4, 5, 7, 99, -1))
    tt.value = arr
    return "token types"


MUTATIONS = ((m_arch_value, 30), (m_arch_delete, 6), (m_per_layer, 6), (m_architecture, 3),
             (m_tok_scalar, 12), (m_tok_array, 12), (m_tensor, 22), (m_heads, 6), (m_small, 8),
             (m_pretokenizer, 4), (m_scale_ffn, 3), (m_shrink_vocab, 5), (m_token_types, 5))


def make_case(bases: dict[str, Image], seed: int, index: int,
              real_share: float) -> tuple[str, Image, bytes | None]:
    """Case ``index`` of a run: (label, image, raw bytes when a byte-level mutation applies)."""
    rng = random.Random(f"{seed}:{index}")
    names = [n for n in bases if n != REAL]
    name = REAL if REAL in bases and rng.random() < real_share else rng.choice(names)
    img = bases[name].copy()
    labels = []
    funcs, weights = zip(*MUTATIONS)
    for _ in range(rng.choice((1, 1, 1, 2, 3))):
        labels.append(rng.choices(funcs, weights)[0](img, rng))
    raw = None
    if rng.random() < 0.05:
        data = bytearray(serialize(img))
        head = len(data) if img.extend_to else min(len(data), 4096)
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(head)] = rng.getrandbits(8)
        raw = bytes(data)
        labels.append("byte flips")
    return f"{name}: " + "; ".join(labels), img, raw


# ---- the worker: one case at a time ------------------------------------------------------------


def _worker(mem_limit: int) -> int:
    """Reads case paths from stdin; writes one JSON result line per case to the protocol fd."""
    import logging
    import threading

    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything printed goes to stderr, not into the protocol
    logging.basicConfig(level=logging.CRITICAL)

    def watch() -> None:
        page = os.sysconf("SC_PAGE_SIZE")
        while True:
            with open("/proc/self/statm") as fh:
                rss = int(fh.read().split()[1]) * page
            if rss > mem_limit:
                os._exit(MEMORY_EXIT)
            time.sleep(0.01)

    threading.Thread(target=watch, daemon=True).start()
    import torch

    torch.set_num_threads(1)
    from deimos.engine import LLM
    from deimos.gguf import GGUFError
    from deimos.kernels.sampling import SamplingParams
    from deimos.models import ConfigError, MemoryBudgetError, WeightError
    from deimos.quant import QuantError
    from deimos.engine.request import EngineError, RequestError
    from deimos.runtime.kv_cache import ContextFullError
    from deimos.tokenizer import VocabError
    from deimos.tokenizer.template import TemplateError

    named_file = (GGUFError, ConfigError, WeightError, QuantError, VocabError, MemoryBudgetError)
    # errors of a request or of the run, not of the file: they name the key or the fault
    # (EngineError: NaN logits from weights that hold NaN/inf)
    named_other = (TemplateError, ContextFullError, RequestError, EngineError)
    sampling = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, seed=0)  # the CLI's
    print(json.dumps({"ready": True}), file=proto)
    for line in sys.stdin:
        path = line.strip()
        t0 = time.perf_counter()
        try:
            llm = LLM(path, device="cpu")
            text = "".join(llm.stream("hi", max_tokens=2, sampling=sampling))
            res = {"outcome": "ran", "msg": repr(text[:40])}
        except named_file as e:
            res = {"outcome": "clean" if path in str(e) else "unclear", "type": type(e).__name__,
                   "msg": str(e)}
        except named_other as e:
            res = {"outcome": "clean", "type": type(e).__name__, "msg": str(e)}
        except Exception as e:  # noqa: BLE001 - anything else is what the fuzz hunts
            import traceback

            res = {"outcome": "wrong", "type": type(e).__name__, "msg": str(e)[:300],
                   "where": traceback.format_exc()[-1500:]}
        res["seconds"] = round(time.perf_counter() - t0, 3)
        llm = None
        print(json.dumps(res), file=proto)
    return 0


class Worker:
    def __init__(self, mem_limit: int, log):
        self.mem_limit, self.log = mem_limit, log
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--worker", "--mem-limit", str(self.mem_limit)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True, cwd=REPO)
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("fuzz worker failed to start (see its log)")

    def stop(self) -> None:
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
            self.proc.wait()
            self.proc = None

    def run(self, path: Path, timeout: float) -> dict:
        import selectors

        if self.proc is None:
            self.start()
        p = self.proc
        p.stdin.write(f"{path}\n")
        p.stdin.flush()
        sel = selectors.DefaultSelector()
        sel.register(p.stdout, selectors.EVENT_READ)
        ready = sel.select(timeout)
        sel.close()
        if not ready:
            self.stop()
            return {"outcome": "hang", "msg": f"no answer in {timeout} s"}
        line = p.stdout.readline()
        if not line:
            code = p.wait()
            self.proc = None
            if code == MEMORY_EXIT:
                return {"outcome": "memory", "msg": f"resident memory past {self.mem_limit >> 20} MiB"}
            return {"outcome": "crash", "msg": f"worker exit status {code}"}
        return json.loads(line)


@dataclass
class Report:
    counts: Counter = field(default_factory=Counter)
    bad: list[tuple[str, dict]] = field(default_factory=list)
    errors: Counter = field(default_factory=Counter)
    seconds: float = 0.0

    def table(self) -> str:
        n = sum(self.counts.values())
        rows = [f"{'cases tried':<14}{n:>8}"] + [f"{o:<14}{self.counts[o]:>8}" for o in OUTCOMES]
        return "\n".join(rows)


def run(cases: int, seed: int, work: Path, timeout: float = 60.0, mem_limit: int = 3 << 30,
        real_share: float = 0.03, keep: Path | None = None, verbose: bool = False) -> Report:
    bases = build_bases(work, with_real=real_share > 0)
    rep = Report()
    t0 = time.perf_counter()
    with open(work / "worker.log", "w") as log:
        worker = Worker(mem_limit, log)
        try:
            for i in range(cases):
                label, img, raw = make_case(bases, seed, i, real_share)
                path = work / "case.gguf"
                if raw is not None:
                    path.write_bytes(raw)
                else:
                    write_case(img, path)
                res = worker.run(path, timeout)
                rep.counts[res["outcome"]] += 1
                if res["outcome"] in ("clean", "unclear"):
                    rep.errors[res.get("type", "?")] += 1
                if res["outcome"] in BAD:
                    rep.bad.append((f"#{i} {label}", res))
                    if keep is not None:
                        keep.mkdir(parents=True, exist_ok=True)
                        (keep / f"case-{seed}-{i}.gguf").write_bytes(path.read_bytes())
                if verbose:
                    print(f"#{i} {res['outcome']:<7} {label} | {res.get('type', '')} "
                          f"{res.get('msg', '')[:160]}")
        finally:
            worker.stop()
    rep.seconds = time.perf_counter() - t0
    return rep


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", type=int, default=500)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds a case may take")
    ap.add_argument("--mem-limit", type=int, default=3 << 30, help="worker resident bytes")
    ap.add_argument("--real-share", type=float, default=0.03,
                    help="share of cases on the real SmolLM2 header (each loads 135M weights)")
    ap.add_argument("--work", type=Path, default=None, help="bases and the case file (default: temp)")
    ap.add_argument("--keep", type=Path, default=None, help="save the files of bad cases here")
    ap.add_argument("-v", "--verbose", action="store_true", help="one line per case")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return _worker(args.mem_limit)
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        rep = run(args.cases, args.seed, work, args.timeout, args.mem_limit, args.real_share,
                  args.keep, args.verbose)
    for label, res in rep.bad:
        print(f"{res['outcome'].upper()}: {label}\n    {res.get('type', '')}: {res.get('msg', '')}")
        if "where" in res:
            print("    " + res["where"].strip().replace("\n", "\n    "))
    print(f"\nseed {args.seed}, {rep.seconds:.0f} s\n{rep.table()}")
    print("clean errors by type: " + ", ".join(f"{k} {v}" for k, v in rep.errors.most_common()))
    return 1 if rep.bad else 0


if __name__ == "__main__":
    sys.exit(main())
