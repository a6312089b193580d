"""A live terminal dashboard of a running server (``rich``), drawn from ``Metrics.snapshot()``.

    dash = Dashboard(metrics, title="deimos serve smollm2")
    dash.start()          # a daemon thread redraws ~4 times a second; nothing if not a terminal
    ...
    dash.stop()

Panels: speeds (prefill and decode rates over every request, measured here between redraws;
the recent per-request means ``Metrics`` keeps; a decode-speed sparkline), the engine (running
and waiting sequences, KV blocks used, free and cached, the prefix cache's hit rate,
preemptions, speculative drafts' acceptance rate and tokens a step), totals, the active
requests (id, prompt, cached and generated tokens), and memory: the server's static sizes
(weights, KV cache...), the process's resident set, and the whole machine's free memory: each
GPU through NVML (``nvidia-ml-py``, optional) or torch's ``mem_get_info`` once CUDA is
initialized, else system RAM from /proc/meminfo.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import deque
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

__all__ = ["Dashboard", "GpuMemory", "system_memory"]

REFRESH_S = 0.25
SPARK = "▁▂▃▄▅▆▇█"
HISTORY = 120  # decode-rate samples kept for the sparkline (30 s at 4 redraws a second)
ACTIVE_ROWS = 12  # active requests listed; the rest counted


def _bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _rate(x: float | None) -> str:
    return "-" if not x else f"{x:,.1f} tok/s"


def _duration(s: float) -> str:
    s = int(s)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


def sparkline(values: list[float], width: int) -> str:
    vals = values[-width:]
    top = max(vals, default=0.0)
    if top <= 0:
        return ""
    return "".join(SPARK[min(int(v / top * (len(SPARK) - 1) + 0.5), len(SPARK) - 1)] for v in vals)


# ---- where memory is ---------------------------------------------------------------------


class GpuMemory:
    """Per-GPU (name, used bytes, total bytes) on the whole card (all processes): NVML when
    ``pynvml`` (nvidia-ml-py) is installed, initialized once; else torch, but only once this
    process has initialized CUDA (the dashboard must not create a CUDA context of its own).
    ``read()`` is None without a GPU."""

    def __init__(self) -> None:
        self._nvml: Any = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml
        except Exception:  # noqa: BLE001 - not installed, no driver, no device: fall back
            self._nvml = None

    def read(self) -> list[tuple[str, int, int]] | None:
        nv = self._nvml
        if nv is not None:
            try:
                out = []
                for i in range(nv.nvmlDeviceGetCount()):
                    h = nv.nvmlDeviceGetHandleByIndex(i)
                    info = nv.nvmlDeviceGetMemoryInfo(h)
                    name = nv.nvmlDeviceGetName(h)
                    name = name.decode() if isinstance(name, bytes) else name
                    out.append((f"GPU {i} {name}", int(info.used), int(info.total)))
                return out or None
            except nv.NVMLError:
                pass
        try:
            import torch
        except ImportError:
            return None
        if not torch.cuda.is_initialized():
            return None
        out = []
        for i in range(torch.cuda.device_count()):
            free, total = torch.cuda.mem_get_info(i)
            out.append((f"GPU {i} {torch.cuda.get_device_name(i)}", total - free, total))
        return out or None

    def close(self) -> None:
        if self._nvml is not None:
            try:
                self._nvml.nvmlShutdown()
            except Exception:  # noqa: BLE001
                pass
            self._nvml = None


def system_memory() -> tuple[int, int] | None:
    """(available, total) bytes of system RAM, or None where it cannot be read."""
    try:
        fields = {}
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                fields[key] = int(rest.split()[0]) * 1024
        return fields["MemAvailable"], fields["MemTotal"]
    except (OSError, KeyError, ValueError, IndexError):
        try:
            page = os.sysconf("SC_PAGE_SIZE")
            return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page
        except (ValueError, OSError, AttributeError):
            return None


def _bar(used: int, total: int, width: int = 20) -> Text:
    frac = min(max(used / total, 0.0), 1.0) if total else 0.0
    n = int(frac * width + 0.5)
    style = "green" if frac < 0.7 else "yellow" if frac < 0.9 else "red"
    return Text("█" * n, style=style) + Text("░" * (width - n), style="dim")


# ---- the dashboard -----------------------------------------------------------------------


class _Rates:
    """Prefill and decode rates now, over every request, from successive snapshots: the
    slopes over the last ~2 s of two running totals, tokens generated (finished requests'
    plus the active ones' so far) and prompt tokens computed (a request's count once its
    first token is out)."""

    def __init__(self, window_s: float = 2.0) -> None:
        self.window_s = window_s
        self.samples: deque[tuple[float, int, int]] = deque()  # (time, prefilled, generated)

    def update(self, snap: dict[str, Any]) -> tuple[float, float]:
        active = snap["active"]
        prefilled = snap["prefill_computed"] + sum(
            a["prompt_tokens"] - a["cached_tokens"] for a in active if a["generated"] > 0)
        generated = snap["generated_tokens"] + sum(a["generated"] for a in active)
        t = snap["uptime_s"]
        self.samples.append((t, prefilled, generated))
        while len(self.samples) > 2 and t - self.samples[0][0] > self.window_s:
            self.samples.popleft()
        (t0, p0, g0), (t1, p1, g1) = self.samples[0], self.samples[-1]
        if t1 <= t0:
            return 0.0, 0.0
        return max(p1 - p0, 0) / (t1 - t0), max(g1 - g0, 0) / (t1 - t0)


class Dashboard:
    def __init__(self, metrics: Any, *, title: str = "deimos", console: Console | None = None,
                 refresh_s: float = REFRESH_S) -> None:
        self.metrics = metrics
        self.title = title
        self.console = console or Console()
        self.refresh_s = refresh_s
        self._rates = _Rates()
        self._history: deque[float] = deque(maxlen=HISTORY)
        self._gpu: GpuMemory | None = None  # opened on first draw
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- running -------------------------------------------------------------------------

    def start(self) -> bool:
        """Draw in a daemon thread; False (and nothing drawn) when the console is not a
        terminal, so a server with redirected output logs only."""
        if not self.console.is_terminal or self._thread is not None:
            return False
        self._stop.clear()
        self._thread = threading.Thread(target=self.run, name="deimos-dashboard", daemon=True)
        self._thread.start()
        return True

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        if self._gpu is not None:
            self._gpu.close()
            self._gpu = None

    def run(self) -> None:
        """Redraw until ``stop`` (blocking; ``start`` runs this in a thread)."""
        if not self.console.is_terminal:
            return
        with Live(self.render(), console=self.console, refresh_per_second=1 / self.refresh_s,
                  screen=False, redirect_stdout=False, redirect_stderr=False) as live:
            while not self._stop.wait(self.refresh_s):
                live.update(self.render())

    def log_handler(self, level: int = logging.INFO) -> logging.Handler:
        """A logging handler printing through the dashboard's console, above the live view
        (a plain stderr handler would write over it)."""
        console = self.console

        class _Handler(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                try:
                    console.print(Text(self.format(record)), soft_wrap=True)
                except Exception:  # noqa: BLE001 - logging must not raise
                    self.handleError(record)

        h = _Handler(level)
        h.setFormatter(logging.Formatter("%(message)s"))
        return h

    # ---- drawing -------------------------------------------------------------------------

    def render(self) -> Group:
        """One frame from a fresh snapshot (also what the tests print). Panels size to their
        content (no full-screen layout), so log lines printed above keep scrolling."""
        snap = self.metrics.snapshot()
        prefill_now, decode_now = self._rates.update(snap)
        self._history.append(decode_now)
        grid = Table.grid(expand=True)
        grid.add_column(ratio=1)
        grid.add_column(ratio=1)
        grid.add_row(Group(self._speeds(snap, prefill_now, decode_now), self._engine(snap)),
                     Group(self._memory(snap), self._totals(snap)))
        return Group(self._header(snap), grid, self._active(snap))

    def _header(self, snap: dict[str, Any]) -> Text:
        n = len(snap["active"])
        busy = f"{n} active" if n else "idle"
        return Text.assemble((f" {self.title} ", "bold reverse"),
                             f"  up {_duration(snap['uptime_s'])}  {busy}  "
                             f"queued {snap['queued']}")

    def _speeds(self, snap: dict[str, Any], prefill_now: float, decode_now: float) -> Panel:
        t = Table.grid(padding=(0, 2))
        t.add_column(style="bold")
        t.add_column(justify="right")
        t.add_column(justify="right")
        t.add_row("", Text("now, all", style="dim"), Text("recent mean, each", style="dim"))
        t.add_row("prefill", _rate(prefill_now), _rate(snap["prefill_tps"]))
        t.add_row("decode", _rate(decode_now), _rate(snap["decode_tps"]))
        ttft = snap.get("ttft_mean_s") or 0.0
        t.add_row("first token", "", f"{ttft * 1000:,.0f} ms" if ttft else "-")
        spark = Text(sparkline(list(self._history), 40), style="cyan")
        return Panel(Group(t, Text("decode, last 30 s ", style="dim") + spark), title="speed")

    def _engine(self, snap: dict[str, Any]) -> Panel:
        e = snap.get("engine")
        if e is None:
            return Panel(Text("no step yet", style="dim"), title="engine")
        t = Table.grid(padding=(0, 2))
        t.add_column(style="bold")
        t.add_column(justify="right")
        t.add_column()
        t.add_row("sequences", f"{e['running']} running", f"{e['waiting']} waiting")
        used, free = e["kv_blocks_used"], e["kv_blocks_free"]
        t.add_row("KV blocks", f"{used:,} used of {used + free:,}", _bar(used, used + free))
        t.add_row("", f"{e['kv_blocks_cached']:,} cached", f"{e['block_size']} tokens each")
        t.add_row("prefix cache", f"{e['prefix_hit_rate'] * 100:.1f}% hit",
                  f"{e['prefix_hit_tokens']:,} of {e['prefix_query_tokens']:,} tokens")
        t.add_row("preemptions", f"{e['preemptions']:,}", "")
        if e.get("spec_drafted"):  # speculative decoding verified drafts
            t.add_row("speculation", f"{e['spec_acceptance_rate'] * 100:.1f}% accepted",
                      f"{e['tokens_per_step']:.2f} tokens a step")
        x = e.get("experts")
        if x:  # an offloaded MoE model's expert cache
            t.add_row("expert cache", f"{x['expert_slots']:.0f} slots a layer",
                      f"{x['expert_cache_bytes'] / 2**30:.1f} GiB")
            t.add_row("", f"{x['expert_hit_rate'] * 100:.1f}% hit",
                      f"{x['cpu_experts_per_token']:.2f} on the CPU a token-layer")
        return Panel(t, title="engine")

    def _active(self, snap: dict[str, Any]) -> Panel:
        active = snap["active"]
        if not active:
            return Panel(Text("idle", style="dim"), title="active requests")
        t = Table(box=None, padding=(0, 2), show_edge=False)
        t.add_column("id", style="bold")
        for name in ("prompt", "cached", "generated", "elapsed"):
            t.add_column(name, justify="right")
        for a in active[:ACTIVE_ROWS]:
            t.add_row(a["id"], f"{a['prompt_tokens']:,}", f"{a['cached_tokens']:,}",
                      f"{a['generated']:,}", f"{a['elapsed_s']:.1f} s")
        rows: list[Any] = [t]
        if len(active) > ACTIVE_ROWS:
            rows.append(Text(f"and {len(active) - ACTIVE_ROWS} more", style="dim"))
        return Panel(Group(*rows), title=f"active requests ({len(active)})")

    def _totals(self, snap: dict[str, Any]) -> Panel:
        t = Table.grid(padding=(0, 2))
        t.add_column(style="bold")
        t.add_column(justify="right")
        t.add_row("prompt tokens", f"{snap['prompt_tokens']:,}")
        t.add_row("  cached", f"{snap['cached_tokens']:,}")
        t.add_row("generated", f"{snap['generated_tokens']:,}")
        reasons = ", ".join(f"{k} {v}" for k, v in sorted(snap["finish_reasons"].items()))
        t.add_row("finished", reasons or "-")
        t.add_row("disconnects", str(snap["disconnects"]))
        for route, n in snap["requests"].items():
            t.add_row(route, str(n))
        return Panel(t, title="totals")

    def _memory(self, snap: dict[str, Any]) -> Panel:
        t = Table.grid(padding=(0, 2))
        t.add_column(style="bold")
        t.add_column(justify="right")
        t.add_column()
        mem = snap.get("memory", {})
        for key, value in mem.items():
            t.add_row(key.replace("_", " "), _bytes(value), "")
        if self._gpu is None:
            self._gpu = GpuMemory()
        gpus = self._gpu.read()
        if gpus:
            for name, used, total in gpus:
                t.add_row(name, f"{_bytes(total - used)} free", _bar(used, total))
                t.add_row("", f"of {_bytes(total)}", "")
        else:
            sysmem = system_memory()
            if sysmem is not None:
                avail, total = sysmem
                t.add_row("system RAM", f"{_bytes(avail)} free", _bar(total - avail, total))
                t.add_row("", f"of {_bytes(total)}", "")
        return Panel(t, title="memory")
