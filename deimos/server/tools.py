"""Tool calls in the model's own format (OpenAI ``tools`` in, ``tool_calls`` out).

Two formats are understood, chosen per model by ``tool_call_style``:

- ``"hermes"`` (Hermes / Qwen2.5 / ChatML models): the model writes
  ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, one block per call, and
  reads results as ``<tool_response>...</tool_response>`` in a user turn.
- ``"llama3"`` (Llama 3.1-3.3): the reply is a JSON object
  ``{"name": ..., "parameters": {...}}``, or ``<|python_tag|>`` followed by one (or by
  ``tool.call(k=v, ...)`` for a built-in tool); results come back in an ``ipython`` turn.

``"none"``: the model has no format we know; a server should refuse ``tools`` for it.

Templates follow the Hugging Face convention for tool conversations (``to_template_messages``):
an assistant message carries ``tool_calls: [{"type": "function", "function": {"name",
"arguments": dict}}]`` and a ``tool`` message carries ``content`` and ``tool_call_id``. A
template that never mentions ``tools`` (SmolLM2's plain ChatML) gets the tool list as a system
prompt and the calls/results as text instead (``prepare_chat``).

Parsing never raises: a block that is not a well-formed call stays in the content.
"""

from __future__ import annotations

import ast
import json
import re
import secrets
import string
import threading
from collections import OrderedDict
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import jsonschema

from deimos.engine.jsontext import check_size
from deimos.tokenizer.template import ChatTemplate, TemplateError

__all__ = [
    "PYTHON_TAG",
    "STYLES",
    "hermes_block_calls",
    "llama3_call",
    "parse_tool_calls",
    "prepare_chat",
    "template_renders_tools",
    "to_template_messages",
    "tool_call_style",
    "tools_system_prompt",
    "validate_tool_choice",
    "validate_tools",
]

STYLES = ("hermes", "llama3", "none")
PYTHON_TAG = "<|python_tag|>"
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names
_ID_ALPHABET = string.ascii_letters + string.digits


# ---- which format -----------------------------------------------------------------------


def template_renders_tools(template_source: str | None) -> bool:
    """Whether the template itself reads the ``tools`` variable (else we prompt for tools)."""
    return bool(template_source) and re.search(r"\btools\b", template_source) is not None


_PROBE_NAME = "deimos_probe_fn"
_PROBE_ARGS = {"probe_arg": 17}
_PROBE_USER = "DeimosToolProbe4c1d"
_PROBE_TOOLS = [{"type": "function", "function": {
    "name": _PROBE_NAME, "description": "probe",
    "parameters": {"type": "object", "properties": {"probe_arg": {"type": "integer"}}}}}]


def _rendered_style(template_source: str) -> str | None:
    """The style whose parser recovers the call the template itself writes for an assistant
    message with one tool call; None if neither does or the template cannot render it."""
    try:
        text = ChatTemplate(template_source).render(
            [{"role": "user", "content": _PROBE_USER},
             {"role": "assistant", "content": "", "tool_calls": [{
                 "id": "probe1234", "type": "function",  # Mistral's wants 9 alphanumerics
                 "function": {"name": _PROBE_NAME, "arguments": dict(_PROBE_ARGS)}}]}],
            tools=_PROBE_TOOLS, add_generation_prompt=False)
    except TemplateError:
        return None
    at = text.find(_PROBE_USER)
    if at < 0:
        return None
    reply = text[at + len(_PROBE_USER):]  # the tool list is written before the user's text
    llama_family = "<|start_header_id|>" in template_source or PYTHON_TAG in template_source
    for style in ("hermes", "llama3"):
        if style == "llama3" and not llama_family:
            continue  # bare JSON calls of another family (Mistral's [TOOL_CALLS]) are not ours
        _, calls = parse_tool_calls(reply, style, names=(_PROBE_NAME,))
        if len(calls) == 1 and json.loads(calls[0]["function"]["arguments"]) == _PROBE_ARGS:
            return style
    return None


