"""Soak test of ``deimos serve``: a few hundred requests of random lengths and kinds (chat and
completions, streamed or not, some abandoned mid-stream) from a few concurrent clients, with
the server's resident memory sampled after a warm-up and at the end.

    python tools/soak_server.py [--requests 300] [--clients 3] [--max-growth-mb 64]
    python tools/soak_server.py --model F.gguf --ctx 1024 --requests 1000 --clients 32 \
        --max-new 96 --words 400 --server-args "--device cuda"      # the GPU soak

Exit status 0 when every request got its expected answer (200, or a 400 for the deliberately
too-long prompts), the server is alive, RSS grew less than --max-growth-mb, every KV block is
free again at the end (/metrics), and, on a GPU, the server process's GPU memory (nvidia-smi)
after the warm-up and at the end differs by less than --max-gpu-growth (a fraction).
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from server_support import ServerProcess  # noqa: E402
from testdata import data_dir  # noqa: E402

WORDS = "the a cat dog sea sky blue run jump over under light dark river stone tree".split()


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def gpu_mb(pid: int) -> float | None:
    """GPU memory of ``pid`` (nvidia-smi), None without a GPU."""
    import subprocess

    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True,
                             timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    for line in out.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0] == str(pid):
            return float(parts[1])
    return None


def metrics(server: ServerProcess) -> dict[str, float]:
    """The server's unlabelled gauges and its memory by kind (``memory.KIND``)."""
    conn = server.connect()
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    out = {}
    for line in text.splitlines():
        if line.startswith("deimos_memory_bytes{kind=\""):
            kind = line.split('"')[1]
            out["memory." + kind] = float(line.split()[-1])
        elif line.startswith("deimos_") and " " in line and "{" not in line:
            name, value = line.split()[:2]
            out[name[len("deimos_"):]] = float(value)
    return out


def gib(m: dict[str, float], kind: str) -> str:
    v = m.get("memory." + kind)
    return "-" if v is None else f"{v / 2**30:.2f}"


# the longest random prompt (words) and answer (tokens): the CPU soak's small ones by default
LIMITS = {"words": 80, "max_new": 4}


