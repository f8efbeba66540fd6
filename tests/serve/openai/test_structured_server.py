"""Structured outputs and tool calling end to end: the official openai client against one
`compiled-llm serve` process of the structured checkpoint (every byte a token, a Qwen-like
template that renders tools, the hermes tool-call parser it implies), sampling at temperature 1.0
with seeds. What comes back is what was asked for: JSON validates against its schema, regexes
and choices match, forced tool calls validate against their tool's parameters, a hermes call
written under "auto" is parsed; what cannot be served is a 400 naming the problem, and the
server is idle and well afterwards.

The model is random, so every string and array in these schemas is bounded (else it writes until
max_tokens). Each test sends its requests at once from a thread pool, so the engine batches them.
"""

from __future__ import annotations

import concurrent.futures
import json
import re
import time
import urllib.request
from typing import Literal

import jsonschema
import openai
import pydantic
import pytest
from prometheus_client.parser import text_string_to_metric_families

from helpers.server_fixtures import serve_process

MODEL = "structured"
MAX_TOKENS = 300


@pytest.fixture(scope="module")
def server(structured_engine, tmp_path_factory):
    log = tmp_path_factory.mktemp("structured_server") / "serve.log"
    with serve_process(structured_engine, "--served-model-name", MODEL, "--enable-auto-tool-choice",
                       log_path=log) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.api_url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def pool():
    with concurrent.futures.ThreadPoolExecutor(64) as p:
        yield p


def at_once(pool, calls) -> list:
    """The results of ``calls`` (functions of no arguments), run concurrently, in order."""
    return [f.result() for f in [pool.submit(call) for call in calls]]


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def text_of(choice) -> str:
    """A chat choice's content or a completion choice's text."""
    return choice.message.content if hasattr(choice, "message") else choice.text


