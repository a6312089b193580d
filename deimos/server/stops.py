"""Stop strings on streamed text: never emit any part of a stop string.

Text arrives in pieces (one token's worth); a stop string may straddle pieces. ``StopMatcher``
emits only text that can no longer be the start of a stop string: it holds back the longest
tail of what it has that is a prefix of some stop string, and cuts at the first full match.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopMatcher:
    __slots__ = ("stops", "_held", "stopped")

    def __init__(self, stops: Sequence[str]) -> None:
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        self.stops = tuple(stops)
        self._held = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        """The text now safe to emit. After a match, ``stopped`` is set and further input is
        ignored (the caller stops generating)."""
        if self.stopped:
            return ""
        buf = self._held + text
        if not self.stops:
            self._held = ""
            return buf
        # the earliest match: a later-starting stop must not win over an earlier one
        cut = min((i for i in (buf.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            self._held = ""
            return buf[:cut]
        keep = 0
        for s in self.stops:
            # longest k < len(s) with buf ending in s[:k]
            for k in range(min(len(s) - 1, len(buf)), keep, -1):
                if buf.endswith(s[:k]):
                    keep = k
                    break
        self._held = buf[len(buf) - keep:] if keep else ""
        return buf[: len(buf) - keep]

    def flush(self) -> str:
        """At the end of generation: the held-back tail (it never became a stop string)."""
        out, self._held = ("" if self.stopped else self._held), ""
        return out
