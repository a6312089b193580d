"""``deimos bench serve`` against real servers on loopback: ``deimos serve`` on the CPU with a
tiny random-weight model, the same with a queue of one (it answers 503 to the requests that
find the queue full), and small raw HTTP servers that cut a stream or never answer.

Oracles: the server's own JSON request log (per request id: status, prompt and completion
tokens, queue wait and time to first token, measured inside the server), numpy's percentile,
and the arithmetic the report's figures are defined by (deimos/bench/serve_stats.py).
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections import Counter

import numpy as np
import pytest
from server_support import ServerProcess, free_port
from testdata import model_path

from deimos.bench.serve import ServeBenchConfig, _next_words
from deimos.bench.serve_client import LONG_JSON_SCHEMA, constrained_body, request_body
from deimos.bench.serve_stats import Dist, percentile
from deimos.bench.words import WORDS, prompt_text
from deimos.cli import main as cli_main
from deimos.synth import write_model

DONOR = "SmolLM2-135M-Instruct.Q4_1.gguf"  # vocabulary and chat template of the tiny model
PROMPT_TOKENS = 40
MAX_TOKENS = 8

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench_serve") / "tiny.gguf"
    return write_model(path, "llama", "llama-tiny", "Q8_0", model_path(DONOR), seed=5)


def _bench(capsys, tmp_path, *argv: str) -> tuple[int, dict | None, str, str]:
    out = tmp_path / "report.json"
    code = cli_main(["bench", "serve", *argv, "--json", str(out)])
    captured = capsys.readouterr()
    report = json.loads(out.read_text()) if out.exists() else None
    return code, report, captured.out, captured.err


def _server_log(server: ServerProcess) -> dict[str, dict]:
    """The server's request log lines of completions, by response id."""
    lines = [json.loads(x) for x in server.log_lines() if x.startswith("{")]
    return {x["id"]: x for x in lines if x.get("path", "").startswith("/v1/") and "id" in x}


def test_percentile_is_numpys_linear() -> None:
    values = [0.31, 0.02, 0.5, 0.17, 0.17, 0.9, 0.44]
    for q in (0, 5, 50, 95, 99, 100):
        assert percentile(values, q) == pytest.approx(np.percentile(values, q))
    d = Dist.of(values)
    assert d.p50 <= d.p95 <= d.p99 and d.n == 7
    assert Dist.of([]) == Dist(None, None, None, None, 0)
    with pytest.raises(ValueError, match="no values"):
        percentile([], 50)


def test_prompts_are_seeded_distinct_words() -> None:
    a = prompt_text(0, "run/4", 3, 50)
    assert a == prompt_text(0, "run/4", 3, 50) and len(a.split()) == 50
    assert set(a.split()) <= set(WORDS)
    firsts = {tuple(prompt_text(0, "run/4", i, 50).split()[:4]) for i in range(64)}
    assert len(firsts) == 64  # no two share their first four words
    assert prompt_text(1, "run/4", 3, 50) != a


def test_calibration_step_fits_overhead_and_rate() -> None:
    # tokens = 31 + 1.5 x words: two probes find the line, the third lands on the target
    def line(w: int) -> int:
        return 31 + round(1.5 * w)

    probes = [(512, line(512))]
    w = _next_words(probes, 512)
    probes.append((w, line(w)))
    w = _next_words(probes, 512)
    assert abs(line(w) - 512) <= 2, (probes, w)


