"""The vocabulary of a GGUF file, read the way llama.cpp reads it (llama_vocab::impl::load).

Only the ``tokenizer.*`` metadata is needed, so a ``Vocab`` can be built from any mapping
with those keys (``GGUFFile.metadata``). Defaults that depend on the tokenizer model and
the pre-tokenizer, the auto-detection of end-of-turn / end-of-generation tokens by their
text, and the attribute fix-ups all follow llama.cpp, so token ids match it.
"""

from __future__ import annotations

import enum
import functools
import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .pretok import PRE_TOKENIZERS, PreTokenizer

log = logging.getLogger(__name__)


class VocabError(ValueError):
    """A tokenizer field of a GGUF file is missing, malformed or unsupported."""


class TokenType(enum.IntEnum):
    """``tokenizer.ggml.token_type`` values in GGUF."""

    UNDEFINED = 0
    NORMAL = 1
    UNKNOWN = 2
    CONTROL = 3
    USER_DEFINED = 4
    UNUSED = 5
    BYTE = 6


class TokenAttr(enum.IntFlag):
    """llama.cpp's per-token attributes (``llama_token_attr``)."""

    UNDEFINED = 0
    UNKNOWN = 1 << 0
    UNUSED = 1 << 1
    NORMAL = 1 << 2
    CONTROL = 1 << 3
    USER_DEFINED = 1 << 4
    BYTE = 1 << 5
    NORMALIZED = 1 << 6
    LSTRIP = 1 << 7
    RSTRIP = 1 << 8
    SINGLE_WORD = 1 << 9


_TYPE_TO_ATTR = {
    TokenType.UNKNOWN: TokenAttr.UNKNOWN,
    TokenType.UNUSED: TokenAttr.UNUSED,
    TokenType.NORMAL: TokenAttr.NORMAL,
    TokenType.CONTROL: TokenAttr.CONTROL,
    TokenType.USER_DEFINED: TokenAttr.USER_DEFINED,
    TokenType.BYTE: TokenAttr.BYTE,
}

# Texts llama.cpp takes as end-of-turn (first found wins; see _first_present) and as
# end-of-generation.
_EOT_TEXTS = (
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>",
    "<EOT>", "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>", "<end_of_utterance>",
)  # fmt: skip
_EOG_TEXTS = frozenset((
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
    "<｜end▁of▁sentence｜>", "[e~[",
))  # fmt: skip
_FIM_TEXTS = {
    "fim_pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>",
                "▁<PRE>", "<|code_prefix|>", "<|prefix|>"),
    "fim_suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>",
                "▁<SUF>", "<|code_suffix|>", "<|suffix|>"),
    "fim_mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>",
                "▁<MID>", "<|code_middle|>", "<|middle|>"),
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",),
}  # fmt: skip

_K = "tokenizer.ggml."
# (attribute, metadata keys in the order llama.cpp reads them; a later key overrides)
_SPECIAL_KEYS = (
    ("bos", ("bos_token_id",)),
    ("eos", ("eos_token_id",)),
    ("eot", ("eot_token_id",)),
    ("eom", ("eom_token_id",)),
    ("unk", ("unknown_token_id",)),
    ("sep", ("seperator_token_id",)),  # sic: llama.cpp's key spelling
    ("pad", ("padding_token_id",)),
    ("mask", ("mask_token_id",)),
    ("fim_pre", ("fim_pre_token_id", "prefix_token_id")),
    ("fim_suf", ("fim_suf_token_id", "suffix_token_id")),
    ("fim_mid", ("fim_mid_token_id", "middle_token_id")),
    ("fim_pad", ("fim_pad_token_id",)),
    ("fim_rep", ("fim_rep_token_id",)),
    ("fim_sep", ("fim_sep_token_id",)),
)


