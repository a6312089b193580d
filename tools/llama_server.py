"""llama-server as an instrument for tools/diff_templates.py and tools/diff_chat_tokens.py:
started on a free loopback port, waited for, asked, stopped. Not part of the package."""

from __future__ import annotations

import json
import socket
import subprocess
import time
import urllib.error
import urllib.request
from typing import Any


class LlamaServer:
    def __init__(self, server: str, model: str, *args: str):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.proc = subprocess.Popen([server, "-m", model, "--port", str(self.port), "--jinja", *args],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(150):  # a tiny model loads in well under a second
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=1)
                return
            except OSError:
                time.sleep(0.1)

    def post(self, path: str, body: dict) -> tuple[int, Any]:
        """(status, parsed JSON) of a POST; on an HTTP error the body's first 200 characters."""
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode(errors="replace")[:200]

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def first_difference(ours, theirs) -> int:
    """The first index where two sequences differ (the shorter's length when one is a prefix)."""
    return next((i for i, (x, y) in enumerate(zip(ours, theirs)) if x != y), min(len(ours), len(theirs)))
