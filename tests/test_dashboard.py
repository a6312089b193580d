"""The terminal dashboard (deimos.server.dashboard) drawn from real ``Metrics`` objects filled
through their own writer methods (many requests at once, the engine's stats after a step).
Oracles: the numbers put in (formatted by arithmetic in the test), the kernel's page count for
total RAM, and plain slopes for the live rates."""

from __future__ import annotations

import io
import logging
import os
import time

import pytest
from rich.console import Console

from deimos.engine.engine import EngineStats
from deimos.server.dashboard import ACTIVE_ROWS, Dashboard, GpuMemory, _Rates, sparkline
from deimos.server.metrics import Finished, Metrics

WEIGHTS, KV = 540_000_000, 94_371_840


# the engine after a step: 3 running, 2 waiting, 40 of 100 blocks held, 7 of the free cached
STATS = EngineStats(running=3, waiting=2, kv_blocks_used=40, kv_blocks_free=60,
                    kv_blocks_cached=7, block_size=16, prefix_hit_tokens=96,
                    prefix_query_tokens=384, preemptions=5)


def filled_metrics() -> Metrics:
    m = Metrics({"model_weights": WEIGHTS, "kv_cache": KV})
    m.count_request("/v1/chat/completions", 200)
    m.count_request("/v1/chat/completions", 400)
    m.start("cmpl-a", 120)
    m.start("cmpl-b", 60)
    m.finish("cmpl-a", Finished(120, 20, 40, 0.25, 400.0, 35.0, "stop"), 0.25, 1.1, False)
    m.finish("cmpl-b", Finished(60, 0, 16, 0.5, 200.0, 25.0, "length"), 0.5, 0.6, True)
    m.start("chatcmpl-dash1", 300)
    m.progress("chatcmpl-dash1", 100, 19)
    m.start("chatcmpl-dash2", 45)
    m.progress("chatcmpl-dash2", 32, 3)
    m.set_engine(STATS)
    return m


def text_of(dash: Dashboard) -> str:
    console = Console(record=True, width=140, file=io.StringIO())
    console.print(dash.render())
    return console.export_text()


def active_row(text: str, rid: str) -> list[str]:
    """The cells of the active-requests table's row of ``rid``."""
    (line,) = [ln for ln in text.splitlines() if rid in ln]
    return line.split("│")[1].split() if "│" in line else line.split()


def test_renders_metrics():
    dash = Dashboard(filled_metrics(), title="deimos serve test-model")
    text = text_of(dash)
    for needle in (
        "deimos serve test-model", "2 active", "queued 0",
        "active requests (2)", "3 running", "2 waiting", "40 used of 100", "7 cached",
        "16 tokens each", f"{96 / 384 * 100:.1f}% hit", "96 of 384 tokens",
        f"{(400.0 + 200.0) / 2:.1f} tok/s", f"{(35.0 + 25.0) / 2:.1f} tok/s",  # recent means
        f"{(0.25 + 0.5) / 2 * 1000:,.0f} ms",  # mean time to first token
        f"{WEIGHTS / 2**20:.1f} MiB", f"{KV / 2**20:.1f} MiB", "process rss",
        "length 1, stop 1", "/v1/chat/completions 200", "/v1/chat/completions 400",
    ):
        assert needle in text, f"{needle!r} not in\n{text}"
    totals = text[text.index("prompt tokens"):]
    assert f"{120 + 60:,}" in totals.split("\n")[0] and f"{40 + 16:,}" in totals
    # id, prompt, cached, generated, elapsed (s): the numbers given to start and progress
    assert active_row(text, "chatcmpl-dash1")[:4] == ["chatcmpl-dash1", "300", "100", "19"]
    assert active_row(text, "chatcmpl-dash2")[:4] == ["chatcmpl-dash2", "45", "32", "3"]
    assert "preemptions" in text and active_row(text, "preemptions")[-1] == "5"


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
    m.finish("chatcmpl-dash1", Finished(300, 100, 19, 0.3, 500.0, 30.0, "stop"), 0.3, 0.6, False)
    text = text_of(dash)
    assert "1 active" in text and "chatcmpl-dash1" not in text and "stop 2" in text
    m.finish("chatcmpl-dash2", Finished(45, 32, 3, 0.1, 130.0, 20.0, "length"), 0.1, 0.1, False)
    text = text_of(dash)
    assert "idle" in text and "chatcmpl-dash2" not in text and "length 2" in text


