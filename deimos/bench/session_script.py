"""The scripted coding agent whose sessions deimos.bench.sessions records.

Every shape works on the standard library's sources (deimos.bench.session_parts) as if it
were CPython's ``Lib/``: what it reads is the real text, numbered as ``cat -n``; what it
quotes, edits and writes back is that text (with small changes), so later answers re-emit code
that is already in the prompt, as a real agent's do; test output and diffs cite the real lines.
"""

from __future__ import annotations

import ast
import difflib
import random
import re
from dataclasses import dataclass, field

from deimos.bench.session_parts import Source, sources
from deimos.bench.sessions import (
    Recorder,
    Sizes,
    assistant,
    est_tokens,
    message_tokens,
    tool_result,
    user,
)

# ---- the material: functions of a file, numbered windows -----------------------------------


@dataclass(frozen=True)
class Func:
    name: str
    start: int  # the def line, 1-based
    end: int  # its last line, 1-based
    insert_at: int  # 0-based line index where a check goes (after the docstring)
    indent: str
    param: str
    owner: str | None  # the enclosing class
    docstring: bool


def functions(text: str) -> list[Func]:
    """Functions and methods with a positional parameter (not self/cls), at least five lines
    long, whose first statement (after any docstring) is within 30 lines of the def."""
    out = []

    def visit(node: ast.AST, owner: str | None) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                visit(child, child.name)
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                f = _func(child, owner)
                if f is not None:
                    out.append(f)
                visit(child, owner)

    visit(ast.parse(text), None)
    return sorted(out, key=lambda f: f.start)


def _func(node: ast.FunctionDef | ast.AsyncFunctionDef, owner: str | None) -> Func | None:
    args = [a.arg for a in node.args.posonlyargs + node.args.args if a.arg not in ("self", "cls")]
    body = node.body
    if not args or node.end_lineno is None or node.end_lineno - node.lineno < 4:
        return None
    first = body[0]
    doc = (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
           and isinstance(first.value.value, str))
    if doc and len(body) < 2:
        return None
    nxt = body[1] if doc else first
    if nxt.lineno <= node.lineno or nxt.lineno - node.lineno > 30:
        return None
    insert_at = first.end_lineno if doc else first.lineno - 1
    return Func(node.name, node.lineno, node.end_lineno, insert_at, " " * nxt.col_offset,
                args[0], owner, doc)


def numbered(lines: list[str], start: int) -> str:
    """Lines as read_file shows them (cat -n); ``start`` is the first one's number."""
    return "\n".join(f"{start + i:6}\t{line}" for i, line in enumerate(lines))


def test_path(src: Source) -> str:
    return "Lib/test/test_" + src.rel.removesuffix(".py").replace("/", "_") + ".py"


def module(src: Source) -> str:
    return src.rel.removesuffix(".py").replace("/", ".")


# ---- multi-turn: grep, read, quote and edit, test, fix, review -----------------------------


@dataclass
class EditedFile:
    src: Source
    lines: list[str]  # the current text
    edits: list[tuple[Func, list[str]]] = field(default_factory=list)  # (func, the check)


def _guard(f: Func, exc: str) -> list[str]:
    return [f"{f.indent}if {f.param} is None:",
            f"{f.indent}    raise {exc}(\"{f.name}() argument '{f.param}' must not be None\")"]


def _unique(lines: list[str], lo: int, hi: int) -> tuple[int, int]:
    """Grow [lo, hi) downwards until its text occurs once in the file."""
    text = "\n".join(lines)
    while "\n".join(lines[lo:hi]) and text.count("\n".join(lines[lo:hi])) > 1 and hi < len(lines):
        hi += 1
    return lo, hi


def _grep(rec: Recorder, pattern: str, files: list[Source], limit: int = 20) -> str:
    rx = re.compile(pattern)
    hits = []
    for s in files:
        rec.read.add(s.rel)
        for i, line in enumerate(s.lines, 1):
            if rx.search(line):
                hits.append(f"{s.path}:{i}:{line.rstrip()[:200]}")
    if not hits:
        return "No matches."
    more = f"\n[{len(hits) - limit} more matches]" if len(hits) > limit else ""
    return "\n".join(hits[:limit]) + more


