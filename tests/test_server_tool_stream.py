"""Streamed replies with tools on (deimos.server.tool_stream): content goes out as it is
written, only what may be a tool call is held.

Oracles: ``parse_tool_calls`` on the whole reply (what the unstreamed response says): the
content sent plus the rest at the end, and the calls, equal its answer for every way of
cutting the same reply into pieces; Python's ``json.JSONDecoder.raw_decode`` for the JSON
prefix check (every prefix of a valid JSON text is viable; a verdict on any text agrees with
it); the same server's unstreamed answer for the same request (content, calls, logprobs); for
"sent before the end", the engine itself, held at a late token until the client has seen
content (a logits processor that forces the reply's tokens and waits there).
"""

from __future__ import annotations

import json
import math
import random
import threading

import pytest
import torch
from server_support import InProcessServer, sse_events
from testdata import model_path

from deimos.server.json_prefix import COMPLETE, INVALID, VIABLE, JsonPrefix
from deimos.server.processors import NEG
from deimos.server.tool_stream import ToolCallSplitter
from deimos.server.tools import PYTHON_TAG, parse_tool_calls
from deimos.synth import write_model

NAMES = {"get_weather", "get_time", "brave_search"}
CALL_H = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
BLOCK = f"<tool_call>\n{CALL_H}\n</tool_call>"
CALL_L = '{"name": "get_time", "parameters": {"city": "Oslo"}}'


def stream(style: str, pieces: list[str], names=NAMES, **kw):
    """(content sent after each piece, the ending)."""
    split = ToolCallSplitter(style, names, **kw)
    sent = [split.feed(p)[0] for p in pieces]
    return sent, split.finish()


def calls_of(calls: list[dict]) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def assert_as_unstreamed(style: str, pieces: list[str], names=NAMES) -> list[str]:
    text = "".join(pieces)
    sent, end = stream(style, pieces, names)
    content, calls = parse_tool_calls(text, style, names)
    assert "".join(sent) + end.content == (content or ""), (pieces, sent, end)
    assert calls_of(end.calls) == calls_of(calls), pieces
    assert text.startswith("".join(sent))
    return sent


def chars(text: str) -> list[str]:
    return list(text)


# ---- the JSON prefix check ------------------------------------------------------------------

STRING_CHARS = ['"', "\\", "/", "\n", "\x01", "\x1f", "\x7f", "é", "\ud83d", "😀", "{", "}",
                " ", "a", "0", "u"]


