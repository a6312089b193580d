"""Fuzz the chat-template sandbox: hostile templates through ``ChatTemplate``, each under a
hard watchdog, classified by what happened.

    python tools/fuzz_templates.py --cases 20000 --seed 7        # long round, counts table
    python tools/fuzz_templates.py --cases 300 --seed 1 --time-s 0.1 --show 5

Cases combine filters, str/list/dict/int methods and operators with huge arguments (widths,
counts, repeat factors, exponents, format widths and precisions, indents), inside loops,
namespaces accumulating across iterations, recursive macros, captured blocks, and mutations
of the real templates of llama.cpp's models/templates (``$DEIMOS_TEST_DATA``) when present.

Each case is compiled and rendered (the compile runs the load-time probe too) in a worker
process. The parent waits at most ``--kill-s`` for an answer; the worker reports the
case's peak resident memory (Linux ``VmHWM``, reset before each case). Classes:

  rendered      the template rendered
  error         it failed with TemplateError (the clean failure)
  wrong         any other exception escaped ChatTemplate
  crash         the worker died (a signal: segfault, abort)
  hang          the case took longer than the time budget (2 renders' deadline + slack), or
                the watchdog killed it
  memory        its peak memory grew more than --mem-mb over the worker's resident size
"""

from __future__ import annotations

import argparse
import glob
import multiprocessing as mp
import os
import random
import re
import resource
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

CLASSES = ("rendered", "error", "wrong", "crash", "hang", "memory")
BAD = ("wrong", "crash", "hang", "memory")

NUMS = ["0", "1", "-1", "3", "7", "64", "1000", "100000", "1000000", "100000000",
        "2000000000", "2e9", "1e8", "10**9", "(2**31)", "-1000000000", "0.5", "(2**2000)",
        "10**100", "-7"]
SMALL = ["1", "2", "3", "10", "100", "1000", "20000"]
STRS = ["'x'", "''", "'ab\\n\\tcd'", "'<a>'", "'é😀'", "'%s'", "'{}'", "'-'", "' '",
        "('x' * 1000)", "('ab\\n' * 10000)", "messages[0].content", "'http://a.b/c d@e.fg'"]
VALUES = STRS + ["messages", "messages[0]", "tools", "[1, 2, 3]", "{'a': 1, 'b': [2]}",
                 "range(10)", "(1, 2)", "none", "undefined_name", "1.5", "(2 ** 64)",
                 "[[0] * 100] * 100", "ns.v", "cycler(1, 2)", "loop", "namespace(a=1)",
                 "dict(a='x')", "lipsum(2)", "true"]

