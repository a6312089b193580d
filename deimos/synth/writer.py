"""Writes random-weight GGUF files of real architectures (test and benchmark models).

The file is a function of (preset, GGML type, donor tokenizer, seed) only: each tensor draws
from its own generator seeded by (seed, crc32(name)), so the bytes do not depend on the order
or the set of the other tensors, and a test can regenerate a file and compare its sha256.

Weight scales: the matrices are ``deimos.quant`` random blocks (values within about +-0.1);
a norm gain is a constant times (1 + N(0, 0.1^2)). Chosen by measuring llama.cpp's greedy runs
on the tiny presets:
- final norm gain OUTPUT_GAIN = 16: the normed hidden state has rms ~16, so the logits spread
  over many units and the next-token distribution is peaked (top-2 gap > 0.1 in ~95% of
  steps), which makes greedy tokens a stable comparison between implementations;
- hidden-state norm gains NORM_GAIN = 4: with gain 1 the layers add little to the residual
  stream, and with tied embeddings the logit of the input token itself then dominates, so
  greedy decoding repeats one token (90% of steps for qwen3-tiny); with 4 it rarely does;
- q/k norm gains 1: attention scores of order 1, neither uniform nor one-hot.
Biases are N(0, 0.2^2); the MoE router weight (F32) is a random F32 matrix like the others.

Writing streams: tensors are cut into chunks of ``CHUNK_ELEMENTS``, drawn by a thread pool
(numpy releases the GIL in the bulk operations) with a bounded number in flight and written
in file order, so memory stays at a few chunks whatever the model size. Chunk k > 0 of a tensor
draws from its own generator seeded by (seed, crc32(name), k); chunk 0, and so any tensor of
one chunk, from (seed, crc32(name)) as above.
"""

from __future__ import annotations

import os
import zlib
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter

from deimos.gguf import GGUFFile
from deimos.gguf.constants import GGMLType
from deimos.quant import get_format
from deimos.synth.arch import Kind, TensorSpec, arch_metadata, tensor_specs
from deimos.synth.mix import WeightTypes, weight_types
from deimos.synth.presets import SynthPreset, get_preset

OUTPUT_GAIN = 16.0
NORM_GAIN = 4.0
NORM_NOISE = 0.1
BIAS_STD = 0.2

# Elements per independently drawn chunk. Part of the file's definition (the bytes of a bigger
# tensor depend on it); larger than every tensor of the tiny presets with their reference
# donors (qwen2-tiny's embedding: 128 x 151936 = 19.4M), whose files llama.cpp checked.
CHUNK_ELEMENTS = 1 << 25

_SCALAR = {"u32": GGUFValueType.UINT32, "f32": GGUFValueType.FLOAT32}
_ARRAY = {"i32[]": GGUFValueType.INT32}  # qwen35's rope.dimension_sections


def write_model(
    path: str | os.PathLike[str],
    arch: str,
    preset: str | SynthPreset,
    ggml_type: GGMLType | str | int | WeightTypes,
    vocab_from: str | os.PathLike[str],
    seed: int = 0,
    *,
    workers: int | None = None,
    data: bool = True,
    chat_template: str | None = None,
) -> Path:
    """Writes a random-weight model of ``preset`` (its arch must be ``arch``) to ``path``.

    ``ggml_type``: a llama.cpp mix name (Q4_K_M, Q8_0, IQ4_XS, ...: the per-tensor types that
    llama-quantize would choose, see mix.py), a GGML type name or value (every 2-D weight that
    type; its block size must divide the rows), or a ``WeightTypes``. Norms, biases and the MoE
    router are F32. ``vocab_from``: a GGUF whose ``tokenizer.*`` keys are copied; the vocabulary
    size is its token count. ``workers``: drawing threads (default: the CPU count). ``data``
    False: the tensor data is left a hole of the right size (a sparse file of zeros, written in
    no time: for tools that read only the tensor table, as llama-quantize --dry-run).
    ``chat_template``: the file's ``tokenizer.chat_template`` (Jinja source) in place of the
    donor's (a vocabulary donor has none: without one, engines fall back to their own
    defaults, which differ). Returns the path; a partly written file is removed on error.
    """
    p = get_preset(preset) if isinstance(preset, str) else preset
    if p.arch != arch:
        raise ValueError(f"preset {p.name!r} is a {p.arch} model, not {arch}")
    wt = ggml_type if isinstance(ggml_type, WeightTypes) else weight_types(ggml_type)
    tokenizer = read_tokenizer(vocab_from)
    if chat_template is not None:
        tokenizer["tokenizer.chat_template"] = (GGUFValueType.STRING, None,
                                                writable_value(chat_template))
    n_vocab = len(tokenizer["tokenizer.ggml.tokens"][2])
    specs = tensor_specs(p, n_vocab)
    types = wt.tensor_types(p, specs)

    path = Path(path)
    w = GGUFWriter(path, arch)
    try:
        w.add_type("model")
        w.add_name(f"deimos-synth {p.name} {wt.name} seed {seed}")
        if wt.is_mix:
            w.add_file_type(wt.ftype)
        if any(t not in (GGMLType.F32, GGMLType.F16, GGMLType.BF16) for t in types):
            w.add_quantization_version(2)
        for suffix, t, value in arch_metadata(p, n_vocab):
            if t in _ARRAY:
                w.add_key_value(f"{arch}.{suffix}", value, GGUFValueType.ARRAY, sub_type=_ARRAY[t])
            else:
                w.add_key_value(f"{arch}.{suffix}", value, _SCALAR[t])
        for key, (vtype, sub, value) in tokenizer.items():
            w.add_key_value(key, value, vtype, sub_type=sub)
        for s, t in zip(specs, types):
            w.add_tensor_info(s.name, tuple(reversed(s.dims)), np.dtype(np.float32), _nbytes(s, t),
                              raw_dtype=GGMLQuantizationType(int(t)))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        align = w.data_alignment
    finally:
        w.close()
    try:
        with open(path, "ab") as f:
            _pad(f, align)
            if not data:
                sizes = (_nbytes(s, t) for s, t in zip(specs, types))
                f.truncate(f.tell() + sum(n + -n % align for n in sizes))
                return path
            for chunk in _drawn(_chunk_jobs(specs, types, seed), workers):
                if chunk is None:  # end of a tensor
                    _pad(f, align)
                else:
                    f.write(chunk.data)
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    return path