def _pytest_head(n: int) -> str:
    return ("============================= test session starts ==============================\n"
            "platform linux -- Python 3.12.3, pytest-8.3.4, pluggy-1.5.0\n"
            "rootdir: /home/dev/cpython\nconfigfile: pyproject.toml\n"
            f"collected {n} items\n\n")


def _progress(path: str, n: int, fail_at: int | None) -> str:
    marks = "".join("F" if i == fail_at else "." for i in range(n))
    return f"{path} {marks}{' ' * max(1, 74 - len(path) - n)}[100%]\n"


def _failing_tests(ef: EditedFile, f: Func, rng: random.Random) -> str:
    """pytest's long report of a test expecting ValueError that got the check's TypeError: the
    module frame shows the function's real source down to the raise."""
    src = ef.src
    n = rng.randint(20, 90)
    fail_at = rng.randrange(n)
    cls = f"Test{f.owner or module(src).split('.')[-1].title().replace('_', '')}"
    test = f"test_{f.name.strip('_')}_rejects_none"
    tpath = test_path(src)
    tline = rng.randint(40, 900)
    call = f"{f.name}(None)" if f.owner is None else f"self.obj.{f.name}(None)"
    raise_line = f.insert_at + 2  # 1-based: the check's second line
    frame = ef.lines[f.start - 1:raise_line]
    body = "\n".join(("    " if i < len(frame) - 1 else ">   ") + line
                     for i, line in enumerate(frame))
    bar = "_" * 20
    msg = f"{f.name}() argument '{f.param}' must not be None"
    return (_pytest_head(n) + _progress(tpath, n, fail_at) + "\n"
            "=================================== FAILURES ===================================\n"
            f"{bar} {cls}.{test} {bar}\n\n"
            f"self = <test.{tpath[9:-3]}.{cls} testMethod={test}>\n\n"
            f"    def {test}(self):\n        with self.assertRaises(ValueError):\n"
            f">           {call}\n\n{tpath}:{tline}: \n" + "_ " * 40 + "\n\n"
            f"{body}\nE       TypeError: {msg}\n\n{src.path}:{raise_line}: TypeError\n"
            "=========================== short test summary info ============================\n"
            f"FAILED {tpath}::{cls}::{test} - TypeError: {msg}\n"
            f"========================= 1 failed, {n - 1} passed in "
            f"{rng.uniform(0.2, 3.0):.2f}s =========================")


def _passing_tests(src: Source, rng: random.Random) -> str:
    n = rng.randint(20, 90)
    return (_pytest_head(n) + _progress(test_path(src), n, None) + "\n"
            f"============================== {n} passed in {rng.uniform(0.2, 3.0):.2f}s "
            "==============================")


def _snippet(lines: list[str], lo: int, hi: int) -> str:
    lo, hi = max(0, lo), min(len(lines), hi)
    return numbered(lines[lo:hi], lo + 1)