@dataclass
class Vocab:
    """Tokens, scores, attributes, merges and special ids of one GGUF vocabulary.

    ``kind`` is "bpe" (``tokenizer.ggml.model`` "gpt2" or "gemma4") or "spm" ("llama").
    Special ids are ``None`` where the vocab has none. Build with ``from_metadata``.
    """

    model: str
    kind: str
    pre: PreTokenizer | None
    tokens: list[str]
    scores: list[float]
    attrs: list[int]
    token_to_id: dict[str, int]
    merges: Sequence[str] = ()
    special: dict[str, int | None] = field(default_factory=dict)
    add_bos: bool = False
    add_eos: bool = False
    add_sep: bool = False
    add_space_prefix: bool = False
    clean_spaces: bool = False
    eog_ids: frozenset[int] = frozenset()
    source: str = "<metadata>"

    # ---- construction -------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, f: Any) -> Vocab:
        """From a ``deimos.gguf.GGUFFile`` (anything with ``.metadata`` and ``.path``)."""
        return cls.from_metadata(f.metadata, source=str(getattr(f, "path", "<gguf>")))

    @classmethod
    def from_metadata(cls, md: Mapping[str, Any], source: str = "<metadata>") -> Vocab:
        def err(msg: str) -> VocabError:
            return VocabError(f"{source}: {msg}")

        model = md.get(_K + "model")
        if model is None:
            raise err(f"missing '{_K}model' (no tokenizer in this file)")
        if not isinstance(model, str):
            raise err(f"'{_K}model' must be a string, got {type(model).__name__}")
        pre_name = md.get(_K + "pre")
        pre: PreTokenizer | None = None
        add_bos = add_eos = add_space_prefix = False
        special: dict[str, int | None] = {k: None for k, _ in _SPECIAL_KEYS}
        if model == "llama":
            kind = "spm"
            special.update(bos=1, eos=2, unk=0)
            add_space_prefix, add_bos, clean_spaces = True, True, False
        elif model in ("gpt2", "gemma4"):
            kind = "bpe"
            if model == "gpt2":
                special.update(bos=11, eos=11)
            else:
                pre_name = "gemma4"  # llama.cpp forces it for this model
            if pre_name is None or pre_name == "":
                log.warning("%s: missing '%spre', using 'default' (quality may degrade)", source, _K)
                pre_name = "default"
            if not isinstance(pre_name, str) or pre_name not in PRE_TOKENIZERS:
                raise err(
                    f"unsupported pre-tokenizer '{_K}pre' = {pre_name!r} "
                    f"(supported: {', '.join(sorted(PRE_TOKENIZERS))})"
                )
            pre = PRE_TOKENIZERS[pre_name]
            clean_spaces = pre.clean_spaces
            if pre.add_bos is not None:
                add_bos = pre.add_bos
            if pre.no_bos:
                special["bos"] = None
        else:
            raise err(
                f"unsupported tokenizer model '{_K}model' = {model!r} "
                "(supported: 'gpt2' and 'gemma4' (BPE), 'llama' (SentencePiece))"
            )

        tokens = md.get(_K + "tokens")
        if tokens is None:
            raise err(f"missing '{_K}tokens'")
        if not isinstance(tokens, Sequence) or isinstance(tokens, str | bytes):
            raise err(f"'{_K}tokens' must be a string array, got {type(tokens).__name__}")
        tokens = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
        n = len(tokens)
        if n == 0:
            raise err(f"'{_K}tokens' is empty")
        if not all(type(t) is str for t in tokens):
            raise err(f"'{_K}tokens' must hold strings")
        token_to_id = {t: i for i, t in enumerate(tokens)}
        if len(token_to_id) != n:
            raise err(f"'{_K}tokens' has {n - len(token_to_id)} duplicate token texts")

        scores = _numeric_array(md, _K + "scores", n, "iuf", err)
        scores_l = [0.0] * n if scores is None else np.asarray(scores[:n], dtype=np.float64).tolist()
        types = _numeric_array(md, _K + "token_type", n, "iu", err)
        if types is None:
            attrs = [int(TokenAttr.NORMAL)] * n
        else:
            t = np.asarray(types[:n], dtype=np.int64)
            lut = np.zeros(8, dtype=np.int64)  # unknown type values -> UNDEFINED (0)
            for ty, at in _TYPE_TO_ATTR.items():
                lut[ty] = at
            attrs = np.where((t >= 0) & (t < 8), lut[np.clip(t, 0, 7)], 0).tolist()
            _check_byte_tokens(tokens, np.flatnonzero(t == TokenType.BYTE), err)

        merges: Sequence[str] = ()
        if kind == "bpe":
            merges = md.get(_K + "merges")
            if merges is None:
                raise err(f"missing '{_K}merges' (required by the BPE tokenizer)")
            if isinstance(merges, str | bytes) or not all(type(m) is str for m in merges):
                raise err(f"'{_K}merges' must be a string array")

        add_space_prefix = _flag(md, "add_space_prefix", add_space_prefix, err)

        for name, keys in _SPECIAL_KEYS:
            cur = special[name]
            if cur is not None and cur >= n:
                log.warning("%s: default special token %s = %d out of range, disabling", source, name, cur)
                special[name] = cur = None
            for key in keys:
                if _K + key not in md:
                    continue
                new = md[_K + key]
                if isinstance(new, bool) or not isinstance(new, int):
                    raise err(f"'{_K}{key}' must be a token id (an integer), got {new!r:.60}")
                if 0 <= new < n:
                    special[name] = new
                else:
                    log.warning("%s: bad special token %s%s = %d, keeping %s", source, _K, key, new, cur)

        add_bos = _flag(md, "add_bos_token", add_bos, err)
        add_eos = _flag(md, "add_eos_token", add_eos, err)
        add_sep = _flag(md, "add_sep_token", False, err)
        if pre is not None and pre.name == "gemma4" and not add_bos:
            add_bos = True  # llama.cpp's Gemma 4 workaround

        eog = _detect_special_texts(tokens, token_to_id, attrs, special)
        _fix_attrs_by_name(md, tokens, token_to_id, attrs)

        return cls(
            model=model, kind=kind, pre=pre, tokens=tokens, scores=scores_l, attrs=attrs,
            token_to_id=token_to_id, merges=merges, special=special, add_bos=add_bos,
            add_eos=add_eos, add_sep=add_sep, add_space_prefix=add_space_prefix,
            clean_spaces=clean_spaces, eog_ids=frozenset(eog), source=source,
        )  # fmt: skip

    # ---- queries --------------------------------------------------------------------------

    @property
    def n_vocab(self) -> int:
        return len(self.tokens)

    @property
    def bos_id(self) -> int | None:
        return self.special["bos"]

    @property
    def eos_id(self) -> int | None:
        return self.special["eos"]

    @property
    def eot_id(self) -> int | None:
        return self.special["eot"]

    @property
    def eom_id(self) -> int | None:
        return self.special["eom"]

    @property
    def unk_id(self) -> int | None:
        return self.special["unk"]

    @property
    def pad_id(self) -> int | None:
        return self.special["pad"]

    @property
    def sep_id(self) -> int | None:
        return self.special["sep"]

    def token_id(self, text: str) -> int | None:
        return self.token_to_id.get(text)

    def attr(self, token_id: int) -> TokenAttr:
        return TokenAttr(self.attrs[token_id])

    def is_control(self, token_id: int) -> bool:
        return bool(self.attrs[token_id] & TokenAttr.CONTROL)

    def is_eog(self, token_id: int) -> bool:
        return token_id in self.eog_ids

    @functools.cached_property
    def bpe_ranks(self) -> dict[str, int]:
        """{"left right": rank}, the first occurrence of a merge winning (C++ emplace).

        llama.cpp keys on the pair (left, right) cut at the first space after index 0.
        Keying on the merge text is the same map for every query the encoder makes,
        because its symbols never hold U+0020 (byte-encoding maps it to U+0120 "Ġ";
        SPM-style BPE escapes it to U+2581): for a space-free, non-empty left symbol the
        first space of "left right" from index 1 is the one between them.
        """
        m = self.merges
        return dict(zip(reversed(m), range(len(m) - 1, -1, -1)))

    @functools.cached_property
    def special_token_ids(self) -> tuple[int, ...]:
        """Control / user-defined / unknown tokens, longest text first (tokenizer_st_partition)."""
        mask = int(TokenAttr.CONTROL | TokenAttr.USER_DEFINED | TokenAttr.UNKNOWN)
        ids = [i for i, a in enumerate(self.attrs) if a & mask]
        ids.sort(key=lambda i: -len(self.tokens[i].encode("utf-8", "surrogateescape")))
        return tuple(ids)

    def byte_to_token(self, b: int) -> int:
        """The token of one raw byte (SPM "<0xXX>", BPE the byte's GPT-2 character)."""
        if self.kind == "spm" or (self.pre is not None and not self.pre.byte_encode):
            tid = self.token_to_id.get(f"<0x{b:02X}>")
            if tid is None and self.kind == "spm":
                tid = self.token_to_id.get(chr(b))
        else:
            from .unicode import byte_to_unicode

            tid = self.token_to_id.get(byte_to_unicode()[b])
        if tid is None:
            raise VocabError(f"{self.source}: vocab has no token for byte 0x{b:02X}")
        return tid


