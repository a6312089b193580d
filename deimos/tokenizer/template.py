"""Chat templates: render a GGUF ``tokenizer.chat_template`` (untrusted Jinja) safely.

The environment mirrors Hugging Face transformers' ``apply_chat_template`` so real templates
render as they do there: ``ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)``
with the loop-controls extension, a ``tojson`` filter that is plain ``json.dumps`` (no HTML
escaping; ``indent``/``ensure_ascii``/``separators``/``sort_keys`` accepted), and the globals
``raise_exception`` and ``strftime_now``. ``{% generation %}`` blocks (HF's assistant-mask
tracker) are accepted and render their body unchanged.

The template comes from a downloaded file, so beyond the sandbox (no ``__class__`` walks, no
mutation of the caller's data) each render has a work budget: loop iterations, ``range`` sizes,
sizes produced by ``*``, ``+``, ``~`` and ``**`` and the output length are all charged, so a
pathological template fails with ``TemplateError`` instead of hanging or eating memory.
Every failure (syntax, sandbox violation, ``raise_exception``, undefined misuse, a Python error
inside the template, exhausted budget) surfaces as ``TemplateError`` naming the problem.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.visitor import NodeTransformer

__all__ = ["ChatTemplate", "TemplateError", "default_template_source"]

# Per-render limits. Real templates loop over messages, tools and tool parameters: a few
# thousand iterations at most, so these are far above legitimate use.
MAX_LOOP_ITERATIONS = 200_000
MAX_RANGE = 20_000
MAX_PRODUCED = 32_000_000  # characters/elements built by *, +, ~ over a whole render
MAX_OUTPUT = 16_000_000  # characters of rendered prompt
MAX_EXPONENT_BITS = 4_096  # ** results are refused beyond this many bits


class TemplateError(ValueError):
    """A chat template could not be compiled or rendered; the message names the problem.

    ``raised_by_template`` is True when the template itself called ``raise_exception`` (for
    example a template requiring strictly alternating user/assistant roles).
    """

    def __init__(self, message: str, *, raised_by_template: bool = False) -> None:
        super().__init__(message)
        self.raised_by_template = raised_by_template


class _TemplateRaised(Exception):
    """Carries the message of ``raise_exception(msg)`` out of the Jinja machinery."""


class _BudgetExceeded(Exception):
    pass


class _Budget:
    """Work counters of one render. Methods start with '_' so the sandbox hides them from the
    template (it refuses attribute names starting with an underscore)."""

    __slots__ = ("iterations", "produced")

    def __init__(self) -> None:
        self.iterations = 0
        self.produced = 0

    def _iterate(self, n: int = 1) -> None:
        self.iterations += n
        if self.iterations > MAX_LOOP_ITERATIONS:
            raise _BudgetExceeded(f"more than {MAX_LOOP_ITERATIONS} loop iterations")

    def _produce(self, n: int) -> None:
        self.produced += n
        if self.produced > MAX_PRODUCED:
            raise _BudgetExceeded(f"built more than {MAX_PRODUCED} characters/elements")


_BUDGET_VAR = "_deimos_budget"


def _budget(ctx: jinja2.runtime.Context) -> _Budget:
    b = ctx.get(_BUDGET_VAR)
    if not isinstance(b, _Budget):  # the template rebound the name
        raise _BudgetExceeded(f"template overwrote the reserved name {_BUDGET_VAR!r}")
    return b


@jinja2.pass_context
def _guard_iter(ctx: jinja2.runtime.Context, iterable: Iterable[Any]) -> Iterator[Any]:
    budget = _budget(ctx)
    if isinstance(iterable, jinja2.Undefined):
        iterable = iter(iterable)  # strict undefined raises here, lenient yields nothing
    for item in iterable:
        budget._iterate()
        yield item


@jinja2.pass_context
def _guard_size(ctx: jinja2.runtime.Context, value: Any) -> Any:
    if isinstance(value, (str, list, tuple)):
        _budget(ctx)._produce(len(value))
    return value


@jinja2.pass_context
def _safe_range(ctx: jinja2.runtime.Context, *args: int) -> range:
    r = range(*args)
    if len(r) > MAX_RANGE:
        raise _BudgetExceeded(f"range() of {len(r)} items (limit {MAX_RANGE})")
    _budget(ctx)._iterate(len(r))
    return r


class _Guard(NodeTransformer):
    """Wraps every for-loop iterable and every ``~`` concatenation in a budget check."""

    def visit_For(self, node: nodes.For) -> nodes.Node:
        self.generic_visit(node)
        node.iter = nodes.Filter(node.iter, "_deimos_iter", [], [], None, None, lineno=node.lineno)
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Node:
        self.generic_visit(node)
        return nodes.Filter(node, "_deimos_size", [], [], None, None, lineno=node.lineno)


class _GenerationExtension(Extension):
    """``{% generation %}...{% endgeneration %}``: HF marks assistant spans with it; we render
    the body as is."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> list[nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # HF overrides Jinja's tojson: no HTML escaping, and these keyword arguments. Beyond HF,
    # a lazy sequence (``tools | map(attribute='function')``) is written as a list, as
    # llama.cpp's Jinja engine does.
    if separators is not None:
        separators = tuple(separators)  # templates pass a Jinja list
    return json.dumps(
        value,
        ensure_ascii=ensure_ascii,
        indent=indent,
        separators=separators,
        sort_keys=sort_keys,
        default=_json_default,
    )


