"""deimos.bench without timing: round statistics, the report's bandwidth and ratios, the table,
llama-bench's JSON, and the GPU contention logic (NVML snapshots as plain records).

Oracles: the statistics module (sample standard deviation), hand-computed bandwidth, and
llama-bench's documented JSON fields (n_prompt, n_gen, avg_ts).
"""

from __future__ import annotations

import json
import statistics

import pytest
from rich.console import Console

from deimos.bench.contention import ContentionCheck, GpuProcess
from deimos.bench.llama import llama_bench_command, parse_llama_bench
from deimos.bench.roof import copy_rate
from deimos.bench.run import BenchConfig, weight_bytes_per_token
from deimos.bench.stats import BenchReport, RoundTimes, Spread, summarize
from deimos.bench.table import render


def test_spread_matches_statistics() -> None:
    values = [101.5, 98.25, 103.0, 99.75]
    s = Spread.of(values)
    assert s.mean == pytest.approx(statistics.mean(values))
    assert s.std == pytest.approx(statistics.stdev(values))
    assert (s.min, s.max, s.n) == (98.25, 103.0, 4)
    assert Spread.of([7.0]).std == 0.0
    with pytest.raises(ValueError, match="no values"):
        Spread.of([])
    with pytest.raises(ValueError, match="finite and positive"):
        Spread.of([1.0, float("inf")])


def _report(llama: bool) -> BenchReport:
    ours = [RoundTimes(0.5, 1.0, 512, 128), RoundTimes(0.25, 0.8, 512, 128)]
    engines = [summarize("deimos", ours)]
    if llama:
        engines.append(summarize("llama.cpp", [RoundTimes(0.1, 0.5, 512, 128)]))
    return BenchReport(model="m.gguf", device="cuda", n_prompt=512, n_gen=128, rounds=2,
                       weight_bytes=4_000_000_000, roof=4.0e12, engines=engines, refused=1)


def test_report_bandwidth_and_ratios() -> None:
    r = _report(llama=True)
    ours = r.engines[0]
    assert ours.prefill.mean == pytest.approx((1024 + 2048) / 2)  # 512/0.5, 512/0.25
    assert ours.decode.mean == pytest.approx((128 + 160) / 2)
    assert r.decode_bandwidth(ours) == pytest.approx(4e9 * 144)
    ratios = r.ratios()
    assert ratios["prefill"] == pytest.approx(1536 / 5120)
    assert ratios["decode"] == pytest.approx(144 / 256)
    d = r.to_json()
    json.dumps(d)  # serializable
    assert d["engines"][0]["decode_roof_share"] == pytest.approx(4e9 * 144 / 4e12)
    assert _report(llama=False).ratios() is None


def test_table_shows_rows_ratios_and_refusals() -> None:
    console = Console(width=140, record=True)
    console.print(render(_report(llama=True)))
    text = console.export_text()
    for want in ("pp512", "tg128", "llama.cpp", "1536.00 ± 724.08", "0.562x", "1 round(s) refused",
                 "576", "14.4%"):
        assert want in text, f"{want!r} missing from the table:\n{text}"


def test_parse_llama_bench_json() -> None:
    out = json.dumps([
        {"model_type": "llama 8B Q4_K - Medium", "n_prompt": 512, "n_gen": 0, "avg_ts": 10240.0,
         "stddev_ts": 12.0, "samples_ts": [10240.0]},
        {"model_type": "llama 8B Q4_K - Medium", "n_prompt": 0, "n_gen": 128, "avg_ts": 248.0,
         "stddev_ts": 0.5, "samples_ts": [248.0]},
    ])
    r = parse_llama_bench(out, 512, 128)
    assert r.prefill_tps == pytest.approx(10240.0) and r.decode_tps == pytest.approx(248.0)
    with pytest.raises(ValueError, match="lacks one pp512"):
        parse_llama_bench(out, 512, 64)
    with pytest.raises(ValueError, match="not JSON"):
        parse_llama_bench("error: model not found", 512, 128)
    cmd = llama_bench_command("/x/llama-bench", "/m.gguf", 512, 128)
    assert cmd[1:] == ["-m", "/m.gguf", "-p", "512", "-n", "128", "-r", "1", "-ngl", "99",
                       "-fa", "1", "-o", "json"]


def test_contention_own_pid_visible() -> None:
    check = ContentionCheck.from_snapshots([], [GpuProcess(42, 1 << 30)], own_pid=42)
    assert check.others([GpuProcess(42, 1 << 30)]) == []
    assert check.others([GpuProcess(42, 0), GpuProcess(7, 0)]) == [GpuProcess(7, 0)]


def test_contention_container_pids() -> None:
    """NVML shows host PIDs: ours is the process that appeared when we touched the GPU;
    one that was there before is another's, and so is any that comes later."""
    before = [GpuProcess(900, 5 << 30)]
    after = [GpuProcess(900, 5 << 30), GpuProcess(31337, 1 << 30)]
    check = ContentionCheck.from_snapshots(before, after, own_pid=12)
    assert check.own == frozenset({31337})
    assert [p.pid for p in check.others(after)] == [900]
    assert check.others([GpuProcess(31337, 0)]) == []
    assert [p.pid for p in check.others([GpuProcess(31337, 0), GpuProcess(5, 0)])] == [5]


def test_bench_config_rejects_bad_values() -> None:
    with pytest.raises(ValueError, match="n_gen must be positive"):
        BenchConfig("m", n_gen=0)
    with pytest.raises(ValueError, match="--roof"):
        BenchConfig("m", roof=0)


def test_cpu_report_has_a_measured_roof_and_no_nvml_advice() -> None:
    """On a CPU: no contention check to advise about, and the roof is this machine's."""
    rate = copy_rate("cpu", nbytes=8 << 20, repeats=2)
    assert 1e8 < rate < 1e13  # a memory copy on any machine: 0.1 GB/s .. 10 TB/s
    r = BenchReport(model="m.gguf", device="cpu", n_prompt=16, n_gen=8, rounds=1,
                    weight_bytes=540_000_000, roof=rate,
                    engines=[summarize("deimos", [RoundTimes(1.0, 2.0, 16, 8)])],
                    contention="not applicable (CPU)", roof_source="copy rate measured on this CPU")
    console = Console(width=160, record=True)
    console.print(render(r))
    text = console.export_text()
    assert "measured on this CPU" in text and "nvidia-ml-py" not in text and "NVML" not in text
    assert f"{540_000_000 * 4 / 1e9:.2f}" in text  # 4 t/s x 0.54 GB = 2.16 GB/s, not "2"
    gpu = BenchReport(model="m.gguf", device="cuda", n_prompt=16, n_gen=8, rounds=1,
                      weight_bytes=1, roof=1.0, engines=r.engines,
                      contention="not checked: NVML does not answer (NVMLError: driver)")
    console.print(render(gpu))
    assert "GPU contention not checked: NVML does not answer" in console.export_text()


def test_cpu_weight_bytes_are_the_float32_weights() -> None:
    from testdata import model_path

    from deimos.gguf import GGUFFile

    f = GGUFFile(model_path("SmolLM2-135M-Instruct.Q4_1.gguf"))  # tied: embedding read once
    assert weight_bytes_per_token(f, "cuda") == sum(i.nbytes for i in f.tensors.values())
    assert weight_bytes_per_token(f, "cpu") == 4 * sum(i.n_elements for i in f.tensors.values())
