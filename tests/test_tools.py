"""Tool calls (deimos.server.tools): format detection, parsing, template rendering, validation.

Oracles: the real chat templates (llama.cpp's models/templates and SmolLM2's own): what a
template writes for an assistant tool call must parse back to that call; llama.cpp's parser
test cases (tests/test-chat.cpp, Hermes-2-Pro block) for hermes outputs; ``json.loads`` for the
arguments; jsonschema's meta-schema for invalid parameter schemas.
"""

from __future__ import annotations

import json
import random
import re

import pytest
from chat_support import read_vocab
from testdata import llama_cpp_path, model_path

from deimos.server.tools import (
    SchemaMemo,
    parse_tool_calls,
    prepare_chat,
    template_renders_tools,
    to_template_messages,
    tool_call_style,
    tools_system_prompt,
    validate_tool_choice,
    validate_tools,
)
from deimos.tokenizer import Tokenizer
from deimos.tokenizer.template import ChatTemplate

SMOL = "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA = "gemma-3-270m-q4_k_m.gguf"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "unit": {"enum": ["C", "F"]}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Local time of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
TOOLS = [WEATHER, TIME]

# template file -> (style, bos, the turn end it writes after an assistant message)
TEMPLATES = {
    "Qwen-Qwen2.5-7B-Instruct": ("hermes", "", "<|im_end|>"),
    "Qwen-Qwen3-0.6B": ("hermes", "", "<|im_end|>"),
    "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use": ("hermes", "<|begin_of_text|>", "<|im_end|>"),
    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use": ("hermes", "<|begin_of_text|>", "<|im_end|>"),
    "meta-llama-Llama-3.1-8B-Instruct": ("llama3", "<|begin_of_text|>", "<|eot_id|>"),
    "meta-llama-Llama-3.2-3B-Instruct": ("llama3", "<|begin_of_text|>", "<|eot_id|>"),
    "meta-llama-Llama-3.3-70B-Instruct": ("llama3", "<|begin_of_text|>", "<|eot_id|>"),
}
# templates with a tool format of their own that we do not parse
OTHER_FORMATS = ["Qwen3-Coder", "GLM-4.6", "mistralai-Mistral-Nemo-Instruct-2407",
                 "openai-gpt-oss-120b", "deepseek-ai-DeepSeek-V3.2"]


def template_source(name: str) -> str:
    return llama_cpp_path(f"models/templates/{name}.jinja").read_text("utf-8")


@pytest.fixture(scope="module")
def smol():
    md, _, _ = read_vocab(model_path(SMOL))
    return md, Tokenizer.from_metadata(md)


def call(name: str, args: dict, id_: str = "call_1") -> dict:
    return {"id": id_, "type": "function",
            "function": {"name": name, "arguments": json.dumps(args)}}


def calls_of(calls: list[dict]) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


CONVERSATION = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Weather in Paris and the time in Tokyo?"},
    {"role": "assistant", "content": None, "tool_calls": [
        call("get_weather", {"city": "Paris", "unit": "C"}, "call_a")]},
    {"role": "tool", "tool_call_id": "call_a", "content": '{"temperature": 21}'},
    {"role": "assistant", "content": "It is 21 C in Paris.", "tool_calls": [
        call("get_time", {"city": "Tokyo"}, "call_b")]},
    {"role": "tool", "tool_call_id": "call_b", "content": "09:30"},
]


# ---- which format ------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_style_of_tool_templates(name, smol):
    assert tool_call_style(template_source(name), smol[1].vocab) == TEMPLATES[name][0]


@pytest.mark.parametrize("name", OTHER_FORMATS)
def test_style_of_other_tool_formats_is_none(name, smol):
    src = template_source(name)
    assert template_renders_tools(src)
    assert tool_call_style(src, smol[1].vocab) == "none"


