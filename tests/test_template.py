"""Chat templates. Oracles: llama.cpp's own chat-template test expectations (parsed from
tests/test-chat-template.cpp), the real templates shipped in llama.cpp/models/templates, the
SmolLM2 GGUF's template, and ChatML/gemma strings spelled out from llama.cpp's C++ formats."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from datetime import datetime

import pytest
from chat_support import LLAMA_CONVERSATION, llama_chat_cases, read_vocab
from testdata import LLAMA_CPP, data_dir, llama_cpp_path, model_path

from deimos.tokenizer.template import (
    CHATML_TEMPLATE,
    GEMMA_TEMPLATE,
    PLAIN_TEMPLATE,
    ChatTemplate,
    TemplateError,
    TemplateLimits,
)

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "Weather in Paris?"},
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather for a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "description": "City name"}},
                "required": ["city"],
            },
        },
    }
]

# -- llama.cpp's expected outputs ---------------------------------------------------------------

_CASES = llama_chat_cases()


@pytest.mark.parametrize("case", [c for c in _CASES if c.supported_with_jinja], ids=lambda c: c.name)
def test_llama_cpp_chat_template_cases(case):
    msgs = LLAMA_CONVERSATION + [{"role": r, "content": c} for r, c in case.extra_conversation]
    out = ChatTemplate(case.template_str, case.bos_token, case.eos_token).render(msgs)
    assert out == case.expected


def test_llama_cpp_cases_were_parsed():
    # the parser must not silently lose cases: the C++ file has 36, 35 renderable with jinja
    assert len(_CASES) >= 30
    assert all(c.template_str and c.expected for c in _CASES)


# -- real templates -----------------------------------------------------------------------------

# not checked here: a missing folder fails test_template_dir_present, not the collection
_TEMPLATE_DIR = data_dir() / LLAMA_CPP / "models" / "templates"
_TEMPLATES = sorted(p.name for p in _TEMPLATE_DIR.glob("*.jinja"))

# Templates whose legitimate response to our plain input is an error (checked to be a
# TemplateError naming the cause): tool_use variants iterate `tools` unconditionally,
# firefunction reads a `functions` variable.
# tool-use templates that loop over ``tools`` unconditionally: without tools they render with
# none (llama.cpp's engine iterates a null as nothing; Jinja itself raises)
_LOOPS_OVER_TOOLS = {
    "CohereForAI-c4ai-command-r-plus-tool_use.jinja",
    "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use.jinja",
    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja",
}
_NEEDS_FUNCTIONS_VAR = {"fireworks-ai-llama-3-firefunction-v2.jinja"}


def test_template_dir_present():
    llama_cpp_path("models/templates")
    assert len(_TEMPLATES) > 50


@pytest.mark.parametrize("name", _TEMPLATES)
def test_real_template_renders(name):
    t = ChatTemplate((_TEMPLATE_DIR / name).read_text("utf-8"), "<s>", "</s>")
    for tools in (None, TOOLS):
        if name in _NEEDS_FUNCTIONS_VAR:
            with pytest.raises(TemplateError, match="undefined"):
                t.render(CONVERSATION, tools=tools)
            continue
        out = t.render(CONVERSATION, tools=tools)
        if tools is None and name in _LOOPS_OVER_TOOLS:
            assert "get_weather" not in out
        # every message's text reaches the prompt (system possibly merged into the user turn)
        for m in CONVERSATION:
            assert m["content"] in out, (name, m)
        if tools is not None and "tools" in t.source:
            assert "get_weather" in out
        # the generation prompt only ever adds text
        assert len(t.render(CONVERSATION, tools=tools, add_generation_prompt=False)) <= len(out)


def test_gemma2_requires_no_system_and_merges_like_llama_cpp():
    t = ChatTemplate((_TEMPLATE_DIR / "google-gemma-2-2b-it.jinja").read_text("utf-8"), "<bos>", "")
    assert not t.supports_system_role
    out = t.render(CONVERSATION)
    assert "<start_of_turn>user\nYou are terse.\nHi<end_of_turn>" in out
    # what the template itself says about a system role, when called directly
    with pytest.raises(TemplateError, match="System role not supported") as info:
        t._render(CONVERSATION, add_generation_prompt=True, tools=None)
    assert info.value.raised_by_template


def test_alternation_error_is_template_error():
    src = (
        "{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('Conversation roles must alternate') }}{% endif %}"
        "{{ m['content'] }}{% endfor %}"
    )
    t = ChatTemplate(src)
    with pytest.raises(TemplateError, match="Conversation roles must alternate") as info:
        t.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    assert info.value.raised_by_template


def test_enable_thinking_passthrough():
    t = ChatTemplate((_TEMPLATE_DIR / "Qwen-Qwen3-0.6B.jinja").read_text("utf-8"))
    on = t.render(CONVERSATION[1:2])
    off = t.render(CONVERSATION[1:2], enable_thinking=False)
    assert off == on + "<think>\n\n</think>\n\n"


# -- the SmolLM2 model's own template -------------------------------------------------------------


def test_smollm2_template_from_gguf():
    md, tokens, _ = read_vocab(model_path("SmolLM2-135M-Instruct.Q4_1.gguf"))
    t = ChatTemplate.from_metadata(md, tokens)
    assert t.source == md["tokenizer.chat_template"]
    assert (t.bos_token, t.eos_token) == ("<|im_start|>", "<|im_end|>")
    out = t.render([{"role": "user", "content": "What is 2+2?"}])
    assert out == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
        "<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    )
    out = t.render(CONVERSATION[:3], add_generation_prompt=False)
    assert out == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n"
    )


def test_gemma3_base_has_no_template_and_gets_gemma_turns():
    md, tokens, _ = read_vocab(model_path("gemma-3-270m-q4_k_m.gguf"))
    assert "tokenizer.chat_template" not in md
    t = ChatTemplate.from_metadata(md, tokens)
    assert t.source == GEMMA_TEMPLATE
    assert (t.bos_token, t.eos_token) == ("<bos>", "<eos>")
    # llama.cpp's gemma format (llm_chat_apply_template, LLM_CHAT_TEMPLATE_GEMMA) on the
    # conversation of its test: system trimmed and joined to the first user turn by "\n\n",
    # contents trimmed, assistant called "model"
    assert t.render(LLAMA_CONVERSATION) == (
        "<start_of_turn>user\nYou are a helpful assistant\n\nHello<end_of_turn>\n"
        "<start_of_turn>model\nHi there<end_of_turn>\n<start_of_turn>user\nWho are you"
        "<end_of_turn>\n<start_of_turn>model\nI am an assistant<end_of_turn>\n"
        "<start_of_turn>user\nAnother question<end_of_turn>\n<start_of_turn>model\n"
    )


# -- defaults -----------------------------------------------------------------------------------


def test_default_chatml_exact():
    md = {"tokenizer.ggml.bos_token_id": 0, "tokenizer.ggml.eos_token_id": 2}
    t = ChatTemplate.from_metadata(md, ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "a"])
    assert t.source == CHATML_TEMPLATE
    assert t.render(CONVERSATION) == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert t.render(CONVERSATION[:1], add_generation_prompt=False) == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
    )


def test_default_plain():
    t = ChatTemplate.from_metadata({}, ["a", "b"])
    assert t.source == PLAIN_TEMPLATE
    assert t.render(CONVERSATION[:2]) == "system: You are terse.\nuser: Hi\nassistant: "


def test_from_metadata_rejects_bad_token_id():
    with pytest.raises(TemplateError, match="eos_token_id = 9"):
        ChatTemplate.from_metadata({"tokenizer.ggml.eos_token_id": 9}, ["a"])


# -- helpers templates use ------------------------------------------------------------------------


def test_tojson_follows_hf(monkeypatch):
    data = {"b": "é<x>", "a": [1, 2]}
    t = ChatTemplate(
        "{{ d | tojson }}|{{ d | tojson(indent=2) }}|{{ d | tojson(ensure_ascii=True) }}|"
        "{{ d | tojson(separators=[',', ':']) }}|{{ d | tojson(sort_keys=true) }}"
    )
    out = t.render([], d=data)
    assert out.split("|") == [
        json.dumps(data, ensure_ascii=False),
        json.dumps(data, ensure_ascii=False, indent=2),
        json.dumps(data, ensure_ascii=True),
        json.dumps(data, ensure_ascii=False, separators=(",", ":")),
        json.dumps(data, ensure_ascii=False, sort_keys=True),
    ]
    # a lazy part (written as a list, as llama.cpp's engine does): charged as produced, never
    # through the one-call encoder (which would build the whole text before any charge); nor
    # a value with separators the walk's bound does not count
    want = ['["1", "2"]', '{"x": ["1", "2"]}', json.dumps(data, ensure_ascii=False, separators=(",", ":"))]
    plain = json.dumps(data, ensure_ascii=False)
    calls = []
    real = json.JSONEncoder.encode
    monkeypatch.setattr(json.JSONEncoder, "encode", lambda self, o: calls.append(o) or real(self, o))
    lazy = ChatTemplate("{{ d.a | map('string') | tojson }}|{{ {'x': d.a | map('string')} | tojson }}"
                        "|{{ d | tojson(separators=[',', ':']) }}")
    assert lazy.render([], d=data).split("|") == want
    assert calls == []
    assert t.render([], d=data).split("|")[0] == plain
    assert len(calls) >= 1  # the plain value: the fast path
    # the walk's bound holds for JSON text with keys that are not strings (written quoted)
    from deimos.tokenizer.template_budget import Budget, TemplateLimits

    for v in ({i: "" for i in range(1, 8)}, {True: None, None: 1.5, 2.5: [1]}):
        bound, exact = Budget(TemplateLimits())._measure_json(v, ascii_only=False)
        assert exact and bound >= len(json.dumps(v, ensure_ascii=False)), v


def test_strftime_now_and_loop_controls():
    t = ChatTemplate(
        "{{ strftime_now('%d %b %Y') }}:{% for i in range(10) %}{% if i == 2 %}{% continue %}"
        "{% endif %}{% if i == 4 %}{% break %}{% endif %}{{ i }}{% endfor %}",
        now=lambda: datetime(2024, 7, 26),
    )
    assert t.render([]) == "26 Jul 2024:013"


def test_trim_and_lstrip_blocks():
    t = ChatTemplate("  {% if true %}\nA\n  {% endif %}\nB")
    assert t.render([]) == "A\nB"


def test_generation_tag_renders_body():
    t = ChatTemplate("{% generation %}X{{ 1 }}{% endgeneration %}Y")
    assert t.render([]) == "X1Y"


# -- errors and the sandbox ------------------------------------------------------------------


@pytest.mark.parametrize(
    "src, match",
    [
        ("{{ ''.__class__.__mro__ }}", "unsafe"),
        ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "unsafe"),
        ("{{ messages.__class__ }}", "unsafe"),
        ("{{ raise_exception.__globals__ }}", "unsafe"),
        ("{{ cycler.__init__.__globals__.os }}", "unsafe"),
        ("{% set x = [] %}{{ x.append(1) }}", "unsafe"),
        ("{{ (messages[0]).update({'role': 'x'}) }}", "unsafe"),
    ],
)
def test_sandbox_escapes_refused(src, match):
    msgs = [{"role": "user", "content": "hi"}]
    with pytest.raises(TemplateError, match=match):
        ChatTemplate(src).render(msgs)
    assert msgs == [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    "src, match",
    [
        ("{% for m in messages %}{{ m }", "syntax error at line 1"),
        ("{% if %}", "syntax error"),
        ("{% endfor %}", "syntax error"),
        ("{{ x | no_such_filter }}", "no_such_filter"),
    ],
)
def test_syntax_errors(src, match):
    with pytest.raises(TemplateError, match=match):
        ChatTemplate(src)


def test_undefined_misuse_and_python_errors():
    with pytest.raises(TemplateError, match="undefined value"):
        ChatTemplate("{{ nothing.attr }}").render([])
    with pytest.raises(TemplateError, match="ZeroDivisionError"):
        ChatTemplate("{{ 1 // 0 }}").render([])
    assert ChatTemplate("[{{ nothing }}]").render([]) == "[]"  # lenient like HF


@pytest.mark.parametrize(
    "src",
    [
        "{% for i in range(10**9) %}{% endfor %}",
        "{% for i in range(20000) %}{% for j in range(20000) %}{% endfor %}{% endfor %}",
        "{% set xs = range(20000) | list %}{% for i in xs %}{% for j in xs %}{% endfor %}"
        "{% endfor %}",
        "{{ 'a' * 10**10 }}",
        "{{ [0] * 10**10 }}",
        "{{ 10 ** 1000000 }}",
        "{% set ns = namespace(s='ab') %}{% for i in range(200) %}{% set ns.s = ns.s ~ ns.s %}"
        "{% endfor %}",
        "{% set ns = namespace(s='ab') %}{% for i in range(200) %}{% set ns.s = ns.s + ns.s %}"
        "{% endfor %}",
        "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
        "{% for i in range(20000) %}{{ 'x' * 2000 }}{% endfor %}",
    ],
    ids=["huge-range", "nested-range", "nested-list", "str-mul", "list-mul", "pow",
         "concat-doubling", "plus-doubling", "recursion", "long-output"],
)
def test_pathological_templates_fail_fast(src):
    t0 = time.perf_counter()
    with pytest.raises(TemplateError, match="limit|too large|recursed|longer"):
        ChatTemplate(src).render([])
    assert time.perf_counter() - t0 < 5


def test_bad_messages():
    t = ChatTemplate(CHATML_TEMPLATE)
    with pytest.raises(TemplateError, match=r"messages\[1\] needs a string 'role'"):
        t.render([{"role": "user", "content": "a"}, {"content": "b"}])
    with pytest.raises(TemplateError, match="list of dicts"):
        t.render("hello")


# -- issue 12: every filter, method and operator under the budget ------------------------------

# Each ran for minutes or took 1-4 GB before the budget covered it. They run in one child
# process (a regression hangs or swaps there, not in pytest), each under tracemalloc.
HOSTILE = {
    "lipsum": "{{ lipsum(100000) }}",
    "namespace-squaring": "{% set ns = namespace(x=2**2000) %}{% for i in range(40) %}"
                          "{% set ns.x = ns.x * ns.x %}{% endfor %}{{ ns.x }}",
    "indent-2e9": "{{ 'a\nb' | indent(2e9 | int) }}",
    "slice-1e8": "{{ [1, 2, 3] | slice(1e8 | int) | list }}",
    "rjust-1e9": "{{ 'x'.rjust(1e9 | int) }}",
    "ljust": "{{ 'x'.ljust(2000000000) }}",
    "center": "{{ 'x'.center(2000000000) }}",
    "center-filter": "{{ 'x' | center(2000000000) }}",
    "format-width": "{{ '{:>2000000000}'.format(1) }}",
    "format-nested-width": "{{ '{:>{}}'.format('x', 2000000000) }}",
    "format-precision": "{{ '{:.2000000000f}'.format(1.0) }}",
    "replace": "{{ ('x' * 1000).replace('x', 'y' * 1000000) }}",
    "replace-empty": "{{ ('x' * 100000).replace('', 'y' * 10000) }}",
    "join": "{{ ('y' * 1000000).join(['a'] * 1000) }}",
    "expandtabs": "{{ ('\t' * 1000).expandtabs(1000000) }}",
    "printf-width": "{{ '%2000000000d' % 1 }}",
    "printf-precision": "{{ '%.2000000000f' % 1.0 }}",
    "printf-star": "{{ '%*d' % (2000000000, 1) }}",
    "format-filter": "{{ '%2000000000s' | format('x') }}",
    "tojson-indent": "{{ messages | tojson(indent=1000000000) }}",
    "tojson-indent-1e9": "{{ messages | tojson(indent=1e9) }}",
    "zfill": "{{ '1'.zfill(2000000000) }}",
    "to-bytes": "{{ (1).to_bytes(2000000000, 'big') }}",
    "round-digits": "{{ 5 | round(-1000000000) }}",
    "odd-of-format": "{{ '%200000000d' is odd }}",  # Jinja's test computes value % 2
    "round-of-string": "{{ ('x' * 20) | round(7, 'floor') }}",  # a str * 10**7 (fuzz)
    "batch-fill": "{{ [1] | batch(1000000000, 'x') | list }}",
    "wordwrap-1": "{{ ('x' * 1000000) | wordwrap(1) }}",
    "translate": "{{ ('x' * 1000000).translate({120: 'y' * 1000}) }}",
    "punycode": "{{ ('x' * 100000).encode('punycode') }}",
    "split": "{{ ('a ' * 5000000).split() | length }}",
    "strftime": "{{ strftime_now('%c' * 10000000) }}",
    "shared-lists-compare": "{% set a = [[[0] * 1000] * 1000] * 1000 %}"
                            "{% set b = [[[0] * 1000] * 1000] * 1000 %}{{ a == b }}",
    "shared-lists-print": "{% set a = [['x' * 1000] * 1000] * 1000 %}{{ a }}",
    "deep-tuple-hash": "{% set ns = namespace(t=()) %}{% for i in range(100) %}"
                       "{% set ns.t = (ns.t,) %}{% endfor %}{{ {ns.t: 1} }}",
    "literal-in-loops": "{% set x %}{% for i in range(20000) %}{% for j in range(9) %}"
                        + "y" * 2000 + "{% endfor %}{% endfor %}{% endset %}{{ x | length }}",
    "macro-doubling": "{% macro d(n) %}{% if n %}{{ d(n - 1) }}{{ d(n - 1) }}{% else %}x"
                      "{% endif %}{% endmacro %}{{ d(40) }}",
    "sum-of-lists": "{{ ([[0] * 1000] * 20000) | sum(start=[]) | length }}",
    "int-product": "{{ ('9' * 4000) | int * ('9' * 4000) | int }}",
    "title-words": "{{ ('a-' * 1000000) | title }}",  # a Python loop over 2M words
}

_CHILD = """
import json, sys, time, tracemalloc
from deimos.tokenizer.template import ChatTemplate, TemplateError
for name, src in json.loads(sys.stdin.read()).items():
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        ChatTemplate(src).render([{"role": "user", "content": "hi"}])
        outcome = "rendered"
    except TemplateError as exc:
        outcome = "TemplateError: " + str(exc)
    except BaseException as exc:
        outcome = type(exc).__name__ + ": " + str(exc)
    elapsed = time.perf_counter() - t0
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    print(json.dumps([name, outcome, elapsed, peak]), flush=True)
"""


@pytest.fixture(scope="module")
def hostile_results():
    proc = subprocess.run([sys.executable, "-c", _CHILD], input=json.dumps(HOSTILE),
                          capture_output=True, text=True, timeout=240)
    results = {}
    for line in proc.stdout.splitlines():
        name, outcome, elapsed, peak = json.loads(line)
        results[name] = (outcome, elapsed, peak)
    return results, proc.stderr[-2000:]


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_template_fails_within_budget(hostile_results, name):
    results, stderr = hostile_results
    assert name in results, f"the child never finished {name!r}: {stderr}"
    outcome, elapsed, peak = results[name]
    assert outcome.startswith("TemplateError: chat template"), outcome
    # one compile-time probe (its own one-second deadline) and one render, on a busy machine
    assert elapsed < 3.0, (name, elapsed, outcome)
    assert peak < 100e6, (name, peak, outcome)


def test_probe_renders_share_one_budget():
    # the load-time probe renders up to four times; a template that spends the deadline in
    # each costs one deadline at load, not four
    # under the iteration limit (2,000 x 90 + 2,000 < 200,000), over the deadline: each inner
    # iteration does four renders (20,000 x 9 of one render each finished in 0.3 s here, idle)
    src = ("{% for i in range(2000) %}{% for j in range(90) %}{{ (i * j) % 7 }}{{ (i + j) % 5 }}"
           "{{ (i - j) % 3 }}{{ i * 2 + j }}{% endfor %}{% endfor %}")
    t0 = time.perf_counter()
    with pytest.raises(TemplateError, match="longer than 0.3 s"):
        ChatTemplate(src, limits=TemplateLimits(time_s=0.3))
    assert time.perf_counter() - t0 < 1.5


def test_reserved_budget_name_cannot_be_rebound():
    with pytest.raises(TemplateError, match="reserved name"):
        ChatTemplate("{% set _deimos_budget = 1 %}{{ 'x' * 2 }}").render([])


def test_unbound_mutators_are_refused():
    msgs = [{"role": "user", "content": "hi"}]
    for src in ("{{ {}.update.__self__ }}", "{{ messages[0].pop('role') }}",
                "{{ ''.join.__self__ }}"):
        with pytest.raises(TemplateError):
            ChatTemplate(src).render(msgs)
    assert msgs == [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    "src, expected",
    [
        ("{{ 'ab'.center(6, '*') }}|{{ 'x' | center(5) }}|{{ 'a\nb' | indent(2, true) }}",
         "**ab**|  x  |  a\n  b"),
        ("{{ '%05.1f|%-4s|%(k)s' % (3.14159, 'a', ) if false else '%05.1f|%-4s' % (3.14159, 'a') }}",
         "003.1|a   "),
        ("{{ '%(k)3s' % {'k': 'v'} }}|{{ '{:>4}|{:.2f}|{!r}'.format('a', 2, 'q') }}",
         "  v|   a|2.00|'q'"),
        ("{{ 'a-b-c'.split('-') }}|{{ ','.join(['x', 'y']) }}|{{ 'a\tb'.expandtabs(4) }}",
         "['a', 'b', 'c']|x,y|a   b"),
        ("{{ [1, 2, 3] | batch(2, 0) | list }}|{{ [1, 2, 3] | slice(2) | list }}|"
         "{{ 2 ** 10 }}|{{ [0] * 3 }}|{{ 'ab' * 2 }}|{{ 'x' ~ 1 ~ [2] }}",
         "[[1, 2], [3, 0]]|[[1, 2], [3]]|1024|[0, 0, 0]|abab|x1[2]"),
        ("{{ messages | tojson(indent=1) }}|{{ 'abc'[1:] }}|{{ (messages | first).role }}|"
         "{{ [3, 1, 2] | sort | join(',') }}|{{ [1, 2] | sum }}|{{ {'a': 1}.get('a') }}",
         '[\n {\n  "role": "user",\n  "content": "hi"\n }\n]|bc|user|1,2,3|3|1'),
        ("{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ n }}{% endif %}{% endmacro %}{{ f(5) }}"
         "{% for x in [{'n': 1, 'c': [{'n': 2, 'c': []}]}] recursive %}{{ x.n }}{{ loop(x.c) }}"
         "{% endfor %}",
         "1234512"),
    ],
    ids=["pad-indent", "printf", "format", "split-join-tabs", "batch-ops", "json-slice-sort",
         "recursion"],
)
def test_budgeted_operations_keep_their_results(src, expected):
    assert ChatTemplate(src).render([{"role": "user", "content": "hi"}]) == expected