def random_value(rng: random.Random, depth: int = 0):
    kind = rng.choice(["dict", "list"] * (depth < 4) + ["str", "int", "float", "const"])
    if kind == "dict":
        return {"".join(rng.choices(STRING_CHARS, k=rng.randint(0, 3))): random_value(rng, depth + 1)
                for _ in range(rng.randint(0, 3))}
    if kind == "list":
        return [random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    if kind == "str":
        return "".join(rng.choices(STRING_CHARS, k=rng.randint(0, 5)))
    if kind == "int":
        return rng.choice([0, -0, 7, -12, 10**20])
    if kind == "float":
        return rng.choice([0.5, -1e-7, 3.25e22, -0.0, math.nan, math.inf, -math.inf])
    return rng.choice([True, False, None])


def random_json(rng: random.Random) -> str:
    value = random_value(rng, 1)
    value = value if isinstance(value, (dict, list)) else [value]
    return json.dumps(value, ensure_ascii=rng.random() < 0.5,
                      indent=rng.choice([None, None, 2, "\t", " \r\n"]),
                      separators=(rng.choice([",", ", ", " ,\t", ",\n"]),
                                  rng.choice([":", ": ", " :\r\n "])))


def verdict(text: str, cuts: list[int] | None = None) -> tuple[str, int]:
    p = JsonPrefix()
    state, at = VIABLE, 0
    for cut in [*(cuts or []), len(text)]:
        state = p.feed(text[:cut], at)
        at = cut
        if state != VIABLE:
            break
    return state, p.end


@pytest.mark.parametrize("seed", range(30))
def test_every_prefix_of_valid_json_is_viable(seed):
    rng = random.Random(seed)
    for _ in range(20):
        text = random_json(rng)
        _, end = json.JSONDecoder().raw_decode(text)
        assert end == len(text)
        p = JsonPrefix()
        for i in range(len(text) - 1):
            assert p.feed(text[: i + 1], i) == VIABLE, (text, i)
        assert p.feed(text, len(text) - 1) == COMPLETE and p.end == len(text)
        assert verdict(text + ' x"}', [rng.randint(0, len(text))]) == (COMPLETE, len(text))


@pytest.mark.parametrize("seed", range(30))
def test_verdicts_on_mutated_json_agree_with_raw_decode(seed):
    rng = random.Random(100 + seed)
    for _ in range(40):
        text = list(random_json(rng))
        for _ in range(rng.randint(1, 4)):
            text[rng.randrange(len(text))] = rng.choice('{}[]":,. \t\x0b\xa0-+eE0123456789'
                                                       "tfnNIaluxs\\/")
        text = "".join(text[: rng.randint(1, len(text))])
        if text[0] not in "{[":
            text = "{" + text
        cuts = sorted(rng.sample(range(len(text)), min(3, len(text))))
        state, end = verdict(text, cuts)
        try:
            _, want_end = json.JSONDecoder().raw_decode(text)
        except ValueError:
            assert state != COMPLETE, text
            continue
        assert (state, end) == (COMPLETE, want_end), text


@pytest.mark.parametrize("text", [
    '{"a": 01}', '{"a": 1.}', '{"a": 1.e5}', '{"a": 1e}', '{"a": 1e+}', '{"a": - 1}',
    '{"a": tru}', '{"a": nul}', '{"a": NaNa}', '{"a": -Inf}', '{"a" 1}', '{,', '{"a": 1,}',
    "[1,]", "[,1]", '{"a": "\x01"}', "{'a': 1}", '{"a": "\\x"}', '{"a": "\\u12g4"}',
    '{"a":\xa01}', '{"a": 1 "b": 2}', "{1: 2}", '[1 2]', "{]", "[}", "[+1]", "[.5]",
])
def test_not_json_is_invalid_where_it_stops_being_json(text):
    with pytest.raises(ValueError):
        json.JSONDecoder().raw_decode(text + "}]}")
    assert verdict(text)[0] == INVALID
    # the text before the offending character is still viable
    p, good = JsonPrefix(), 0
    while p.feed(text[: good + 1], good) == VIABLE:
        good += 1
    assert good < len(text)


@pytest.mark.parametrize("text", [
    '{"a": -0.5e-3, "b": [true, false, null, NaN, -Infinity, Infinity, 0e0, 1E+2, 0.25]}',
    '{"a": "\\u00e9\\ud83d\\ude00\\"\\\\\\/\\b\\f\\n\\r\\t", "b": {}, "c": [[]]}',
    '[ \t\n\r{ }, [ ] , "x" ]',
])
def test_hand_made_json(text):
    assert verdict(text) == (COMPLETE, len(text))
    assert all(verdict(text[:i])[0] == VIABLE for i in range(1, len(text)))


# ---- the splitter on hand-made replies ------------------------------------------------------

@pytest.mark.parametrize("style", ["hermes", "llama3"])
def test_content_only_goes_out_as_it_is_written(style):
    pieces = ["Hello", " there", ",", " how", " are", " you", "?\n"]
    sent, end = stream(style, pieces)
    # a trailing space or newline waits for the next piece (a call after it would trim it)
    assert sent == ["Hello", " there", ",", " how", " are", " you", "?"]
    assert end.content == "\n" and end.calls == []


@pytest.mark.parametrize(("style", "text", "want"), [
    ("hermes", BLOCK, [("get_weather", {"city": "Paris"})]),
    ("hermes", f"\n {BLOCK}\n", [("get_weather", {"city": "Paris"})]),
    ("llama3", CALL_L, [("get_time", {"city": "Oslo"})]),
    ("llama3", f"{PYTHON_TAG}{CALL_L}", [("get_time", {"city": "Oslo"})]),
    ("llama3", f'{PYTHON_TAG}brave_search.call(query="x")', [("brave_search", {"query": "x"})]),
])
def test_a_call_alone_is_held_and_sent_as_a_call(style, text, want):
    sent, end = stream(style, chars(text))
    assert "".join(sent) == "" and end.content == "" and calls_of(end.calls) == want


@pytest.mark.parametrize(("style", "text"), [
    ("hermes", f"Check.{BLOCK}"),
    ("llama3", f"Check.{CALL_L}"),
    ("llama3", f'Check.{PYTHON_TAG}get_time.call(city="Oslo")'),
])
def test_a_marker_cut_at_every_position(style, text):
    """Content before the call goes out with the first piece, whatever part of the call's
    opening that piece holds; the call comes at the end."""
    for k in range(len(text) + 1):
        sent, end = stream(style, [text[:k], text[k:]])
        assert sent[0] == text[: min(k, 6)], k
        assert "".join(sent) == "Check." and end.content == "", k
        assert calls_of(end.calls) == [("get_weather", {"city": "Paris"}) if style == "hermes"
                                       else ("get_time", {"city": "Oslo"})]


def test_content_then_calls_hermes():
    text = f"Let me look.\n{BLOCK}\n<tool_call>\n" + \
        '{"name": "get_time", "arguments": {"city": "Tokyo"}}\n</tool_call>'
    pieces = ["Let", " me", " look", ".\n", "<", "tool", "_call", ">\n", text[25:40], text[40:]]
    assert "".join(pieces) == text
    sent, end = stream("hermes", pieces)
    assert sent == ["Let", " me", " look", ".", "", "", "", "", "", ""]
    assert end.content == ""
    assert calls_of(end.calls) == [("get_weather", {"city": "Paris"}), ("get_time", {"city": "Tokyo"})]


def test_content_then_calls_llama3():
    text = f"Checking both: {CALL_L}; " + '{"name": "get_weather", "arguments": {"city": "Rome"}}'
    sent, end = stream("llama3", chars(text))
    assert "".join(sent) == "Checking both:" and end.content == ""
    assert calls_of(end.calls) == [("get_time", {"city": "Oslo"}), ("get_weather", {"city": "Rome"})]


@pytest.mark.parametrize("text", [
    "a <tool_x> b", "<tools> are listed", "<tool_cal>l> no", "</tool_call> stray", "x <tool_call",
    "<tool_call>get_weather(city='Paris')</tool_call> sorry",  # a block without a call in it
    '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call> not ours',  # not in names
])
def test_hermes_lookalikes_are_released(text):
    sent = assert_as_unstreamed("hermes", chars(text))
    done = "".join(sent)
    if text.endswith("<tool_call"):  # still a possible opening at the end: held
        assert done == "x"
    else:
        assert done == text
    sent, _ = stream("hermes", ["a <tool_", "x"])
    assert sent == ["a", " <tool_x"]


def test_a_block_without_a_call_is_released_when_it_closes():
    block = "<tool_call>not json</tool_call>"
    sent, end = stream("hermes", [block[:20], block[20:], " ok", f"\n{BLOCK}"])
    assert sent == ["", block, " ok", ""]
    assert end.content == "" and calls_of(end.calls) == [("get_weather", {"city": "Paris"})]


@pytest.mark.parametrize("text", [
    'The set {1, 2} and {"name": "Ada", "age": 36} end',  # not JSON; JSON but not a call
    "function f() { return 1; } ok", "<|python is not the tag", "{{{{[[[ x", '{"a": "b"} x',
    '{"name": "rm_rf", "parameters": {}} x',  # a call to a function not given
])
def test_llama3_lookalikes_are_released(text):
    sent = assert_as_unstreamed("llama3", chars(text))
    assert "".join(sent) == text


def test_llama3_json_is_held_until_it_cannot_be_a_call():
    obj = '{"city": "Paris", "temp": 21}'
    sent, end = stream("llama3", ["Here:", " ", obj[:10], obj[10:-1], obj[-1], " ok"])
    assert sent == ["Here:", "", "", "", f" {obj}", " ok"]
    assert end == ("", [], [])
    sent, _ = stream("llama3", ["Use ", "{ ", "return", " x; }"])  # not JSON at "r"
    assert sent == ["Use", "", " { return", " x; }"]


def test_leading_whitespace_before_content_is_sent_with_it():
    text = f"  Sure.{BLOCK}"
    sent, end = stream("hermes", ["  ", "Sure", ".", BLOCK])
    assert sent == ["", "  Sure", ".", ""]
    assert parse_tool_calls(text, "hermes")[0] == "  Sure."
    sent, end = stream("hermes", ["  ", BLOCK, "\n "])
    assert sent == ["", "", ""] and end.content == "" and len(end.calls) == 1
    assert parse_tool_calls(f"  {BLOCK}\n ", "hermes")[0] is None


def test_a_forced_call_is_held_whole():
    body = CALL_H + "\n</tool_call>"
    sent, end = stream("hermes", chars(body), prefix="<tool_call>\n")
    assert set(sent) == {""} and end.content == ""
    assert calls_of(end.calls) == [("get_weather", {"city": "Paris"})]
    sent, end = stream("llama3", chars(CALL_L), hold=True)
    assert set(sent) == {""} and calls_of(end.calls) == [("get_time", {"city": "Oslo"})]
    sent, end = stream("hermes", ["not", " a call"], prefix="<tool_call>\n")  # as unstreamed
    assert sent == ["", ""] and end == ("<tool_call>\nnot a call", [], [])


def test_marks_go_out_with_the_last_character_of_their_piece():
    split = ToolCallSplitter("hermes", NAMES)
    pieces = ["Hi", " there", ".\n<", "tool_call>", CALL_H, "</tool_call>"]
    released = [split.feed(p, [i])[1] for i, p in enumerate(pieces)]
    assert released == [[0], [1], [], [], [], []]
    assert split.finish().marks == [2, 3, 4, 5]


# ---- the same content and calls however the reply is cut ------------------------------------

HERMES_BITS = ["Sure", "let me check", ".", " ", "  ", "\n", "\t", "é", "<", ">", "<tool",
               "_call", "<tool_call>", "</tool_call>", "</tool", "<tools>", "<tool_call", "call>",
               CALL_H, '{"name": "get_time", "arguments": "{\\"city\\": \\"Oslo\\"}"}',
               '[{"name": "get_time", "arguments": {}}]', '{"name": "rm_rf", "arguments": {}}',
               '{"name": oops}', "{", "}", '"', "\n</tool_call>\n"]
LLAMA3_BITS = ["Sure", "the answer", ":", " ", "\n", ";", "; ", "{", "}", "[", "]", '"', "1",
               "-", "tru", "e", "NaN", "x", "{{", "\\", CALL_L,
               '{"name": "get_weather", "parameters": {"city": "Rome"}}',
               '{"type": "function", "function": {"name": "get_time", "parameters": {}}}',
               '{"name": "get_weather", "arguments": {"city": "Oslo"}}',
               '{"name": "Ada", "age": 36}', '{"a": "<|python_tag|>"}',
               '{"a": {"name": "get_time", "parameters": {}}', PYTHON_TAG, "<|python", "_tag|>",
               'brave_search.call(query="weather")', "get_time.call(city='Rome')",
               '{"name": "get_weather", "parameters": {"city": "Paris"}',
               '{"name": "rm_rf", "parameters": {}}']


def random_reply(rng: random.Random, style: str) -> str:
    bits = HERMES_BITS if style == "hermes" else LLAMA3_BITS
    if rng.random() < 0.5:
        return "".join(rng.choices(bits, k=rng.randint(0, 14)))
    # a reply shaped like a real one: content, then calls, maybe content after
    words = ["Sure", " ", "let me check", ".", "\n", "  ", ";"]
    parts = ["".join(rng.choices(words, k=rng.randint(0, 4)))]
    for _ in range(rng.randint(1, 3)):
        call = rng.choice(bits[-8:] if style == "hermes" else bits[-14:])
        if style == "hermes":
            call = f"<tool_call>{rng.choice(['', chr(10)])}{call}" + \
                rng.choice(["\n</tool_call>", "</tool_call>", ""])
        parts.append(call + rng.choice(["", "\n", "; ", " "]))
    parts.append(rng.choice(["", "Done.", " ok\n"]))
    return "".join(parts)


def random_cuts(rng: random.Random, text: str) -> list[str]:
    if rng.random() < 0.2:
        return list(text)
    cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 10))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


