"""deimos.bench without timing: round statistics, the report's bandwidth and ratios (of means
and of bests), the table and its lines on how each engine was measured, llama-bench's JSON
and command, a llama-bench run (a stand-in script that prints llama-bench's JSON), and the GPU
contention logic (NVML snapshots as plain records).

Oracles: the statistics module (sample standard deviation), hand-computed bandwidth and
ratios, and llama-bench's JSON fields as its json_printer writes them (n_prompt, n_gen,
avg_ts, samples_ts, build_commit: tools/llama-bench/llama-bench.cpp).
"""

from __future__ import annotations

import json
import statistics

import pytest
from rich.console import Console

from deimos.bench.contention import ContentionCheck, GpuProcess
from deimos.bench.llama import (
    DEFAULT_LLAMA_ARGS,
    llama_args,
    llama_bench_command,
    parse_llama_bench,
    run_llama_bench,
)
from deimos.bench.roof import copy_rate
from deimos.bench.run import BenchConfig, intruders, weight_bytes_per_token
from deimos.bench.stats import BenchReport, EngineResult, RoundTimes, Spread, summarize
from deimos.bench.table import render


def test_spread_matches_statistics() -> None:
    values = [101.5, 98.25, 103.0, 99.75]
    s = Spread.of(values)
    assert s.mean == pytest.approx(statistics.mean(values))
    assert s.std == pytest.approx(statistics.stdev(values))
    assert (s.min, s.max, s.n) == (98.25, 103.0, 4)
    assert s.best == 103.0 and s.values == tuple(values)
    assert Spread.of([7.0]).std == 0.0
    with pytest.raises(ValueError, match="no values"):
        Spread.of([])
    with pytest.raises(ValueError, match="finite and positive"):
        Spread.of([1.0, float("inf")])


def _report(llama: bool) -> BenchReport:
    ours = [RoundTimes(0.5, 1.0, 512, 128), RoundTimes(0.25, 0.8, 512, 128)]
    engines = [summarize("deimos", ours, "1 warm-up round (pp512 + tg4) not reported, then 2 "
                                         "rounds")]
    if llama:  # three repetitions: pp 5120 4096 6144 t/s, tg 256 240 272
        engines.append(EngineResult("llama.cpp", Spread.of([5120.0, 4096.0, 6144.0]),
                                    Spread.of([256.0, 240.0, 272.0]),
                                    "llama-bench abc1234 (7000), one run alone: its own warm-up "
                                    "run per test, 3 repetitions, flags -ngl 99 -fa 1"))
    return BenchReport(model="m.gguf", device="cuda", n_prompt=512, n_gen=128, rounds=2,
                       weight_bytes=4_000_000_000, roof=4.0e12, engines=engines, refused=1)


def test_report_bandwidth_and_ratios() -> None:
    r = _report(llama=True)
    ours = r.engines[0]
    assert ours.prefill.mean == pytest.approx((1024 + 2048) / 2)  # 512/0.5, 512/0.25
    assert ours.decode.mean == pytest.approx((128 + 160) / 2)
    assert r.decode_bandwidth(ours) == pytest.approx(4e9 * 144)
    ratios = r.ratios()
    assert ratios["prefill"] == pytest.approx(1536 / 5120)  # of the means
    assert ratios["decode"] == pytest.approx(144 / 256)
    assert ratios["prefill_best"] == pytest.approx(2048 / 6144)  # of the best rounds
    assert ratios["decode_best"] == pytest.approx(160 / 272)
    d = r.to_json()
    json.dumps(d)  # serializable
    assert d["engines"][0]["decode_roof_share"] == pytest.approx(4e9 * 144 / 4e12)
    assert list(d["engines"][1]["prefill"]["values"]) == [5120.0, 4096.0, 6144.0]
    assert d["engines"][1]["method"].startswith("llama-bench abc1234")
    assert d["ratios"]["decode_best"] == pytest.approx(160 / 272)
    assert _report(llama=False).ratios() is None


