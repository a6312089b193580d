"""The reference run's log-probabilities on disk (``--kl-divergence-base``), read back by a
later ``--kl-divergence`` run of another model or engine path.

Layout (little-endian)::

    b"DEIMOSLP"  u32 header length  header (UTF-8 JSON: LogProbHeader)
    i32 tokens[n_chunk * n_ctx]                     the evaluated tokens, chunk after chunk
    per chunk, per scored position (n_ctx - 1 - n_ctx // 2 rows,
    each nv = 2 * ceil(n_vocab / 2) + 4 u16):
        f32 scale, f32 min_log_prob, u16 q[n_vocab] (+ 1 pad when n_vocab is odd)
        log P(v) = scale * q[v] + min_log_prob

The rows are llama.cpp's own encoding (``llama-perplexity --kl-divergence-base``): 16-bit
steps over the top 16 nats of each row (a step of 16 / 65535 = 2.4e-4 nats at most), every
token below that at q = 0. So its files are read too (``_logits_`` magic: u32 n_ctx, i32
n_vocab, i32 n_chunk, then the same tokens and rows); they name no model or vocabulary, so
only sizes and tokens can be checked against them.
"""

from __future__ import annotations

import json
import struct
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

MAGIC = b"DEIMOSLP"
LLAMA_MAGIC = b"_logits_"
FORMAT_VERSION = 1
LOG_RANGE = 16.0  # nats below a row's maximum that are kept (llama.cpp's)
FLOOR = -LOG_RANGE  # a kept log-probability is above this (kld.kld_per_position's floor)


class LogitsFileError(ValueError):
    """A log-prob file that cannot be read, or that does not belong with this run."""


