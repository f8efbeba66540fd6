"""A chat request's tools: checked, handed to the chat template, and the answer's calls parsed.

As vLLM: with ``tools`` the template sees them (transformers' ``apply_chat_template(tools=...)``);
``tool_choice`` defaults to "auto" when there are tools, else "none". "none" renders the tools
but parses nothing; "auto" parses the calls the model writes, and needs the server started with
``--enable-auto-tool-choice`` and a tool-call parser (``--tool-call-parser``, by default the one
the chat template implies). "required" and a named function decode the answer under a JSON
schema built from the tools (``forced_tool_calls.py``), so it always parses into calls; they need
no parser, and leave no room for the request's own response_format or structured_outputs.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Callable

from compiled_llm.serve.openai.forced_tool_calls import named_schema, parse_required, required_schema
from compiled_llm.serve.openai.protocol import ChatCompletionRequest
from compiled_llm.serve.openai.serving import ApiError, ServerState
from compiled_llm.serve.openai.tool_parsers import PARSERS, ToolParser, parser_for_template
from compiled_llm.serve.openai.tool_parsers.base import ToolCall, content_of
from compiled_llm.serve.openai.tool_parsers.stream import NamedCallStream, RequiredCallStream, ToolCallStream
from compiled_llm.serve.sampling_params import StructuredOutputsParams


def _bad(message: str, param: str) -> ApiError:
    return ApiError(400, message, "BadRequestError", param=param)


@dataclasses.dataclass(frozen=True)
class ToolPlan:
    """How a chat's answer becomes tool calls: with ``parser`` ("auto") the calls it finds; with
    ``named`` the whole answer is that function's arguments; with ``required`` the answer is a
    JSON array of calls; else ("none") the answer is all content. ``structured_outputs`` is the
    grammar named and required decode under."""

    parser: ToolParser | None = None
    max_calls: int | None = None  # 1 with parallel_tool_calls false
    named: str | None = None
    required: bool = False
    structured_outputs: StructuredOutputsParams | None = None

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """The whole answer's content (None when empty) and calls."""
        if self.named is not None:
            return None, [ToolCall(self.named, text)]
        if self.required:
            calls = parse_required(text)
            return (None, calls[:self.max_calls]) if calls else (text, [])
        if self.parser is None:
            return text, []
        items, _ = self.parser.parse(text, final=True)
        calls = [item for item in items if isinstance(item, ToolCall)][:self.max_calls]
        if not calls:
            return text, []
        return content_of(items, final=True) or None, calls

    def stream(self) -> ToolCallStream | NamedCallStream | RequiredCallStream | None:
        """One choice's streamed split into content and call deltas (None: all content)."""
        if self.named is not None:
            return NamedCallStream(self.named)
        if self.required:
            return RequiredCallStream(self.max_calls)
        return None if self.parser is None else ToolCallStream(self.parser, self.max_calls)

    def finish_reason(self, called: bool, reason: str | None) -> str | None:
        """As vLLM's, after OpenAI's: "tool_calls" once "auto" called tools, or when "required"
        stopped after its calls; a named function keeps the engine's reason ("stop")."""
        if reason is None or not called or self.named is not None:
            return reason
        if self.required:
            return "tool_calls" if reason == "stop" else reason
        return "tool_calls"


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

    def auto_parser() -> ToolParser:
        parser = server_parser_name(state)
        if not state.config.enable_auto_tool_choice or parser is None:
            raise _bad("tool_choice 'auto' needs the server started with --enable-auto-tool-choice and a "
                       "--tool-call-parser (none is set or implied by the chat template)", "tool_choice")
        return PARSERS[parser]

    return plan_tools(req.tools or [], req.tool_choice, req.parallel_tool_calls is not False, auto_parser)


def plan_tools(tools: list[dict[str, Any]], tool_choice: str | dict[str, Any] | None, parallel: bool,
               auto_parser: Callable[[], ToolParser | None]) -> ToolPlan:
    """The plan for ``tools`` and ``tool_choice`` (None: "auto" with tools, else "none");
    ``auto_parser`` gives the parser "auto" reads calls with (None: none)."""
    names = _tool_names(tools)
    max_calls = None if parallel else 1
    choice = tool_choice if tool_choice is not None else ("auto" if names else "none")
    if isinstance(choice, dict):
        function = choice.get("function") if isinstance(choice.get("function"), dict) else {}
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise _bad("tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'function': "
                       "{'name': ...}}", "tool_choice")
        if name not in names:
            raise _bad(f"tool_choice names the function {name!r}, which is not in tools", "tool_choice")
        schema = named_schema(tools[names.index(name)])
        return ToolPlan(named=name, structured_outputs=StructuredOutputsParams(json=schema))
    if choice == "required":
        if not names:
            raise _bad("tool_choice 'required' needs tools", "tool_choice")
        schema = required_schema(tools, max_calls)
        return ToolPlan(max_calls=max_calls, required=True, structured_outputs=StructuredOutputsParams(json=schema))
    if choice not in ("none", "auto"):
        raise _bad(f"tool_choice must be 'none', 'auto', 'required' or a named function, got {choice!r}",
                   "tool_choice")
    if choice == "none":
        return ToolPlan()
    if not names:
        raise _bad("tool_choice 'auto' needs tools", "tool_choice")
    return ToolPlan(auto_parser(), max_calls)


def check_no_other_constraint(plan: ToolPlan, requested: StructuredOutputsParams | None) -> None:
    """tool_choice "required" or a named function decodes under its own grammar: the request
    cannot ask for another (response_format, structured_outputs)."""
    if plan.structured_outputs is not None and requested is not None:
        what = "'required'" if plan.required else "naming a function"
        raise _bad(f"tool_choice {what} constrains the answer to tool calls; leave response_format and "
                   f"structured_outputs unset, or use tool_choice 'auto'", "tool_choice")


def _tool_names(tools: list[dict[str, Any]]) -> list[str]:
    names = []
    for i, tool in enumerate(tools):
        if tool.get("type", "function") != "function":
            raise _bad(f"tools[{i}] has type {tool.get('type')!r}; only 'function' tools are supported", "tools")
        function = tool.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str) or not name:
            raise _bad(f"tools[{i}] has no function name (tools[{i}].function.name)", "tools")
        if function.get("parameters") is not None and not isinstance(function["parameters"], dict):
            raise _bad(f"tools[{i}].function.parameters must be a JSON schema object", "tools")
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