def test_style_from_vocab_when_the_template_ignores_tools(smol):
    md, tok = smol
    src = md["tokenizer.chat_template"]
    assert not template_renders_tools(src)
    assert tool_call_style(src, tok.vocab) == "hermes"  # ChatML markers
    gmd, _, _ = read_vocab(model_path(GEMMA))
    gtok = Tokenizer.from_metadata(gmd)
    assert tool_call_style(gmd.get("tokenizer.chat_template"), gtok.vocab) == "none"
    assert tool_call_style(None, gtok.vocab) == "none"


# ---- parsing -----------------------------------------------------------------------------


def test_hermes_llama_cpp_cases():
    # tests/test-chat.cpp, NousResearch-Hermes-2-Pro block: message_assist_call(_content)
    content, calls = parse_tool_calls(
        '<tool_call>\n{"name": "special_function", "arguments": {"arg1": 1}}</tool_call>', "hermes")
    assert content is None and calls_of(calls) == [("special_function", {"arg1": 1})]
    content, calls = parse_tool_calls(
        "Hello, world!\nWhat's up?<tool_call>\n"
        '{"name": "special_function", "arguments": {"arg1": 1}}</tool_call>', "hermes")
    assert content == "Hello, world!\nWhat's up?"
    assert calls_of(calls) == [("special_function", {"arg1": 1})]
    plain = "Hello, world!\nWhat's up?"
    assert parse_tool_calls(plain, "hermes") == (plain, [])


def test_hermes_multiple_and_variants():
    text = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            '</tool_call>\n<tool_call>\n'
            '{"name": "get_time", "arguments": "{\\"city\\": \\"Tokyo\\"}"}'
            '\n</tool_call>')
    content, calls = parse_tool_calls(text, "hermes")
    assert content == "Let me look."
    assert calls_of(calls) == [("get_weather", {"city": "Paris"}), ("get_time", {"city": "Tokyo"})]
    assert len({c["id"] for c in calls}) == 2
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)
    # a list in one block; an unclosed last block (the model stopped at end-of-generation)
    _, calls = parse_tool_calls('<tool_call>[{"name": "a", "arguments": {}}, '
                                '{"name": "b", "parameters": {"x": [1]}}]</tool_call>', "hermes")
    assert calls_of(calls) == [("a", {}), ("b", {"x": [1]})]
    content, calls = parse_tool_calls('Sure. <tool_call>\n{"name": "get_time"}', "hermes")
    assert content == "Sure." and calls_of(calls) == [("get_time", {})]


@pytest.mark.parametrize("text", [
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}\n</tool_call>',  # no }
    "<tool_call>\nget_weather(city='Paris')\n</tool_call>",
    '<tool_call>{"arguments": {"city": "Paris"}}</tool_call>',  # no name
    '<tool_call>{"name": "get_weather", "arguments": [1, 2]}</tool_call>',
    '<tool_call>{"name": "get_weather", "arguments": "not json"}</tool_call>',
    "<tool_call></tool_call>",
    "<tool_call>",
    "",
])
def test_hermes_malformed_is_content(text):
    assert parse_tool_calls(text, "hermes") == (text, [])


def test_hermes_malformed_block_stays_beside_a_good_one():
    bad = '<tool_call>{"name": oops}</tool_call>'
    good = '<tool_call>{"name": "get_time", "arguments": {"city": "Oslo"}}</tool_call>'
    content, calls = parse_tool_calls(bad + "\n" + good, "hermes")
    assert content == bad and calls_of(calls) == [("get_time", {"city": "Oslo"})]


def test_names_filter():
    text = '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>'
    assert parse_tool_calls(text, "hermes", names={"get_time"}) == (text, [])
    assert calls_of(parse_tool_calls(text, "hermes", names={"rm_rf"})[1]) == [("rm_rf", {})]


