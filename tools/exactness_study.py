"""The exactness study of issue 13 (docs/exactness.md): Deimos and llama.cpp against a float64
evaluation of the same dequantized weights.

    python tools/exactness_study.py [--models M.gguf ...] [--groups kinds,repeat,long]
        [--paths P,...] [--llama-cuda DIR] [--out results.json]

Paths run: float64 (the yardstick, always), deimos-cpu, deimos-cpu-q8act (the float32
reference with llama.cpp's 8-bit activation rounding emulated: tools/exactness/q8act.py),
llama-cpu (llama_ref's reference settings: f32 KV cache, flash attention off),
llama-cpu-default (f16 KV cache, flash attention auto: as llama-cli runs), llama-cpu-twin (the
F32 twin: no activation quantization); on a machine with CUDA also deimos-cuda-prefill and
deimos-cuda-decode; with ``--llama-cuda DIR`` (a CUDA libllama with llama_ref built beside it:
``python tools/llama_ref/driver.py --build-in DIR``) llama-cuda and llama-cuda-default
(``--ngl 99``). Needs $DEIMOS_TEST_DATA (the models, the llama.cpp source) and, for the
llama-cpu paths, $LLAMA_CPU_DIR (the unpacked CPU llama.cpp build, with llama-quantize).
torch (unless --threads) and llama.cpp run on one thread, so that every run sums in the same order.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

TOOLS = Path(__file__).resolve().parent
sys.path.insert(0, str(TOOLS))
sys.path.insert(0, str(TOOLS / "llama_ref"))
import driver  # noqa: E402
from exactness import paths, sequences, study  # noqa: E402
from make_f32_twin_reference import make_twin  # noqa: E402

from deimos.eval.corpus import fetch_text, read_text  # noqa: E402
from deimos.gguf import GGUFFile  # noqa: E402
from deimos.tokenizer import Tokenizer  # noqa: E402

MODELS = ("SmolLM2-135M-Instruct.Q4_1.gguf", "gemma-3-270m-q4_k_m.gguf")


CPU_PATHS = ("deimos-cpu", "deimos-cpu-q8act", "llama-cpu", "llama-cpu-default", "llama-cpu-twin")
CUDA_PATHS = ("deimos-cuda-prefill", "deimos-cuda-decode")
LLAMA_CUDA_PATHS = ("llama-cuda", "llama-cuda-default")


def make_paths(names: list[str], model: Path, twin: Path, llama_cuda: Path | None) -> dict:
    """The runs of ``names`` (made lazily: a CUDA path only where there is CUDA)."""
    need_cpu = any(n.startswith("llama-cpu") for n in names)
    exe = driver.build(driver.LlamaPaths.default()) if need_cpu else None
    cuda_exe = llama_cuda / "llama_ref" if llama_cuda is not None else None
    ref, default = driver.LlamaOptions(), driver.LlamaOptions(kv="f16", fa="auto")
    make = {
        "deimos-cpu": lambda: paths.deimos_reference(model, float64=False),
        # llama.cpp's 8-bit activation rounding emulated on the float32 reference (q8act.py)
        "deimos-cpu-q8act": lambda: paths.deimos_reference(model, float64=False, q8act=True),
        "llama-cpu": lambda: paths.LlamaRun(exe, model, ref),
        "llama-cpu-default": lambda: paths.LlamaRun(exe, model, default),
        "llama-cpu-twin": lambda: paths.LlamaRun(exe, twin, ref),
        "deimos-cuda-prefill": lambda: paths.deimos_cuda(model, decode=False),
        "deimos-cuda-decode": lambda: paths.deimos_cuda(model, decode=True),
        "llama-cuda": lambda: paths.LlamaRun(cuda_exe, model, driver.LlamaOptions(ngl=99)),
        "llama-cuda-default": lambda: paths.LlamaRun(cuda_exe, model,
                                                     driver.LlamaOptions(ngl=99, kv="f16", fa="auto")),
    }
    return {n: make[n]() for n in names}


def default_paths(llama_cuda: Path | None) -> list[str]:
    names = list(CPU_PATHS)
    if torch.cuda.is_available():
        names += CUDA_PATHS
    if llama_cuda is not None:
        names += LLAMA_CUDA_PATHS
    return names


def run_model(model: Path, groups: set[str], names: list[str], llama_cuda: Path | None,
              cache: Path, per_group: int | None) -> dict:
    f = GGUFFile(model)
    tok = Tokenizer.from_gguf(f)
    long_text = read_text(fetch_text("alice29")) if "long" in groups else None
    seqs = [s for s in sequences.all_sequences(model.name, tok, long_text) if s.group in groups]
    if per_group is not None:  # the first ones of each group (a shorter run)
        seqs = [s for g in sorted(groups) for s in [x for x in seqs if x.group == g][:per_group]]
    twin = cache / f"{model.stem}.f32.gguf"
    if "llama-cpu-twin" in names and not twin.exists():
        make_twin(Path(os.environ.get("LLAMA_CPU_DIR", driver.LlamaPaths.default().lib)), model, twin)
    yard = paths.deimos_reference(model, float64=True)
    runs = make_paths(names, model, twin, llama_cuda)
    results = {name: study.PathResult() for name in runs}
    for k, seq in enumerate(seqs):
        t0 = time.time()
        ref = yard(seq)
        for name, run in runs.items():
            study.compare(seq, ref, run(seq), results[name])
        print(f"  {model.stem} {k + 1}/{len(seqs)} {seq.group}/{seq.id} ({len(seq.tokens)} tokens, "
              f"{time.time() - t0:.0f} s)", file=sys.stderr, flush=True)
    return {
        "model": model.name, "sha256": driver.sha256_file(model),
        "sequences": [{"group": s.group, "id": s.id, "tokens": list(s.tokens),
                       "positions": list(s.positions), "first_gen": s.first_gen} for s in seqs],
        "paths": {name: {"summary": study.summary(r), "per_sequence": r.per_sequence,
                         "flips": r.flips} for name, r in results.items()},
    }


def table(doc: dict) -> str:
    lines = []
    for m in doc["models"]:
        lines += [f"\n### {m['model']}\n",
                  "| path | group | positions | KLD mean | KLD p99 | KLD max | top-1 agree | flips | "
                  "first-token rel. logit err (median / max) |",
                  "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
        for name, p in m["paths"].items():
            s = p["summary"]
            fg = s.get("first_gen_rel_logit")
            fgs = f"{fg['median']:.2g} / {fg['max']:.2g}" if fg else ""
            for g in [g for g in s if g != "first_gen_rel_logit"]:
                r = s[g]
                lines.append(f"| {name} | {g} | {r['n']} | {r['kld_mean']:.3g} | {r['kld_p99']:.3g} | "
                             f"{r['kld_max']:.3g} | {100 * r['same_top']:.2f}% | {r['flips']} | "
                             f"{fgs if g == 'all' else ''} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="*", type=Path,
                    default=[driver.test_data_dir() / "models" / m for m in MODELS])
    ap.add_argument("--groups", default="kinds,repeat,long")
    ap.add_argument("--paths", default=None,
                    help="comma-separated paths to run (default: every one this machine has; "
                    f"known: {', '.join(CPU_PATHS + CUDA_PATHS + LLAMA_CUDA_PATHS)})")
    ap.add_argument("--llama-cuda", type=Path, default=None,
                    help="folder of a CUDA libllama with llama_ref built in it (driver.py --build-in)")
    ap.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "deimos" / "exactness",
                    help="where the F32 twins are kept")
    ap.add_argument("--per-group", type=int, default=None,
                    help="only the first N sequences of each group (a shorter run)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch CPU threads (default 1: every CPU run sums in one order; the "
                    "float64 yardstick does not care, so a GPU machine's run may use more)")
    ap.add_argument("--out", type=Path, default=Path("exactness-results.json"))
    args = ap.parse_args()
    groups = set(args.groups.split(","))
    if not groups <= {"kinds", "repeat", "long"}:
        ap.error(f"--groups: unknown group(s) {sorted(groups - {'kinds', 'repeat', 'long'})}")
    for m in args.models:
        if not m.exists():
            ap.error(f"--models: {m} does not exist")
    if args.llama_cuda is not None and not (args.llama_cuda / "llama_ref").exists():
        ap.error(f"--llama-cuda: {args.llama_cuda}/llama_ref is missing "
                 "(python tools/llama_ref/driver.py --build-in DIR)")
    names = args.paths.split(",") if args.paths else default_paths(args.llama_cuda)
    unknown = set(names) - set(CPU_PATHS + CUDA_PATHS + LLAMA_CUDA_PATHS)
    if unknown:
        ap.error(f"--paths: unknown path(s) {sorted(unknown)}")
    if set(names) & set(CUDA_PATHS) and not torch.cuda.is_available():
        ap.error("--paths: the deimos-cuda paths need a CUDA device")
    if set(names) & set(LLAMA_CUDA_PATHS) and args.llama_cuda is None:
        ap.error("--paths: the llama-cuda paths need --llama-cuda DIR")
    if args.threads < 1:
        ap.error(f"--threads: must be >= 1, got {args.threads}")
    torch.set_num_threads(args.threads)
    args.cache.mkdir(parents=True, exist_ok=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=TOOLS).stdout.strip()
    doc = {"command": " ".join(sys.argv), "commit": commit,
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "machine": f"{platform.machine()} {platform.processor() or ''} torch {torch.__version__}"
                      + (f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""),
           "llama_cpp_build": driver.LLAMA_CPP_BUILD, "models": []}
    for m in args.models:
        doc["models"].append(run_model(m, groups, names, args.llama_cuda, args.cache,
                                       args.per_group))
        args.out.write_text(json.dumps(doc))
    print(table(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
