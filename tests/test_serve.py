"""``deimos serve`` starting and stopping: the address bound before the model loads, the warning for
an open address without a key, and the drain on SIGTERM with streams in flight.

Oracles: the process's exit status and stderr, what each client's HTTP connection received
(``http.client`` raises IncompleteRead on a chunked body without its terminator), whether a new
connection is accepted.
"""

from __future__ import annotations

import http.client
import json
import logging
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
from server_support import ServerProcess, free_port
from testdata import REPO, model_path

from deimos.server.serve import ServeConfig, ServeError, bind_socket, warn_if_open

SMOL = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_ID = "SmolLM2-135M-Instruct.Q4_1"
GRACE_S = 5.0

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize("host, key, loud", [
    ("0.0.0.0", None, True), ("::", None, True), ("192.168.1.7", None, True),
    ("myhost.example", None, True), ("0.0.0.0", "k", False), ("127.0.0.1", None, False),
    ("::1", None, False), ("localhost", None, False),
])
def test_open_address_without_a_key_is_warned_about(capsys, caplog, host, key, loud):
    with caplog.at_level(logging.WARNING, logger="deimos.server"):
        warn_if_open(ServeConfig("m", host=host, api_key=key))
    err = capsys.readouterr().err
    assert ("WARNING" in err and host in err and "API key" in err) == loud, err
    assert any("no API key" in r.getMessage() for r in caplog.records) == loud


def test_busy_port_is_a_clear_error():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(ServeError, match=f"cannot listen on 127.0.0.1:{port}"):
            bind_socket("127.0.0.1", port)
    sock = bind_socket("127.0.0.1", port)  # free again
    sock.close()


def test_busy_port_fails_before_the_model_loads(tmp_path):
    """The model file is not a GGUF file: had the model been loaded first, that would be the
    error."""
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        st = subprocess.run(
            [sys.executable, "-m", "deimos", "serve", str(bad), "--listen",
             f"127.0.0.1:{port}", "--no-tui"], cwd=REPO, capture_output=True, text=True,
            timeout=120)
    assert st.returncode == 2, st.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in st.stderr and "--listen" in st.stderr
    assert "GGUF" not in st.stderr and "serving" not in st.stderr


def _stream(server: ServerProcess, max_tokens: int, out: dict, first: threading.Event) -> None:
    conn = server.connect(timeout=120)
    body = {"model": MODEL_ID, "prompt": "Once upon a time", "max_tokens": max_tokens,
            "stream": True, "temperature": 0}
    conn.request("POST", "/v1/completions", body=json.dumps(body),
                 headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    lines = [resp.readline()]
    first.set()
    try:
        rest = resp.read()  # IncompleteRead without the chunked terminator
        out["events"] = [ln[6:] for ln in (b"".join(lines) + rest).decode().split("\n\n")
                         if ln.startswith("data: ")]
    except http.client.IncompleteRead as e:
        out["error"] = repr(e)
    out["status"] = resp.status


def test_sigterm_drains_streams_and_exits_0(tmp_path):
    server = ServerProcess(model_path(SMOL), log_dir=tmp_path,
                           config={"n_ctx": 256, "grace_s": GRACE_S})
    try:
        short, long_ = {}, {}
        got_short, got_long = threading.Event(), threading.Event()
        threads = [threading.Thread(target=_stream, args=(server, 1, short, got_short)),
                   threading.Thread(target=_stream, args=(server, 200, long_, got_long))]
        threads[0].start()
        assert got_short.wait(60)
        threads[1].start()
        assert got_long.wait(60)  # its role chunk: the long stream is in flight
        t0 = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        with pytest.raises(OSError):  # no longer accepting
            server.request("GET", "/health", timeout=5)
        for t in threads:
            t.join(60)
        code = server.proc.wait(30)
        elapsed = time.monotonic() - t0
    finally:
        server.close()
    log = server.log_path.read_text()
    assert code == 0, log
    assert elapsed < GRACE_S + 5, elapsed
    # the short one finished normally within the grace period
    assert short.get("status") == 200 and "error" not in short, short
    finals = [json.loads(e)["choices"][0]["finish_reason"] for e in short["events"][:-1]]
    assert finals[-1] == "length" and short["events"][-1] == "[DONE]"
    # the long one was cut with an event saying why, then [DONE] and a proper end
    assert long_.get("status") == 200 and "error" not in long_, long_
    assert long_["events"][-1] == "[DONE]"
    err = json.loads(long_["events"][-2])["error"]
    assert err["code"] == "server_shutting_down" and "shutting down" in err["message"]
    assert "SIGTERM: draining" in log and "Traceback" not in log