def test_llama3_outputs():
    content, calls = parse_tool_calls(
        '{"name": "get_weather", "parameters": {"city": "Paris"}}', "llama3")
    assert content is None and calls_of(calls) == [("get_weather", {"city": "Paris"})]
    content, calls = parse_tool_calls(
        '<|python_tag|>{"type": "function", "name": "get_time", "parameters": {"city": "Oslo"}}; '
        '{"name": "get_weather", "arguments": {"city": "Rome"}}', "llama3")
    assert content is None
    assert calls_of(calls) == [("get_time", {"city": "Oslo"}), ("get_weather", {"city": "Rome"})]
    # Llama 3.1's built-in tool syntax
    content, calls = parse_tool_calls('<|python_tag|>brave_search.call(query="weather Paris")',
                                      "llama3")
    assert content is None and calls_of(calls) == [("brave_search", {"query": "weather Paris"})]
    # tests/test-chat.cpp Llama 3.x: plain content with tools given stays content
    plain = "Hello, world!\nWhat's up?"
    assert parse_tool_calls(plain, "llama3") == (plain, [])


@pytest.mark.parametrize("text", [
    'The answer is {"name": "Ada", "age": 36}.',  # JSON, but not a call
    '{"name": "get_weather", "parameters": {"city": "Paris"}',  # truncated
    "<|python_tag|>import os; os.system('ls')",
    '<|python_tag|>brave_search.call(query=open("x"))',
    "{{{{[[[",
])
def test_llama3_malformed_is_content(text):
    assert parse_tool_calls(text, "llama3") == (text, [])


def test_never_raises_on_truncated_or_garbled_output():
    text = ('Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
            '"unit": "C"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": '
            '{"city": "Tokyo"}}\n</tool_call>')
    rng = random.Random(0)
    for style in ("hermes", "llama3", "none"):
        for n in range(len(text) + 1):
            content, calls = parse_tool_calls(text[:n], style)
            assert len(calls) <= 2 and (content is None or isinstance(content, str))
        for _ in range(300):
            chars = list(text)
            for _ in range(rng.randint(1, 6)):
                chars[rng.randrange(len(chars))] = rng.choice('{}[]":,<>/\\ x\n\x00é')
            parse_tool_calls("".join(chars), style)


# ---- rendering through real templates ----------------------------------------------------


def _assistant_reply(template: ChatTemplate, messages: list, tools, turn_end: str) -> str:
    """What the template writes for the last (assistant) message of ``messages``."""
    head = template.render(messages[:-1], tools=tools, add_generation_prompt=True)
    full = template.render(messages, tools=tools, add_generation_prompt=False)
    assert full.startswith(head)
    return full[len(head):].split(turn_end)[0]


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_template_call_parses_back(name):
    """The call a template writes in the model's format parses back to the same call."""
    src = template_source(name)
    style, bos, turn_end = TEMPLATES[name]
    template = ChatTemplate(src, bos, turn_end)
    user = {"role": "user", "content": "Weather in Paris?"}
    sent = call("get_weather", {"city": "Paris", "unit": "C"})
    msgs, tools = prepare_chat([user, {"role": "assistant", "content": None, "tool_calls": [sent]}],
                               TOOLS, src, style)
    reply = _assistant_reply(template, msgs, tools, turn_end)
    content, calls = parse_tool_calls(reply, style, names={"get_weather", "get_time"})
    assert calls_of(calls) == calls_of([sent]), reply
    # Qwen3 writes an empty reasoning block before the call: that is content here
    assert content is None or re.fullmatch(r"<think>\s*</think>", content), reply


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_tool_conversation_renders(name):
    src = template_source(name)
    style, bos, turn_end = TEMPLATES[name]
    msgs, tools = prepare_chat(CONVERSATION[:4], TOOLS, src, style)
    text = ChatTemplate(src, bos, turn_end).render(msgs, tools=tools)
    assert tools is not None and "Current weather of a city" in text  # the tool list
    assert '"temperature": 21' in text and '"{\\"temperature' not in text  # result, not re-quoted
    if style == "hermes":
        assert "<tool_response>\n{\"temperature\": 21}\n</tool_response>" in text
    else:
        assert ('<|start_header_id|>ipython<|end_header_id|>\n\n{"temperature": 21}<|eot_id|>'
                in text)
    assert text.endswith({"hermes": "<|im_start|>assistant\n",
                          "llama3": "<|start_header_id|>assistant<|end_header_id|>\n\n"}[style])


