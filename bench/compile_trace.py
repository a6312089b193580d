"""Which Triton kernel variants a process specializes, and when: a ``jit_cache_hook`` (called
before each kernel variant is first built in this process, whether its binary then comes from
the disk cache or a compile) records the kernel, its constexprs and the phase it came in.

    trace = CompileTrace(); trace.install()
    trace.phase = "load"; ...; trace.phase = "16 requests"; ...
    print(trace.table())

A measurement aid for the bench scripts: a variant first seen inside a request is one the
load's warm-up did not make.
"""

from __future__ import annotations

from collections import defaultdict


class CompileTrace:
    def __init__(self) -> None:
        self.phase = "start"
        self.seen: dict[str, list[str]] = defaultdict(list)

    def install(self) -> None:
        from triton import knobs

        knobs.runtime.jit_cache_hook = self._hook

    def _hook(self, *, fn, compile, **_) -> bool:
        params = fn.jit_function.params
        shown = []
        for k, v in (compile.get("constants") or {}).items():
            i = k[0] if isinstance(k, tuple) and len(k) == 1 else k
            name = params[i].name if isinstance(i, int) and i < len(params) else str(k)
            shown.append(f"{name}={v}")
        # the specialization: each argument's type and divisibility (16) as Triton keyed it
        sig = compile.get("signature") or {}
        divisible = [params[a[0]].name for a, kinds in _attrs(compile) if ["tt.divisibility", 16] in kinds]
        self.seen[self.phase].append(
            f"{fn.name}({', '.join(shown)}; div16: {','.join(divisible)}; {len(sig)} args)")
        return False  # build it as usual

    def table(self, width: int | None = None) -> str:
        """A row a phase: its count and its variants (cut at ``width`` characters)."""
        lines = ["| phase | variants first built | kernels |", "|---|---:|---|"]
        for phase, names in self.seen.items():
            lines.append(f"| {phase} | {len(names)} | {'; '.join(names)[:width]} |")
        return "\n".join(lines)


def _attrs(compile: dict) -> list:
    """The (argument path, attributes) pairs of a variant's first config, across Triton versions."""
    configs = compile.get("configs") or [{}]
    cfg = configs[0]
    items = cfg.items() if isinstance(cfg, dict) else []
    return [(k if isinstance(k, tuple) else (k,), v) for k, v in items]
