"""Bounded JSON (deimos.engine.jsontext): the closure of truncated JSON text and the size limits.

Oracle for ``closure``: ``json.loads`` of every prefix of seeded random JSON documents (every
kind of value, escapes, unicode, whitespace) plus its closure; a complete document needs none.
For ``check_size``: values built to sit exactly at and just past each limit, and a time bound.
"""

from __future__ import annotations

import json
import random
import time

import pytest

from deimos.engine.jsontext import JsonLimits, JsonTooLarge, check_size, closure


def _value(rng: random.Random, depth: int):
    r = rng.random()
    if depth > 4 or r < 0.4:
        return rng.choice([rng.randint(-10**6, 10**6), rng.random() * 1e5, -3.5e-7, True, False,
                           None, 'a\\b"c\u00e9\u2028\U0001f600', "", "x" * rng.randint(0, 4)])
    if r < 0.7:
        return [_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {f"k{i}\\\"\u00e9": _value(rng, depth + 1) for i in range(rng.randint(0, 3))}


@pytest.mark.parametrize("seed", range(4))
def test_every_prefix_closes_into_json(seed):
    rng = random.Random(seed)
    for _ in range(40):
        value = _value(rng, 0)
        text = json.dumps(value, ensure_ascii=rng.random() < 0.5,
                          indent=rng.choice([None, 2]))
        assert closure(text) == "" or not isinstance(value, (dict, list))
        for i in range(len(text) + 1):
            prefix = text[:i]
            json.loads(prefix + closure(prefix))  # raises if the closure is wrong


@pytest.mark.parametrize("prefix, tail", [
    ("", "{}"), ("  ", "{}"), ("{", "}"), ('{"a', '":null}'), ('{"a"', ":null}"),
    ('{"a":', "null}"), ('{"a": 1,', '"":null}'), ('{"a": [1,', "null]}"), ('{"a": "x\\', '\\"}'),
    ('{"a": "\\u00', '00"}'), ('{"a": tr', "ue}"), ('{"a": -', "0}"), ('{"a": 1.5e', "0}"),
    ('{"a": {"b": [{"c": n', "ull}]}}"), ('{"a": 12', "}"), ('{"a": []', "}"),
])
def test_minimal_closures(prefix, tail):
    assert closure(prefix) == tail


def test_limits_are_exact():
    lim = JsonLimits(max_depth=3, max_nodes=10, max_chars=8)
    check_size([[[1]]], "x", lim)
    with pytest.raises(JsonTooLarge, match="x is nested too deeply"):
        check_size([[[[1]]]], "x", lim)
    check_size([0] * 9, "x", lim)  # the list and its nine items
    with pytest.raises(JsonTooLarge, match="more than 10 values"):
        check_size([0] * 10, "x", lim)
    check_size({"abcd": "efgh"}, "x", lim)
    with pytest.raises(JsonTooLarge, match="more than 8 characters"):
        check_size({"abcd": "efghi"}, "x", lim)
    lim = JsonLimits(max_subschemas=3)
    check_size({"properties": {"a": {}, "b": {}}, "anyOf": [{}]}, "x", lim)
    with pytest.raises(JsonTooLarge, match="more than 3 properties and subschemas"):
        check_size({"properties": {"a": {}, "b": {}}, "anyOf": [{"$defs": {"c": {}}}, {}]},
                   "x", lim)


def test_hostile_values_are_refused_in_milliseconds():
    deep: dict = {}
    cur = deep
    for _ in range(100_000):  # json.dumps could not even serialize this
        cur["a"] = {}
        cur = cur["a"]
    wide = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(100_000)}}
    for value, words in ((deep, "nested too deeply"), (wide, "more than"),
                         (["x" * 10**6, "y"], "characters")):
        t0 = time.perf_counter()
        with pytest.raises(JsonTooLarge, match=words):
            check_size(value, "tools[3].function.parameters")
        assert time.perf_counter() - t0 < 0.05
