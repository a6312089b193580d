"""The ``deimos`` command: subcommands build a config from their flags and call down.

Output contract: answers go to stdout, logs and errors to stderr. ``run --raw`` prints
exactly the generated text on stdout and nothing else.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Callable, Sequence

from deimos import __version__
from deimos.kernels.sampling_params import SAMPLING_BOUNDS, Bound, SamplingParams

log = logging.getLogger("deimos")

# `run` and `chat` stop here unless -n says otherwise (and say so when it cut the answer);
# the loop guard (engine/repetition.py) ends a cycling answer long before
RUN_MAX_TOKENS = 512
# each sampling flag and the SamplingParams field (and server request field) it sets
SAMPLING_FLAGS = {"temperature": "--temperature", "top_k": "--top-k", "top_p": "--top-p",
                  "min_p": "--min-p", "repetition_penalty": "--repeat-penalty",
                  "presence_penalty": "--presence-penalty",
                  "frequency_penalty": "--frequency-penalty", "seed": "--seed"}


def _template_kwargs(text: str) -> tuple[tuple[str, object], ...]:
    """An argparse type: a JSON object of template variables (deimos.tokenizer.chat's check)."""
    from deimos.tokenizer.chat import template_variables

    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {type(value).__name__}")
    try:
        return tuple(template_variables(value).items())
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _checked(kind: type, bound: Bound) -> Callable[[str], object]:
    """An argparse type: the text as ``kind``, checked by ``bound`` (the sampler's own check,
    so a flag's error reads as the server's and SamplingParams' do; argparse names the flag)."""

    def parse(text: str) -> object:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"must be {'an integer' if kind is int else 'a number'}, got {text!r}") from None
        problem = bound.problem(value)
        if problem is not None:
            raise argparse.ArgumentTypeError(problem)
        return value

    return parse


def _add_sampling(p: argparse.ArgumentParser, max_tokens: int | None = RUN_MAX_TOKENS) -> None:
    d = SamplingParams()
    g = p.add_argument_group("sampling (llama.cpp's defaults)")
    g.add_argument("-n", "--max-tokens", type=_checked(int, Bound(lo=1, integer=True)),
                   default=max_tokens, help="tokens to generate at most (default: "
                   f"{max_tokens or 'what the context holds'})")

    def flag(field: str, kind: type, help: str | None = None, *aliases: str) -> None:
        g.add_argument(SAMPLING_FLAGS[field], *aliases, type=_checked(kind, SAMPLING_BOUNDS[field]),
                       default=getattr(d, field), help=help)

    flag("temperature", float, f"{d.temperature:g}; 0 = greedy", "--temp")
    flag("top_k", int, f"{d.top_k}; 0 = off")
    flag("top_p", float, f"{d.top_p:g}; 1 = off")
    flag("min_p", float, f"{d.min_p:g}; 0 = off")
    flag("repetition_penalty", float, f"{d.repetition_penalty:g}; 1 = off")
    flag("presence_penalty", float)
    flag("frequency_penalty", float)
    flag("seed", int, "same seed, same output")