def test_table_shows_best_mean_ratios_methods_and_refusals() -> None:
    console = Console(width=160, record=True)
    console.print(render(_report(llama=True)))
    text = console.export_text()
    words = " ".join(text.split())  # the caption lines wrap at the table's width
    for want in ("pp512", "tg128", "llama.cpp",
                 "1536.00 ± 724.08", "2048.00",  # deimos pp: mean ± sd, best
                 "5120.00 ± 1024.00", "6144.00",  # llama.cpp pp
                 "deimos/llama.cpp", "0.300x", "0.333x",  # pp: ratio of means, of bests
                 "0.562x", "0.588x",  # tg
                 "1 round(s) refused", "576", "14.4%",
                 "deimos: 1 warm-up round (pp512 + tg4) not reported, then 2 rounds",
                 ("llama.cpp: llama-bench abc1234 (7000), one run alone: its own warm-up run per "
                  "test, 3 repetitions, flags -ngl 99 -fa 1"),
                 "ratios: of the means, and of the best rounds"):
        assert want in words, f"{want!r} missing from the table:\n{text}"
    alone = Console(width=160, record=True)
    alone.print(render(_report(llama=False)))
    text = alone.export_text()
    assert "deimos/llama.cpp" not in text and "ratios:" not in text and "2048.00" in text


LLAMA_JSON = [  # as llama-bench -o json writes it (fields trimmed)
    {"build_commit": "abc1234", "build_number": 7000, "model_type": "qwen3 0.6B Q8_0",
     "n_prompt": 512, "n_gen": 0, "n_depth": 0, "avg_ts": 41337.0, "stddev_ts": 410.0,
     "samples_ns": [12500000, 12300000, 12350000], "samples_ts": [40960.0, 41625.0, 41457.5]},
    {"build_commit": "abc1234", "build_number": 7000, "model_type": "qwen3 0.6B Q8_0",
     "n_prompt": 0, "n_gen": 128, "n_depth": 0, "avg_ts": 500.0, "stddev_ts": 2.0,
     "samples_ns": [256000000, 257000000, 255000000], "samples_ts": [500.0, 498.0, 502.0]},
]


def test_parse_llama_bench_json() -> None:
    out = json.dumps(LLAMA_JSON)
    pp, tg, build = parse_llama_bench(out, 512, 128)
    assert pp == [40960.0, 41625.0, 41457.5] and tg == [500.0, 498.0, 502.0]
    assert build == "abc1234 (7000)"
    old = [{k: v for k, v in t.items() if k != "samples_ts"} for t in LLAMA_JSON]
    assert parse_llama_bench(json.dumps(old), 512, 128)[:2] == ([41337.0], [500.0])
    with pytest.raises(ValueError, match="lacks one pp512"):
        parse_llama_bench(out, 512, 64)
    with pytest.raises(ValueError, match="found 2 and 1"):  # two flag sets, e.g. -fa 0,1
        parse_llama_bench(json.dumps([LLAMA_JSON[0], *LLAMA_JSON]), 512, 128)
    with pytest.raises(ValueError, match="not JSON"):
        parse_llama_bench("error: model not found", 512, 128)


def test_llama_bench_command_and_flags() -> None:
    assert DEFAULT_LLAMA_ARGS == "-ngl 99 -fa 1"
    cmd = llama_bench_command("/x/llama-bench", "/m.gguf", 512, 128, 5, llama_args(None))
    assert cmd[1:] == ["-m", "/m.gguf", "-p", "512", "-n", "128", "-r", "5", "-ngl", "99",
                       "-fa", "1", "-o", "json"]
    assert llama_args('-ngl 99 -fa 1 -ub "2048"') == ["-ngl", "99", "-fa", "1", "-ub", "2048"]
    with pytest.raises(ValueError, match="-r is set by deimos bench"):
        llama_args("-ngl 99 -r 3")
    with pytest.raises(ValueError, match="-o is set by deimos bench"):
        BenchConfig("m", llama_args="-o md")
    assert BenchConfig("m", rounds=3).reps_llama == 5
    assert BenchConfig("m", rounds=8).reps_llama == 8
    assert BenchConfig("m", rounds=8, llama_reps=3).reps_llama == 3