def test_qwen_renders_content_and_consecutive_results():
    src = template_source("Qwen-Qwen2.5-7B-Instruct")
    msgs, tools = prepare_chat(CONVERSATION + [
        {"role": "tool", "tool_call_id": "call_b", "content": "second result"}],
        TOOLS, src, "hermes")
    text = ChatTemplate(src).render(msgs, tools=tools)
    assert ("<|im_start|>assistant\nIt is 21 C in Paris.\n<tool_call>\n"
            '{"name": "get_time", "arguments": {"city": "Tokyo"}}\n</tool_call><|im_end|>') in text
    assert ("<|im_start|>user\n<tool_response>\n09:30\n</tool_response>\n<tool_response>\n"
            "second result\n</tool_response><|im_end|>") in text


def test_smollm2_template_gets_tools_as_text(smol):
    """SmolLM2's template ignores tools: they go into the system prompt, calls and results
    become Hermes text, and the conversation still encodes with the model's tokenizer."""
    md, tok = smol
    src = md["tokenizer.chat_template"]
    template = ChatTemplate.from_metadata(md, md["tokenizer.ggml.tokens"])
    msgs, tools = prepare_chat(CONVERSATION, TOOLS, src, "hermes")
    assert tools is None
    text = template.render(msgs)
    assert text.startswith("<|im_start|>system\nYou are a helpful assistant.\n\n"
                           + tools_system_prompt(TOOLS, "hermes") + "<|im_end|>\n")
    turns = text.split("<|im_start|>")[1:]
    assert [t.split("\n")[0] for t in turns] == ["system", "user", "assistant", "user",
                                                 "assistant", "user", "assistant"]
    for turn, sent in ((turns[2], CONVERSATION[2]), (turns[4], CONVERSATION[4])):
        reply = turn[len("assistant\n"):].split("<|im_end|>")[0]
        content, calls = parse_tool_calls(reply, "hermes")
        assert calls_of(calls) == calls_of(sent["tool_calls"]) and content == sent["content"]
    assert turns[3] == 'user\n<tool_response>\n{"temperature": 21}\n</tool_response><|im_end|>\n'
    from deimos.tokenizer.chat import encode_chat

    ids = encode_chat(tok, template, msgs)
    assert tok.decode(ids) == text
    # without a system message one is added
    msgs, _ = prepare_chat(CONVERSATION[1:2], TOOLS, src, "hermes")
    assert msgs[0] == {"role": "system", "content": tools_system_prompt(TOOLS, "hermes")}


