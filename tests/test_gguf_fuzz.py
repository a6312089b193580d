"""Fuzzing GGUFFile with mutated real-structure files: every open must either succeed with a
self-consistent result or raise GGUFError naming the file. Any other exception, or an open that
takes absurdly long, fails the test. Deterministic (seeded).

The reader alone, two bases: a small file written by gguf-py's GGUFWriter with a
vocabulary-like string array, scores, merges, a nested array, every scalar type and tensors of
several types (thousands of mutations); and the header + metadata + tensor infos of the real SmolLM2 model, extended to the
real file size as a sparse file so no tensor data is copied (about 40 targeted mutations:
its 49k-token vocabulary makes each open ~0.1 s).

The whole load, as ``deimos run`` does it (tools/fuzz_gguf.py, a short seeded round): mutated
synth models and SmolLM2 header through GGUFFile, ModelConfig, the weights, the tokenizer, the
chat template and two generated tokens; every case must run or raise one of the project's
named errors naming the file, within its time and memory limits (the long round:
``python tools/fuzz_gguf.py --cases N --seed S``).
"""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path

import gguf
import numpy as np
import pytest

from deimos.gguf import GGML_BLOCK, GGUFError, GGUFFile
from gguf_support import int_fields
from testdata import REPO, model_path

SEED = 20240601
INTERESTING = [0, 1, 2, 3, 4, 5, 7, 8, 9, 12, 13, 31, 32, 33, 255, 2**16 - 1, 2**31 - 1, 2**31,
               2**32 - 1, 2**32, 2**62, 2**63 - 1, 2**63, 2**64 - 1]
SLOW_OPEN_S = 2.0  # one open of a mutated file; the valid bases open in milliseconds