def _add_model(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", help="a GGUF file, a known model name (see `deimos pull "
                   "--list`), a Hugging Face cache folder or hf://ORG/NAME/FILE.gguf (local)")
    p.add_argument("-m", "--model", dest="model_opt", metavar="MODEL", default=None,
                   help="the same as the positional MODEL")


def _block_size(text: str) -> int:
    """--block-size: a power of two in 16..256 (the paged attention's tiles)."""
    value = _checked(int, Bound(lo=16, hi=256, integer=True))(text)
    if value & (value - 1):
        raise argparse.ArgumentTypeError(f"must be a power of two in [16, 256], got {value}")
    return value


# the engine flags and the EngineConfig fields they set
ENGINE_FLAGS = {"max_seqs": "--max-seqs", "max_batch_tokens": "--max-batch-tokens",
                "kv_tokens": "--kv-tokens", "kv_gib": "--kv-gib", "block_size": "--block-size",
                "prefix_cache": "--no-prefix-cache"}
# speculative decoding's flags: the LLM arguments they set, and the SpecConfig words in its errors
SPEC_FLAGS = {"speculative": "--speculative", "spec_k": "--spec-k", "draft_model": "--draft-model"}
SPEC_WORDS = {"speculative method": "--speculative", "k_max": "--spec-k",
              "a draft_model": "--draft-model"}
CPU_MAX_SEQS = 32  # LLM's default on the CPU (EngineConfig's, 64, on a GPU)


def _add_engine(p: argparse.ArgumentParser) -> None:
    p.add_argument("-c", "--ctx-size", type=_checked(int, Bound(lo=2, integer=True)),
                   default=None, help="context size in tokens (default: the model's trained "
                   "context, at most 4096)")
    g = p.add_argument_group("engine (continuous batching over a paged KV cache)")
    positive = _checked(int, Bound(lo=1, integer=True))
    g.add_argument("--max-seqs", type=positive, default=None, metavar="N",
                   help=f"sequences decoded at once (default: 64 on a GPU, {CPU_MAX_SEQS} on "
                        "the CPU)")
    g.add_argument("--max-batch-tokens", type=positive, default=None, metavar="N",
                   help="tokens one step computes, decodes and prompt chunks together "
                        "(default: 2048; at least --max-seqs)")
    kv = g.add_mutually_exclusive_group()
    kv.add_argument("--kv-tokens", type=positive, default=None, metavar="N",
                    help="KV pool size in tokens, shared by every sequence (default: from the "
                         "GPU's free memory; on the CPU the context per sequence, at most 4 GiB)")
    kv.add_argument("--kv-gib", type=_checked(float, Bound(lo=0, lo_open=True)), default=None,
                    metavar="X", help="KV pool size in GiB (instead of --kv-tokens)")
    g.add_argument("--block-size", type=_block_size, default=None, metavar="N",
                   help="tokens per KV block, the prefix cache's unit (a power of two in "
                        "16..256; default: the engine's)")
    g.add_argument("--no-prefix-cache", action="store_true",
                   help="do not reuse the KV blocks of earlier prompts' shared prefixes")
    g.add_argument("--speculative", default=None, metavar="METHOD",
                   help="speculative decoding: ngram (prompt lookup: drafts copied from the "
                        "prompt and the answer so far), draft (a draft model's greedy "
                        "drafts, --draft-model) or mtp (the model's own MTP layers, in qwen35 "
                        "family files that have them; eager steps on the GPU), verified several "
                        "at a time in one batched step; greedy output unchanged, sampled output "
                        "the same distribution")
    g.add_argument("--spec-k", type=positive, default=None, metavar="N",
                   help="with --speculative: the most drafts one step verifies (default 6; "
                        "each sequence adapts it to its acceptance)")
    g.add_argument("--draft-model", default=None, metavar="MODEL",
                   help="with --speculative draft: a smaller GGUF model with the same "
                        "vocabulary (a path or a known name)")
    g.add_argument("--experts", choices=("auto", "gpu", "cpu"), default=None,
                   help="MoE models on a GPU: where the routed experts live (default auto: on the "
                        "GPU when the model fits, else on the host with an elastic GPU cache of "
                        "experts and the misses computed on the CPU)")
    g.add_argument("--expert-cache-gib", type=_checked(float, Bound(lo=0)), default=None,
                   metavar="X", help="a fixed GPU expert cache of X GiB (default: sized from free "
                   "GPU memory, shrinking and growing as other programs take and give memory)")
    g.add_argument("--dense-weights", choices=("auto", "on", "off"), default=None,
                   help="fp16 copies of the quantized weights beside their packed bytes, for "
                        "batched decode and prefill (GPU; 2 bytes a weight; default auto: when "
                        "they fit in half the free memory)")


def engine_options(args: argparse.Namespace, device: str) -> dict[str, object]:
    """``LLM(**...)``'s engine settings from the flags given (the engine's defaults for the
    rest); a combination the engine refuses is one line naming the flags."""
    opts: dict[str, object] = {k: getattr(args, k) for k in ENGINE_FLAGS
                               if k != "prefix_cache" and getattr(args, k, None) is not None}
    if getattr(args, "no_prefix_cache", False):
        opts["prefix_cache"] = False
    from deimos.engine.engine import EngineConfig
    from deimos.engine.llm import speculation

    trial = dict(opts)
    for key in ("dense_weights", "experts", "expert_cache_gib"):  # the model's placement
        if getattr(args, key, None) is not None:
            opts[key] = getattr(args, key)
    if device == "cpu":
        trial.setdefault("max_seqs", CPU_MAX_SEQS)
    method, k = getattr(args, "speculative", None), getattr(args, "spec_k", None)
    draft = getattr(args, "draft_model", None)
    for value, flag in ((k, "--spec-k"), (draft, "--draft-model")):
        if value is not None and method is None:
            raise ValueError(f"{flag} needs --speculative (e.g. --speculative ngram)")
    try:
        spec = speculation(method, k, draft)
        EngineConfig(n_ctx=2, spec=spec, **trial)  # its checks, before the model loads
    except ValueError as e:
        message = str(e)
        for field, flag in {**ENGINE_FLAGS, **SPEC_WORDS}.items():
            message = message.replace(field, flag)
        raise ValueError(message) from None
    for key in SPEC_FLAGS:
        if getattr(args, key, None) is not None:
            opts[key] = getattr(args, key)
    return opts


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _device(args: argparse.Namespace) -> str:
    """--device checked (one line for an unknown device, a CPU-only torch, a missing GPU)."""
    from deimos.engine.llm import check_device

    return check_device(args.device or _default_device(), "--device")


def _add_device(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default=None, metavar="cuda|cuda:N|cpu",
                   help="cuda: quantized weights and Triton kernels on the GPU; cpu: the float32 "
                        "reference (default: cuda when available)")


def _say(message: str) -> None:
    print(f"deimos: {message}", file=sys.stderr, flush=True)


def _bars() -> bool:
    """Progress bars only on a terminal; elsewhere (logs, pipes) plain lines or nothing."""
    return sys.stderr.isatty()


def _sampling(args: argparse.Namespace):
    from deimos.kernels.sampling import SamplingParams

    return SamplingParams(
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
        repetition_penalty=args.repeat_penalty, presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty, seed=args.seed,
    )


def _resolve(model: str):
    """The model's file, pulled first (with progress) when it is a known name not yet cached."""
    from deimos.registry import PullDisplay, resolve

    return resolve(model, display=PullDisplay(_say, bars=_bars()))


def _load(path, n_ctx: int | None, device: str, *, stages: bool = False, transient: bool = True,
          engine: dict[str, object] | None = None):
    """The LLM, with a progress bar of its stages on a terminal (weights; on a GPU each
    kernel and CUDA graph compiled or loaded from the cache) or, with ``stages``, always.
    ``engine``: EngineConfig's settings (``engine_options``)."""
    engine = engine or {}
    from rich.console import Console
    from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from deimos.engine import LLM

    if not (stages or _bars()):
        return LLM(path, n_ctx=n_ctx, device=device, **engine)
    n_stages = 1  # the weights
    if device != "cpu":
        from deimos.runtime.graph import PREFILL_BUCKETS

        n_stages += len(PREFILL_BUCKETS) + 1  # each prefill graph, the decode graph
    columns = (SpinnerColumn(), TextColumn("{task.description:<34}"), BarColumn(),
               TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True), transient=transient) as bar:
        task = bar.add_task(f"loading {path.name}", total=n_stages)
        seen: list[str] = []

        def progress(label: str) -> None:
            if seen:
                bar.advance(task)
            seen.append(label)
            what = "loading weights" if label == "weights" else f"compiling: {label}"
            bar.update(task, description=f"{what} ({device})")

        llm = LLM(path, n_ctx=n_ctx, device=device, progress=progress, **engine)
        bar.advance(task)
    return llm


