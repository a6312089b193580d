"""One-time notices of a model's interim or fallback paths (logged once per model, kept for
reports such as ``deimos bench``)."""

from __future__ import annotations

import logging

log = logging.getLogger("deimos")


class Notices:
    def __init__(self) -> None:
        self.seen: dict[str, str] = {}  # key -> message, in order of first occurrence

    def once(self, key: str, message: str, level: int = logging.INFO) -> None:
        if key not in self.seen:
            self.seen[key] = message
            log.log(level, "GPU path: %s", message)
