"""Regenerate tests/test_tokenizer_golden.json by asking llama.cpp itself (libllama via ctypes).

    LD_LIBRARY_PATH=$DEIMOS_TEST_DATA/llama-cpu python tools/make_tokenizer_golden.py \
        $DEIMOS_TEST_DATA/llama-cpu/libllama.so

Loads each vocab with ``vocab_only`` and records, for a fixed set of inputs (plus texts
built from each vocab's own control tokens): llama_tokenize for three (add_special,
parse_special) settings, llama_detokenize of the result both ways, the special ids and
flags, the end-of-generation set, the non-normal token attributes, and a digest of every
token's piece (tokenizer_support.pieces_digest, shared with the test that reads it). The
files come from the test data (tests/testdata.py, so the same $DEIMOS_TEST_DATA and default);
libllama.so is not fetched by tools/fetch_test_data.py: it is llama.cpp's prebuilt CPU build.
"""

from __future__ import annotations

import ctypes
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests")]
from testdata import LLAMA_CPP, data_dir  # noqa: E402
from tokenizer_support import pieces_digest  # noqa: E402

LLAMA_CPP_BUILD = "11434"
VOCABS = [  # (name, path relative to $DEIMOS_TEST_DATA)
    *[
        (n, f"{LLAMA_CPP}/models/ggml-vocab-{n}.gguf")
        for n in (
            "command-r deepseek-coder deepseek-llm falcon gemma-4 gpt-2 llama-bpe llama-spm "
            "mpt phi-3 qwen2 qwen35 refact starcoder"
        ).split()
    ],
    ("smollm2", "models/SmolLM2-135M-Instruct.Q4_1.gguf"),
    ("gemma3", "models/gemma-3-270m-q4_k_m.gguf"),
]

INPUTS = [
    "",
    " ",
    "Hello world",
    " Hello world",
    "  leading spaces and trailing  ",
    "Hello, y'all! How are you 😁 ?我想在apple工作1314151天～",
    "I'M SURE YOU'LL SEE they'RE here, we'VE 'S 'd",
    "3 33 333 3333 33333 1234567890 ٣٤٥ ½ x²",
    "\n\n\n \t\t\n\r\n  \r  tabs\tand\u00a0nbsp\u2009thin\u3000ideographic",
    "🚀 (normal) 😶‍🌫️ (multiple emojis concatenated) ✅ 🦙🦙 👨‍👩‍👧‍👦",
    "нещо на Български ελληνικά עברית العربية हिन्दी ไทย 한국어 日本語のテキスト",
    "e\u0301 n\u0303 a\u0308\u0323 combining marks; Ω Å ﬁ ＡＢＣ ｶﾀｶﾅ",
    "def f(x):\n    return x**2  # comment\n\n\nclass A:\n\tpass\n",
    "<s> </s> <unk> <|endoftext|> <|im_start|>user\nhi<|im_end|> <start_of_turn> <end_of_turn>",
    "Special-ish: <|im_start|><|im_start|>  <|im_end|>\n<eos><bos>",
    "a\u2581b \u2581 \u2581\u2581 <0x41> [UNK_BYTE_0x80]",
    "unpaired surrogates are not valid str, but U+FFFD \ufffd and U+0000 \x00 and \x7f are",
    "The quick brown fox jumps over the lazy dog. " * 3
    + "Lorem ipsum dolor sit amet, consectetur adipiscing elit; 12.5% of $1,234.56 — “quoted” ‘text’…",
]


class _ModelParams(ctypes.Structure):  # include/llama.h struct llama_model_params (build 11434)
    _fields_ = [
        ("devices", ctypes.c_void_p), ("tensor_buft_overrides", ctypes.c_void_p),
        ("n_gpu_layers", ctypes.c_int32), ("split_mode", ctypes.c_int32),
        ("load_mode", ctypes.c_int32), ("lazy_mode", ctypes.c_int32), ("main_gpu", ctypes.c_int32),
        ("tensor_split", ctypes.c_void_p), ("progress_callback", ctypes.c_void_p),
        ("progress_callback_user_data", ctypes.c_void_p), ("kv_overrides", ctypes.c_void_p),
        ("vocab_only", ctypes.c_bool), ("check_tensors", ctypes.c_bool),
        ("use_extra_bufts", ctypes.c_bool), ("no_host", ctypes.c_bool),
        ("no_alloc", ctypes.c_bool), ("load_mtp", ctypes.c_bool),
    ]  # fmt: skip