# (filter, argument patterns); {n} a number, {s} a string, {v} a value
FILTERS = [
    ("center", ["", "{n}"]), ("indent", ["{n}", "{n}, true, true", "{s}"]),
    ("wordwrap", ["{n}", "{n}, true, {s}"]), ("replace", ["{s}, {s}", "'', {s}", "{s}, {s}, {n}"]),
    ("format", ["{v}", "{v}, {v}", "a={v}"]), ("join", ["", "{s}", "{s}, 'content'"]),
    ("batch", ["{n}", "{n}, {v}"]), ("slice", ["{n}", "{n}, {v}"]),
    ("truncate", ["{n}", "{n}, true, {s}"]), ("round", ["", "{n}", "{n}, 'floor'"]),
    ("tojson", ["", "indent={n}", "indent={s}", "ensure_ascii=true"]),
    ("int", ["", "{n}, 16"]), ("float", [""]), ("list", [""]),
    ("map", ["'string'", "'center', {n}", "attribute='content'", "'upper'"]),
    ("select", ["", "'string'"]), ("reject", ["'none'"]), ("selectattr", ["'role'"]),
    ("unique", [""]), ("sort", ["", "attribute='role'"]), ("groupby", ["'role'"]),
    ("sum", ["", "start=[]", "start={v}"]), ("pprint", [""]), ("urlize", ["", "{n}"]),
    ("wordcount", [""]), ("striptags", [""]), ("xmlattr", [""]), ("dictsort", [""]),
    ("items", [""]), ("first", [""]), ("last", [""]), ("length", [""]), ("string", [""]),
    ("upper", [""]), ("title", [""]), ("escape", [""]), ("urlencode", [""]),
    ("filesizeformat", [""]), ("reverse", [""]), ("abs", [""]), ("default", ["{v}"]),
    ("max", [""]), ("min", [""]), ("trim", ["", "{s}"]), ("capitalize", [""]), ("attr", ["{s}"]),
    ("forceescape", [""]), ("random", [""]), ("count", [""]), ("safe", [""]),
]
METHODS = [
    ("ljust", ["{n}", "{n}, {s}"]), ("rjust", ["{n}"]), ("center", ["{n}"]), ("zfill", ["{n}"]),
    ("expandtabs", ["{n}"]), ("replace", ["{s}, {s}", "'', {s}", "{s}, {s}, {n}"]),
    ("join", ["{v}", "[{s}] * {n}"]), ("split", ["", "{s}", "{s}, {n}"]), ("splitlines", [""]),
    ("encode", ["", "'punycode'", "'utf-16'", "'idna'"]), ("format", ["{v}", "{v}, {v}", "a={v}"]),
    ("format_map", ["{'a': {v}}"]), ("upper", [""]), ("strip", ["", "{s}"]),
    ("translate", ["{120: {s}}"]), ("partition", ["{s}"]), ("count", ["{s}"]),
    ("startswith", ["{s}"]), ("to_bytes", ["{n}, 'big'"]), ("items", [""]), ("get", ["{v}"]),
    ("keys", [""]), ("copy", [""]), ("bit_length", [""]), ("index", ["{v}"]),
    ("fromkeys", ["{v}"]), ("title", [""]), ("swapcase", [""]), ("casefold", [""]),
    ("rsplit", ["{s}, {n}"]), ("isdigit", [""]), ("removeprefix", ["{s}"]), ("hex", [""]),
    ("append", ["1"]), ("update", ["{v}"]), ("pop", [""]), ("conjugate", [""]),
]
BINOPS = ["*", "+", "**", "%", "//", "/", "-", "~", "==", "!=", "<", "in", "not in", "and", "or"]
FORMAT_SPECS = ["{:>{n}}", "{:.{n}f}", "{:0{n}d}", "{!r:^{n}}", "{:,}", "{:{}}", "{0}{0}{0}",
                "{a.b}", "{0[0]}", "{:x<{n}}"]
RECURSIVE = ["[[1, [2]]]", "messages", "[{'c': [{'c': []}]}]"]
DAG_USES = ["a == b", "a in [b]", "{(a | map('list') | list | string): 1}", "a | tojson | length",
            "a | string | length", "a | unique | list | length", "a | sort | length"]
PRINTF = ["%{n}d", "%.{n}f", "%*d", "%-{n}s", "%(a)s%(a){n}s", "%c", "%{n}.{n}e", "%%", "%r"]


def _pick_num(rng: random.Random) -> str:
    return rng.choice(NUMS)


def _fill(rng: random.Random, pattern: str, depth: int) -> str:
    out = pattern
    while "{n}" in out:
        out = out.replace("{n}", _pick_num(rng), 1)
    while "{s}" in out:
        out = out.replace("{s}", rng.choice(STRS), 1)
    while "{v}" in out:
        out = out.replace("{v}", _expr(rng, depth + 1), 1)
    return out