def tool_call_style(template_source: str | None, vocab: Any) -> str:
    """"hermes", "llama3" or "none" for a model with this chat template and vocabulary.

    ``vocab``: anything with ``token_id(text) -> int | None`` (``Vocab`` or ``Tokenizer``).
    A template that renders tools decides by what it writes for a tool call (its own format
    must parse back with our parser: Qwen3-Coder's XML-style ``<tool_call>`` does not, and is
    "none"). A template that ignores tools (plain ChatML, as SmolLM2's) falls back on the
    vocabulary: a ``<tool_call>`` token or the ChatML markers mean hermes (ChatML chat models
    are commonly tuned on Hermes-format function calling), ``<|python_tag|>`` means llama3."""
    if template_renders_tools(template_source):
        return _rendered_style(template_source) or "none"
    if vocab.token_id("<tool_call>") is not None:
        return "hermes"
    if vocab.token_id(PYTHON_TAG) is not None:
        return "llama3"
    if vocab.token_id("<|im_start|>") is not None and vocab.token_id("<|im_end|>") is not None:
        return "hermes"
    return "none"


# ---- validation -------------------------------------------------------------------------


class SchemaMemo:
    """The parameter schemas already found valid (their JSON text), at most ``size``: an agent
    sends the same ~20 tools with every turn, and checking each against the JSON Schema
    meta-schema took ~16 ms a turn on a 2-core CPU, most of the server's work before the
    engine. Thread-safe (the handlers' thread pool); a schema found invalid is not kept."""

    def __init__(self, size: int = 1024):
        self.size = size
        self._valid: OrderedDict[str, None] = OrderedDict()
        self._lock = threading.Lock()

    def known(self, key: str) -> bool:
        with self._lock:
            if key in self._valid:
                self._valid.move_to_end(key)
                return True
            return False

    def add(self, key: str) -> None:
        with self._lock:
            self._valid[key] = None
            while len(self._valid) > self.size:
                self._valid.popitem(last=False)


def validate_tools(tools: Any, memo: SchemaMemo | None = None) -> None:
    """Raise ValueError naming the first problem in an OpenAI ``tools`` list. ``memo``: the
    parameter schemas found valid before (their meta-schema check skipped)."""
    if not isinstance(tools, list):
        raise ValueError(f"tools must be a list, got {type(tools).__name__}")
    _check_sizes(tools)
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, Mapping):
            raise ValueError(f"{where} must be an object, got {type(tool).__name__}")
        if tool.get("type") != "function":
            raise ValueError(f"{where}.type must be 'function', got {tool.get('type')!r}")
        fn = tool.get("function")
        if not isinstance(fn, Mapping):
            raise ValueError(f"{where}.function must be an object with a 'name'")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ValueError(
                f"{where}.function.name must be 1-64 characters of a-z, A-Z, 0-9, '_' or '-', "
                f"got {name!r}"
            )
        if name in seen:
            raise ValueError(f"{where}.function.name {name!r} is used by another tool")
        seen.add(name)
        desc = fn.get("description")
        if desc is not None and not isinstance(desc, str):
            raise ValueError(f"{where}.function.description must be a string")
        if "strict" in fn and not isinstance(fn["strict"], bool):
            raise ValueError(f"{where}.function.strict must be true or false")
        if "parameters" in fn:
            _check_parameters(fn["parameters"], f"{where}.function.parameters", memo)


def _check_sizes(tools: list) -> None:
    """Size limits before anything recursive walks the schemas: each tool's parameters (named
    in the error), then the list as a whole (a forced call's grammar holds every schema)."""
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, Mapping) else None
        if isinstance(fn, Mapping) and "parameters" in fn:
            check_size(fn["parameters"], f"tools[{i}].function.parameters")
    check_size(tools, "tools")