def _json_default(value: Any) -> Any:
    if isinstance(value, Iterator):
        return list(value)
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def _raise_exception(message: Any) -> None:
    raise _TemplateRaised(str(message))


class _Sandbox(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def unsafe_undefined(self, obj: Any, attribute: str) -> jinja2.Undefined:
        # Jinja returns an Undefined that prints as ''; an escape attempt should fail loudly.
        raise jinja2.sandbox.SecurityError(
            f"access to attribute {attribute!r} of a {type(obj).__name__!r} object is unsafe"
        )

    def call_binop(self, context: jinja2.runtime.Context, operator: str, left: Any, right: Any):
        budget = _budget(context)
        if operator == "**":
            if isinstance(left, int) and isinstance(right, int) and right > 0:
                bits = max(abs(left).bit_length(), 1) * right
                if bits > MAX_EXPONENT_BITS:
                    raise _BudgetExceeded(f"{left} ** {right} is too large")
            return left**right
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(n, int):
                    budget._produce(len(seq) * max(n, 0))
            return left * right
        result = super().call_binop(context, operator, left, right)
        if isinstance(result, (str, list, tuple)):
            budget._produce(len(result))
        return result


def _make_environment(now: Callable[[], datetime]) -> _Sandbox:
    env = _Sandbox(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=["jinja2.ext.loopcontrols", _GenerationExtension],
    )
    env.filters["tojson"] = _tojson
    env.filters["_deimos_iter"] = _guard_iter
    env.filters["_deimos_size"] = _guard_size
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: now().strftime(fmt)
    env.globals["range"] = _safe_range
    return env


def _describe(exc: BaseException) -> TemplateError:
    """Translate anything raised while compiling or rendering into a TemplateError."""
    if isinstance(exc, _TemplateRaised):
        return TemplateError(f"chat template raised an error: {exc}", raised_by_template=True)
    if isinstance(exc, _BudgetExceeded):
        return TemplateError(f"chat template exceeded its work limit: {exc}")
    if isinstance(exc, jinja2.TemplateSyntaxError):
        return TemplateError(f"chat template syntax error at line {exc.lineno}: {exc.message}")
    if isinstance(exc, jinja2.sandbox.SecurityError):
        return TemplateError(f"chat template attempted an unsafe operation: {exc}")
    if isinstance(exc, jinja2.UndefinedError):
        return TemplateError(f"chat template used an undefined value: {exc}")
    if isinstance(exc, RecursionError):
        return TemplateError("chat template recursed too deeply")
    if isinstance(exc, MemoryError):
        return TemplateError("chat template ran out of memory")
    return TemplateError(f"chat template failed: {type(exc).__name__}: {exc}")


# Built-in templates for models that ship none (see default_template_source).
# Same text as llama.cpp's CHATML_TEMPLATE_SRC (common/chat.cpp).
CHATML_TEMPLATE = (
    "{%- for message in messages -%}\n"
    "  {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' -}}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "  {{- '<|im_start|>assistant\\n' -}}\n"
    "{%- endif -%}"
)

# llama.cpp's built-in "gemma" format (src/llama-chat.cpp, LLM_CHAT_TEMPLATE_GEMMA): system text
# is trimmed and merged into the next non-model turn, "assistant" is called "model", contents
# are trimmed. No BOS in the text: the tokenizer adds it (add_bos_token).
GEMMA_TEMPLATE = (
    "{%- set ns = namespace(system='') -%}\n"
    "{%- for message in messages -%}\n"
    "  {%- if message.role == 'system' -%}\n"
    "    {%- set ns.system = ns.system + message.content | trim -%}\n"
    "  {%- else -%}\n"
    "    {%- set role = 'model' if message.role == 'assistant' else message.role -%}\n"
    "    {{- '<start_of_turn>' + role + '\\n' -}}\n"
    "    {%- if ns.system and role != 'model' -%}\n"
    "      {{- ns.system + '\\n\\n' -}}\n"
    "      {%- set ns.system = '' -%}\n"
    "    {%- endif -%}\n"
    "    {{- message.content | trim + '<end_of_turn>\\n' -}}\n"
    "  {%- endif -%}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "  {{- '<start_of_turn>model\\n' -}}\n"
    "{%- endif -%}"
)

# Last resort for a vocabulary with no chat markers at all: "role: content" lines.
PLAIN_TEMPLATE = (
    "{%- for message in messages -%}\n"
    "  {{- message.role + ': ' + message.content + '\\n' -}}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "  {{- 'assistant: ' -}}\n"
    "{%- endif -%}"
)


def default_template_source(tokens: Sequence[str]) -> str:
    """The template for a model without ``tokenizer.chat_template``.

    Gemma's turn markers win (llama.cpp detects gemma by ``<start_of_turn>``), then ChatML when
    the vocabulary has its markers (llama.cpp's own default), else plain "role: content".
    """
    vocab = set(tokens)
    if "<start_of_turn>" in vocab and "<end_of_turn>" in vocab:
        return GEMMA_TEMPLATE
    if "<|im_start|>" in vocab and "<|im_end|>" in vocab:
        return CHATML_TEMPLATE
    return PLAIN_TEMPLATE


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)):
        raise TemplateError(f"messages must be a list of dicts, got {type(messages).__name__}")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise TemplateError(f"messages[{i}] must be a dict, got {type(m).__name__}")
        if not isinstance(m.get("role"), str):
            raise TemplateError(f"messages[{i}] needs a string 'role'")


