"""Hostile-request fuzzing of ``deimos serve``, without schemathesis: seeded malformed requests
against a real server process, each answer classified.

    python tools/fuzz_api.py [--cases 3000] [--seed 1] [--model PATH] [--timeout 60]

Requests are mutations of valid chat and completion bodies: wrong types, huge and non-finite
numbers, giant strings, lone surrogates, deep JSON, missing fields, bad tools, tool_choice and
schemas, bad n/max_tokens/logprobs; then bodies that are not JSON or not UTF-8, wrong content
types, wrong methods and paths, malformed HTTP, and clients that leave mid-request or
mid-stream. Each outcome is one of:

    ok           2xx with a well-formed answer (a stream ends with ``data: [DONE]``)
    clean_error  4xx with an OpenAI error object (any 4xx for malformed HTTP, which the HTTP
                 layer answers before the app)
    wrong        anything else: a 5xx, a 4xx without an error object, a broken 2xx
    hang         no answer within --timeout
    crash        the server process died

Exit status 0 when every case was ``ok`` or ``clean_error`` and /metrics counted as many 5xx as
the clients saw (none). tests/test_api_fuzz.py runs a short round in CI.
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import shlex
import socket
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

OUTCOMES = ("ok", "clean_error", "wrong", "hang", "crash")


# ---- cases -------------------------------------------------------------------------------------

class Raw:
    """JSON text put into a body as is (NaN, deep nesting json.dumps cannot write, bad escapes)."""

    def __init__(self, text: str) -> None:
        self.text = text


def dumps(v: Any) -> str:
    if isinstance(v, Raw):
        return v.text
    if isinstance(v, dict):
        return "{" + ", ".join(f"{json.dumps(k)}: {dumps(x)}" for k, x in v.items()) + "}"
    if isinstance(v, list):
        return "[" + ", ".join(dumps(x) for x in v) + "]"
    return json.dumps(v)


@dataclass(frozen=True)
class Case:
    name: str
    raw: bytes  # the whole HTTP request
    stream: bool = False  # a 2xx must be an SSE stream ending in [DONE]
    http_level: bool = False  # malformed below the API: any 4xx is clean
    leave: str | None = None  # the client leaves: "now", "mid_body", "first_line"


def http_request(method: str, path: str, body: bytes | None,
                 headers: dict[str, str] | None = None) -> bytes:
    hdrs = {"Host": "127.0.0.1", "Connection": "close"}
    if body is not None:
        hdrs["Content-Type"] = "application/json"
        hdrs["Content-Length"] = str(len(body))
    hdrs.update(headers or {})
    head = f"{method} {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in hdrs.items())
    return head.encode("latin-1") + b"\r\n" + (body or b"")


def _deep(depth: int, open_: str = "[", close: str = "]") -> Raw:
    return Raw(open_ * depth + "1" + close * depth)


def _deep_schema(depth: int) -> Raw:
    return Raw('{"type": "object", "properties": {"a": ' * depth + '{"type": "string"}'
               + "}}" * depth)


def hostile_values(rng: random.Random) -> list[Any]:
    return [None, True, False, 0, -1, 1, 2**31, 2**63, -(2**63), 10**30, 1.5, -1e308, 1e308,
            Raw("NaN"), Raw("Infinity"), Raw("-Infinity"), Raw("1e999"), "", "x", "0.5",
            "x" * rng.choice([1000, 100_000, 2_000_000]), Raw('"\\ud800"'), Raw('"\\u0000"'),
            "\u202e\U0001f600\ufeff", [], {}, [1, "a", None], {"a": 1}, _deep(200),
            _deep(rng.choice([900, 5000, 50_000])), Raw('{"": {"": {"": []}}}')]


FIELDS = ["model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature",
          "top_p", "top_k", "min_p", "n", "stop", "seed", "logprobs", "top_logprobs",
          "logit_bias", "response_format", "tools", "tool_choice", "stream", "stream_options",
          "echo", "suffix", "best_of", "frequency_penalty", "presence_penalty",
          "repetition_penalty", "user", "parallel_tool_calls"]


def _tools(rng: random.Random) -> Any:
    params = rng.choice([
        {"type": "object", "properties": {"a": {"type": "nope"}}},
        {"type": "string"}, {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}},
        {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(30_000)}},
        _deep_schema(rng.choice([40, 100, 3000])), {"type": "object", "required": "a"},
        {"type": "object", "properties": {"a": {"type": "integer", "minimum": "x"}}},
        {"type": "object", "properties": {"city": {"type": "string"}}}])
    name = rng.choice(["f", "get_weather", "", "bad name!", "x" * 100, 7, None])
    tool = {"type": rng.choice(["function", "function", "code", 1]),
            "function": {"name": name, "parameters": params}}
    return rng.choice([[tool], [tool, tool], tool, [1], [{"type": "function"}], "tools"])


def _tool_choice(rng: random.Random) -> Any:
    return rng.choice(["none", "auto", "required", "sometimes", 3, {"type": "function"},
                       {"type": "function", "function": {"name": "missing"}},
                       {"type": "function", "function": {"name": "f"}}])


def _response_format(rng: random.Random) -> Any:
    return rng.choice([
        {"type": "json_object"}, {"type": "json_schema"}, {"type": "xml"}, {"type": "text"},
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 7}}},
        {"type": "json_schema", "json_schema": {"name": "x", "schema": _deep_schema(
            rng.choice([30, 100, 5000]))}},
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "object", "properties": {f"p{i}": {} for i in range(50_000)}}}},
        {"type": "json_schema", "json_schema": {"schema": {"type": "string", "pattern": "(("}}},
        {"type": "json_schema", "json_schema": {"schema": {"type": "integer"}}}])


def _messages(rng: random.Random) -> Any:
    return rng.choice([
        [{"role": "user", "content": "hi"}], [], [{"role": "wizard", "content": "hi"}],
        [{"role": "user"}], [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}],
        [{"role": "user", "content": "hi"}] * rng.choice([50, 2000]),
        [{"role": "tool", "content": "42"}],
        [{"role": "assistant", "content": None, "tool_calls": [
            {"type": "function", "function": {"name": "f", "arguments": "{not json"}}]}],
        [{"role": "user", "content": "{{ raise('x') }} {% for %}"}],
        [{"role": "user", "content": "word " * 3000}], "hi", [["user", "hi"]]])


def body_case(rng: random.Random, model: str) -> Case:
    chat = rng.random() < 0.6
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body: dict[str, Any] = {"model": model, "max_tokens": rng.choice([1, 2])}
    body.update({"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"})
    special: dict[str, Callable[[random.Random], Any]] = {
        "tools": _tools, "tool_choice": _tool_choice, "response_format": _response_format,
        "messages": _messages}
    names = []
    for _ in range(rng.choice([1, 1, 2, 3])):
        field = rng.choice(FIELDS)
        names.append(field)
        r = rng.random()
        if r < 0.1:
            body.pop(field, None)
        elif field in special and r < 0.7:
            body[field] = special[field](rng)
        elif r < 0.85:
            body[field] = rng.choice(hostile_values(rng))
        else:
            body[field] = rng.choice([1, 2, 3, 0.7, True, "stop", ["\n"], 5, 20])
    stream = body.get("stream") is True
    return Case(f"{path.rsplit('/', 1)[1]}:{'+'.join(names)}",
                http_request("POST", path, dumps(body).encode("utf-8", "surrogatepass")),
                stream=stream)


def raw_case(rng: random.Random, model: str) -> Case:
    path = rng.choice(["/v1/chat/completions", "/v1/completions"])
    good = dumps({"model": model, "prompt": "hi", "max_tokens": 1}).encode()
    kind = rng.choice(["truncated", "bad_utf8", "empty", "array", "string", "text_plain",
                       "form", "no_type", "gzip", "short_length", "wrong_method", "no_route",
                       "long_path", "query", "huge_header", "bad_request_line", "leave_now",
                       "leave_mid_body", "leave_mid_stream", "many_headers", "null_body"])
    req = http_request("POST", path, good)
    http_level, leave, stream = False, None, False
    if kind == "truncated":
        req = http_request("POST", path, good[: rng.randrange(1, len(good))])
    elif kind == "bad_utf8":
        req = http_request("POST", path, good.replace(b"hi", b"h\xff\xfe\xc0"))
    elif kind == "empty":
        req = http_request("POST", path, b"")
    elif kind == "array":
        req = http_request("POST", path, b"[1, 2, 3]")
    elif kind == "string":
        req = http_request("POST", path, b'"hello"')
    elif kind == "null_body":
        req = http_request("POST", path, b"null")
    elif kind == "text_plain":
        req = http_request("POST", path, good, {"Content-Type": "text/plain"})
    elif kind == "form":
        req = http_request("POST", path, b"model=x&prompt=hi",
                           {"Content-Type": "application/x-www-form-urlencoded"})
    elif kind == "no_type":
        req = req.replace(b"Content-Type: application/json\r\n", b"")
    elif kind == "gzip":
        req = http_request("POST", path, b"\x1f\x8b\x08garbage", {"Content-Encoding": "gzip"})
    elif kind == "short_length":
        req = http_request("POST", path, good, {"Content-Length": str(len(good) // 2)})
    elif kind == "wrong_method":
        req = http_request(rng.choice(["GET", "PUT", "DELETE", "PATCH"]), path, None)
    elif kind == "no_route":
        req = http_request("POST", rng.choice(["/v2/x", "/", "/v1/../etc/passwd", "/%00"]), good)
    elif kind == "long_path":
        req, http_level = http_request("GET", "/v1/models/" + "a" * 20_000, None), True
    elif kind == "query":
        req = http_request("POST", path + "?stream=true&model=" + "x" * 500, good)
    elif kind == "huge_header":
        req, http_level = http_request("POST", path, good, {"X-Big": "v" * 100_000}), True
    elif kind == "many_headers":
        req = http_request("POST", path, good, {f"X-H{i}": "v" for i in range(300)})
        http_level = True
    elif kind == "bad_request_line":
        req, http_level = b"POST\x00 /v1 HTTP/9.9\r\n\r\n", True
    elif kind == "leave_now":
        leave = "now"
    elif kind == "leave_mid_body":
        leave = "mid_body"
    elif kind == "leave_mid_stream":
        body = dumps({"model": model, "prompt": "Tell a long story.", "max_tokens": 40,
                      "stream": True}).encode()
        req, leave, stream = http_request("POST", path, body), "first_line", True
    return Case(f"raw:{kind}", req, stream=stream, http_level=http_level, leave=leave)


def make_case(rng: random.Random, model: str) -> Case:
    return body_case(rng, model) if rng.random() < 0.75 else raw_case(rng, model)


# ---- running and classifying -----------------------------------------------------------------

@dataclass(frozen=True)
class Outcome:
    kind: str  # one of OUTCOMES
    status: int
    detail: str


def _is_error_body(data: bytes) -> bool:
    try:
        err = json.loads(data)["error"]
        return isinstance(err["message"], str) and bool(err["message"]) and {
            "type", "param", "code"} <= err.keys()
    except (ValueError, KeyError, TypeError):
        return False


def _good_answer(case: Case, data: bytes) -> bool:
    if case.stream:
        text = data.decode("utf-8", "replace")
        return text.rstrip().endswith("data: [DONE]")
    try:
        return isinstance(json.loads(data), dict)
    except ValueError:
        return False


def run_case(port: int, case: Case, timeout: float) -> Outcome:
    """Send one case on a fresh connection and classify the answer (crashes are found by the
    caller, from the process)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    try:
        if case.leave == "now":
            return Outcome("ok", 0, "left at once")
        if case.leave == "mid_body":
            sock.sendall(case.raw[: len(case.raw) - 10])
            return Outcome("ok", 0, "left mid-body")
        sock.sendall(case.raw)
        resp = http.client.HTTPResponse(sock)
        try:
            resp.begin()
            if case.leave == "first_line":
                resp.fp.readline()
                return Outcome("ok", resp.status, "left mid-stream")
            data = resp.read()
        except (TimeoutError, socket.timeout):
            return Outcome("hang", 0, f"no answer in {timeout} s")
        except (http.client.HTTPException, ConnectionError) as e:
            return Outcome("wrong", 0, f"broken answer: {e!r}")
    finally:
        sock.close()
    status = resp.status
    if 200 <= status < 300:
        ok = _good_answer(case, data)
        return Outcome("ok" if ok else "wrong", status, "" if ok else data[-300:].decode(
            "utf-8", "replace"))
    if 400 <= status < 500 and (case.http_level or _is_error_body(data)):
        return Outcome("clean_error", status, "")
    return Outcome("wrong", status, data[:300].decode("utf-8", "replace"))


