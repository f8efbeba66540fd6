"""Chat prompts: a Hugging Face chat template rendered the way transformers'
``apply_chat_template(tokenize=False)`` renders it, in a jinja2 sandbox that also bounds what a
(tampered) template may allocate; and the plain transcript used when a tokenizer has no template.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any, Sequence

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from compiled_llm.errors import CompiledLLMError

DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant."


def plain_chat_prompt(user_text: str, system_prompt: str | None) -> str:
    """The prompt used when a tokenizer has no chat template: a readable transcript that ends
    where the assistant should start writing."""
    head = f"{system_prompt}\n\n" if system_prompt else ""
    return f"{head}User: {user_text}\nAssistant:"


def one_turn_chat(user_text: str, system_prompt: str | None) -> list[dict[str, str]]:
    """The messages of a one-turn chat: the system prompt (if any), then the user's text."""
    messages = [{"role": "user", "content": user_text}]
    if system_prompt:
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


def pick_template(templates: str | dict[str, str] | None, tools: bool = False) -> str | None:
    """The template a chat uses: the only one, or of named ones (a tokenizer's list of
    ``{"name", "template"}``) the one named "tool_use" for a chat with tools when there is one,
    as transformers picks it, else the one named "default"."""
    if isinstance(templates, dict):
        templates = templates.get("tool_use") if tools and templates.get("tool_use") else templates.get("default")
    return templates if isinstance(templates, str) and templates else None


# --- rendering -----------------------------------------------------------------------------------


# Where a message's reasoning may be, the first being the name templates read.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


# Names a caller's template variables (``chat_template_kwargs``) may not take: what the renderer
# itself passes or defines, and apply_chat_template's own arguments. Names ending in _token(s)
# (bos_token, additional_special_tokens, ...) and starting with "_" are reserved too.
RESERVED_TEMPLATE_NAMES = frozenset((
    "messages", "conversation", "tools", "documents", "add_generation_prompt", "continue_final_message",
    "chat_template", "tokenize", "return_dict", "raise_exception", "strftime_now", "dict", "namespace",
))


def check_template_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """The extra template variables as plain data; a name that would shadow one of the
    renderer's is refused (``CompiledLLMError``), as are names that are not identifiers."""
    if not kwargs:
        return {}
    for name in kwargs:
        if not isinstance(name, str) or not name.isidentifier():
            raise CompiledLLMError(f"chat_template_kwargs: {name!r} is not a template variable name")
        if name in RESERVED_TEMPLATE_NAMES or name.startswith("_") or name.endswith(("_token", "_tokens")):
            raise CompiledLLMError(f"chat_template_kwargs: {name!r} is reserved by the chat template renderer")
    return {name: _plain(value) for name, value in kwargs.items()}


def render_chat_template(
    template: str, messages: Sequence[dict[str, Any]], add_generation_prompt: bool, variables: dict[str, str],
    template_kwargs: dict[str, Any] | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> str:
    """Render a Hugging Face chat template as transformers' apply_chat_template(tokenize=False)
    does: messages without their None fields, the reasoning under its usual names, the named
    special tokens (``bos_token``, ``eos_token``, ...), the caller's ``template_kwargs``
    (``check_template_kwargs``) as template variables, and ``tools`` (the OpenAI tool
    definitions) as the template's ``tools``."""
    extra = check_template_kwargs(template_kwargs)

    chat = []
    for message in messages:
        message = {k: _plain(v) for k, v in message.items() if v is not None}
        reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:  # templates read reasoning_content, gpt-oss ones thinking
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        chat.append(message)
    try:
        return _compile_chat_template(template).render(
            messages=chat, tools=_plain(tools) if tools else None, documents=None,
            add_generation_prompt=add_generation_prompt, **extra, **variables
        )
    except jinja2.TemplateError as e:
        raise CompiledLLMError(f"chat template: {e}") from None
    except Exception as e:  # a template is untrusted code: a range too big, recursion, 1 + "a", ...
        text = str(e).strip()
        raise CompiledLLMError(f"chat template: {type(e).__name__}: {text.splitlines()[0][:200] if text else ''}") from None


def _plain(value: Any) -> Any:
    """Only plain JSON data reaches a template (chat templates are untrusted code)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, dict):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    for t in (str, int, float):
        if isinstance(value, t):
            return t(value)
    return f"<{type(value).__name__}>"


# --- the sandbox ---------------------------------------------------------------------------------


# The most items one ``*`` or ``+`` in a chat template may make, and the most bits ``**`` may:
# far above any prompt, far below what would let a (tampered) template allocate gigabytes.
MAX_TEMPLATE_ITEMS = 1 << 24
MAX_TEMPLATE_POWER_BITS = 1 << 16


class _ChatTemplateSandbox(ImmutableSandboxedEnvironment):
    """jinja's sandbox bounds ``range``; this also bounds repetition, concatenation and powers."""

    intercepted_binops = frozenset(("*", "+", "**"))

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        sized = (str, list, tuple)
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, sized) and isinstance(n, int) and len(seq) * n > MAX_TEMPLATE_ITEMS:
                    raise jinja2.exceptions.SecurityError("the chat template repeats a value too many times")
        elif operator == "+":
            if isinstance(left, sized) and isinstance(right, sized) and len(left) + len(right) > MAX_TEMPLATE_ITEMS:
                raise jinja2.exceptions.SecurityError("the chat template builds a value that is too long")
        elif isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and right > 0 and (
                right * left.bit_length() > MAX_TEMPLATE_POWER_BITS):
            raise jinja2.exceptions.SecurityError("the chat template raises a number to too high a power")
        return super().call_binop(context, operator, left, right)


@lru_cache(maxsize=16)
def _compile_chat_template(template: str) -> Any:
    """transformers' chat template environment: a sandbox with trim_blocks and lstrip_blocks, loop
    controls, the ``{% generation %}`` tag, and the globals and filters templates rely on."""

    class GenerationTag(jinja2.ext.Extension):
        """``{% generation %}`` marks assistant text for training masks; rendering keeps it as is."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return caller()

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        # unlike jinja's own tojson: no HTML escaping, and json.dumps' options
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    class TemplateDict:  # dict() and dict.fromkeys() without access to the type itself
        def __call__(self, *args: Any, **kwargs: Any) -> dict:
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
            return dict.fromkeys(*args, **kwargs)

    def check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"Chat templates cannot store underscore-prefixed attributes on a namespace, but got {name!r}."
            )

    class TemplateNamespace(jinja2.utils.Namespace):  # no dunder attributes on namespaces
        def __init__(*args: Any, **kwargs: Any) -> None:
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

    env = _ChatTemplateSandbox(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = TemplateNamespace
    return env.from_string(template)
