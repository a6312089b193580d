"""Write the recorded agent sessions of ``deimos bench agent`` (bench/sessions/).

    python tools/make_sessions.py                 # bench/sessions/{multi-turn,long-prompt,long-decode}.jsonl.gz + manifest.json
    python tools/make_sessions.py --small --out /tmp/s   # the short sessions the tests replay
    python tools/make_sessions.py --count-with ggml-vocab-llama-bpe.gguf   # also real token counts

The sessions are made by deimos.bench.sessions from the standard library of the Python that
runs this (the manifest names it and every file read, with its sha256): the same seed and the
same files give the same bytes. ``--check`` regenerates into memory and says whether the
committed files are what this Python makes.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import sys
from pathlib import Path

from deimos.bench.sessions import (
    FULL,
    SESSIONS_DIR,
    SHAPES,
    SMALL,
    generate,
    to_jsonl,
    write_sessions,
)


def real_counts(gguf: str, out_dir: Path) -> None:
    """Tokens of each session's last prompt under a real tokenizer: the message texts, tool
    calls and the tools' JSON, without a chat template's markers."""
    from deimos.bench.sessions import load_session
    from deimos.gguf import GGUFFile
    from deimos.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(GGUFFile(gguf))
    for shape in SHAPES:
        body = load_session(out_dir / f"{shape}.jsonl.gz")[-1]
        parts = [json.dumps(body.get("tools") or [], ensure_ascii=False)]
        for m in body["messages"]:
            parts.append(m.get("content") or "")
            parts += [c["function"]["name"] + c["function"]["arguments"]
                      for c in m.get("tool_calls") or ()]
        n = sum(len(tok.encode(p, add_special=False)) for p in parts)
        print(f"{shape}: last prompt {n} tokens with {Path(gguf).name} "
              f"({sum(map(len, parts)) / n:.2f} characters a token)")


def check(out_dir: Path, seed: int) -> int:
    manifest = json.loads((out_dir / "manifest.json").read_text())
    bad = 0
    for shape in SHAPES:
        raw = to_jsonl(generate(shape, FULL, seed))
        committed = gzip.decompress((out_dir / f"{shape}.jsonl.gz").read_bytes())
        same = raw == committed
        bad += not same
        print(f"{shape}: {'same' if same else 'DIFFERENT'} (sha256 {hashlib.sha256(raw).hexdigest()[:16]}, "
              f"manifest {manifest['sessions'][shape]['sha256_jsonl'][:16]})")
    return 1 if bad else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=SESSIONS_DIR, help="directory (default bench/sessions)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--small", action="store_true", help="the tests' short sessions")
    ap.add_argument("--check", action="store_true",
                    help="compare the committed sessions with what this Python makes; write nothing")
    ap.add_argument("--count-with", metavar="GGUF", default=None,
                    help="also count each last prompt's tokens with this file's tokenizer")
    args = ap.parse_args()
    if args.check:
        return check(args.out, args.seed)
    manifest = write_sessions(args.out, SMALL if args.small else FULL, args.seed)
    for shape, s in manifest["sessions"].items():
        print(f"{shape}: {s['turns']} turns, prompt {s['first_prompt_tokens']} -> "
              f"{s['last_prompt_tokens']} tokens (estimated), answers {s['min_answer_tokens']}-"
              f"{s['max_answer_tokens']} ({s['answer_tokens']} in all); {s['bytes_jsonl']:,} B, "
              f"{s['bytes_gz']:,} B gzipped")
    print(f"{len(manifest['sources'])} source files of Python {manifest['python']}'s stdlib; "
          f"wrote {args.out}", file=sys.stderr)
    if args.count_with:
        real_counts(args.count_with, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