def test_bench_serve_against_deimos_serve(tiny, tmp_path, capsys) -> None:
    server = ServerProcess(tiny, "--device", "cpu", "-c", "256", log_dir=tmp_path)
    try:
        code, report, out, err = _bench(
            capsys, tmp_path, "--url", server.url + "/v1", "--concurrency", "1,2",
            "--prompt-tokens", str(PROMPT_TOKENS), "--max-tokens", str(MAX_TOKENS),
            "--requests", "4", "--temperature", "0.7")
    finally:
        server.close()
    assert code == 0, err
    assert report["model"] == "tiny" and report["sampling"] == {"temperature": 0.7}
    # stdout: the table (one row per level) and its notes, nothing else
    assert out.startswith("**tiny** at ") and "| concurrency | ok | failed |" in out
    assert "| 1 | 4 | 0 |" in out and "| 2 | 4 | 0 |" in out
    assert "ITL: gaps between content deltas" in out
    merged = [lv for lv in report["levels"] if lv["tokens_per_delta"] > 1.005]
    assert ("Tokens per delta above 1" in out) == bool(merged)
    logged = _server_log(server)
    cal = report["calibration"]
    assert abs(cal["probes"][-1][1] - PROMPT_TOKENS) <= 2 or cal["note"], cal
    records = report["records"]
    # every request reached the server once, calibration probes too (one token each)
    assert len(logged) == len(records) + len(cal["probes"])
    for rec in records:
        srv = logged[rec["response_id"]]
        assert rec["ok"] and srv["status"] == 200
        assert (rec["completion_tokens"] == rec["usage_completion_tokens"]
                == srv["completion_tokens"])
        assert 1 <= rec["completion_tokens"] <= MAX_TOKENS
        assert rec["prompt_tokens"] == srv["prompt_tokens"]
        assert abs(rec["prompt_tokens"] - PROMPT_TOKENS) <= 4  # random words, calibrated
        assert len(rec["itl_s"]) == rec["n_deltas"] - 1
        # the client's TTFT holds the server's queue wait and first step, then the trip back
        assert rec["ttft_s"] >= (srv["queued_ms"] + srv["ttft_ms"]) / 1e3 - 2e-4
        assert 0 < rec["ttft_s"] <= rec["e2e_s"]
        assert rec["ttft_s"] + sum(rec["itl_s"]) <= rec["e2e_s"]
    for lv in report["levels"]:
        c = lv["concurrency"]
        measured = [r for r in records if r["level"] == c and not r["warmup"]]
        assert len(measured) == lv["requests"] == lv["ok"] == 4 and lv["failed"] == 0
        assert lv["warmup_ok"] == c and lv["warmup_failed"] == 0
        assert lv["output_tokens"] == sum(r["completion_tokens"] for r in measured)
        start = min(r["sent_s"] for r in measured)
        end = max(r["sent_s"] + r["e2e_s"] for r in measured)
        assert start == 0.0 and lv["wall_s"] == pytest.approx(end - start)
        assert lv["output_tps"] == pytest.approx(lv["output_tokens"] / lv["wall_s"])
        assert lv["output_tps"] > 0
        assert lv["total_tps"] == pytest.approx(
            (lv["output_tokens"] + lv["prompt_tokens"]) / lv["wall_s"])
        for name in ("ttft", "itl", "tpot", "e2e"):
            d = lv[name]
            assert d["n"] > 0 and 0 < d["p50"] <= d["p95"] <= d["p99"], (name, d)
        assert lv["ttft"]["p50"] <= lv["e2e"]["p50"]
        assert lv["tokens_from_usage"] == 4


def test_constrained_clients_beside_plain_ones(tiny, tmp_path, capsys) -> None:
    """``--constrained 1``: one client task of each level sends JSON-schema requests (no
    ignore_eos: the server refuses the pair with a 400), the others plain ones; the level's
    figures cover all, its plain row the plain requests alone over their own span, its
    constrained row the constrained ones alone."""
    body = constrained_body(request_body("chat", "m", "hi", 8, {"temperature": 0.5}))
    assert "ignore_eos" not in body and body["temperature"] == 0.5
    assert body["response_format"]["json_schema"]["schema"] == LONG_JSON_SCHEMA
    server = ServerProcess(tiny, "--device", "cpu", "-c", "256", log_dir=tmp_path)
    try:
        code, report, out, err = _bench(
            capsys, tmp_path, "--url", server.url, "--concurrency", "3",
            "--prompt-tokens", str(PROMPT_TOKENS), "--max-tokens", str(MAX_TOKENS),
            "--requests", "6", "--constrained", "1")
    finally:
        server.close()
    assert code == 0, err
    assert "| 3 (plain only) |" in out
    logged = _server_log(server)
    measured = [r for r in report["records"] if not r["warmup"]]
    mine = [r for r in measured if r["constrained"]]
    plain = [r for r in measured if not r["constrained"]]
    assert mine and plain and len(mine) + len(plain) == 6
    assert all(r["ok"] and logged[r["response_id"]]["status"] == 200 for r in measured)
    (lv,) = report["levels"]
    p = lv["plain"]
    assert p["requests"] == p["ok"] == len(plain)
    assert p["output_tokens"] == sum(r["completion_tokens"] for r in plain)
    span = max(r["sent_s"] + r["e2e_s"] for r in plain) - min(r["sent_s"] for r in plain)
    assert p["wall_s"] == pytest.approx(span) and p["wall_s"] <= lv["wall_s"]
    assert p["output_tps"] == pytest.approx(p["output_tokens"] / span)
    c = lv["constrained"]
    assert c["requests"] == c["ok"] == len(mine)
    assert c["output_tokens"] == sum(r["completion_tokens"] for r in mine)
    assert "| 3 (constrained only) |" in out
    assert lv["output_tokens"] == p["output_tokens"] + sum(r["completion_tokens"] for r in mine)
    with pytest.raises(ValueError, match="--constrained must leave plain clients"):
        ServeBenchConfig(concurrency=(1, 4), constrained=1)
    assert cli_main(["bench", "serve", "--url", server.url, "--concurrency", "1,4",
                     "--constrained", "1"]) != 0
    assert "--constrained must leave plain clients at every level (0 .. 0), got 1" in \
        capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli_main(["bench", "serve", "--constrained", "-1"])
    assert "argument --constrained: must be >= 0, got -1" in capsys.readouterr().err