def _episode(rec: Recorder, ef: EditedFile, f: Func, others: list[Source], sizes: Sizes,
             budget: int, rng: random.Random) -> None:
    """grep (sometimes), read a window around ``f``, quote and edit it, run the tests; when
    they fail, fix the edit and run them again."""
    src, path = ef.src, ef.src.path
    rec.read.add(src.rel)
    if rng.random() < 0.6:
        c = rec.call("grep", pattern=rf"\b{f.name}\b", path="Lib/", glob="*.py", max_results=20)
        rec.turn(assistant(f"Let me see where `{f.name}` is defined and used.", c),
                 tool_result(c, _grep(rec, rf"\b{f.name}\b", [src, *others])))
    lo, hi = sizes.read_tokens
    want = max(lo, min(rng.randint(lo, hi), budget))
    k = rng.randint(1, 4)
    first = max(0, f.start - 1 - rng.randint(3, 40))
    last = min(len(ef.lines), f.insert_at + k + 1)
    while last < len(ef.lines) and est_tokens(numbered(ef.lines[first:last], first + 1)) < want:
        last += 1
    while first > 0 and est_tokens(numbered(ef.lines[first:last], first + 1)) < want:
        first -= 1  # the file ended first: start earlier
    c = rec.call("read_file", path=path, offset=first + 1, limit=last - first)
    rec.turn(assistant(f"I'll read `{path}` around `{f.name}` (line {f.start}).", c),
             tool_result(c, numbered(ef.lines[first:last], first + 1)))

    # quote the function's head, then insert the check after its docstring
    a, b = _unique(ef.lines, f.start - 1, min(f.insert_at + k, f.end))
    old = ef.lines[a:b]
    guard = _guard(f, "TypeError")
    new = ef.lines[a:f.insert_at] + guard + ef.lines[f.insert_at:b]
    c = rec.call("edit_file", path=path, old_string="\n".join(old), new_string="\n".join(new))
    who = f"`{f.owner}.{f.name}`" if f.owner else f"`{f.name}`"
    rec.turn(assistant(
        f"{who} ({path}, lines {a + 1}-{b}) never checks `{f.param}`:\n\n```python\n"
        + "\n".join(old) + f"\n```\n\nA None `{f.param}` only fails further down, with an "
        f"error that does not name the argument. I'll check it "
        + ("right after the docstring." if f.docstring else "first thing in the body."), c),
        tool_result(c, f"The file {path} has been updated. Here's the result of running "
                       f"`cat -n` on a snippet of the edited file:\n"
                       + _snippet(ef.lines[:a] + new + ef.lines[b:], a - 3, b + len(guard) + 3)))
    ef.lines[a:b] = new
    ef.edits.append((f, guard))

    c = rec.call("run_tests", path=test_path(src), keyword=f.name, fail_fast=True)
    if rng.random() < 0.5:  # the tests want ValueError: fix the check, run them again
        rec.turn(assistant("Now the tests for it.", c),
                 tool_result(c, _failing_tests(ef, f, rng)))
        fixed = _guard(f, "ValueError")
        at = f.insert_at
        c = rec.call("edit_file", path=path, old_string="\n".join(guard),
                     new_string="\n".join(fixed))
        rec.turn(assistant(
            f"The test expects ValueError, which is what the rest of `{module(src)}` raises "
            "for bad argument values. The check now reads:\n\n```python\n"
            + "\n".join(ef.lines[f.start - 1:at] + fixed) + "\n```", c),
            tool_result(c, f"The file {path} has been updated. Here's the result of running "
                           "`cat -n` on a snippet of the edited file:\n"
                           + _snippet(ef.lines[:at] + fixed + ef.lines[at + 2:], at - 3, at + 5)))
        ef.lines[at:at + 2] = fixed
        ef.edits[-1] = (f, fixed)
        c = rec.call("run_tests", path=test_path(src), fail_fast=True)
        rec.turn(assistant("Running the whole test file again.", c),
                 tool_result(c, _passing_tests(src, rng)))
    else:
        rec.turn(assistant("Now the tests for it.", c), tool_result(c, _passing_tests(src, rng)))
    if rng.random() < 0.4:
        c = rec.call("lint", paths=[path])
        rec.turn(assistant("And the linter on the file.", c),
                 tool_result(c, "All checks passed!"))


def _diff(files: list[EditedFile]) -> str:
    parts = []
    for ef in files:
        p = ef.src.path
        parts.append(f"diff --git a/{p} b/{p}\n" + "\n".join(difflib.unified_diff(
            ef.src.lines, ef.lines, f"a/{p}", f"b/{p}", lineterm="", n=3)))
    return "\n".join(parts)


def _pick(rng: random.Random, pool: list[Source]) -> tuple[Source, Func]:
    """A file of the pool (removed from it) and one of its functions."""
    while pool:
        src = pool.pop(rng.randrange(len(pool)))
        funcs = functions(src.text)
        if funcs:
            return src, rng.choice(funcs)
    raise RuntimeError("sessions: the source files ran out")


