"""The ``deimos bench`` table (rich), in llama-bench's spirit: one row per engine and test."""

from __future__ import annotations

from rich.table import Table

from deimos.bench.stats import BenchReport


def _rate(bytes_per_s: float) -> str:
    if bytes_per_s >= 1e12:
        return f"{bytes_per_s / 1e12:.2f} TB/s"
    return f"{bytes_per_s / 1e9:.1f} GB/s"


def render(report: BenchReport) -> Table:
    gb = report.weight_bytes / 1e9
    title = (f"{report.model} on {report.device}: {gb:.2f} GB of weights per token, "
             f"{report.rounds} rounds, roof {_rate(report.roof)} ({report.roof_source})")
    t = Table(title=title)
    for col in ("engine", "test", "t/s", "min", "max", "GB/s", "roof"):
        t.add_column(col, justify="left" if col in ("engine", "test") else "right")
    for e in report.engines:
        t.add_row(e.engine, f"pp{report.n_prompt}", e.prefill.text(), f"{e.prefill.min:.2f}",
                  f"{e.prefill.max:.2f}", "", "")
        bw = report.decode_bandwidth(e)
        t.add_row(e.engine, f"tg{report.n_gen}", e.decode.text(), f"{e.decode.min:.2f}",
                  f"{e.decode.max:.2f}", f"{bw / 1e9:.{0 if bw >= 100e9 else 2}f}",
                  f"{bw / report.roof:.1%}")
    ratios = report.ratios()
    if ratios:
        t.add_row("deimos / llama.cpp", f"pp{report.n_prompt}", f"{ratios['prefill']:.3f}x",
                  "", "", "", "")
        t.add_row("deimos / llama.cpp", f"tg{report.n_gen}", f"{ratios['decode']:.3f}x",
                  "", "", "", "")
    captions = list(report.notes)
    if report.refused:
        captions.append(f"{report.refused} round(s) refused: another process used the GPU")
    if report.contention.startswith("not checked"):
        captions.append(f"GPU contention {report.contention}")
    if captions:
        t.caption = "\n".join(captions)
    return t