def one(server: ServerProcess, rng: random.Random, ctx: int) -> str:
    """One random request; returns an outcome label ('ok ...' or 'BAD ...')."""
    sizes = [w for w in (1, 3, 10, 30, 80, 200, 400, 800) if w <= LIMITS["words"]]
    n_words = rng.choice(sizes) if rng.random() > 0.03 else ctx * 2
    text = " ".join(rng.choice(WORDS) for _ in range(n_words))
    body: dict = {"model": "any-id", "max_tokens": rng.randint(1, LIMITS["max_new"]),
                  "temperature": rng.choice([0, 0.7, 1.0]), "seed": rng.randrange(1000)}
    chat = rng.random() < 0.5
    if chat:
        path = "/v1/chat/completions"
        body["messages"] = [{"role": "user", "content": text}]
    else:
        path = "/v1/completions"
        body["prompt"] = text
    if rng.random() < 0.3:
        body["stop"] = [rng.choice(WORDS)]
    if rng.random() < 0.2:
        body["logprobs"] = True if chat else 2
        if chat:
            body["top_logprobs"] = 2
    too_long = n_words >= ctx
    if rng.random() < 0.4 and not too_long:
        body["stream"] = True
        body["max_tokens"] = rng.randint(1, 3 * LIMITS["max_new"])
        abandon = rng.random() < 0.3
        conn = server.connect()
        conn.request("POST", path, body=json.dumps(body),
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            return f"BAD stream status {resp.status}"
        lines = 0
        while True:
            line = resp.readline()
            if not line:
                break
            if line.startswith(b"data: "):
                lines += 1
                if abandon and lines >= 2:
                    conn.sock.close()
                    conn.close()
                    return "ok abandoned"
                if line.strip() == b"data: [DONE]":
                    break
        conn.close()
        return "ok stream" if lines >= 2 else "BAD short stream"
    status, out = server.request("POST", path, body)
    if too_long:
        return "ok too-long 400" if status == 400 else f"BAD too-long got {status}"
    if status != 200:
        return f"BAD status {status}: {out}"
    return "ok " + out["choices"][0]["finish_reason"]


def main() -> int:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so `finally` stops the server
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(data_dir() / "models/SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--clients", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--max-growth-mb", type=float, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--words", type=int, default=80, help="longest random prompt, in words")
    ap.add_argument("--max-new", type=int, default=4, help="most tokens a non-streamed answer asks")
    ap.add_argument("--max-gpu-growth", type=float, default=0.02)
    ap.add_argument("--server-args", default="", help="more `deimos serve` flags (e.g. --device cuda)")
    args = ap.parse_args()
    LIMITS.update(words=args.words, max_new=args.max_new)

    with tempfile.TemporaryDirectory() as tmp:
        server = ServerProcess(Path(args.model), "-c", str(args.ctx), "--max-queue", "256",
                               *args.server_args.split(), log_dir=Path(tmp), startup_s=600)
        try:
            rng = random.Random(args.seed)
            outcomes: Counter[str] = Counter()
            for _ in range(args.warmup):
                outcomes[one(server, rng, args.ctx)] += 1
            rss0 = rss_mb(server.proc.pid)
            gpu0 = gpu_mb(server.proc.pid)
            m0 = metrics(server)
            t0 = time.monotonic()
            lock = threading.Lock()
            left = [args.requests]

            def client(seed: int) -> None:
                r = random.Random(seed)
                while True:
                    with lock:
                        if left[0] == 0:
                            return
                        left[0] -= 1
                    try:
                        o = one(server, r, args.ctx)
                    except Exception as e:  # noqa: BLE001 - counted as a failure
                        o = f"BAD {type(e).__name__}: {e}"
                    with lock:
                        outcomes[o.split(":")[0]] += 1

            threads = [threading.Thread(target=client, args=(args.seed * 100 + i,))
                       for i in range(args.clients)]
            for t in threads:
                t.start()
            samples, gpu_samples = [], []
            while any(t.is_alive() for t in threads):
                samples.append(rss_mb(server.proc.pid))
                if gpu0 is not None:
                    gpu_samples.append(gpu_mb(server.proc.pid) or 0.0)
                time.sleep(2)
            for t in threads:
                t.join()
            time.sleep(1)
            rss1 = rss_mb(server.proc.pid)
            gpu1 = gpu_mb(server.proc.pid)
            m1 = metrics(server)
            used = m1.get("kv_blocks_used")
            alive = server.request("GET", "/health")[0] == 200
            dt = time.monotonic() - t0
            bad = sum(v for k, v in outcomes.items() if k.startswith("BAD"))
            growth = rss1 - rss0
            print(f"soak: {args.requests} requests (+{args.warmup} warm-up) from {args.clients} "
                  f"clients in {dt:.0f} s; outcomes {dict(sorted(outcomes.items()))}")
            print(f"soak: RSS after warm-up {rss0:.1f} MB, at the end {rss1:.1f} MB "
                  f"(growth {growth:+.1f} MB; min/max during {min(samples or [rss1]):.1f}/"
                  f"{max(samples or [rss1]):.1f} MB); alive: {alive}; KV blocks used at the end: {used}")
            print(f"soak: torch GPU memory allocated / reserved GiB: after warm-up {gib(m0, 'gpu_allocated')}"
                  f" / {gib(m0, 'gpu_reserved')}, at the end {gib(m1, 'gpu_allocated')} / "
                  f"{gib(m1, 'gpu_reserved')}")
            gpu_ok = True
            if gpu0 is not None and gpu1 is not None:
                gpu_ok = abs(gpu1 - gpu0) <= args.max_gpu_growth * gpu0
                print(f"soak: GPU memory after warm-up {gpu0:.0f} MiB, at the end {gpu1:.0f} MiB "
                      f"({(gpu1 - gpu0) / gpu0:+.2%}; min/max during {min(gpu_samples or [gpu1]):.0f}/"
                      f"{max(gpu_samples or [gpu1]):.0f} MiB)")
            return 0 if (alive and bad == 0 and growth < args.max_growth_mb and used == 0
                         and gpu_ok) else 1
        finally:
            server.close()


if __name__ == "__main__":
    sys.exit(main())
