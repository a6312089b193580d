"""The MoE benchmarks of ``deimos bench`` on the CPU: the memory helper as a real process (its
command line, the host memory it holds and rewrites, its end on exit, on an exception and when
its parent is SIGKILLed), llama.cpp's -ncmoe search (its order and best-pick from given
results), the squeeze replay's bookkeeping (from given records, and driven with a real helper),
the expert cache's phase numbers, the flags, and one whole run of a tiny MoE file on the CPU.

Oracles: /proc/<pid>/status (VmRSS: the helper's memory is resident; the process is gone),
hand-computed search orders and phase rates, and the issue's llama.cpp run (30 out of memory,
33 the best, 36 slower)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import NamedTuple

import pytest
from rich.console import Console

from deimos.bench.memhold import ALIGN, GIB, MIB, MemHold, parse_ready, to_take
from deimos.bench.moe import (
    MemorySeen,
    MoeBenchReport,
    active_weight_bytes,
    add_phase,
    phase_numbers,
    render_moe,
)
from deimos.bench.ncmoe import (
    NcmoeSearch,
    NcmoeTry,
    expert_bytes_by_layer,
    failure_reason,
    first_guess,
    has_ncmoe,
)
from deimos.bench.run import BenchConfig
from deimos.bench.squeeze import (
    Event,
    RequestRecord,
    SlotSample,
    SqueezePlan,
    SqueezeTimeline,
    drive,
)
from deimos.bench.stats import Spread
from testdata import LLAMA_CPP, data_file

REPO = Path(__file__).resolve().parent.parent


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def _gone(pid: int, within: float = 5.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
        except FileNotFoundError:
            return True
        if state == "Z":  # exited, not yet reaped by its (dead or waiting) parent
            return True
        time.sleep(0.05)
    return False


# ---- the memory helper -------------------------------------------------------------------------

def test_to_take_rounds_down_and_never_goes_negative() -> None:
    assert to_take(10 * GIB, 8 * GIB) == 2 * GIB
    assert to_take(10 * GIB + 3 * MIB, 8 * GIB) == 2 * GIB + 2 * MIB  # down to 2 MiB
    assert to_take(7 * GIB, 8 * GIB) == 0
    with pytest.raises(ValueError):
        to_take(-1, 0)


def test_command_line() -> None:
    h = MemHold(leave_gib=8, device="cuda:1", python="py")
    assert h.command() == ["py", "-m", "deimos.bench.memhold", "--leave", "8", "--device",
                           "cuda:1", "--rewrite-ms", "0", "--wait-s", "60", "--chunk-mib", "256"]
    h = MemHold(take_gib=2, rewrite_ms=250, python="py")
    assert h.command()[3:5] == ["--take", "2"] and h.command()[7:9] == ["--rewrite-ms", "250"]
    with pytest.raises(ValueError, match="exactly one"):
        MemHold(leave_gib=1, take_gib=1)
    with pytest.raises(ValueError, match="exactly one"):
        MemHold()
    assert parse_ready("ready held=4 free_before=10 free_after=6 full=0", 1.5) == (4, 10, 6,
                                                                                   False, 1.5, "")
    assert parse_ready("ready held=4 free_before=10 free_after=6 full=0 stop=stdin", 1.5).stop == "stdin"
    assert parse_ready("something else", 0.0) is None
    with pytest.raises(ValueError, match="without its numbers"):
        parse_ready("ready held=4", 0.0)


def test_cpu_stand_in_holds_resident_memory_rewrites_it_and_ends_on_exit() -> None:
    take = 48 * MIB
    with MemHold(take_gib=take / GIB, device="cpu", rewrite_ms=40, chunk_mib=16) as h:
        held = h.wait_ready(20)
        pid = h.pid
        assert held.held == take and held.full
        assert _rss(pid) >= take  # filled, so resident (not merely reserved)
        time.sleep(0.5)
    assert _gone(pid)
    assert h.returncode == 0
    assert h.rewrites is not None and h.rewrites >= 4  # 0.5 s at 40 ms


def test_helper_ends_when_an_exception_leaves_the_with_block() -> None:
    with pytest.raises(KeyboardInterrupt), MemHold(take_gib=4 * MIB / GIB, device="cpu") as h:
        h.wait_ready(20)
        pid = h.pid
        raise KeyboardInterrupt  # Ctrl-C in the bench
    assert _gone(pid)


def test_helper_ends_when_its_parent_is_killed() -> None:
    """The parent SIGKILLed (no cleanup runs): the helper sees its stdin close and goes."""
    code = ("import sys, time\n"
            "from deimos.bench.memhold import MemHold\n"
            "h = MemHold(take_gib=4 / 1024, device='cpu').start()\n"
            "h.wait_ready(20)\n"
            "print(h.pid, flush=True)\n"
            "time.sleep(60)\n")
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, cwd=REPO)
    try:
        child = int(parent.stdout.readline())
        assert not _gone(child, within=0.2)
        parent.send_signal(signal.SIGKILL)
        parent.wait(5)
        assert _gone(child)
    finally:
        parent.kill()
        parent.wait()
        parent.stdout.close()


def test_leave_on_the_cpu_stand_in_leaves_about_what_it_was_told() -> None:
    """--leave reads free memory between pieces: asked to leave all but 32 MiB of what is free
    now, it holds about 32 MiB (other processes move MemAvailable a little meanwhile)."""
    for _ in range(3):  # again if another process (a parallel test's load) took more than the
        # 32 MiB between the test's reading and the helper's first: then there was nothing to hold
        free = int(Path("/proc/meminfo").read_text().split("MemAvailable:")[1].split()[0]) * 1024
        leave = free - 32 * MIB
        with MemHold(leave_gib=leave / GIB, device="cpu", chunk_mib=8) as h:
            held = h.wait_ready(20)
        if held.held or held.free_before > leave:
            break
    assert held.held % ALIGN == 0 and held.held > 0
    # what it left free by its own last reading (other processes move MemAvailable meanwhile,
    # so what it had to take may differ from the 32 MiB of the test's reading)
    assert abs(held.free_after - leave) <= 64 * MIB, held


# ---- llama.cpp's -ncmoe search -----------------------------------------------------------------

def _run(search: NcmoeSearch, fits, speed) -> list[int]:
    order = []
    while (n := search.next()) is not None:
        order.append(n)
        if fits(n):
            pp, tg = speed(n)
            search.record(NcmoeTry(n, Spread.of([pp]), Spread.of([tg])))
        else:
            search.record(NcmoeTry(n, error="out of memory"))
    return order


def _issue_speed(n: int) -> tuple[float, float]:
    """The issue's run: 33 the best, 36 and 40 slower; 31..32 a little slower than 33."""
    return {31: (1900.0, 38.0), 32: (1950.0, 39.0), 33: (1997.0, 40.1)}.get(
        n, (2000.0 - 20 * n, 60.0 - 0.6 * n))