def _check_parameters(schema: Any, where: str, memo: SchemaMemo | None = None) -> None:
    if not isinstance(schema, Mapping):
        raise ValueError(f"{where} must be a JSON Schema object, got {type(schema).__name__}")
    if schema.get("type", "object") != "object":
        raise ValueError(f"{where}.type must be 'object' (arguments are a JSON object), "
                         f"got {schema.get('type')!r}")
    key = None
    if memo is not None:  # the schema's exact JSON text (sizes were checked before)
        try:
            key = json.dumps(schema, sort_keys=True, separators=(",", ":"), allow_nan=False)
        except (TypeError, ValueError):
            key = None  # not plain JSON: checked every time
        if key is not None and memo.known(key):
            return
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        at = "".join(f"[{p!r}]" for p in e.path)
        raise ValueError(f"{where}{at} is not a valid JSON Schema: {e.message}") from None
    if key is not None:
        memo.add(key)


def validate_tool_choice(tool_choice: Any, tools: Sequence[Mapping[str, Any]] | None) -> None:
    """Raise ValueError for a ``tool_choice`` that is malformed or names no given tool."""
    if tool_choice is None or tool_choice in ("none", "auto"):
        return
    if tool_choice == "required":
        if not tools:
            raise ValueError("tool_choice 'required' needs a non-empty tools list")
        return
    if isinstance(tool_choice, Mapping) and tool_choice.get("type") == "function":
        fn = tool_choice.get("function")
        name = fn.get("name") if isinstance(fn, Mapping) else None
        names = [t["function"]["name"] for t in tools or ()]
        if name not in names:
            raise ValueError(f"tool_choice names function {name!r}, which is not in tools "
                             f"({', '.join(names) or 'none given'})")
        return
    raise ValueError("tool_choice must be 'none', 'auto', 'required' or "
                     f"{{'type': 'function', 'function': {{'name': ...}}}}, got {tool_choice!r}")


# ---- messages for the template ------------------------------------------------------------


def _text(content: Any, where: str) -> str | None:
    """OpenAI content (a string, None, or a list of parts) as a string."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for j, part in enumerate(content):
            if not isinstance(part, Mapping) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                raise ValueError(
                    f"{where}.content[{j}]: only text parts are supported, got {kind!r}")
            out.append(str(part.get("text", "")))
        return "".join(out)
    raise ValueError(f"{where}.content must be a string or a list of parts")


def _arguments(value: Any) -> Any:
    """OpenAI sends arguments as a JSON string; templates expect the object."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value  # not JSON: the template shows it as given
    return {} if value is None else value


def _call_text(name: str, args: Any, style: str) -> str:
    if style == "llama3":
        return json.dumps({"name": name, "parameters": args}, ensure_ascii=False)
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}, ensure_ascii=False) + \
        "\n</tool_call>"


def to_template_messages(
    messages: Sequence[Mapping[str, Any]], *, native: bool = True, style: str = "hermes"
) -> list[dict[str, Any]]:
    """OpenAI request messages as chat templates expect them.

    ``native``: the template renders tool calls and ``tool`` messages itself (HF convention:
    arguments as objects, ``tool`` messages with ``tool_call_id`` and, added here, the called
    function's ``name``). Otherwise calls become text in ``style``'s format inside the
    assistant's content, and tool results become a user turn of ``<tool_response>`` blocks
    (hermes) or an ``ipython`` turn (llama3)."""
    out: list[dict[str, Any]] = []
    names: dict[str, str] = {}  # tool_call_id -> function name
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        msg = dict(m)
        role = msg.get("role")
        msg["content"] = _text(msg.get("content"), where)
        calls = msg.pop("tool_calls", None)
        if role == "assistant" and calls:
            conv = []
            for j, c in enumerate(calls):
                fn = c.get("function") if isinstance(c, Mapping) else None
                if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
                    raise ValueError(f"{where}.tool_calls[{j}] needs function.name")
                args = _arguments(fn.get("arguments"))
                call = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
                if isinstance(c.get("id"), str):
                    call["id"] = c["id"]
                    names[c["id"]] = fn["name"]
                conv.append(call)
            if native:
                msg["tool_calls"] = conv
                msg["content"] = msg["content"] or ""
            else:
                parts = [msg["content"]] if msg["content"] else []
                parts += [_call_text(c["function"]["name"], c["function"]["arguments"], style)
                          for c in conv]
                msg["content"] = "\n".join(parts)
        elif role == "tool":
            result = msg["content"] or ""
            if native:
                if "name" not in msg and msg.get("tool_call_id") in names:
                    msg["name"] = names[msg["tool_call_id"]]
                # Llama 3's templates write a mapping result with tojson but also a string
                # (Jinja strings are iterable), which would quote it: pass JSON as the value
                msg["content"] = _arguments(result) if style == "llama3" else result
            elif style == "llama3":
                msg = {"role": "ipython", "content": result}
            else:
                block = f"<tool_response>\n{result}\n</tool_response>"
                if out and out[-1].get("_tool_turn"):  # consecutive results share one turn
                    out[-1]["content"] += "\n" + block
                    continue
                msg = {"role": "user", "content": block, "_tool_turn": True}
        elif msg["content"] is None:
            msg["content"] = ""
        out.append(msg)
    for msg in out:
        msg.pop("_tool_turn", None)
    return out


