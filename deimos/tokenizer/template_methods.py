"""Methods of built-in values (str, bytes, list, tuple, dict, int, float, set, range) that a
template may call, each with a rule that sizes what it will build before it runs.

A rule gets ``(budget, self, args, kwargs)``, reserves the predicted size of the result (or
refuses) and returns the arguments to call with (``join`` materializes a lazy argument once,
under the iteration budget). A method of these types that is not listed here (the mutators
the sandbox already hides, and anything a newer Python adds) is refused.
"""

from __future__ import annotations

import codecs
import types
from collections.abc import Callable, Mapping
from typing import Any

from jinja2.sandbox import SecurityError
from markupsafe import Markup

from .template_budget import Budget, BudgetExceeded, budget_iter, str_units

__all__ = ["MethodCall", "resolve_method"]

Args = tuple[tuple[Any, ...], dict[str, Any]]
Rule = Callable[[Budget, Any, tuple[Any, ...], dict[str, Any]], Args]

_SLOT = 8
_STR_OBJECT = 64  # a new small str: header plus its list slot
_DICT_ENTRY = 100

# Codecs whose output is a small multiple of their input and whose cost is linear; others
# (punycode is quadratic, the escape codecs grow tenfold) are refused.
_CODECS = {"utf-8", "utf-16", "utf-16-le", "utf-16-be", "utf-32", "utf-32-le", "utf-32-be",
           "ascii", "iso8859-1", "cp1252"}
_ASCII_WHITESPACE = " \t\n\r\x0b\x0c\x1c\x1d\x1e\x1f"
_ASCII_LINE_BREAKS = "\n\r\x0b\x0c\x1c\x1d\x1e"


def _arg(args: tuple[Any, ...], kwargs: dict[str, Any], i: int, name: str, default: Any) -> Any:
    if len(args) > i:
        return args[i]
    return kwargs.get(name, default)


def _wide(*values: Any) -> int:
    """Bytes per character of a string built from these (1 if all ASCII, else 4)."""
    for v in values:
        if isinstance(v, str) and not v.isascii():
            return 4
    return 1


