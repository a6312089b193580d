"""String formatting under the render budget: ``fmt % args`` and ``str.format``/``format_map``.

A conversion can be far larger than its inputs (``'%2000000000d' % 1`` is 2 GB), so each one
is sized from its width and precision and the size of the value it prints, and the whole
result is reserved before Python builds it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from jinja2.sandbox import SandboxedFormatter
from markupsafe import EscapeFormatter, Markup

from .template_budget import Budget, BudgetExceeded, str_units

__all__ = ["FormatCall", "predict_printf"]

_DIGITS = re.compile(r"\d+")
_FLOAT_DIGITS = 320  # '%f' % 1e308 prints 309 digits before the point
_ESCAPE_GROWTH = 6  # markupsafe: '"' -> '&#34;'


def _number(digits: str, budget: Budget) -> int:
    # CPython refuses widths beyond Py_ssize_t itself; anything with more than 9 digits is
    # beyond our budget anyway, and int() of a huge digit run would itself be slow.
    if len(digits) > 9:
        raise BudgetExceeded(f"a format width or precision of {len(digits)} digits")
    return int(digits)


def _spec_arg(args: Any, index: int) -> tuple[Any, int]:
    if isinstance(args, tuple):
        if index < len(args):
            return args[index], index + 1
        return None, index + 1
    return (args if index == 0 else None), index + 1


def _spec_field(text: str, pos: int, args: Any, arg_index: int, budget: Budget
                ) -> tuple[int, int, int]:
    """A %-spec's width or precision at ``pos``: ``*`` (taken from the arguments) or digits.
    -> (value, position after it, next argument index); 0 when neither is there."""
    if pos < len(text) and text[pos] == "*":
        value, arg_index = _spec_arg(args, arg_index)
        return (abs(value) if isinstance(value, int) else 0), pos + 1, arg_index
    if m := _DIGITS.match(text, pos):
        return _number(m.group(), budget), m.end(), arg_index
    return 0, pos, arg_index


def predict_printf(budget: Budget, fmt: str | bytes, args: Any, *, escape: bool = False) -> int:
    """Upper bound (bytes) of ``fmt % args``, following CPython's conversion-spec grammar:
    ``%[(key)][flags][width|*][.precision|*][hlL]type``."""
    text = fmt.decode("latin-1") if isinstance(fmt, bytes) else fmt
    budget._iterate(text.count("%") // 2 + 1)  # the specs are walked here in Python
    growth = _ESCAPE_GROWTH if escape else 1
    total = str_units(fmt)
    n, pos, arg_index = len(text), 0, 0
    while (pos := text.find("%", pos)) != -1:
        pos += 1
        key = None
        if pos < n and text[pos] == "(":
            depth, start = 1, pos + 1
            pos += 1
            while pos < n and depth:
                depth += {"(": 1, ")": -1}.get(text[pos], 0)
                pos += 1
            key = text[start : pos - 1]
        while pos < n and text[pos] in "-+ #0":
            pos += 1
        width, pos, arg_index = _spec_field(text, pos, args, arg_index, budget)
        prec = 0
        if pos < n and text[pos] == ".":
            prec, pos, arg_index = _spec_field(text, pos + 1, args, arg_index, budget)
        while pos < n and text[pos] in "hlL":
            pos += 1
        if pos >= n:
            break
        conv = text[pos]
        pos += 1
        if conv == "%":
            total += width + 1
            continue
        if key is not None and isinstance(args, Mapping):
            value = args.get(key)
        else:
            value, arg_index = _spec_arg(args, arg_index)
        if conv in "sra":
            size = budget._measure(value) * (10 if conv == "a" else 1) * growth
        else:  # numbers: digits, a sign, an exponent, the precision's digits
            size = _FLOAT_DIGITS + prec
            if isinstance(value, int):
                size += budget._measure(value) * 4  # %o/%x of a negative or %c: a few per digit
        total += 4 * (max(width, size) + 1)
        budget._reserve(total, "a %-formatted string")
    return total


def printf(budget: Budget, fmt: str | bytes, args: Any) -> Any:
    budget._reserve(predict_printf(budget, fmt, args, escape=isinstance(fmt, Markup)),
                    "a %-formatted string")
    return budget._account(fmt % args)


def _spec_size(spec: str, budget: Budget) -> int:
    # A standard spec is [[fill]align][sign][z][#][0][width][,_][.precision][type]; a custom
    # __format__ may read digits differently, so every digit run counts as a width.
    return sum(_number(d, budget) for d in _DIGITS.findall(spec)) + _FLOAT_DIGITS


class _Formatter(SandboxedFormatter):
    """Jinja's sandboxed formatter (attribute lookups through the sandbox) that sizes each
    field before formatting it."""

    def __init__(self, env: Any, budget: Budget, **kwargs: Any) -> None:
        super().__init__(env, **kwargs)
        self._budget = budget

    def convert_field(self, value: Any, conversion: str | None) -> Any:
        if conversion in ("r", "s", "a"):
            self._budget._reserve(self._budget._measure(value) * 10, "a formatted field")
        return self._budget._account(super().convert_field(value, conversion))

    def format_field(self, value: Any, format_spec: str) -> Any:
        size = _spec_size(format_spec, self._budget) + 2 * self._budget._measure(value)
        self._budget._reserve(4 * size, "a formatted field")
        return self._budget._account(super().format_field(value, format_spec))


class _EscapeFormatter(_Formatter, EscapeFormatter):
    pass


class FormatCall:
    """What the sandbox hands out for ``s.format`` / ``s.format_map``: it only runs through the
    environment's ``call`` (which passes the render's budget)."""

    __slots__ = ("text", "is_map")

    def __init__(self, text: str, is_map: bool) -> None:
        self.text = text
        self.is_map = is_map

    def __repr__(self) -> str:
        return f"<format method of {type(self.text).__name__}>"

    def _run(self, env: Any, budget: Budget, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self.is_map:
            if kwargs or len(args) != 1:
                raise TypeError("format_map() takes exactly one positional argument")
            args, kwargs = (), args[0]
        if isinstance(self.text, Markup):
            formatter: _Formatter = _EscapeFormatter(env, budget, escape=self.text.escape)
        else:
            formatter = _Formatter(env, budget)
        budget._iterate(self.text.count("{") // 2 + 1)  # a Python call per field
        budget._reserve(str_units(self.text), "a formatted string")
        return budget._account(type(self.text)(formatter.vformat(self.text, args, kwargs)))