def tools_system_prompt(tools: Sequence[Mapping[str, Any]], style: str) -> str:
    """The tool list and call format as system-prompt text, for a template that does not
    render ``tools`` itself (the wording is the one the format's own templates use)."""
    if style == "llama3":
        body = "\n\n".join(json.dumps(t, indent=4, ensure_ascii=False) for t in tools)
        return ("You have access to the following functions. To call a function, please respond "
                'with JSON for a function call. Respond in the format {"name": function name, '
                '"parameters": dictionary of argument name and its value}. Do not use variables.'
                f"\n\n{body}")
    body = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n"
            f"<tools>\n{body}\n</tools>\n\n"
            "For each function call, return a json object with function name and arguments "
            "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


def prepare_chat(
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None,
    template_source: str | None,
    style: str,
) -> tuple[list[dict[str, Any]], list[Mapping[str, Any]] | None]:
    """(messages, tools) to hand to ``ChatTemplate.render``: as given when the template
    renders tools; else the tool list merged into the system message (one is added if
    missing), tool traffic as text, and ``tools=None``."""
    if template_renders_tools(template_source):
        return to_template_messages(messages, style=style), list(tools) if tools else None
    msgs = to_template_messages(messages, native=False, style=style)
    if tools:
        prompt = tools_system_prompt(tools, style)
        if msgs and msgs[0].get("role") == "system":
            msgs[0]["content"] = (msgs[0]["content"] + "\n\n" + prompt).lstrip()
        else:
            msgs.insert(0, {"role": "system", "content": prompt})
    return msgs, None


# ---- parsing the model's output ----------------------------------------------------------


def _call_id() -> str:
    return "call_" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(24))


def _as_call(obj: Any, names: Collection[str] | None) -> dict[str, Any] | None:
    """An OpenAI tool call from a decoded ``{"name", "arguments"|"parameters"}`` object (also
    wrapped as ``{"type": "function", "function": {...}}``), or None if it is not one."""
    if not isinstance(obj, dict):
        return None
    if isinstance(obj.get("function"), dict):
        obj = obj["function"]
    name = obj.get("name")
    if not isinstance(name, str) or not name or (names is not None and name not in names):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return {"id": _call_id(), "type": "function",
            "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}}


def _calls_in(body: str, names: Collection[str] | None) -> list[dict[str, Any]] | None:
    """The calls of one JSON value (an object or a list of them), or None unless all are."""
    try:
        value = json.loads(body)
    except ValueError:
        return None
    items = value if isinstance(value, list) else [value]
    calls = [_as_call(v, names) for v in items]
    return calls if calls and all(c is not None for c in calls) else None


_HERMES_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.S)


def hermes_block_calls(body: str, names: Collection[str] | None) -> list[dict[str, Any]] | None:
    """The calls of one ``<tool_call>`` block's text, or None if it is not a call."""
    return _calls_in(body.strip(), names)


