"""The tokenizer facade: encode / decode / stream-decode with llama.cpp's exact ids.

    tok = Tokenizer.from_gguf(gguf_file)
    ids = tok.encode("Hello", add_special=True, parse_special=False)
    text = tok.decode(ids)
    dec = tok.stream_decoder(); chunks = [dec.feed(i) for i in ids] + [dec.flush()]
"""

from __future__ import annotations

import codecs
import functools
from collections.abc import Iterable, Mapping
from typing import Any

from .bpe import BPEEncoder
from .cache import EncodeCache
from .spm import SPMEncoder
from .unicode import unicode_to_byte
from .vocab import TokenAttr, Vocab, VocabError

_C_SPACE = " \t\n\v\f\r"  # C isspace() in the "C" locale: what llama.cpp's lstrip/rstrip use
_SPECIAL_OUT = TokenAttr.CONTROL | TokenAttr.UNKNOWN


class ControlTexts:
    """Special-token texts, indexed to tell whether a place in a text is strictly inside an
    occurrence of one of them: only places whose two neighbours are a pair of characters some
    text holds are looked at, then each text length ending past the place."""

    __slots__ = ("lengths", "pairs", "texts")

    def __init__(self, texts: Iterable[str]) -> None:
        self.texts = frozenset(t for t in texts if len(t) > 1)
        self.lengths = tuple(sorted({len(t) for t in self.texts}))
        self.pairs = frozenset(t[i : i + 2] for t in self.texts for i in range(len(t) - 1))

    def inside(self, text: str, k: int) -> bool:
        """Whether position ``k`` (between ``text[k - 1]`` and ``text[k]``) is strictly inside
        an occurrence of one of the texts."""
        if not 0 < k < len(text) or text[k - 1 : k + 1] not in self.pairs:
            return False
        for n in self.lengths:
            for p in range(max(0, k - n + 1), k):
                if text[p : p + n] in self.texts:
                    return True
        return False


