"""Recorded coding-agent sessions for ``deimos bench agent``, made from realistic parts.

A session file is JSONL (gzipped when it ends in .gz): one OpenAI chat-completion request body
per turn, each carrying the whole conversation so far (system prompt, ``tools``, every earlier
message) and ``max_tokens``, the recorded answer's length, to which the bench forces the
answer. The recorded answer itself is the first new message of the next turn's history, as an
agent would have sent it back: the server's own answer (nonsense on random weights) is thrown
away, only its length counts.

The agent is scripted (deimos.bench.session_script) over the standard library's sources
(deimos.bench.session_parts): it greps, reads windows of real files (numbered as cat -n),
quotes and edits functions it read, runs tests whose output cites the real lines, and reviews
a real unified diff. Three shapes:

- ``multi-turn``: 30+ short turns; the prompt grows to ``prompt_tokens`` (30k);
- ``long-prompt``: one document of ``prompt_tokens`` (whole source files) and a question,
  then one follow-up question on the same document;
- ``long-decode``: every answer ``decode_tokens`` (2k) long: whole files written back.

Token counts are estimates, ceil(characters / 4) (``est_tokens``): no tokenizer is needed, so
the generator runs anywhere. Real tokenizers cut numbered listings and JSON-escaped tool
arguments finer than whole files: the committed sessions' last prompts (texts and tools'
JSON, no template) are 30.6k / 30.3k / 27.1k tokens with Llama 3's tokenizer and 34.1k /
30.4k / 29.2k with Qwen2's (multi-turn / long-prompt / long-decode; estimates 29.8k / 33.1k /
26.2k): a server needs a context of 40k for them (SmolLM2's smaller vocabulary: 36.4k).
Everything is drawn from ``random.Random(f"{seed}:{shape}")``: the same seed and the same
stdlib files give the same bytes.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import math
import random
import sys
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from deimos.bench.session_parts import SYSTEM_PARAGRAPHS, TOOLS, sources

SHAPES = ("multi-turn", "long-prompt", "long-decode")
MESSAGE_OVERHEAD = 4  # estimated tokens a chat template adds around each message
SESSIONS_DIR = Path(__file__).resolve().parents[2] / "bench" / "sessions"


@dataclass(frozen=True)
class Sizes:
    """How big the sessions are. ``FULL`` is the one committed; ``SMALL`` makes sessions a tiny
    CPU model replays in seconds (tests)."""

    prompt_tokens: int = 30_000  # multi-turn/long-decode: the last prompt; long-prompt: the document
    read_tokens: tuple[int, int] = (1000, 4000)  # one file read (multi-turn)
    min_turns: int = 30  # multi-turn
    decode_tokens: int = 2048  # each long-decode answer
    answer_tokens: int = 400  # each long-prompt answer
    max_tokens_cap: int | None = None  # every turn's max_tokens at most this (tests)
    n_tools: int = len(TOOLS)
    system_paragraphs: int = len(SYSTEM_PARAGRAPHS)

    def __post_init__(self) -> None:
        lo, hi = self.read_tokens
        if not 0 < lo <= hi:
            raise ValueError(f"sessions: read_tokens must be 0 < lo <= hi, got {self.read_tokens}")
        if not 1 <= self.n_tools <= len(TOOLS):
            raise ValueError(f"sessions: n_tools must be in 1..{len(TOOLS)}, got {self.n_tools}")
        if not 1 <= self.system_paragraphs <= len(SYSTEM_PARAGRAPHS):
            raise ValueError(f"sessions: system_paragraphs must be in 1..{len(SYSTEM_PARAGRAPHS)}")
        for name in ("prompt_tokens", "min_turns", "decode_tokens", "answer_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"sessions: {name} must be >= 1, got {getattr(self, name)}")


FULL = Sizes()
SMALL = Sizes(prompt_tokens=2000, read_tokens=(80, 200), min_turns=6, decode_tokens=120,
              answer_tokens=60, max_tokens_cap=6, n_tools=3, system_paragraphs=1)


def est_tokens(text: str) -> int:
    """The token estimate: ceil(characters / 4)."""
    return math.ceil(len(text) / 4)


def message_tokens(m: dict[str, Any]) -> int:
    n = MESSAGE_OVERHEAD + est_tokens(m.get("content") or "")
    for c in m.get("tool_calls") or ():
        n += est_tokens(c["function"]["name"] + c["function"]["arguments"]) + 3
    return n


def request_tokens(body: dict[str, Any]) -> int:
    """A request's estimated prompt: its messages and its tool schemas (as JSON)."""
    tools = body.get("tools")
    n = est_tokens(json.dumps(tools, ensure_ascii=False)) if tools else 0
    return n + sum(message_tokens(m) for m in body["messages"])


class Recorder:
    """A conversation being recorded: ``turn(answer, *results)`` writes the request the
    answer replies to (the conversation so far), then appends the answer and what came back."""

    def __init__(self, system: str, tools: list[dict[str, Any]], rng: random.Random,
                 cap: int | None) -> None:
        self.messages: list[dict[str, Any]] = [{"role": "system", "content": system}]
        self.tools = tools
        self.rng = rng
        self.cap = cap
        self.requests: list[dict[str, Any]] = []
        self.read: set[str] = set()  # the stdlib files whose text went into the session
        self._tools_tokens = est_tokens(json.dumps(tools, ensure_ascii=False))
        self._tokens = self._tools_tokens + message_tokens(self.messages[0])

    @property
    def tokens(self) -> int:
        """The estimated prompt of the next request."""
        return self._tokens

    def add(self, *messages: dict[str, Any]) -> None:
        for m in messages:
            self.messages.append(m)
            self._tokens += message_tokens(m)

    def turn(self, answer: dict[str, Any], *results: dict[str, Any]) -> None:
        n = message_tokens(answer) - MESSAGE_OVERHEAD
        if self.cap is not None:
            n = min(n, self.cap)
        self.requests.append({"messages": [dict(m) for m in self.messages], "tools": self.tools,
                              "max_tokens": max(1, n)})
        self.add(answer, *results)

    def call_id(self) -> str:
        # 9 letters and digits: Mistral's templates refuse any other tool call id
        return "".join(self.rng.choice("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
                                       "0123456789") for _ in range(9))

    def call(self, name: str, **arguments: Any) -> dict[str, Any]:
        return {"id": self.call_id(), "type": "function",
                "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}


def assistant(content: str, *calls: dict[str, Any]) -> dict[str, Any]:
    m: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        m["tool_calls"] = list(calls)
    return m


def tool_result(call: dict[str, Any], content: str) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call["id"], "content": content}


