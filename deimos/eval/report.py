"""Tables of ``deimos perplexity`` and ``quant-check --kld``: the lines llama-perplexity prints,
with the same statistics in the same order, so the two outputs can be read side by side."""

from __future__ import annotations

from deimos.eval.kld import KLDSummary
from deimos.eval.perplexity import PerplexityResult


def perplexity_lines(r: PerplexityResult) -> list[str]:
    w, p = r.windows, r.ppl
    out = [f"model {r.model}, text {r.text}, device {r.device}",
           f"{w.n_tokens} tokens, {w.n_chunk} chunks of {w.n_ctx} (second half scored: "
           f"{r.nll.shape[0]} tokens), {r.seconds:.1f} s",
           f"Final estimate: PPL = {p.value:.4f} +/- {p.unc:.5f}"]
    if r.base is not None and r.kld is None:
        out.append(f"log-probabilities saved to {r.base}")
    if r.kld is not None:
        out += ["", f"against the reference log-probabilities of {r.base}:", *kld_lines(r.kld)]
    return out


def kld_lines(s: KLDSummary) -> list[str]:
    """llama.cpp's three blocks (perplexity, KL divergence, token probability statistics)."""
    out = ["====== Perplexity statistics ======",
           f"Mean PPL(Q)                   : {s.ppl.value:10.6f} ± {s.ppl.unc:10.6f}",
           f"Mean PPL(base)                : {s.ppl_ref.value:10.6f} ± {s.ppl_ref.unc:10.6f}",
           f"Cor(ln(PPL(Q)), ln(PPL(base))): {100 * s.cor_ln_ppl:6.2f}%",
           f"Mean ln(PPL(Q)/PPL(base))     : {s.ln_ppl_ratio.value:10.6f} ± "
           f"{s.ln_ppl_ratio.unc:10.6f}",
           f"Mean PPL(Q)/PPL(base)         : {s.ppl_ratio.value:10.6f} ± {s.ppl_ratio.unc:10.6f}",
           f"Mean PPL(Q)-PPL(base)         : {s.ppl_diff.value:10.6f} ± {s.ppl_diff.unc:10.6f}",
           "", "====== KL divergence statistics ======",
           f"Mean    KLD: {s.kld.value:10.6f} ± {s.kld.unc:10.6f}"]
    out += [f"{_label(k)} KLD: {v:10.6f}" for k, v in s.kld_percentiles.items()]
    out += ["", "====== Token probability statistics ======",
            f"Mean    Δp: {100 * s.delta_p.value:6.3f} ± {100 * s.delta_p.unc:5.3f} %"]
    out += [f"{_label(k)} Δp: {100 * v:6.3f}%" for k, v in s.delta_p_percentiles.items()]
    out += [f"RMS Δp    : {100 * s.rms_delta_p.value:6.3f} ± {100 * s.rms_delta_p.unc:5.3f} %",
            f"Same top p: {100 * s.same_top.value:6.3f} ± {100 * s.same_top.unc:5.3f} %"]
    return out


def _label(key: str) -> str:
    """llama.cpp's row labels: 'Maximum', '99.9%  ', 'Median ', ' 5.0%  ', 'Minimum'."""
    named = {"max": "Maximum", "median": "Median ", "min": "Minimum"}
    if key in named:
        return named[key]
    return f"{float(key):4.1f}%  "