def _write_base(path: Path) -> None:
    rng = np.random.default_rng(7)
    vocab = ["<unk>", "<s>", "</s>"] + [f"Ġtok{i}" if i % 3 else f"語{i}" for i in range(500)]
    w = gguf.GGUFWriter(str(path), arch="llama")
    w.add_uint32("llama.block_count", 2)
    w.add_float32("llama.rope.freq_base", 10000.0)
    w.add_uint64("t.u64", 2**40)
    w.add_int8("t.i8", -3)
    w.add_uint16("t.u16", 7)
    w.add_int16("t.i16", -7)
    w.add_int64("t.i64", -(2**40))
    w.add_float64("t.f64", 0.25)
    w.add_bool("t.bool", True)
    w.add_uint8("t.u8", 9)
    w.add_int32("t.i32", -9)
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_token_list(vocab)
    w.add_token_scores(rng.standard_normal(len(vocab)).astype(np.float32).tolist())
    w.add_token_types([1] * len(vocab))
    w.add_token_merges([f"Ġ t{i}" for i in range(200)])
    w.add_key_value("t.nested", [[1, 2], [3]], gguf.GGUFValueType.ARRAY,
                    sub_type=gguf.GGUFValueType.ARRAY)
    w.add_key_value("t.bools", [True, False], gguf.GGUFValueType.ARRAY,
                    sub_type=gguf.GGUFValueType.BOOL)
    w.add_tensor("token_embd.weight", rng.standard_normal((8, 16), dtype=np.float32))
    w.add_tensor("norm.weight", rng.standard_normal(16).astype(np.float16))
    w.add_tensor("q8.weight", rng.integers(0, 256, (2, 68), dtype=np.uint8),
                 raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("q4k.weight", rng.integers(0, 256, (1, 144), dtype=np.uint8),
                 raw_dtype=gguf.GGMLQuantizationType.Q4_K)
    w.add_tensor("pos.weight", rng.integers(0, 9, (3,), dtype=np.int32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _check_consistent(f: GGUFFile) -> None:
    """What a successful open promises: tensors inside the file, aligned, disjoint, sized."""
    assert f.version in (2, 3)
    assert f.alignment > 0 and f.alignment & (f.alignment - 1) == 0
    assert f.data_offset % f.alignment == 0
    end = 0
    for t in sorted(f.tensors.values(), key=lambda t: t.offset):
        block, size = GGML_BLOCK[t.ggml_type]
        assert 1 <= len(t.dims) <= 4 and all(d > 0 for d in t.dims)
        assert t.n_elements == int(np.prod(t.dims, dtype=object)) and t.dims[0] % block == 0
        assert t.nbytes == t.n_elements // block * size
        assert t.offset >= max(end, f.data_offset) and (t.offset - f.data_offset) % f.alignment == 0
        assert t.offset + t.nbytes <= f.file_size
        end = t.offset + t.nbytes
        assert f.tensor_bytes(t.name).shape == (t.nbytes,)
    for v in f.metadata.values():
        if isinstance(v, np.ndarray):
            assert not v.flags.writeable


class _Fuzzer:
    def __init__(self, path: Path):
        self.path = path
        self.fh = open(path, "w+b")  # noqa: SIM115 - closed in report()
        self.failures: list[str] = []
        self.n = self.ok = 0
        self.slowest = 0.0

    def run(self, label: str, data: bytes, extend_to: int = 0) -> None:
        # Rewrite one open file in place: truncating to 0 and rewriting (mode "wb") makes ext4
        # flush on every close (auto_da_alloc), which costs more than the parsing.
        fh = self.fh
        fh.seek(0)
        fh.write(data)
        fh.truncate(max(len(data), extend_to))  # growing leaves a sparse hole: no tensor bytes
        fh.flush()
        self.n += 1
        t0 = time.perf_counter()
        try:
            with GGUFFile(self.path) as f:
                _check_consistent(f)
            self.ok += 1
        except GGUFError as e:
            if not str(e).startswith(f"{self.path}: "):
                self.failures.append(f"{label}: message does not name the file: {e}")
        except Exception as e:  # noqa: BLE001 - any other exception is the bug we hunt
            self.failures.append(f"{label}: {type(e).__name__}: {e}")
        dt = time.perf_counter() - t0
        self.slowest = max(self.slowest, dt)
        if dt > SLOW_OPEN_S:
            self.failures.append(f"{label}: open took {dt:.1f} s")

    def report(self) -> None:
        self.fh.close()
        assert not self.failures, (
            f"{len(self.failures)} of {self.n} mutations misbehaved:\n"
            + "\n".join(self.failures[:20])
        )


def _put(data: bytes, off: int, size: int, value: int) -> bytes:
    return data[:off] + (value % 2 ** (8 * size)).to_bytes(size, "little") + data[off + size :]


@pytest.mark.timeout(120)
def test_fuzz_small_real_structure_file(tmp_path):
    base_path = tmp_path / "base.gguf"
    _write_base(base_path)
    base = base_path.read_bytes()
    with GGUFFile(base_path) as f:
        _check_consistent(f)
        meta_end = f.data_offset
        assert len(f.metadata["tokenizer.ggml.tokens"]) == 503 and len(f.tensors) == 5
    rng = random.Random(SEED)
    fz = _Fuzzer(tmp_path / "mut.gguf")

    # Truncation: every cut in the first 600 bytes, then random cuts anywhere.
    for cut in [*range(600), *(rng.randrange(len(base)) for _ in range(400))]:
        fz.run(f"truncate at {cut}", base[:cut])

    # Integer fields (counts, lengths, types, dims, offsets) set to absurd or off-by-one values:
    # every structural field with every interesting value, string lengths sampled.
    fields = int_fields(base)
    structural = [fl for fl in fields if not fl[2].startswith("len value")]
    lengths = [fl for fl in fields if fl[2].startswith("len value")]
    for off, size, label in structural:
        orig = int.from_bytes(base[off : off + size], "little")
        for v in [*INTERESTING, orig - 1, orig + 1, orig * 2, len(base) - off]:
            fz.run(f"{label} @{off} = {v}", _put(base, off, size, v))
    for off, size, label in rng.sample(lengths, 150):
        for v in [rng.choice(INTERESTING), rng.getrandbits(8 * size), rng.randrange(len(base))]:
            fz.run(f"{label} @{off} = {v}", _put(base, off, size, v))

    # Random byte flips, mostly in the header/metadata/tensor infos.
    for i in range(1200):
        data = bytearray(base)
        for _ in range(rng.randint(1, 4)):
            pos = rng.randrange(meta_end if rng.random() < 0.8 else len(base))
            flip = data[pos] ^ (1 << rng.randrange(8))
            data[pos] = rng.randrange(256) if rng.random() < 0.5 else flip
        fz.run(f"flip #{i}", bytes(data))

    # Splices: cut out or duplicate a chunk, shifting everything after it.
    for i in range(200):
        a = rng.randrange(meta_end)
        b = min(len(base), a + rng.randint(1, 64))
        data = base[:a] + base[b:] if i % 2 else base[:b] + base[a:b] + base[b:]
        fz.run(f"splice #{i} [{a}:{b}]", data)

    fz.report()
    assert fz.n > 3000 and 0 < fz.ok < fz.n, (fz.n, fz.ok)  # the fuzz reached both outcomes


@pytest.mark.timeout(120)
def test_fuzz_real_model_header(tmp_path):
    src = model_path("SmolLM2-135M-Instruct.Q4_1.gguf")
    with GGUFFile(src) as f:
        prefix_len, full = f.data_offset, f.file_size
        first_ti = min(t.offset for t in f.tensors.values())
    with open(src, "rb") as fh:
        base = fh.read(prefix_len)
    rng = random.Random(SEED)
    fz = _Fuzzer(tmp_path / "mut.gguf")
    fz.run("unmutated prefix, sparse tail", base, full)
    assert fz.ok == 1 and first_ti == prefix_len

    fields = int_fields(base)
    by_label = {label: (off, size) for off, size, label in fields}
    # The header counts and the big tokenizer arrays' counts and item types.
    targets = [by_label["tensor count"], by_label["kv count"]]
    targets += [(off, size) for off, size, label in fields
                if label.startswith(("count value", "item type value"))]
    for off, size in targets:
        for v in rng.sample(INTERESTING, 2):
            fz.run(f"field @{off} = {v}", _put(base, off, size, v), full)
    # Tensor infos: dims, types and offsets of a few tensors.
    ti_fields = [fl for fl in fields if fl[2].startswith(("dim ", "ggml type", "offset", "n_dims"))]
    for off, size, label in rng.sample(ti_fields, 16):
        v = rng.choice(INTERESTING + [int.from_bytes(base[off : off + size], "little") + 32])
        fz.run(f"{label} @{off} = {v}", _put(base, off, size, v), full)
    # Truncations, in the tensor-info region and before it.
    for cut in rng.sample(range(prefix_len), 6):
        fz.run(f"truncate at {cut}", base[:cut])
    fz.report()


@pytest.mark.timeout(300)
def test_fuzz_whole_model_load(tmp_path):
    sys.path.insert(0, str(REPO / "tools"))
    import fuzz_gguf

    rep = fuzz_gguf.run(cases=150, seed=SEED, work=tmp_path, timeout=60, real_share=0.02)
    bad = "\n".join(f"{res['outcome']}: {label}: {res.get('type', '')} {res.get('msg', '')}"
                    for label, res in rep.bad)
    assert not rep.bad, f"{len(rep.bad)} of 150 cases misbehaved:\n{bad}\n{rep.table()}"
    assert rep.counts["ran"] > 10 and rep.counts["clean"] > 50, rep.table()  # both outcomes reached
