"""Jinja's filters, tests and globals under the render budget.

Each one is wrapped: the deadline is checked, a rule sizes what the call will build from its
arguments (widths, counts, fill values, the printed size of the value) and reserves it, and
the result is charged after. A filter or test a newer Jinja adds without a rule here gets the
conservative treatment: its arguments are walked (bounded size and nesting) and it is charged
after.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping
from datetime import datetime
from typing import Any

import jinja2
from jinja2 import pass_context
from jinja2.filters import make_attrgetter
from jinja2.utils import Cycler, Joiner, Namespace
from jinja2.utils import _PassArg, generate_lorem_ipsum  # noqa: PLC2701

from .template_budget import Budget, BudgetExceeded, budget_iter, int_digits, str_units
from .template_format import printf
from .template_methods import _join, _replace

__all__ = ["BUDGET_VAR", "budget_of", "install"]

BUDGET_VAR = "_deimos_budget"

Args = tuple[tuple[Any, ...], dict[str, Any]]
Rule = Callable[[Budget, tuple[Any, ...], dict[str, Any]], Args]


class TemplateRaised(Exception):
    """Carries the message of ``raise_exception(msg)`` out of the Jinja machinery."""


def budget_of(ctx: jinja2.runtime.Context) -> Budget:
    b = ctx.get(BUDGET_VAR)
    if not isinstance(b, Budget):  # the template rebound the name
        raise BudgetExceeded(f"template overwrote the reserved name {BUDGET_VAR!r}")
    return b


def _arg(args: tuple[Any, ...], kwargs: dict[str, Any], i: int, name: str, default: Any) -> Any:
    return args[i] if len(args) > i else kwargs.get(name, default)


def _text_units(budget: Budget, value: Any) -> int:
    if isinstance(value, str):
        return str_units(value)
    return 4 * budget._measure(value)


_SPLITTERS = " \t\n\r\x0b\x0c\x1c\x1d\x1e\x1f-({[<"


def _pieces(text: str) -> int:
    """Upper bound on the words Python-level filters (title, wordwrap, urlize, striptags)
    split a string into and walk one by one."""
    if not text.isascii():
        return len(text) + 1
    return 2 * sum(text.count(c) for c in _SPLITTERS) + 1


def _words(factor: int) -> Rule:
    """A string filter that walks the words of its value in Python, building a list of them."""

    def rule(budget: Budget, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Args:
        _text(factor)(budget, args, kwargs)
        if args and isinstance(args[0], str):
            pieces = _pieces(args[0])
            budget._iterate(pieces)
            budget._reserve(64 * pieces, "a word list")
        return args, kwargs

    return rule


# -- rules -----------------------------------------------------------------------------------


def _same(budget: Budget, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Args:
    return args, kwargs


def _walked(budget: Budget, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Args:
    """Unknown or comparing: every argument is bounded in size and nesting."""
    for a in (*args, *kwargs.values()):
        budget._operand(a)
    return args, kwargs


def _text(factor: int) -> Rule:
    """A filter that turns its value into a string at most ``factor`` times its printed size."""

    def rule(budget: Budget, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Args:
        if args:
            budget._reserve(factor * _text_units(budget, args[0]), "a filtered string")
        return args, kwargs

    return rule


def _iterates(budget: Budget, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Args:
    """A filter that walks its value: each item is one iteration."""
    if args:
        args = (budget_iter(budget, args[0]), *args[1:])
    return args, kwargs


def _compares(budget: Budget, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Args:
    """A filter that sorts, hashes or compares the items of its value."""
    if args:
        items = list(budget_iter(budget, args[0]))
        budget._operand(items)
        budget._reserve(8 * len(items) + 64, "a sorted list")
        args = (items, *args[1:])
    return args, kwargs


def _dictsort(budget: Budget, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Args:
    if args and isinstance(args[0], Mapping):
        budget._iterate(len(args[0]))
        budget._operand(args[0])
        budget._reserve(80 * len(args[0]) + 64, "a sorted list")
    return args, kwargs


def _center(budget: Budget, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Args:
    _text(1)(budget, args, kwargs)
    width = _arg(args, kwargs, 1, "width", 80)
    if isinstance(width, int):
        budget._reserve(4 * width, "a centered string")
    return args, kwargs


def _indent(budget: Budget, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Args:
    if not args:
        return args, kwargs
    width = _arg(args, kwargs, 1, "width", 4)
    text = args[0] if isinstance(args[0], str) else ""
    pad = len(width) if isinstance(width, str) else width if isinstance(width, int) else 0
    lines = text.count("\n") + text.count("\r") + 2
    budget._iterate(lines)
    budget._reserve(4 * (len(text) + max(pad, 0) * lines) + 64 * lines, "an indented string")
    return args, kwargs


def _wordwrap(budget: Budget, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Args:
    if not args or not isinstance(args[0], str):
        return args, kwargs
    text = args[0]
    width = _arg(args, kwargs, 1, "width", 79)
    wrap = _arg(args, kwargs, 3, "wrapstring", "\n")
    if isinstance(width, int) and width > 0:
        lines = len(text) // width + text.count("\n") + 2
        _words(1)(budget, args, kwargs)  # textwrap splits into chunks first
        budget._iterate(lines)
        # textwrap cuts a long word one line at a time, copying the rest of it each time
        budget._reserve(lines * len(text) // 8 + 4 * len(text) + lines * 64, "wrapped text")
        if isinstance(wrap, str):
            budget._reserve(4 * (len(text) + lines * len(wrap)), "wrapped text")
    return args, kwargs


def _replace_filter(budget: Budget, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Args:
    if args and isinstance(args[0], str):
        _replace(budget, args[0], args[1:], kwargs)
    return args, kwargs


def _truncate(budget: Budget, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Args:
    _text(1)(budget, args, kwargs)
    end = _arg(args, kwargs, 3, "end", "...")
    if isinstance(end, str):
        budget._reserve(str_units(end), "a truncated string")
    return args, kwargs


def _round(budget: Budget, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Args:
    if args and not isinstance(args[0], (int, float)):
        # Jinja computes value * 10 ** precision: a string would be repeated, not scaled
        raise TypeError(f"round() needs a number, got {type(args[0]).__name__}")
    precision = _arg(args, kwargs, 1, "precision", 0)
    if isinstance(precision, int) and abs(precision) > 400:  # 10 ** precision is computed
        raise BudgetExceeded(f"round() to {precision} digits")
    return args, kwargs


def _batch(budget: Budget, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Args:
    args, kwargs = _iterates(budget, args, kwargs)
    linecount = _arg(args, kwargs, 1, "linecount", 1)
    if isinstance(linecount, int) and _arg(args, kwargs, 2, "fill_with", None) is not None:
        budget._iterate(max(linecount, 0))  # the last batch is padded to linecount
        budget._reserve(8 * max(linecount, 0), "a padded batch")
    return args, kwargs


def _slice(budget: Budget, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Args:
    if args:
        args = (list(budget_iter(budget, args[0])), *args[1:])
    slices = _arg(args, kwargs, 1, "slices", 1)
    if isinstance(slices, int):
        budget._iterate(max(slices, 0))
        budget._reserve(72 * max(slices, 0), "slices")
    return args, kwargs


def _format(budget: Budget, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Args:
    return args, kwargs  # replaced wholesale by _do_format


def _pprint(budget: Budget, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Args:
    if args:  # indentation can repeat once per nesting level on every line
        budget._reserve(4 * budget.limits.max_nesting * budget._measure(args[0]), "pprint output")
    return args, kwargs


def _urlize(budget: Budget, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Args:
    if args:
        extra = sum(len(v) for v in (*args[1:], *kwargs.values()) if isinstance(v, str))
        text = _text_units(budget, args[0])
        _words(1)(budget, args, {})  # a regex or two per word
        budget._reserve(4 * text + (text // 2 + 1) * (64 + 2 * extra), "urlized text")
    return args, kwargs


def _wordcount(budget: Budget, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Args:
    if args:  # re.findall builds the list of words
        budget._reserve(32 * _text_units(budget, args[0]), "a word list")
    return args, kwargs


def _striptags(budget: Budget, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Args:
    _words(2)(budget, args, kwargs)  # and " ".join(value.split())
    if args and isinstance(args[0], str):
        budget._iterate(args[0].count("<"))  # markupsafe walks tag by tag in Python
    return args, kwargs


def _xmlattr(budget: Budget, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Args:
    if args:
        budget._reserve(6 * 4 * budget._measure(args[0]), "xml attributes")
    return args, kwargs


def _int(budget: Budget, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Args:
    # base-10 parsing is quadratic in the digits (CPython caps it at 4300 digits unless the
    # host lifted the cap); more digits than max_int_bits can hold are refused up front
    if args and isinstance(args[0], (str, bytes)):
        longest = int_digits(1 << budget.limits.max_int_bits) + 64  # signs, '_', spaces
        if len(args[0]) > longest:
            raise BudgetExceeded(f"int() of a {len(args[0])}-character string")
    return args, kwargs


def _number_test(budget: Budget, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Args:
    # odd/even/divisibleby compute value % n: on a string that is %-formatting
    for a in args:
        if not isinstance(a, (int, float)):
            raise TypeError(f"this test needs numbers, got {type(a).__name__}")
    return args, kwargs


def _lower_test(budget: Budget, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Args:
    if args:  # str(value).islower()
        budget._reserve(budget._str_cost(args[0]), "a string")
    return args, kwargs


_FILTER_RULES: dict[str, Rule] = {
    "abs": _same, "attr": _same, "count": _same, "length": _same, "d": _same,
    "default": _same, "first": _same, "last": _same, "random": _same, "float": _same,
    "int": _int, "filesizeformat": _same, "items": _same, "safe": _text(1),
    "capitalize": _text(3), "lower": _text(3), "upper": _text(3), "title": _words(3),
    "trim": _text(1), "string": _text(1), "e": _text(6), "escape": _text(6),
    "forceescape": _text(6), "urlencode": _text(12), "striptags": _striptags,
    "center": _center, "indent": _indent, "wordwrap": _wordwrap, "replace": _replace_filter,
    "truncate": _truncate, "round": _round, "batch": _batch, "slice": _slice,
    "list": _iterates, "map": _iterates, "select": _iterates, "reject": _iterates,
    "selectattr": _iterates, "rejectattr": _iterates, "reverse": _iterates,
    "sort": _compares, "dictsort": _dictsort, "unique": _compares, "groupby": _compares,
    "max": _compares, "min": _compares, "pprint": _pprint, "urlize": _urlize,
    "wordcount": _wordcount, "xmlattr": _xmlattr,
    # replaced below by budget-aware implementations
    "format": _format, "join": _same, "sum": _same, "tojson": _same,
}
_TEST_RULES: dict[str, Rule] = {
    "lower": _lower_test, "upper": _lower_test, "defined": _same, "undefined": _same,
    "none": _same, "boolean": _same, "false": _same, "true": _same, "integer": _same,
    "float": _same, "number": _same, "string": _same, "mapping": _same, "iterable": _same,
    "sequence": _same, "callable": _same, "sameas": _same, "escaped": _same, "filter": _same,
    "test": _same, "odd": _number_test, "even": _number_test, "divisibleby": _number_test,
}
_NOT_FRESH = {"attr", "d", "default", "first", "last", "random", "max", "min", "safe"}


# -- replacements that need the budget inside --------------------------------------------------


def _do_format(budget: Budget, value: Any, *args: Any, **kwargs: Any) -> Any:
    if args and kwargs:
        raise jinja2.FilterArgumentError(
            "can't handle positional and keyword arguments at the same time"
        )
    text = value if isinstance(value, str) else str(value)
    return printf(budget, text, kwargs or args)


def _do_join(budget: Budget, ctx: jinja2.runtime.Context, value: Any, d: Any = "",
             attribute: Any = None) -> Any:
    items: Any = budget_iter(budget, value)
    if attribute is not None:
        items = map(make_attrgetter(ctx.environment, attribute), items)
    strings = []
    for item in items:
        budget._reserve(budget._str_cost(item), "a joined item")
        strings.append(item if type(item) is str else budget._account(str(item)))
    sep = str(d)
    (strings,), _ = _join(budget, sep, (strings,), {})
    return budget._account(sep.join(strings))


def _do_sum(budget: Budget, ctx: jinja2.runtime.Context, value: Any, attribute: Any = None,
            start: Any = 0) -> Any:
    from .template_ops import binop  # the + of the sandbox, with its size checks

    items: Any = budget_iter(budget, value)
    if attribute is not None:
        items = map(make_attrgetter(ctx.environment, attribute), items)
    total = start
    for item in items:
        total = binop(budget, "+", total, item)
    return total


def _json_default(value: Any) -> Any:
    if isinstance(value, Iterator):
        return list(value)
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def _do_tojson(budget: Budget, value: Any, ensure_ascii: bool = False, indent: Any = None,
               separators: Any = None, sort_keys: bool = False) -> str:
    # HF overrides Jinja's tojson: no HTML escaping, and these keyword arguments. Beyond HF,
    # a lazy sequence (``tools | map(attribute='function')``) is written as a list, as
    # llama.cpp's Jinja engine does.
    if isinstance(indent, int) and not isinstance(indent, bool) and indent > 1024 or (
        isinstance(indent, str) and len(indent) > 1024
    ):
        raise BudgetExceeded("tojson indent wider than 1024")
    if separators is not None:
        separators = tuple(separators)  # templates pass a Jinja list
        if sum(len(s) for s in separators if isinstance(s, str)) > 1024:
            raise BudgetExceeded("tojson separators longer than 1024")
    bound, exact = budget._measure_json(value, ascii_only=bool(ensure_ascii))
    budget._reserve(bound, "JSON text")
    if isinstance(indent, float):
        raise TypeError("tojson indent must be an integer or a string")
    encoder = json.JSONEncoder(ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                               sort_keys=sort_keys, default=_json_default)
    if exact and indent is None and separators is None:  # within the bound: C encoder, one call
        text = encoder.encode(value)
        budget._charge(str_units(text))
        return text
    chunks = []
    # chunk by chunk, so a lazy part (sized only as it is produced) is charged as it grows
    for chunk in encoder.iterencode(value):
        budget._charge(str_units(chunk))
        chunks.append(chunk)
    return "".join(chunks)


_REPLACED: dict[str, Callable[..., Any]] = {
    "format": _do_format, "tojson": _do_tojson,
}
_REPLACED_CTX: dict[str, Callable[..., Any]] = {"join": _do_join, "sum": _do_sum}


# -- wrapping ----------------------------------------------------------------------------------


def _call_with(func: Callable[..., Any], ctx: jinja2.runtime.Context, args: tuple[Any, ...],
               kwargs: dict[str, Any]) -> Any:
    pass_arg = _PassArg.from_obj(func)
    if pass_arg is _PassArg.context:
        return func(ctx, *args, **kwargs)
    if pass_arg is _PassArg.eval_context:
        return func(ctx.eval_ctx, *args, **kwargs)
    if pass_arg is _PassArg.environment:
        return func(ctx.environment, *args, **kwargs)
    return func(*args, **kwargs)


def _wrap(name: str, func: Callable[..., Any], rule: Rule) -> Callable[..., Any]:
    fresh = name not in _NOT_FRESH

    @pass_context
    def guarded(ctx: jinja2.runtime.Context, *args: Any, **kwargs: Any) -> Any:
        budget = budget_of(ctx)
        budget._tick()
        if name in _REPLACED:
            return budget._account(_REPLACED[name](budget, *args, **kwargs), fresh=False)
        if name in _REPLACED_CTX:
            return budget._account(_REPLACED_CTX[name](budget, ctx, *args, **kwargs), fresh=False)
        args, kwargs = rule(budget, args, kwargs)
        result = _call_with(func, ctx, args, kwargs)
        return budget._account(result, fresh=fresh and not (args and result is args[0]))

    guarded.__name__ = guarded.__qualname__ = f"guarded_{name}"
    guarded._deimos_checked = True  # type: ignore[attr-defined]
    return guarded


def _checked(func: Callable[..., Any]) -> Callable[..., Any]:
    func._deimos_checked = True  # type: ignore[attr-defined]
    return func


@pass_context
def _safe_range(ctx: jinja2.runtime.Context, *args: int) -> range:
    budget = budget_of(ctx)
    r = range(*args)
    if len(r) > budget.limits.max_range:
        raise BudgetExceeded(f"range() of {len(r)} items (limit {budget.limits.max_range})")
    budget._iterate(len(r))
    return r


@pass_context
def _lipsum(ctx: jinja2.runtime.Context, n: int = 5, html: bool = True, min: int = 20,
            max: int = 100) -> str:
    budget = budget_of(ctx)
    if isinstance(n, int) and isinstance(max, int):
        words = n * (max if max > 0 else 0) + n
        budget._iterate(words)
        budget._reserve(16 * words, "lorem ipsum")
    return budget._account(generate_lorem_ipsum(n, html, min, max))


@pass_context
def _dict(ctx: jinja2.runtime.Context, *args: Any, **kwargs: Any) -> dict[Any, Any]:
    budget = budget_of(ctx)
    if args and not isinstance(args[0], Mapping):
        items = list(budget_iter(budget, args[0]))
        budget._operand(items)  # keys are hashed
        args = (items, *args[1:])
    elif args:
        budget._iterate(len(args[0]))
    budget._reserve(100 * (len(kwargs) + sum(len(a) for a in args if hasattr(a, "__len__"))),
                    "a dict")
    return budget._account(dict(*args, **kwargs))


@pass_context
def _namespace(ctx: jinja2.runtime.Context, *args: Any, **kwargs: Any) -> Namespace:
    budget = budget_of(ctx)
    _walked(budget, args, {})
    budget._iterate(len(kwargs) + sum(len(a) for a in args if hasattr(a, "__len__")))
    return Namespace(*args, **kwargs)


@pass_context
def _cycler(ctx: jinja2.runtime.Context, *items: Any) -> Cycler:
    budget_of(ctx)._iterate(len(items))
    return Cycler(*items)


@pass_context
def _joiner(ctx: jinja2.runtime.Context, sep: str = ", ") -> Joiner:
    budget_of(ctx)._tick()
    return Joiner(sep)


def _raise_exception(message: Any) -> None:
    raise TemplateRaised(str(message)[:10_000])


def _strftime_now(now: Callable[[], datetime]) -> Callable[..., str]:
    @pass_context
    def strftime_now(ctx: jinja2.runtime.Context, fmt: str) -> str:
        budget = budget_of(ctx)
        if isinstance(fmt, str):  # '%c' is 24 characters from 2
            budget._reserve(16 * str_units(fmt), "a strftime() string")
        return budget._account(now().strftime(fmt))

    return strftime_now


def install(env: jinja2.Environment, now: Callable[[], datetime]) -> None:
    """Replace the environment's filters, tests and globals by their guarded versions."""
    env.filters["tojson"] = _do_tojson  # ours (HF's), wrapped below like the rest
    for name, func in list(env.filters.items()):
        env.filters[name] = _wrap(name, func, _FILTER_RULES.get(name, _walked))
    for name, func in list(env.tests.items()):
        env.tests[name] = _wrap(name, func, _TEST_RULES.get(name, _walked))
    env.globals.update(
        range=_safe_range, lipsum=_lipsum, dict=_dict, namespace=_namespace, cycler=_cycler,
        joiner=_joiner, raise_exception=_checked(_raise_exception),
        strftime_now=_strftime_now(now),
    )
    for func in env.globals.values():
        if callable(func):
            _checked(func)