def _expr(rng: random.Random, depth: int = 0) -> str:
    """A random expression: a value, then up to three filters / methods / operators."""
    if depth > 2:
        return rng.choice(VALUES)
    e = rng.choice(VALUES)
    for _ in range(rng.randint(0, 3)):
        kind = rng.random()
        if kind < 0.35:
            name, pats = rng.choice(FILTERS)
            args = _fill(rng, rng.choice(pats), depth)
            e = f"({e} | {name}({args}))" if args else f"({e} | {name})"
        elif kind < 0.7:
            name, pats = rng.choice(METHODS)
            e = f"{e}.{name}({_fill(rng, rng.choice(pats), depth)})"
        elif kind < 0.85:
            op = rng.choice(BINOPS)
            other = _pick_num(rng) if rng.random() < 0.5 else _expr(rng, depth + 1)
            e = f"({e} {op} {other})" if rng.random() < 0.5 else f"({other} {op} {e})"
        elif kind < 0.93:
            spec = rng.choice(FORMAT_SPECS).replace("{n}", _pick_num(rng).strip("()"))
            e = f"'{spec}'.format({e}, {_pick_num(rng)}, a={e})"
        else:
            spec = rng.choice(PRINTF).replace("{n}", rng.choice(["5", "100000", "2000000000"]))
            e = f"('{spec}' % ({e}, {_pick_num(rng)}))" if "*" in spec or "%(" not in spec \
                else f"('{spec}' % {{'a': {e}}})"
    return e


# Statement shapes; each <TOKEN> is replaced by a fresh random pick (see _TOKENS).
SHAPES = [
    "{{ <E> }}",
    "{{ <E> }}{{ <E> }}",
    "{% set ns = namespace(v=<V>) %}{% for i in range(<N>) %}{% set ns.v = <E> %}"
    "{% set ns.v = ns.v <ACC> <RHS> %}{% endfor %}{{ ns.v }}",
    "{% for i in range(<N>) %}{% for j in range(<N>) %}{{ <E> }}{% endfor %}{% endfor %}",
    "{% macro f(k) %}{% if k > 0 %}{{ f(k - 1) }}{{ f(k - 1) }}{% else %}{{ <E> }}{% endif %}"
    "{% endmacro %}{{ f(<K>) }}",
    "{% macro g(x) %}{{ g(x ~ x) }}{% endmacro %}{{ g(<S>) }}",
    "{% set x %}{% for i in range(<N>) %}<Y>{{ <E> }}{% endfor %}{% endset %}{{ x | length }}",
    "{% filter <F> %}{% for i in range(<N>) %}{{ <E> }}{% endfor %}{% endfilter %}",
    "{% for x in <R> recursive %}{{ loop(x.c if x.c is defined else []) }}{{ <E> }}{% endfor %}",
    "{% set a = [[<V>] * <N>] * <N> %}{% set b = [[<V>] * <N>] * <N> %}{{ <D> }}",
    "{% set ns = namespace(t=()) %}{% for i in range(<N>) %}{% for j in range(<N>) %}"
    "{% set ns.t = (ns.t,) %}{% endfor %}{% endfor %}{{ {ns.t: 1} | length }}",
]
_TOKENS = {
    "<E>": lambda rng: _expr(rng),
    "<V>": lambda rng: rng.choice(VALUES),
    "<S>": lambda rng: rng.choice(STRS),
    "<N>": lambda rng: rng.choice(SMALL),
    "<K>": lambda rng: rng.choice(["3", "20", "40", "100000"]),
    "<ACC>": lambda rng: rng.choice(["*", "+", "~", "**"]),
    "<RHS>": lambda rng: rng.choice(["ns.v", "2", "ns.v | length", "[ns.v]", "(ns.v,)"]),
    "<Y>": lambda rng: "y" * rng.choice([1, 100, 5000]),
    "<F>": lambda rng: rng.choice(["upper", "center(2000000000)", "indent(100000)", "wordwrap(1)"]),
    "<R>": lambda rng: rng.choice(RECURSIVE),
    "<D>": lambda rng: rng.choice(DAG_USES),
}
_TOKEN = re.compile("|".join(re.escape(t) for t in _TOKENS))


def _statement(rng: random.Random) -> str:
    return _TOKEN.sub(lambda m: _TOKENS[m.group()](rng), rng.choice(SHAPES))


def _real_templates() -> list[str]:
    root = os.environ.get("DEIMOS_TEST_DATA", str(Path.home() / ".cache/deimos/test-data"))
    paths = sorted(glob.glob(f"{root}/src/*/llama.cpp/models/templates/*.jinja"))
    return [Path(p).read_text("utf-8") for p in paths]


