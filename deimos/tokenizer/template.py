"""Chat templates: render a GGUF ``tokenizer.chat_template`` (untrusted Jinja) safely.

The environment mirrors Hugging Face transformers' ``apply_chat_template`` so real templates
render as they do there: ``ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)``
with the loop-controls extension, a ``tojson`` filter that is plain ``json.dumps`` (no HTML
escaping; ``indent``/``ensure_ascii``/``separators``/``sort_keys`` accepted), and the globals
``raise_exception`` and ``strftime_now``. ``{% generation %}`` blocks (HF's assistant-mask
tracker) are accepted and render their body unchanged.

The template comes from a downloaded file and is rendered at model load (to probe it), so
beyond the sandbox (no ``__class__`` walks, no mutation of the caller's data) each render runs
under a ``Budget`` (``template_budget``): every operator (``template_ops``), call of a built-in
method (``template_methods``), ``%``/``format`` (``template_format``), filter, test and global
(``template_filters``), loop iteration, ``~``, slice, comparison, hashed key and output goes
through a hook of the sandbox or a node the ``_Guard`` rewrote, which sizes what it will build
before building it and checks a wall-clock deadline. A pathological template fails with
``TemplateError`` in about a second and within about 100 MB.
Every failure (syntax, sandbox violation, ``raise_exception``, undefined misuse, a Python error
inside the template, exhausted budget) surfaces as ``TemplateError`` naming the problem.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
from jinja2 import nodes, pass_context
from jinja2.ext import Extension
from jinja2.runtime import BlockReference, LoopContext, Macro
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError
from jinja2.utils import Cycler, Joiner
from jinja2.visitor import NodeTransformer

from .template_budget import Budget, BudgetExceeded, GuardedIterator, TemplateLimits, budget_iter
from .template_filters import BUDGET_VAR, TemplateRaised, budget_of, install
from .template_format import FormatCall
from .template_methods import resolve_method
from .template_ops import OPERATORS, binop

__all__ = ["ChatTemplate", "TemplateError", "TemplateLimits", "default_template_source"]


class TemplateError(ValueError):
    """A chat template could not be compiled or rendered; the message names the problem.

    ``raised_by_template`` is True when the template itself called ``raise_exception`` (for
    example a template requiring strictly alternating user/assistant roles).
    """

    def __init__(self, message: str, *, raised_by_template: bool = False) -> None:
        super().__init__(message)
        self.raised_by_template = raised_by_template


# -- hooks the rewritten tree calls (filters: the template cannot rebind them) ----------------


@pass_context
def _guard_iter(ctx: jinja2.runtime.Context, iterable: Any) -> Any:
    budget = budget_of(ctx)
    if isinstance(iterable, jinja2.Undefined):
        return iter(iterable)  # strict undefined raises here, lenient yields nothing
    if iterable is None:  # ``for tool in tools`` without tools: nothing, as llama.cpp's engine
        return iter(())  # renders it (Jinja raises; tool-use templates loop over tools unasked)
    return GuardedIterator(iterable, budget)


@pass_context
def _guard_emit(ctx: jinja2.runtime.Context, n: int) -> str:
    budget_of(ctx)._emit(n)
    return ""


@pass_context
def _guard_concat(ctx: jinja2.runtime.Context, parts: tuple[Any, ...]) -> str:
    budget = budget_of(ctx)
    strings = []
    for part in parts:
        budget._reserve(budget._str_cost(part), "a ~ operand")
        strings.append(part if type(part) is str else budget._account(str(part)))
    budget._reserve(sum(map(len, strings)) * 4, "a ~ concatenation")
    return budget._account("".join(strings))


@pass_context
def _guard_slice(ctx: jinja2.runtime.Context, value: Any, start: Any, stop: Any, step: Any) -> Any:
    budget = budget_of(ctx)
    budget._tick()
    return budget._account(value[start:stop:step])


@pass_context
def _guard_operand(ctx: jinja2.runtime.Context, value: Any) -> Any:
    return budget_of(ctx)._operand(value)


@pass_context
def _finalize(ctx: jinja2.runtime.Context, value: Any) -> Any:
    budget = budget_of(ctx)
    if type(value) is str:
        budget._emit(len(value))
    else:
        cost = budget._str_cost(value)
        budget._reserve(cost, "printed value")
        budget._emit(cost // 4)
    return value


def _literal_size(body: list[nodes.Node]) -> int:
    return sum(len(n.data) for stmt in body for n in stmt.find_all(nodes.TemplateData))


def _hook(name: str, *args: nodes.Expr, lineno: int) -> nodes.Filter:
    return nodes.Filter(args[0], name, list(args[1:]), [], None, None, lineno=lineno)


def _operand(node: nodes.Expr) -> nodes.Expr:
    if isinstance(node, nodes.Const):
        return node
    return _hook("_deimos_operand", node, lineno=node.lineno)


class _Guard(NodeTransformer):
    """Routes what the sandbox's hooks do not see through the budget: loop iterations (and the
    literal text each iteration or macro call emits), ``~``, slices, comparisons and hashed
    keys."""

    def _charge_body(self, body: list[nodes.Node], lineno: int) -> list[nodes.Node]:
        size = _literal_size(body)
        if not size:
            return body
        charge = nodes.ExprStmt(_hook("_deimos_emit", nodes.Const(size), lineno=lineno),
                                lineno=lineno)
        return [charge, *body]

    def visit_For(self, node: nodes.For) -> nodes.Node:
        self.generic_visit(node)
        node.iter = _hook("_deimos_iter", node.iter, lineno=node.lineno)
        node.body = self._charge_body(node.body, node.lineno)
        return node

    def visit_Macro(self, node: nodes.Macro) -> nodes.Node:
        self.generic_visit(node)
        node.body = self._charge_body(node.body, node.lineno)
        return node

    def visit_CallBlock(self, node: nodes.CallBlock) -> nodes.Node:
        self.generic_visit(node)
        node.body = self._charge_body(node.body, node.lineno)
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Node:
        self.generic_visit(node)
        return _hook("_deimos_concat", nodes.Tuple(node.nodes, "load", lineno=node.lineno),
                     lineno=node.lineno)

    def visit_Getitem(self, node: nodes.Getitem) -> nodes.Node:
        self.generic_visit(node)
        if isinstance(node.arg, nodes.Slice):
            none = nodes.Const(None, lineno=node.lineno)
            s = node.arg
            return _hook("_deimos_slice", node.node, s.start or none, s.stop or none,
                         s.step or none, lineno=node.lineno)
        node.arg = _operand(node.arg)
        return node

    def visit_Compare(self, node: nodes.Compare) -> nodes.Node:
        self.generic_visit(node)
        node.expr = _operand(node.expr)
        for op in node.ops:
            op.expr = _operand(op.expr)
        return node

    def visit_Dict(self, node: nodes.Dict) -> nodes.Node:
        self.generic_visit(node)
        for pair in node.items:
            pair.key = _operand(pair.key)
        return node


class _GenerationExtension(Extension):
    """``{% generation %}...{% endgeneration %}``: HF marks assistant spans with it; we render
    the body as is."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> list[nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