class Tokenizer:
    def __init__(self, vocab: Vocab, cache: EncodeCache | None = None):
        """``cache``: long texts' ids kept for the next encode of the same text (default: a
        new EncodeCache of its own)."""
        self.vocab = vocab
        self.cache = EncodeCache() if cache is None else cache
        self._encoder: BPEEncoder | SPMEncoder = (
            BPEEncoder(vocab) if vocab.kind == "bpe" else SPMEncoder(vocab)
        )
        # a chat template's short texts between messages come back every turn (thread-safe)
        self._partitions = functools.lru_cache(maxsize=4096)(self._partition_tuple)

    @classmethod
    def from_gguf(cls, f: Any) -> Tokenizer:
        """From a ``deimos.gguf.GGUFFile`` (or anything with ``.metadata``)."""
        return cls(Vocab.from_gguf(f))

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, Any], source: str = "<metadata>") -> Tokenizer:
        return cls(Vocab.from_metadata(metadata, source=source))

    # ---- vocab shortcuts -----------------------------------------------------------------

    @property
    def n_vocab(self) -> int:
        return self.vocab.n_vocab

    @property
    def bos_id(self) -> int | None:
        return self.vocab.bos_id

    @property
    def eos_id(self) -> int | None:
        return self.vocab.eos_id

    @property
    def eot_id(self) -> int | None:
        return self.vocab.eot_id

    @property
    def eom_id(self) -> int | None:
        return self.vocab.eom_id

    @property
    def eog_ids(self) -> frozenset[int]:
        """Tokens that end generation in llama.cpp (EOS, EOT, EOM and the known texts)."""
        return self.vocab.eog_ids

    @property
    def add_bos(self) -> bool:
        return self.vocab.add_bos

    def token_id(self, text: str) -> int | None:
        """The id of the token whose text is exactly ``text``, or None."""
        return self.vocab.token_id(text)

    def token_attr(self, token_id: int) -> TokenAttr:
        return self.vocab.attr(token_id)

    def is_control(self, token_id: int) -> bool:
        return self.vocab.is_control(token_id)

    @functools.cached_property
    def nl_id(self) -> int | None:
        """The newline token (llama.cpp's linefeed_id)."""
        v = self.vocab
        if v.kind == "spm":
            try:
                return v.byte_to_token(0x0A)
            except VocabError:
                return v.pad_id
        ids = self.encode("\n", add_special=False)
        return ids[0] if ids else v.pad_id

    # ---- encode --------------------------------------------------------------------------

    def encode(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        """Token ids of ``text`` (llama_tokenize).

        add_special: add BOS/EOS as the vocab asks (``add_bos`` / ``add_eos``).
        parse_special: match control tokens written in the text (e.g. ``<|im_start|>``) as
        single tokens; otherwise they are ordinary text. User-defined tokens always match.
        """
        if not isinstance(text, str):
            raise TypeError(f"encode() takes str, got {type(text).__name__}")
        return self.cache.get((text, add_special, parse_special),
                              lambda: self._encode(text, add_special, parse_special))

    def encode_verbatim(self, text: str) -> list[int]:
        """Tokens whose pieces spell ``text`` exactly: no BOS or EOS, control tokens as plain
        text, and no SentencePiece space prefix (``encode`` puts one before the text where the
        vocab asks for it). What a grammar engine that tokenizes forced text needs."""
        if not isinstance(text, str):
            raise TypeError(f"encode_verbatim() takes str, got {type(text).__name__}")
        return self.cache.get((text, "verbatim"), lambda: self._encode(text, False, False, prefix=False))

    def _encode(self, text: str, add_special: bool, parse_special: bool, prefix: bool = True) -> list[int]:
        v = self.vocab
        frags = self._partition(text, parse_special) if text else []
        out: list[int] = []
        if add_special and v.add_bos:
            if v.bos_id is None:
                raise VocabError(f"{v.source}: vocab asks for a BOS token but has none")
            out.append(v.bos_id)
        if v.kind == "spm":
            prev_special = True  # the first fragment gets the space prefix, BOS or not
            for fr in frags:
                if isinstance(fr, int):
                    out.append(fr)
                    prev_special = True
                    continue
                piece = text[fr[0] : fr[1]]
                if v.add_space_prefix and prev_special and prefix:
                    piece = " " + piece
                out.extend(self._encoder.encode(piece.replace(" ", "\u2581")))
                prev_special = False
        else:
            for fr in frags:
                if isinstance(fr, int):
                    out.append(fr)
                else:
                    out.extend(self._encoder.encode(text[fr[0] : fr[1]]))
        if add_special and v.add_eos:
            if v.eos_id is None:
                raise VocabError(f"{v.source}: vocab asks for an EOS token but has none")
            out.append(v.eos_id)
        return out

    @functools.cached_property
    def control_texts(self) -> ControlTexts:
        """The texts of the vocabulary's control (and unknown) tokens, the ones a chat prompt's
        contents must not form or cut (deimos.tokenizer.chat), indexed for ``inside``."""
        v = self.vocab
        return ControlTexts(v.tokens[t] for t in v.special_token_ids if v.attrs[t] & _SPECIAL_OUT)

    @functools.cached_property
    def _specials(self) -> tuple[tuple[tuple[int, str, bool, bool], ...], ...]:
        """(id, text, lstrip, rstrip) of the special tokens in partition order, plain values
        (the flags' enum arithmetic was most of a short text's encode): [0] without the
        control and unknown tokens (parse_special False), [1] all."""
        v = self.vocab
        rows = [(tid, v.tokens[tid], bool(v.attrs[tid] & TokenAttr.LSTRIP),
                 bool(v.attrs[tid] & TokenAttr.RSTRIP), bool(v.attrs[tid] & _SPECIAL_OUT))
                for tid in v.special_token_ids]
        return (tuple(r[:4] for r in rows if not r[4]), tuple(r[:4] for r in rows))

    def partition(self, text: str, parse_special: bool = False) -> tuple[int | tuple[int, int], ...]:
        """``text`` split as ``encode`` splits it: special-token ids and the (start, end) spans
        of raw text between them (user-defined tokens always match; control tokens only with
        ``parse_special``). Memoized."""
        if not isinstance(text, str):
            raise TypeError(f"partition() takes str, got {type(text).__name__}")
        return self._partitions(text, bool(parse_special))

    def _partition_tuple(self, text: str, parse_special: bool) -> tuple[int | tuple[int, int], ...]:
        return tuple(self._partition(text, parse_special)) if text else ()

    def _partition(self, text: str, parse_special: bool) -> list[int | tuple[int, int]]:
        """Split text into special-token ids and raw (start, end) spans
        (tokenizer_st_partition: each special token in turn, longest first)."""
        frags: list[int | tuple[int, int]] = [(0, len(text))]
        for tid, tok, lstrip, rstrip in self._specials[parse_special]:
            if tok not in text:
                continue
            new: list[int | tuple[int, int]] = []
            for fr in frags:
                if isinstance(fr, int):
                    new.append(fr)
                    continue
                s, e = fr
                while True:
                    m = text.find(tok, s, e)
                    if m < 0:
                        if e > s:
                            new.append((s, e))
                        break
                    ls, le = s, m
                    if lstrip:
                        while le > ls and text[le - 1] in _C_SPACE:
                            le -= 1
                    if le > ls:
                        new.append((ls, le))
                    new.append(tid)
                    s = m + len(tok)
                    if rstrip:
                        while s < e and text[s] in _C_SPACE:
                            s += 1
            frags = new
        return frags

    # ---- decode --------------------------------------------------------------------------

    def token_to_piece(self, token_id: int, special: bool = True, lstrip: int = 0) -> bytes:
        """Raw bytes of one token (llama_token_to_piece). With special=False, control and
        unknown tokens give b"". lstrip: drop up to that many leading spaces."""
        v = self.vocab
        if not 0 <= token_id < v.n_vocab:
            raise IndexError(f"token id {token_id} out of range [0, {v.n_vocab})")
        piece = self._pieces.get(token_id)
        if piece is None:
            piece = self._pieces[token_id] = self._make_piece(token_id)
        if not special and v.attrs[token_id] & _SPECIAL_OUT:
            return b""
        while lstrip > 0 and piece[:1] == b" ":
            piece = piece[1:]
            lstrip -= 1
        return piece

    @functools.cached_property
    def _pieces(self) -> dict[int, bytes]:
        return {}  # token id -> piece with special=True, filled on first use

    def _make_piece(self, tid: int) -> bytes:
        v = self.vocab
        text = v.tokens[tid]
        attr = v.attrs[tid]
        if attr & (_SPECIAL_OUT | TokenAttr.USER_DEFINED):
            return text.encode("utf-8", "surrogateescape")
        if attr & TokenAttr.NORMAL:
            if v.kind == "spm" or v.pre.escape_whitespaces:  # type: ignore[union-attr]
                return text.replace("\u2581", " ").encode("utf-8", "surrogateescape")
            return _gpt2_decode_text(text)
        if attr & TokenAttr.BYTE:
            return bytes([int(text[3:5], 16)])
        return b""  # unused / undefined tokens have no text, as in llama.cpp

    def detokenize_bytes(
        self, ids: Iterable[int], remove_special: bool = False, unparse_special: bool = True
    ) -> bytes:
        """llama_detokenize, as bytes (may end inside a UTF-8 sequence)."""
        v = self.vocab
        ids = list(ids)
        remove_space = v.add_space_prefix
        if remove_special and v.add_bos and ids and ids[0] == v.bos_id:
            remove_space = False
            ids = ids[1:]
        if remove_special and v.add_eos and ids and ids[-1] == v.eos_id:
            ids = ids[:-1]
        parts = []
        for tid in ids:
            parts.append(self.token_to_piece(tid, special=unparse_special, lstrip=int(remove_space)))
            remove_space = False
        out = b"".join(parts)
        return _clean_spaces(out) if v.clean_spaces else out

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """Text of ids; with skip_special, control tokens vanish and a leading BOS / trailing
        EOS added by the vocab are dropped. Invalid UTF-8 becomes U+FFFD."""
        raw = self.detokenize_bytes(ids, remove_special=skip_special, unparse_special=not skip_special)
        return raw.decode("utf-8", errors="replace")

    def stream_decoder(self, skip_special: bool = False, strip_leading_space: bool = False) -> StreamDecoder:
        return StreamDecoder(self, skip_special=skip_special, strip_leading_space=strip_leading_space)


class StreamDecoder:
    """Turns tokens into text one at a time, emitting only complete UTF-8 characters.

    A character whose bytes are split across tokens (emoji, CJK from byte-fallback tokens)
    is held back until it completes; bytes that can never form a character become U+FFFD.
    The concatenation of all ``feed`` results and ``flush()`` equals ``decode`` of the
    same ids, except for the clean-up of spaces some BPE vocabs do in ``decode`` (which
    needs lookahead). ``strip_leading_space`` drops the space SPM puts before the first
    token, as ``decode`` does for a sequence from its start; leave it off when streaming a
    continuation of a prompt.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = False, strip_leading_space: bool = False):
        self._tok = tokenizer
        self._special = not skip_special
        self._lstrip = int(strip_leading_space and tokenizer.vocab.add_space_prefix)
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token_id: int) -> str:
        piece = self._tok.token_to_piece(token_id, special=self._special, lstrip=self._lstrip)
        self._lstrip = 0
        return self._utf8.decode(piece)

    def flush(self) -> str:
        """Whatever is held back (an incomplete character becomes U+FFFD); then reset."""
        out = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        return out


@functools.cache
def _utf8_to_byte() -> dict[str, int]:
    return unicode_to_byte()


def _gpt2_decode_text(text: str) -> bytes:
    """Undo GPT-2 byte encoding (llama_decode_text), with its [UNK_BYTE_...] fallback."""
    m = _utf8_to_byte()
    out = bytearray()
    for ch in text:
        b = m.get(ch)
        if b is not None:
            out.append(b)
        else:
            out += (b"[UNK_BYTE_0x" + ch.encode("utf-8", "surrogateescape").hex().encode()
                    + text.encode("utf-8", "surrogateescape") + b"]")
    return bytes(out)


def _clean_spaces(t: bytes) -> bytes:
    """llama_detokenize's clean_up_tokenization_spaces passes, byte for byte."""
    sp, ap = 0x20, 0x27
    # pass 1: " ?" " !" " ." " ," -> drop the space
    out = bytearray(t[:1])
    for i in range(1, len(t)):
        if t[i - 1] == sp and t[i] in b"?!.,":
            out.pop()
        out.append(t[i])
    # pass 2: " ' " -> "'"
    t2 = bytearray(out)
    out = bytearray(t2[:1])
    i = 1
    while i < len(t2):
        x = t2[i]
        if x == ap and i + 1 < len(t2) and t2[i - 1] == sp and t2[i + 1] == sp:
            out.pop()
            i += 1
            t2[i] = 0  # the C code blanks the skipped space in place
        out.append(x)
        i += 1
    # pass 3: " 's" " 'm" " 're" " 've" -> drop the space
    t3 = bytes(out)
    n = len(t3)
    out = bytearray(t3[:1])
    for i in range(1, n):
        x = t3[i]
        if t3[i - 1] == sp and x == ap and i + 1 < n:
            x1 = t3[i + 1]
            if x1 in b"sm":
                out.pop()
            elif x1 not in b"td" and i + 2 < n and (x1, t3[i + 2]) in ((0x72, 0x65), (0x76, 0x65)):
                out.pop()
        out.append(x)
    return bytes(out)