def _llm(args: argparse.Namespace):
    device = _device(args)  # a bad --device fails before any download
    engine = engine_options(args, device)
    return _load(_resolve(args.model), args.ctx_size, device, engine=engine)


def _read_prompt(args: argparse.Namespace) -> str:
    if args.file is not None and args.prompt is not None:
        raise ValueError("give the prompt as an argument or with -f FILE, not both")
    if args.file is None:
        if args.prompt is None:
            raise ValueError("run needs a PROMPT (or -f FILE; -f - reads stdin)")
        return args.prompt
    if args.file == "-":
        return sys.stdin.read()
    try:
        with open(args.file, encoding="utf-8") as f:
            return f.read()
    except UnicodeDecodeError as e:
        raise ValueError(f"-f {args.file}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise ValueError(f"-f {args.file}: {e.strerror or e}") from None


def _finish_note(req, args: argparse.Namespace, n_ctx: int) -> str | None:
    """Why the answer ended, when it was not the model's own end."""
    from deimos.engine.repetition import LoopGuard

    if req.finish_reason == "repetition":
        period = (req.loop_guard or LoopGuard()).period(req.output_ids)
        return (f"[stopped: the answer was repeating a span of {period} tokens; "
                "--no-loop-guard lets it run]")
    if req.finish_reason == "length":
        if len(req.output_ids) >= req.max_tokens:
            return f"[stopped at -n {req.max_tokens} tokens; a larger -n allows a longer answer]"
        return f"[stopped: the context of {n_ctx} tokens is full; -c sets a larger one]"
    return None


def _stream(llm, ids: list[int], args: argparse.Namespace, sampling) -> str:
    """Streams the answer to stdout, ended by a newline unless --raw; the note on how it
    ended goes to stderr. Returns the generated text."""
    from deimos.engine import Request
    from deimos.engine.repetition import LoopGuard

    req = Request(ids, args.max_tokens, sampling, llm.stop_ids,
                  loop_guard=None if args.no_loop_guard else LoopGuard())
    pieces: list[str] = []
    for piece in llm.stream_ids(req):
        pieces.append(piece)
        sys.stdout.write(piece)
        sys.stdout.flush()
    text = "".join(pieces)
    if not getattr(args, "raw", False) and not text.endswith("\n"):
        sys.stdout.write("\n")  # --raw: stdout is the generated text, nothing else
        sys.stdout.flush()
    note = _finish_note(req, args, llm.n_ctx)
    if note is not None:
        _say(note)
    return text


def cmd_run(args: argparse.Namespace) -> int:
    prompt = _read_prompt(args)
    sampling = _sampling(args)
    llm = _llm(args)
    raw = args.raw
    if not raw and not llm.has_chat_template:
        # a base model: a chat template it was never tuned on makes worse answers
        _say(f"{llm.path.name} has no chat template (a base model): continuing the prompt as "
             "plain text, as --raw does")
        raw = True
    ids = llm.encode_raw(prompt) if raw else llm.encode_chat([{"role": "user", "content": prompt}])
    _stream(llm, ids, args, sampling)
    return 0


# chat lines that end the session (besides an empty line and end of input): llama-cli's and
# ollama's words, which users type out of habit (sent as a message they got an answer instead)
QUIT_COMMANDS = ("/exit", "/quit", "/bye")


def cmd_chat(args: argparse.Namespace) -> int:
    sampling = _sampling(args)
    llm = _llm(args)
    messages: list[dict[str, str]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    interactive = sys.stdin.isatty()
    if not llm.has_chat_template:
        _say(f"{llm.path.name} has no chat template (a base model, not tuned for chat): using "
             "the default template for its vocabulary; expect it not to follow the turns")
    if interactive:
        print(f"deimos chat: {llm.path.name} (empty line, /exit or Ctrl-D to quit, /reset to start over)",
              file=sys.stderr)
    while True:
        try:
            line = input("> " if interactive else "")
        except EOFError:
            break
        if not line.strip() or line.strip() in QUIT_COMMANDS:
            break
        if line.strip() == "/reset":
            messages = messages[:1] if args.system else []
            continue
        messages.append({"role": "user", "content": line})
        reply = _stream(llm, llm.encode_chat(messages), args, sampling)
        messages.append({"role": "assistant", "content": reply})
    return 0


def cmd_tokenize(args: argparse.Namespace) -> int:
    from deimos.gguf import GGUFFile
    from deimos.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(GGUFFile(_resolve(args.model)))
    ids = tok.encode(args.text, add_special=not args.no_bos, parse_special=args.parse_special)
    print(json.dumps(ids))
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from rich.console import Console

    from deimos.gguf.inspect import inspect_gguf, render_inspect

    Console().print(render_inspect(inspect_gguf(_resolve(args.model))))
    return 0


def cmd_quant_check(args: argparse.Namespace) -> int:
    """Exit 0: all within expectation; 1: something flagged or mismatched; 2: unusable input."""
    from rich.console import Console

    from deimos.gguf import GGUFError
    from deimos.quant.check import QuantCheckError, check_files, render_check
    from deimos.registry import RegistryError

    try:  # short names and HF cache paths too, like every other command
        args.quant, args.reference = (str(_resolve(m)) for m in (args.quant, args.reference))
        result = check_files(args.quant, args.reference)
    except (GGUFError, QuantCheckError, RegistryError, OSError) as e:
        print(f"deimos: error: {e}", file=sys.stderr)
        return 2
    Console().print(render_check(result, all_tensors=args.all))
    if args.kld is not None:  # the models' output distributions too (deimos.eval)
        from deimos.eval.cli import run_quant_kld

        print("\n".join(["", *run_quant_kld(args)]))
    return 1 if result.problems else 0


def serve_config(args: argparse.Namespace):
    """The ServeConfig of ``serve``'s flags (and $DEIMOS_API_KEY)."""
    from deimos.server.serve import ServeConfig

    if args.listen is not None and (args.host is not None or args.port is not None):
        raise ValueError("give --listen HOST:PORT or --host/--port, not both")
    host, port = ServeConfig.parse_listen(args.listen or "127.0.0.1:8080")
    host = host if args.host is None else args.host
    port = port if args.port is None else args.port
    # the environment keeps the key out of `ps`; --api-key wins when both are set
    api_key = args.api_key or os.environ.get("DEIMOS_API_KEY") or None
    device = _device(args)
    engine = engine_options(args, device)
    return ServeConfig(
        model=args.model, host=host, port=port, n_ctx=args.ctx_size, api_key=api_key,
        sampling=_sampling(args), max_tokens=args.max_tokens, max_queue=args.max_queue,
        tui=not args.no_tui, device=device, alias=args.alias or None,
        template_kwargs=args.chat_template_kwargs, **engine,
    )


def cmd_serve(args: argparse.Namespace) -> int:
    from deimos.server.serve import serve

    cfg = serve_config(args)
    _resolve(args.model)  # a first pull shows its progress before the server starts
    return serve(cfg)


def cmd_compile(args: argparse.Namespace) -> int:
    import time

    from deimos.runtime.kernel_cache import use_kernel_cache

    if (args.device or _default_device()) == "cpu":
        raise RuntimeError("compile: no CUDA GPU here (kernels are compiled for the local GPU; "
                           "tools/compile_kernels.py checks sm_90 builds without one)")
    device = _device(args)
    cache = use_kernel_cache()
    before = sum(1 for _ in cache.rglob("*.json"))
    path = _resolve(args.model)
    t0 = time.perf_counter()
    llm = _load(path, args.ctx_size, device, stages=True, transient=False,
                engine=engine_options(args, device))
    after = sum(1 for _ in cache.rglob("*.json"))
    print(f"{llm.path.name}: every kernel and CUDA graph ready in {time.perf_counter() - t0:.1f} s; "
          f"{after - before} new kernel builds in {cache} ({after} in all)")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from rich.console import Console

    from deimos.runtime.kernel_cache import use_kernel_cache

    use_kernel_cache()
    from deimos.bench import BenchConfig, run_bench
    from deimos.bench.run import render_report

    try:
        cfg = BenchConfig(model=str(_resolve(args.model)), n_prompt=args.n_prompt,
                          n_gen=args.n_gen, rounds=args.repetitions, device=_device(args),
                          roof=args.roof, vs_llama=args.vs_llama, seed=args.seed,
                          llama_args=args.llama_args, llama_reps=args.llama_reps,
                          gpu_mem=args.gpu_mem, squeeze=args.squeeze, release=args.release,
                          squeeze_requests=args.squeeze_requests)
    except ValueError as e:
        print(f"deimos: {e}", file=sys.stderr)
        return 2
    report = run_bench(cfg)
    console = Console(stderr=args.json == "-")
    for part in render_report(report):
        console.print(part)
    _write_json(report.to_json(), args.json)
    return 0


def _write_json(doc: dict, dest: str | None) -> None:
    """``--json FILE`` (``-``: stdout)."""
    if not dest:
        return
    text = json.dumps(doc, indent=2)
    if dest == "-":
        print(text)
    else:
        with open(dest, "w") as f:
            f.write(text + "\n")


def _levels(text: str) -> tuple[int, ...]:
    """--concurrency: comma-separated positive integers."""
    try:
        levels = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be integers separated by commas, got {text!r}") from None
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError(f"every level must be >= 1, got {text!r}")
    return levels


# bench serve's sampling flags and the request fields each sets (llama-server calls the
# repetition penalty repeat_penalty, Deimos repetition_penalty: both are sent)
SERVE_SAMPLING = {"temperature": ("temperature",), "top_k": ("top_k",), "top_p": ("top_p",),
                  "min_p": ("min_p",), "repeat_penalty": ("repeat_penalty", "repetition_penalty"),
                  "presence_penalty": ("presence_penalty",),
                  "frequency_penalty": ("frequency_penalty",), "sampling_seed": ("seed",)}


def cmd_bench_serve(args: argparse.Namespace) -> int:
    from deimos.bench.serve import ServeBenchConfig, api_key_from_env, run_serve_bench
    from deimos.bench.serve_stats import markdown

    sampling = {name: getattr(args, dest) for dest, names in SERVE_SAMPLING.items()
                for name in names if getattr(args, dest) is not None}
    cfg = ServeBenchConfig(
        url=args.url, model=args.model, api_key=args.api_key or api_key_from_env(),
        concurrency=args.concurrency, prompt_tokens=args.prompt_tokens,
        max_tokens=args.max_tokens, requests=args.requests, warmup=args.warmup,
        endpoint=args.endpoint, sampling=sampling, seed=args.seed, timeout_s=args.timeout,
        constrained=args.constrained)
    report = run_serve_bench(cfg, progress=_say)
    _write_json(report.to_json(), args.json)
    print(markdown(report), file=sys.stderr if args.json == "-" else sys.stdout)
    return 0


def cmd_bench_agent(args: argparse.Namespace) -> int:
    from deimos.bench.agent import AgentBenchConfig, run_agent_bench
    from deimos.bench.agent_stats import markdown
    from deimos.bench.serve import api_key_from_env

    sampling = {"temperature": args.temperature} if args.temperature is not None else {}
    cfg = AgentBenchConfig(
        session=args.session, url=args.url, model=args.model,
        api_key=args.api_key or api_key_from_env(), turns=args.turns,
        tools_in_system=args.tools_in_system, warmup=args.warmup, sampling=sampling,
        timeout_s=args.timeout)
    report = run_agent_bench(cfg, progress=_say)
    _write_json(report.to_json(), args.json)
    print(markdown(report), file=sys.stderr if args.json == "-" else sys.stdout)
    return 0


def _bench_serve_argv(argv: Sequence[str]) -> list[str]:
    """``deimos [-v] bench serve|agent ...`` -> ``bench-serve|bench-agent ...`` (a nested
    subcommand beside bench's positional MODEL would make argparse take MODEL for a subcommand
    name; a model file named "serve" is still ./serve)."""
    argv = list(argv)
    i = next((k for k, a in enumerate(argv) if not a.startswith("-")), None)
    if i is not None and argv[i:i + 2] in (["bench", "serve"], ["bench", "agent"]):
        argv[i:i + 2] = [f"bench-{argv[i + 1]}"]
    return argv


def cmd_pull(args: argparse.Namespace) -> int:
    from deimos import registry

    if args.list or not args.name:
        print(f"{'name':14} {'aliases':9} {'size':>7}  {'cached':7} description")
        for m in registry.MODELS:
            cached = registry.cached_file(m)
            print(f"{m.name:14} {','.join(m.aliases) or '-':9} {m.size / 1e6:4.0f} MB  "
                  f"{'yes' if cached else 'no':7} {m.description}")
        print(f"cache: {registry.cache_dir() / 'models'}", file=sys.stderr)
        return 0
    print(registry.pull(args.name, display=registry.PullDisplay(_say, bars=_bars())))
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
    template = None
    if args.chat_template is not None:
        from pathlib import Path

        from deimos.tokenizer.template import ChatTemplate, TemplateError

        try:
            template = Path(args.chat_template).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"--chat-template {args.chat_template}: cannot read it as UTF-8 "
                             f"text: {e}") from None
        try:
            ChatTemplate(template)
        except TemplateError as e:
            raise ValueError(f"--chat-template {args.chat_template}: not a chat template "
                             f"Deimos can render: {e}") from None
    t0 = time.perf_counter()
    path = write_model(args.output, preset.arch, preset, wt, resolve(args.vocab_from), args.seed,
                       workers=args.workers, chat_template=template)
    dt = time.perf_counter() - t0
    size = path.stat().st_size
    print(f"deimos: wrote {preset.name} {wt.name}: {size / 1e9:.3f} GB in {dt:.1f} s "
          f"({size / 1e9 / dt:.2f} GB/s)", file=sys.stderr)
    print(path)
    return 0


def _add_server_client(p: argparse.ArgumentParser) -> None:
    """The flags of a bench that drives an OpenAI-compatible server."""
    p.add_argument("--url", default="http://127.0.0.1:8080", help="the server's base URL")
    p.add_argument("--api-key", default=None,
                   help="sent as 'Authorization: Bearer KEY' (default: $DEIMOS_API_KEY or "
                        "$OPENAI_API_KEY)")
    p.add_argument("--model", default=None,
                   help="the request's model (default: the first id of GET /v1/models)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="deimos", description="Run GGUF language models.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging on stderr")
    parser.add_argument("--version", action="version", version=f"deimos {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    loop_guard = ("do not stop an answer that repeats one span of tokens over and over "
                  "(stopped by default, with a note on stderr)")
    p = sub.add_parser("run", help="answer one prompt (streamed)")
    _add_model(p)
    p.add_argument("prompt", nargs="?")
    p.add_argument("-f", "--file", default=None, metavar="FILE",
                   help="read the prompt from FILE ('-': stdin) instead of PROMPT")
    p.add_argument("--raw", action="store_true",
                   help="no chat template: the prompt as is; stdout holds exactly the generated text")
    p.add_argument("--no-loop-guard", action="store_true", help=loop_guard)
    _add_engine(p)
    _add_sampling(p)
    _add_device(p)
    p.set_defaults(func=cmd_run, after_model="prompt")

    p = sub.add_parser("chat", help="interactive multi-turn chat")
    _add_model(p)
    p.add_argument("--system", default=None, help="a system message")
    p.add_argument("--no-loop-guard", action="store_true", help=loop_guard)
    _add_engine(p)
    _add_sampling(p)
    _add_device(p)
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (chat, completions, "
                                     "streaming, tools, JSON output, /metrics)")
    _add_model(p)
    p.add_argument("--listen", default=None, metavar="HOST:PORT",
                   help="address to bind (default loopback only: 127.0.0.1:8080)")
    p.add_argument("--host", default=None, help="the HOST of --listen alone")
    p.add_argument("--port", type=_checked(int, Bound(lo=0, hi=65535, integer=True)),
                   default=None, help="the PORT of --listen alone")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every route but /health "
                        "(default: $DEIMOS_API_KEY, which `ps` does not show)")
    p.add_argument("--max-queue", type=_checked(int, Bound(lo=1, integer=True)), default=64,
                   help="requests (each choice of n) waiting to start before new ones get 503 "
                        "with Retry-After")
    p.add_argument("--alias", default=None, metavar="NAME",
                   help="the model id /v1/models lists and responses name (default: the "
                        "file's name without .gguf); requests may name any model")
    p.add_argument("--no-tui", action="store_true", help="no dashboard: JSON request logs only")
    p.add_argument("--chat-template-kwargs", type=_template_kwargs, default=(), metavar="JSON",
                   help="variables every chat request's template gets, a JSON object (e.g. "
                        "'{\"enable_thinking\": false}'); a request's own chat_template_kwargs "
                        "win")
    _add_engine(p)
    # -n: max_tokens of requests that give none (default: up to the context)
    _add_sampling(p, max_tokens=None)
    _add_device(p)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("tokenize", help="print token ids as a JSON array")
    _add_model(p)
    p.add_argument("text", nargs="?")
    p.add_argument("--no-bos", action="store_true", help="do not add BOS/EOS")
    p.add_argument("--parse-special", action="store_true", help="match special tokens in the text")
    p.set_defaults(func=cmd_tokenize, after_model="text")

    p = sub.add_parser("inspect", help="metadata and tensor table of a GGUF file")
    _add_model(p)
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("quant-check",
                       help="compare a quantized GGUF with a higher-precision copy, tensor by tensor")
    p.add_argument("quant", help="the quantized GGUF file (or a known model name)")
    p.add_argument("reference", help="the same model at higher precision (F32, F16, Q8_0, ...)")
    p.add_argument("--all", action="store_true", help="list every tensor, not only flagged ones")
    from deimos.eval.cli import add_kld_options, add_perplexity_parser

    add_kld_options(p)
    p.set_defaults(func=cmd_quant_check)

    add_perplexity_parser(sub)

    p = sub.add_parser("compile", help="compile every kernel (and CUDA graph) MODEL needs on this GPU, "
                       "into the kernel cache")
    _add_model(p)
    _add_engine(p)
    _add_device(p)
    p.set_defaults(func=cmd_compile)

    p = sub.add_parser("bench", help="prefill/decode tokens/s and decode GB/s (llama-bench style)")
    _add_model(p)
    positive = _checked(int, Bound(lo=1, integer=True))
    p.add_argument("-p", "--n-prompt", type=positive, default=512, help="prompt tokens (pp test)")
    p.add_argument("-n", "--n-gen", type=positive, default=128, help="generated tokens (tg test)")
    p.add_argument("-r", "--repetitions", type=positive, default=3, help="rounds")
    p.add_argument("--roof", type=_checked(float, Bound(lo=0, lo_open=True)), default=None,
                   help="bandwidth roof in B/s for the decode share (default: this device's "
                        "copy rate, measured)")
    p.add_argument("--vs-llama", default=None, metavar="LLAMA_BENCH",
                   help="path of llama.cpp's llama-bench: run it on the same file first, alone "
                        "(its own warm-up, then the repetitions), then Deimos's rounds")
    p.add_argument("--llama-args", default=None, metavar='"FLAGS"',
                   help="llama-bench's flags beside -m/-p/-n/-r/-o, given with '=' "
                        "(--llama-args=\"-ngl 99 -fa 1 -ub 2048\"; default: \"-ngl 99 -fa 1\", "
                        "its best known flags for one GPU)")
    p.add_argument("--llama-reps", type=positive, default=None,
                   help="llama-bench's repetitions (default: max(-r, 5))")
    p.add_argument("--gpu-mem", type=_checked(float, Bound(lo=0, lo_open=True)), default=None,
                   metavar="GIB",
                   help="leave the engine (and llama-bench) GIB of the card: a helper process "
                        "holds the rest of its free memory from before the load to the end")
    p.add_argument("--squeeze", action="store_true",
                   help="instead of the rounds: a replay of requests of -n tokens; before "
                        "request 4 another process takes 2 GiB, rewritten every 250 ms "
                        "(decode before/after, the expert cache's slots)")
    p.add_argument("--release", action="store_true",
                   help="with --squeeze: the 2 GiB are given back mid-run (the cache regrows)")
    p.add_argument("--squeeze-requests", type=positive, default=8, metavar="N",
                   help="requests of the --squeeze replay (default 8)")
    p.add_argument("--json", default=None, metavar="FILE",
                   help="also write the report as JSON ('-': stdout, the table then on stderr)")
    p.add_argument("--seed", type=int, default=0)
    _add_device(p)
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("bench-serve", prog="deimos bench serve",
                       help="(also `bench serve`) throughput and latencies of an OpenAI-"
                            "compatible server (deimos serve, llama-server) at several "
                            "concurrencies")
    _add_server_client(p)
    p.add_argument("--concurrency", type=_levels, default=(1, 4, 16, 64), metavar="C1,C2,...",
                   help="client tasks per level, each sending its next request when its last "
                        "one ends (default: 1,4,16,64)")
    p.add_argument("--prompt-tokens", type=positive, default=512,
                   help="prompt length: random words, calibrated on the server's usage")
    p.add_argument("--max-tokens", type=positive, default=128,
                   help="tokens per request (sent with ignore_eos)")
    p.add_argument("--requests", type=positive, default=None,
                   help="measured requests per level (default: 4 x concurrency, at least 8)")
    p.add_argument("--warmup", type=_checked(int, Bound(lo=0, integer=True)), default=None,
                   help="requests per level before the measured ones (default: the "
                        "concurrency)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--chat", dest="endpoint", action="store_const", const="chat",
                      help="/v1/chat/completions (the default)")
    mode.add_argument("--completions", dest="endpoint", action="store_const",
                      const="completions", help="/v1/completions")
    p.set_defaults(endpoint="chat")
    g = p.add_argument_group("sampling (sent only if given; else each server's defaults, "
                             "llama.cpp's sampler chain for both deimos serve and llama-server)")
    for dest, field in (("temperature", "temperature"), ("top_k", "top_k"), ("top_p", "top_p"),
                        ("min_p", "min_p"), ("repeat_penalty", "repetition_penalty"),
                        ("presence_penalty", "presence_penalty"),
                        ("frequency_penalty", "frequency_penalty"), ("sampling_seed", "seed")):
        kind = int if field in ("top_k", "seed") else float
        flag = "--sampling-seed" if dest == "sampling_seed" else SAMPLING_FLAGS[field]
        g.add_argument(flag, dest=dest, type=_checked(kind, SAMPLING_BOUNDS[field]), default=None,
                       help=f"the request's {' and '.join(SERVE_SAMPLING[dest])}")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts' random words")
    p.add_argument("--timeout", type=_checked(float, Bound(lo=0, lo_open=True)), default=600.0,
                   help="seconds a request may take before it is cut and counted as failed")
    p.add_argument("--constrained", type=_checked(int, Bound(lo=0, integer=True)), default=0,
                   metavar="N", help="N client tasks of each level send JSON-schema-constrained "
                                     "requests (an array of >= 512 short strings, no ignore_eos); "
                                     "the table adds the plain requests' rows")
    p.add_argument("--json", default=None, metavar="FILE",
                   help="also write the report with every request's record as JSON ('-': "
                        "stdout, the table then on stderr)")
    p.set_defaults(func=cmd_bench_serve)

    p = sub.add_parser("bench-agent", prog="deimos bench agent",
                       help="(also `bench agent`) replay a recorded coding-agent session against "
                            "an OpenAI-compatible server: wall time, prefill/decode rates, TTFT "
                            "and cached tokens per turn")
    p.add_argument("session", help="a session file (.jsonl or .jsonl.gz, one chat request a "
                                   "turn) or a recorded one: multi-turn, long-prompt, long-decode")
    _add_server_client(p)
    p.add_argument("--turns", type=positive, default=None, help="replay the first N turns only")
    p.add_argument("--tools-in-system", action="store_true",
                   help="send the tool schemas as system-prompt text, not as the tools field "
                        "(the same prompt text for servers whose templates render tools "
                        "differently; a server that holds replies while tools are on)")
    p.add_argument("--warmup", type=_checked(int, Bound(lo=0, integer=True)), default=1,
                   help="short unrelated requests before the session (default 1)")
    p.add_argument("--temperature", type=_checked(float, SAMPLING_BOUNDS["temperature"]),
                   default=None, help="sent as each request's temperature (default: the "
                                      "server's)")
    p.add_argument("--timeout", type=_checked(float, Bound(lo=0, lo_open=True)), default=600.0,
                   help="seconds a turn may take before it is cut and counted as failed")
    p.add_argument("--json", default=None, metavar="FILE",
                   help="also write the report with every turn's record as JSON ('-': stdout, "
                        "the table then on stderr)")
    p.set_defaults(func=cmd_bench_agent)

    p = sub.add_parser("pull", help="fetch a known model into the local cache")
    p.add_argument("name", nargs="?")
    p.add_argument("--list", action="store_true",
                   help="list known models: size, and whether each is in the cache")
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
    p.add_argument("--chat-template", metavar="FILE",
                   help="a Jinja chat template written as the file's tokenizer.chat_template "
                        "(e.g. llama.cpp's models/templates/meta-llama-Llama-3.1-8B-Instruct.jinja), "
                        "so every engine renders the same prompts")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=None, help="drawing threads (default: CPUs)")
    p.add_argument("--list", action="store_true", help="list the presets with sizes in --type")
    p.set_defaults(func=cmd_synth)
    return parser


