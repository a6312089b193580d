"""The template's arithmetic operators under the render budget: each result is sized from its
operands before Python computes it (repeat counts, lengths, integer bit lengths)."""

from __future__ import annotations

import operator
from collections.abc import Set
from typing import Any

from markupsafe import Markup

from .template_budget import Budget, BudgetExceeded, str_units
from .template_format import printf

__all__ = ["OPERATORS", "binop"]

OPERATORS = {
    "+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv,
    "//": operator.floordiv, "**": operator.pow, "%": operator.mod,
}


def _is_int(v: Any) -> bool:
    return isinstance(v, int)


def _units_per_item(seq: Any) -> int:
    if isinstance(seq, (list, tuple)):
        return 8
    return 1 if isinstance(seq, bytes) or seq.isascii() else 4


def _check_bits(budget: Budget, bits: int, what: str) -> None:
    if bits > budget.limits.max_int_bits:
        raise BudgetExceeded(f"{what} would exceed {budget.limits.max_int_bits} bits")


def binop(budget: Budget, op: str, left: Any, right: Any) -> Any:
    budget._tick()
    if op == "%" and isinstance(left, (str, bytes)):
        return printf(budget, left, right)
    if op == "*":
        for seq, n in ((left, right), (right, left)):
            if isinstance(seq, (str, bytes, list, tuple)) and _is_int(n):
                budget._reserve(len(seq) * max(n, 0) * _units_per_item(seq), "a repeated sequence")
        if _is_int(left) and _is_int(right):
            _check_bits(budget, left.bit_length() + right.bit_length(), "a product")
    elif op == "**":
        if _is_int(left) and _is_int(right) and right > 0 and abs(left) > 1:
            _check_bits(budget, (left.bit_length() - 1) * right + 1, f"{left} ** {right}")
    elif op == "+":
        if isinstance(left, (str, bytes)) and isinstance(right, (str, bytes)):
            # Markup escapes the other side (either way round: Markup.__radd__ runs first)
            grow = 6 if isinstance(left, Markup) != isinstance(right, Markup) else 1
            wide = 4 if str_units(left) != len(left) or str_units(right) != len(right) else 1
            budget._reserve(wide * grow * (len(left) + len(right)), "a concatenation")
        elif isinstance(left, (list, tuple)) and isinstance(right, (list, tuple)):
            budget._reserve(8 * (len(left) + len(right)), "a concatenation")
        elif isinstance(left, Markup):
            budget._reserve(str_units(left) + 6 * 4 * budget._measure(right), "a concatenation")
    elif op == "-" and (isinstance(left, Set) or isinstance(right, Set)):
        for side in (left, right):
            budget._operand(list(side) if isinstance(side, Set) else side)
        budget._reserve(8 * sum(len(s) for s in (left, right) if hasattr(s, "__len__")) * 4,
                        "a set difference")
    return budget._account(OPERATORS[op](left, right))