def user(content: str) -> dict[str, Any]:
    return {"role": "user", "content": content}


def new_recorder(sizes: Sizes, rng: random.Random) -> Recorder:
    system = "\n\n".join(SYSTEM_PARAGRAPHS[:sizes.system_paragraphs])
    return Recorder(system, [dict(t) for t in TOOLS[:sizes.n_tools]], rng, sizes.max_tokens_cap)


def record(shape: str, sizes: Sizes = FULL, seed: int = 0) -> Recorder:
    """One session recorded: ``.requests`` (the request bodies in turn order), ``.read``."""
    from deimos.bench import session_script

    builders = {"multi-turn": session_script.multi_turn, "long-prompt": session_script.long_prompt,
                "long-decode": session_script.long_decode}
    if shape not in builders:
        raise ValueError(f"sessions: unknown shape {shape!r} (one of {', '.join(SHAPES)})")
    rng = random.Random(f"{seed}:{shape}")
    rec = new_recorder(sizes, rng)
    builders[shape](rec, sizes, rng)
    return rec


def generate(shape: str, sizes: Sizes = FULL, seed: int = 0) -> list[dict[str, Any]]:
    """The request bodies of one session, in turn order."""
    return record(shape, sizes, seed).requests


def to_jsonl(requests: Iterable[dict[str, Any]]) -> bytes:
    return b"".join(json.dumps(r, ensure_ascii=False, separators=(",", ":")).encode() + b"\n"
                    for r in requests)


def load_session(path: str | Path) -> list[dict[str, Any]]:
    """The request bodies of a session file (.jsonl or .jsonl.gz), or of a committed session
    by name (``multi-turn``, ``long-prompt``, ``long-decode``). Each must be a JSON object with
    ``messages`` (a non-empty list) and ``max_tokens`` (a positive integer)."""
    p = Path(path)
    if not p.exists() and str(path) in SHAPES:
        p = SESSIONS_DIR / f"{path}.jsonl.gz"
    if not p.exists():
        raise FileNotFoundError(f"bench agent: no session file {str(path)!r} (a path, or one of "
                                f"{', '.join(SHAPES)})")
    data = p.read_bytes()
    if data[:2] == b"\x1f\x8b":
        data = gzip.decompress(data)
    out = []
    for i, line in enumerate(data.decode("utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            body = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"bench agent: {p}:{i} is not JSON: {e}") from None
        if not isinstance(body, dict) or not isinstance(body.get("messages"), list) \
                or not body["messages"]:
            raise ValueError(f"bench agent: {p}:{i} is not a chat request (no messages)")
        n = body.get("max_tokens")
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"bench agent: {p}:{i} has no positive integer max_tokens")
        out.append(body)
    if not out:
        raise ValueError(f"bench agent: {p} holds no turns")
    return out


def summary(requests: list[dict[str, Any]]) -> dict[str, Any]:
    """Turns and estimated token counts of a session."""
    prompts = [request_tokens(r) for r in requests]
    answers = [r["max_tokens"] for r in requests]
    return {"turns": len(requests), "first_prompt_tokens": prompts[0],
            "last_prompt_tokens": prompts[-1], "answer_tokens": sum(answers),
            "max_answer_tokens": max(answers), "min_answer_tokens": min(answers)}


def write_sessions(out_dir: Path, sizes: Sizes = FULL, seed: int = 0) -> dict[str, Any]:
    """Every shape as ``out_dir/SHAPE.jsonl.gz`` plus ``manifest.json`` (sizes, the sources read
    with their sha256, the Python that read them). Returns the manifest."""
    out_dir.mkdir(parents=True, exist_ok=True)
    manifest: dict[str, Any] = {
        "generator": "tools/make_sessions.py (deimos.bench.sessions)", "seed": seed,
        "sizes": asdict(sizes), "python": ".".join(map(str, sys.version_info[:3])),
        "token_estimate": "ceil(characters / 4) of message contents, tool calls and the tools' "
                          f"JSON, plus {MESSAGE_OVERHEAD} per message",
        "sessions": {},
    }
    read: set[str] = set()
    for shape in SHAPES:
        rec = record(shape, sizes, seed)
        read |= rec.read
        raw = to_jsonl(rec.requests)
        gz = gzip.compress(raw, compresslevel=9, mtime=0)
        (out_dir / f"{shape}.jsonl.gz").write_bytes(gz)
        manifest["sessions"][shape] = {
            "file": f"{shape}.jsonl.gz", **summary(load_session(out_dir / f"{shape}.jsonl.gz")),
            "bytes_jsonl": len(raw), "bytes_gz": len(gz),
            "sha256_jsonl": hashlib.sha256(raw).hexdigest()}
    manifest["sources"] = [{"path": s.path, "stdlib": s.rel, "sha256": s.sha256}
                           for s in sources() if s.rel in read]
    (out_dir / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest
