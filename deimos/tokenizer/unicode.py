"""Code point classes, the GPT-2 byte<->unicode map, and llama.cpp's pre-tokenizer splitter.

This is a port of llama.cpp ``src/unicode.cpp`` (``unicode_regex_split``): a text is cut
into words by a list of regexes applied one after the other, each one re-cutting the
pieces the previous one produced. Some regexes have hand-written splitters there
(GPT-2, LLaMA-3, Qwen2, Qwen3.5, newline runs); the others run through ``std::regex`` on a
"collapsed" text where every non-ASCII code point becomes one byte naming its class.
We reproduce both, because that collapse is what defines the results (e.g. ``\\p{L}`` is
llama.cpp's table, not Python's Unicode database, and ``\\s`` is C's ASCII isspace).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence

import numpy as np

from ._unicode_data import RANGE_FLAGS, RANGE_STARTS, WHITESPACE

# unicode_cpt_flags bits (llama.cpp src/unicode.h)
UNDEFINED = 0x0001
NUMBER = 0x0002
LETTER = 0x0004
SEPARATOR = 0x0008
MARK = 0x0010
PUNCTUATION = 0x0020
SYMBOL = 0x0040
CONTROL = 0x0080
CATEGORIES = 0x00FF
WHITESPACE_BIT = 0x0100

MAX_CODEPOINTS = 0x110000


@functools.cache
def flags_table() -> np.ndarray:
    """uint16[0x110000]: llama.cpp's flags of every code point (categories | whitespace bit)."""
    starts = np.asarray(RANGE_STARTS, dtype=np.int64)
    table = np.repeat(np.asarray(RANGE_FLAGS[:-1], dtype=np.uint16), np.diff(starts))
    assert table.size == MAX_CODEPOINTS
    table[np.fromiter(WHITESPACE, dtype=np.int64)] |= WHITESPACE_BIT
    table.setflags(write=False)
    return table


def codepoint_flags(cps: Sequence[int]) -> list[int]:
    if not cps:
        return []
    return flags_table()[np.asarray(cps, dtype=np.int64)].tolist()


@functools.cache
def byte_to_unicode() -> tuple[str, ...]:
    """GPT-2's reversible byte -> printable code point map (``unicode_byte_to_utf8_map``)."""
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    out: dict[int, str] = {b: chr(b) for b in keep}
    n = 0
    for b in range(256):
        if b not in out:
            out[b] = chr(256 + n)
            n += 1
    return tuple(out[b] for b in range(256))


@functools.cache
def unicode_to_byte() -> dict[str, int]:
    return {c: b for b, c in enumerate(byte_to_unicode())}


# ---------------------------------------------------------------------------------------
# Hand-written splitters. Each takes the whole text's code points and flags, and the
# current piece lengths; it returns new piece lengths. Within a piece [ini, end) a position
# outside it reads as flags 0 / code point OUT (unicode.cpp's _get_flags/_get_cpt), which
# is why every lookahead is bounds-checked against `end`.

_OUT = -1
_CR, _LF, _SPACE, _APOS = 0x0D, 0x0A, 0x20, 0x27
_CONTRACTION_1 = frozenset(map(ord, "stmd"))
_CONTRACTION_2 = frozenset({(ord("r"), ord("e")), (ord("v"), ord("e")), (ord("l"), ord("l"))})


def _ascii_lower(c: int) -> int:
    # unicode_tolower only matters here when it yields one of "stmdrvel"; the only code
    # points lowering to those are their ASCII upper cases.
    return c + 32 if 0x41 <= c <= 0x5A else c


def _contraction_len(cps: list[int], pos: int, end: int, case_insensitive: bool) -> int:
    """Length of a match of 's|'t|'re|'ve|'m|'ll|'d at pos (0 if none)."""
    if cps[pos] != _APOS or pos + 1 >= end:
        return 0
    low = _ascii_lower if case_insensitive else (lambda c: c)
    n1 = low(cps[pos + 1])
    if n1 in _CONTRACTION_1:
        return 2
    if pos + 2 < end and (n1, low(cps[pos + 2])) in _CONTRACTION_2:
        return 3
    return 0


def _split_gpt2(cps: list[int], fl: list[int], offsets: list[int]) -> list[int]:
    """'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)"""
    out: list[int] = []
    start = 0
    for off in offsets:
        ini, end = start, start + off
        start = end

        def F(p: int) -> int:
            return fl[p] if p < end else 0

        pos = ini
        while pos < end:
            c = cps[pos]
            n = _contraction_len(cps, pos, end, case_insensitive=False)
            if n:
                out.append(n)
                pos += n
                continue
            f2 = F(pos + 1) if c == _SPACE else fl[pos]
            p0 = pos
            if f2 & LETTER:
                pos += c == _SPACE
                while F(pos) & LETTER:
                    pos += 1
            elif f2 & NUMBER:
                pos += c == _SPACE
                while F(pos) & NUMBER:
                    pos += 1
            elif not (f2 & (WHITESPACE_BIT | LETTER | NUMBER)) and f2:
                pos += c == _SPACE
                while (f := F(pos)) and not (f & (WHITESPACE_BIT | LETTER | NUMBER)):
                    pos += 1
            else:
                nws = 0
                while F(pos + nws) & WHITESPACE_BIT:
                    nws += 1
                if nws > 1 and pos + nws < end:  # \s+(?!\S): leave the last space to the next word
                    pos += nws - 1
                elif nws > 0:
                    pos += nws
                else:
                    pos += 1
            out.append(pos - p0)
    return out