def multi_turn(rec: Recorder, sizes: Sizes, rng: random.Random) -> None:
    """Episodes over one file each until the prompt nears ``prompt_tokens``, then the review
    of the whole diff and the summary."""
    pool = list(sources())
    src, f = _pick(rng, pool)
    rec.add(user(
        f"In `{src.path}`, `{f.name}()` accepts None for `{f.param}` and only fails later with "
        "an error that does not say what was wrong. Make it reject None up front with a clear "
        "message, run its tests, and tell me what you changed. There are a few more of these; "
        "I'll send them one at a time."))
    c = rec.call("todo_write", todos=[
        {"content": f"Read {f.name} in {src.path}", "status": "in_progress"},
        {"content": f"Check {f.param} up front", "status": "pending"},
        {"content": f"Run {test_path(src)}", "status": "pending"}])
    rec.turn(assistant("I'll plan this first.", c), tool_result(c, "Todos updated."))
    edited: list[EditedFile] = []
    reserve = 250 + sizes.answer_tokens  # the diff review and the summary
    while True:
        ef = EditedFile(src, src.lines)
        edited.append(ef)
        others = [pool[rng.randrange(len(pool))] for _ in range(3)] if pool else []
        budget = sizes.prompt_tokens - rec.tokens - reserve - 400
        _episode(rec, ef, f, others, sizes, budget, rng)
        reserve = 250 + est_tokens(_diff(edited)) + 60 * len(edited)
        room = sizes.prompt_tokens - rec.tokens - reserve
        if room < sizes.read_tokens[0] + 450 and len(rec.requests) + 2 >= sizes.min_turns:
            break
        src, f = _pick(rng, pool)
        rec.add(user(
            f"Thanks. `{src.path}` has the same problem: `{f.name}()` takes a None "
            f"`{f.param}` without complaint. Fix it the same way and run its tests."))
    c = rec.call("git_diff")
    rec.turn(assistant("All tests pass. Let me review the whole diff.", c),
             tool_result(c, _diff(edited)))
    lines = ["Done. Every function now rejects a None argument up front:\n"]
    for ef in edited:
        for func, guard in ef.edits:
            lines.append(f"- `{ef.src.path}`, `{func.name}()`:\n```python\n"
                         + "\n".join(guard) + "\n```")
    lines.append("\nTests: " + ", ".join(f"`{test_path(ef.src)}`" for ef in edited)
                 + " pass; lint is clean.")
    rec.turn(assistant("\n".join(lines)))


# ---- long prompt: whole files as one document, two questions -------------------------------


def _quote(src: Source, f: Func, tokens: int) -> str:
    """An answer of about ``tokens`` that quotes ``f``'s source (cut to fit) and explains."""
    head = f"`{f.name}` is defined in `{src.path}` (line {f.start}):\n\n```python\n"
    tail = (f"\n```\n\nIt takes `{f.param}` first and does not check it: a None `{f.param}` "
            "only fails where it is first used, with an error that does not name it.")
    body = src.lines[f.start - 1:f.end]
    while body and est_tokens(head + "\n".join(body) + tail) > tokens:
        body.pop()
    return head + "\n".join(body) + tail