@dataclass(frozen=True)
class LogProbHeader:
    model: str  # file name of the reference model (llama.cpp files: "")
    n_vocab: int
    n_ctx: int
    n_chunk: int
    vocab_sha256: str = ""  # deimos.eval.corpus.vocab_fingerprint of the tokenizer ("": unknown)
    text: str = ""  # what was evaluated (file name)
    engine: str = "deimos"  # "deimos cpu", "deimos cuda", "llama.cpp"

    @property
    def first(self) -> int:
        return self.n_ctx // 2

    @property
    def rows_per_chunk(self) -> int:
        return self.n_ctx - 1 - self.first

    @property
    def row_words(self) -> int:
        return 2 * ((self.n_vocab + 1) // 2) + 4


def encode_rows(logp: np.ndarray) -> np.ndarray:
    """Log-probabilities [R, V] -> uint16 rows [R, nv] (llama.cpp's scheme, see the module)."""
    x = np.asarray(logp, dtype=np.float32)
    r, v = x.shape
    out = np.zeros((r, 2 * ((v + 1) // 2) + 4), dtype=np.uint16)
    hi = x.max(axis=1)
    lo = np.maximum(x.min(axis=1), hi - np.float32(LOG_RANGE))
    scale = ((hi - lo) / np.float32(65535.0)).astype(np.float32)
    head = out[:, :4].view(np.float32)
    head[:, 0], head[:, 1] = scale, lo
    safe = np.where(scale > 0, scale, np.float32(1.0))[:, None]
    q = np.rint((x - lo[:, None]) / safe)  # half to even, as llama.cpp's nearest_int
    q = np.where((x > lo[:, None]) & (scale[:, None] > 0), q, 0)
    out[:, 4:4 + v] = np.clip(q, 0, 65535).astype(np.uint16)
    return out


def decode_rows(rows: np.ndarray, n_vocab: int) -> np.ndarray:
    """uint16 rows [R, nv] -> log-probabilities [R, n_vocab] float32 (ones at q = 0 are at or
    below the kept range: mask them with ``FLOOR`` or use ``kld_per_position(floor=FLOOR)``)."""
    head = np.ascontiguousarray(rows[:, :4]).view(np.float32)
    q = rows[:, 4:4 + n_vocab].astype(np.float32)
    return (head[:, :1] * q + head[:, 1:2]).astype(np.float32)


class LogProbWriter:
    """Writes the header and tokens at once, then the rows as ``write_rows`` gets them."""

    def __init__(self, path: str | Path, header: LogProbHeader, tokens: np.ndarray):
        tokens = np.asarray(tokens, dtype=np.int32)
        if tokens.shape != (header.n_chunk * header.n_ctx,):
            raise ValueError(f"{path}: {tokens.shape[0]} tokens for {header.n_chunk} chunks of "
                             f"{header.n_ctx}")
        self.path = Path(path)
        self.header = header
        self._rows = 0
        self._total = header.n_chunk * header.rows_per_chunk
        self._f = open(self.path, "wb")
        blob = json.dumps({"format": FORMAT_VERSION, **asdict(header)}).encode()
        self._f.write(MAGIC + struct.pack("<I", len(blob)) + blob)
        self._f.write(tokens.astype("<i4").tobytes())

    def write_rows(self, logp: np.ndarray) -> None:
        """Appends log-probability rows [R, n_vocab], chunk after chunk, position after position."""
        h = self.header
        if logp.ndim != 2 or logp.shape[1] != h.n_vocab:
            raise ValueError(f"{self.path}: rows of shape {logp.shape}, expected [R, {h.n_vocab}]")
        if self._rows + logp.shape[0] > self._total:
            raise ValueError(f"{self.path}: more than the {self._total} rows of its header")
        self._f.write(encode_rows(logp).astype("<u2").tobytes())
        self._rows += logp.shape[0]

    def close(self) -> None:
        self._f.close()
        if self._rows != self._total:
            self.path.unlink(missing_ok=True)  # never leave a file that promises more rows
            raise LogitsFileError(f"{self.path}: {self._rows} of {self._total} rows written; "
                                  "file removed")

    def __enter__(self) -> LogProbWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self._f.close()
            self.path.unlink(missing_ok=True)


class LogProbFile:
    """A log-prob file, memory-mapped and checked for size; ``chunk(i)`` -> (tokens, logp)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            data = np.memmap(self.path, dtype=np.uint8, mode="r")
        except (OSError, ValueError) as e:  # ValueError: an empty file
            raise LogitsFileError(f"{self.path}: cannot read a log-prob file ({e})") from e
        self.header, offset = self._read_header(data)
        h = self.header
        if h.n_vocab <= 0 or h.n_ctx < 4 or h.n_chunk <= 0:
            raise LogitsFileError(f"{self.path}: n_vocab {h.n_vocab}, n_ctx {h.n_ctx}, n_chunk "
                                  f"{h.n_chunk} in its header: not a valid log-prob file")
        n_tok = h.n_chunk * h.n_ctx
        rows = h.n_chunk * h.rows_per_chunk
        expected = offset + 4 * n_tok + 2 * rows * h.row_words
        if data.shape[0] != expected:
            raise LogitsFileError(
                f"{self.path}: {data.shape[0]} bytes, its header ({h.n_chunk} chunks of "
                f"{h.n_ctx}, vocabulary {h.n_vocab}) needs {expected}: truncated or not one file")
        self.tokens = np.frombuffer(data, dtype="<i4", count=n_tok, offset=offset)
        self._rows = np.frombuffer(data, dtype="<u2", count=rows * h.row_words,
                                   offset=offset + 4 * n_tok).reshape(rows, h.row_words)
        if self.tokens.size and (self.tokens.min() < 0 or self.tokens.max() >= h.n_vocab):
            raise LogitsFileError(f"{self.path}: token ids outside its vocabulary [0, {h.n_vocab})")

    def _read_header(self, data: np.ndarray) -> tuple[LogProbHeader, int]:
        head = bytes(data[:20])
        if head[:8] == MAGIC and len(head) >= 12:
            (n,) = struct.unpack_from("<I", head, 8)
            if 12 + n > data.shape[0]:
                raise LogitsFileError(f"{self.path}: header of {n} bytes runs past the file")
            try:
                meta = json.loads(bytes(data[12:12 + n]))
                version = meta.pop("format")
                if version != FORMAT_VERSION:
                    raise LogitsFileError(f"{self.path}: format {version}; this Deimos reads "
                                          f"format {FORMAT_VERSION}")
                return LogProbHeader(**meta), 12 + n
            except (ValueError, TypeError, KeyError) as e:
                if isinstance(e, LogitsFileError):
                    raise
                raise LogitsFileError(f"{self.path}: unreadable header ({e})") from e
        if head[:8] == LLAMA_MAGIC and len(head) >= 20:
            n_ctx, n_vocab, n_chunk = struct.unpack_from("<Iii", head, 8)
            return LogProbHeader("", n_vocab, n_ctx, n_chunk, engine="llama.cpp"), 20
        raise LogitsFileError(f"{self.path}: not a log-prob file (neither Deimos's {MAGIC!r} "
                              f"nor llama-perplexity's {LLAMA_MAGIC!r} magic)")

    def chunk_tokens(self, i: int) -> np.ndarray:
        n = self.header.n_ctx
        return self.tokens[i * n:(i + 1) * n]

    def chunk_logp(self, i: int) -> np.ndarray:
        """[rows_per_chunk, n_vocab] float32 log-probabilities of chunk ``i``."""
        r = self.header.rows_per_chunk
        return decode_rows(self._rows[i * r:(i + 1) * r], self.header.n_vocab)

    def check_matches(self, *, n_vocab: int, vocab_sha256: str = "", n_ctx: int | None = None,
                      tokens: np.ndarray | None = None) -> None:
        """Raises LogitsFileError naming the first thing that differs from this run."""
        h = self.header
        if n_vocab != h.n_vocab:
            raise LogitsFileError(f"{self.path}: vocabulary of {h.n_vocab} tokens (model "
                                  f"{h.model or '?'}), this model has {n_vocab}")
        if vocab_sha256 and h.vocab_sha256 and vocab_sha256 != h.vocab_sha256:
            raise LogitsFileError(f"{self.path}: made with another tokenizer (model "
                                  f"{h.model}): the same ids are other tokens")
        if n_ctx is not None and n_ctx != h.n_ctx:
            raise LogitsFileError(f"{self.path}: computed with -c {h.n_ctx}, this run asks for "
                                  f"-c {n_ctx} (leave -c out to take the file's)")
        if tokens is not None:
            t = np.asarray(tokens)
            n = min(t.shape[0], self.tokens.shape[0])
            if t.shape[0] < self.tokens.shape[0] or not np.array_equal(t[:n], self.tokens[:n]):
                diff = np.nonzero(t[:n] != self.tokens[:n])[0]
                at = int(diff[0]) if diff.size else n
                raise LogitsFileError(f"{self.path}: its tokens differ from this text's from "
                                      f"token {at} on: another text or tokenizer")
