"""The fixed parts of the recorded agent sessions (deimos.bench.sessions): a coding agent's
system prompt, its 20 tool schemas, and the source files it reads.

The sources are files of the Python standard library of the Python running the generator, so
the generator runs anywhere; the sessions it writes are byte-identical wherever the same
stdlib files are read (the manifest records each file's sha256 and the Python version). Paths
are shown as in CPython's repository (``Lib/textwrap.py``): the scripted agent works on
CPython's ``Lib/``.
"""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

SYSTEM_PARAGRAPHS = (
    ("You are Forge, a coding agent working in the user's repository through the tools below. "
     "You read code before you change it, make the smallest change that solves the task, and "
     "run the tests after every change. Answer in the user's language; be brief."),
    ("# Working rules\n"
     "- Never guess a file's contents: read it (read_file, with offset and limit for large "
     "files) or search it (grep, glob, search_symbols) first.\n"
     "- Edit with edit_file: old_string must match the file exactly, whitespace included, and "
     "occur once; give enough surrounding lines to make it unique. Use write_file only for new "
     "files or complete rewrites.\n"
     "- Keep the existing style: naming, indentation, docstring conventions, import order. Do "
     "not reformat code you did not change.\n"
     "- After an edit, run the narrowest test that covers it (run_tests with a path or a -k "
     "expression), then the module's whole test file before you finish.\n"
     "- A failing test is information: read its traceback, find the line in the source, and "
     "fix the cause, not the symptom. Do not weaken or delete tests to make them pass.\n"
     "- Run commands only inside the repository. Never push, never rewrite history, never "
     "delete files you did not create unless the user asks."),
    ("# Output\n"
     "- When you quote code, quote it exactly, in a fenced block with the language, and name "
     "the file and line range.\n"
     "- When you finish, summarize what changed and why in a few lines, list the files "
     "touched, and say which tests you ran and their result.\n"
     "- If the task is ambiguous or a change would be risky (public API, data formats, "
     "security), stop and ask with ask_user."),
    ("# Repository\n"
     "The repository is CPython. Library code lives in Lib/, its tests in Lib/test/. Tests "
     "run with `python -m pytest` from the root; the interpreter is already built. The default "
     "branch is main; commit with git_commit only when the user asks."),
)


def _fn(name: str, description: str, properties: dict[str, Any],
        required: tuple[str, ...] = ()) -> dict[str, Any]:
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": properties,
                       "required": list(required), "additionalProperties": False}}}


def _s(description: str, **extra: Any) -> dict[str, Any]:
    return {"type": "string", "description": description, **extra}


def _i(description: str, **extra: Any) -> dict[str, Any]:
    return {"type": "integer", "description": description, **extra}


def _b(description: str) -> dict[str, Any]:
    return {"type": "boolean", "description": description}


PATH = _s("Path relative to the repository root, e.g. Lib/textwrap.py")