_BOUNDARY = re.compile(r"\{[{%]")
_CONTENT = re.compile(r"message(\.content|\[['\"]content['\"]\])")


def _mutate(rng: random.Random, src: str) -> str:
    """A real template with a hostile twist."""
    kind = rng.randrange(5)
    if kind == 0:  # a hostile statement at a random tag boundary
        cuts = [m.start() for m in _BOUNDARY.finditer(src)] or [0]
        at = rng.choice(cuts)
        return src[:at] + _statement(rng) + src[at:]
    if kind == 1:  # content through a hostile chain
        name, pats = rng.choice(FILTERS)
        args = _fill(rng, rng.choice(pats), 1)
        repl = f"(message\\1 | {name}({args}))" if args else f"(message\\1 | {name})"
        return _CONTENT.sub(repl, src, count=rng.randint(1, 3))
    if kind == 2:  # integers made huge
        return re.sub(r"(?<![\w.])\d+(?![\w.])", lambda m: _pick_num(rng) if rng.random() < 0.5
                      else m.group(), src)
    if kind == 3:  # more messages than the caller passed
        return src.replace("messages", f"(messages * {rng.choice(SMALL)})", rng.randint(1, 3))
    # a statement of the template repeated inside a loop
    cuts = [m.start() for m in _BOUNDARY.finditer(src)] or [0]
    at = rng.choice(cuts)
    return (src[:at] + f"{{% for _r in range({rng.choice(SMALL)}) %}}" + src[at:] +
            "{% endfor %}")


@dataclass(frozen=True)
class Case:
    source: str
    content: str
    with_tools: bool


def make_cases(seed: int, n: int) -> list[Case]:
    rng = random.Random(seed)
    real = _real_templates()
    cases = []
    for _ in range(n):
        if real and rng.random() < 0.3:
            src = _mutate(rng, rng.choice(real))
        else:
            src = _statement(rng)
        content = rng.choice(["hi", "x" * 100_000, "ab\n\t<é>" * 1000, "{{ '{}' }}%s"])
        cases.append(Case(src, content, rng.random() < 0.5))
    return cases


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]


# -- the worker process ------------------------------------------------------------------------


def _rss_peak_kb() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    return 0


def _rss_now_kb() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _worker(conn: mp.connection.Connection, time_s: float, cap_mb: int) -> None:
    from deimos.tokenizer.template import ChatTemplate, TemplateError, TemplateLimits

    limits = TemplateLimits(time_s=time_s)
    # a hard cap on the address space, so a runaway allocation fails here (MemoryError)
    # instead of taking the machine
    try:
        vm = int(open("/proc/self/statm").read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        cap = vm + cap_mb * 2**20 * 20
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    except (OSError, ValueError):
        pass
    while True:
        try:
            case = conn.recv()
        except EOFError:
            return
        msgs = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": case.content},
                {"role": "assistant", "content": "ok"}, {"role": "user", "content": "again"}]
        base = _rss_now_kb()
        exact = _reset_peak()
        t0 = time.perf_counter()
        try:
            t = ChatTemplate(case.source, "<s>", "</s>", limits=limits)
            t.render(msgs, tools=TOOLS if case.with_tools else None)
            kind, detail = "rendered", ""
        except TemplateError as exc:
            kind, detail = "error", str(exc)[:200]
        except MemoryError:
            kind, detail = "memory", "MemoryError"
        except BaseException as exc:  # noqa: BLE001 - this is what the fuzzer looks for
            kind, detail = "wrong", f"{type(exc).__name__}: {str(exc)[:200]}"
        elapsed = time.perf_counter() - t0
        peak_mb = (_rss_peak_kb() - base) / 1024 if exact else 0.0
        conn.send((kind, detail, elapsed, peak_mb))