def _split_llama3_like(
    cps: list[int], fl: list[int], offsets: list[int], digits: int, marks: bool
) -> list[int]:
    """llama3 (digits=3), qwen2 (digits=1), qwen35 (digits=1, marks=True):
    (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*
    |\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+    (qwen35: \\p{L} -> [\\p{L}\\p{M}] in the word branches)"""
    word = LETTER | MARK if marks else LETTER
    out: list[int] = []
    start = 0
    for off in offsets:
        ini, end = start, start + off
        start = end

        def F(p: int) -> int:
            return fl[p] if p < end else 0

        pos = ini
        while pos < end:
            c = cps[pos]
            f = fl[pos]
            n = _contraction_len(cps, pos, end, case_insensitive=True)
            if n:
                out.append(n)
                pos += n
                continue
            # [^\r\n\p{L}\p{N}]?\p{L}+
            if not (c == _CR or c == _LF or f & NUMBER) and (f & word or F(pos + 1) & word):
                p0 = pos
                pos += 1
                while F(pos) & word:
                    pos += 1
                out.append(pos - p0)
                continue
            # \p{N}{1,3} (or \p{N})
            if f & NUMBER:
                p0 = pos
                while F(pos) & NUMBER:
                    pos += 1
                    if pos - p0 >= digits:
                        out.append(pos - p0)
                        p0 = pos
                if pos > p0:
                    out.append(pos - p0)
                continue
            # <space>?[^\s\p{L}\p{N}]+[\r\n]*   (the first test reads flags, not flags2, as in C++)
            stop = WHITESPACE_BIT | word | NUMBER
            f2 = F(pos + 1) if c == _SPACE else f
            if not (f2 & stop) and f:
                p0 = pos
                pos += c == _SPACE
                while (f2 := F(pos)) and not (f2 & stop):
                    pos += 1
                while pos < end and cps[pos] in (_CR, _LF):
                    pos += 1
                out.append(pos - p0)
                continue
            nws = 0
            last_rn = 0
            while F(pos + nws) & WHITESPACE_BIT:
                if cps[pos + nws] in (_CR, _LF):
                    last_rn = pos + nws + 1
                nws += 1
            p0 = pos
            if last_rn > 0:  # \s*[\r\n]+
                pos = last_rn
            elif nws > 1 and pos + nws < end:  # \s+(?!\S)
                pos += nws - 1
            elif nws > 0:  # \s+
                pos += nws
            else:
                pos += 1
            out.append(pos - p0)
    return out


def _split_newlines(cps: list[int], offsets: list[int]) -> list[int]:
    """[^\\n]+|[\\n]+"""
    out: list[int] = []
    start = 0
    for off in offsets:
        pos, end = start, start + off
        start = end
        while pos < end:
            is_nl = cps[pos] == _LF
            p0 = pos
            while pos < end and (cps[pos] == _LF) == is_nl:
                pos += 1
            out.append(pos - p0)
    return out


GPT2_RE = "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)"
_CONTR = "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
LLAMA3_RE = _CONTR + (
    "|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
)
QWEN2_RE = _CONTR + (
    "|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
)
QWEN35_RE = _CONTR + (
    "|[^\\r\\n\\p{L}\\p{N}]?[\\p{L}\\p{M}]+|\\p{N}| ?[^\\s\\p{L}\\p{M}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+"
    "|\\s+(?!\\S)|\\s+"
)
NEWLINES_RE = "[^\\n]+|[\\n]+"

_CUSTOM = {
    GPT2_RE: lambda cps, fl, o: _split_gpt2(cps, fl, o),
    LLAMA3_RE: lambda cps, fl, o: _split_llama3_like(cps, fl, o, digits=3, marks=False),
    QWEN2_RE: lambda cps, fl, o: _split_llama3_like(cps, fl, o, digits=1, marks=False),
    QWEN35_RE: lambda cps, fl, o: _split_llama3_like(cps, fl, o, digits=1, marks=True),
    NEWLINES_RE: lambda cps, fl, o: _split_newlines(cps, o),
}

# ---------------------------------------------------------------------------------------
# The std::regex fallback. A regex naming a category runs on the collapsed text: ASCII
# stays, non-ASCII whitespace -> \x0B, other code points -> one marker char per class.

