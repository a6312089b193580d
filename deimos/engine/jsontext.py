"""Untrusted JSON, bounded: size limits checked without recursion, and the closure of a JSON text
cut off mid-value.

``check_size(schema, "tools[3].function.parameters")`` walks a parsed JSON value with an explicit
stack, so a schema nested 10,000 deep or holding 100,000 properties is refused in milliseconds,
before anything recursive (jsonschema's meta-validation, llguidance's compiler) sees it.

``closure(text)`` is the shortest suffix that makes a truncated JSON text parse: a generation
under a JSON grammar that stops at ``max_tokens`` ends with its strings, values and brackets
closed (finish_reason stays "length"; the value may lack what a schema requires).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["JsonLimits", "JsonTooLarge", "check_size", "closure"]


@dataclass(frozen=True)
class JsonLimits:
    # Nesting counts containers: a schema level is usually two ({"properties": {"a": ...}}).
    # Real tool and response schemas stay far below these; what exceeds them is an attack or
    # a mistake, and costs the grammar compiler seconds to minutes.
    max_depth: int = 64
    max_nodes: int = 20_000  # values of any kind (objects, arrays, scalars, keys not counted)
    max_chars: int = 1_000_000  # characters of all keys and strings together
    # JSON Schema: properties and branches (anyOf, $defs...) together. The meta-validation
    # and the grammar compiler cost grows faster than linearly in these: 1,000 properties
    # take about a second on a busy core, 9,000 a minute
    max_subschemas: int = 1_000


# keywords whose value holds one subschema per key / per item
_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions",
                          "dependentSchemas"})
_SCHEMA_LISTS = frozenset({"anyOf", "oneOf", "allOf", "prefixItems"})


class JsonTooLarge(ValueError):
    """A JSON value beyond a ``JsonLimits``; the message names the field."""


def check_size(value: object, where: str, limits: JsonLimits = JsonLimits()) -> None:
    """Raise ``JsonTooLarge`` naming ``where`` when ``value`` (parsed JSON: dicts, lists,
    scalars) nests deeper, holds more values or more text than ``limits`` allow. Stops at the
    first limit crossed, so the cost is bounded by the limits, not by the value."""
    stack: list[tuple[object, int]] = [(value, 1)]
    nodes = chars = subschemas = 0
    while stack:
        v, depth = stack.pop()
        nodes += 1
        # every value on the stack is counted when popped: refuse as soon as the sum is over
        if nodes + len(stack) + (len(v) if isinstance(v, (dict, list)) else 0) > limits.max_nodes:
            raise JsonTooLarge(f"{where} is too large: more than {limits.max_nodes} values")
        if isinstance(v, str):
            chars += len(v)
        elif isinstance(v, (dict, list)):
            if depth > limits.max_depth:
                raise JsonTooLarge(f"{where} is nested too deeply: more than {limits.max_depth} "
                                   "levels of objects and arrays")
            if isinstance(v, dict):
                chars += sum(len(k) for k in v)
                subschemas += sum(len(x) for k, x in v.items() if isinstance(x, (dict, list))
                                  and (k in _SCHEMA_MAPS or k in _SCHEMA_LISTS))
                if subschemas > limits.max_subschemas:
                    raise JsonTooLarge(f"{where} is too large: more than "
                                       f"{limits.max_subschemas} properties and subschemas "
                                       "(anyOf, oneOf, allOf, $defs...)")
                stack.extend((x, depth + 1) for x in v.values())
            else:
                stack.extend((x, depth + 1) for x in v)
        if chars > limits.max_chars:
            raise JsonTooLarge(f"{where} is too large: more than {limits.max_chars} characters "
                               "of keys and strings")


# ---- closing a truncated JSON text ------------------------------------------------------------

# What a container still needs, by the state it was left in (o: object, a: array).
_KEY_FIRST, _KEY, _COLON, _VALUE, _AFTER = range(5)  # object states; arrays use _VALUE, _AFTER
_LITERALS = ("true", "false", "null")


def closure(text: str) -> str:
    """The suffix that completes ``text``, a prefix of a JSON text (as a JSON grammar lets a
    model write it), into valid JSON: a cut escape, number or literal finished, an open string
    closed, a key given ``null``, and every open array and object closed; ``{}`` for a text
    with no value yet. A text that is not a JSON prefix gets a best effort."""
    stack: list[list] = []  # [kind "o"/"a", state]
    in_string = False
    is_key = False
    escape = -1  # -1: none; 0: after a backslash; 1..4: hex digits of \u still wanted
    scalar = ""  # the number or literal being written
    seen_value = False

    def value_done() -> None:
        nonlocal seen_value
        seen_value = True
        if stack:
            stack[-1][1] = _AFTER

    for ch in text:
        if in_string:
            if escape == 0:
                escape = 4 if ch == "u" else -1
            elif escape > 0:
                escape -= 1
                if escape == 0:
                    escape = -1
            elif ch == "\\":
                escape = 0
            elif ch == '"':
                in_string = False
                if is_key:
                    stack[-1][1] = _COLON
                else:
                    value_done()
            continue
        if scalar and (ch.isalnum() or ch in "+-."):
            scalar += ch
            continue
        if scalar:
            scalar = ""
            value_done()
        if ch in " \t\r\n":
            continue
        top = stack[-1] if stack else None
        if ch == '"':
            in_string = True
            is_key = top is not None and top[0] == "o" and top[1] in (_KEY_FIRST, _KEY)
        elif ch in "{[":
            stack.append(["o", _KEY_FIRST] if ch == "{" else ["a", _KEY_FIRST])
        elif ch in "}]":
            if stack:
                stack.pop()
            value_done()
        elif ch == ":" and top is not None:
            top[1] = _VALUE
        elif ch == "," and top is not None:
            top[1] = _KEY if top[0] == "o" else _VALUE
        else:
            scalar = ch

    out = []
    if in_string:
        if escape == 0:
            out.append("\\")  # a lone backslash becomes an escaped one
        elif escape > 0:
            out.append("0" * escape)
        out.append('"')
        if is_key:
            out.append(":null")
        if stack:
            stack[-1][1] = _AFTER
    elif scalar:
        out.append(_finish_scalar(scalar))
        if stack:
            stack[-1][1] = _AFTER
    elif not stack and not seen_value:
        return "{}"
    for i, (kind, state) in enumerate(reversed(stack)):
        if i:  # an outer container's value is the one just closed
            state = _AFTER
        if kind == "o":
            out.append({_KEY: '"":null', _COLON: ":null", _VALUE: "null"}.get(state, "") + "}")
        else:
            out.append(("null" if state == _VALUE else "") + "]")
    return "".join(out)


def _finish_scalar(s: str) -> str:
    for lit in _LITERALS:
        if lit.startswith(s):
            return lit[len(s):]
    if s[-1] in "-+.eE":  # a number cut before its digits
        return "0"
    return ""