def post(server, path: str, body: dict) -> dict:
    request = urllib.request.Request(server.url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as r:
        return json.loads(r.read())


def metrics(server) -> dict[str, float]:
    with urllib.request.urlopen(server.url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}


# ---- JSON schemas --------------------------------------------------------------------------------------

POINT = {"type": "object", "properties": {"x": {"type": "integer", "minimum": -50, "maximum": 50},
                                          "y": {"type": "integer", "minimum": -50, "maximum": 50}},
         "required": ["x", "y"], "additionalProperties": False}


def word(n: int) -> dict:
    return {"type": "string", "pattern": f"^[a-z]{{1,{n}}}$"}


SCHEMAS = {
    "flat_person": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"]},
    "nested_user": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {
            "id": {"type": "integer", "minimum": 1, "maximum": 9999},
            "email": {"type": "string", "pattern": "^[a-z]{1,6}@[a-z]{1,5}\\.com$"}},
            "required": ["id", "email"]},
        "active": {"type": "boolean"}}, "required": ["user", "active"]},
    "bounded_integer_array": {"type": "object", "properties": {
        "values": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                   "minItems": 2, "maxItems": 4}}, "required": ["values"]},
    "top_level_enum_array": {"type": "array", "items": {"enum": ["red", "green", "blue"]},
                             "minItems": 1, "maxItems": 3},
    "const_and_bounded_numbers": {"type": "object", "properties": {
        "kind": {"const": "point"},
        "x": {"type": "number", "minimum": -10, "maximum": 10},
        "y": {"type": "number", "minimum": 0.5, "maximum": 2.5}}, "required": ["kind", "x", "y"]},
    "optional_fields": {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 99}, "note": {"type": "string", "maxLength": 6},
        "score": {"type": "number", "minimum": 0, "maximum": 1}, "ok": {"type": "boolean"}},
        "required": ["id"], "additionalProperties": False},
    "any_of_scalars": {"type": "object", "properties": {
        "value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 100}, {"type": "string", "maxLength": 5},
                            {"type": "null"}]}}, "required": ["value"]},
    "refs_to_defs": {"type": "object", "$defs": {"point": POINT}, "properties": {
        "start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}}, "required": ["start", "end"]},
    "null_and_boolean": {"type": "object", "properties": {"nothing": {"type": "null"}, "flag": {"type": "boolean"}},
                         "required": ["nothing", "flag"]},
    "boolean_array": {"type": "object", "properties": {
        "flags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 5}}, "required": ["flags"]},
    "array_of_objects": {"type": "object", "properties": {
        "items": {"type": "array", "minItems": 1, "maxItems": 3, "items": {"type": "object", "properties": {
            "sku": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}$"},
            "qty": {"type": "integer", "minimum": 1, "maximum": 5}}, "required": ["sku", "qty"]}}},
        "required": ["items"]},
    "deep_nesting": {"type": "object", "properties": {"a": {"type": "object", "properties": {
        "b": {"type": "object", "properties": {"c": {"type": "object", "properties": {
            "d": {"type": "integer", "minimum": 0, "maximum": 3}}, "required": ["d"]}}, "required": ["c"]}},
        "required": ["b"]}}, "required": ["a"]},
    "mixed_enum": {"type": "object", "properties": {"v": {"enum": [1, "two", True, None, 3.5]}}, "required": ["v"]},
    "nullable_integer": {"type": "object", "properties": {
        "count": {"type": ["integer", "null"], "minimum": 0, "maximum": 1000}}, "required": ["count"]},
    "recursive_ref": {"type": "object", "properties": {
        "value": {"type": "integer", "minimum": 0, "maximum": 9},
        "next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}}, "required": ["value", "next"]},
    "tuple_prefix_items": {"type": "array", "prefixItems": [{"enum": ["GET", "PUT"]},
                                                           {"type": "integer", "minimum": 100, "maximum": 599}],
                           "items": False},
    "string_lengths": {"type": "object", "properties": {"code": {"type": "string", "minLength": 3, "maxLength": 3},
                                                        "tag": {"type": "string", "minLength": 1, "maxLength": 4}},
                       "required": ["code", "tag"]},
    "all_optional": {"type": "object", "properties": {"a": {"type": "boolean"}, "b": {"type": "null"},
                                                      "c": {"enum": ["x", "y"]}}},
    "exclusive_bounds": {"type": "object", "properties": {
        "t": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10},
        "r": {"type": "number", "exclusiveMinimum": -1, "exclusiveMaximum": 1}}, "required": ["t", "r"]},
    "const_object": {"type": "object", "properties": {"version": {"const": 2}, "meta": {"const": {"ok": True}}},
                     "required": ["version", "meta"]},
    "defs_with_enum_and_array": {"type": "object", "$defs": {
        "color": {"enum": ["red", "green"]}, "palette": {"type": "array", "items": {"$ref": "#/$defs/color"},
                                                         "minItems": 1, "maxItems": 2}},
        "properties": {"main": {"$ref": "#/$defs/color"}, "others": {"$ref": "#/$defs/palette"}},
        "required": ["main", "others"]},
    "event": {"type": "object", "properties": {
        "name": word(6), "when": {"type": "object", "properties": {
            "day": {"type": "integer", "minimum": 1, "maximum": 31},
            "month": {"enum": ["jan", "feb", "mar"]}}, "required": ["day", "month"]},
        "attendees": {"type": "array", "items": word(4), "maxItems": 2}, "public": {"type": "boolean"}},
        "required": ["name", "when", "attendees"]},
}
COMPLETION_SCHEMAS = ["flat_person", "array_of_objects"]  # also asked through /v1/completions' structured_outputs


def test_sampled_outputs_under_22_json_schemas_validate_and_nearly_all_finish(client, pool):
    def chat(i, name):
        return lambda: client.chat.completions.create(
            model=MODEL, messages=user(f"Reply with a {name} as JSON."), temperature=1.0, seed=i, n=2,
            max_tokens=MAX_TOKENS, response_format={"type": "json_schema", "json_schema": {
                "name": name, "schema": SCHEMAS[name], "strict": True}})

    def completion(i, name):
        return lambda: client.completions.create(
            model=MODEL, prompt=f"A {name} in JSON:", temperature=1.0, seed=i, n=2, max_tokens=MAX_TOKENS,
            extra_body={"structured_outputs": {"json": SCHEMAS[name]}})

    names = list(SCHEMAS) + COMPLETION_SCHEMAS
    replies = at_once(pool, [chat(i, name) for i, name in enumerate(SCHEMAS)]
                      + [completion(i, name) for i, name in enumerate(COMPLETION_SCHEMAS)])
    outputs = [(name, c.finish_reason, text_of(c)) for name, reply in zip(names, replies) for c in reply.choices]
    assert len(outputs) == 2 * len(names)
    for name, finish, text in outputs:
        if finish == "stop":
            jsonschema.validate(json.loads(text), SCHEMAS[name])
    cut = [(name, text) for name, finish, text in outputs if finish != "stop"]
    assert len(cut) <= 0.05 * len(outputs), cut


class Forecast(pydantic.BaseModel):
    city: str = pydantic.Field(pattern="^[a-z]{1,8}$")
    days: list[pydantic.conint(ge=1, le=31)] = pydantic.Field(max_length=3)
    unit: Literal["C", "F"]
    windy: bool


def test_parse_with_a_pydantic_model_returns_an_instance_of_it(client, pool):
    replies = at_once(pool, [lambda seed=seed: client.chat.completions.parse(
        model=MODEL, messages=user("Forecast?"), response_format=Forecast, temperature=1.0, seed=seed,
        max_tokens=MAX_TOKENS) for seed in range(3)])
    for reply in replies:
        (choice,) = reply.choices
        assert choice.finish_reason == "stop"
        assert isinstance(choice.message.parsed, Forecast)
        assert choice.message.parsed == Forecast.model_validate_json(choice.message.content)


REGEXES = [r"[a-c]{2,4}-[0-9]{1,3}", r"(yes|no), because [a-z]{1,10}\.", r"\d{4}-\d{2}-\d{2}",
           r"[A-Z][a-z]{0,5}( [A-Z][a-z]{0,5}){0,2}", r"0x[0-9a-f]{1,8}"]
CHOICES = [["yes", "no", "maybe so"], ["alpha", "beta", "gamma", "delta"], ["1", "12", "123"]]


def test_regex_and_choice_outputs_match_on_both_endpoints(client, pool):
    def chat(seed, constraint):
        return lambda: client.chat.completions.create(
            model=MODEL, messages=user("Answer."), temperature=1.0, seed=seed, max_tokens=60, n=2,
            extra_body={"structured_outputs": constraint}).choices

    def completion(seed, constraint):
        return lambda: client.completions.create(
            model=MODEL, prompt="Answer:", temperature=1.0, seed=seed, max_tokens=60, n=2,
            extra_body={"structured_outputs": constraint}).choices

    asks = [(seed, c, endpoint) for seed, c in enumerate([{"regex": r} for r in REGEXES] + [{"choice": c} for c in CHOICES])
            for endpoint in (chat, completion)]
    for (_, constraint, _), choices in zip(asks, at_once(pool, [endpoint(seed, c) for seed, c, endpoint in asks])):
        for c in choices:
            text = text_of(c)
            assert c.finish_reason == "stop", (constraint, text)
            if "regex" in constraint:
                assert re.fullmatch(constraint["regex"], text), (constraint, text)
            else:
                assert text in constraint["choice"], (constraint, text)


def test_a_seed_gives_one_structured_output_alone_or_among_other_requests(client, pool):
    """A token its grammar refuses is drawn again from the seed's generator, from which a step
    queued ahead may have drawn meanwhile (for a row then dropped): how the steps were queued,
    which other requests decide, must not change the output."""
    def ask(seed):
        return lambda: client.chat.completions.create(
            model=MODEL, messages=user("Reply."), temperature=1.0, seed=seed, max_tokens=MAX_TOKENS,
            response_format={"type": "json_schema", "json_schema": {"name": "e", "schema": SCHEMAS["event"]}},
        ).choices[0].message.content

    alone = ask(0)()
    among = at_once(pool, [ask(0)] * 4 + [ask(seed) for seed in range(1, 5)])
    assert among[:4] == [alone] * 4


# ---- tools ------------------------------------------------------------------------------------------------

def function(name: str, parameters: dict) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


# One tool per request: the template writes a tool's JSON into the prompt at about a token a
# character (~160 tokens, ~130 more for the template's own words), and the model takes 512.
WEATHER = function("get_weather", {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
                                   "required": ["city"]})
ADD = function("add", {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
                       "required": ["a"]})
TAG = function("tag", {"type": "object", "$defs": {"c": {"enum": ["red", "blue"]}}, "properties": {
    "tags": {"type": "array", "items": {"$ref": "#/$defs/c"}, "maxItems": 2}}, "required": ["tags"]})


def named(tool: dict) -> dict:
    return {"type": "function", "function": {"name": tool["function"]["name"]}}


def streamed_answer(stream) -> tuple[list[tuple[str, str]], str, str]:
    """A streamed choice's calls (name, arguments: its deltas concatenated per index), finish
    reason and content."""
    names, arguments, finish, content = {}, {}, None, ""
    for chunk in stream:
        for c in chunk.choices:
            content += c.delta.content or ""
            for d in c.delta.tool_calls or []:
                if d.function and d.function.name:
                    names[d.index] = d.function.name
                arguments[d.index] = arguments.get(d.index, "") + ((d.function and d.function.arguments) or "")
            finish = c.finish_reason or finish
    return [(names[i], arguments[i]) for i in sorted(names)], finish, content


def answer(reply) -> tuple[list[tuple[str, str]], str, str]:
    (choice,) = reply.choices
    calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
    return calls, choice.finish_reason, choice.message.content or ""


def tool_reply(client, tool, tool_choice, seed: int, stream: bool, parallel: bool = True, **extra):
    """The calls, finish reason and content of a chat that offers ``tool`` (max_tokens unset: all
    the context the prompt leaves)."""
    reply = client.chat.completions.create(model=MODEL, messages=user("Use the tool."), tools=[tool],
                                           tool_choice=tool_choice, parallel_tool_calls=parallel, temperature=1.0,
                                           seed=seed, stream=stream, **extra)
    return streamed_answer(reply) if stream else answer(reply)


FORCED = [  # tool, tool_choice, finish_reason
    (WEATHER, "required", "tool_calls"),
    (ADD, "required", "tool_calls"),
    (TAG, "required", "tool_calls"),
    (WEATHER, named(WEATHER), "stop"),  # as vLLM: a named function's answer keeps "stop"
    (TAG, named(TAG), "stop"),
]


def test_forced_tool_calls_always_validate_streamed_and_not(client, pool):
    """One call per answer (parallel_tool_calls false), so that every answer fits in the 150-220
    tokens the prompt leaves and ends with its call."""
    asks = [(tool, choice, finish, seed, stream) for tool, choice, finish in FORCED for seed in range(4)
            for stream in (False, True)]
    replies = at_once(pool, [lambda a=a: tool_reply(client, a[0], a[1], a[3], a[4], parallel=False) for a in asks])
    for (tool, choice, finish, seed, stream), (calls, reason, content) in zip(asks, replies):
        what = (tool["function"]["name"], choice, seed, stream, calls, reason)
        assert reason == finish and len(calls) == 1 and content == "", what
        ((name, arguments),) = calls
        assert name == tool["function"]["name"], what
        jsonschema.validate(json.loads(arguments), tool["function"]["parameters"])
    # a seed gives one answer, whose streamed arguments add up to the unstreamed ones
    assert replies[0::2] == replies[1::2]


def test_required_with_parallel_calls_streams_each_call_at_its_index(server, client, pool):
    """With parallel_tool_calls the model chooses how many calls to write; whitespace is biased
    away (a random model spends most of its tokens on it) so that several fit. An answer cut by
    the end of the context is content, not calls; every call of the others validates."""
    bias = {str(t): -100 for t in post(server, "/tokenize", {"prompt": "\t\n\r"})["tokens"]}
    asks = [(seed, stream) for seed in range(8) for stream in (False, True)]
    replies = at_once(pool, [lambda a=a: tool_reply(client, ADD, "required", *a, logit_bias=bias) for a in asks])
    assert {reason for _, reason, _ in replies} <= {"tool_calls", "length"}
    finished = [calls for calls, reason, _ in replies if reason == "tool_calls"]
    assert len(finished) >= len(asks) // 2 and max(map(len, finished)) >= 2, replies
    for calls in finished:
        for name, arguments in calls:
            assert name == "add"
            jsonschema.validate(json.loads(arguments), ADD["function"]["parameters"])
    for (unstreamed, streamed) in zip(replies[0::2], replies[1::2]):
        assert unstreamed[1] == streamed[1]
        if unstreamed[1] == "tool_calls":
            assert unstreamed == streamed


HERMES_CALL = r'<tool_call>\{"name": "get_weather", "arguments": \{"city": "[a-z]{1,8}"\}\}</tool_call>'


def test_auto_parses_a_hermes_call_the_model_writes(client, pool):
    """A random model writes no call of its own accord: a regex spells one in the template's
    format, and "auto" reads it as the model's."""
    forced = {"structured_outputs": {"regex": HERMES_CALL}}
    replies = at_once(pool, [lambda seed=seed, stream=stream: tool_reply(client, WEATHER, "auto", seed, stream,
                                                                         extra_body=forced)
                             for seed in range(2) for stream in (False, True)])
    for calls, reason, content in replies:
        assert reason == "tool_calls" and content == ""
        ((name, arguments),) = calls
        assert name == "get_weather" and re.fullmatch("[a-z]{1,8}", json.loads(arguments)["city"])
    assert replies[0::2] == replies[1::2]


# ---- bad input ------------------------------------------------------------------------------------------
# (a tool_choice naming an unknown function and malformed logit_bias: test_server.py)

@pytest.mark.parametrize("extra, named", [
    ({"structured_outputs": {"json": {"type": "strnig"}}}, "invalid JSON schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {
        "type": "object", "properties": {"a": {"not": {"type": "string"}}}}}}}, "#/properties/a/not is not supported"),
    ({"structured_outputs": {"regex": "(ab"}}, "invalid regex"),
    ({"structured_outputs": {"grammar": "root ::= missing"}}, "invalid grammar"),
    ({"logit_bias": {"100000": 1}}, "logit_bias token id 100000 is outside"),
])
def test_what_cannot_be_served_is_a_400_naming_the_problem(client, extra, named):
    for ask in (lambda: client.chat.completions.create(model=MODEL, messages=user("hi"), max_tokens=4, extra_body=extra),
                lambda: client.completions.create(model=MODEL, prompt="hi", max_tokens=4, extra_body=extra)):
        with pytest.raises(openai.BadRequestError) as e:
            ask()
        assert named in e.value.body["message"]


def test_a_regex_that_cannot_finish_in_max_tokens_ends_with_length_and_the_server_stays_well(client, server):
    reply = client.chat.completions.create(model=MODEL, messages=user("Letters."), temperature=1.0, seed=0,
                                           max_tokens=5, extra_body={"structured_outputs": {"regex": "[a-z]{40}"}})
    (choice,) = reply.choices
    assert choice.finish_reason == "length" and re.fullmatch("[a-z]{1,39}", choice.message.content)
    plain = client.completions.create(model=MODEL, prompt="hello", max_tokens=3, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert plain.choices[0].finish_reason == "length" and plain.usage.completion_tokens == 3
    deadline = time.monotonic() + 10
    while True:  # every request of the module done, every KV block free
        m = metrics(server)
        if (m["compiled_llm:num_requests_running"], m["compiled_llm:num_requests_waiting"],
                m["compiled_llm:kv_cache_usage_perc"]) == (0, 0, 0):
            break
        assert time.monotonic() < deadline, m
        time.sleep(0.05)
    assert "Traceback" not in server.log()
