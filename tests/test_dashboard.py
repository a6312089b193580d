"""The terminal dashboard (deimos.server.dashboard) drawn from real ``Metrics`` objects filled
through their own writer methods. Oracles: the numbers put in (formatted by arithmetic in the
test), the kernel's page count for total RAM, and a plain slope for the live rates."""

from __future__ import annotations

import io
import logging
import os
import time

import pytest
from rich.console import Console

from deimos.server.dashboard import Dashboard, GpuMemory, _ActiveRates, sparkline
from deimos.server.metrics import Finished, Metrics

WEIGHTS, KV = 540_000_000, 94_371_840


def filled_metrics() -> Metrics:
    m = Metrics({"model_weights": WEIGHTS, "kv_cache": KV})
    m.count_request("/v1/chat/completions", 200)
    m.count_request("/v1/chat/completions", 400)
    m.finish(Finished(120, 20, 40, 0.25, 400.0, 35.0, "stop"), 0.25, 1.1, False)
    m.finish(Finished(60, 0, 16, 0.5, 200.0, 25.0, "length"), 0.5, 0.6, True)
    m.start("chatcmpl-dash1", 300)
    m.progress(100, 19)
    return m


def text_of(dash: Dashboard) -> str:
    console = Console(record=True, width=140, file=io.StringIO())
    console.print(dash.render())
    return console.export_text()


def test_renders_metrics():
    dash = Dashboard(filled_metrics(), title="deimos serve test-model")
    text = text_of(dash)
    for needle in (
        "deimos serve test-model", "busy", "queued 0",
        "chatcmpl-dash1", "300 tokens (100 cached)", "19 tokens",
        f"{(400.0 + 200.0) / 2:.1f} tok/s", f"{(35.0 + 25.0) / 2:.1f} tok/s",  # recent means
        f"{(0.25 + 0.5) / 2 * 1000:,.0f} ms",  # mean time to first token
        f"{WEIGHTS / 2**20:.1f} MiB", f"{KV / 2**20:.1f} MiB", "process rss",
        "length 1, stop 1", "/v1/chat/completions 200", "/v1/chat/completions 400",
    ):
        assert needle in text, f"{needle!r} not in\n{text}"
    totals = text[text.index("prompt tokens"):]
    assert f"{120 + 60:,}" in totals.split("\n")[0] and f"{40 + 16:,}" in totals


def test_memory_panel_shows_the_machine():
    text = text_of(Dashboard(filled_metrics()))
    gpus = GpuMemory().read()
    if gpus is None:  # CPU machine: system RAM, total from the kernel's page count
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        assert "system RAM" in text and f"of {total / 2**30:.1f} GiB" in text
    else:
        for name, _, total in gpus:
            assert name in text


def test_idle_after_finish():
    m = filled_metrics()
    dash = Dashboard(m)
    text_of(dash)
    m.finish(Finished(300, 100, 19, 0.3, 500.0, 30.0, "stop"), 0.3, 0.6, False)
    text = text_of(dash)
    assert "idle" in text and "chatcmpl-dash1" not in text and "stop 2" in text


def test_active_rates():
    """Prefill: computed prompt tokens over the time to the first token; decode: the slope of
    generated tokens over the last 2 s of samples; a new id starts over."""
    r = _ActiveRates()
    snap = {"id": "a", "prompt_tokens": 500, "cached_tokens": 100, "generated": 0}
    assert r.update({**snap, "elapsed_s": 0.5}) == (0.0, 0.0)
    pre, dec = r.update({**snap, "generated": 1, "elapsed_s": 0.8})
    assert pre == pytest.approx(400 / 0.8) and dec == 0.0
    for i in range(1, 13):  # 20 tokens/s for 3 s
        pre, dec = r.update({**snap, "generated": 1 + 5 * i, "elapsed_s": 0.8 + 0.25 * i})
    assert pre == pytest.approx(400 / 0.8) and dec == pytest.approx(20.0)
    assert r.samples[-1][0] - r.samples[0][0] <= 2.0 + 1e-9
    pre, dec = r.update({**snap, "id": "b", "elapsed_s": 0.1})
    assert (pre, dec) == (0.0, 0.0)
    assert r.update(None) == (0.0, 0.0)


def test_sparkline():
    assert sparkline([0.0, 0.0], 10) == ""
    # the last 3 values on the 8 levels (0..7) scaled to the maximum: 2/8*7, 4/8*7, 7, rounded
    assert sparkline([1.0, 2.0, 4.0, 8.0], 3) == "▃▅█"
    assert len(sparkline([float(i) for i in range(200)], 40)) == 40


def test_no_output_when_not_a_terminal():
    out = io.StringIO()
    dash = Dashboard(filled_metrics(), console=Console(file=out))
    assert dash.start() is False
    dash.run()  # returns at once too
    dash.stop()
    assert out.getvalue() == ""


def test_thread_redraws_and_stops():
    out = io.StringIO()
    m = filled_metrics()
    dash = Dashboard(m, console=Console(file=out, force_terminal=True, width=120),
                     refresh_s=0.05)
    assert dash.start() is True
    assert dash.start() is False  # already running
    time.sleep(0.3)
    m.progress(100, 42)
    time.sleep(0.3)
    thread = dash._thread
    dash.stop()
    assert thread is not None and not thread.is_alive() and dash._thread is None
    drawn = out.getvalue()
    assert "active request" in drawn and "42 tokens" in drawn


def test_log_lines_print_through_the_console():
    out = io.StringIO()
    dash = Dashboard(filled_metrics(), console=Console(file=out, width=120))
    log = logging.getLogger("deimos.test_dashboard")
    log.propagate = False
    h = dash.log_handler()
    log.addHandler(h)
    try:
        log.warning("POST /v1/chat/completions 200 in 1.2 s")
    finally:
        log.removeHandler(h)
    assert out.getvalue() == "POST /v1/chat/completions 200 in 1.2 s\n"


def test_prometheus_exposition_parses_and_registries_are_per_server():
    """/metrics' text, read back by prometheus_client's own parser: the numbers put in, and a
    second Metrics object (another server in the same process) sharing none of them."""
    from prometheus_client.parser import text_string_to_metric_families

    families = {f.name: f for f in text_string_to_metric_families(
        filled_metrics().prometheus().decode())}
    requests = {(s.labels["route"], s.labels["status"]): s.value
                for s in families["deimos_requests"].samples}
    assert requests == {("/v1/chat/completions", "200"): 1, ("/v1/chat/completions", "400"): 1}
    assert families["deimos_prompt_tokens"].samples[0].value == 120 + 60
    ttft = {s.name: s.value for s in families["deimos_time_to_first_token_seconds"].samples
            if s.labels.get("le") in (None, "0.25", "+Inf")}
    assert ttft["deimos_time_to_first_token_seconds_count"] == 2
    assert ttft["deimos_time_to_first_token_seconds_sum"] == pytest.approx(0.75)
    mem = {s.labels["kind"]: s.value for s in families["deimos_memory_bytes"].samples}
    assert mem["model_weights"] == WEIGHTS and mem["kv_cache"] == KV
    other = {f.name: f for f in text_string_to_metric_families(Metrics().prometheus().decode())}
    assert other["deimos_requests"].samples == []