def test_requests_refused_with_503_are_counted(tiny, tmp_path, capsys) -> None:
    """A queue of one: of six requests at once, those that find it full get 503."""
    server = ServerProcess(tiny, "--device", "cpu", "-c", "256", "--max-queue", "1",
                           log_dir=tmp_path)
    try:
        code, report, out, err = _bench(
            capsys, tmp_path, "--url", server.url, "--concurrency", "6", "--prompt-tokens", "24",
            "--max-tokens", "32", "--requests", "12", "--warmup", "0", "--completions")
    finally:
        server.close()
    assert code == 0, err
    (lv,) = report["levels"]
    assert lv["ok"] >= 1 and lv["failed"] >= 1 and lv["ok"] + lv["failed"] == 12
    assert set(lv["errors"]) == {e for e in lv["errors"] if e.startswith("HTTP 503:")}
    assert sum(lv["errors"].values()) == lv["failed"]
    assert "c=6 failures: " in out and "HTTP 503" in out
    lines = [json.loads(x) for x in server.log_lines() if x.startswith("{")]
    statuses = Counter(x["status"] for x in lines if x.get("path") == "/v1/completions")
    assert statuses[503] == lv["failed"] and statuses[200] == lv["ok"] + len(
        report["calibration"]["probes"])
    assert lv["output_tokens"] == sum(r["completion_tokens"] for r in report["records"] if r["ok"])


class RawServer:
    """An HTTP server on loopback that answers every POST with a stream it cuts after one
    event ("cut"), never answers at all ("hang"), or a whole stream whose text holds raw
    Unicode line separators (U+2028, U+0085: JSON need not escape them) ("unicode")."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.port = free_port()
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(ready,), daemon=True)
        self.thread.start()
        assert ready.wait(10)

    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        self.server = self.loop.run_until_complete(
            asyncio.start_server(self._handle, "127.0.0.1", self.port))
        ready.set()
        self.loop.run_forever()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next((int(x.split(b":")[1]) for x in head.split(b"\r\n")
                       if x.lower().startswith(b"content-length:")), 0)
        await reader.readexactly(length)
        if self.mode == "hang":
            await asyncio.sleep(60)
        text = "a\u2028b\x85c" if self.mode == "unicode" else "hi"
        event = json.dumps({"id": "x", "choices": [{"index": 0, "text": text}]},
                           ensure_ascii=False).encode()
        chunk = b"data: " + event + b"\n\n"
        if self.mode == "unicode":
            usage = json.dumps({"id": "x", "choices": [], "usage": {"completion_tokens": 1,
                                                                    "prompt_tokens": 16}})
            chunk += b"data: " + usage.encode() + b"\n\ndata: [DONE]\n\n"
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n" + f"{len(chunk):x}\r\n".encode()
                     + chunk + b"\r\n" + (b"0\r\n\r\n" if self.mode == "unicode" else b""))
        await writer.drain()
        writer.close()  # "cut": no terminating chunk, the body is incomplete

    async def _shutdown(self) -> None:
        self.server.close()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self._shutdown(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.mark.parametrize("mode, error", [("cut", "broken stream"), ("hang", "timed out after")])
def test_broken_streams_and_hung_servers_are_failures(tmp_path, capsys, mode, error) -> None:
    raw = RawServer(mode)
    try:
        code, report, out, err = _bench(
            capsys, tmp_path, "--url", f"http://127.0.0.1:{raw.port}", "--model", "m",
            "--concurrency", "2", "--requests", "3", "--warmup", "1", "--max-tokens", "4",
            "--prompt-tokens", "16", "--timeout", "0.5", "--completions")
    finally:
        raw.close()
    assert code == 0, err
    (lv,) = report["levels"]
    assert (lv["ok"], lv["failed"], lv["warmup_failed"]) == (0, 3, 1)
    assert all(e.startswith(error) for e in lv["errors"]), lv["errors"]
    assert lv["output_tps"] == 0 and lv["ttft"]["n"] == 0
    assert "prompts not calibrated" in report["calibration"]["note"]
    assert "| 2 | 0 | 3 |" in out


def test_raw_unicode_line_separators_do_not_cut_an_event(tmp_path, capsys) -> None:
    raw = RawServer("unicode")
    try:
        code, report, out, err = _bench(
            capsys, tmp_path, "--url", f"http://127.0.0.1:{raw.port}", "--model", "m",
            "--concurrency", "2", "--requests", "3", "--warmup", "1", "--max-tokens", "4",
            "--prompt-tokens", "16", "--completions")
    finally:
        raw.close()
    assert code == 0, err
    (lv,) = report["levels"]
    assert (lv["ok"], lv["failed"]) == (3, 0), lv["errors"]


def test_broken_url(tmp_path, capsys) -> None:
    """Nothing listens: without --model there is no model to ask for (one clear line); with
    it, every request is counted as failed."""
    url = f"http://127.0.0.1:{free_port()}"
    code, report, _, err = _bench(capsys, tmp_path, "--url", url, "--concurrency", "1")
    assert code == 1 and report is None
    assert "GET /v1/models" in err and "is the server up?" in err
    code, report, _, err = _bench(capsys, tmp_path, "--url", url, "--model", "m",
                                    "--concurrency", "1", "--requests", "2")
    assert code == 0
    (lv,) = report["levels"]
    assert (lv["ok"], lv["failed"]) == (0, 2) and "ConnectError" in next(iter(lv["errors"]))
