"""``deimos bench agent`` and its recorded sessions.

Oracles: the generator's own output generated twice (determinism) and the committed files; the
standard library's files themselves (what a session's reads and writes must re-emit); the
sizes the issue asks for; a real ``deimos serve`` on the CPU with a tiny random-weight model,
whose JSON request log gives per response id the prompt, cached and generated tokens and the
time to first token measured inside the server; and, for the statistics, hand-made turns whose
rates are worked out by hand.
"""

from __future__ import annotations

import gzip
import hashlib
import itertools
import json
import re

import pytest
from server_support import ServerProcess, free_port
from testdata import model_path

from deimos.bench.agent import _output_text, request_body, warmup_body
from deimos.bench.agent_stats import AgentReport, TurnRecord, markdown, summarize
from deimos.bench.session_parts import sources
from deimos.bench.sessions import (
    FULL,
    SESSIONS_DIR,
    SHAPES,
    SMALL,
    generate,
    load_session,
    message_tokens,
    request_tokens,
    to_jsonl,
    write_sessions,
)
from deimos.cli import _bench_serve_argv
from deimos.cli import main as cli_main
from deimos.synth import write_model

DONOR = "SmolLM2-135M-Instruct.Q4_1.gguf"  # vocabulary and chat template of the tiny model
BLOCK = 16  # deimos serve's KV block: the prefix cache reuses whole blocks

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def full() -> dict[str, list[dict]]:
    return {shape: generate(shape, FULL) for shape in SHAPES}


def _reads(body: dict) -> list[tuple[dict, str]]:
    """(read_file arguments, the tool result) of every read in a request's history."""
    results = {m["tool_call_id"]: m["content"] for m in body["messages"] if m["role"] == "tool"}
    return [(json.loads(c["function"]["arguments"]), results[c["id"]])
            for m in body["messages"] if m["role"] == "assistant"
            for c in m.get("tool_calls") or () if c["function"]["name"] == "read_file"
            and c["id"] in results]


def _unnumbered(text: str) -> list[str]:
    return [re.sub(r"^ *\d+\t", "", line, count=1) for line in text.split("\n")]


def _source(path: str) -> list[str]:
    return next(s for s in sources() if s.path == path).lines


# ---- the generator -------------------------------------------------------------------------


def test_generator_is_deterministic_and_seeded(full) -> None:
    for shape in SHAPES:
        assert to_jsonl(generate(shape, FULL)) == to_jsonl(full[shape]), shape
        assert to_jsonl(generate(shape, FULL, seed=1)) != to_jsonl(full[shape]), shape


def test_committed_sessions_match_their_manifest_and_the_generator(full) -> None:
    manifest = json.loads((SESSIONS_DIR / "manifest.json").read_text())
    total = 0
    for shape in SHAPES:
        raw = (SESSIONS_DIR / f"{shape}.jsonl.gz").read_bytes()
        total += len(raw)
        entry = manifest["sessions"][shape]
        assert hashlib.sha256(gzip.decompress(raw)).hexdigest() == entry["sha256_jsonl"]
        assert entry["turns"] == len(load_session(shape))
    assert total < 3 * 2**20
    here = {s.path: s.sha256 for s in sources()}
    if any(here.get(s["path"]) != s["sha256"] for s in manifest["sources"]):
        pytest.skip(f"this Python's stdlib files differ from Python {manifest['python']}'s, "
                    "which made the committed sessions")
    for shape in SHAPES:
        assert gzip.decompress((SESSIONS_DIR / f"{shape}.jsonl.gz").read_bytes()) \
            == to_jsonl(full[shape]), shape