def _same(budget: Budget, obj: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Args:
    return args, kwargs


def _operands(budget: Budget, obj: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Args:
    budget._operand(obj)
    for a in (*args, *kwargs.values()):
        budget._operand(a)
    return args, kwargs


def _linear(factor: int) -> Rule:
    def rule(budget: Budget, obj: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Args:
        size = len(obj) if isinstance(obj, str) and obj.isascii() else factor * str_units(obj)
        budget._reserve(size, "a string")
        return args, kwargs

    return rule


def _pad(budget: Budget, obj: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Args:
    width = _arg(args, kwargs, 0, "width", 0)
    if isinstance(width, int):
        fill = _arg(args, kwargs, 1, "fillchar", " ")
        budget._reserve(max(width, len(obj)) * _wide(obj, fill), "a padded string")
    return args, kwargs


def _expandtabs(budget: Budget, obj: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Args:
    tabsize = _arg(args, kwargs, 0, "tabsize", 8)
    if isinstance(tabsize, int):
        tab = "\t" if isinstance(obj, str) else b"\t"
        budget._reserve((len(obj) + obj.count(tab) * max(tabsize, 0)) * _wide(obj),
                        "an expandtabs() result")
    return args, kwargs


def _replace(budget: Budget, obj: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Args:
    old = _arg(args, kwargs, 0, "old", None)
    new = _arg(args, kwargs, 1, "new", None)
    count = _arg(args, kwargs, 2, "count", -1)
    if type(old) is type(new) and isinstance(old, (str, bytes)) and isinstance(count, int):
        hits = len(obj) + 1 if not old else obj.count(old)
        if count >= 0:
            hits = min(hits, count)
        size = len(obj) + hits * max(len(new) - len(old), 0)
        budget._reserve(size * _wide(obj, new), "a replace() result")
    return args, kwargs


def _join(budget: Budget, obj: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Args:
    if len(args) != 1 or kwargs:
        return args, kwargs
    items = list(budget_iter(budget, args[0]))
    escape = isinstance(obj, Markup)
    size = len(obj) * max(len(items) - 1, 0)
    for item in items:
        if isinstance(item, (str, bytes)):
            size += str_units(item) * (6 if escape else 1)
        elif escape:  # Markup.join escapes str() of anything
            size += 6 * budget._str_cost(item)
    budget._reserve(size * _wide(obj), "a join() result")
    return (items,), {}


def _pieces(budget: Budget, obj: Any, pieces: int, maxsplit: Any) -> None:
    if isinstance(maxsplit, int) and maxsplit >= 0:
        pieces = min(pieces, maxsplit + 1)
    budget._iterate(pieces)
    budget._reserve(pieces * _STR_OBJECT + str_units(obj), "a split() result")


def _split(budget: Budget, obj: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Args:
    sep = _arg(args, kwargs, 0, "sep", None)
    maxsplit = _arg(args, kwargs, 1, "maxsplit", -1)
    if sep is None:
        if isinstance(obj, str) and not obj.isascii():
            pieces = len(obj) // 2 + 1
        else:
            ws = _ASCII_WHITESPACE if isinstance(obj, str) else _ASCII_WHITESPACE.encode()
            pieces = sum(obj.count(c) for c in ws) + 1
    elif isinstance(sep, type(obj)) and sep:
        pieces = obj.count(sep) + 1
    else:
        return args, kwargs  # Python raises on an empty or mistyped separator
    _pieces(budget, obj, pieces, maxsplit)
    return args, kwargs


def _splitlines(budget: Budget, obj: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Args:
    if isinstance(obj, str) and not obj.isascii():
        pieces = len(obj) + 1
    else:
        breaks = _ASCII_LINE_BREAKS if isinstance(obj, str) else b"\n\r"
        pieces = sum(obj.count(c) for c in breaks) + 1
    _pieces(budget, obj, pieces, -1)
    return args, kwargs


def _partition(budget: Budget, obj: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Args:
    budget._reserve(str_units(obj) + 3 * _STR_OBJECT, "a partition() result")
    return args, kwargs


def _translate(budget: Budget, obj: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Args:
    table = _arg(args, kwargs, 0, "table", None)
    longest = 1
    if isinstance(table, Mapping):
        values: Any = table.values()
    elif isinstance(table, (list, tuple)):
        values = table
    else:
        values = ()
    for v in budget_iter(budget, values):
        if isinstance(v, (str, bytes)):
            longest = max(longest, str_units(v))
    budget._reserve(len(obj) * longest * 4, "a translate() result")
    return args, kwargs


def _maketrans(budget: Budget, obj: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Args:
    size = sum(len(a) for a in args if isinstance(a, (str, bytes, Mapping)))
    budget._iterate(size)
    budget._reserve(size * _DICT_ENTRY, "a maketrans() table")
    return args, kwargs


def _codec(name: Any) -> None:
    try:
        canonical = codecs.lookup(name).name if isinstance(name, str) else None
    except LookupError:
        return  # Python raises its own LookupError
    if canonical not in _CODECS:
        raise SecurityError(f"the {name!r} codec is not available to chat templates")


def _encode(budget: Budget, obj: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Args:
    _codec(_arg(args, kwargs, 0, "encoding", "utf-8"))
    budget._reserve(10 * len(obj) + 4, "an encoded string")  # errors='backslashreplace'
    return args, kwargs


def _decode(budget: Budget, obj: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Args:
    _codec(_arg(args, kwargs, 0, "encoding", "utf-8"))
    budget._reserve(16 * len(obj) + 4, "a decoded string")
    return args, kwargs


def _copy_slots(budget: Budget, obj: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Args:
    per = _DICT_ENTRY if isinstance(obj, Mapping) else _SLOT
    budget._reserve(per * len(obj) + 64, "a copy")
    return args, kwargs


def _fromkeys(budget: Budget, obj: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Args:
    if not args:
        return args, kwargs
    keys = list(budget_iter(budget, args[0]))
    budget._operand(keys)  # every key is hashed
    budget._reserve(_DICT_ENTRY * len(keys) + 64, "a fromkeys() dict")
    return (keys, *args[1:]), kwargs


def _set_op(budget: Budget, obj: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Args:
    items = [list(budget_iter(budget, a)) for a in args]
    for a in items:
        budget._operand(a)
    budget._reserve(_SLOT * (len(obj) + sum(len(a) for a in items)) * 4, "a set")
    return tuple(items), kwargs


def _to_bytes(budget: Budget, obj: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Args:
    length = _arg(args, kwargs, 0, "length", 1)
    if isinstance(length, int):
        budget._reserve(length, "a to_bytes() result")
    return args, kwargs


def _from_bytes(budget: Budget, obj: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Args:
    data = _arg(args, kwargs, 0, "bytes", b"")
    if isinstance(data, (bytes, str)) and 8 * len(data) > budget.limits.max_int_bits:
        raise BudgetExceeded(f"an integer of more than {budget.limits.max_int_bits} bits")
    return args, kwargs


def _hex(budget: Budget, obj: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Args:
    budget._reserve(3 * len(obj) + 2, "a hex() string")
    return args, kwargs


def _escape(budget: Budget, obj: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Args:
    budget._reserve(6 * sum(budget._measure(a) for a in args), "an escaped string")
    return args, kwargs


def _striptags(budget: Budget, obj: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Args:
    budget._iterate(obj.count("<"))  # markupsafe walks tag by tag in Python
    return _linear(1)(budget, obj, args, kwargs)


_CHEAP_STR = {
    "count", "endswith", "find", "index", "isalnum", "isalpha", "isascii", "isdecimal",
    "isdigit", "isidentifier", "islower", "isnumeric", "isprintable", "isspace", "istitle",
    "isupper", "rfind", "rindex", "startswith",
}
_STR_RULES: dict[str, Rule] = {name: _same for name in _CHEAP_STR}
_STR_RULES.update({
    "capitalize": _linear(3), "casefold": _linear(3), "lower": _linear(3), "upper": _linear(3),
    "swapcase": _linear(3), "title": _linear(3),
    "lstrip": _linear(1), "rstrip": _linear(1), "strip": _linear(1),
    "removeprefix": _linear(1), "removesuffix": _linear(1), "unescape": _linear(1),
    "center": _pad, "ljust": _pad, "rjust": _pad, "zfill": _pad,
    "expandtabs": _expandtabs, "replace": _replace, "join": _join,
    "split": _split, "rsplit": _split, "splitlines": _splitlines,
    "partition": _partition, "rpartition": _partition,
    "translate": _translate, "maketrans": _maketrans,
    "encode": _encode, "decode": _decode, "hex": _hex, "fromhex": _linear(1),
    "escape": _escape, "striptags": _striptags,
})
_SEQ_RULES: dict[str, Rule] = {"count": _operands, "index": _operands, "copy": _copy_slots}
_DICT_RULES: dict[str, Rule] = {
    "get": _operands, "items": _same, "keys": _same, "values": _same, "copy": _copy_slots,
    "fromkeys": _fromkeys,
}
_INT_RULES: dict[str, Rule] = {
    "as_integer_ratio": _same, "bit_count": _same, "bit_length": _same, "conjugate": _same,
    "is_integer": _same, "to_bytes": _to_bytes, "from_bytes": _from_bytes, "hex": _same,
    "fromhex": _same,
}
_SET_RULES: dict[str, Rule] = {
    name: _set_op for name in ("difference", "intersection", "symmetric_difference", "union",
                               "isdisjoint", "issubset", "issuperset")
}
_SET_RULES["copy"] = _copy_slots

_RULES: tuple[tuple[type | tuple[type, ...], dict[str, Rule]], ...] = (
    ((str, bytes), _STR_RULES),
    (dict, _DICT_RULES),
    ((list, tuple, range), _SEQ_RULES),
    ((int, float), _INT_RULES),
    ((set, frozenset), _SET_RULES),
    ((type({}.keys()), type({}.items())), {"isdisjoint": _set_op}),
)


def _rules_for(owner: Any) -> dict[str, Rule] | None:
    cls = owner if isinstance(owner, type) else type(owner)
    for types_, rules in _RULES:
        if issubclass(cls, types_):
            return rules
    return None


class MethodCall:
    """A call of a built-in method resolved to its receiver and its rule."""

    __slots__ = ("func", "owner", "name", "rule")

    def __init__(self, func: Callable[..., Any], owner: Any, name: str, rule: Rule) -> None:
        self.func, self.owner, self.name, self.rule = func, owner, name, rule

    def run(self, budget: Budget, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        args, kwargs = self.rule(budget, self.owner, args, kwargs)
        result = self.func(*args, **kwargs)
        return budget._account(result, fresh=result is not self.owner and self.name != "get")


def resolve_method(obj: Any, args: tuple[Any, ...]) -> MethodCall | None:
    """The rule for calling ``obj`` when it is a method of a built-in value type; None when it
    is something else; SecurityError for a method of those types that is not allowed."""
    if isinstance(obj, types.MethodDescriptorType):  # unbound: dict.get(d, key)
        rules = _rules_for(obj.__objclass__)
        if rules is None:
            return None
        rule = rules.get(obj.__name__)
        if rule is None or not args or not isinstance(args[0], obj.__objclass__):
            raise SecurityError(f"calling {obj.__objclass__.__name__}.{obj.__name__} is not "
                                "allowed in a chat template")
        bound = getattr(args[0], obj.__name__)
        return _Unbound(bound, args[0], obj.__name__, rule)
    if not isinstance(obj, (types.BuiltinMethodType, types.MethodType)):
        return None
    owner = obj.__self__
    if owner is None and obj.__qualname__ in ("str.maketrans", "bytes.maketrans"):
        return MethodCall(obj, "", "maketrans", _maketrans)
    rules = _rules_for(owner)
    if rules is None:
        return None
    rule = rules.get(obj.__name__)
    if rule is None:
        kind = owner.__name__ if isinstance(owner, type) else type(owner).__name__
        raise SecurityError(f"calling {kind}.{obj.__name__} is not allowed in a chat template")
    return MethodCall(obj, owner, obj.__name__, rule)


class _Unbound(MethodCall):
    """``dict.get(d, k)``: the receiver is the first argument."""

    __slots__ = ()

    def run(self, budget: Budget, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return super().run(budget, args[1:], kwargs)