def test_run_llama_bench_reads_a_whole_run(tmp_path) -> None:
    """A stand-in llama-bench (a script printing its JSON, and a long log on stderr as the real
    one prints while loading): the arguments it got, the samples, the watcher's calls."""
    got = tmp_path / "argv.json"
    fake = tmp_path / "llama-bench"
    fake.write_text("#!/bin/sh\n"
                    f"printf '%s\\n' \"$@\" > {got}.txt\n"
                    "i=0; while [ $i -lt 3000 ]; do echo 'load_tensors: layer offloaded' >&2; "
                    "i=$((i+1)); done\n"
                    "sleep 0.3\n"
                    f"cat <<'EOF'\n{json.dumps(LLAMA_JSON)}\nEOF\n")
    fake.chmod(0o755)
    calls = []
    run = run_llama_bench(fake, "/m.gguf", 512, 128, 3, ["-ngl", "99", "-fa", "1"],
                          while_running=lambda: calls.append(1), poll_s=0.05)
    assert (tmp_path / "argv.json.txt").read_text().split() == [
        "-m", "/m.gguf", "-p", "512", "-n", "128", "-r", "3", "-ngl", "99", "-fa", "1", "-o",
        "json"]
    assert run.prefill_ts == [40960.0, 41625.0, 41457.5] and run.decode_ts == [500.0, 498.0, 502.0]
    assert run.build == "abc1234 (7000)" and run.pid > 0 and len(calls) >= 3
    bad = tmp_path / "llama-bench-bad"
    bad.write_text("#!/bin/sh\necho 'error: failed to load model' >&2\nexit 1\n")
    bad.chmod(0o755)
    with pytest.raises(RuntimeError, match="failed to load model"):
        run_llama_bench(bad, "/m.gguf", 512, 128, 3, [])
    with pytest.raises(ValueError, match="is not a file"):
        run_llama_bench(tmp_path / "missing", "/m.gguf", 512, 128, 3, [])


def _fake_llama_bench(path, tests: list[dict], argv_file) -> str:
    path.write_text(f"#!/bin/sh\nprintf '%s\\n' \"$@\" > {argv_file}\n"
                    f"cat <<'EOF'\n{json.dumps(tests)}\nEOF\n")
    path.chmod(0o755)
    return str(path)


def test_cpu_bench_vs_llama(tmp_path) -> None:
    """The whole --vs-llama flow on the CPU with a tiny model: llama-bench (a stand-in) once
    with -r max(rounds, 5) and the default flags, Deimos's rounds after it, both in the table
    with their method lines; a llama-bench that fails leaves Deimos's rounds and a note."""
    from testdata import model_path

    from deimos.bench.run import run_bench
    from deimos.synth import write_model

    tiny = write_model(tmp_path / "tiny.gguf", "llama", "llama-tiny", "Q8_0",
                       model_path("SmolLM2-135M-Instruct.Q4_1.gguf"), seed=5)
    tests = [dict(t, n_prompt=16 if t["n_prompt"] else 0, n_gen=4 if t["n_gen"] else 0)
             for t in LLAMA_JSON]
    fake = _fake_llama_bench(tmp_path / "llama-bench", tests, tmp_path / "argv.txt")
    cfg = BenchConfig(str(tiny), n_prompt=16, n_gen=4, rounds=2, device="cpu", vs_llama=fake,
                      roof=1e11)
    report = run_bench(cfg)
    argv = (tmp_path / "argv.txt").read_text().split()
    assert argv == ["-m", str(tiny), "-p", "16", "-n", "4", "-r", "5", "-ngl", "99", "-fa", "1",
                    "-o", "json"]
    ours, theirs = report.engines
    assert ours.engine == "deimos" and ours.prefill.n == ours.decode.n == 2
    assert ours.method == "1 warm-up round (pp16 + tg4) not reported, then 2 rounds, after " \
                          "llama.cpp's run"
    assert theirs.prefill.values == (40960.0, 41625.0, 41457.5) and theirs.decode.best == 502.0
    assert "5 repetitions, flags -ngl 99 -fa 1" in theirs.method
    assert report.ratios()["prefill_best"] == pytest.approx(ours.prefill.max / 41625.0)
    assert report.contention == "not applicable (CPU)" and report.notes == []

    bad = tmp_path / "llama-bench-bad"
    bad.write_text("#!/bin/sh\necho 'ggml_cuda_init: no CUDA devices' >&2\nexit 1\n")
    bad.chmod(0o755)
    report = run_bench(BenchConfig(str(tiny), n_prompt=16, n_gen=4, rounds=1, device="cpu",
                                   vs_llama=str(bad), roof=1e11))
    assert [e.engine for e in report.engines] == ["deimos"] and report.ratios() is None
    assert len(report.notes) == 1 and "no CUDA devices" in report.notes[0]


def test_llama_run_intruders() -> None:
    """While llama-bench runs: its own PID when NVML shows it; in a container (host PIDs) the
    one new process is taken for it, and any second one is another's."""
    assert intruders({4242}, 4242) == set()
    assert intruders({4242, 7}, 4242) == {7}
    assert intruders({900001}, 4242) == set()
    assert intruders({900001, 900002}, 4242) == {900001, 900002}
    assert intruders(set(), 4242) == set()


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
