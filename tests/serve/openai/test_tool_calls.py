"""A chat's tools: rendered by the chat template as transformers renders them, checked, and the
answer's calls parsed into OpenAI's message and finish reason."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from compiled_llm.model.tokenizer.loader import load_tokenizer
from compiled_llm.serve.openai.protocol import ChatCompletionRequest, ChatMessage
from compiled_llm.serve.openai.reasoning.chat import ChatReasoning
from compiled_llm.serve.openai.reasoning.parsers import PARSERS
from compiled_llm.serve.openai.serving import ApiError
from compiled_llm.serve.openai.serving_chat import _ChatStream, _Shape, chat_messages
from compiled_llm.serve.openai.tool_calls import server_parser_name, tool_plan
from compiled_llm.serve.server_config import ServerConfig
from helpers.trained_tokenizers import train_hf_tokenizer

# Qwen2.5's way with tools, cut down: the tools' JSON in the system turn, an assistant's calls
# with tool_call.arguments | tojson, tool answers in <tool_response>.
QWEN_LIKE = """{%- if tools %}<|im_start|>system
# Tools
<tools>{% for tool in tools %}
{{ tool | tojson }}{% endfor %}
</tools>
For each call, return <tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}<|im_start|>{{ message.role }}
{% if message.content %}{{ message.content }}{% endif %}
{%- for tool_call in message.tool_calls or [] %}{% if tool_call.function is defined %}{% set tool_call = tool_call.function %}{% endif %}
<tool_call>{"name": "{{ tool_call.name }}", "arguments": {{ tool_call.arguments | tojson }}}</tool_call>{% endfor %}<|im_end|>
{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

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
    ({"tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "'nope', which is not in tools"),
    ({"tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
     "needs structured outputs"),
    ({"tools": [WEATHER_TOOL], "tool_choice": "required"}, "'required' needs structured outputs"),
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


def shape(n=2):
    s = state(enable_auto_tool_choice=True)
    req = request(tools=[WEATHER_TOOL], n=n, stream=True)
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
