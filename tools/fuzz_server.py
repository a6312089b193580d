"""Schema-driven fuzzing of ``deimos serve``: schemathesis generates requests from the server's
own /openapi.json (valid and invalid ones) and checks that none gets a 5xx.

    python tools/fuzz_server.py [--model PATH] [--max-examples 40] [--max-time 900]

Starts its own server on a free loopback port (small context, so generated requests that are
valid stay short on a CPU), runs ``schemathesis run`` against it, then checks /health and the
server's own 5xx count in /metrics. Exit status: 0 when no 5xx and the server is alive.
Needs the ``fuzz`` extra (schemathesis).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import signal
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from server_support import ServerProcess  # noqa: E402
from testdata import data_dir  # noqa: E402


def main() -> int:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so `finally` stops the server
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(data_dir() / "models/SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--ctx", type=int, default=96, help="server context size")
    ap.add_argument("--max-examples", type=int, default=40, help="cases per operation and phase")
    ap.add_argument("--max-time", type=int, default=900, help="seconds for the whole run")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        server = ServerProcess(Path(args.model), "-c", str(args.ctx), "-n", "8",
                               "--max-queue", "512", log_dir=Path(tmp))
        t0 = time.monotonic()
        try:
            cmd = [str(Path(sys.executable).parent / "schemathesis"), "run",
                   f"{server.url}/openapi.json", "--checks", "not_a_server_error",
                   "--max-examples", str(args.max_examples), "--max-time", str(args.max_time),
                   "--seed", str(args.seed), "--workers", "1", "--request-timeout", "600",
                   "--no-color", "--phases", "examples,coverage,fuzzing",
                   "--generation-database", "none",
                   "--suppress-health-check", "all"]
            print("+", " ".join(cmd), flush=True)
            st = subprocess.run(cmd, capture_output=True, text=True)
            print(st.stdout[-6000:])
            print(st.stderr[-2000:], file=sys.stderr)
            alive = server.request("GET", "/health", timeout=30)[0] == 200
            _, metrics = server.request("GET", "/metrics", timeout=30)
            counts: dict[str, float] = {}
            for line in metrics.splitlines():
                m = re.match(r'deimos_requests_total\{route="([^"]+)",status="(\d+)"\} (\S+)', line)
                if m:
                    key = f"{m.group(2)}"
                    counts[key] = counts.get(key, 0) + float(m.group(3))
            served = sum(counts.values())
            five = sum(v for k, v in counts.items() if k.startswith("5"))
            print(f"fuzz: {served:.0f} requests in {time.monotonic() - t0:.0f} s, by status "
                  f"{dict(sorted(counts.items()))}; 5xx: {five:.0f}; alive: {alive}; "
                  f"schemathesis exit {st.returncode}")
            errors = [ln for ln in server.log_lines() if "Traceback" in ln or "ERROR" in ln]
            if errors:
                print("server log errors:\n" + "\n".join(errors[:20]))
            return 0 if alive and five == 0 and st.returncode == 0 else 1
        finally:
            server.close()


if __name__ == "__main__":
    sys.exit(main())
