"""A chat request's tools: checked, handed to the chat template, and the answer's calls parsed.

As vLLM: with ``tools`` the template sees them (transformers' ``apply_chat_template(tools=...)``);
``tool_choice`` defaults to "auto" when there are tools, else "none". "none" renders the tools
but parses nothing; "auto" parses the calls the model writes, and needs the server started with
``--enable-auto-tool-choice`` and a tool-call parser (``--tool-call-parser``, by default the one
the chat template implies). "required" and a named function need grammar-constrained decoding
(structured outputs), which this server does not have yet: they are refused.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from compiled_llm.serve.openai.protocol import ChatCompletionRequest
from compiled_llm.serve.openai.serving import ApiError, ServerState
from compiled_llm.serve.openai.tool_parsers import PARSERS, ToolParser, parser_for_template
from compiled_llm.serve.openai.tool_parsers.base import ToolCall, content_of


def _bad(message: str, param: str) -> ApiError:
    return ApiError(400, message, "BadRequestError", param=param)


@dataclasses.dataclass(frozen=True)
class ToolPlan:
    parser: ToolParser | None  # None: the answer is all content
    max_calls: int | None  # 1 with parallel_tool_calls false

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """The whole answer's content (None when empty) and calls."""
        if self.parser is None:
            return text, []
        items, _ = self.parser.parse(text, final=True)
        calls = [item for item in items if isinstance(item, ToolCall)][:self.max_calls]
        if not calls:
            return text, []
        return content_of(items, final=True) or None, calls


def server_parser_name(state: ServerState) -> str | None:
    """--tool-call-parser, else the one the chat template implies ("none": no parser)."""
    name = state.config.tool_call_parser
    if name is None:
        tok = state.tokenizer
        template = tok.chat_template_text(tools=True) if tok is not None else None
        name = parser_for_template(template)
    return None if name in (None, "none") else name


def tool_plan(state: ServerState, req: ChatCompletionRequest) -> ToolPlan:
    """Checks the request's tools and tool_choice; refuses what cannot be served."""
    names = _tool_names(req.tools or [])
    choice = req.tool_choice if req.tool_choice is not None else ("auto" if names else "none")
    if isinstance(choice, dict):
        function = choice.get("function") if isinstance(choice.get("function"), dict) else {}
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise _bad("tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'function': "
                       "{'name': ...}}", "tool_choice")
        if name not in names:
            raise _bad(f"tool_choice names the function {name!r}, which is not in tools", "tool_choice")
        raise _bad("tool_choice naming a function needs structured outputs (grammar-constrained decoding), "
                   "which are not supported yet; use 'auto'", "tool_choice")
    if choice == "required":
        raise _bad("tool_choice 'required' needs structured outputs (grammar-constrained decoding), which are "
                   "not supported yet; use 'auto'", "tool_choice")
    if choice not in ("none", "auto"):
        raise _bad(f"tool_choice must be 'none', 'auto', 'required' or a named function, got {choice!r}",
                   "tool_choice")
    if choice == "none":
        return ToolPlan(None, None)
    if not names:
        raise _bad("tool_choice 'auto' needs tools", "tool_choice")
    parser = server_parser_name(state)
    if not state.config.enable_auto_tool_choice or parser is None:
        raise _bad("tool_choice 'auto' needs the server started with --enable-auto-tool-choice and a "
                   "--tool-call-parser (none is set or implied by the chat template)", "tool_choice")
    return ToolPlan(PARSERS[parser], 1 if req.parallel_tool_calls is False else None)


def _tool_names(tools: list[dict[str, Any]]) -> list[str]:
    names = []
    for i, tool in enumerate(tools):
        if tool.get("type", "function") != "function":
            raise _bad(f"tools[{i}] has type {tool.get('type')!r}; only 'function' tools are supported", "tools")
        function = tool.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str) or not name:
            raise _bad(f"tools[{i}] has no function name (tools[{i}].function.name)", "tools")
        names.append(name)
    return names


def template_tool_calls(tool_calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """An assistant message's calls as chat templates read them (transformers' and vLLM's way):
    ``function.arguments`` as a dict, not the API's JSON text."""
    out = []
    for call in tool_calls:
        call = dict(call)
        function = call.get("function")
        if isinstance(function, dict) and isinstance(function.get("arguments"), str):
            try:
                call["function"] = {**function, "arguments": json.loads(function["arguments"])}
            except ValueError:
                pass  # not JSON: the template gets the text as it came
        out.append(call)
    return out
