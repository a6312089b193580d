"""``deimos serve`` starting and stopping: its flags (the engine's, --alias), the address bound
before the model loads, the warning for an open address without a key, and the drain on SIGTERM
with streams in flight.

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
from pathlib import Path

import pytest
from server_support import ServerProcess, free_port
from testdata import REPO, model_path

from deimos.cli import build_parser, main, serve_config
from deimos.server.serve import ServeConfig, ServeError, bind_socket, model_id, warn_if_open

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


def test_engine_flags_and_alias_make_the_serve_config():
    parse = build_parser().parse_args
    cfg = serve_config(parse(["serve", "m", "--device", "cpu", "--max-seqs", "4",
                              "--max-batch-tokens", "256", "--kv-tokens", "4096",
                              "--block-size", "32", "--no-prefix-cache", "--alias", "smol"]))
    assert (cfg.max_seqs, cfg.max_batch_tokens, cfg.kv_tokens, cfg.kv_gib, cfg.block_size,
            cfg.prefix_cache, cfg.alias) == (4, 256, 4096, None, 32, False, "smol")
    assert cfg.engine_options() == {"max_seqs": 4, "max_batch_tokens": 256, "kv_tokens": 4096,
                                    "block_size": 32, "prefix_cache": False}
    plain = serve_config(parse(["serve", "m", "--device", "cpu", "--kv-gib", "0.5"]))
    assert plain.engine_options() == {"kv_gib": 0.5} and plain.alias is None  # the defaults:
    # the engine's (LLM picks max_seqs by device)
    assert model_id(Path("/models/SmolLM2-135M.Q4_1.gguf")) == "SmolLM2-135M.Q4_1"
    assert model_id(Path("/models/SmolLM2-135M.Q4_1.gguf"), "smol") == "smol"


@pytest.mark.parametrize("flags, flag, problem", [
    (["--max-seqs", "0"], "--max-seqs", "must be >= 1, got 0"),
    (["--max-batch-tokens", "x"], "--max-batch-tokens", "must be an integer"),
    (["--kv-tokens", "-3"], "--kv-tokens", "must be >= 1"),
    (["--kv-gib", "0"], "--kv-gib", "must be > 0"),
    (["--kv-gib", "1", "--kv-tokens", "9"], "--kv-tokens", "not allowed with argument --kv-gib"),
    (["--block-size", "48"], "--block-size", "must be a power of two in [16, 256], got 48"),
    (["--block-size", "512"], "--block-size", "must be in [16, 256]"),
], ids=["seqs", "batch-tokens", "kv-tokens", "kv-gib", "both-kv", "block-odd", "block-big"])
def test_bad_engine_flag_is_one_line_naming_it(capsys, flags, flag, problem):
    with pytest.raises(SystemExit) as exit_:  # argparse's exit
        main(["serve", "m", "--device", "cpu", *flags])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2
    assert err[-1].startswith(f"deimos serve: error: argument {flag}: ") and problem in err[-1]


@pytest.mark.parametrize("command", [["serve", "m"], ["run", "m", "hi"], ["chat", "m"]])
def test_a_batch_budget_below_the_sequences_names_both_flags(capsys, command):
    """A combination the engine refuses: one line, before anything loads (the model "m" does
    not exist, and that is not what is said)."""
    code = main([*command, "--device", "cpu", "--max-seqs", "8", "--max-batch-tokens", "4"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1, err
    assert err[0] == ("deimos: error: --max-batch-tokens (4) must be >= --max-seqs (8): every "
                      "running sequence decodes at each step")


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