def test_search_from_a_guess_that_fits() -> None:
    s = NcmoeSearch(48, 32)
    order = _run(s, lambda n: n >= 31, _issue_speed)
    # 32 fits; down by 4 (28 fails); bisect (30 fails, 31 fits): the boundary 31; then 33 and 35
    assert order == [32, 28, 30, 31, 33, 35]
    assert s.boundary() == 31
    assert s.best().n == 33 and s.best().decode.mean == 40.1
    assert "-ncmoe 28: out of memory" in s.summary()


def test_search_from_a_guess_too_low() -> None:
    s = NcmoeSearch(48, 20)
    assert _run(s, lambda n: n >= 31, _issue_speed) == [20, 24, 28, 32, 30, 31, 33, 35]
    assert s.best().n == 33


def test_search_stops_at_zero_and_when_nothing_fits() -> None:
    s = NcmoeSearch(48, 0)
    assert _run(s, lambda n: True, lambda n: (100.0 - n, 50.0 - n)) == [0]
    assert s.best().n == 0
    s = NcmoeSearch(10, 3)
    assert _run(s, lambda n: False, _issue_speed) == [3, 7, 10]
    assert s.best() is None
    s = NcmoeSearch(48, 40, max_runs=3)
    assert len(_run(s, lambda n: n >= 5, _issue_speed)) == 3
    with pytest.raises(ValueError, match="twice"):
        s.record(NcmoeTry(40))