def _model_arg(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """-m MODEL beside the positional one: with -m, the first positional is the next
    argument (``run -m smollm2 "prompt"``)."""
    if not hasattr(args, "model_opt"):
        return
    if args.model_opt is not None:
        after = getattr(args, "after_model", None)
        if args.model is not None:
            if after is None or getattr(args, after) is not None:
                parser.error(f"the model is given twice: {args.model!r} and -m {args.model_opt!r}")
            setattr(args, after, args.model)
        args.model = args.model_opt
    if args.model is None:
        parser.error(f"{args.command} needs a MODEL (or -m MODEL)")
    if getattr(args, "after_model", None) == "text" and args.text is None:
        parser.error("tokenize needs the TEXT to tokenize")


def parse_cli(parser: argparse.ArgumentParser, argv: Sequence[str]) -> argparse.Namespace:
    """``argv`` parsed, with a command's options and positionals in any order: ``deimos run
    MODEL --raw -n 12 "prompt"`` as well as ``deimos run MODEL "prompt" --raw -n 12`` (argparse
    alone refuses a positional after options once the command's subparser has begun: a first
    hour's "unrecognized arguments" for the prompt). The command's words are parsed again,
    intermixed, only when the plain parse leaves some over."""
    argv = _bench_serve_argv(argv)
    args, extra = parser.parse_known_args(argv)
    if not extra:
        return args
    sub = next((a.choices.get(args.command) for a in parser._actions
                if isinstance(a, argparse._SubParsersAction)), None)
    if sub is None or args.command not in argv:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    at = argv.index(args.command)
    try:
        inner = sub.parse_intermixed_args(argv[at + 1:])
    except TypeError:  # a parser intermixed parsing cannot take: argparse's own message
        return parser.parse_args(argv)
    for k, v in vars(inner).items():
        setattr(args, k, v)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parse_cli(parser, sys.argv[1:] if argv is None else argv)
    _model_arg(parser, args)
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
