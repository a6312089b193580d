"""Test support for chat templates and stop tokens: model metadata, and the
expected outputs of llama.cpp's own chat-template test (tests/test-chat-template.cpp), parsed
from its C++ source so the oracle is llama.cpp's data, not ours."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from testdata import llama_cpp_path


def read_vocab(path: Path) -> tuple[dict[str, Any], list[str], Any]:
    """(metadata, tokens, token_types) of a GGUF file (a path checked by testdata) through
    deimos' reader."""
    from deimos.gguf import GGUFFile

    with GGUFFile(path) as f:
        md = dict(f.metadata)
    types = md.get("tokenizer.ggml.token_type")
    return md, list(md["tokenizer.ggml.tokens"]), None if types is None else types.copy()


# -- llama.cpp tests/test-chat-template.cpp ------------------------------------------------------

_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\", '"': '"', "'": "'", "0": "\0"}
_LITERAL = re.compile(r'(?:U8C\(\s*)?u?8?"((?:[^"\\]|\\.)*)"\s*\)?', re.S)


def _unescape(body: str) -> str:
    out, i = [], 0
    while i < len(body):
        c = body[i]
        if c == "\\":
            out.append(_ESCAPES[body[i + 1]])
            i += 2
        else:
            out.append(c)
            i += 1
    return "".join(out)


@dataclass
class LlamaChatCase:
    name: str
    template_str: str
    expected_output: str
    expected_output_jinja: str = ""
    bos_token: str = ""
    eos_token: str = ""
    supported_with_jinja: bool = True
    extra_conversation: list[tuple[str, str]] = field(default_factory=list)

    @property
    def expected(self) -> str:
        # as the C++ test: the jinja expectation when given, with \r\n normalized
        text = self.expected_output_jinja or self.expected_output
        return text.replace("\r\n", "\n")


# The conversation every case renders (main_automated_tests in test-chat-template.cpp).
LLAMA_CONVERSATION = [
    {"role": "system", "content": "You are a helpful assistant"},
    {"role": "user", "content": "Hello"},
    {"role": "assistant", "content": "Hi there"},
    {"role": "user", "content": "Who are you"},
    {"role": "assistant", "content": "   I am an assistant   "},
    {"role": "user", "content": "Another question"},
]


def llama_chat_cases() -> list[LlamaChatCase]:
    src = llama_cpp_path("tests/test-chat-template.cpp").read_text("utf-8")
    start = src.index("std::vector<TestCase> test_cases {")
    end = src.index("for (const auto & test_case : test_cases)", start)
    # whole-line // comments go; fields are marked /* .field= */ (one case omits the '=')
    region = "\n".join(
        line for line in src[start:end].split("\n") if not line.lstrip().startswith("//")
    )
    cases = []
    for chunk in re.split(r"/\* \.name=? \*/", region)[1:]:
        fields: dict[str, Any] = {}
        parts = ["name"] + re.split(r"/\* \.(\w+)=? \*/", chunk)
        for key, text in zip(parts[0::2], parts[1::2]):
            if key == "supported_with_jinja":
                fields[key] = text.strip().startswith("true")
            elif key == "extra_conversation":
                lits = [_unescape(m.group(1)) for m in _LITERAL.finditer(text.split("\n")[0])]
                fields[key] = list(zip(lits[0::2], lits[1::2]))
            else:
                # adjacent literals up to the field's trailing comma
                text = text.split("\n        }")[0]
                fields[key] = "".join(_unescape(m.group(1)) for m in _LITERAL.finditer(text))
        cases.append(LlamaChatCase(**fields))
    return cases
