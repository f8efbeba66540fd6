"""A streamed answer's tool calls, as OpenAI streams them: a call's first delta carries its index,
id, type and name, the next ones pieces of its arguments as the model writes them, which
concatenate to the arguments' JSON text (the model's own text, as the whole answer's parse gives
it).

- ``ToolCallStream`` (tool_choice "auto"): the parser decides, as the text grows, what is
  content; a call is sent from where its JSON starts (after ``<tool_call>``), its name once the
  name's string has closed, then its arguments. A call whose name has been sent cannot be taken
  back: should its JSON break later (the whole answer's parse would make it content), the call
  stays as sent, and its text comes as content as well.
- ``NamedCallStream`` (a named function): the whole answer is that call's arguments.
- ``RequiredCallStream`` ("required"): the answer is a JSON array of ``{"name", "parameters"}``.

Each has ``feed(delta, final) -> (content delta, delta.tool_calls entries)`` and ``called``.
"""

from __future__ import annotations

from typing import Any

from compiled_llm.serve.openai.tool_parsers.base import ToolCall, ToolParser, content_of, new_tool_call_id
from compiled_llm.serve.openai.tool_parsers.json_spans import ObjectScanner, ScannedObject

# a call so far: its name (None until whole) and its arguments' text so far (None while held back)
PartialCall = tuple[str | None, str | None]


class CallDeltas:
    """The ``delta.tool_calls`` entries for what is new in a list of calls so far."""

    def __init__(self, max_calls: int | None = None):
        self.max_calls = max_calls  # parallel_tool_calls false: 1
        self.sent: list[str] = []  # per call sent, its arguments sent

    @property
    def called(self) -> bool:
        return bool(self.sent)

    def update(self, calls: list[PartialCall]) -> list[dict[str, Any]]:
        deltas: list[dict[str, Any]] = []
        for index, (name, arguments) in enumerate(calls[:self.max_calls]):
            if name is None:
                break  # the calls after it wait for its name
            if index == len(self.sent):
                self.sent.append("")
                deltas.append({"index": index, "id": new_tool_call_id(), "type": "function",
                               "function": {"name": name, "arguments": ""}})
            sent = self.sent[index]
            if arguments is None or len(arguments) <= len(sent) or not arguments.startswith(sent):
                continue
            piece, self.sent[index] = arguments[len(sent):], arguments
            if deltas and deltas[-1]["index"] == index:
                deltas[-1]["function"]["arguments"] += piece
            else:
                deltas.append({"index": index, "function": {"arguments": piece}})
        return deltas


def scanned_call(scanner: ObjectScanner, obj: ScannedObject, arguments_key: str) -> PartialCall:
    """A call object as far as it is written. Arguments that are an object are sent as they
    grow; others (a JSON string, none at all) once the call's object has closed."""
    if obj.end is not None:
        call = ToolCall.from_json(scanner.text[obj.start:obj.end], arguments_key)
        if call is not None:
            return call.name, call.arguments
    name = scanner.string_value(obj, "name")
    span = obj.members.get(arguments_key) or obj.members.get("arguments")
    if span is None or scanner.text[span.start] not in "{[":
        return name, None
    return name, scanner.value_text(span)


class ScannedCalls:
    """The calls so far of scanned objects; a closed object's call is worked out once."""

    def __init__(self, arguments_key: str):
        self.arguments_key = arguments_key
        self.closed: dict[int, PartialCall] = {}  # by id of its ScannedObject

    def __call__(self, scanner: ObjectScanner) -> list[PartialCall]:
        calls = []
        for obj in scanner.objects:
            call = self.closed.get(id(obj))
            if call is None:
                call = scanned_call(scanner, obj, self.arguments_key)
                if obj.end is not None:
                    self.closed[id(obj)] = call
            calls.append(call)
        return calls


class ToolCallStream:
    """tool_choice "auto": content and calls as ``parser`` finds them."""

    def __init__(self, parser: ToolParser, max_calls: int | None = None):
        self.parser = parser
        self.text = ""
        self.sent_content = ""
        self.scanners: dict[int, ObjectScanner] = {}  # by where a call's JSON starts in text
        self.scanned = ScannedCalls(parser.arguments_key)
        self.calls = CallDeltas(max_calls)

    @property
    def called(self) -> bool:
        return self.calls.called

    def feed(self, delta: str, final: bool) -> tuple[str, list[dict[str, Any]]]:
        self.text += delta
        items, _ = self.parser.parse(self.text, final)
        content = content_of(items, final)
        content_delta = content[len(self.sent_content):] if content.startswith(self.sent_content) else ""
        self.sent_content += content_delta
        calls: list[PartialCall] = []
        for start, end in self.parser.call_spans(self.text):
            scanner = self.scanners.get(start)
            if scanner is None:
                scanner = self.scanners[start] = ObjectScanner(depth=1, max_objects=self.parser.calls_per_span)
            if not scanner.done:
                scanner.feed(self.text[start + len(scanner.text):end])
            calls += self.scanned(scanner)
        return content_delta, self.calls.update(calls)


class NamedCallStream:
    """tool_choice naming a function: every piece of the answer is a piece of its arguments; the
    call's first delta comes with the answer's first text."""

    def __init__(self, name: str):
        self.name = name
        self.text = ""
        self.calls = CallDeltas(1)

    @property
    def called(self) -> bool:
        return self.calls.called

    def feed(self, delta: str, final: bool) -> tuple[str, list[dict[str, Any]]]:
        self.text += delta
        if not self.text and not final:
            return "", []
        return "", self.calls.update([(self.name, self.text)])


class RequiredCallStream:
    """tool_choice "required": the calls of a JSON array of ``{"name", "parameters"}``."""

    def __init__(self, max_calls: int | None = None):
        self.scanner = ObjectScanner(depth=2)
        self.scanned = ScannedCalls("parameters")
        self.calls = CallDeltas(max_calls)

    @property
    def called(self) -> bool:
        return self.calls.called

    def feed(self, delta: str, final: bool) -> tuple[str, list[dict[str, Any]]]:
        self.scanner.feed(delta)
        return "", self.calls.update(self.scanned(self.scanner))
