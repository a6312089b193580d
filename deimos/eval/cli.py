"""``deimos perplexity`` (and ``quant-check --kld``): flags, model loading, output.

    deimos perplexity MODEL TEXT [-c 512] [--chunks N]                 perplexity
    deimos perplexity REF TEXT --kl-divergence-base BASE.bin           ... and save REF's log-probs
    deimos perplexity MODEL --kl-divergence-base BASE.bin --kl-divergence   KLD against them

TEXT is a file (read as ``llama-perplexity -f`` reads it) or a known text's name
(``alice29``: see deimos.eval.corpus). Progress goes to stderr, the result to stdout
(``--json -``: the JSON on stdout, the table on stderr).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from deimos.eval import corpus, kld
from deimos.eval.logits_file import LogitsFileError, LogProbFile, LogProbHeader, LogProbWriter

# The parsers are built on every `deimos` call: torch (deimos.eval.perplexity) is imported by
# the commands only. These equal perplexity.DEFAULT_CTX / DEFAULT_BATCH.
DEFAULT_CTX = 512
DEFAULT_BATCH = 512


@dataclass
class Loaded:
    """A model file opened: its tokenizer at once, the weights on demand (``model``), so bad
    input (a text, -c, a base file) is refused before the weights are loaded."""

    path: Path
    file: object  # GGUFFile
    tokenizer: object  # Tokenizer
    vocab_sha256: str
    device: str
    _model: object = None

    @property
    def model(self):
        if self._model is None:
            from deimos.models import load_model

            self._model = load_model(self.file, device=self.device)
        return self._model

    @property
    def n_vocab(self) -> int:
        """Columns of the logits (the model's, read from the metadata without the weights)."""
        from deimos.models import ModelConfig

        return ModelConfig.from_gguf(self.file.metadata, source=str(self.path)).n_vocab

    @property
    def bos_id(self) -> int | None:
        """The BOS that starts every window (llama.cpp: when the vocabulary adds BOS)."""
        return self.tokenizer.bos_id if self.tokenizer.add_bos else None


def load(model: str, device: str) -> Loaded:
    from deimos.eval.perplexity import PerplexityError
    from deimos.gguf import GGUFFile
    from deimos.registry import resolve
    from deimos.tokenizer import Tokenizer

    if device != "cpu":
        from deimos.runtime.kernel_cache import use_kernel_cache

        use_kernel_cache()
    path = resolve(model)
    f = GGUFFile(path)
    tok = Tokenizer.from_gguf(f)
    if tok.vocab.add_eos:
        raise PerplexityError(f"{path.name}: its vocabulary adds EOS after a text; perplexity "
                              "windows would end in it (llama-perplexity refuses such models too)")
    fingerprint = corpus.vocab_fingerprint(list(f.metadata.get("tokenizer.ggml.tokens", [])))
    return Loaded(path, f, tok, fingerprint, device)


def tokenize(m: Loaded, text_arg: str) -> tuple[Path, np.ndarray]:
    path = corpus.resolve_text(text_arg)
    ids = m.tokenizer.encode(corpus.read_text(path), add_special=True, parse_special=False)
    return path, np.asarray(ids, dtype=np.int64)


def _progress(label: str):
    def report(done: int, total: int, ppl: float) -> None:
        print(f"{label}: [{done}/{total}] PPL {ppl:.4f}", file=sys.stderr, flush=True)
    return report


def _emit(lines: list[str], payload: dict, json_dest: str | None) -> None:
    text = "\n".join(lines)
    if json_dest == "-":
        print(text, file=sys.stderr)
        print(json.dumps(payload, indent=2))
        return
    print(text)
    if json_dest:
        Path(json_dest).write_text(json.dumps(payload, indent=2) + "\n")


def cmd_perplexity(args: argparse.Namespace) -> int:
    from deimos.cli import _default_device
    from deimos.eval.perplexity import PerplexityError, evaluate, plan_windows
    from deimos.eval.report import perplexity_lines

    device = args.device or _default_device()
    if args.kl_divergence and not args.kl_divergence_base:
        raise PerplexityError("--kl-divergence needs --kl-divergence-base FILE (the reference "
                              "run's log-probabilities)")
    if not args.kl_divergence and args.text is None:
        raise PerplexityError("perplexity needs a TEXT (a file, or a known text: "
                              f"{', '.join(corpus.TEXTS)})")
    m = load(args.model, device)
    n_vocab = m.n_vocab
    if args.kl_divergence:
        base = LogProbFile(args.kl_divergence_base)
        h = base.header
        base.check_matches(n_vocab=n_vocab, vocab_sha256=m.vocab_sha256, n_ctx=args.ctx_size)
        text_name = h.text or "(tokens of the base file)"
        if args.text is not None:
            path, ids = tokenize(m, args.text)
            base.check_matches(n_vocab=n_vocab, tokens=ids)
            text_name = path.name
        tokens = np.asarray(base.tokens, dtype=np.int64)
        w = plan_windows(tokens.shape[0], h.n_ctx, args.chunks)
        result = evaluate(m.model, tokens, w, bos_id=m.bos_id, n_batch=args.batch_size,
                          base_in=base, progress=_progress("kl-divergence"),
                          labels=(m.path.name, text_name))
    else:
        path, ids = tokenize(m, args.text)
        w = plan_windows(ids.shape[0], args.ctx_size or DEFAULT_CTX, args.chunks)
        labels = (m.path.name, path.name)
        if args.kl_divergence_base:
            header = LogProbHeader(m.path.name, n_vocab, w.n_ctx, w.n_chunk, m.vocab_sha256,
                                   path.name, f"deimos {device}")
            with LogProbWriter(args.kl_divergence_base, header,
                               ids[:w.n_chunk * w.n_ctx]) as out:
                result = evaluate(m.model, ids, w, bos_id=m.bos_id, n_batch=args.batch_size,
                                  base_out=out, progress=_progress("perplexity"), labels=labels)
        else:
            result = evaluate(m.model, ids, w, bos_id=m.bos_id, n_batch=args.batch_size,
                              progress=_progress("perplexity"), labels=labels)
    _emit(perplexity_lines(result), result.to_json(), args.json)
    return 0


def add_perplexity_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("perplexity", help="perplexity of a text (llama-perplexity's), and KL-"
                       "divergence against a reference run's log-probabilities")
    p.add_argument("model", help="a GGUF file, or a known model name")
    p.add_argument("text", nargs="?", default=None,
                   help=f"a text file, or a known text ({', '.join(corpus.TEXTS)}); optional "
                        "with --kl-divergence (the base file holds the tokens)")
    p.add_argument("-c", "--ctx-size", type=int, default=None,
                   help=f"tokens per window, the second half scored (default {DEFAULT_CTX}; "
                        "with --kl-divergence: the base file's)")
    p.add_argument("--chunks", type=int, default=None, help="score only the first N windows")
    p.add_argument("-b", "--batch-size", type=int, default=DEFAULT_BATCH,
                   help="tokens per forward step (default %(default)s)")
    p.add_argument("--kl-divergence-base", default=None, metavar="FILE",
                   help="without --kl-divergence: save every scored position's log-probabilities "
                        "to FILE; with it: read them (Deimos's or llama-perplexity's file)")
    p.add_argument("--kl-divergence", action="store_true",
                   help="KL-divergence, top-token agreement and Δp against --kl-divergence-base")
    p.add_argument("--json", default=None, metavar="FILE",
                   help="also write the result as JSON ('-': stdout, the table then on stderr)")
    p.add_argument("--device", default=None, metavar="cuda|cpu",
                   help="cuda: the GPU kernels (prefill path); cpu: the float32 reference")
    p.set_defaults(func=cmd_perplexity)
    return p


# ---- quant-check --kld ------------------------------------------------------------------


def add_kld_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kld", nargs="?", const="alice29", default=None, metavar="TEXT",
                   help="also run both models on TEXT (default alice29) and report the "
                        "quantized model's KL-divergence from the reference")
    p.add_argument("--kld-ctx", type=int, default=DEFAULT_CTX, help="window for --kld")
    p.add_argument("--kld-chunks", type=int, default=4, help="windows for --kld (default 4)")
    p.add_argument("--device", default="cpu", metavar="cuda|cpu", help="where --kld runs")