class _Pool:
    """One worker process at a time; a new one after a crash or a kill."""

    def __init__(self, time_s: float, mem_mb: int) -> None:
        self.ctx = mp.get_context("spawn")
        self.time_s, self.mem_mb = time_s, mem_mb
        self.proc: mp.Process | None = None
        self.conn: mp.connection.Connection | None = None

    def _start(self) -> None:
        parent, child = self.ctx.Pipe()
        self.proc = self.ctx.Process(target=_worker, args=(child, self.time_s, self.mem_mb),
                                     daemon=True)
        self.proc.start()
        child.close()
        self.conn = parent

    def _stop(self) -> None:
        if self.proc is not None and self.proc.exitcode is None:
            self.proc.kill()
            self.proc.join()
        self.proc = self.conn = None

    def run(self, case: Case, kill_s: float) -> tuple[str, str, float, float]:
        if self.proc is None or not self.proc.is_alive():
            self._start()
        assert self.conn is not None and self.proc is not None
        t0 = time.perf_counter()
        try:
            self.conn.send(case)
            if self.conn.poll(kill_s):
                return self.conn.recv()
        except (EOFError, OSError):  # the worker died mid-case
            pass
        elapsed = time.perf_counter() - t0
        self.proc.join(0.5)
        code = self.proc.exitcode
        self._stop()
        if code is None:
            return "hang", f"killed after {kill_s:g} s", elapsed, 0.0
        return "crash", f"worker exit code {code}", elapsed, 0.0

    def close(self) -> None:
        self._stop()


@dataclass(frozen=True)
class Result:
    case: Case
    kind: str
    detail: str
    elapsed: float
    peak_mb: float


def run_round(seed: int, cases: int, *, time_s: float = 1.0, mem_mb: int = 100,
              slack_s: float = 1.5, kill_s: float | None = None,
              progress: int = 0) -> list[Result]:
    """Render ``cases`` generated cases; a case over ``2 * time_s + slack_s`` (a load probe
    and one render, each with its deadline) is a hang, one over ``mem_mb`` a memory case."""
    budget_s = 2 * time_s + slack_s
    kill_s = kill_s if kill_s is not None else max(10.0, 4 * budget_s)
    pool = _Pool(time_s, mem_mb)
    results = []
    try:
        for case in make_cases(seed, cases):
            kind, detail, elapsed, peak = pool.run(case, kill_s)
            if kind in ("rendered", "error") and elapsed > budget_s:
                kind, detail = "hang", f"{elapsed:.2f} s (budget {budget_s:.2f} s); {detail}"
            elif kind in ("rendered", "error") and peak > mem_mb:
                kind, detail = "memory", f"{peak:.0f} MB; {detail}"
            results.append(Result(case, kind, detail, elapsed, peak))
            if progress and len(results) % progress == 0:
                counts = Counter(r.kind for r in results)
                print(f"{len(results)} cases: {dict(counts)}", file=sys.stderr, flush=True)
    finally:
        pool.close()
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--time-s", type=float, default=1.0, help="the render deadline")
    ap.add_argument("--mem-mb", type=int, default=100)
    ap.add_argument("--show", type=int, default=3, help="examples printed per bad class")
    ap.add_argument("--progress", type=int, default=500, help="counts to stderr every N cases")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    results = run_round(args.seed, args.cases, time_s=args.time_s, mem_mb=args.mem_mb,
                        progress=args.progress)
    counts = Counter(r.kind for r in results)
    print(f"{args.cases} cases, seed {args.seed}, {time.perf_counter() - t0:.0f} s")
    print(f"{'class':10s} {'count':>7s}")
    for k in CLASSES:
        print(f"{k:10s} {counts.get(k, 0):7d}")
    slowest = max(results, key=lambda r: r.elapsed)
    print(f"slowest case {slowest.elapsed:.2f} s; largest peak "
          f"{max(r.peak_mb for r in results):.0f} MB")
    for k in BAD:
        for r in [r for r in results if r.kind == k][: args.show]:
            print(f"--- {k}: {r.detail}\n{r.case.source[:600]}")
    return 1 if any(counts.get(k) for k in BAD) else 0


if __name__ == "__main__":
    sys.exit(main())