def _trim(kept: list[str], extra: str = "") -> str:
    """The content around the calls: ``kept`` are the texts before, between and after them.
    Trailing whitespace (and ``extra`` characters) goes; leading whitespace only when nothing
    else comes before the first call. (A streamed reply has already sent text written before
    a call, leading spaces included: ``tool_stream`` holds back only what this may remove.)"""
    content = "".join(kept)
    end = len(content)
    while end and (content[end - 1].isspace() or content[end - 1] in extra):
        end -= 1
    start = 0
    if all(c.isspace() or c in extra for c in kept[0]):
        while start < end and (content[start].isspace() or content[start] in extra):
            start += 1
    return content[start:end]


def _parse_hermes(text: str, names: Collection[str] | None) -> tuple[str, list[dict[str, Any]]]:
    calls: list[dict[str, Any]] = []
    kept: list[str] = []
    at = 0
    for m in _HERMES_BLOCK.finditer(text):
        found = hermes_block_calls(m.group(1), names)
        if found is None:
            continue  # not a call: the block stays in the content
        kept.append(text[at : m.start()])
        calls += found
        at = m.end()
    kept.append(text[at:])
    return _trim(kept), calls


def _json_objects(text: str) -> list[tuple[int, int, Any]]:
    """(start, end, value) of each top-level JSON object found in ``text``, left to right."""
    dec = json.JSONDecoder()
    found = []
    i = text.find("{")
    while i >= 0:
        try:
            value, end = dec.raw_decode(text, i)
        except ValueError:
            i = text.find("{", i + 1)
            continue
        found.append((i, end, value))
        i = text.find("{", end)
    return found


def _pythonic_call(code: str, names: Collection[str] | None) -> dict[str, Any] | None:
    """Llama 3.1's built-in tool syntax ``brave_search.call(query="...")``."""
    try:
        node = ast.parse(code.strip(), mode="eval").body
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == "call" and isinstance(node.func.value, ast.Name)
                and not node.args):
            return None
        args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg}
    except (SyntaxError, ValueError, TypeError, MemoryError, RecursionError):
        return None
    return _as_call({"name": node.func.value.id, "arguments": args}, names)


def llama3_call(value: Any, names: Collection[str] | None) -> dict[str, Any] | None:
    """The call a JSON object of a Llama 3 reply makes, or None: it needs its arguments
    (``parameters``/``arguments``) or the ``function`` wrapper, else it is plain JSON the model
    wrote as an answer."""
    if not isinstance(value, dict) or not ({"parameters", "arguments"} & value.keys()
                                           or isinstance(value.get("function"), dict)):
        return None
    return _as_call(value, names)


def _parse_llama3(text: str, names: Collection[str] | None) -> tuple[str, list[dict[str, Any]]]:
    head, tag, tail = text.partition(PYTHON_TAG)
    if tag:
        call = _pythonic_call(tail, names)
        if call is not None:
            return _trim([head]), [call]
    calls: list[dict[str, Any]] = []
    kept: list[str] = []
    at = 0
    for start, end, value in _json_objects(text):
        call = llama3_call(value, names)
        if call is None:
            continue
        kept.append(text[at:start])
        calls.append(call)
        at = end
    kept.append(text[at:])
    if not calls:
        return text, []
    # separators between consecutive calls, and the tag itself, are not content
    return _trim([k.replace(PYTHON_TAG, "") for k in kept], ";"), calls


def parse_tool_calls(
    text: str, style: str, names: Collection[str] | None = None
) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool_calls) of a finished reply in ``style``'s format.

    Calls are OpenAI objects ``{"id": "call_...", "type": "function", "function": {"name",
    "arguments": JSON string}}``. ``names``: when given, a call to any other function is not
    a call (it stays content). Without calls the text comes back unchanged; with calls the
    remaining content loses its trailing whitespace, and its leading whitespace when nothing
    else comes before the first call (llama3: semicolons too); None when empty. Never raises.
    ``tool_stream.ToolCallSplitter`` streams the same content as it is written."""
    try:
        if style == "hermes":
            content, calls = _parse_hermes(text, names)
        elif style == "llama3":
            content, calls = _parse_llama3(text, names)
        else:
            return text, []
    except Exception:  # noqa: BLE001 - malformed output is content, never an error
        return text, []
    if not calls:
        return text, []
    return content or None, calls
