"""A chat prompt's token ids against llama.cpp's: random conversations through
``LLM.encode_chat`` and through llama-server (``/apply-template`` then ``/tokenize`` with
special tokens parsed), the ids compared.

    LD_LIBRARY_PATH=DIR python tools/diff_chat_tokens.py DIR/llama-server MODEL.gguf [--n 300]

Contents are ``tools/fuzz_tokenizer.py``'s random texts without special-token text (where
Deimos keeps it plain and llama.cpp parses it); conversations of 1-4 alternating turns ending
on a user turn. Prints each conversation whose ids differ (and whether the rendered texts do:
a model without a template gets a different default in each engine). An instrument, not a test.
"""

from __future__ import annotations

import argparse
import json
import random
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tools")]

from fuzz_tokenizer import random_text  # noqa: E402

from deimos.engine import LLM  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("server")
    ap.add_argument("model")
    ap.add_argument("--n", type=int, default=300, help="conversations")
    ap.add_argument("--seed", type=int, default=5)
    a = ap.parse_args()
    llm = LLM(a.model, n_ctx=512)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([a.server, "-m", a.model, "--port", str(port), "--jinja", "-c", "512"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def post(path: str, body: dict) -> dict:
        req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        return json.loads(urllib.request.urlopen(req, timeout=30).read())

    rng, bad = random.Random(a.seed), 0
    try:
        for _ in range(100):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
                break
            except OSError:
                time.sleep(0.2)
        for _ in range(a.n):
            msgs = []
            for j in range(rng.randint(1, 4)):
                c = random_text(rng, [])
                msgs.append({"role": "user" if j % 2 == 0 else "assistant", "content": c if c.strip() else "x" + c})
            if msgs[-1]["role"] != "user":
                msgs.append({"role": "user", "content": "ok"})
            prompt = post("/apply-template", {"messages": msgs})["prompt"]
            theirs = post("/tokenize", {"content": prompt, "add_special": True, "parse_special": True})["tokens"]
            ours = llm.encode_chat(msgs)
            if ours != theirs:
                bad += 1
                same_text = llm.template.render(msgs, add_generation_prompt=True) == prompt
                at = next((k for k, (x, y) in enumerate(zip(ours, theirs)) if x != y), min(len(ours), len(theirs)))
                print(f"differ at {at} ({'same text' if same_text else 'the texts differ'}): "
                      f"{[m['content'] for m in msgs]!r}\n  ours {ours[at:at + 6]} llama.cpp {theirs[at:at + 6]}")
    finally:
        proc.terminate()
    print(f"{a.n} conversations, {bad} differ")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