def long_prompt(rec: Recorder, sizes: Sizes, rng: random.Random) -> None:
    """Whole source files, concatenated until ``prompt_tokens``, the last one cut at a line;
    a question on one function, then a follow-up on another."""
    pool = list(sources())
    rng.shuffle(pool)
    parts: list[str] = []
    used: list[tuple[Source, int]] = []  # (file, lines of it in the document)
    size = 0
    for src in pool:
        part = f"### {src.path}\n\n```python\n{src.text.rstrip()}\n```\n"
        if size + est_tokens(part) > sizes.prompt_tokens:
            lines = src.lines
            while lines and size + est_tokens(f"### {src.path}\n\n```python\n"
                                              + "\n".join(lines) + "\n```\n") > sizes.prompt_tokens:
                lines = lines[:max(0, len(lines) - max(1, len(lines) // 8))]
            if lines:
                part = f"### {src.path} (first {len(lines)} lines)\n\n```python\n" \
                       + "\n".join(lines) + "\n```\n"
                parts.append(part)
                used.append((src, len(lines)))
            break
        parts.append(part)
        used.append((src, len(src.lines)))
        size += est_tokens(part)
    for s, _ in used:
        rec.read.add(s.rel)
    asked = [(s, f) for s, n in used for f in functions(s.text) if f.end <= n]
    long = [(s, f) for s, f in asked if f.end - f.start >= 25]  # answers that fill their length
    (s1, f1), (s2, f2) = rng.sample(long if len(long) >= 2 else asked, 2)
    rec.add(user(
        f"Below are {len(used)} modules from Lib/.\n\n" + "\n".join(parts)
        + f"\nQuestion: what does `{f1.name}` in `{s1.path}` do with its `{f1.param}` "
          "argument, and what happens if it is None? Quote the code."))
    rec.turn(assistant(_quote(s1, f1, sizes.answer_tokens)),
             user(f"And `{f2.name}` in `{s2.path}`: same question."))
    rec.turn(assistant(_quote(s2, f2, sizes.answer_tokens)))


# ---- long decode: whole windows written back, 2k tokens an answer --------------------------


def _modernized(lines: list[str]) -> list[str]:
    """The rewrite an answer writes back: the window, with ``-> None`` on ``__init__``s and
    %-formatting of one name turned into an f-string where the line is that simple."""
    out = ["from __future__ import annotations", ""]
    for line in lines:
        m = re.match(r"^(\s*def __init__\(.*\)):\s*$", line)
        if m and "->" not in line:
            line = f"{m.group(1)} -> None:"
        m = re.match(r"""^(.*)(['"])([^'"{}%]*)%s([^'"{}%]*)\2 % (\w+)(.*)$""", line)
        if m:
            pre, q, a, b, name, post = m.groups()
            line = f"{pre}f{q}{a}{{{name}}}{b}{q}{post}"
        out.append(line)
    return out


def _window(src: Source, rng: random.Random, tokens: int) -> tuple[int, list[str]]:
    """(first line, lines): a window of about ``tokens`` starting at a top-level def/class."""
    lines = src.lines
    starts = [i for i, x in enumerate(lines) if x.startswith(("def ", "class "))
              and est_tokens("\n".join(lines[i:])) >= tokens] or [0]
    first = rng.choice(starts)
    last = first
    while last < len(lines) and est_tokens("\n".join(lines[first:last])) < tokens:
        last += 1
    return first, lines[first:last]


def _write_answer(rec: Recorder, src: Source, window: list[str], nxt: dict | None,
                  limit: int) -> tuple[dict, int]:
    """The answer writing ``window`` back modernized (cut so that it fits ``limit`` tokens),
    with the next read when ``nxt`` is given; and how many window lines it kept."""
    keep = len(window)
    while True:
        c = rec.call("write_file", path=src.path, content="\n".join(_modernized(window[:keep])))
        calls = [c] + ([nxt] if nxt else [])
        a = assistant(f"Here is `{src.path}` with `from __future__ import annotations` and the "
                      "small modernizations, written back whole.", *calls)
        if message_tokens(a) <= limit or keep <= 1:
            return a, keep
        over = message_tokens(a) - limit
        keep = max(1, keep - max(1, over // 12))


def long_decode(rec: Recorder, sizes: Sizes, rng: random.Random) -> None:
    """Each answer writes back the window just read (``decode_tokens`` long) and reads the
    next, until the prompt would pass ``prompt_tokens``."""
    limit = sizes.decode_tokens  # the answers' estimated length, overhead included
    pool = [s for s in sources() if est_tokens(s.text) >= 2 * limit]  # a window fits
    rng.shuffle(pool)

    def fitted(src: Source) -> tuple[int, list[str]]:
        first, window = _window(src, rng, limit)
        # the next read's call is not known yet: one at least as long stands in for it
        stand_in = rec.call("read_file", path="Lib/" + "x" * 24, offset=99999, limit=9999)
        _, keep = _write_answer(rec, src, window, stand_in, limit)
        return first, window[:keep]

    src = pool.pop()
    rec.read.add(src.rel)
    first, window = fitted(src)
    rec.add(user(
        "Modernize these modules one at a time: add `from __future__ import annotations`, "
        "annotate `__init__` with `-> None`, and turn simple %-formatting into f-strings. "
        f"Write each one back whole with write_file. First `{src.path}`, from line "
        f"{first + 1}:\n\n```python\n" + "\n".join(window) + "\n```"))
    while True:
        nxt_src = pool.pop()
        n_first, n_window = fitted(nxt_src)
        read = numbered(n_window, n_first + 1)
        rd = rec.call("read_file", path=nxt_src.path, offset=n_first + 1, limit=len(n_window))
        answer, _ = _write_answer(rec, src, window, rd, limit)
        wrote = tool_result(answer["tool_calls"][0], f"Wrote {len(window) + 2} lines to {src.path}.")
        got = tool_result(rd, read)
        grow = message_tokens(answer) + message_tokens(wrote) + message_tokens(got)
        if rec.tokens + grow > sizes.prompt_tokens or not pool:
            break
        rec.read.add(nxt_src.rel)
        rec.turn(answer, wrote, got)
        src, first, window = nxt_src, n_first, n_window
    answer, _ = _write_answer(rec, src, window, None, limit)
    rec.turn(answer)