@pytest.mark.parametrize("style", ["hermes", "llama3"])
@pytest.mark.parametrize("seed", range(40))
def test_random_cuts_give_the_unstreamed_answer(style, seed):
    rng = random.Random(seed * 7 + (style == "llama3"))
    for _ in range(30):
        text = random_reply(rng, style)
        names = None if rng.random() < 0.2 else NAMES
        for _ in range(6):
            assert_as_unstreamed(style, random_cuts(rng, text), names)


# ---- through the app: the tiny model with its reply forced -----------------------------------

DONOR = "SmolLM2-135M-Instruct.Q4_1.gguf"  # vocabulary and chat template (hermes style)
CHAT = "/v1/chat/completions"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = tmp_path_factory.mktemp("tool_stream") / "tiny.gguf"
    write_model(path, "llama", "llama-tiny", "Q8_0", model_path(DONOR), seed=5)
    s = InProcessServer(path, n_ctx=1024, model_id="tiny")
    assert s.server.tool_style == "hermes"
    yield s
    s.close()


class Script:
    """A logits processor forcing the reply to ``ids`` then an end-of-generation token.
    ``wait_at``: before choosing that output position, wait (up to a minute) for ``go``."""

    def __init__(self, ids: list[int], stop: int, wait_at: int = -1,
                 go: threading.Event | None = None) -> None:
        self.ids, self.stop, self.wait_at, self.go = ids, stop, wait_at, go
        self.waited: bool | None = None  # whether go came in time

    def __call__(self, output_ids, logits: torch.Tensor) -> torch.Tensor:
        k = len(output_ids)
        if k == self.wait_at and self.go is not None and self.waited is None:
            self.waited = self.go.wait(60)
        out = torch.full_like(logits, NEG)
        want = self.ids[k] if k < len(self.ids) else self.stop
        out[want] = logits[want]
        return out


