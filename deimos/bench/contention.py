"""Is anyone else using the GPU? Checked through NVML before every timed round.

In a container NVML may report host PIDs, which never equal ``os.getpid()``; so our own
process is recognized by difference: the compute processes seen before this process touched
the device (``baseline``, all of them others) and those that appeared once it had (``own``).
``others(now)`` are then the processes that are neither ours nor counted out: anything in the
baseline that is still there, and anything new since. pynvml (nvidia-ml-py) is optional:
without it the check reports itself unavailable and the bench says so.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class GpuProcess:
    pid: int
    used_bytes: int | None


@dataclass(frozen=True)
class ContentionCheck:
    own: frozenset[int]  # PIDs (as NVML reports them) that belong to this process

    @classmethod
    def from_snapshots(cls, before: Iterable[GpuProcess], after: Iterable[GpuProcess],
                       own_pid: int) -> ContentionCheck:
        """``before``: processes seen before this process initialized the device; ``after``:
        after it did. Ours: our PID if NVML shows it, else whatever is new in ``after``."""
        after_pids = {p.pid for p in after}
        if own_pid in after_pids:
            return cls(frozenset({own_pid}))
        return cls(frozenset(after_pids - {p.pid for p in before}))

    def others(self, now: Iterable[GpuProcess]) -> list[GpuProcess]:
        return [p for p in now if p.pid not in self.own]


class Nvml:
    """The compute processes of one GPU; ``available`` is False without pynvml or a driver."""

    def __init__(self, index: int = 0) -> None:
        self.available = False
        self.error = ""
        try:
            import pynvml
        except ImportError:
            self.error = "nvidia-ml-py is not installed (pip install nvidia-ml-py)"
            return
        try:
            pynvml.nvmlInit()
            self._nvml = pynvml
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            self.available = True
        except Exception as e:  # noqa: BLE001 - no NVML for any reason: the check is unavailable
            self.error = f"NVML does not answer ({type(e).__name__}: {e})"

    def processes(self) -> list[GpuProcess]:
        if not self.available:
            return []
        procs = self._nvml.nvmlDeviceGetComputeRunningProcesses(self._handle)
        return [GpuProcess(int(p.pid), getattr(p, "usedGpuMemory", None)) for p in procs]