class _Llama:
    def __init__(self, lib_path: str):
        lib = ctypes.CDLL(lib_path)
        vp, i32, b = ctypes.c_void_p, ctypes.c_int32, ctypes.c_bool
        lib.llama_model_default_params.restype = _ModelParams
        lib.llama_model_load_from_file.restype = vp
        lib.llama_model_load_from_file.argtypes = [ctypes.c_char_p, _ModelParams]
        lib.llama_model_free.argtypes = [vp]
        lib.llama_model_get_vocab.restype = vp
        lib.llama_model_get_vocab.argtypes = [vp]
        lib.llama_tokenize.restype = i32
        lib.llama_tokenize.argtypes = [vp, ctypes.c_char_p, i32, ctypes.POINTER(i32), i32, b, b]
        lib.llama_detokenize.restype = i32
        lib.llama_detokenize.argtypes = [vp, ctypes.POINTER(i32), i32, ctypes.c_char_p, i32, b, b]
        lib.llama_token_to_piece.restype = i32
        lib.llama_token_to_piece.argtypes = [vp, i32, ctypes.c_char_p, i32, i32, b]
        for fn in ("bos", "eos", "eot", "nl", "pad", "sep", "n_tokens"):
            getattr(lib, f"llama_vocab_{fn}").restype = i32
            getattr(lib, f"llama_vocab_{fn}").argtypes = [vp]
        for fn in ("get_add_bos", "get_add_eos"):
            getattr(lib, f"llama_vocab_{fn}").restype = b
            getattr(lib, f"llama_vocab_{fn}").argtypes = [vp]
        lib.llama_vocab_is_eog.restype = b
        lib.llama_vocab_is_eog.argtypes = [vp, i32]
        lib.llama_vocab_get_attr.restype = i32
        lib.llama_vocab_get_attr.argtypes = [vp, i32]
        lib.llama_vocab_get_text.restype = ctypes.c_char_p
        lib.llama_vocab_get_text.argtypes = [vp, i32]
        lib.llama_backend_init()
        self.lib = lib

    def load(self, path: str) -> tuple[int, int]:
        p = self.lib.llama_model_default_params()
        p.vocab_only = True
        m = self.lib.llama_model_load_from_file(path.encode(), p)
        if not m:
            raise RuntimeError(f"llama.cpp could not load {path}")
        return m, self.lib.llama_model_get_vocab(m)

    def tokenize(self, v: int, text: str, add_special: bool, parse_special: bool) -> list[int]:
        raw = text.encode("utf-8")
        cap = len(raw) + 8
        buf = (ctypes.c_int32 * cap)()
        n = self.lib.llama_tokenize(v, raw, len(raw), buf, cap, add_special, parse_special)
        assert n >= 0, n
        return list(buf[:n])

    def detokenize(self, v: int, ids: list[int], remove_special: bool, unparse_special: bool) -> bytes:
        arr = (ctypes.c_int32 * max(1, len(ids)))(*ids)
        cap = 64 + 64 * len(ids)
        buf = ctypes.create_string_buffer(cap)
        n = self.lib.llama_detokenize(v, arr, len(ids), buf, cap, remove_special, unparse_special)
        assert n >= 0, n
        return buf.raw[:n]

    def piece(self, v: int, tid: int, special: bool) -> bytes:
        buf = ctypes.create_string_buffer(512)
        n = self.lib.llama_token_to_piece(v, tid, buf, 512, 0, special)
        assert n >= 0, n
        return buf.raw[:n]


def _none(x: int) -> int | None:
    return None if x < 0 else x


def record(ll: _Llama, path: str) -> dict:
    model, v = ll.load(path)
    lib = ll.lib
    n = lib.llama_vocab_n_tokens(v)
    attrs = [lib.llama_vocab_get_attr(v, i) for i in range(n)]
    control = [i for i in range(n) if attrs[i] & (1 << 3)]
    texts = [lib.llama_vocab_get_text(v, i).decode("utf-8", "replace") for i in control[:4]]
    inputs = list(INPUTS)
    if texts:
        inputs.append("".join(f"{t} x{k} " for k, t in enumerate(texts)))
        inputs.append(f"{texts[0]}\n  {texts[-1]}\tHello{texts[0]}{texts[0]}")
    cases = []
    for s in inputs:
        case = {"text": s}
        for key, a, p in (("plain", False, False), ("add", True, False), ("add_parse", True, True)):
            case[key] = ll.tokenize(v, s, a, p)
        ids = case["add_parse"]
        case["decode_keep"] = ll.detokenize(v, ids, False, True).decode("utf-8", "replace")
        case["decode_skip"] = ll.detokenize(v, ids, True, False).decode("utf-8", "replace")
        cases.append(case)
    out = {
        "path": path,
        "n_vocab": n,
        "bos": _none(lib.llama_vocab_bos(v)),
        "eos": _none(lib.llama_vocab_eos(v)),
        "eot": _none(lib.llama_vocab_eot(v)),
        "nl": _none(lib.llama_vocab_nl(v)),
        "pad": _none(lib.llama_vocab_pad(v)),
        "add_bos": lib.llama_vocab_get_add_bos(v),
        "add_eos": lib.llama_vocab_get_add_eos(v),
        "eog": [i for i in range(n) if lib.llama_vocab_is_eog(v, i)],
        "attrs": {str(i): a for i, a in enumerate(attrs) if a != 4},  # 4 = NORMAL
        "pieces_special": pieces_digest([ll.piece(v, i, True) for i in range(n)]),
        "pieces_plain": pieces_digest([ll.piece(v, i, False) for i in range(n)]),
        "cases": cases,
    }
    lib.llama_model_free(model)
    return out


def main() -> None:
    root = data_dir()
    ll = _Llama(sys.argv[1] if len(sys.argv) > 1 else "libllama.so")
    data = {"llama_cpp_build": LLAMA_CPP_BUILD, "vocabs": {}}
    for name, rel in VOCABS:
        print("recording", name, file=sys.stderr)
        rec = record(ll, str(root / rel))
        rec["path"] = rel
        data["vocabs"][name] = rec
    out = REPO / "tests" / "test_tokenizer_golden.json"
    out.write_text(json.dumps(data, ensure_ascii=False, separators=(",", ":")))
    print(f"wrote {out} ({out.stat().st_size} bytes)", file=sys.stderr)


if __name__ == "__main__":
    main()
