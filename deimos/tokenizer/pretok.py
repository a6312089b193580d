"""Pre-tokenizer variants by ``tokenizer.ggml.pre`` (llama.cpp src/llama-vocab.cpp).

Each BPE vocab names its pre-tokenizer; it selects the splitting regexes and a few flags.
Only the variants listed here are supported; any other name is an error, as in llama.cpp.
"""

from __future__ import annotations

from dataclasses import dataclass

from .unicode import GPT2_RE, LLAMA3_RE, NEWLINES_RE, QWEN2_RE, QWEN35_RE


@dataclass(frozen=True)
class PreTokenizer:
    name: str  # llama.cpp's pre-type family (LLAMA_VOCAB_PRE_TYPE_*), lower case
    regexes: tuple[str, ...]
    ignore_merges: bool = False  # a word that is itself a token is not merged
    add_bos: bool | None = None  # overrides the BPE default (False) before metadata is read
    clean_spaces: bool = True  # detokenize: remove " ," " ." " 's" ... spaces
    byte_encode: bool = True  # GPT-2 byte->unicode encoding of words (False: raw UTF-8)
    escape_whitespaces: bool = False  # ' ' -> U+2581 before BPE (SPM-style BPE)
    no_bos: bool = False  # special BOS id is disabled (chatglm)


_DEFAULT = (
    "[\\p{P}\\$\\+<=>\\^~\\|]+",
    GPT2_RE,
    "\\p{N}+",
    "[0-9][0-9][0-9]",
)
# Copied with escapes: these literal ranges must not pass through Unicode normalization
# (e.g. U+1F7D would become U+03CE and break the range).
_DEEPSEEK_LLM = (
    "[\r\n]",
    "\\s?[A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293"
    "\u0295-\u02af\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c"
    "\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5"
    "\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77"
    "\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59"
    "\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc"
    "\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107"
    "\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139"
    "\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee"
    "\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e"
    "\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f"
    "\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2"
    "\U000118a0-\U000118df\U0001e900-\U0001e943]+",
    "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
    "\\s+$",
    "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+",
    "\\p{N}+",
)
_CJK = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"
_DEEPSEEK_CODER = ("[\r\n]", "\\s?\\p{L}+", "\\s?\\p{P}+", _CJK, "\\p{N}")
_FALCON = (
    "[\\p{P}\\$\\+<=>\\^~\\|`]+",
    GPT2_RE,
    "[0-9][0-9][0-9]",
)
_STARCODER = ("\\p{N}", GPT2_RE)


def _families() -> dict[str, PreTokenizer]:
    fam: dict[str, PreTokenizer] = {}

    def add(names: str, p: PreTokenizer) -> None:
        for n in names.split():
            fam[n] = p

    add("default", PreTokenizer("default", _DEFAULT))
    add(
        "llama3 llama-v3 llama-bpe falcon3 falcon-h1 pixtral midm-2.0 lfm2 jina-v5-nano",
        PreTokenizer("llama3", (LLAMA3_RE,), ignore_merges=True, add_bos=True),
    )
    add("dbrx", PreTokenizer("dbrx", (LLAMA3_RE,)))
    add("smaug-bpe", PreTokenizer("smaug", (LLAMA3_RE,)))
    add("chatglm-bpe", PreTokenizer("chatglm4", (LLAMA3_RE,), no_bos=True))
    add("glm4 glm5", PreTokenizer("chatglm4", (LLAMA3_RE,), no_bos=True, ignore_merges=True))
    add("deepseek-llm", PreTokenizer("deepseek-llm", _DEEPSEEK_LLM, clean_spaces=False))
    add("deepseek-coder", PreTokenizer("deepseek-coder", _DEEPSEEK_CODER, clean_spaces=False))
    add("falcon", PreTokenizer("falcon", _FALCON))
    add("mpt", PreTokenizer("mpt", (GPT2_RE,)))
    add(
        "gpt-2 phi-2 jina-es jina-de gigachat jina-v2-es jina-v2-de a.x-4.0 mellum modern-bert exaone4",
        PreTokenizer("gpt2", (GPT2_RE,)),
    )
    add("olmo", PreTokenizer("olmo", (GPT2_RE,)))
    add("jais", PreTokenizer("jais", (GPT2_RE,)))
    add("trillion", PreTokenizer("trillion", (GPT2_RE,), clean_spaces=False))
    add("granite-docling", PreTokenizer("granite-docling", (GPT2_RE,), clean_spaces=False))
    add("starcoder", PreTokenizer("starcoder", _STARCODER))
    add("refact", PreTokenizer("refact", _STARCODER))
    add("command-r", PreTokenizer("command-r", _STARCODER, clean_spaces=False))
    add("smollm", PreTokenizer("smollm", _STARCODER, clean_spaces=False))
    add("codeshell", PreTokenizer("codeshell", _STARCODER))
    add("exaone", PreTokenizer("exaone", _STARCODER))
    add("minerva-7b", PreTokenizer("minerva", _STARCODER))
    add("mellum2", PreTokenizer("mellum2", _STARCODER))
    add("qwen2 deepseek-r1-qwen kormo f2llmv2", PreTokenizer("qwen2", (QWEN2_RE,), clean_spaces=False))
    add("megrez", PreTokenizer("qwen2", (QWEN2_RE,)))
    add("stablelm2", PreTokenizer("stablelm2", (QWEN2_RE,)))
    add("hunyuan", PreTokenizer("hunyuan", (QWEN2_RE,), clean_spaces=False))
    add("solar-open", PreTokenizer("solar-open", (QWEN2_RE,), clean_spaces=False))
    add("grok-2", PreTokenizer("grok-2", (QWEN2_RE,), clean_spaces=False))
    add("qwen35", PreTokenizer("qwen35", (QWEN35_RE,), clean_spaces=False))
    add(
        "gemma4 granite-embed-multi-311m",
        PreTokenizer("gemma4", (NEWLINES_RE,), byte_encode=False, escape_whitespaces=True),
    )
    return fam


PRE_TOKENIZERS: dict[str, PreTokenizer] = _families()
