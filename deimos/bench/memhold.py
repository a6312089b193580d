"""Another process's memory, for ``deimos bench --gpu-mem`` and ``--squeeze``: a helper process
that allocates device memory, touches it so it is resident, and holds it until it is told to go.

    python -m deimos.bench.memhold --leave 8      # hold all but 8 GiB of the card's free memory
    python -m deimos.bench.memhold --take 2 --rewrite-ms 250   # 2 GiB, rewritten every 250 ms

The helper allocates in pieces of ``--chunk-mib`` (re-reading free memory between pieces, so
its own CUDA context and the allocator's rounding are counted), fills every piece (resident,
not merely reserved), then prints one line ``ready held=B free_before=B free_after=B full=0|1``
on stdout. ``--take`` waits for memory another process gives back (the squeeze: the engine
shrinks its expert cache only between steps), retrying an allocation that fails until
``--wait-s``, then holds what it has (``full=0``; ``stop=`` says why it stopped taking). ``--rewrite-ms``: every piece rewritten at
that period, so the driver cannot page it out (unified memory, oversubscription) and the
holder is not idle memory the driver could reclaim.

It goes when its stdin reaches end of file (the parent closed it, or died: even a SIGKILLed
bench leaves no holder behind), or on SIGTERM/SIGINT (Ctrl-C reaches the whole process
group); it then prints ``rewrites=N``. ``--device cpu`` is the stand-in of the tests: host
memory (numpy), free memory from /proc/meminfo's MemAvailable.

``MemHold`` is the parent's side: the command line, start, the ready line read on a thread
(``wait_ready``), and ``close`` (stdin closed, then SIGTERM, then SIGKILL), as a context
manager so that an exception or Ctrl-C in the bench still ends the helper.
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import NamedTuple, Self

GIB = 1 << 30
MIB = 1 << 20
ALIGN = 2 * MIB  # the CUDA caching allocator's rounding of large blocks
CHUNK_MIB = 256
RETRY_S = 0.05  # between two tries of an allocation that failed (--take)


def to_take(free: int, leave: int, align: int = ALIGN) -> int:
    """Bytes to allocate so that ``leave`` of ``free`` stay free (0 when already below),
    rounded down to ``align``."""
    if free < 0 or leave < 0:
        raise ValueError(f"memhold: free {free} and leave {leave} must be >= 0")
    return max(0, free - leave) // align * align


# ---- the helper ---------------------------------------------------------------------------------


class _Device:
    """Allocation, fill and free memory of one device: CUDA through torch, or host memory."""

    def __init__(self, name: str) -> None:
        self.cuda = name.startswith("cuda")
        if self.cuda:
            import torch

            self.torch = torch
            self.dev = torch.device(name)
            torch.cuda.init()
            torch.empty(1, device=self.dev)  # the context now, so free() counts it
        else:
            import numpy as np

            self.np = np

    def free(self) -> int:
        if self.cuda:
            return int(self.torch.cuda.mem_get_info(self.dev)[0])
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError("memhold: /proc/meminfo has no MemAvailable")

    def alloc(self, n: int):
        """``n`` bytes, filled (so resident); None when the device has no room."""
        if self.cuda:
            try:
                t = self.torch.empty(n, dtype=self.torch.uint8, device=self.dev)
            except self.torch.OutOfMemoryError:
                return None
            t.fill_(1)
            self.torch.cuda.synchronize(self.dev)
            return t
        try:
            a = self.np.empty(n, dtype=self.np.uint8)
        except MemoryError:
            return None
        a.fill(1)
        return a

    def rewrite(self, pieces: list, value: int) -> None:
        for p in pieces:
            p.fill_(value) if self.cuda else p.fill(value)
        if self.cuda:
            self.torch.cuda.synchronize(self.dev)


def _hold(args: argparse.Namespace, done: threading.Event, why: list[str]) -> int:
    dev = _Device(args.device)
    chunk = args.chunk_mib * MIB
    free_before = dev.free()
    pieces: list = []
    held = 0
    full = True
    deadline = time.monotonic() + args.wait_s
    while not done.is_set():
        if args.leave is not None:
            want = min(chunk, to_take(dev.free(), int(args.leave * GIB)))
        else:
            want = min(chunk, int(args.take * GIB) - held) // ALIGN * ALIGN
        if want <= 0:
            break
        p = dev.alloc(want)
        if p is None:
            if args.leave is not None:  # the free reading raced another allocation: read again
                chunk = max(ALIGN, chunk // 2)
                continue
            if time.monotonic() > deadline:
                full = False
                break
            done.wait(RETRY_S)
            continue
        pieces.append(p)
        held += want
    if done.is_set() or (args.take is not None and held < int(args.take * GIB) // ALIGN * ALIGN):
        full = False  # told to go, or out of time, before it held it all
    # why it stopped taking: "all" it wanted, "waited" --wait-s out, or what told it to go
    stop = "all" if full else (why[0] if why else "waited")
    print(f"ready held={held} free_before={free_before} free_after={dev.free()} "
          f"full={int(full)} stop={stop}", flush=True)
    rewrites = 0
    period = args.rewrite_ms / 1000 if args.rewrite_ms else None
    while not done.wait(period if period else 1.0):
        if period:
            rewrites += 1
            dev.rewrite(pieces, rewrites & 0xFF)
    print(f"rewrites={rewrites}", flush=True)
    return 0


def _stdin_eof(done: threading.Event, why: list[str]) -> None:
    try:
        while sys.stdin.buffer.read(4096):
            pass
    except (OSError, ValueError):
        pass
    why.append("stdin")
    done.set()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m deimos.bench.memhold",
                                description="hold device memory until stdin closes")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--leave", type=float, metavar="GIB",
                      help="allocate all but GIB of the device's free memory")
    what.add_argument("--take", type=float, metavar="GIB", help="allocate GIB")
    p.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu (the tests' stand-in)")
    p.add_argument("--rewrite-ms", type=float, default=0.0,
                   help="rewrite the memory at this period (0: never)")
    p.add_argument("--chunk-mib", type=int, default=CHUNK_MIB)
    p.add_argument("--wait-s", type=float, default=60.0,
                   help="--take: how long to retry allocations that fail")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if (args.leave if args.leave is not None else args.take) < 0 or args.rewrite_ms < 0 \
            or args.chunk_mib < 2:
        raise SystemExit("memhold: --leave/--take and --rewrite-ms must be >= 0, --chunk-mib >= 2")
    done = threading.Event()
    why: list[str] = []  # what told it to go

    def on_signal(sig, _frame) -> None:
        why.append(signal.Signals(sig).name)
        done.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    threading.Thread(target=_stdin_eof, args=(done, why), daemon=True).start()
    return _hold(args, done, why)


# ---- the parent's side --------------------------------------------------------------------------


class Held(NamedTuple):
    """The helper's ready line, and when the parent read it (``time.monotonic``)."""

    held: int
    free_before: int
    free_after: int
    full: bool
    at: float
    stop: str = ""  # why it stopped taking (all, waited, stdin, a signal's name)


