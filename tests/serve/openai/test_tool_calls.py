"""A chat's tools: rendered by the chat template as transformers renders them, checked, and the
answer's calls parsed into OpenAI's message and finish reason."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import xgrammar
from xgrammar.testing import _is_grammar_accept_string

from compiled_llm.errors import InvalidRequestError
from compiled_llm.model.tokenizer.loader import load_tokenizer
from compiled_llm.serve.openai.protocol import ChatCompletionRequest, ChatMessage
from compiled_llm.serve.openai.reasoning.chat import ChatReasoning
from compiled_llm.serve.openai.reasoning.parsers import PARSERS
from compiled_llm.serve.openai.serving import ApiError
from compiled_llm.serve.openai.serving_chat import _ChatStream, _Shape, chat_messages
from compiled_llm.serve.openai.structured_outputs import request_structured_outputs
from compiled_llm.serve.openai.tool_calls import check_no_other_constraint, server_parser_name, tool_plan
from compiled_llm.serve.server_config import ServerConfig
from helpers.trained_tokenizers import QWEN_TOOLS_TEMPLATE, train_hf_tokenizer

QWEN_LIKE = QWEN_TOOLS_TEMPLATE

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    _, hf = train_hf_tokenizer(chat_template=QWEN_LIKE)
    path = tmp_path_factory.mktemp("qwen_like")
    hf.save_pretrained(str(path))
    return hf, load_tokenizer(path)


def test_tools_and_calls_render_as_transformers_renders_them(tokenizers):
    hf, ours = tokenizers
    messages = chat_messages([ChatMessage(**m) for m in CONVERSATION])
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}  # a dict, as HF templates read
    ids = ours.apply_chat_template(messages, tools=[WEATHER_TOOL])
    text = hf.apply_chat_template(messages, tools=[WEATHER_TOOL], add_generation_prompt=True, tokenize=False)
    assert ids == hf.encode(text, add_special_tokens=False)
    assert "get_weather" in text and "The weather in a city" in text
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in text


def test_a_chat_with_tools_uses_the_tokenizers_tool_use_template_as_transformers_does(tmp_path):
    plain = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    _, hf = train_hf_tokenizer(chat_template={"default": plain, "tool_use": QWEN_LIKE})
    hf.save_pretrained(str(tmp_path))
    ours = load_tokenizer(tmp_path)
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    with_tools = hf.apply_chat_template(messages, tools=[WEATHER_TOOL], add_generation_prompt=True, tokenize=False)
    assert "get_weather" in with_tools
    assert ours.apply_chat_template(messages, tools=[WEATHER_TOOL]) == hf.encode(with_tools, add_special_tokens=False)
    without = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert ours.apply_chat_template(messages) == hf.encode(without, add_special_tokens=False)
    # the parser the server infers reads the template chats with tools use
    served = SimpleNamespace(config=ServerConfig(), tokenizer=ours, model_name="m")
    assert server_parser_name(served) == "hermes"


def state(template: str = QWEN_LIKE, **config):
    tok = SimpleNamespace(has_chat_template=True, chat_template_text=lambda tools=False: template)
    return SimpleNamespace(config=ServerConfig(**config), tokenizer=tok, model_name="m")


def request(**fields):
    return ChatCompletionRequest(messages=[ChatMessage(role="user", content="hi")], **fields)


@pytest.mark.parametrize("fields,named", [
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools[0] has no function name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]},
     "tools[0].function.parameters must be a JSON schema object"),
    ({"tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "'nope', which is not in tools"),
    ({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, "which is not in tools"),
    ({"tool_choice": "required"}, "'required' needs tools"),
    ({"tools": [WEATHER_TOOL], "tool_choice": "sometimes"}, "tool_choice must be"),
    ({"tools": [WEATHER_TOOL]}, "--enable-auto-tool-choice"),
])
def test_what_cannot_be_served_is_a_400_naming_it(fields, named):
    with pytest.raises(ApiError) as e:
        tool_plan(state(), request(**fields))
    assert e.value.status == 400 and named in str(e.value)


def test_auto_needs_a_parser_the_flag_or_the_template_gives():
    with pytest.raises(ApiError):
        tool_plan(state("{{ messages }}", enable_auto_tool_choice=True), request(tools=[WEATHER_TOOL]))
    plan = tool_plan(state("{{ messages }}", enable_auto_tool_choice=True, tool_call_parser="hermes"),
                     request(tools=[WEATHER_TOOL]))
    assert plan.parser is not None
    assert tool_plan(state(), request(tools=[WEATHER_TOOL], tool_choice="none")).parser is None


ANSWER = 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def completion(index, text, finish="stop", delta=""):
    return SimpleNamespace(index=index, text=text, token_ids=[1], logprobs=None, finish_reason=finish,
                           stop_reason=None, delta_text=delta, delta_token_ids=[1], delta_logprobs=None)


def shape(n=2, **fields):
    s = state(enable_auto_tool_choice=True)
    req = request(**{"tools": [WEATHER_TOOL], "n": n, "stream": True, **fields})
    return _Shape(s, req, "chatcmpl-x", 0, tool_plan(s, req))


def test_with_a_reasoning_parser_the_calls_are_parsed_from_the_answer_after_the_think_block():
    s = shape()
    s.reasoning = ChatReasoning(PARSERS["deepseek_r1"], "")
    out = SimpleNamespace(outputs=[completion(0, "weather needs a tool</think>" + ANSWER),
                                   completion(1, "<tool_call> is only a thought</think>")],
                          prompt_token_ids=[1, 2], prompt_logprobs=None)
    first, second = s.response(out).model_dump()["choices"]
    assert first["finish_reason"] == "tool_calls"
    assert first["message"]["reasoning_content"] == "weather needs a tool" and first["message"]["content"] == "Checking."
    (call,) = first["message"]["tool_calls"]
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    # a tag inside the reasoning is no call, and an empty answer is null
    assert second["finish_reason"] == "stop" and second["message"]["tool_calls"] == []
    assert second["message"]["reasoning_content"] == "<tool_call> is only a thought"
    assert second["message"]["content"] is None


def test_auto_parses_each_choice_into_tool_calls():
    out = SimpleNamespace(outputs=[completion(0, ANSWER), completion(1, "No tools needed.")],
                          prompt_token_ids=[1, 2], prompt_logprobs=None)
    first, second = shape().response(out).model_dump()["choices"]
    assert first["finish_reason"] == "tool_calls" and first["message"]["content"] == "Checking."
    (call,) = first["message"]["tool_calls"]
    assert call["id"].startswith("chatcmpl-tool-") and call["type"] == "function"
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    assert second["finish_reason"] == "stop" and second["message"] == {
        "role": "assistant", "content": "No tools needed.", "tool_calls": [], "reasoning_content": None}


def test_a_streamed_call_arrives_as_tool_call_deltas_and_ends_with_tool_calls():
    writer = _ChatStream(shape(n=1), [1, 2])
    pieces = [ANSWER[:15], ANSWER[15:40], ANSWER[40:]]
    events = []
    for i, piece in enumerate(pieces):
        final = i == len(pieces) - 1
        out = SimpleNamespace(outputs=[completion(0, "", "stop" if final else None, piece)], prompt_logprobs=None)
        events += writer.chunks([(0, out)])
    choices = [e["choices"][0] for e in events]
    assert "".join(c["delta"].get("content") or "" for c in choices) == "Checking."
    calls = [d for c in choices for d in c["delta"].get("tool_calls", [])]
    assert calls[0]["function"]["name"] == "get_weather" and calls[0]["id"].startswith("chatcmpl-tool-")
    assert json.loads("".join(d["function"]["arguments"] for d in calls)) == {"city": "Paris"}
    assert [c["finish_reason"] for c in choices][-1] == "tool_calls"
    assert all(c["finish_reason"] is None for c in choices[:-1])


# ---- tool_choice "required" and a named function: decoded under a schema of the tools ----------------

TIME_TOOL = {"type": "function", "function": {"name": "get_time", "description": "The time in a zone"}}  # no parameters
PLACE_TOOL = {"type": "function", "function": {"name": "find_place", "parameters": {
    "type": "object", "properties": {"place": {"$ref": "#/$defs/Place"}}, "required": ["place"],
    "$defs": {"Place": {"type": "object", "properties": {"lat": {"type": "number"}}, "required": ["lat"]}}}}}
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def accepts(schema: dict, text: str) -> bool:
    return _is_grammar_accept_string(xgrammar.Grammar.from_json_schema(json.dumps(schema)), text)


def test_a_named_function_decodes_under_its_parameters_schema():
    plan = tool_plan(state(), request(tools=[WEATHER_TOOL, TIME_TOOL], tool_choice=NAMED))
    schema = plan.structured_outputs.json
    assert schema == WEATHER_TOOL["function"]["parameters"]
    assert accepts(schema, '{"city": "Paris"}') and not accepts(schema, '{"town": "Paris"}')
    # a function without parameters takes any object
    timed = tool_plan(state(), request(tools=[TIME_TOOL], tool_choice={"type": "function", "function": {"name": "get_time"}}))
    assert timed.structured_outputs.json == {"type": "object"} and accepts({"type": "object"}, '{"zone": "CET"}')


def test_required_decodes_under_an_array_of_the_tools_calls():
    tools = [WEATHER_TOOL, TIME_TOOL, PLACE_TOOL]
    schema = tool_plan(state(), request(tools=tools, tool_choice="required")).structured_outputs.json
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    assert "Place" in schema["$defs"]  # moved to the root, where "#/$defs/Place" points
    two = ('[{"name": "get_weather", "parameters": {"city": "Paris"}}, '
           '{"name": "find_place", "parameters": {"place": {"lat": 48.8}}}]')
    assert accepts(schema, two) and accepts(schema, '[{"name": "get_time", "parameters": {}}]')
    assert not accepts(schema, "[]")
    assert not accepts(schema, '[{"name": "get_weather", "parameters": {"zone": "CET"}}]')
    assert not accepts(schema, '[{"name": "get_news", "parameters": {}}]')
    one = tool_plan(state(), request(tools=tools, tool_choice="required", parallel_tool_calls=False))
    assert one.structured_outputs.json["maxItems"] == 1 and not accepts(one.structured_outputs.json, two)


def test_tools_that_define_one_name_differently_cannot_be_required():
    other = json.loads(json.dumps(PLACE_TOOL).replace('"number"', '"string"').replace("find_place", "other_place"))
    with pytest.raises(InvalidRequestError, match=r"\$defs/Place differently"):
        tool_plan(state(), request(tools=[PLACE_TOOL, other], tool_choice="required"))


@pytest.mark.parametrize("other", [{"response_format": {"type": "json_object"}},
                                   {"structured_outputs": {"regex": "a+"}}])
@pytest.mark.parametrize("choice", ["required", NAMED])
def test_required_or_named_with_another_constraint_is_a_400(choice, other):
    req = request(tools=[WEATHER_TOOL], tool_choice=choice, **other)
    with pytest.raises(ApiError) as e:
        check_no_other_constraint(tool_plan(state(), req), request_structured_outputs(req))
    assert e.value.status == 400 and e.value.param == "tool_choice" and "leave response_format" in e.value.message
    # "auto" and "none" leave the answer free for one
    for free in ("auto", "none"):
        req = request(tools=[WEATHER_TOOL], tool_choice=free, **other)
        check_no_other_constraint(tool_plan(state(enable_auto_tool_choice=True), req), request_structured_outputs(req))


def response_choices(s, *completions):
    out = SimpleNamespace(outputs=list(completions), prompt_token_ids=[1, 2], prompt_logprobs=None)
    return s.response(out).model_dump()["choices"]


def test_a_named_functions_answer_is_its_arguments_and_finishes_with_stop_as_vllm():
    (choice,) = response_choices(shape(n=1, tool_choice=NAMED), completion(0, '{"city": "Paris"}'))
    assert choice["finish_reason"] == "stop" and choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["id"].startswith("chatcmpl-tool-") and call["type"] == "function"
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}


REQUIRED_ANSWER = '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": {}}]'


def test_a_required_answer_is_parsed_into_calls_and_finishes_with_tool_calls():
    s = shape(tools=[WEATHER_TOOL, TIME_TOOL], tool_choice="required")
    whole, cut = response_choices(s, completion(0, REQUIRED_ANSWER), completion(1, REQUIRED_ANSWER[:30], "length"))
    assert whole["finish_reason"] == "tool_calls" and whole["message"]["content"] is None
    assert [c["function"] for c in whole["message"]["tool_calls"]] == [
        {"name": "get_weather", "arguments": '{"city": "Paris"}'}, {"name": "get_time", "arguments": "{}"}]
    # cut short by max_tokens it parses into nothing: the text is the content
    assert cut["finish_reason"] == "length" and cut["message"]["tool_calls"] == []
    assert cut["message"]["content"] == REQUIRED_ANSWER[:30]


@pytest.mark.parametrize("text", ["{}", "[]", '[{"parameters": {}}]', '[{"name": "f", "parameters": "x"}]',
                                  '[{"name": "f"}]', '[{"name": "f", "parameters": {}}', "not json"])
def test_a_required_answer_that_is_not_an_array_of_calls_is_content(text):
    s = shape(tool_choice="required")
    (choice,) = response_choices(s, completion(0, text))
    assert choice["message"]["tool_calls"] == [] and choice["message"]["content"] == text
    assert choice["finish_reason"] == "stop"


def stream_events(s, pieces: list[str], finish: str = "stop") -> list[dict]:
    """A streamed reply, one output per piece (a piece is a token's text), as chunk choices."""
    writer = _ChatStream(s, [1, 2])
    events = writer.head()
    for i, piece in enumerate(pieces):
        final = i == len(pieces) - 1
        out = SimpleNamespace(outputs=[completion(0, "", finish if final else None, piece)], prompt_logprobs=None)
        events += writer.chunks([(0, out)])
    return [e["choices"][0] for e in events]


def streamed_calls(choices: list[dict]) -> dict[int, dict]:
    calls: dict[int, dict] = {}
    for c in choices:
        for d in c["delta"].get("tool_calls", []):
            call = calls.setdefault(d["index"], {"arguments": ""})
            if "id" in d:
                assert "name" not in call, "a call's header comes once"
                call.update(id=d["id"], type=d["type"], name=d["function"]["name"])
            call["arguments"] += d["function"]["arguments"]
    return calls


def test_a_named_function_streams_its_arguments_token_by_token():
    tokens = ['{"', "city", '":', ' "', "Par", "is", '"}']
    choices = stream_events(shape(n=1, tool_choice=NAMED), tokens)
    deltas = [c["delta"]["tool_calls"][0] for c in choices if "tool_calls" in c["delta"]]
    assert deltas[0]["id"].startswith("chatcmpl-tool-") and deltas[0]["type"] == "function"
    assert deltas[0]["index"] == 0 and deltas[0]["function"]["name"] == "get_weather"
    # every token's text is a piece of the arguments, sent with it
    assert [d["function"]["arguments"] for d in deltas] == tokens
    assert streamed_calls(choices)[0]["arguments"] == '{"city": "Paris"}'
    assert all(not c["delta"].get("content") for c in choices)
    assert choices[-1]["finish_reason"] == "stop" and all(c["finish_reason"] is None for c in choices[:-1])


def test_required_streams_each_call_as_its_name_is_known_then_its_arguments_in_pieces():
    s = shape(n=1, tools=[WEATHER_TOOL, TIME_TOOL], tool_choice="required")
    tokens = [REQUIRED_ANSWER[i:i + 4] for i in range(0, len(REQUIRED_ANSWER), 4)]
    choices = stream_events(s, tokens)
    calls = streamed_calls(choices)
    assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == [
        ("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]
    first = [d for c in choices for d in c["delta"].get("tool_calls", []) if d["index"] == 0]
    assert len(first) > 3  # the arguments came in pieces, not at the end
    # the first call's header came before the second call's JSON had started
    header_at = next(i for i, c in enumerate(choices) if c["delta"].get("tool_calls", [{}])[0].get("id"))
    assert "get_time" not in "".join(tokens[:header_at])
    assert choices[-1]["finish_reason"] == "tool_calls"
    assert all(not c["delta"].get("content") for c in choices)


def test_streamed_required_with_parallel_tool_calls_false_sends_one_call():
    s = shape(n=1, tools=[WEATHER_TOOL, TIME_TOOL], tool_choice="required", parallel_tool_calls=False)
    calls = streamed_calls(stream_events(s, list(REQUIRED_ANSWER)))
    assert list(calls) == [0] and calls[0]["name"] == "get_weather"


def test_with_a_reasoning_parser_a_named_functions_arguments_are_the_answer_after_the_think_block():
    s = shape(n=1, tool_choice=NAMED)
    s.reasoning = ChatReasoning(PARSERS["deepseek_r1"], "")
    (choice,) = response_choices(s, completion(0, 'Paris it is</think>{"city": "Paris"}'))
    assert choice["message"]["reasoning_content"] == "Paris it is"
    assert choice["message"]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'
    s = shape(n=1, tool_choice=NAMED)
    s.reasoning = ChatReasoning(PARSERS["deepseek_r1"], "")
    choices = stream_events(s, ["Paris", " it is", "</think>", '{"city":', ' "Paris"}'])
    assert "".join(c["delta"].get("reasoning_content", "") for c in choices) == "Paris it is"
    assert streamed_calls(choices)[0]["arguments"] == '{"city": "Paris"}'
