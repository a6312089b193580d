"""The ``deimos bench`` table (rich), in llama-bench's spirit: one row per engine and test, each
engine's mean ± sd and best round (every round's value is in the JSON), the ratios of means
and of bests, and a line per engine on how it was measured."""

from __future__ import annotations

from rich.table import Table

from deimos.bench.stats import BenchReport


def _rate(bytes_per_s: float) -> str:
    if bytes_per_s >= 1e12:
        return f"{bytes_per_s / 1e12:.2f} TB/s"
    return f"{bytes_per_s / 1e9:.1f} GB/s"


def render(report: BenchReport) -> Table:
    gb = report.weight_bytes / 1e9
    title = (f"{report.model} on {report.device}: tokens/s, {gb:.2f} GB of weights per token, "
             f"roof {_rate(report.roof)} ({report.roof_source})")
    t = Table(title=title)
    for col in ("engine", "test", "mean ± sd", "best", "n", "GB/s", "roof"):
        t.add_column(col, justify="left" if col in ("engine", "test") else "right", no_wrap=True)
    for e in report.engines:
        t.add_row(e.engine, f"pp{report.n_prompt}", e.prefill.text(), f"{e.prefill.best:.2f}",
                  str(e.prefill.n), "", "")
        bw = report.decode_bandwidth(e)  # of the mean
        t.add_row(e.engine, f"tg{report.n_gen}", e.decode.text(), f"{e.decode.best:.2f}",
                  str(e.decode.n), f"{bw / 1e9:.{0 if bw >= 100e9 else 2}f}",
                  f"{bw / report.roof:.1%}")
    ratios = report.ratios()
    if ratios:
        for test, key in ((f"pp{report.n_prompt}", "prefill"), (f"tg{report.n_gen}", "decode")):
            t.add_row("deimos/llama.cpp", test, f"{ratios[key]:.3f}x",
                      f"{ratios[key + '_best']:.3f}x", "", "", "")
    captions = [f"{e.engine}: {e.method}" for e in report.engines if e.method]
    if ratios:
        captions.append("ratios: of the means, and of the best rounds; GB/s and roof: of the "
                        "mean")
    captions += report.notes
    if report.refused:
        captions.append(f"{report.refused} round(s) refused: another process used the GPU")
    if report.contention.startswith("not checked"):
        captions.append(f"GPU contention {report.contention}")
    if captions:
        t.caption = "\n".join(captions)
    return t