def _numeric_array(md: Mapping[str, Any], key: str, n: int, kinds: str, err: Any) -> np.ndarray | None:
    """The numeric array ``key`` (numpy dtype kind in ``kinds``) with at least ``n`` entries
    (llama.cpp reads the first ``n``), or None when absent."""
    arr = md.get(key)
    if arr is None:
        return None
    if not isinstance(arr, np.ndarray) or arr.ndim != 1 or arr.dtype.kind not in kinds:
        got = f"{arr.dtype} array" if isinstance(arr, np.ndarray) else type(arr).__name__
        raise err(f"'{key}' must be a numeric array, got {got}")
    if len(arr) < n:
        raise err(f"'{key}' has {len(arr)} entries, fewer than the {n} tokens")
    return arr


def _flag(md: Mapping[str, Any], key: str, default: bool, err: Any) -> bool:
    value = md.get(_K + key, default)
    if not isinstance(value, bool):
        raise err(f"'{_K}{key}' must be a bool, got {value!r:.60}")
    return value


_BYTE_TEXT = re.compile(r"<0x[0-9A-Fa-f]{2}>")


def _check_byte_tokens(tokens: list[str], byte_ids: np.ndarray, err: Any) -> None:
    """A BYTE-type token stands for the byte its text spells, ``<0xNN>``; decoding reads the
    byte from the text. llama.cpp parses whatever is there with strtol (garbage decodes as
    a wrong byte, a short text throws at decode time); here the file is refused at load."""
    for tid in byte_ids.tolist():
        if not _BYTE_TEXT.fullmatch(tokens[tid]):
            raise err(f"token {tid} has type BYTE ('{_K}token_type') but its text "
                      f"{tokens[tid]!r:.40} is not of the form <0xNN>")


