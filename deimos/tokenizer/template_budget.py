"""The work budget of one chat-template render: limits, counters, a deadline, value sizes.

A template is untrusted code. Every operation it can reach either predicts the size of what it
is about to build and reserves it here before running (``_reserve``), or is charged after
(``_account``); every charge point also checks the wall-clock deadline, so nothing runs long
between two checks. Sizes are counted in bytes: one per character of an ASCII string, four
per character of any other (CPython's widest layout), eight per container slot, so the
cumulative count bounds the memory a render can hold.

Values can be larger than they look: ``[s] * 1000`` is 1000 slots that print as 1000 copies
of ``s``, and nesting a tuple in itself 100 000 times makes ``hash()`` overflow the C stack.
``_measure`` walks a value once per distinct object (shared parts are counted by reference,
not re-walked) and bounds its printed size, its expanded node count and its nesting depth
before anything prints, compares or hashes it.

Methods start with '_' so the sandbox hides them from the template (it refuses attribute
names starting with an underscore).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import jinja2
from jinja2.utils import Namespace

__all__ = ["Budget", "BudgetExceeded", "TemplateLimits"]


@dataclass(frozen=True)
class TemplateLimits:
    """Per-render limits. Real templates loop over messages, tools and tool parameters and
    render prompts of at most a few MB in milliseconds: these are far above legitimate use and
    keep a hostile template near 1 s and 100 MB."""

    time_s: float = 1.0  # wall clock of one render (the load-time probe shares one)
    max_bytes: int = 32_000_000  # built by operators, calls, filters over the whole render
    max_output: int = 8_000_000  # characters emitted, captured blocks and macro bodies included
    max_iterations: int = 200_000  # loop iterations and items walked by filters
    max_range: int = 20_000  # items of one range()
    max_int_bits: int = 4_096  # integers built by the template
    max_depth: int = 64  # macro / recursive-loop / block call depth
    max_nesting: int = 64  # nesting of a value printed, compared or hashed
    max_nodes: int = 1_000_000  # expanded elements of a value printed, compared or hashed


class BudgetExceeded(Exception):
    """A render ran out of budget; the message names the limit."""


# An object whose repr does not show its contents (cycler, joiner, macro, loop, generator...)
_OPAQUE_REPR = 80
_FLOAT_REPR = 24  # repr(-1.2345678901234567e-308)
_TICK_EVERY = 4096  # walked nodes between two deadline checks


def str_units(s: str | bytes) -> int:
    """Bytes a string holds (an upper bound: non-ASCII counted at four per character)."""
    if isinstance(s, str) and not s.isascii():
        return 4 * len(s)
    return len(s)


def int_digits(n: int) -> int:
    return n.bit_length() * 30103 // 100_000 + 2  # log10(2) per bit, and a sign


class Budget:
    __slots__ = ("limits", "deadline", "bytes", "output", "iterations", "depth")

    def __init__(self, limits: TemplateLimits) -> None:
        self.limits = limits
        self.deadline = time.monotonic() + limits.time_s
        self.bytes = 0
        self.output = 0
        self.iterations = 0
        self.depth = 0

    # -- charge points ---------------------------------------------------------------------

    def _tick(self) -> None:
        if time.monotonic() > self.deadline:
            raise BudgetExceeded(f"took longer than {self.limits.time_s:g} s")

    def _iterate(self, n: int = 1) -> None:
        self.iterations += n
        if self.iterations > self.limits.max_iterations:
            raise BudgetExceeded(f"more than {self.limits.max_iterations} loop iterations")
        self._tick()

    def _reserve(self, n: int, what: str = "a value") -> None:
        """Refuse to build something predicted to take ``n`` bytes when the budget lacks them."""
        if self.bytes + n > self.limits.max_bytes:
            raise BudgetExceeded(
                f"{what} of about {n} bytes would exceed the {self.limits.max_bytes}-byte limit"
            )
        self._tick()

    def _charge(self, n: int) -> None:
        self.bytes += n
        if self.bytes > self.limits.max_bytes:
            raise BudgetExceeded(f"built more than {self.limits.max_bytes} bytes")
        self._tick()

    def _emit(self, n: int) -> None:
        self.output += n
        if self.output > self.limits.max_output:
            raise BudgetExceeded(f"output longer than {self.limits.max_output} characters")
        self._tick()

    def _enter(self) -> None:
        self.depth += 1
        if self.depth > self.limits.max_depth:
            raise BudgetExceeded(f"calls nested more than {self.limits.max_depth} deep")
        self._tick()

    def _leave(self) -> None:
        self.depth -= 1

    def _check_int(self, n: int) -> None:
        if n.bit_length() > self.limits.max_int_bits:
            raise BudgetExceeded(f"an integer of more than {self.limits.max_int_bits} bits")

    # -- after a call: charge what it built -------------------------------------------------

    def _account(self, value: Any, *, fresh: bool = True) -> Any:
        """Charge a value an operation returned (``fresh``: it was built, not looked up) and
        put a lazy iterator under the iteration budget."""
        if isinstance(value, bool) or value is None:
            return value
        if isinstance(value, int):
            self._check_int(value)
            if fresh:
                self._charge(value.bit_length() // 8)
            return value
        if isinstance(value, (str, bytes)):
            if fresh:
                self._charge(str_units(value))
            return value
        if isinstance(value, (list, tuple, set, frozenset)):
            if fresh:
                self._charge(8 * len(value) + 56)
            return value
        if isinstance(value, dict):
            if fresh:
                self._charge(100 * len(value) + 64)
            return value
        if isinstance(value, Iterator) and not isinstance(value, GuardedIterator):
            return GuardedIterator(value, self)
        self._tick()
        return value

    # -- sizes of existing values ------------------------------------------------------------

    def _measure(self, value: Any) -> int:
        """An upper bound on ``len(str(value))``. Raises when the value expands beyond
        ``max_nodes`` elements or nests beyond ``max_nesting``."""
        if isinstance(value, str):
            if type(value) is not str:
                return _str_repr_bound(value, json=False, ascii_only=False)
            return len(value)
        return _Measure(self, json=False, ascii_only=False).run(value)

    def _measure_json(self, value: Any, *, ascii_only: bool) -> tuple[int, bool]:
        """An upper bound on the length of ``value``'s JSON text (with json.dumps' default
        separators; limits as ``_measure``), and whether it holds for the whole text: False
        when the value has a part only its own iteration sizes (a lazy sequence), whose JSON
        must then be charged as it is produced."""
        if isinstance(value, str):
            return _str_repr_bound(value, json=True, ascii_only=ascii_only), True
        m = _Measure(self, json=True, ascii_only=ascii_only)
        return m.run(value), not m.opaque

    def _str_cost(self, value: Any) -> int:
        """Bytes that ``str(value)`` will allocate: nothing for a plain str, else its size."""
        if type(value) is str:
            return 0
        if isinstance(value, (bool, int, float)) or value is None:
            return 32 + (int_digits(value) if isinstance(value, int) else 0)
        n = self._measure(value)
        return 4 * n

    def _operand(self, value: Any) -> Any:
        """Check a value about to be compared or hashed: its cost is its expanded size."""
        if isinstance(value, (list, tuple, dict, set, frozenset, Namespace)):
            _Measure(self, json=False, ascii_only=False).run(value)
        return value


def _str_repr_bound(s: str, *, json: bool, ascii_only: bool) -> int:
    """Upper bound on ``len(repr(s))`` or ``len(json.dumps(s))`` in linear time, no copy."""
    n = len(s)
    if s.isascii():
        if s.isprintable():  # only quotes and backslashes are escaped, by one character each
            return n + 2 + s.count("\\") + s.count('"' if json else "'")
        return 6 * n + 2  # \u001f (json) / \x1f (repr)
    if json and ascii_only:
        return 12 * n + 2  # an astral character is a surrogate pair of \uXXXX
    return 10 * n + 2  # \U000e0001 (repr); json without ensure_ascii keeps it


class _Measure:
    """One walk over a value graph, memoized by object identity (shared parts are sized once
    and counted once per reference). A cycle counts as the ``[...]`` Python prints for it."""

    __slots__ = ("budget", "json", "ascii_only", "sizes", "active", "walked", "opaque")

    def __init__(self, budget: Budget, *, json: bool, ascii_only: bool) -> None:
        self.budget = budget
        self.json = json
        self.ascii_only = ascii_only
        self.sizes: dict[int, tuple[int, int]] = {}  # id -> (printed size, expanded nodes)
        self.active: set[int] = set()
        self.walked = 0
        self.opaque = False  # a value sized by a constant guess (an iterator, an object)

    def run(self, value: Any) -> int:
        size, _ = self._walk(value, 0)
        return size

    def _walk(self, value: Any, depth: int) -> tuple[int, int]:
        limits = self.budget.limits
        if isinstance(value, str):
            return _str_repr_bound(value, json=self.json, ascii_only=self.ascii_only), 1
        if isinstance(value, bool) or value is None:
            return 5, 1
        if isinstance(value, int):
            return int_digits(value), 1
        if isinstance(value, float):
            return _FLOAT_REPR, 1
        if isinstance(value, bytes):
            return 4 * len(value) + 3, 1
        children: Iterable[Any]
        if isinstance(value, Namespace):
            children = _namespace_items(value)
        elif isinstance(value, Mapping):
            children = value.items()
        elif isinstance(value, (list, tuple, set, frozenset)):
            children = value
        elif isinstance(value, jinja2.Undefined):
            return 16, 1
        else:
            self.opaque = True
            return _OPAQUE_REPR, 1
        key = id(value)
        if key in self.sizes:
            return self.sizes[key]
        if key in self.active:
            return 5, 1  # '[...]'
        if depth >= limits.max_nesting:
            raise BudgetExceeded(f"a value nested more than {limits.max_nesting} deep")
        self.active.add(key)
        size, nodes = 2, 1
        for child in children:
            self.walked += 1
            if self.walked % _TICK_EVERY == 0:
                self.budget._tick()
            if isinstance(child, tuple) and isinstance(value, (Mapping, Namespace)):
                ks, kn = self._walk(child[0], depth + 1)
                if self.json and not isinstance(child[0], str):
                    ks += 2  # JSON writes a number, true/false or null key in quotes
                vs, vn = self._walk(child[1], depth + 1)
                size, nodes = size + ks + vs + 4, nodes + kn + vn
            else:
                cs, cn = self._walk(child, depth + 1)
                size, nodes = size + cs + 2, nodes + cn
            if nodes > limits.max_nodes:
                raise BudgetExceeded(f"a value of more than {limits.max_nodes} elements")
        self.active.discard(key)
        if isinstance(value, Namespace):
            size += 16  # '<Namespace ...>'
        self.sizes[key] = (size, nodes)
        return size, nodes


def _namespace_items(ns: Namespace) -> Iterable[tuple[str, Any]]:
    # Namespace keeps its attributes in a name-mangled dict; reading it does not run template
    # code.
    attrs = object.__getattribute__(ns, "_Namespace__attrs")
    return attrs.items()


class GuardedIterator(Iterator[Any]):
    """A lazy iterator whose every item is charged as one iteration."""

    __slots__ = ("_it", "_budget")

    def __init__(self, iterable: Iterable[Any], budget: Budget) -> None:
        self._it = iter(iterable)
        self._budget = budget

    def __next__(self) -> Any:
        item = next(self._it)
        self._budget._iterate()
        return item


def budget_iter(budget: Budget, value: Any) -> Any:
    """The input of something about to walk ``value``: sized inputs are charged up front, lazy
    ones per item."""
    if isinstance(value, GuardedIterator) or isinstance(value, jinja2.Undefined):
        return value
    if hasattr(value, "__len__"):
        try:
            budget._iterate(len(value))
        except TypeError:
            pass
        return value
    if isinstance(value, Iterable):
        return GuardedIterator(value, budget)
    return value