def test_to_template_messages():
    msgs = to_template_messages([
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        CONVERSATION[2], CONVERSATION[3],
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "not json"}}]},
    ])
    assert msgs[0] == {"role": "user", "content": "ab"}
    assert msgs[1]["content"] == "" and msgs[1]["tool_calls"] == [{
        "id": "call_a", "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}}]
    assert msgs[2] == {"role": "tool", "tool_call_id": "call_a", "name": "get_weather",
                       "content": '{"temperature": 21}'}
    assert msgs[3]["tool_calls"][0]["function"]["arguments"] == "not json"
    assert CONVERSATION[2]["content"] is None  # the caller's messages are not changed
    with pytest.raises(ValueError, match=r"messages\[0\].content\[1\]: only text parts"):
        to_template_messages([{"role": "user", "content": [
            {"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "x"}}]}])
    with pytest.raises(ValueError, match=r"messages\[0\].tool_calls\[0\] needs function.name"):
        to_template_messages([{"role": "assistant", "tool_calls": [{"type": "function"}]}])


# ---- validation --------------------------------------------------------------------------


def test_valid_tools_pass():
    validate_tools(TOOLS)
    validate_tools([{"type": "function", "function": {"name": "no-params_1"}}])
    validate_tools([])


def _fn(**kw):
    return [{"type": "function", "function": {"name": "f", **kw}}]


@pytest.mark.parametrize("tools, message", [
    ({"type": "function"}, "tools must be a list"),
    (["f"], r"tools\[0\] must be an object"),
    ([{"type": "retrieval", "function": {"name": "f"}}], r"tools\[0\].type must be 'function'"),
    ([{"type": "function"}], r"tools\[0\].function must be an object"),
    (_fn(name="has space"), "1-64 characters"),
    (_fn(name="x" * 65), "1-64 characters"),
    (_fn(name=""), "1-64 characters"),
    ([WEATHER, WEATHER], r"tools\[1\].function.name 'get_weather' is used by another tool"),
    (_fn(description=3), "description must be a string"),
    (_fn(parameters=[]), "parameters must be a JSON Schema object"),
    (_fn(parameters={"type": "string"}), r"parameters.type must be 'object'"),
    (_fn(parameters={"type": "object", "properties": {"a": {"type": "strng"}}}),
     r"parameters\['properties'\]\['a'\]\['type'\] is not a valid JSON Schema"),
    (_fn(parameters={"type": "object", "required": "a"}), r"\['required'\] is not a valid"),
    (_fn(strict="yes"), "strict must be true or false"),
])
def test_invalid_tools(tools, message):
    with pytest.raises(ValueError, match=message):
        validate_tools(tools)
    memo = SchemaMemo()
    for _ in range(2):  # with the memo, the same error each time: an invalid schema is not kept
        with pytest.raises(ValueError, match=message):
            validate_tools(tools, memo)


def test_the_schema_memo_skips_only_schemas_found_valid(monkeypatch):
    """A turn's tools again: their schemas are not checked against the meta-schema a second
    time (the same JSON text, key order aside); a changed schema is; the memo is bounded."""
    import jsonschema

    checked = []
    cls = jsonschema.validators.validator_for({})  # the draft of a schema without $schema
    real = cls.check_schema

    def counting(schema, *a, **k):
        checked.append(json.dumps(schema, sort_keys=True))
        return real(schema, *a, **k)

    monkeypatch.setattr(cls, "check_schema", counting)
    memo = SchemaMemo(size=2)
    validate_tools(TOOLS, memo)
    first = len(checked)
    assert first == sum("parameters" in t["function"] for t in TOOLS) > 0
    reordered = json.loads(json.dumps(TOOLS))
    for t in reordered:
        if "parameters" in t["function"]:
            t["function"]["parameters"] = dict(reversed(list(t["function"]["parameters"].items())))
    validate_tools(reordered, memo)
    kept = min(first, 2)  # the memo holds the last two
    assert len(checked) == first + (first - kept)
    changed = _fn(parameters={"type": "object", "properties": {"x": {"type": "integer"}}})
    validate_tools(changed, memo)
    validate_tools(changed, memo)
    assert len(checked) == first + (first - kept) + 1


def test_tool_choice():
    for ok in (None, "none", "auto", "required",
               {"type": "function", "function": {"name": "get_time"}}):
        validate_tool_choice(ok, TOOLS)
    with pytest.raises(ValueError, match="'nope', which is not in tools"):
        validate_tool_choice({"type": "function", "function": {"name": "nope"}}, TOOLS)
    with pytest.raises(ValueError, match="needs a non-empty tools list"):
        validate_tool_choice("required", None)
    with pytest.raises(ValueError, match="tool_choice must be"):
        validate_tool_choice("sometimes", TOOLS)