@pytest.fixture
def force(served, monkeypatch):
    """force(text, ...) -> Script: every request after it generates ``text``."""
    submit = served.worker.submit
    tok = served.llm.tokenizer

    def use(text: str, **kw) -> Script:
        ids = tok.encode(text, add_special=False)
        assert tok.decode(ids) == text
        script = Script(ids, min(served.llm.stop_ids), **kw)

        def scripted(job):
            job.request.logits_processors = [*job.request.logits_processors, script]
            submit(job)

        monkeypatch.setattr(served.worker, "submit", scripted)
        return script

    return use


def chat_body() -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": "Weather in Paris?"}],
            "tools": [WEATHER], "max_tokens": 120, "seed": 7, "temperature": 0.8}


def chat(served, **fields) -> dict:
    status, answer = served.request("POST", CHAT, {**chat_body(), **fields})
    assert status == 200, answer
    return answer


def streamed(served, **fields) -> list[dict]:
    status, raw = served.request("POST", CHAT, {**chat_body(), **fields, "stream": True})
    assert status == 200, raw
    events = sse_events(raw)
    assert events[-1] == "[DONE]"
    return events[:-1]


def joined(events: list[dict], n: int = 1) -> list[dict]:
    """Per choice: content, tool calls (arguments joined by index), finish reason, logprobs
    and how many chunks carried content."""
    out = [{"content": "", "calls": {}, "finish": None, "logprobs": [], "content_chunks": 0}
           for _ in range(n)]
    for ev in events:
        for c in ev["choices"]:
            o, d = out[c["index"]], c["delta"]
            if d.get("content"):
                o["content"] += d["content"]
                o["content_chunks"] += 1
            for call in d.get("tool_calls") or ():
                have = o["calls"].setdefault(call["index"], {"name": "", "arguments": ""})
                fn = call.get("function") or {}
                have["name"] += fn.get("name") or ""
                have["arguments"] += fn.get("arguments") or ""
                have["id"] = call.get("id") or have.get("id")
            o["logprobs"] += (c.get("logprobs") or {}).get("content") or []
            o["finish"] = c["finish_reason"] or o["finish"]
    return out


