"""The ``deimos`` command: subcommands build a config from their flags and call down.

Output contract: answers go to stdout, logs and errors to stderr. ``run --raw`` prints
exactly the generated text on stdout and nothing else.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence

log = logging.getLogger("deimos")


def _add_sampling(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling (llama.cpp's defaults)")
    g.add_argument("-n", "--max-tokens", type=int, default=256, help="tokens to generate at most")
    g.add_argument("--temperature", "--temp", type=float, default=0.8, help="0 = greedy")
    g.add_argument("--top-k", type=int, default=40, help="0 = off")
    g.add_argument("--top-p", type=float, default=0.95, help="1 = off")
    g.add_argument("--min-p", type=float, default=0.05, help="0 = off")
    g.add_argument("--repeat-penalty", type=float, default=1.0, help="1 = off")
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None, help="same seed, same output")


def _add_model(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="a GGUF file, or a known model name (see `deimos pull --list`)")


def _add_engine(p: argparse.ArgumentParser) -> None:
    p.add_argument("-c", "--ctx-size", type=int, default=None, help="context size in tokens")


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _add_device(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default=None, metavar="cuda|cpu",
                   help="cuda: quantized weights and Triton kernels on the GPU; cpu: the float32 "
                        "reference (default: cuda when available)")


def _sampling(args: argparse.Namespace):
    from deimos.kernels.sampling import SamplingParams

    return SamplingParams(
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
        repetition_penalty=args.repeat_penalty, presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty, seed=args.seed,
    )


def _llm(args: argparse.Namespace):
    from deimos.engine import LLM

    return LLM(args.model, n_ctx=args.ctx_size, device=getattr(args, "device", None) or _default_device())


def cmd_run(args: argparse.Namespace) -> int:
    sampling = _sampling(args)
    llm = _llm(args)
    out = sys.stdout
    for piece in llm.stream(args.prompt, max_tokens=args.max_tokens, raw=args.raw, sampling=sampling):
        out.write(piece)
        out.flush()
    if not args.raw:
        out.write("\n")
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    sampling = _sampling(args)
    llm = _llm(args)
    messages: list[dict[str, str]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    interactive = sys.stdin.isatty()
    if interactive:
        print(f"deimos chat: {llm.path.name} (empty line or Ctrl-D to quit, /reset to start over)",
              file=sys.stderr)
    while True:
        try:
            line = input("> " if interactive else "")
        except EOFError:
            break
        if not line.strip():
            break
        if line.strip() == "/reset":
            messages = messages[:1] if args.system else []
            continue
        messages.append({"role": "user", "content": line})
        reply: list[str] = []
        for piece in llm.stream_chat(messages, max_tokens=args.max_tokens, sampling=sampling):
            reply.append(piece)
            sys.stdout.write(piece)
            sys.stdout.flush()
        sys.stdout.write("\n")
        messages.append({"role": "assistant", "content": "".join(reply)})
    return 0


def cmd_tokenize(args: argparse.Namespace) -> int:
    from deimos.gguf import GGUFFile
    from deimos.registry import resolve
    from deimos.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(GGUFFile(resolve(args.model)))
    ids = tok.encode(args.text, add_special=not args.no_bos, parse_special=args.parse_special)
    print(json.dumps(ids))
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from rich.console import Console

    from deimos.gguf.inspect import inspect_gguf, render_inspect
    from deimos.registry import resolve

    Console().print(render_inspect(inspect_gguf(resolve(args.model))))
    return 0


def cmd_quant_check(args: argparse.Namespace) -> int:
    """Exit 0: all within expectation; 1: something flagged or mismatched; 2: unusable input."""
    from rich.console import Console

    from deimos.gguf import GGUFError
    from deimos.quant.check import QuantCheckError, check_files, render_check

    try:
        result = check_files(args.quant, args.reference)
    except (GGUFError, QuantCheckError, OSError) as e:
        print(f"deimos: error: {e}", file=sys.stderr)
        return 2
    Console().print(render_check(result, all_tensors=args.all))
    if args.kld is not None:  # the models' output distributions too (deimos.eval)
        from deimos.eval.cli import run_quant_kld

        print("\n".join(["", *run_quant_kld(args)]))
    return 1 if result.problems else 0


def cmd_serve(args: argparse.Namespace) -> int:
    from deimos.server.serve import ServeConfig, serve

    host, port = ServeConfig.parse_listen(args.listen)
    return serve(ServeConfig(
        model=args.model, host=host, port=port, n_ctx=args.ctx_size, api_key=args.api_key,
        sampling=_sampling(args), max_tokens=args.max_tokens, max_queue=args.max_queue,
        tui=not args.no_tui, device=args.device or _default_device(),
    ))


def cmd_compile(args: argparse.Namespace) -> int:
    import time

    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from deimos.engine import LLM
    from deimos.runtime.graph import PREFILL_BUCKETS
    from deimos.runtime.kernel_cache import use_kernel_cache

    device = args.device or _default_device()
    if device == "cpu":
        raise RuntimeError("compile: no CUDA GPU here (kernels are compiled for the local GPU; "
                           "tools/compile_kernels.py checks sm_90 builds without one)")
    cache = use_kernel_cache()
    before = sum(1 for _ in cache.rglob("*.json"))
    stages = 1 + len(PREFILL_BUCKETS) + 1  # weights, each prefill graph, the decode graph
    columns = (TextColumn("{task.description:<22}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
               TimeElapsedColumn())  # fmt: skip
    t0 = time.perf_counter()
    with Progress(*columns, console=Console(stderr=True)) as bar:
        task = bar.add_task("starting", total=stages)
        seen = []

        def progress(label: str) -> None:
            if seen:
                bar.advance(task)
            seen.append(label)
            bar.update(task, description=label)

        llm = LLM(args.model, n_ctx=args.ctx_size, device=device, progress=progress)
        bar.advance(task)
    after = sum(1 for _ in cache.rglob("*.json"))
    print(f"{llm.path.name}: every kernel and CUDA graph ready in {time.perf_counter() - t0:.1f} s; "
          f"{after - before} new kernel builds in {cache} ({after} in all)")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from rich.console import Console

    from deimos.runtime.kernel_cache import use_kernel_cache

    use_kernel_cache()
    from deimos.bench import BenchConfig, run_bench
    from deimos.bench.table import render

    cfg = BenchConfig(model=args.model, n_prompt=args.n_prompt, n_gen=args.n_gen,
                      rounds=args.repetitions, device=args.device or _default_device(),
                      roof=args.roof, vs_llama=args.vs_llama, seed=args.seed)
    report = run_bench(cfg)
    Console(stderr=args.json == "-").print(render(report))
    if args.json:
        text = json.dumps(report.to_json(), indent=2)
        if args.json == "-":
            print(text)
        else:
            with open(args.json, "w") as f:
                f.write(text + "\n")
    return 0


def cmd_pull(args: argparse.Namespace) -> int:
    from deimos import registry

    if args.list or not args.name:
        for name in registry.known_names():
            print(name)
        return 0
    print(registry.pull(args.name))
    return 0


def cmd_synth(args: argparse.Namespace) -> int:
    import time

    from deimos.registry import resolve
    from deimos.synth import (PRESETS, TYPICAL_VOCAB, get_preset, planned_size, weight_types,
                              write_model)

    wt = weight_types(args.type, pure=args.pure)
    if args.list:
        print(f"{'preset':18} {'arch':9} {'layers':>6} {'n_embd':>6} {'experts':>7} "
              f"{'params':>8} {wt.name + ' GB':>10}  (vocab of the real model)")
        for p in PRESETS.values():
            n, nbytes = planned_size(p, wt, TYPICAL_VOCAB[p.arch])
            experts = f"{p.n_expert_used}/{p.n_expert}" if p.is_moe else "-"
            print(f"{p.name:18} {p.arch:9} {p.n_layer:6} {p.n_embd:6} {experts:>7} "
                  f"{n / 1e9:7.2f}B {nbytes / 1e9:10.3f}")
        return 0
    if args.preset is None or args.output is None or args.vocab_from is None:
        raise ValueError("synth needs PRESET OUTPUT and --vocab-from (or --list)")
    preset = get_preset(args.preset)
    t0 = time.perf_counter()
    path = write_model(args.output, preset.arch, preset, wt, resolve(args.vocab_from), args.seed,
                       workers=args.workers)
    dt = time.perf_counter() - t0
    size = path.stat().st_size
    print(f"deimos: wrote {preset.name} {wt.name}: {size / 1e9:.3f} GB in {dt:.1f} s "
          f"({size / 1e9 / dt:.2f} GB/s)", file=sys.stderr)
    print(path)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="deimos", description="Run GGUF language models.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging on stderr")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("run", help="answer one prompt (streamed)")
    _add_model(p)
    p.add_argument("prompt")
    p.add_argument("--raw", action="store_true",
                   help="no chat template: the prompt as is; stdout holds exactly the generated text")
    _add_engine(p)
    _add_sampling(p)
    _add_device(p)
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("chat", help="interactive multi-turn chat")
    _add_model(p)
    p.add_argument("--system", default=None, help="a system message")
    _add_engine(p)
    _add_sampling(p)
    _add_device(p)
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (chat, completions, "
                                     "streaming, tools, JSON output, /metrics)")
    _add_model(p)
    p.add_argument("--listen", default="127.0.0.1:8080", metavar="HOST:PORT",
                   help="address to bind (default loopback only: 127.0.0.1:8080)")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every route but /health")
    p.add_argument("--max-queue", type=int, default=64,
                   help="requests waiting for the engine before new ones get 503")
    p.add_argument("--no-tui", action="store_true", help="no dashboard: JSON request logs only")
    _add_engine(p)
    _add_sampling(p)
    # -n: max_tokens of requests that give none (default: up to the context)
    _add_device(p)
    p.set_defaults(func=cmd_serve, max_tokens=None)

    p = sub.add_parser("tokenize", help="print token ids as a JSON array")
    _add_model(p)
    p.add_argument("text")
    p.add_argument("--no-bos", action="store_true", help="do not add BOS/EOS")
    p.add_argument("--parse-special", action="store_true", help="match special tokens in the text")
    p.set_defaults(func=cmd_tokenize)

    p = sub.add_parser("inspect", help="metadata and tensor table of a GGUF file")
    _add_model(p)
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("quant-check",
                       help="compare a quantized GGUF with a higher-precision copy, tensor by tensor")
    p.add_argument("quant", help="the quantized GGUF file")
    p.add_argument("reference", help="the same model at higher precision (F32, F16, Q8_0, ...)")
    p.add_argument("--all", action="store_true", help="list every tensor, not only flagged ones")
    from deimos.eval.cli import add_kld_options, add_perplexity_parser

    add_kld_options(p)
    p.set_defaults(func=cmd_quant_check)

    add_perplexity_parser(sub)

    p = sub.add_parser("compile", help="compile every kernel (and CUDA graph) MODEL needs on this GPU, "
                       "into the kernel cache")
    _add_model(p)
    p.add_argument("-c", "--ctx-size", type=int, default=None, help="context size (default 4096)")
    _add_device(p)
    p.set_defaults(func=cmd_compile)

    p = sub.add_parser("bench", help="prefill/decode tokens/s and decode GB/s (llama-bench style)")
    _add_model(p)
    p.add_argument("-p", "--n-prompt", type=int, default=512, help="prompt tokens (pp test)")
    p.add_argument("-n", "--n-gen", type=int, default=128, help="generated tokens (tg test)")
    p.add_argument("-r", "--repetitions", type=int, default=3, help="rounds")
    p.add_argument("--roof", type=float, default=4.3e12,
                   help="bandwidth roof in B/s for the decode share (default: H200 copy rate)")
    p.add_argument("--vs-llama", default=None, metavar="LLAMA_BENCH",
                   help="path of llama.cpp's llama-bench: run it on the same file, interleaved")
    p.add_argument("--json", default=None, metavar="FILE",
                   help="also write the report as JSON ('-': stdout, the table then on stderr)")
    p.add_argument("--seed", type=int, default=0)
    _add_device(p)
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("pull", help="fetch a known model into the local cache")
    p.add_argument("name", nargs="?")
    p.add_argument("--list", action="store_true", help="list known model names")
    p.set_defaults(func=cmd_pull)

    p = sub.add_parser("synth", help="write a random-weight GGUF of a real architecture")
    p.add_argument("preset", nargs="?", help="a preset name (e.g. llama-8b, qwen3-0.6b; --list)")
    p.add_argument("output", nargs="?")
    p.add_argument("--type", default="Q8_0",
                   help="a llama.cpp mix as llama-quantize makes it (Q4_K_M, Q4_K_S, Q5_K_M, "
                        "Q6_K, Q8_0, Q4_0, IQ4_XS, ...) or one GGML type for every matrix "
                        "(F16, Q4_K, ...)")
    p.add_argument("--pure", action="store_true",
                   help="every matrix exactly the GGML type --type (a mix name: its base "
                        "type), no mix rules or fallbacks")
    p.add_argument("--vocab-from", help="GGUF file whose tokenizer is copied")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=None, help="drawing threads (default: CPUs)")
    p.add_argument("--list", action="store_true", help="list the presets with sizes in --type")
    p.set_defaults(func=cmd_synth)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        stream=sys.stderr, format="deimos: %(levelname)s: %(message)s")
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0
    except (ValueError, OSError, RuntimeError, LookupError) as e:
        # GGUFError, ConfigError, QuantError, TemplateError, RequestError, RegistryError...
        # are all of these kinds: one clear line, no traceback (use -v for one).
        if args.verbose:
            log.exception("failed")
        print(f"deimos: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
