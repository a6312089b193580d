"""llama.cpp's llama-bench on the same file, in one run of its own: its warm-up run (llama-bench
does one per test unless told --no-warmup) and ``reps`` repetitions of the pp and tg tests,
read back per repetition (``samples_ts`` of its JSON output).

``DEFAULT_LLAMA_ARGS`` are llama-bench's best known flags for one GPU: every layer offloaded
(``-ngl 99``) and flash attention on (``-fa 1``); ``--llama-args`` replaces them. Deimos sets
the model, the test sizes, the repetitions and the output format itself.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

DEFAULT_LLAMA_ARGS = "-ngl 99 -fa 1"
# flags Deimos sets itself: giving them in --llama-args would contradict them
OWN_FLAGS = ("-m", "--model", "-p", "--n-prompt", "-n", "--n-gen", "-r", "--repetitions",
             "-o", "--output")
TIMEOUT_S = 1800.0


@dataclass(frozen=True)
class LlamaRun:
    """Tokens/s of each repetition of the pp and tg tests, and what ran them."""

    prefill_ts: list[float]
    decode_ts: list[float]
    build: str  # llama-bench's build_commit (build_number)
    args: list[str]  # the flags beyond Deimos's own (--llama-args)
    pid: int = 0  # the llama-bench process (to tell it apart in NVML's process list)


def llama_args(text: str | None) -> list[str]:
    """--llama-args split as a shell would; ValueError for a flag Deimos sets itself."""
    args = shlex.split(DEFAULT_LLAMA_ARGS if text is None else text)
    own = [a for a in args if a in OWN_FLAGS]
    if own:
        raise ValueError(f"--llama-args: {', '.join(own)} is set by deimos bench itself "
                         "(the model, -p, -n, -r and -o json)")
    return args


def llama_bench_command(binary: str | Path, model: str | Path, n_prompt: int, n_gen: int,
                        reps: int, args: list[str]) -> list[str]:
    return [str(binary), "-m", str(model), "-p", str(n_prompt), "-n", str(n_gen), "-r", str(reps),
            *args, "-o", "json"]


def parse_llama_bench(text: str, n_prompt: int, n_gen: int) -> tuple[list[float], list[float], str]:
    """llama-bench's JSON (a list of tests) -> (pp tokens/s per repetition, tg tokens/s per
    repetition, build). An older llama-bench without ``samples_ts``: its ``avg_ts`` alone."""
    try:
        tests = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"llama-bench output is not JSON ({e}): {text[:200]!r}") from None
    if not isinstance(tests, list) or not all(isinstance(t, dict) for t in tests):
        raise ValueError(f"llama-bench output is not a list of tests: {text[:200]!r}")
    pp = [t for t in tests if t.get("n_prompt") == n_prompt and t.get("n_gen") == 0]
    tg = [t for t in tests if t.get("n_gen") == n_gen and t.get("n_prompt") == 0]
    if len(pp) != 1 or len(tg) != 1:
        raise ValueError(f"llama-bench output lacks one pp{n_prompt} and one tg{n_gen} test "
                         f"(found {len(pp)} and {len(tg)}; --llama-args must select one "
                         "configuration)")

    def samples(t: dict) -> list[float]:
        values = t.get("samples_ts") or [t["avg_ts"]]
        return [float(v) for v in values]

    build = f"{pp[0].get('build_commit', '?')} ({pp[0].get('build_number', '?')})"
    return samples(pp[0]), samples(tg[0]), build


def run_llama_bench(binary: str | Path, model: str | Path, n_prompt: int, n_gen: int, reps: int,
                    args: list[str], while_running: Callable[[], None] | None = None,
                    poll_s: float = 0.1) -> LlamaRun:
    """One llama-bench run; ``while_running`` is called every ``poll_s`` seconds until it
    exits (the bench watches the GPU's processes there)."""
    binary = Path(binary)
    if not binary.is_file():
        raise ValueError(f"--vs-llama: {binary} is not a file (the llama-bench binary)")
    env = dict(os.environ)
    # the release tarballs keep their shared libraries beside the binary
    env["LD_LIBRARY_PATH"] = os.pathsep.join(
        x for x in (str(binary.resolve().parent), env.get("LD_LIBRARY_PATH", "")) if x)
    cmd = llama_bench_command(binary, model, n_prompt, n_gen, reps, args)
    # files, not pipes: its model-loading log on stderr could fill a pipe while we poll
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=env)
        deadline = time.monotonic() + TIMEOUT_S
        while proc.poll() is None:
            if time.monotonic() > deadline:
                proc.kill()
                proc.wait()
                raise RuntimeError(f"llama-bench ran past {TIMEOUT_S:.0f} s: {shlex.join(cmd)}")
            if while_running is not None:
                while_running()
            time.sleep(poll_s)
        out.seek(0)
        err.seek(0)
        stdout = out.read().decode(errors="replace")
        stderr = err.read().decode(errors="replace")
    if proc.returncode != 0:
        raise RuntimeError(f"llama-bench failed ({proc.returncode}): {stderr[-2000:]}")
    pp, tg, build = parse_llama_bench(stdout, n_prompt, n_gen)
    return LlamaRun(pp, tg, build, list(args), proc.pid)
