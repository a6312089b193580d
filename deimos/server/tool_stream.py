"""Tool calls in a streamed reply: content sent as it is written, only what may be a call held.

    split = ToolCallSplitter("hermes", names={"get_weather"})
    for piece, marks in pieces:               # the reply's text as the engine writes it
        text, released = split.feed(piece, marks)   # content to send now, and its pieces' marks
    end = split.finish()                      # end.content (the rest), end.calls, end.marks

What is sent can no longer be part of a call; the rest is held from the first point where a
call may start, and at the end the whole reply goes through ``tools.parse_tool_calls``, so the
content sent plus ``end.content`` is the content the same text gives unstreamed, and
``end.calls`` are its calls. What is held, by style:

- hermes: a ``<tool_call>`` block from its opening tag; a block that closes without a call in
  it is released. A partial tag at the end of the text ("<tool_") waits for what follows.
- llama3: everything from the first ``<|python_tag|>`` (its pythonic call reads the whole
  rest); a JSON object from its ``{`` until it closes (released unless it is a call) or
  cannot be JSON any more (``json_prefix``), as ``parse_tool_calls`` finds calls anywhere.
- both: trailing whitespace (llama3: and ``;``) until more text follows, since a call after
  it would trim it; once a call is found, everything after it.

A forced call (``hold=True``, or a ``prefix`` that opens the call) is held whole. ``marks``
are per-piece payloads (the tokens' logprobs): a piece's marks are released with its last
character.
"""

from __future__ import annotations

import json
import logging
from collections import deque
from collections.abc import Collection, Sequence
from typing import Any, NamedTuple

from deimos.server.json_prefix import COMPLETE, INVALID, JsonPrefix
from deimos.server.tools import PYTHON_TAG, hermes_block_calls, llama3_call, parse_tool_calls

__all__ = ["Ending", "ToolCallSplitter"]

log = logging.getLogger("deimos.server")

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class Ending(NamedTuple):
    content: str  # content not sent yet ("" when none)
    calls: list[dict[str, Any]]  # parse_tool_calls' calls of the whole reply
    marks: list  # the marks of the pieces not released yet


