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
import random
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tools")]

from fuzz_tokenizer import random_text  # noqa: E402
from llama_server import LlamaServer, first_difference  # noqa: E402

from deimos.engine import LLM  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("server")
    ap.add_argument("model")
    ap.add_argument("--n", type=int, default=300, help="conversations")
    ap.add_argument("--seed", type=int, default=5)
    a = ap.parse_args()
    llm = LLM(a.model, n_ctx=512)
    rng, bad = random.Random(a.seed), 0
    with LlamaServer(a.server, a.model, "-c", "512") as srv:
        for _ in range(a.n):
            msgs = []
            for j in range(rng.randint(1, 4)):
                c = random_text(rng, [])
                msgs.append({"role": "user" if j % 2 == 0 else "assistant", "content": c if c.strip() else "x" + c})
            if msgs[-1]["role"] != "user":
                msgs.append({"role": "user", "content": "ok"})
            prompt = srv.post("/apply-template", {"messages": msgs})[1]["prompt"]
            theirs = srv.post("/tokenize", {"content": prompt, "add_special": True,
                                            "parse_special": True})[1]["tokens"]
            ours = llm.encode_chat(msgs)
            if ours == theirs:
                continue
            bad += 1
            at = first_difference(ours, theirs)
            texts = "same text" if llm.template.render(msgs, add_generation_prompt=True) == prompt else "texts differ"
            print(f"differ at {at} ({texts}): {[m['content'] for m in msgs]!r}", "\n  ours",
                  ours[at:at + 6], "llama.cpp", theirs[at:at + 6])
    print(f"{a.n} conversations, {bad} differ")
    return int(bad > 0)


if __name__ == "__main__":
    sys.exit(main())