def test_best_prefers_decode_then_prefill() -> None:
    s = NcmoeSearch(48, 10)
    s.record(NcmoeTry(10, Spread.of([900.0]), Spread.of([40.0])))
    s.record(NcmoeTry(12, Spread.of([1000.0]), Spread.of([40.0])))
    s.record(NcmoeTry(14, Spread.of([2000.0]), Spread.of([39.0])))
    assert s.best().n == 12 and s.best_prefill().n == 14


class _Info(NamedTuple):
    nbytes: int


def test_first_guess_from_the_files_bytes() -> None:
    tensors = {f"blk.{i}.ffn_{p}_exps.weight": _Info(100) for i in range(4)
               for p in ("gate", "up", "down")}
    tensors |= {"blk.0.attn_q.weight": _Info(50), "blk.1.ffn_gate_inp.weight": _Info(7),
                "blk.2.ffn_down_shexp.weight": _Info(9)}
    per = expert_bytes_by_layer(tensors, 4)
    assert per == [300, 300, 300, 300]
    total = 1266
    assert first_guess(total, per, None) == 0
    assert first_guess(total, per, total + 10, overhead=0) == 0
    assert first_guess(total, per, total - 1, overhead=0) == 1
    assert first_guess(total, per, total - 301, overhead=0) == 2
    assert first_guess(total, per, 0, overhead=0) == 4  # never past the layers


def test_ncmoe_flags_and_failure_reasons() -> None:
    assert has_ncmoe(["-ngl", "99", "-ncmoe", "33"]) and has_ncmoe(["--n-cpu-moe=4"])
    assert not has_ncmoe(["-ngl", "99", "-fa", "1"])
    assert failure_reason("llama-bench failed (1): ggml_backend_cuda_buffer_type_alloc_buffer: "
                          "allocating 9000 MiB on device 0: cudaMalloc failed: out of memory"
                          ) == "out of memory"
    assert failure_reason("weird\nerror: bad flag -zz\n") == "error: bad flag -zz"


# ---- the squeeze -------------------------------------------------------------------------------

def test_squeeze_plan() -> None:
    p = SqueezePlan.of(8)
    assert (p.take_before, p.release_before) == (3, None)
    assert [p.phase(i) for i in range(8)] == ["before"] * 3 + ["squeezed"] * 5
    p = SqueezePlan.of(8, release=True)
    assert p.release_before == 5
    assert [p.phase(i) for i in range(8)] == ["before"] * 3 + ["squeezed"] * 2 + ["released"] * 3
    with pytest.raises(ValueError, match="too few"):
        SqueezePlan.of(4)
    with pytest.raises(ValueError, match="too few"):
        SqueezePlan.of(5, release=True)
    with pytest.raises(ValueError, match="after the take"):
        SqueezePlan(8, 3, 3)