def parse_ready(line: str, at: float) -> Held | None:
    """``ready held=.. free_before=.. free_after=.. full=..`` -> Held; None for another line."""
    words = line.split()
    if not words or words[0] != "ready":
        return None
    kv = dict(w.split("=", 1) for w in words[1:] if "=" in w)
    try:
        return Held(int(kv["held"]), int(kv["free_before"]), int(kv["free_after"]),
                    kv.get("full", "1") == "1", at, kv.get("stop", ""))
    except (KeyError, ValueError):
        raise ValueError(f"memhold: a ready line without its numbers: {line!r}") from None


class MemHold:
    """A helper process holding memory (module docstring). Give ``leave_gib`` (all but that of
    the free memory) or ``take_gib``."""

    def __init__(self, *, leave_gib: float | None = None, take_gib: float | None = None,
                 device: str = "cuda", rewrite_ms: float = 0.0, wait_s: float = 60.0,
                 chunk_mib: int = CHUNK_MIB, python: str = sys.executable) -> None:
        if (leave_gib is None) == (take_gib is None):
            raise ValueError("MemHold: give exactly one of leave_gib and take_gib")
        amount = leave_gib if leave_gib is not None else take_gib
        if amount < 0 or rewrite_ms < 0:
            raise ValueError(f"MemHold: amounts must be >= 0 (GiB {amount}, ms {rewrite_ms})")
        self.leave_gib, self.take_gib = leave_gib, take_gib
        self.device, self.rewrite_ms, self.wait_s, self.chunk_mib = device, rewrite_ms, wait_s, chunk_mib
        self.python = python
        self.proc: subprocess.Popen | None = None
        self.held: Held | None = None
        self.rewrites: int | None = None
        self.started_at: float | None = None
        self._lines: list[str] = []
        self._ready = threading.Event()
        self._reader: threading.Thread | None = None
        self._err = None
        self.returncode: int | None = None

    def command(self) -> list[str]:
        what = (["--leave", f"{self.leave_gib:g}"] if self.leave_gib is not None
                else ["--take", f"{self.take_gib:g}"])
        return [self.python, "-m", "deimos.bench.memhold", *what, "--device", self.device,
                "--rewrite-ms", f"{self.rewrite_ms:g}", "--wait-s", f"{self.wait_s:g}",
                "--chunk-mib", str(self.chunk_mib)]

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def start(self) -> MemHold:
        import os

        root = str(Path(__file__).resolve().parents[2])  # deimos's parent: importable there
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(x for x in (root, env.get("PYTHONPATH", "")) if x)
        self.started_at = time.monotonic()
        # stderr in a file: torch's warnings could fill a pipe nobody reads
        self._err = tempfile.TemporaryFile()  # noqa: SIM115 - closed with the helper
        self.proc = subprocess.Popen(self.command(), stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self._err, env=env)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        return self

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for raw in self.proc.stdout:
            line = raw.decode(errors="replace").strip()
            self._lines.append(line)
            held = parse_ready(line, time.monotonic())
            if held is not None:
                self.held = held
                self._ready.set()
            elif line.startswith("rewrites="):
                self.rewrites = int(line.split("=", 1)[1])
        self._ready.set()  # it exited: wait_ready returns and says why

    def wait_ready(self, timeout: float = 120.0) -> Held:
        """Blocks until the helper holds its memory; RuntimeError if it died or timed out."""
        if self.proc is None:
            raise RuntimeError("MemHold: not started")
        if not self._ready.wait(timeout) or self.held is None:
            err = self._stderr_tail()
            self.close()
            raise RuntimeError(f"memhold: no ready line in {timeout:.0f} s "
                               f"({' '.join(self.command())}): {err}")
        return self.held

    def poll_ready(self) -> Held | None:
        return self.held

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def _stderr_tail(self) -> str:
        if self._err is None:
            return ""
        self._err.seek(0)
        return self._err.read().decode(errors="replace")[-1500:] or "(no stderr)"

    def close(self, timeout: float = 5.0) -> int | None:
        """Ends the helper (stdin closed; then SIGTERM; then SIGKILL): its rewrites, if it
        said."""
        proc, self.proc = self.proc, None
        if proc is None:
            return self.rewrites
        try:
            if proc.stdin is not None:
                proc.stdin.close()
        except OSError:
            pass
        for stop in (None, proc.terminate, proc.kill):
            if stop is not None:
                stop()
            try:
                proc.wait(timeout)
                break
            except subprocess.TimeoutExpired:
                continue
        if self._reader is not None:
            self._reader.join(timeout)
        if proc.stdout is not None:
            proc.stdout.close()
        if self._err is not None:
            self._err.close()
            self._err = None
        self.returncode = proc.returncode
        return self.rewrites

    def __enter__(self) -> Self:
        return self.start() if self.proc is None else self

    def __exit__(self, *exc) -> None:
        self.close()


if __name__ == "__main__":
    sys.exit(main())
