"""Our chat-template rendering against llama.cpp's (its Jinja engine, through llama-server's
/apply-template): every template of llama.cpp's models/templates, a few conversations each,
the rendered prompts compared character for character.

    LD_LIBRARY_PATH=DIR python tools/diff_templates.py DIR/llama-server MODEL.gguf [--only NAME]

MODEL: any small GGUF whose vocabulary gives both sides the same bos/eos texts (a `deimos
synth` tiny model). Each template starts its own llama-server (`--jinja
--chat-template-file`, loopback, a free port); the conversations: a system prompt and two user
turns around an assistant's answer, a single user turn, and the first with one tool in the
request. Prints one line a template (same / differs at character N with both sides' text
there / llama.cpp refused). An instrument, not a test: llama.cpp is not a dependency.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tools"), str(REPO / "tests")]

from llama_server import LlamaServer, first_difference  # noqa: E402
from testdata import LLAMA_CPP, data_dir  # noqa: E402

from deimos.gguf import GGUFFile  # noqa: E402
from deimos.tokenizer import Tokenizer  # noqa: E402
from deimos.tokenizer.template import ChatTemplate  # noqa: E402

CHAT = [{"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Hi there, who are you?"},
        {"role": "assistant", "content": "I am an assistant. How can I help?"},
        {"role": "user", "content": "Tell me a joke about  spaces\nand newlines."}]
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                         "parameters": {"type": "object", "properties": {
                                             "city": {"type": "string"}}, "required": ["city"]}}}
CASES = [("chat", CHAT, None), ("one turn", CHAT[1:2], None), ("tools", CHAT, [TOOL])]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("server")
    ap.add_argument("model")
    ap.add_argument("--only", default="", help="a substring of the template names to run")
    a = ap.parse_args()
    with GGUFFile(a.model) as f:
        v = Tokenizer.from_gguf(f).vocab
    bos = v.tokens[v.bos_id] if v.bos_id is not None else ""
    eos = v.tokens[v.eos_id] if v.eos_id is not None else ""
    differ = 0
    for path in sorted((data_dir() / LLAMA_CPP / "models" / "templates").glob("*.jinja")):
        if a.only and a.only not in path.name:
            continue
        src = path.read_text()
        with LlamaServer(a.server, a.model, "--chat-template-file", str(path), "-c", "256") as srv:
            try:
                ours_t = ChatTemplate(src, bos_token=bos, eos_token=eos)
            except Exception as e:  # noqa: BLE001 - reported, the next template goes on
                print(f"{path.name}: ours refused to compile: {type(e).__name__}: {e}")
                continue
            for label, msgs, tools in CASES:
                status, theirs = srv.post("/apply-template",
                                          {"messages": msgs, **({"tools": tools} if tools else {})})
                theirs = theirs["prompt"] if status == 200 else theirs
                try:
                    ours = ours_t.render(msgs, add_generation_prompt=True,
                                         **({"tools": tools} if tools else {}))
                except Exception as e:  # noqa: BLE001
                    ours = f"<error {type(e).__name__}: {e}>"
                if status != 200:
                    print(f"{path.name} [{label}]: llama.cpp {status}: {theirs[:100]!r}; ours "
                          f"{'rendered' if not ours.startswith('<error') else ours[:100]}")
                    continue
                if ours == theirs:
                    print(f"{path.name} [{label}]: same ({len(ours)} chars)")
                    continue
                differ += 1
                at = first_difference(ours, theirs)
                print(f"{path.name} [{label}]: DIFFERS at {at} of {len(ours)}/{len(theirs)}: ours "
                      f"{ours[max(0, at - 30):at + 40]!r}\n      llama.cpp {theirs[max(0, at - 30):at + 40]!r}")
    print(f"{differ} renderings differ")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
