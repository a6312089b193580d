"""One round of llama.cpp's llama-bench on the same file (``-r 1 -o json``), as RoundTimes."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from deimos.bench.stats import RoundTimes


def llama_bench_command(binary: str | Path, model: str | Path, n_prompt: int, n_gen: int) -> list[str]:
    return [str(binary), "-m", str(model), "-p", str(n_prompt), "-n", str(n_gen), "-r", "1",
            "-ngl", "99", "-fa", "1", "-o", "json"]


def parse_llama_bench(text: str, n_prompt: int, n_gen: int) -> RoundTimes:
    """llama-bench's JSON (a list of tests) -> the pp and tg rates as one round."""
    try:
        tests = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"llama-bench output is not JSON ({e}): {text[:200]!r}") from None
    pp = [t for t in tests if t.get("n_prompt") == n_prompt and t.get("n_gen") == 0]
    tg = [t for t in tests if t.get("n_gen") == n_gen and t.get("n_prompt") == 0]
    if len(pp) != 1 or len(tg) != 1:
        raise ValueError(f"llama-bench output lacks one pp{n_prompt} and one tg{n_gen} test")
    return RoundTimes(n_prompt / float(pp[0]["avg_ts"]), n_gen / float(tg[0]["avg_ts"]),
                      n_prompt, n_gen)


def run_llama_bench(binary: str | Path, model: str | Path, n_prompt: int, n_gen: int) -> RoundTimes:
    binary = Path(binary)
    if not binary.is_file():
        raise ValueError(f"--vs-llama: {binary} is not a file (the llama-bench binary)")
    env = dict(os.environ)
    # the release tarballs keep their shared libraries beside the binary
    env["LD_LIBRARY_PATH"] = os.pathsep.join(
        x for x in (str(binary.resolve().parent), env.get("LD_LIBRARY_PATH", "")) if x)
    r = subprocess.run(llama_bench_command(binary, model, n_prompt, n_gen), capture_output=True,
                       text=True, env=env, timeout=1800)
    if r.returncode != 0:
        raise RuntimeError(f"llama-bench failed ({r.returncode}): {r.stderr[-2000:]}")
    return parse_llama_bench(r.stdout, n_prompt, n_gen)