_CAT_MARK = {NUMBER: "\xd1", LETTER: "\xd2", PUNCTUATION: "\xd3", MARK: "\xd4", SYMBOL: "\xd5"}
_OTHER_MARK = "\xd0"
_UCAT = {  # \p{..} -> (flag, the ASCII members as a bracket-expression body)
    "\\p{N}": (NUMBER, "0-9"),
    "\\p{L}": (LETTER, "A-Za-z"),
    "\\p{P}": (PUNCTUATION, "!-#%-*,-/:-;?-@\\[-\\]_\\{\\}"),
    "\\p{M}": (MARK, ""),
    "\\p{S}": (SYMBOL, "\\$\\+<->^`\\|\\~"),
    "\\p{Lu}": (LETTER, "A-Za-z"),
    "\\p{Ll}": (LETTER, "A-Za-z"),
    "\\p{Lt}": (LETTER, "A-Za-z"),
    "\\p{Lm}": (LETTER, "A-Za-z"),
    "\\p{Lo}": (LETTER, "A-Za-z"),
}


def _uses_categories(expr: str) -> bool:
    return any(k in expr for k in _UCAT)


def _collapse_regex(expr: str) -> str:
    """Port of unicode_regex_split's regex_expr_collapsed loop."""
    out: list[str] = []
    inside = False
    i = 0
    while i < len(expr):
        ch = expr[i]
        if ch == "[" and (i == 0 or expr[i - 1] != "\\"):
            out.append("[")
            inside = True
            i += 1
            continue
        if inside and ch == "]" and expr[i - 1] != "\\":
            out.append("]")
            inside = False
            i += 1
            continue
        if ch == "\\" and i + 3 < len(expr) and expr[i + 1] == "p" and expr[i + 2] == "{":
            close = expr.find("}", i + 3)
            if close != -1 and close <= i + 10 and expr[i : close + 1] in _UCAT:
                flag, ascii_body = _UCAT[expr[i : close + 1]]
                body = _CAT_MARK[flag] + ascii_body
                out.append(body if inside else f"[{body}]")
                i = close + 1
                continue
        out.append(ch)
        i += 1
    return "".join(out)


def _to_python_regex(expr: str) -> re.Pattern[str]:
    # ECMAScript '$' (no multiline) is the end of input; Python's '$' also matches before a
    # final '\n'. re.ASCII makes \s exactly C's isspace set [ \t\n\v\f\r].
    if expr.endswith("$") and not expr.endswith("\\$"):
        expr = expr[:-1] + "\\Z"
    return re.compile(expr, re.ASCII)


def _split_stl(text: str, pattern: re.Pattern[str], offsets: list[int]) -> list[int]:
    out: list[int] = []
    start = 0
    for off in offsets:
        piece = text[start : start + off]
        idx = 0
        for m in pattern.finditer(piece):
            if m.start() > idx:
                out.append(m.start() - idx)
            if m.end() > m.start():
                out.append(m.end() - m.start())
            idx = m.end()
        if idx < off:
            out.append(off - idx)
        start += off
    return out


class RegexSplitter:
    """Cuts text into pre-tokenizer words exactly like llama.cpp's unicode_regex_split."""

    def __init__(self, exprs: Sequence[str]):
        self.exprs = tuple(exprs)
        self._steps: list[tuple[str, object]] = []
        for e in self.exprs:
            if e in _CUSTOM:
                self._steps.append(("custom", _CUSTOM[e]))
            elif _uses_categories(e):
                if any(ord(c) >= 128 for c in e):
                    raise ValueError(f"regex mixes unicode categories and non-ASCII characters: {e!r}")
                self._steps.append(("collapsed", _to_python_regex(_collapse_regex(e))))
            else:
                self._steps.append(("wide", _to_python_regex(e)))

    def split(self, text: str) -> list[str]:
        if not text:
            return []
        cps = [ord(c) for c in text]
        fl = codepoint_flags(cps)
        collapsed = wide = None
        offsets = [len(cps)]
        for kind, step in self._steps:
            if kind == "custom":
                offsets = step(cps, fl, offsets)  # type: ignore[operator]
            elif kind == "collapsed":
                if collapsed is None:
                    collapsed = _collapse_text(cps, fl)
                offsets = _split_stl(collapsed, step, offsets)  # type: ignore[arg-type]
            else:
                if wide is None:
                    wide = "".join(
                        "\x0b" if c > 0x7F and f & WHITESPACE_BIT else chr(c)
                        for c, f in zip(cps, fl)
                    )
                offsets = _split_stl(wide, step, offsets)  # type: ignore[arg-type]
        words = []
        start = 0
        for off in offsets:
            words.append(text[start : start + off])
            start += off
        return words


def _collapse_text(cps: list[int], fl: list[int]) -> str:
    chars = []
    for c, f in zip(cps, fl):
        if c < 128:
            chars.append(chr(c))
        elif f & WHITESPACE_BIT:
            chars.append("\x0b")
        else:
            chars.append(_CAT_MARK.get(f & CATEGORIES, _OTHER_MARK))
    return "".join(chars)


def byte_encode(word: str) -> str:
    """UTF-8 bytes of word, each mapped through GPT-2's byte_to_unicode."""
    table = byte_to_unicode()
    return "".join(table[b] for b in word.encode("utf-8"))