def _merge_system_message(messages: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    # llama.cpp common/chat.cpp system_message_not_supported(): merge into the next message, or
    # drop it when it is alone.
    messages = list(messages)
    if not messages or messages[0]["role"] != "system":
        return messages
    if len(messages) == 1:
        return []
    system, nxt = messages[0].get("content"), messages[1].get("content")
    if not (isinstance(system, str) and isinstance(nxt, str)):
        return messages
    return [{**messages[1], "content": system + "\n" + nxt}, *messages[2:]]


class ChatTemplate:
    """A compiled chat template. Compiling validates the syntax (``TemplateError`` if bad)."""

    def __init__(
        self,
        source: str,
        bos_token: str = "",
        eos_token: str = "",
        *,
        now: Callable[[], datetime] = datetime.now,
    ) -> None:
        if not isinstance(source, str):
            raise TemplateError(f"chat template must be a string, got {type(source).__name__}")
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        self._env = _make_environment(now)
        try:
            tree = _Guard().visit(self._env.parse(source))
            self._template = self._env.from_string(tree)
        except Exception as exc:  # noqa: BLE001 - every failure becomes a TemplateError
            raise _describe(exc) from exc
        self.supports_system_role = self._probe_system_role()

    def _probe_system_role(self) -> bool:
        """Whether a system message's content reaches the output (llama.cpp's caps check:
        common/jinja/caps.cpp). Templates such as gemma-2's raise on a system role. A template
        that fails even on a lone user message (e.g. one that requires tools) tells us nothing
        about system roles and is assumed to support them."""
        needle = "DeimosSystemProbe7f3a"
        user = {"role": "user", "content": "User message"}
        for tools in (None, []):
            try:
                self._render([user], add_generation_prompt=False, tools=tools)
            except TemplateError:
                continue
            try:
                probe = [{"role": "system", "content": needle}, user]
                return needle in self._render(probe, add_generation_prompt=False, tools=tools)
            except TemplateError:
                return False
        return True

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, Any], tokens: Sequence[str]) -> ChatTemplate:
        """The model's template (``tokenizer.chat_template``) or the default for its vocab, with
        bos/eos strings looked up from ``tokenizer.ggml.{bos,eos}_token_id``."""

        def token(key: str) -> str:
            tid = metadata.get(key)
            if tid is None:
                return ""
            tid = int(tid)
            if not 0 <= tid < len(tokens):
                raise TemplateError(f"{key} = {tid} is outside the vocabulary (0..{len(tokens) - 1})")
            return tokens[tid]

        source = metadata.get("tokenizer.chat_template")
        if source is None or source == "":
            source = default_template_source(tokens)
        return cls(source, token("tokenizer.ggml.bos_token_id"), token("tokenizer.ggml.eos_token_id"))

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        """The prompt text for ``messages``. ``kwargs`` reach the template as variables
        (e.g. ``enable_thinking=False``); ``tools`` is passed as given (None when absent, as HF
        does). For a template without a system role, a leading system message is merged into
        the next message as llama.cpp does (``system + "\\n" + content``)."""
        _check_messages(messages)
        if not self.supports_system_role:
            messages = _merge_system_message(messages)
        return self._render(messages, add_generation_prompt=add_generation_prompt, tools=tools, **kwargs)

    def _render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool,
        tools: Sequence[Mapping[str, Any]] | None,
        **kwargs: Any,
    ) -> str:
        if _BUDGET_VAR in kwargs:
            raise TemplateError(f"{_BUDGET_VAR!r} is a reserved template variable")
        variables = {
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            **kwargs,
            "messages": messages,
            "tools": tools,
            "add_generation_prompt": add_generation_prompt,
            _BUDGET_VAR: _Budget(),
        }
        parts: list[str] = []
        size = 0
        try:
            for chunk in self._template.generate(variables):
                size += len(chunk)
                if size > MAX_OUTPUT:
                    raise _BudgetExceeded(f"output longer than {MAX_OUTPUT} characters")
                parts.append(chunk)
        except Exception as exc:  # noqa: BLE001 - every failure becomes a TemplateError
            raise _describe(exc) from exc
        return "".join(parts)