def planned_size(p: SynthPreset, wt: WeightTypes, n_vocab: int) -> tuple[int, int]:
    """(parameters, tensor bytes) of preset ``p`` written with ``wt`` and ``n_vocab`` tokens."""
    specs = tensor_specs(p, n_vocab)
    n_params = n_bytes = 0
    for s, t in zip(specs, wt.tensor_types(p, specs)):
        fmt, n = get_format(t), int(np.prod(s.dims))
        n_params += n
        n_bytes += n // fmt.block_size * fmt.type_size
    return n_params, n_bytes


def tensor_bytes(s: TensorSpec, t: GGMLType, seed: int) -> np.ndarray:
    """All bytes of one tensor as ``write_model`` writes them (uint8; for tests and tools)."""
    return np.concatenate([job() for job in _tensor_jobs(s, t, seed)])


def read_tokenizer(donor: str | os.PathLike[str]) -> dict[str, tuple]:
    """The donor's ``tokenizer.*`` keys as {key: (value type, item type or None, value)},
    in the form GGUFWriter packs back to the same bytes."""
    with GGUFFile(donor) as f:
        out: dict[str, tuple] = {}
        for key, value in f.metadata.items():
            if not key.startswith("tokenizer."):
                continue
            types = f.value_types[key]
            sub = types[1] if len(types) > 1 else None
            if sub is not None and len(value) == 0:
                continue  # GGUFWriter cannot write an empty array; llama.cpp treats it as absent
            out[key] = (GGUFValueType(int(types[0])),
                        None if sub is None else GGUFValueType(int(sub)), writable_value(value))
        if "tokenizer.ggml.tokens" not in out:
            raise ValueError(f"{donor}: no tokenizer.ggml.tokens, not a usable vocabulary donor")
        return out


def writable_value(value: object) -> object:
    # The reader decodes strings with surrogateescape (GGUF does not promise valid UTF-8);
    # bytes make GGUFWriter write them back unchanged. Numeric arrays come as numpy arrays,
    # which GGUFWriter does not take as a sequence.
    if isinstance(value, str):
        return value.encode("utf-8", "surrogateescape")
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, list):
        return [writable_value(v) for v in value]
    return value


def _nbytes(s: TensorSpec, t: GGMLType) -> int:
    fmt = get_format(t)
    return int(np.prod(s.dims)) // fmt.block_size * fmt.type_size


def _pad(f, align: int) -> None:
    f.write(b"\0" * (-f.tell() % align))


def _chunk_jobs(specs: list[TensorSpec], types: list[GGMLType], seed: int) -> Iterator:
    """Draw jobs in file order; ``None`` marks the end of each tensor."""
    for s, t in zip(specs, types):
        yield from _tensor_jobs(s, t, seed)
        yield None


def _drawn(jobs: Iterator, workers: int | None) -> Iterator[np.ndarray | None]:
    """Runs the jobs on a thread pool, at most ``2 * workers`` in flight; results in order."""
    workers = workers or os.cpu_count() or 1
    with ThreadPoolExecutor(workers, thread_name_prefix="synth") as pool:
        pending: deque[Future | None] = deque()
        for job in jobs:
            pending.append(None if job is None else pool.submit(job))
            while len(pending) > 2 * workers or (pending and pending[0] is None):
                head = pending.popleft()
                yield None if head is None else head.result()
        for head in pending:
            yield None if head is None else head.result()


def _tensor_jobs(s: TensorSpec, t: GGMLType, seed: int) -> list:
    name_crc = zlib.crc32(s.name.encode())
    n = int(np.prod(s.dims))
    if s.kind not in (Kind.MATRIX, Kind.ROUTER):
        return [lambda: _vector_bytes(s.kind, n, np.random.default_rng([seed, name_crc]))]
    fmt = get_format(t)
    n_blocks = n // fmt.block_size
    per_chunk = CHUNK_ELEMENTS // fmt.block_size
    jobs = []
    for k, first in enumerate(range(0, n_blocks, per_chunk)):
        key = [seed, name_crc] if k == 0 else [seed, name_crc, k]
        count = min(per_chunk, n_blocks - first)
        jobs.append(lambda key=key, count=count: fmt.random_blocks(
            count, np.random.default_rng(key)).reshape(-1))
    return jobs


def _vector_bytes(kind: Kind, n: int, rng: np.random.Generator) -> np.ndarray:
    if kind is Kind.BIAS:
        v = BIAS_STD * rng.standard_normal(n, dtype=np.float32)
    elif kind is Kind.DECAY:
        v = -rng.uniform(1.0, 16.0, n).astype(np.float32)
    else:
        gain = {Kind.OUTPUT_NORM: OUTPUT_GAIN, Kind.NORM: NORM_GAIN, Kind.HEAD_NORM: 1.0}[kind]
        v = np.float32(gain) * (1.0 + NORM_NOISE * rng.standard_normal(n, dtype=np.float32))
    return v.astype("<f4").view(np.uint8)
