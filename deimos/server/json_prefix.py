"""Whether a JSON object or array written so far can still be completed, as Python's ``json``
reads it (``JSONDecoder().raw_decode``: strict strings, NaN/Infinity allowed).

    p = JsonPrefix()
    p.feed(text, start)   # VIABLE, COMPLETE (p.end: one past the closing bracket) or INVALID

Fed character by character (each character read once, however the text arrives), so a
streamed reply can tell at once that a ``{`` it holds back cannot be a tool call's JSON.
INVALID must be sound: it is said only when no continuation could make ``raw_decode``
succeed. The grammar is CPython's scanner (Modules/_json.c): whitespace is `` \\t\\n\\r``
only; a string holds no character below U+0020 and only the escapes ``\\" \\\\ \\/ \\b \\f \\n
\\r \\t \\uXXXX``; a number is ``-?(0|[1-9][0-9]*)(\\.[0-9]+)?([eE][-+]?[0-9]+)?`` (ASCII
digits), the scanner backing off a ``.`` or an exponent without digits (which then cannot
follow a value); the literals are ``true false null NaN Infinity -Infinity``. Nesting has no
limit here: ``raw_decode`` may still refuse a deep value with RecursionError.
"""

from __future__ import annotations

__all__ = ["COMPLETE", "INVALID", "VIABLE", "JsonPrefix"]

VIABLE, COMPLETE, INVALID = "viable", "complete", "invalid"

_WS = " \t\n\r"
_DIGITS = "0123456789"
_HEX = "0123456789abcdefABCDEF"
_ESCAPES = '"\\/bfnrt'
_LITERALS = {"t": "rue", "f": "alse", "n": "ull", "N": "aN", "I": "nfinity"}

# what the innermost container expects next (outside strings, numbers and literals)
_VALUE, _VALUE_OR_CLOSE, _KEY, _KEY_OR_CLOSE, _COLON, _AFTER = range(6)
# the token being read
(_NONE, _STRING, _ESCAPE, _UNICODE, _LITERAL, _SIGN, _ZERO, _INT, _DOT, _FRAC, _E, _ESIGN,
 _EXP) = range(13)


class JsonPrefix:
    __slots__ = ("_closers", "_expect", "_key", "_left", "_mode", "end", "state")

    def __init__(self) -> None:
        self._closers: list[str] = []  # "}" / "]" of each open container, innermost last
        self._expect = _VALUE
        self._mode = _NONE
        self._key = False  # the string being read is an object key
        self._left = ""  # a literal's characters still to come; "xxxx": \\u hex digits
        self.state = VIABLE
        self.end = -1

    def feed(self, text: str, start: int = 0) -> str:
        """Read ``text[start:]``, the characters after those already read; the state after
        them. The first character read must open the object or array."""
        if self.state != VIABLE:
            return self.state
        for i in range(start, len(text)):
            if not self._step(text[i]):
                self.state = INVALID
                return INVALID
            if not self._closers:  # the outermost bracket closed
                self.state, self.end = COMPLETE, i + 1
                return COMPLETE
        return VIABLE

    def _step(self, ch: str) -> bool:
        mode = self._mode
        if mode == _STRING:
            if ch == '"':
                self._mode = _NONE
                self._expect = _COLON if self._key else _AFTER
            elif ch == "\\":
                self._mode = _ESCAPE
            elif ch < " ":  # strict: a control character ends the scan
                return False
            return True
        if mode == _ESCAPE:
            if ch == "u":
                self._mode, self._left = _UNICODE, "xxxx"
                return True
            self._mode = _STRING
            return ch in _ESCAPES
        if mode == _UNICODE:
            self._left = self._left[1:]
            if not self._left:
                self._mode = _STRING
            return ch in _HEX
        if mode == _LITERAL:
            if ch != self._left[0]:
                return False
            self._left = self._left[1:]
            if not self._left:
                self._mode, self._expect = _NONE, _AFTER
            return True
        if mode != _NONE and not self._number(ch):
            return False
        if self._mode != _NONE:
            return True
        return self._structure(ch)

    def _number(self, ch: str) -> bool:
        """A character while a number is read: False if the text cannot be JSON; else the
        mode says whether ``ch`` was part of it (still a number) or follows it (_NONE)."""
        mode = self._mode
        if mode == _SIGN:
            if ch == "I":
                self._mode, self._left = _LITERAL, "nfinity"
            elif ch in _DIGITS:
                self._mode = _ZERO if ch == "0" else _INT
            else:
                return False
        elif mode in (_DOT, _ESIGN):  # digits must come (the scanner would back off to a
            if ch not in _DIGITS:  # '.' or 'e', which cannot follow a value)
                return False
            self._mode = _FRAC if mode == _DOT else _EXP
        elif mode == _E:
            if ch in "+-":
                self._mode = _ESIGN
            elif ch in _DIGITS:
                self._mode = _EXP
            else:
                return False
        elif ch in _DIGITS and mode != _ZERO:  # _INT, _FRAC, _EXP
            pass
        elif ch == "." and mode in (_ZERO, _INT):
            self._mode = _DOT
        elif ch in "eE" and mode != _EXP:
            self._mode = _E
        else:  # the number ended before ch
            self._mode, self._expect = _NONE, _AFTER
        return True

    def _structure(self, ch: str) -> bool:
        if not self._closers and self._expect == _VALUE:  # the first character
            return ch in "{[" and self._open(ch)
        if ch in _WS:
            return True
        expect = self._expect
        if expect == _COLON:
            self._expect = _VALUE
            return ch == ":"
        if expect == _AFTER:
            if ch == ",":
                self._expect = _KEY if self._closers[-1] == "}" else _VALUE
                return True
            return ch == self._closers[-1] and self._close()
        if expect in (_KEY, _KEY_OR_CLOSE):
            if ch == '"':
                self._mode, self._key = _STRING, True
                return True
            return ch == "}" and expect == _KEY_OR_CLOSE and self._close()
        if ch == "]" and expect == _VALUE_OR_CLOSE:
            return self._close()
        return self._value(ch)

    def _value(self, ch: str) -> bool:
        if ch in "{[":
            return self._open(ch)
        if ch == '"':
            self._mode, self._key = _STRING, False
        elif ch == "-":
            self._mode = _SIGN
        elif ch in _DIGITS:
            self._mode = _ZERO if ch == "0" else _INT
        elif ch in _LITERALS:
            self._mode, self._left = _LITERAL, _LITERALS[ch]
        else:
            return False
        return True

    def _open(self, ch: str) -> bool:
        self._closers.append("}" if ch == "{" else "]")
        self._expect = _KEY_OR_CLOSE if ch == "{" else _VALUE_OR_CLOSE
        return True

    def _close(self) -> bool:
        self._closers.pop()
        self._expect = _AFTER
        return True