def _detect_special_texts(
    tokens: list[str], token_to_id: dict[str, int], attrs: list[int], special: dict[str, int | None]
) -> set[int]:
    """EOT/EOM/FIM auto-detection by text, then the end-of-generation set (llama.cpp load).

    The set (llama.cpp's ``special_eog_ids``): the FIM pad/repo/sep ids, every token whose
    text is in ``_EOG_TEXTS``, the eos/eot/eom ids, minus the fix-ups below. Special ids
    arrive here already range-checked, with the tokenizer model's defaults (SPM eos 2, gpt2
    eos 11, none for gemma4) where the metadata has none or an out-of-range one.
    """

    def mark_control(tid: int) -> None:
        attrs[tid] = attrs[tid] | int(TokenAttr.CONTROL)

    # llama.cpp scans an unordered_map, so with several candidates its pick depends on hash
    # order; we take the first in its list order, which is deterministic.
    def first_present(texts: Sequence[str]) -> int | None:
        for t in texts:
            if t in token_to_id:
                return token_to_id[t]
        return None

    for name, texts in (("eot", _EOT_TEXTS), ("eom", ("<|eom_id|>",)), *_FIM_TEXTS.items()):
        if special[name] is None:
            tid = first_present(texts)
            if tid is not None:
                special[name] = tid
                mark_control(tid)

    control, unused = int(TokenAttr.CONTROL), int(TokenAttr.UNUSED)
    for tid, a in enumerate(attrs):
        if a & control and "unused" in tokens[tid]:
            attrs[tid] = a | unused

    eog: set[int] = {special[k] for k in ("fim_pad", "fim_rep", "fim_sep") if special[k] is not None}  # type: ignore[misc]
    for text in _EOG_TEXTS:
        tid = token_to_id.get(text)
        if tid is not None:
            eog.add(tid)
            mark_control(tid)
    for text in ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"):  # gpt-oss
        if text in token_to_id:
            attrs[token_to_id[text]] = int(TokenAttr.USER_DEFINED)
    for k in ("eos", "eot", "eom"):
        if special[k] is not None:
            eog.add(special[k])  # type: ignore[arg-type]

    # Fix-ups on the final set. gpt-oss / solar-open: "<|end|>" closes a message, not the
    # generation, when a call marker ("<|call|>" or "<|calls|>", llama.cpp does not tell them
    # apart) and "<|return|>" or "<|flush|>" are enders too. gemma4 / plamo: "</s>" is text.
    texts = {tokens[t]: t for t in eog}
    has_call = "<|call|>" in texts or "<|calls|>" in texts
    if "<|end|>" in texts and has_call and ("<|return|>" in texts or "<|flush|>" in texts):
        eog.discard(texts["<|end|>"])
        attrs[texts["<|end|>"]] = int(TokenAttr.USER_DEFINED)
    if "</s>" in texts and ("<|tool_response>" in texts or "<|plamo:eos|>" in texts):
        eog.discard(texts["</s>"])
        attrs[texts["</s>"]] = int(TokenAttr.NORMAL)
    return eog


def _fix_attrs_by_name(
    md: Mapping[str, Any], tokens: list[str], token_to_id: dict[str, int], attrs: list[int]
) -> None:
    """Per-model attribute fix-ups llama.cpp applies by ``general.name`` (Phi-3 rstrip)."""
    name = str(md.get("general.name", "")).lower()
    if "phi-3" in name or "phi3" in name:
        mask = int(TokenAttr.CONTROL | TokenAttr.USER_DEFINED | TokenAttr.UNKNOWN)
        rstrip = int(TokenAttr.RSTRIP)
        for tid, a in enumerate(attrs):
            if a & mask:
                attrs[tid] = a | rstrip
        if "</s>" in token_to_id:
            attrs[token_to_id["</s>"]] |= rstrip
        for t in ("<unk>", "<s>", "<|endoftext|>"):
            if t in token_to_id:
                attrs[token_to_id[t]] &= ~rstrip