TOOLS: tuple[dict[str, Any], ...] = (
    _fn("read_file", "Read a text file. Lines come back numbered (cat -n). Large files: read "
        "a window with offset and limit; at most 2000 lines per call.",
        {"path": PATH, "offset": _i("First line to read, 1-based", minimum=1),
         "limit": _i("Number of lines to read", minimum=1, maximum=2000)}, ("path",)),
    _fn("write_file", "Create a file or overwrite it completely with the given content. "
        "Prefer edit_file for changes to existing files.",
        {"path": PATH, "content": _s("The whole new content of the file")},
        ("path", "content")),
    _fn("edit_file", "Replace an exact string in a file. old_string must occur exactly once "
        "unless replace_all is true; include enough context to make it unique.",
        {"path": PATH, "old_string": _s("The exact text to replace, whitespace included"),
         "new_string": _s("The replacement text"),
         "replace_all": _b("Replace every occurrence instead of exactly one")},
        ("path", "old_string", "new_string")),
    _fn("multi_edit", "Several edit_file replacements in one file, applied in order, all or "
        "none.",
        {"path": PATH, "edits": {"type": "array", "description": "The replacements", "items": {
            "type": "object", "properties": {"old_string": _s("Exact text to replace"),
                                             "new_string": _s("Replacement")},
            "required": ["old_string", "new_string"]}}}, ("path", "edits")),
    _fn("list_dir", "List a directory: names, with / after subdirectories.",
        {"path": PATH, "depth": _i("How many levels to descend", minimum=1, maximum=4)},
        ("path",)),
    _fn("glob", "Find files whose path matches a glob pattern, newest first.",
        {"pattern": _s("A glob such as Lib/**/*.py"), "path": _s("Directory to search in")},
        ("pattern",)),
    _fn("grep", "Search file contents with a regular expression (ripgrep syntax). Prints "
        "path:line:text for each match.",
        {"pattern": _s("The regular expression"), "path": _s("File or directory to search"),
         "glob": _s("Only files matching this glob, e.g. *.py"),
         "context": _i("Lines of context around each match", minimum=0, maximum=20),
         "ignore_case": _b("Case-insensitive search"),
         "max_results": _i("Stop after this many matches", minimum=1)}, ("pattern",)),
    _fn("search_symbols", "Find definitions of a class, function or variable by name across "
        "the repository (an index of Python definitions).",
        {"name": _s("The symbol's name or a prefix"),
         "kind": _s("Limit to one kind", enum=["class", "function", "method", "variable"])},
        ("name",)),
    _fn("find_references", "Find the places that use a symbol defined at a given location.",
        {"path": PATH, "line": _i("Line of the definition", minimum=1),
         "name": _s("The symbol's name")}, ("path", "name")),
    _fn("run_tests", "Run tests with pytest and return its output (truncated to the last "
        "400 lines).",
        {"path": _s("Test file or directory; default: the whole suite"),
         "keyword": _s("A -k expression selecting tests"),
         "fail_fast": _b("Stop at the first failure (-x)"),
         "verbose": _b("One line per test (-v)")}),
    _fn("run_command", "Run a shell command in the repository root and return its exit code, "
        "stdout and stderr. No interactive commands; 120 s limit.",
        {"command": _s("The command line"),
         "timeout": _i("Seconds before the command is killed", minimum=1, maximum=600)},
        ("command",)),
    _fn("python_eval", "Evaluate a short Python snippet with the repository's interpreter and "
        "return what it prints.",
        {"code": _s("The code; print what you want to see")}, ("code",)),
    _fn("lint", "Run the linter (ruff check) on files and return its findings.",
        {"paths": {"type": "array", "items": {"type": "string"}, "description": "Files"},
         "fix": _b("Apply safe fixes")}, ("paths",)),
    _fn("git_status", "Show the working tree's status (git status --short).", {}),
    _fn("git_diff", "Show unstaged changes (git diff), optionally for some paths only.",
        {"paths": {"type": "array", "items": {"type": "string"}, "description": "Paths"},
         "staged": _b("Show staged changes instead")}),
    _fn("git_log", "Show recent commits touching a path.",
        {"path": _s("A path; default: the whole repository"),
         "max_count": _i("How many commits", minimum=1, maximum=50)}),
    _fn("git_commit", "Commit the given paths with a message. Only when the user asks.",
        {"message": _s("The commit message"),
         "paths": {"type": "array", "items": {"type": "string"}, "description": "Paths"}},
        ("message", "paths")),
    _fn("todo_write", "Replace the task list shown to the user.",
        {"todos": {"type": "array", "description": "The tasks", "items": {
            "type": "object", "properties": {
                "content": _s("What to do"),
                "status": _s("Its state", enum=["pending", "in_progress", "done"])},
            "required": ["content", "status"]}}}, ("todos",)),
    _fn("web_fetch", "Fetch a documentation page and return it as text.",
        {"url": _s("An https URL"), "max_chars": _i("Truncate after this many characters",
                                                     minimum=100)}, ("url",)),
    _fn("ask_user", "Ask the user a question and wait for the answer.",
        {"question": _s("The question"),
         "options": {"type": "array", "items": {"type": "string"},
                     "description": "Suggested answers"}}, ("question",)),
)

# files the scripted agent works on, relative to the stdlib; those missing in this Python are
# left out (their list goes into the manifest)
SOURCE_FILES = (
    "textwrap.py", "shlex.py", "fnmatch.py", "glob.py", "heapq.py", "bisect.py",
    "statistics.py", "difflib.py", "json/encoder.py", "json/decoder.py", "csv.py",
    "configparser.py", "argparse.py", "dataclasses.py", "functools.py", "tokenize.py",
    "fractions.py", "ipaddress.py", "shutil.py", "tempfile.py", "base64.py", "pprint.py",
    "queue.py", "contextlib.py", "copy.py", "string.py", "calendar.py", "gettext.py",
    "sched.py", "selectors.py", "locale.py", "mimetypes.py", "netrc.py", "plistlib.py",
    "urllib/parse.py", "email/utils.py", "html/parser.py", "http/cookies.py", "graphlib.py",
    "colorsys.py", "filecmp.py", "linecache.py", "numbers.py", "operator.py", "reprlib.py",
    "secrets.py", "stringprep.py", "timeit.py", "zipapp.py", "weakref.py",
)


@dataclass(frozen=True)
class Source:
    rel: str  # relative to the stdlib
    text: str
    sha256: str

    @property
    def path(self) -> str:
        """As the agent names it: CPython's repository layout."""
        return f"Lib/{self.rel}"

    @property
    def lines(self) -> list[str]:
        return self.text.splitlines()


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


@cache
def sources() -> tuple[Source, ...]:
    """The SOURCE_FILES this Python has, in list order."""
    out = []
    root = stdlib_dir()
    for rel in SOURCE_FILES:
        p = root / rel
        if not p.is_file():
            continue
        data = p.read_bytes()
        out.append(Source(rel, data.decode("utf-8"), hashlib.sha256(data).hexdigest()))
    if len(out) < 8:
        raise RuntimeError(f"sessions: only {len(out)} of the source files exist under {root}")
    return tuple(out)