def _partial(text: str, marker: str, start: int) -> int:
    """Length of the longest proper prefix of ``marker`` that ``text`` ends with, from
    ``start`` on."""
    for k in range(min(len(marker) - 1, len(text) - start), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


class _Hermes:
    """Where a ``<tool_call>`` block may start (``_parse_hermes``' blocks, in its order)."""

    def __init__(self, names: Collection[str] | None) -> None:
        self.names = names
        self.pos = 0  # blocks before this were resolved: not calls
        self.search = 0  # OPEN cannot start before this
        self.open_at = -1  # an open block's start
        self.close_search = 0
        self.call_at = -1

    def limit(self, text: str) -> int:
        if self.call_at >= 0:
            return self.call_at
        while True:
            if self.open_at < 0:
                at = text.find(OPEN, self.search)
                if at < 0:
                    self.search = max(self.pos, len(text) - len(OPEN) + 1)
                    return len(text) - _partial(text, OPEN, self.pos)
                self.open_at, self.close_search = at, at + len(OPEN)
            close = text.find(CLOSE, self.close_search)
            if close < 0:
                self.close_search = max(self.open_at + len(OPEN), len(text) - len(CLOSE) + 1)
                return self.open_at
            try:
                calls = hermes_block_calls(text[self.open_at + len(OPEN):close], self.names)
            except Exception:  # noqa: BLE001 - the whole parse will fail: hold, it decides
                calls = []
            if calls is not None:
                self.call_at = self.open_at
                return self.call_at
            self.pos = self.search = close + len(CLOSE)
            self.open_at = -1


_DECODER = json.JSONDecoder()


class _Llama3:
    """Where a call may start: the first python tag, or a JSON object (``_json_objects``'
    scan: from each ``{`` not inside an object already read)."""

    def __init__(self, names: Collection[str] | None) -> None:
        self.names = names
        self.tag_at = -1
        self.tag_search = 0
        self.pos = 0  # the scan for the next object starts here
        self.obj: JsonPrefix | None = None
        self.obj_at = 0
        self.read = 0  # the object's characters read so far end here
        self.call_at = -1

    def limit(self, text: str) -> int:
        if self.tag_at < 0:
            self.tag_at = text.find(PYTHON_TAG, self.tag_search)
            self.tag_search = max(0, len(text) - len(PYTHON_TAG) + 1)
        tag = self.tag_at if self.tag_at >= 0 else len(text) - _partial(text, PYTHON_TAG, 0)
        return self._json(text, tag)

    def _json(self, text: str, stop: int) -> int:
        """min(stop, where a JSON call may start); objects from ``stop`` on are not read."""
        if self.call_at >= 0:
            return min(stop, self.call_at)
        while True:
            if self.obj is None:
                at = text.find("{", self.pos, stop)
                if at < 0:
                    self.pos = max(self.pos, stop)
                    return stop
                self.obj, self.obj_at, self.read = JsonPrefix(), at, at
            state = self.obj.feed(text, self.read)
            self.read = len(text)
            if state == INVALID:
                self.obj, self.pos = None, self.obj_at + 1
                continue
            if state != COMPLETE:
                return min(stop, self.obj_at)
            try:
                value, end = _DECODER.raw_decode(text, self.obj_at)
            except ValueError:  # as _json_objects: try the next "{"
                self.obj, self.pos = None, self.obj_at + 1
                continue
            except Exception:  # noqa: BLE001 - RecursionError: the whole parse decides
                value, end = None, -1
            if end < 0 or llama3_call(value, self.names) is not None:
                self.call_at = self.obj_at
                return min(stop, self.call_at)
            self.obj, self.pos = None, end


class ToolCallSplitter:
    """One streamed reply's text split into content to send now and what may be a call."""

    def __init__(self, style: str, names: Collection[str] | None = None, prefix: str = "",
                 hold: bool = False) -> None:
        """``style``, ``names``: as ``parse_tool_calls``. ``prefix``: text before the reply
        (a forced call's opening tag); with it, or ``hold``, nothing is sent before the end."""
        self.style, self.names, self.prefix = style, names, prefix
        self.hold = hold or bool(prefix)
        scan = {"hermes": _Hermes, "llama3": _Llama3}.get(style)
        self._scan = scan(names) if scan is not None else None  # None: no calls to find
        self._extra = ";" if style == "llama3" else ""  # trimmed besides whitespace
        self.text = ""
        self.n_sent = 0  # text[:n_sent] went out as content
        self._blank_from = 0  # text's trailing run of trimmable characters starts here
        self._backed: tuple[int, int] = (-1, 0)  # (limit, its end) of the last back-off
        self._marks: deque[tuple[int, Sequence]] = deque()  # (piece's end, its marks)

    def _blank(self, ch: str) -> bool:
        return ch.isspace() or ch in self._extra

    def feed(self, piece: str, marks: Sequence = ()) -> tuple[str, list]:
        """The content that can go out now (maybe ""), and the marks of the pieces it ends."""
        start = len(self.text)
        self.text += piece
        i = len(piece)
        while i and self._blank(piece[i - 1]):
            i -= 1
        if i:
            self._blank_from = start + i
        self._marks.append((len(self.text), marks))
        if self.hold:
            return "", []
        end = self._safe_end()
        out = self.text[self.n_sent:end] if end > self.n_sent else ""
        self.n_sent = max(self.n_sent, end)
        released: list = []
        while self._marks and self._marks[0][0] <= self.n_sent:
            released += self._marks.popleft()[1]
        return out, released

    def _safe_end(self) -> int:
        """The end of the text no call can start in, less the trimmable run before it."""
        if self._scan is None:
            return len(self.text)
        limit = self._scan.limit(self.text)
        if limit == len(self.text):
            return max(self.n_sent, self._blank_from)
        if limit != self._backed[0]:  # the text before limit does not change: once per limit
            end = limit
            while end > self.n_sent and self._blank(self.text[end - 1]):
                end -= 1
            self._backed = (limit, end)
        return max(self.n_sent, self._backed[1])

    def finish(self) -> Ending:
        """The end of the reply: the content not sent yet, the calls, the marks held."""
        marks = [m for _, ms in self._marks for m in ms]
        self._marks.clear()
        content, calls = parse_tool_calls(self.prefix + self.text, self.style, self.names)
        content = content or ""
        sent = self.text[:self.n_sent]
        if not content.startswith(sent):  # a bug here: what went out cannot be taken back
            log.error("tool-call stream: the content sent (%d characters) is not the start "
                      "of the reply's content (%s style)", len(sent), self.style)
            return Ending("", calls, marks)
        return Ending(content[len(sent):], calls, marks)
