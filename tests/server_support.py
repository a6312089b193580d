"""A real ``deimos serve`` process on loopback for the server tests."""

from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from testdata import REPO


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """``deimos serve MODEL --listen 127.0.0.1:PORT --no-tui ARGS``; stderr goes to a file
    (the JSON request log) so a test can read it."""

    def __init__(self, model: Path, *args: str, log_dir: Path, startup_s: float = 180,
                 config: dict[str, Any] | None = None) -> None:
        """``config``: run ``serve(ServeConfig(model, port=..., tui=False, **config))`` instead
        of the command line (for settings the CLI does not expose, such as ``grace_s``)."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / "server.stderr"
        self._log = open(self.log_path, "w")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if config is None:
            argv = ["-m", "deimos", "serve", str(model), "--listen", f"127.0.0.1:{self.port}",
                    "--no-tui", *args]
        else:
            argv = ["-c", "import sys; from deimos.server.serve import ServeConfig, serve; "
                          f"sys.exit(serve(ServeConfig({str(model)!r}, port={self.port}, "
                          f"tui=False, **{config!r})))"]
        self.proc = subprocess.Popen([sys.executable, *argv], cwd=REPO,
                                     stdout=subprocess.DEVNULL, stderr=self._log, env=env)
        deadline = time.monotonic() + startup_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"deimos serve exited with {self.proc.returncode}:\n"
                                   f"{self.log_path.read_text()}")
            try:
                if self.request("GET", "/health", timeout=2)[0] == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"deimos serve did not answer /health in {startup_s} s:\n"
                                   f"{self.log_path.read_text()}")
            time.sleep(0.3)

    def connect(self, timeout: float = 300) -> http.client.HTTPConnection:
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)

    def request(self, method: str, path: str, body: Any = None, *, raw: bytes | None = None,
                headers: dict[str, str] | None = None, timeout: float = 300) -> tuple[int, Any]:
        """(status, parsed JSON or text) of one plain HTTP request."""
        conn = self.connect(timeout)
        try:
            data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
            hdrs = {"Content-Type": "application/json", **(headers or {})}
            conn.request(method, path, body=data, headers=hdrs)
            resp = conn.getresponse()
            text = resp.read().decode()
            try:
                return resp.status, json.loads(text)
            except ValueError:
                return resp.status, text
        finally:
            conn.close()

    def log_lines(self) -> list[str]:
        return self.log_path.read_text().splitlines()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


class InProcessServer:
    """The real app over a real engine, served by uvicorn on loopback in this process, so a
    test can look at the engine (its KV blocks) while clients talk HTTP to it. ``engine``:
    LLM's engine settings (max_seqs, block_size...)."""

    def __init__(self, model: Path, *, n_ctx: int, max_queue: int = 64, model_id: str = "m",
                 **engine: Any) -> None:
        import threading

        import uvicorn

        from deimos.engine import LLM
        from deimos.server.app import Server, create_app
        from deimos.server.metrics import Metrics
        from deimos.server.serve import bind_socket, memory_sizes
        from deimos.server.worker import EngineWorker

        self.llm = LLM(model, n_ctx=n_ctx, **engine)
        self.metrics = Metrics(memory_sizes(self.llm))
        self.worker = EngineWorker(self.llm, self.metrics, max_queue=max_queue)
        self.server = Server(self.llm, self.worker, self.metrics, model_id)
        sock = bind_socket("127.0.0.1", 0)
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._uvicorn = uvicorn.Server(uvicorn.Config(create_app(self.server),
                                                      log_level="warning"))
        self.worker.start()
        self._thread = threading.Thread(target=self._uvicorn.run, kwargs={"sockets": [sock]},
                                        daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._uvicorn.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.05)

    connect = ServerProcess.connect
    request = ServerProcess.request

    def close(self) -> None:
        self._uvicorn.should_exit = True
        self._thread.join(30)
        self.worker.stop()


def sse_events(data: bytes | str) -> list[Any]:
    """The JSON payloads of an SSE body, and "[DONE]" as itself."""
    text = data.decode() if isinstance(data, bytes) else data
    return [json.loads(ev[6:]) if ev[6:] != "[DONE]" else "[DONE]"
            for ev in text.split("\n\n") if ev.startswith("data: ")]


def metric_values(text: str) -> dict[str, float]:
    """Every sample of a Prometheus text exposition: series (with labels) -> value."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            series, _, value = line.rpartition(" ")
            out[series] = float(value)
    return out