_LOOP_KWARGS = ("_loop_vars", "_block_vars")
_RUNTIME_HELPERS = (Cycler, Joiner, LoopContext)


class _Sandbox(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset(OPERATORS)

    def unsafe_undefined(self, obj: Any, attribute: str) -> jinja2.Undefined:
        # Jinja returns an Undefined that prints as ''; an escape attempt should fail loudly.
        raise SecurityError(
            f"access to attribute {attribute!r} of a {type(obj).__name__!r} object is unsafe"
        )

    def wrap_str_format(self, value: Any) -> Any:
        # str.format / format_map: sized field by field when called (see FormatCall)
        if jinja2.sandbox.SandboxedEnvironment.wrap_str_format(self, value) is None:
            return None
        return FormatCall(value.__self__, value.__name__ == "format_map")

    def call_binop(
        self, context: jinja2.runtime.Context, operator: str, left: Any, right: Any
    ) -> Any:
        return binop(budget_of(context), operator, left, right)

    def call(  # noqa: N805 - Jinja's signature: positional names that kwargs cannot clash with
        __self, __context: jinja2.runtime.Context, __obj: Any, *args: Any, **kwargs: Any
    ) -> Any:
        budget = budget_of(__context)
        budget._tick()
        if not __self.is_safe_callable(__obj):
            raise SecurityError(f"{__obj!r} is not safely callable")
        if getattr(__obj, "_deimos_checked", False):  # our guarded globals size themselves
            return __context.call(__obj, *args, **kwargs)
        extra = {k: kwargs.pop(k) for k in _LOOP_KWARGS if k in kwargs}
        if isinstance(__obj, FormatCall):
            return __obj._run(__self, budget, args, kwargs)
        method = resolve_method(__obj, args)
        if method is not None:
            return method.run(budget, args, kwargs)
        for a in (*args, *kwargs.values()):
            budget._operand(a)
        if isinstance(__obj, LoopContext) and args:  # {{ loop(children) }} in a recursive loop
            args = (budget_iter(budget, args[0]), *args[1:])
        nested = isinstance(__obj, (Macro, LoopContext, BlockReference))
        if nested:
            budget._enter()
        try:
            result = __context.call(__obj, *args, **kwargs, **extra)
        finally:
            if nested:
                budget._leave()
        # Jinja's helpers (cycler.next, loop.cycle, joiner) hand back values that already
        # exist; anything else (a macro's text, the caller's own callables) is charged for
        # what it returns
        lookup = isinstance(getattr(__obj, "__self__", None), _RUNTIME_HELPERS) or isinstance(
            __obj, Joiner
        )
        return budget._account(result, fresh=not lookup)


def _make_environment(now: Callable[[], datetime]) -> _Sandbox:
    env = _Sandbox(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=["jinja2.ext.loopcontrols", _GenerationExtension],
        finalize=_finalize,
    )
    install(env, now)
    env.filters.update(
        _deimos_iter=_guard_iter, _deimos_emit=_guard_emit, _deimos_concat=_guard_concat,
        _deimos_slice=_guard_slice, _deimos_operand=_guard_operand,
    )
    return env


def _describe(exc: BaseException) -> TemplateError:
    """Translate anything raised while compiling or rendering into a TemplateError."""
    if isinstance(exc, TemplateRaised):
        return TemplateError(f"chat template raised an error: {exc}", raised_by_template=True)
    if isinstance(exc, BudgetExceeded):
        return TemplateError(f"chat template exceeded its work limit: {exc}")
    if isinstance(exc, jinja2.TemplateSyntaxError):
        return TemplateError(f"chat template syntax error at line {exc.lineno}: {exc.message}")
    if isinstance(exc, SecurityError):
        return TemplateError(f"chat template attempted an unsafe operation: {exc}")
    if isinstance(exc, jinja2.UndefinedError):
        return TemplateError(f"chat template used an undefined value: {exc}")
    if isinstance(exc, RecursionError):
        return TemplateError("chat template recursed too deeply")
    if isinstance(exc, MemoryError):
        return TemplateError("chat template ran out of memory")
    return TemplateError(f"chat template failed: {type(exc).__name__}: {str(exc)[:500]}")


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
        limits: TemplateLimits = TemplateLimits(),
    ) -> None:
        if not isinstance(source, str):
            raise TemplateError(f"chat template must be a string, got {type(source).__name__}")
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.limits = limits
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
        about system roles and is assumed to support them. The probe renders share one budget:
        a hostile template costs one render's limits at load, not four."""
        needle = "DeimosSystemProbe7f3a"
        user = {"role": "user", "content": "User message"}
        budget = Budget(self.limits)
        for tools in (None, []):
            try:
                self._render([user], add_generation_prompt=False, tools=tools, budget=budget)
            except TemplateError as exc:
                if isinstance(exc.__cause__, BudgetExceeded):
                    raise
                continue
            try:
                probe = [{"role": "system", "content": needle}, user]
                out = self._render(probe, add_generation_prompt=False, tools=tools, budget=budget)
                return needle in out
            except TemplateError as exc:
                if isinstance(exc.__cause__, BudgetExceeded):
                    raise
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
        budget: Budget | None = None,
        **kwargs: Any,
    ) -> str:
        if BUDGET_VAR in kwargs:
            raise TemplateError(f"{BUDGET_VAR!r} is a reserved template variable")
        if budget is None:
            budget = Budget(self.limits)
        variables = {
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            **kwargs,
            "messages": messages,
            "tools": tools,
            "add_generation_prompt": add_generation_prompt,
            BUDGET_VAR: budget,
        }
        parts: list[str] = []
        size = 0
        try:
            for chunk in self._template.generate(variables):
                size += len(chunk)
                if size > self.limits.max_output:
                    raise BudgetExceeded(f"output longer than {self.limits.max_output} characters")
                parts.append(chunk)
            budget._tick()
        except Exception as exc:  # noqa: BLE001 - every failure becomes a TemplateError
            raise _describe(exc) from exc
        return "".join(parts)
