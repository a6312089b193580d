"""A short round of the API fuzzer (tools/fuzz_api.py) against a real ``deimos serve`` process:
seeded hostile requests, each answer classified (ok, clean 4xx, wrong, hang, crash). The long
round: ``python tools/fuzz_api.py --cases 3000``.

Oracle: the OpenAI error-object shape of every 4xx, a well-formed body for every 2xx, the
process staying alive, and /metrics counting exactly the 5xx the clients saw (none)."""

from __future__ import annotations

import sys

import pytest
from server_support import ServerProcess
from testdata import REPO, model_path

sys.path.insert(0, str(REPO / "tools"))

from fuzz_api import fuzz  # noqa: E402

SMOL = "SmolLM2-135M-Instruct.Q4_1.gguf"
CASES = 100

pytestmark = pytest.mark.timeout(600)


def test_short_fuzz_round(tmp_path):
    server = ServerProcess(model_path(SMOL), "-c", "96", "-n", "2", "--max-queue", "512",
                           log_dir=tmp_path)
    try:
        report = fuzz(server, CASES, seed=12, model="SmolLM2-135M-Instruct.Q4_1", timeout=60)
    finally:
        server.close()
    print(report.summary())
    assert report.tried == CASES and report.clean(), report.summary()
    assert report.counts["ok"] > 10 and report.counts["clean_error"] > 50  # both kinds tried
    assert not [ln for ln in server.log_lines() if "Traceback" in ln]
