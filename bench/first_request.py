"""What the first requests after a load pay: an agent's first turn (a long prompt, no cached
prefix), its second turn (the first turn's prompt cached, a short new part), then the same two
shapes again with other tokens. Times each one's first token and lists the Triton kernels
compiled during it (new entries of the kernel cache directory): a kernel compiled inside a
request is a variant the load's warm-up did not make.

    TRITON_CACHE_DIR=/tmp/fresh-cache python bench/first_request.py MODEL.gguf [-p 2600] [--turn 150]

Start it with an empty TRITON_CACHE_DIR to see every compile; with a warm one it shows only
what the process loads. A measurement, not a test. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from deimos.engine import LLM  # noqa: E402
from deimos.engine.request import Request  # noqa: E402
from deimos.kernels.sampling import SamplingParams  # noqa: E402


def cache_entries(root: Path) -> dict[str, str]:
    """Each kernel-cache entry's directory -> the kernel's name (from its metadata json)."""
    out = {}
    if not root.is_dir():
        return out
    for d in root.iterdir():
        name = "?"
        for j in d.glob("*.json"):
            if j.name.startswith("__grp__"):
                continue
            try:
                name = json.loads(j.read_text()).get("name", j.stem)
            except (OSError, ValueError):
                name = j.stem
            break
        out[d.name] = name
    return out


def first_token(llm: LLM, ids: list[int], n_new: int) -> tuple[float, list[int]]:
    """Seconds from adding the request to its first sampled token, and its tokens."""
    eng = llm.engine
    req = Request(ids, n_new, SamplingParams(seed=1))
    t0 = time.perf_counter()
    eng.add(req)
    ttft = None
    while eng.has_work:
        eng.step()
        if ttft is None and req.output_ids:
            ttft = time.perf_counter() - t0
    return ttft, list(req.output_ids)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("-p", "--prompt", type=int, default=2600, help="the first turn's prompt tokens")
    ap.add_argument("--turn", type=int, default=150, help="the second turn's new tokens")
    ap.add_argument("-n", "--new", type=int, default=16, help="tokens each turn generates")
    ap.add_argument("-c", "--ctx", type=int, default=40960)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    root = Path(os.environ.get("TRITON_CACHE_DIR", Path.home() / ".triton" / "cache"))
    t0 = time.perf_counter()
    llm = LLM(args.model, n_ctx=args.ctx, device=args.device)
    load = time.perf_counter() - t0
    seen = cache_entries(root)
    print(f"load + warm-up {load:.1f} s; {len(seen)} kernel-cache entries ({root})")
    import torch

    g = torch.Generator().manual_seed(0)
    rows = []
    for label in ("first", "again"):
        p1 = torch.randint(0, llm.config.n_vocab, (args.prompt,), generator=g).tolist()
        new_part = torch.randint(0, llm.config.n_vocab, (args.turn,), generator=g).tolist()
        ids = p1
        for turn in (1, 2):
            ttft, out = first_token(llm, ids, args.new)
            now = cache_entries(root)
            new = sorted({now[k] for k in now.keys() - seen.keys()})
            seen = now
            rows.append((f"{label} turn {turn}", len(ids), ttft, new))
            ids = p1 + out + new_part  # the next turn: the cached prompt, its answer, new tokens
    print("\n| request | prompt tokens | TTFT ms | kernels compiled during it |\n|---|---:|---:|---|")
    for label, n, ttft, new in rows:
        names = ", ".join(new) if new else "-"
        print(f"| {label} | {n} | {ttft * 1e3:.1f} | {len(new)}: {names[:400]} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
