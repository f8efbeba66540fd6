"""The hermes and llama3_json parsers on hand-written answers, whole and streamed."""

from __future__ import annotations

import json

import pytest

from compiled_llm.serve.openai.tool_calls import ToolPlan
from compiled_llm.serve.openai.tool_parsers import PARSERS, parser_for_template
from compiled_llm.serve.openai.tool_parsers.stream import ToolCallStream

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
TIME = '{"name": "get_time", "arguments": {"zone": "CET"}}'


def whole(parser: str, text: str, max_calls=None):
    content, calls = ToolPlan(PARSERS[parser], max_calls).parse(text)
    return content, [(c.name, json.loads(c.arguments)) for c in calls]


def streamed(parser: str, pieces: list[str], max_calls=None):
    stream = ToolCallStream(PARSERS[parser], max_calls)
    content, calls = "", {}
    for i, piece in enumerate(pieces):
        text, deltas = stream.feed(piece, final=i == len(pieces) - 1)
        content += text
        for d in deltas:
            call = calls.setdefault(d["index"], {"name": None, "arguments": ""})
            if "id" in d:
                assert d["id"].startswith("chatcmpl-tool-") and d["type"] == "function" and call["name"] is None
                call["name"] = d["function"]["name"]
            call["arguments"] += d["function"]["arguments"]
    return content, [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())]


def test_hermes_one_call():
    assert whole("hermes", f"<tool_call>\n{WEATHER}\n</tool_call>") == (
        None, [("get_weather", {"city": "Paris", "unit": "celsius"})])


def test_hermes_several_calls_with_text_around_them():
    text = f"Let me check.\n<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n{TIME}\n</tool_call>\nDone."
    assert whole("hermes", text) == ("Let me check.Done.", [
        ("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {"zone": "CET"})])


def test_parallel_tool_calls_false_keeps_the_first_call():
    text = f"<tool_call>{WEATHER}</tool_call><tool_call>{TIME}</tool_call>"
    assert whole("hermes", text, max_calls=1)[1] == [("get_weather", {"city": "Paris", "unit": "celsius"})]


def test_hermes_malformed_json_stays_content():
    text = 'Hi <tool_call>{"name": "f", "arguments": {</tool_call>'
    assert whole("hermes", text) == (text, [])


def test_hermes_a_call_left_open_at_the_end_counts_when_its_json_is_whole():
    assert whole("hermes", f"<tool_call>{TIME}")[1] == [("get_time", {"zone": "CET"})]


def test_text_without_calls_is_all_content():
    assert whole("hermes", "The weather is fine. <tool") == ("The weather is fine. <tool", [])
    assert whole("llama3_json", "Paris is sunny.") == ("Paris is sunny.", [])


def test_llama3_json_calls_with_and_without_the_python_tag():
    call = '{"name": "get_time", "parameters": {"zone": "CET"}}'
    assert whole("llama3_json", call) == (None, [("get_time", {"zone": "CET"})])
    assert whole("llama3_json", f"<|python_tag|>{call}; {call}")[1] == [("get_time", {"zone": "CET"})] * 2


def test_llama3_json_malformed_stays_content():
    text = '{"name": "get_time", "parameters": {"zone": '
    assert whole("llama3_json", text) == (text, [])


HERMES_TEXTS = [
    f"Let me check.\n<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n{TIME}\n</tool_call>\nDone.",
    'Hi <tool_call>{"arguments": {</tool_call> bye',  # broken before its name: content
    "a <tool_ca b </tool_call> c <",
    f"<tool_call>{TIME}",
    '<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>',  # arguments as a JSON string
    '<tool_call>{"name": "g"}</tool_call>',  # no arguments: {}
]
LLAMA_TEXTS = ['<|python_tag|>{"name": "get_time", "parameters": {"zone": "CET"}}', "  <|python_t", "Plain {text}"]


@pytest.mark.parametrize("parser,text", [("hermes", t) for t in HERMES_TEXTS] + [("llama3_json", t) for t in LLAMA_TEXTS])
def test_every_split_into_two_or_three_deltas_streams_what_the_whole_parses_to(parser, text):
    content, calls = whole(parser, text)
    expected = (content or "", calls)
    assert streamed(parser, [text]) == expected
    assert streamed(parser, list(text)) == expected
    for i in range(len(text) + 1):
        assert streamed(parser, [text[:i], text[i:]]) == expected, i
        j = (i + len(text)) // 2
        assert streamed(parser, [text[:i], text[i:j], text[j:]]) == expected, (i, j)


def raw_streamed(parser: str, pieces: list[str]) -> list[dict]:
    """Each feed's tool-call deltas."""
    stream = ToolCallStream(PARSERS[parser])
    return [stream.feed(piece, final=i == len(pieces) - 1)[1] for i, piece in enumerate(pieces)]


@pytest.mark.parametrize("parser,text", [
    ("hermes", f"Let me check.\n<tool_call>\n{WEATHER}\n</tool_call>"),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}'),
])
def test_auto_streams_a_calls_arguments_in_pieces_as_they_are_written(parser, text):
    (whole_call,) = ToolPlan(PARSERS[parser]).parse(text)[1]
    pieces = [text[i:i + 3] for i in range(0, len(text), 3)]
    feeds = raw_streamed(parser, pieces)
    deltas = [d for feed in feeds for d in feed]
    assert deltas[0]["function"]["name"] == "get_weather" and "id" in deltas[0]
    arguments = [d["function"]["arguments"] for d in deltas]
    # the arguments are sent while the model writes them, before the call is whole
    sent_before_the_end = "".join(d["function"]["arguments"] for feed in feeds[:-2] for d in feed)
    assert len([a for a in arguments if a]) > 5 and sent_before_the_end.startswith('{"city": "Par')
    # and concatenate to the whole answer's arguments, the model's own text
    assert "".join(arguments) == whole_call.arguments == '{"city": "Paris", "unit": "celsius"}'


def test_a_call_whose_name_was_sent_stays_a_call_when_its_json_breaks():
    text = 'Hi <tool_call>{"name": "f", "arguments": {</tool_call> bye'
    assert whole("hermes", text) == (text, [])  # whole, it is content
    stream = ToolCallStream(PARSERS["hermes"])
    content, deltas = "", []
    for i, c in enumerate(text):
        piece, new = stream.feed(c, final=i == len(text) - 1)
        content, deltas = content + piece, deltas + new
    assert stream.called and deltas[0]["function"]["name"] == "f"
    assert "".join(d["function"]["arguments"] for d in deltas) == "{"
    assert content == text  # its text comes as content as well


def test_a_partial_tag_is_held_back_until_known():
    stream = ToolCallStream(PARSERS["hermes"])
    assert stream.feed("Hi <tool_", final=False) == ("Hi", [])
    assert stream.feed("box> yes", final=True) == (" <tool_box> yes", [])


def test_the_template_implies_the_parser():
    assert parser_for_template("{{ '<tool_call>' }}{{ tools | tojson }}") == "hermes"
    assert parser_for_template("{{ '<|python_tag|>' }}") == "llama3_json"
    assert parser_for_template("{{ messages }}") is None