def test_squeeze_summary_from_given_records() -> None:
    plan = SqueezePlan.of(7, release=True)  # before 0..2, squeezed 3..4, released 5..6
    assert plan.release_before == 5
    tl = SqueezeTimeline(plan, held_bytes=2 * GIB)
    # (phase, seconds, tokens, slots at start, at end)
    rows = [(1.0, 100, 64, 64), (1.0, 100, 64, 64), (0.5, 100, 64, 64),  # 300/2.5 = 120 t/s
            (2.0, 100, 64, 40), (1.0, 100, 40, 40),  # 200/3 = 66.7 t/s
            (1.0, 100, 40, 56), (0.5, 100, 56, 64)]  # 200/1.5 = 133 t/s
    t = 0.0
    for i, (secs, toks, a, b) in enumerate(rows):
        tl.requests.append(RequestRecord(i, plan.phase(i), t, secs, toks, a, b))
        tl.samples.append(SlotSample(t + secs, b, i))
        t += secs
    tl.events += [Event(2.5, "take"), Event(3.0, "taken"), Event(5.5, "release")]
    s = tl.summary()
    assert s.before_tps == pytest.approx(120.0)
    assert s.squeezed_tps == pytest.approx(200 / 3)
    assert s.kept == pytest.approx((200 / 3) / 120)
    assert s.released_tps == pytest.approx(200 / 1.5)
    assert (s.slots_before, s.slots_squeezed, s.slots_end, s.slots_regrown) == (64, 40, 64, 64)
    assert s.regrow_s == pytest.approx(7.0 - 5.5)  # the sample at the end of request 7
    assert s.taken_s == pytest.approx(0.5)
    json.dumps(tl.to_json())


def test_drive_with_a_real_helper() -> None:
    """The replay's loop on the CPU: requests that sleep, a slot count that follows the
    helper's state, and a real helper process taking 8 MiB then released."""
    plan = SqueezePlan.of(7, release=True, take_gib=8 * MIB / GIB, rewrite_ms=20)
    holds: list[MemHold] = []
    pids: list[int] = []

    def make_hold() -> MemHold:
        holds.append(MemHold(take_gib=plan.take_gib, rewrite_ms=plan.rewrite_ms, device="cpu"))
        return holds[-1]

    def run_request(i: int, after_step) -> int:
        if i == plan.take_before:
            pids.append(holds[-1].pid)
            holds[-1].wait_ready(20)  # so the test knows the take landed during request 4
        for _ in range(3):
            time.sleep(0.03 if holds and holds[-1].alive() else 0.01)  # slower while squeezed
            after_step()
        return 3

    def slots() -> int:
        return 4 if holds and holds[-1].alive() else 8

    tl = drive(plan, run_request, slots, make_hold)
    assert [r.phase for r in tl.requests] == ["before"] * 3 + ["squeezed"] * 2 + ["released"] * 2
    assert [e.what for e in tl.events] == ["take", "taken", "release"]
    assert tl.held_bytes == 8 * MIB and tl.rewrites is not None
    s = tl.summary()
    assert (s.slots_before, s.slots_squeezed, s.slots_regrown) == (8, 4, 8)
    assert s.kept < 1.0 and s.regrow_s is not None and s.regrow_s >= 0
    assert _gone(pids[0]) and holds[0].returncode == 0


def test_drive_closes_the_helper_when_a_request_fails() -> None:
    plan = SqueezePlan.of(5, take_gib=4 * MIB / GIB)
    holds: list[MemHold] = []
    pids: list[int] = []

    def make_hold() -> MemHold:
        holds.append(MemHold(take_gib=plan.take_gib, device="cpu"))
        return holds[-1]

    def run_request(i: int, after_step) -> int:
        if i == plan.take_before:
            pids.append(holds[-1].pid)
            holds[-1].wait_ready(20)
            raise RuntimeError("a step failed")
        return 1

    with pytest.raises(RuntimeError, match="a step failed"):
        drive(plan, run_request, lambda: None, make_hold)
    assert _gone(pids[0])


# ---- the expert cache's phase numbers, the report ----------------------------------------------

def _snap(slots, hits, misses, cpu, tokens, streamed=0, prom=0, resizes=0, host_read=0,
          share=0.5, moves=0) -> dict:
    return {"slots": slots, "bytes": slots * GIB // 8, "hits": hits, "misses": misses,
            "promotions": prom, "cpu_experts": cpu, "host_read_experts": host_read,
            "streamed_experts": streamed, "tokens": tokens, "resizes": resizes,
            "gpu_share": share, "share_moves": moves}


