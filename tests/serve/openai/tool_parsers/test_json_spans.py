"""ObjectScanner: the value spans of the members of JSON objects at one depth, found as the text
arrives in pieces, whatever the pieces."""

from __future__ import annotations

import json

import pytest

from compiled_llm.serve.openai.tool_parsers.json_spans import ObjectScanner

CALLS = ('[{"name": "get_weather", "parameters": {"city": "Pa\\"ris}", "days": [1, {"x": "]"}]}}, '
         '{"name":"get_time","parameters":{},"n": -1.5e3 , "ok":true}]')


def scanned(text: str, depth: int, pieces: int = 1, **kw) -> ObjectScanner:
    scanner = ObjectScanner(depth=depth, **kw)
    size = max(1, len(text) // pieces)
    for i in range(0, len(text), size):
        scanner.feed(text[i:i + size])
    return scanner


def members(scanner: ObjectScanner) -> list[dict[str, str]]:
    return [{k: scanner.value_text(span) for k, span in obj.members.items()} for obj in scanner.objects]


@pytest.mark.parametrize("pieces", [1, 7, len(CALLS)])
def test_the_objects_of_an_array_and_their_members_values_are_found_in_any_pieces(pieces):
    scanner = scanned(CALLS, depth=2, pieces=pieces)
    assert members(scanner) == [
        {"name": '"get_weather"', "parameters": '{"city": "Pa\\"ris}", "days": [1, {"x": "]"}]}'},
        {"name": '"get_time"', "parameters": "{}", "n": "-1.5e3", "ok": "true"},
    ]
    values = json.loads(CALLS)
    assert [json.loads(m["parameters"]) for m in members(scanner)] == [v["parameters"] for v in values]
    assert [scanner.string_value(obj, "name") for obj in scanner.objects] == ["get_weather", "get_time"]
    assert all(CALLS[o.start] == "{" and CALLS[o.end - 1] == "}" for o in scanner.objects)


def test_an_open_value_has_no_end_and_its_text_so_far_grows_with_the_text():
    scanner = ObjectScanner(depth=2)
    cut = CALLS.index("[1,")
    scanner.feed(CALLS[:cut])
    (obj,) = scanner.objects
    span = obj.members["parameters"]
    assert obj.end is None and span.end is None
    assert scanner.value_text(span) == '{"city": "Pa\\"ris}", "days": '
    assert scanner.string_value(obj, "name") == "get_weather"
    scanner.feed(CALLS[cut:])
    assert span.end is not None and json.loads(scanner.value_text(span))["days"] == [1, {"x": "]"}]


def test_a_name_is_known_only_once_its_string_has_closed():
    scanner = ObjectScanner(depth=1)
    scanner.feed('{"name": "get_wea')
    assert scanner.string_value(scanner.objects[0], "name") is None
    scanner.feed('ther\\u00e9"')
    assert scanner.string_value(scanner.objects[0], "name") == "get_weatheré"


def test_top_level_objects_one_after_another_with_text_between():
    text = '<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {"y": "}"}}'
    scanner = scanned(text, depth=1, pieces=5)
    assert members(scanner) == [{"name": '"a"', "parameters": '{"x": 1}'}, {"name": '"b"', "parameters": '{"y": "}"}'}]


def test_max_objects_stops_reading_after_the_first_closes():
    scanner = scanned('{"name": "a", "arguments": {}}\n</tool_call>{"name": "b"}', depth=1, max_objects=1)
    assert scanner.done and len(scanner.objects) == 1


def test_text_that_is_not_json_gives_no_error():
    for text in ('}}]] "unclosed', '{"a" "b": }', '{"name": {"x": [}', "plain words"):
        scanned(text, depth=1)
        scanned(text, depth=2, pieces=len(text))