def test_every_turn_extends_the_last_with_the_recorded_answer(full) -> None:
    for shape, turns in full.items():
        for prev, cur in itertools.pairwise(turns):
            n = len(prev["messages"])
            assert cur["messages"][:n] == prev["messages"], shape
            answer = cur["messages"][n]
            assert answer["role"] == "assistant"
            # max_tokens is the recorded answer's estimated length (template overhead aside)
            assert prev["max_tokens"] == message_tokens(answer) - 4, shape
            assert request_tokens(cur) > request_tokens(prev)
        names = [t["function"]["name"] for t in turns[0]["tools"]]
        assert len(names) == len(set(names)) == 20
        assert {"read_file", "write_file", "edit_file", "grep", "run_tests"} <= set(names)
        assert all(t["tools"] == turns[0]["tools"] for t in turns)


def test_multi_turn_shape(full) -> None:
    turns = full["multi-turn"]
    assert len(turns) >= 30
    assert 27_000 <= request_tokens(turns[-1]) <= 33_000
    assert request_tokens(turns[0]) < 4_000
    assert max(t["max_tokens"] for t in turns) <= 1_000  # short turns
    last = turns[-1]
    reads = _reads(last)
    assert len(reads) >= 5
    for args, text in reads:
        # 1-4k tokens of a real file, from the offset asked for (numbered as cat -n)
        assert 1_000 <= -(-len(text) // 4) <= 4_200, args
        lines = _source(args["path"])
        first = args["offset"] - 1
        assert _unnumbered(text) == lines[first:first + args["limit"]], args
    # edits quote code they read: old_string is in an earlier read's window, and is quoted in
    # the answer's text too
    edits = [(m, json.loads(c["function"]["arguments"])) for m in last["messages"]
             if m["role"] == "assistant" for c in m.get("tool_calls") or ()
             if c["function"]["name"] == "edit_file"]
    assert len(edits) >= 5
    windows = "\n".join("\n".join(_unnumbered(text)) for _, text in reads)
    quoted = [(m, e) for m, e in edits if "raise TypeError" not in e["old_string"]]
    for m, e in quoted:
        assert e["old_string"] in windows
        assert e["old_string"] in m["content"]
    tool_text = "\n".join(m["content"] for m in last["messages"] if m["role"] == "tool")
    assert "passed in" in tool_text and "FAILURES" in tool_text and "diff --git a/Lib/" in tool_text


def test_long_prompt_shape(full) -> None:
    turns = full["long-prompt"]
    document = max((m for m in turns[0]["messages"] if m["role"] == "user"),
                   key=lambda m: len(m["content"]))
    assert 28_000 <= -(-len(document["content"]) // 4) <= 30_000
    # whole files as they are in the stdlib
    for path in re.findall(r"^### (Lib/\S+)\n", document["content"], re.MULTILINE):
        assert "\n".join(_source(path)).rstrip() in document["content"], path
    assert len(turns) == 2 and all(t["max_tokens"] <= FULL.answer_tokens for t in turns)


def test_long_decode_shape(full) -> None:
    turns = full["long-decode"]
    assert len(turns) >= 5
    assert all(0.95 * 2048 <= t["max_tokens"] <= 2048 for t in turns)
    assert request_tokens(turns[-1]) <= 30_000
    # each answer writes back the window the turn before read (modernized: a header line)
    last = turns[-1]
    reads = {a["path"]: _unnumbered(text) for a, text in _reads(last)}
    writes = [json.loads(c["function"]["arguments"]) for m in last["messages"]
              if m["role"] == "assistant" for c in m.get("tool_calls") or ()
              if c["function"]["name"] == "write_file"]
    assert len(writes) == len(turns) - 1
    for w in writes[1:]:
        body = w["content"].split("\n")[2:]
        seen = reads[w["path"]]
        same = sum(a == b for a, b in zip(body, seen))
        assert len(body) == len(seen) and same >= 0.9 * len(seen), w["path"]


def test_small_sizes_and_the_manifest(tmp_path) -> None:
    manifest = write_sessions(tmp_path, SMALL)
    for shape in SHAPES:
        turns = load_session(tmp_path / f"{shape}.jsonl.gz")
        assert all(t["max_tokens"] == SMALL.max_tokens_cap for t in turns)
        assert len(turns[0]["tools"]) == SMALL.n_tools
        assert request_tokens(turns[-1]) <= 3_000
        assert manifest["sessions"][shape]["turns"] == len(turns)
    assert len(load_session(tmp_path / "multi-turn.jsonl.gz")) >= SMALL.min_turns
    used = {s["path"] for s in manifest["sources"]}
    assert used and used <= {s.path for s in sources()}


def test_load_session_plain_gzip_and_errors(tmp_path) -> None:
    turns = generate("long-decode", SMALL)
    plain = tmp_path / "s.jsonl"
    plain.write_bytes(to_jsonl(turns))
    assert load_session(plain) == turns
    assert load_session(tmp_path / "s.jsonl") == load_session(plain)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": [{"role": "user", "content": "x"}]}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1 has no positive integer max_tokens"):
        load_session(bad)
    with pytest.raises(FileNotFoundError, match="no session file"):
        load_session(tmp_path / "missing.jsonl")


# ---- the request and the statistics --------------------------------------------------------


def test_request_body_forces_the_length_and_moves_tools_on_request() -> None:
    turn = generate("multi-turn", SMALL)[2]
    body = request_body(turn, "m")
    assert body["max_tokens"] == turn["max_tokens"] and body["ignore_eos"] is True
    assert body["stream"] and body["stream_options"] == {"include_usage": True}
    assert body["tools"] == turn["tools"] and body["messages"] == turn["messages"]
    moved = request_body(turn, "m", tools_in_system=True, sampling={"temperature": 0.0})
    assert "tools" not in moved and moved["temperature"] == 0.0
    assert moved["messages"][1:] == turn["messages"][1:]
    system = moved["messages"][0]["content"]
    assert system.startswith(turn["messages"][0]["content"])
    assert all(json.dumps(t, ensure_ascii=False) in system for t in turn["tools"])


def test_warmup_carries_a_made_up_tool_when_the_session_has_tools() -> None:
    """A tool-use template (Hermes-3's) refuses a request without tools: the warm-up sends one
    of its own, named and described by random words, as the session sends its tools."""
    turn = generate("multi-turn", SMALL)[0]
    plain = warmup_body("m", 0, tools=False)
    assert "tools" not in plain and plain["max_tokens"] == 4 and plain["ignore_eos"] is True
    body = warmup_body("m", 1, tools=True, sampling={"temperature": 0.5})
    (tool,) = body["tools"]
    assert tool["function"]["name"] == "warmup_1" and body["temperature"] == 0.5
    assert tool["function"]["name"] not in {t["function"]["name"] for t in turn["tools"]}
    assert body["messages"] == warmup_body("m", 1, tools=False)["messages"]
    moved = warmup_body("m", 1, tools=True, tools_in_system=True)
    assert "tools" not in moved and "warmup_1" in moved["messages"][0]["content"]
    assert moved["messages"][0]["role"] == "system"


def test_stats_on_hand_made_turns() -> None:
    def turn(i, prompt, cached, n, ttft, e2e, deltas=None, **kw):
        return TurnRecord(turn=i, max_tokens=kw.pop("max_tokens", n), sent_s=10.0 + i, ok=True,
                          ttft_s=ttft, e2e_s=e2e, n_deltas=n if deltas is None else deltas,
                          prompt_tokens=prompt, cached_tokens=cached, completion_tokens=n, **kw)

    turns = [
        turn(1, 1000, 0, 11, 0.5, 1.5),  # prefill 1000 / 0.5 s, decode 10 / 1.0 s
        turn(2, 1300, 992, 21, 0.2, 1.2),  # 308 new / 0.2 s, 20 / 1.0 s
        turn(3, 1400, 1296, 5, None, 0.9, deltas=0),  # no output delta: no TTFT
        turn(4, 1500, 1392, 8, 0.7, 0.7, deltas=1),  # held: the answer in one piece
        turn(5, 1600, 1488, 3, 0.1, 0.3, max_tokens=4),  # ended early: not forced
        TurnRecord(turn=6, max_tokens=4, sent_s=16.0, error="HTTP 503: busy", e2e_s=0.01),
    ]
    s = summarize(turns)
    assert (s.turns, s.ok, s.failed) == (6, 5, 1) and s.errors == {"HTTP 503: busy": 1}
    assert s.wall_s == pytest.approx(16.01 - 11.0)
    assert s.held == [3, 4] and s.not_forced == [5] and s.forced_turns == 4
    # measured: turns 1, 2, 5
    assert s.ttft_s == pytest.approx(0.8) and s.decode_s == pytest.approx(2.2)
    assert s.prefill_tps == pytest.approx((1000 + 308 + 112) / 0.8)
    assert s.decode_tps == pytest.approx((10 + 20 + 2) / 2.2)
    assert s.ttft_max_s == 0.5 and s.ttft.n == 3
    assert s.prompt_tokens == 6800 and s.cached_tokens == 5168 and s.new_tokens == 1632
    assert turns[0].prefill_tps == 2000.0 and turns[1].decode_tps == pytest.approx(20.0)
    assert s.server_prefill_tps is None  # no server timings
    text = markdown(_report(turns))
    assert "| 4 | 1500 | 1392 | 108 | 8 / 8 | held |" in text
    assert "| 5 | 1600 | 1488 | 112 | 3 / 4 ! |" in text
    assert "Not forced to length" in text and "1 x HTTP 503: busy" in text


def test_output_text_of_stream_events() -> None:
    def ev(**delta):
        return {"choices": [{"index": 0, "delta": delta}]}
    assert _output_text(ev(content="def f(")) == "def f("
    assert _output_text(ev(reasoning_content="hm", content="x")) == "hmx"
    call = {"index": 0, "function": {"name": "edit", "arguments": '{"path": '}}
    assert _output_text(ev(tool_calls=[call, {"function": {"arguments": '"a"}'}}])) \
        == 'edit{"path": "a"}'
    # no output: role-only deltas, usage events, and malformed choices
    for e in (ev(role="assistant"), ev(content=None), {"usage": {"completion_tokens": 3}},
              {"choices": []}, {"choices": ["x"]}, {"choices": [{"delta": "x"}]},
              ev(tool_calls="x"), ev(tool_calls=[{"function": {"name": 3}}])):
        assert _output_text(e) == ""


def test_answers_digest_compares_text_turn_by_turn() -> None:
    def report(*texts, ok=True):
        r = AgentReport(url="u", model="m", session="s", tools_in_system=False, sampling={},
                        warmup_ok=1, warmup_failed=0)
        r.turns = [TurnRecord(turn=i, max_tokens=4, sent_s=float(i), ok=ok, ttft_s=0.1,
                              e2e_s=0.4, n_deltas=4, prompt_tokens=10, cached_tokens=0,
                              completion_tokens=4, text=t) for i, t in enumerate(texts, 1)]
        return r
    a = report("ab", "c")
    assert a.answers_sha256 == report("ab", "c").answers_sha256
    # the same characters split across turns otherwise, another order, a failed turn: differ
    others = [report("a", "bc"), report("c", "ab"), report("ab", "c", ok=False), report("ab")]
    assert len({a.answers_sha256, *(r.answers_sha256 for r in others)}) == 5
    assert a.to_json()["answers_sha256"] == a.answers_sha256
    assert a.to_json()["turns"][0]["text"] == "ab"
    assert f"sha256 {a.answers_sha256[:16]}" in markdown(a)


def test_llama_server_timings() -> None:
    """llama-server's cache_n stands in for a missing usage count; its timings give its own
    rates (Σ n / Σ ms)."""
    a = TurnRecord(turn=1, max_tokens=4, sent_s=0.0, ok=True, ttft_s=0.1, e2e_s=0.4, n_deltas=4,
                   prompt_tokens=300, completion_tokens=4,
                   timings={"cache_n": 0, "prompt_n": 300, "prompt_ms": 100.0,
                            "predicted_n": 4, "predicted_ms": 40.0})
    b = TurnRecord(turn=2, max_tokens=4, sent_s=1.0, ok=True, ttft_s=0.1, e2e_s=0.4, n_deltas=4,
                   prompt_tokens=400, completion_tokens=4,
                   timings={"cache_n": 288, "prompt_n": 112, "prompt_ms": 50.0,
                            "predicted_n": 4, "predicted_ms": 40.0})
    from deimos.bench.agent import _read_usage

    for rec in (a, b):
        _read_usage(rec, {"timings": rec.timings})
        assert rec.cached_from == "timings"
    s = summarize([a, b])
    assert s.cached_tokens == 288 and s.cache_unknown == []
    assert s.server_prefill_tps == pytest.approx(412 / 0.15)
    assert s.server_decode_tps == pytest.approx(8 / 0.08)
    # a usage count wins over timings, whichever event comes first
    c = TurnRecord(turn=3, max_tokens=1, sent_s=0.0)
    _read_usage(c, {"usage": {"prompt_tokens": 9, "completion_tokens": 1,
                              "prompt_tokens_details": {"cached_tokens": 5}}})
    _read_usage(c, {"timings": {"cache_n": 7}})
    assert (c.cached_tokens, c.cached_from, c.prompt_tokens) == (5, "usage", 9)


def _report(turns):
    from deimos.bench.agent_stats import AgentReport

    return AgentReport(url="u", model="m", session="s", tools_in_system=False, sampling={},
                       warmup_ok=1, warmup_failed=0, turns=turns)


def test_bench_agent_argv() -> None:
    assert _bench_serve_argv(["-v", "bench", "agent", "s"]) == ["-v", "bench-agent", "s"]
    assert _bench_serve_argv(["bench", "serve", "--url", "u"]) == ["bench-serve", "--url", "u"]
    assert _bench_serve_argv(["bench", "agent.gguf"]) == ["bench", "agent.gguf"]


# ---- replays against real servers ----------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench_agent") / "tiny.gguf"
    return write_model(path, "llama", "llama-tiny", "Q8_0", model_path(DONOR), seed=5)


def _bench(capsys, tmp_path, *argv: str) -> tuple[int, dict | None, str, str]:
    out = tmp_path / "report.json"
    out.unlink(missing_ok=True)
    code = cli_main(["bench", "agent", *argv, "--json", str(out)])
    captured = capsys.readouterr()
    return code, json.loads(out.read_text()) if out.exists() else None, captured.out, \
        captured.err


def _server_log(server: ServerProcess) -> dict[str, dict]:
    lines = [json.loads(x) for x in server.log_lines() if x.startswith("{")]
    return {x["id"]: x for x in lines if x.get("path") == "/v1/chat/completions" and "id" in x}


def test_replay_against_deimos_serve(tiny, tmp_path, capsys) -> None:
    """The short multi-turn session, twice on one fresh server: tools as recorded (deimos
    serve streams the content, holding back only what may be a tool call), then in the system
    prompt. Every answer has
    its recorded length; each turn reuses the previous turn's whole prompt, block by block."""
    write_sessions(tmp_path / "s", SMALL)
    session = str(tmp_path / "s" / "multi-turn.jsonl.gz")
    recorded = load_session(session)
    server = ServerProcess(tiny, "--device", "cpu", "-c", "4096", log_dir=tmp_path)
    try:
        code, held, _, err = _bench(capsys, tmp_path, session, "--url", server.url)
        assert code == 0, err
        code, streamed, out, err = _bench(capsys, tmp_path, session, "--url", server.url + "/v1",
                                          "--tools-in-system")
        assert code == 0, err
    finally:
        server.close()
    logged = _server_log(server)
    assert len(logged) == 2 * (len(recorded) + 1)  # each replay: a warm-up and the turns
    for report in (held, streamed):
        turns = report["turns"]
        assert report["model"] == "tiny" and len(turns) == len(recorded)
        assert report["warmup_ok"] == 1
        for t, rec in zip(turns, recorded):
            srv = logged[t["response_id"]]
            assert t["ok"] and srv["status"] == 200
            assert t["completion_tokens"] == t["max_tokens"] == rec["max_tokens"] \
                == srv["completion_tokens"]
            assert t["forced"] and srv["finish_reason"] == "length"
            assert t["prompt_tokens"] == srv["prompt_tokens"]
            assert t["cached_tokens"] == srv["cached_tokens"] and t["cached_from"] == "usage"
        for prev, cur in itertools.pairwise(turns):
            # the prefix cache: the whole previous prompt again, less its partial last block
            assert prev["prompt_tokens"] - BLOCK < cur["cached_tokens"] <= prev["prompt_tokens"]
            assert cur["cached_tokens"] > prev["cached_tokens"]
        s = report["summary"]
        assert s["ok"] == len(recorded) and s["forced_turns"] == len(recorded)
        assert s["completion_tokens"] == sum(r["max_tokens"] for r in recorded)
        assert all(t["text"] for t in turns)  # each answer's streamed text, kept
        assert s["cached_tokens"] == sum(t["cached_tokens"] for t in turns)
    assert held["turns"][0]["cached_tokens"] == 0  # a fresh server
    # tools on: deimos serve streams the content, holding only what may be a tool call
    assert held["summary"]["held"] == []
    assert held["summary"]["prefill_tps"] is not None
    turns = streamed["turns"]
    assert streamed["summary"]["held"] == [] and streamed["tools_in_system"]
    for t in turns:
        srv = logged[t["response_id"]]
        # the client's TTFT holds the server's queue wait and first step, then the trip back
        assert t["ttft_s"] >= (srv["queued_ms"] + srv["ttft_ms"]) / 1e3 - 2e-4
        assert 0 < t["ttft_s"] <= t["e2e_s"]
        assert t["prefill_tps"] == pytest.approx(t["new_tokens"] / t["ttft_s"])
    s = streamed["summary"]
    assert s["prefill_tps"] == pytest.approx(
        sum(t["new_tokens"] for t in turns) / sum(t["ttft_s"] for t in turns))
    assert s["decode_tps"] == pytest.approx(
        sum(t["completion_tokens"] - 1 for t in turns)
        / sum(t["e2e_s"] - t["ttft_s"] for t in turns))
    assert out.startswith("**tiny** at ") and "| turn | prompt | cached |" in out
    assert f"| {len(turns)} | {turns[-1]['prompt_tokens']} | {turns[-1]['cached_tokens']} |" in out


def test_unreachable_server_fails_every_turn(tmp_path, capsys) -> None:
    write_sessions(tmp_path / "s", SMALL)
    url = f"http://127.0.0.1:{free_port()}"
    code, report, _, err = _bench(capsys, tmp_path, str(tmp_path / "s" / "long-prompt.jsonl.gz"),
                                  "--url", url)
    assert code == 1 and report is None and "bench agent: GET /v1/models" in err
    code, report, out, _ = _bench(capsys, tmp_path, str(tmp_path / "s" / "long-prompt.jsonl.gz"),
                                  "--url", url, "--model", "m", "--warmup", "0")
    assert code == 0
    s = report["summary"]
    assert (s["ok"], s["failed"]) == (0, 2) and "ConnectError" in next(iter(s["errors"]))
    assert "failed: ConnectError" in out