def test_phase_numbers_count_only_the_phase() -> None:
    a = _snap(16, 1000, 1000, 500, 100)  # the load's and warm-up's counts, left out
    b = _snap(16, 1900, 1100, 600, 150)
    n = phase_numbers(a, b)
    assert n["hits"] == 900 and n["misses"] == 100 and n["hit_rate"] == pytest.approx(0.9)
    assert n["cpu_experts_per_token"] == pytest.approx(100 / 50)
    c = _snap(8, 2000, 1400, 900, 200, resizes=1, host_read=150, share=0.35, moves=3)
    both = add_phase(n, phase_numbers(b, c))
    assert (both["gpu_share"], both["share_moves"]) == (0.35, 3)  # the level at the end, moves summed
    assert both["host_read_per_token"] == pytest.approx(150 / 100)
    assert both["hits"] == 1000 and both["misses"] == 400
    assert both["hit_rate"] == pytest.approx(1000 / 1400)
    assert both["cpu_experts_per_token"] == pytest.approx(400 / 100)
    assert (both["slots"], both["resizes"]) == (8, 1)
    assert phase_numbers({}, {}) == {}


class _File(NamedTuple):
    metadata: dict
    tensors: dict


def test_active_weight_bytes_count_the_routed_share() -> None:
    f = _File({"general.architecture": "qwen3moe", "qwen3moe.expert_count": 8,
               "qwen3moe.expert_used_count": 2},
              {"blk.0.ffn_up_exps.weight": _Info(800), "blk.0.attn_q.weight": _Info(100)})
    assert active_weight_bytes(f, 900, 1) == 100 + 200