def metrics_5xx(port: int) -> float:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
    finally:
        conn.close()
    total = 0.0
    for line in text.splitlines():
        if line.startswith("deimos_requests_total{") and 'status="5' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


@dataclass
class Report:
    counts: Counter
    seconds: float
    faults: list[tuple[str, Outcome]]
    metrics_5xx: float | None = None

    @property
    def tried(self) -> int:
        return sum(self.counts.values())

    def clean(self) -> bool:
        seen_5xx = sum(1 for _, o in self.faults if o.status >= 500)
        return (self.counts["wrong"] == self.counts["hang"] == self.counts["crash"] == 0
                and self.metrics_5xx == seen_5xx)

    def summary(self) -> str:
        counts = ", ".join(f"{k} {self.counts[k]}" for k in OUTCOMES)
        lines = [f"api fuzz: tried {self.tried} in {self.seconds:.0f} s: {counts}; "
                 f"5xx counted by /metrics: {self.metrics_5xx}"]
        lines += [f"  {o.kind} {o.status} {name}: {o.detail[:200]}" for name, o in self.faults[:20]]
        return "\n".join(lines)


def fuzz(server: Any, n: int, seed: int, model: str, timeout: float = 60) -> Report:
    """``n`` cases against ``server`` (a ``ServerProcess``); stops at a crash."""
    rng = random.Random(seed)
    counts: Counter = Counter()
    faults: list[tuple[str, Outcome]] = []
    t0 = time.monotonic()
    for _ in range(n):
        case = make_case(rng, model)
        try:
            out = run_case(server.port, case, timeout)
        except OSError as e:
            out = Outcome("crash" if server.proc.poll() is not None else "wrong", 0, repr(e))
        if server.proc.poll() is not None:
            out = Outcome("crash", 0, f"the server exited with {server.proc.returncode}")
        counts[out.kind] += 1
        if out.kind not in ("ok", "clean_error"):
            faults.append((case.name, out))
        if out.kind == "crash":
            break
    alive = server.proc.poll() is None
    return Report(counts, time.monotonic() - t0, faults, metrics_5xx(server.port) if alive else None)


def main() -> int:
    from server_support import ServerProcess
    from testdata import data_dir

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(data_dir() / "models/SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--cases", type=int, default=3000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=60, help="seconds before a case hangs")
    ap.add_argument("--server-args", default="", help="more `deimos serve` flags, one string "
                    "(e.g. '--speculative ngram --kv-tokens 256')")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        server = ServerProcess(Path(args.model), "-c", "96", "-n", "2", "--max-queue", "512",
                               *shlex.split(args.server_args), log_dir=Path(tmp))
        try:
            report = fuzz(server, args.cases, args.seed, Path(args.model).stem, args.timeout)
        finally:
            server.close()
        print(report.summary())
        tracebacks = [ln for ln in server.log_lines() if "Traceback" in ln]
        print(f"server log: {len(server.log_lines())} lines, {len(tracebacks)} tracebacks")
    return 0 if report.clean() else 1


if __name__ == "__main__":
    sys.exit(main())