def unstreamed(choice: dict) -> dict:
    m = choice["message"]
    return {"content": m["content"] or "",
            "calls": [(c["function"]["name"], c["function"]["arguments"])
                      for c in m.get("tool_calls") or ()],
            "finish": choice["finish_reason"],
            "logprobs": (choice.get("logprobs") or {}).get("content") or []}


def same(got: dict, want: dict) -> None:
    calls = [(c["name"], c["arguments"]) for _, c in sorted(got["calls"].items())]
    assert (got["content"], calls, got["finish"]) == (want["content"], want["calls"],
                                                      want["finish"])
    assert got["logprobs"] == want["logprobs"]


LONG = ("The weather in Paris is mild today, with a light breeze from the west and a few "
        "clouds over the river in the afternoon. Take a light jacket if you go out tonight.")


def test_content_goes_out_while_the_reply_is_written(served, force):
    go = threading.Event()
    script = force(LONG, wait_at=30, go=go)
    conn = served.connect()
    conn.request("POST", CHAT, body=json.dumps({**chat_body(), "stream": True}),
                 headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    lines = []
    while (line := resp.readline()) and line != b"data: [DONE]\n":
        lines.append(line)
        if line.startswith(b"data: {") and json.loads(line[6:])["choices"][0]["delta"].get(
                "content"):
            go.set()  # the engine, held before token 30, may go on
    conn.close()
    assert script.waited is True  # content came while the engine still had tokens to write
    got = joined(sse_events(b"".join(lines)))[0]
    assert got["content_chunks"] > 10
    same(got, unstreamed(chat(served)["choices"][0]))
    assert got["content"] == LONG and got["finish"] == "stop"


def test_content_then_a_call_streamed_as_unstreamed(served, force):
    text = f"Let me check the weather in Paris.\n{BLOCK}"
    force(text)
    fields = {"n": 2, "logprobs": True, "top_logprobs": 2}
    whole = chat(served, **fields)
    events = streamed(served, **fields)
    got = joined(events, 2)
    for i in range(2):
        want = unstreamed(whole["choices"][i])
        assert want["content"] == "Let me check the weather in Paris."
        assert want["calls"] == [("get_weather", '{"city": "Paris"}')]
        assert want["finish"] == "tool_calls"
        assert len(want["logprobs"]) == whole["usage"]["completion_tokens"] // 2 - 1  # + eos
        same(got[i], want)
        assert got[i]["content_chunks"] > 3 and got[i]["calls"][0]["id"].startswith("call_")
    # content before the call, the call in one delta after it
    kinds = [("calls" if c["delta"].get("tool_calls") else "content")
             for ev in events for c in ev["choices"] if c["index"] == 0
             and (c["delta"].get("content") or c["delta"].get("tool_calls"))]
    assert kinds[-1] == "calls" and set(kinds[:-1]) == {"content"}
    (delta,) = [c["delta"] for ev in events for c in ev["choices"]
                if c["index"] == 0 and c["delta"].get("tool_calls")]
    (call,) = delta["tool_calls"]
    assert call["index"] == 0 and call["type"] == "function"


def test_the_models_own_reply_streamed_as_unstreamed(served):
    for seed in (1, 2, 3):
        fields = {"seed": seed, "max_tokens": 40, "logprobs": True}
        want = unstreamed(chat(served, **fields)["choices"][0])
        got = joined(streamed(served, **fields))[0]
        same(got, want)
        if "<" not in want["content"]:
            assert got["content_chunks"] > 1


def test_a_forced_call_is_still_held_whole(served):
    fields = {"tool_choice": {"type": "function", "function": {"name": "get_weather"}},
              "temperature": 0, "max_tokens": 120}
    want = unstreamed(chat(served, **fields)["choices"][0])
    events = streamed(served, **fields)
    got = joined(events)[0]
    same(got, want)
    assert want["finish"] == "tool_calls" and got["content_chunks"] == 0
    assert sum(bool(c["delta"].get("tool_calls")) for ev in events for c in ev["choices"]) == 1