def test_render_moe_report() -> None:
    plan = SqueezePlan.of(5)
    tl = SqueezeTimeline(plan)
    for i in range(5):
        tl.requests.append(RequestRecord(i, plan.phase(i), float(i), 1.0, 50, 32, 32 if i < 3
                                         else 24))
        tl.samples.append(SlotSample(i + 1.0, 32 if i < 3 else 24, i, (3 - i % 3) * GIB // 4, GIB // 2))
    tl.events.append(Event(3.0, "take", "2 GiB"))
    r = MoeBenchReport("m.gguf", "offloaded (32 of 128 slots a layer at load)",
                       MemorySeen(8.0, 140 * GIB, 130 * GIB, 139 * GIB, 8 * GIB, 2 * GIB),
                       experts={"decode": {**_snap(32, 90, 10, 10, 20), "hit_rate": 0.9,
                                           "cpu_experts_per_token": 0.5, "cache_gib": 4.0}},
                       ncmoe=[{"n": 30, "prefill": None, "decode": None, "error": "out of memory"},
                              {"n": 33, "prefill": {"mean": 1997.0}, "decode": {"mean": 40.1},
                               "error": ""}], ncmoe_best=33, squeeze=tl)
    con = Console(width=200, record=True)
    for part in render_moe(r):
        con.print(part)
    text = con.export_text()
    assert "--gpu-mem 8: a helper holds 130.00 GiB" in text
    assert "out of memory" in text and "best" in text and "90.0%" in text
    assert "kept 100.0%" in text and "32 before, 24 at the fewest" in text
    # the sizing's view: the least free memory of each phase against its headroom
    flat = " ".join(text.split())  # the caption wraps
    assert "squeezed: free memory (the sizing's reader) at least 0.50 GiB (headroom 0.50 GiB) at 5.00s" in flat
    assert "before: free memory (the sizing's reader) at least 0.25 GiB (headroom 0.50 GiB) at 3.00s" in flat
    assert json.loads(json.dumps(r.to_json()))["ncmoe_best"] == 33


def test_llama_cpp_under_the_squeeze_is_searched_again_with_the_take_held(monkeypatch) -> None:
    """llama.cpp's best -ncmoe again while a helper holds the squeeze's take: the search sees
    the free memory the helper left, counts the helper's PID as the bench's own, and the
    helper is closed after it; the report says both settings and the kept fraction."""
    from deimos.bench import moe_run
    from deimos.bench.memhold import Held
    from deimos.bench.stats import EngineResult

    class FakeHold:
        pid = 4242
        closed = False

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            FakeHold.closed = True

        def wait_ready(self):
            return Held(2 * GIB, 8 * GIB, 6 * GIB, True, 0.0)

    def result(tps):
        return EngineResult("llama.cpp", Spread.of([300.0]), Spread.of([tps]))

    seen = {}

    def fake_search(cfg, path, file, n_layer, nvml, ours, free):
        seen.update(ours=ours, free=free, open=not FakeHold.closed)
        s = NcmoeSearch(n_layer, 40)
        s.record(NcmoeTry(36, error="out of memory"))
        s.record(NcmoeTry(40, Spread.of([250.0]), Spread.of([30.0])))
        return result(30.0), 0, ["a note"], s

    monkeypatch.setattr(moe_run, "search_llama", fake_search)
    before = NcmoeSearch(48, 33)
    before.record(NcmoeTry(33, Spread.of([330.0]), Spread.of([50.0])))
    cfg = BenchConfig("m", squeeze=True, vs_llama="/x/llama-bench", gpu_mem=8)
    out = moe_run.squeezed_llama(cfg, "m", None, 48, None, frozenset({1}), result(50.0), before,
                                 make_hold=FakeHold)
    assert seen == {"ours": frozenset({1, 4242}), "free": 6 * GIB, "open": True}
    assert FakeHold.closed
    assert (out.before_ncmoe, out.before_tps, out.squeezed_ncmoe, out.squeezed_tps) == (33, 50.0, 40, 30.0)
    assert out.kept == pytest.approx(0.6) and [t["n"] for t in out.tried] == [36, 40]
    text = "\n".join(out.lines())
    assert "-ncmoe 33: 50.00 t/s before, -ncmoe 40: 30.00 t/s with 2 GiB less: kept 60.0%" in text
    assert "squeezed: a note" in text
    r = MoeBenchReport("m.gguf", "offloaded", MemorySeen(8.0, 80 * GIB, 70 * GIB, 78 * GIB, 8 * GIB,
                                                          2 * GIB), llama_squeeze=out)
    con = Console(width=300, record=True)
    for part in render_moe(r):
        con.print(part)
    assert "kept 60.0%" in con.export_text()
    assert json.loads(json.dumps(r.to_json()))["llama_squeeze"]["kept"] == pytest.approx(0.6)
    # nothing fits with the take held: said, no kept fraction
    monkeypatch.setattr(moe_run, "search_llama", lambda *a: (None, 0, ["llama.cpp: no -ncmoe fit"],
                                                             NcmoeSearch(48, 40)))
    out = moe_run.squeezed_llama(cfg, "m", None, 48, None, frozenset(), result(50.0), before,
                                 make_hold=FakeHold)
    assert out.squeezed_tps is None and out.kept is None
    assert "no -ncmoe fit with 2 GiB less" in out.lines()[0]


def test_llama_cpp_is_also_run_with_its_weights_pinned(monkeypatch) -> None:
    """After its -ncmoe (given or searched), llama-bench runs once more with ``-lm none`` (a
    pinned host copy instead of mmap'd pages) unless the flags choose a load mode; the better
    run's numbers are the table's test by test (each test's faster mode), and the notes give both."""
    from deimos.bench import moe_run
    from deimos.bench.stats import EngineResult

    runs = []

    def fake_alone(table):
        def run(cfg, path, nvml, args, ours):
            runs.append(list(args))
            pp, tg = table["-lm" in args]
            if pp is None:
                return None, 0, [], "ggml_cuda: out of memory"
            return EngineResult("llama.cpp", Spread.of([pp]), Spread.of([tg]), "m"), 0, [], ""
        return run

    cfg = BenchConfig("m", vs_llama="/x/llama-bench", llama_args="-ngl 99 -fa 1 -ncmoe 33")
    for table, want, note in (({False: (330.0, 54.0), True: (1900.0, 53.5)}, (1900.0, 54.0), "(pp -lm none, tg mmap)"),
                              ({False: (330.0, 54.0), True: (1900.0, 55.0)}, (1900.0, 55.0), "(-lm none)"),
                              ({False: (330.0, 54.0), True: (320.0, 50.0)}, (330.0, 54.0), "(mmap)"),
                              ({False: (330.0, 54.0), True: (None, None)}, (330.0, 54.0), "out of memory")):
        runs.clear()
        monkeypatch.setattr(moe_run, "_llama_alone", fake_alone(table))
        res, _, notes, search = moe_run.search_llama(cfg, "m", None, 48, None, frozenset(), None)
        assert search is None and runs == [["-ngl", "99", "-fa", "1", "-ncmoe", "33"],
                                           ["-ngl", "99", "-fa", "1", "-ncmoe", "33", "-lm", "none"]]
        assert (res.prefill.mean, res.decode.mean) == want and note in notes[-1]
        assert ("load mode" in res.method) == (want[0] == 1900.0)
    runs.clear()
    cfg = BenchConfig("m", vs_llama="/x/llama-bench", llama_args="-ngl 99 -ncmoe 33 -lm mmap")
    moe_run.search_llama(cfg, "m", None, 48, None, frozenset(), None)
    assert len(runs) == 1  # a load mode chosen: no second run
    # after a search: the pinned run at the best -ncmoe found (33: 32 and below do not fit)
    runs.clear()

    def searched(cfg, path, nvml, args, ours):
        runs.append(list(args))
        n = int(args[args.index("-ncmoe") + 1])
        if n < 33:
            return None, 0, [], "cudaMalloc failed: out of memory"
        pinned = "-lm" in args
        return EngineResult("llama.cpp", Spread.of([1900.0 if pinned else 330.0]),
                            Spread.of([60.0 - (n - 33) * (1 if not pinned else 1.2)]), "m"), 0, [], ""

    monkeypatch.setattr(moe_run, "_llama_alone", searched)
    monkeypatch.setattr(moe_run, "first_guess", lambda *a: 36)
    monkeypatch.setattr(moe_run, "expert_bytes_by_layer", lambda *a: [])
    cfg = BenchConfig("m", vs_llama="/x/llama-bench")
    f = SimpleNamespace(tensors={}, file_size=0)
    res, _, notes, search = moe_run.search_llama(cfg, "m", f, 48, None, frozenset(), None)
    assert search.best().n == 33 and runs[-1][-4:] == ["-ncmoe", "33", "-lm", "none"]
    assert (res.prefill.mean, res.decode.mean) == (1900.0, 60.0) and "(pp -lm none, tg mmap)" in notes[-1]


def test_squeeze_against_llama_cpp_needs_a_moe_file(tmp_path) -> None:
    """A dense file has no -ncmoe to search: refused by name before any helper starts."""
    from deimos.bench.run import run_bench
    from deimos.synth import write_model

    dense = write_model(tmp_path / "dense.gguf", "llama", "llama-tiny", "Q8_0",
                        data_file("models/SmolLM2-135M-Instruct.Q4_1.gguf"), seed=5)
    with pytest.raises(ValueError, match="dense.gguf has no routed experts"):
        run_bench(BenchConfig(str(dense), squeeze=True, vs_llama="/x/llama-bench", gpu_mem=8))


# ---- the flags ---------------------------------------------------------------------------------

def test_config_checks() -> None:
    with pytest.raises(ValueError, match="--release is a variant"):
        BenchConfig("m", release=True)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        BenchConfig("m", device="cpu", gpu_mem=8)
    with pytest.raises(ValueError, match="with --vs-llama needs --gpu-mem"):
        BenchConfig("m", squeeze=True, vs_llama="/x/llama-bench")
    BenchConfig("m", squeeze=True, vs_llama="/x/llama-bench", gpu_mem=8)  # both limits searched
    with pytest.raises(ValueError, match="too few"):
        BenchConfig("m", squeeze=True, release=True, squeeze_requests=5)
    with pytest.raises(ValueError, match="positive"):
        BenchConfig("m", gpu_mem=0)


def test_cli_flags() -> None:
    from deimos.cli import build_parser

    p = build_parser()
    a = p.parse_args(["bench", "m.gguf", "--gpu-mem", "8", "--squeeze", "--release",
                      "--squeeze-requests", "10"])
    assert (a.gpu_mem, a.squeeze, a.release, a.squeeze_requests) == (8.0, True, True, 10)
    a = p.parse_args(["bench", "m.gguf"])
    assert (a.gpu_mem, a.squeeze, a.release, a.squeeze_requests) == (None, False, False, 8)
    with pytest.raises(SystemExit):
        p.parse_args(["bench", "m.gguf", "--gpu-mem", "0"])


# ---- a whole run on the CPU --------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory) -> Path:
    from deimos.synth import write_model

    donor = data_file(f"{LLAMA_CPP}/models/ggml-vocab-phi-3.gguf")  # 32k tokens: small
    return write_model(tmp_path_factory.mktemp("moe") / "tiny-moe.gguf", "qwen3moe",
                       "qwen3moe-tiny", "Q8_0", donor, 0)


def test_cli_bench_on_a_tiny_moe_file_goes_through_llm(tiny_moe, tmp_path) -> None:
    """``deimos bench`` on a MoE file, CPU device: the LLM path (a MoeBenchReport: the placement
    line, the bench's rounds inside), and the routed share of the bytes per token."""
    out = tmp_path / "b.json"
    r = subprocess.run([sys.executable, "-m", "deimos", "bench", str(tiny_moe), "--device",
                        "cpu", "-p", "6", "-n", "3", "-r", "1", "--roof", "1e10", "--json",
                        str(out)], check=False, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    doc = json.loads(out.read_text())
    assert doc["placement"] == "on the CPU" and doc["experts"] == {}
    bench = doc["bench"]
    assert bench["engines"][0]["engine"] == "deimos" and bench["engines"][0]["decode"]["n"] == 1
    assert "deimos.LLM defaults" in bench["engines"][0]["method"]
    assert "routed experts on the CPU" in r.stdout


def test_llama_cpp_gets_each_tests_faster_load_mode():
    """llama.cpp's two load modes (mmap, -lm none): the comparison takes each test from the mode
    that ran it faster (H100: -lm none's prefill ~4x mmap's, mmap's decode a few % faster)."""
    from deimos.bench.moe_run import faster_each
    from deimos.bench.stats import EngineResult

    mmap = EngineResult("llama.cpp", Spread.of([421.0]), Spread.of([89.9]), "llama-bench -ncmoe 33")
    pinned = EngineResult("llama.cpp", Spread.of([1752.0]), Spread.of([85.9]), "x")
    best, mode = faster_each(mmap, pinned)
    assert (best.prefill.mean, best.decode.mean) == (1752.0, 89.9)
    assert mode == "pp -lm none, tg mmap" and best.method == "llama-bench -ncmoe 33; load mode " + mode
    best, mode = faster_each(mmap, EngineResult("llama.cpp", Spread.of([2000.0]), Spread.of([95.0])))
    assert mode == "-lm none" and (best.prefill.mean, best.decode.mean) == (2000.0, 95.0)
    best, mode = faster_each(mmap, EngineResult("llama.cpp", Spread.of([400.0]), Spread.of([80.0])))
    assert mode == "mmap" and best.method == mmap.method and best.prefill.mean == 421.0