def test_long_active_list_is_cut():
    m = Metrics()
    for i in range(ACTIVE_ROWS + 5):
        m.start(f"cmpl-{i:03d}", 10 + i)
    text = text_of(Dashboard(m))
    assert f"active requests ({ACTIVE_ROWS + 5})" in text and "and 5 more" in text
    assert f"cmpl-{ACTIVE_ROWS - 1:03d}" in text and f"cmpl-{ACTIVE_ROWS:03d}" not in text


def snap(t: float, prefilled: int, generated: int, active: list[tuple[int, int, int]]) -> dict:
    """A snapshot at uptime ``t`` with ``active`` as (prompt, cached, generated) triples."""
    return {"uptime_s": t, "prefill_computed": prefilled, "generated_tokens": generated,
            "active": [{"prompt_tokens": p, "cached_tokens": c, "generated": g}
                       for p, c, g in active]}


def test_rates_over_every_request():
    """Decode: the slope of all tokens generated (finished plus active) over the last 2 s;
    prefill: of prompt tokens computed (an active request's count once its first token is
    out); a request finishing moves its tokens between the two terms without a jump."""
    r = _Rates()
    assert r.update(snap(0.0, 0, 0, [(500, 100, 0)])) == (0.0, 0.0)
    pre, dec = r.update(snap(0.5, 0, 0, [(500, 100, 1), (50, 0, 0)]))
    assert pre == pytest.approx(400 / 0.5) and dec == pytest.approx(1 / 0.5)
    for i in range(1, 16):  # two requests at 10 tokens/s each, for 3 s
        pre, dec = r.update(snap(0.5 + 0.2 * i, 0, 0, [(500, 100, 1 + 2 * i), (50, 0, 2 * i)]))
    # the second's 50 prompt tokens came at 0.7 s: out of the window now
    assert dec == pytest.approx(20.0) and pre == 0.0
    assert r.samples[-1][0] - r.samples[0][0] <= 2.0 + 1e-9
    # at 3.7 s the first finishes with 33 tokens (they and its 400 computed prompt tokens
    # move to the totals): no jump in either
    pre, dec = r.update(snap(3.7, 400, 33, [(50, 0, 32)]))
    assert dec == pytest.approx(20.0) and pre == 0.0


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
    m.progress("chatcmpl-dash1", 100, 42)
    time.sleep(0.3)
    thread = dash._thread
    dash.stop()
    assert thread is not None and not thread.is_alive() and dash._thread is None
    drawn = out.getvalue()
    assert "active requests" in drawn and "42" in drawn


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
    value = {f.name: f.samples[0].value for f in families.values() if len(f.samples) == 1}
    assert value["deimos_active_requests"] == 2
    assert (value["deimos_running_sequences"], value["deimos_waiting_sequences"]) == (3, 2)
    assert (value["deimos_kv_blocks_used"], value["deimos_kv_blocks_free"],
            value["deimos_kv_blocks_cached"], value["deimos_kv_block_size"]) == (40, 60, 7, 16)
    assert value["deimos_prefix_cache_hit_rate"] == pytest.approx(96 / 384)
    assert value["deimos_prefix_cache_hit_tokens"] == 96
    assert value["deimos_prefix_cache_query_tokens"] == 384
    assert value["deimos_preemptions"] == 5
    other = {f.name: f for f in text_string_to_metric_families(Metrics().prometheus().decode())}
    assert other["deimos_requests"].samples == []


def test_expert_cache_numbers_reach_the_dashboard_and_metrics():
    """An offloaded MoE model's expert cache (EngineStats.experts): slots, hit rate and CPU
    experts on the dashboard's engine panel and as /metrics gauges."""
    from dataclasses import replace

    from prometheus_client import generate_latest

    experts = {"expert_slots": 24, "expert_cache_bytes": 3 * 2**30, "expert_hit_rate": 0.625,
               "cpu_experts_per_token": 2.5, "expert_promotions": 130, "expert_resizes": 2}
    m = filled_metrics()
    m.set_engine(replace(STATS, experts=experts))
    text = text_of(Dashboard(m))
    for needle in ("24 slots a layer", "3.0 GiB", "62.5% hit", "2.50 on the CPU"):
        assert needle in text, f"{needle!r} not in\n{text}"
    out = generate_latest(m.registry).decode()
    got = {ln.split()[0]: float(ln.split()[1]) for ln in out.splitlines()
           if ln.startswith("deimos_") and "{" not in ln}
    for name, value in experts.items():
        assert got.get(f"deimos_{name}") == float(value), name