def quant_kld(quant: str, reference: str, text: str, n_ctx: int, n_chunks: int | None,
              device: str = "cpu", progress=None) -> kld.KLDSummary:
    """KLD of ``quant`` against ``reference`` on ``text``, window by window, both in memory:
    the reference's log-probabilities exact (no 16-bit file in between, ``floor=None``)."""
    from deimos.eval.perplexity import plan_windows, window_input, window_logits, window_targets
    from deimos.runtime.kv_cache import KVCache

    ref, q = load(reference, device), load(quant, device)
    if ref.vocab_sha256 != q.vocab_sha256:
        raise LogitsFileError(f"{quant} and {reference} have different vocabularies: their "
                              "distributions cannot be compared token by token")
    _, ids = tokenize(ref, text)
    w = plan_windows(ids.shape[0], n_ctx, n_chunks)
    kv_r = KVCache(ref.model.config, w.n_ctx, device=device)
    kv_q = KVCache(q.model.config, w.n_ctx, device=device)
    stats = []
    for i in range(w.n_chunk):
        targets = window_targets(ids, w, i)
        lr = window_logits(ref.model, kv_r, window_input(ids, w, i, ref.bos_id), w.first)
        lq = window_logits(q.model, kv_q, window_input(ids, w, i, q.bos_id), w.first)
        for r in range(0, targets.shape[0], 64):  # bounds the float64 rows (262k vocabularies)
            stats.append(kld.compare_positions(kld.log_softmax(lr[r:r + 64].cpu().numpy()),
                                               kld.log_softmax(lq[r:r + 64].cpu().numpy()),
                                               targets[r:r + 64]))
        if progress is not None:
            progress(i + 1, w.n_chunk, float(np.exp(np.concatenate([s.nll for s in stats]).mean())))
    return kld.summarize(kld.PositionStats.concat(stats))


def run_quant_kld(args: argparse.Namespace) -> list[str]:
    from deimos.eval.report import kld_lines

    s = quant_kld(args.quant, args.reference, args.kld, args.kld_ctx, args.kld_chunks,
                  args.device, _progress("kld"))
    return [f"KL-divergence of {Path(args.quant).name} from {Path(args.reference).name} on "
            f"{args.kld} ({args.kld_chunks} windows of {args.kld_ctx}):", *kld_lines(s)]


__all__ = ["add_kld_options", "add_perplexity_parser", "cmd_perplexity", "quant_kld",
           "run_quant_kld"]
