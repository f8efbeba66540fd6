"""Structured outputs and logit_bias, request -> SamplingParams: OpenAI's response_format
(text, json_object, json_schema) and vLLM's structured_outputs object become
``SamplingParams.structured_outputs`` on completions and chat alike, logit_bias's string keys
token ids; a wrong shape is a 400 naming the field. (Whether the engine then constrains the
output is the engine's tests' question.)"""

from __future__ import annotations

from types import SimpleNamespace

import pydantic
import pytest
from openai.lib._parsing._completions import type_to_response_format_param

from compiled_llm.errors import InvalidRequestError
from compiled_llm.serve.openai.protocol import (CHAT_NOT_SUPPORTED, COMPLETION_NOT_SUPPORTED, ChatCompletionRequest,
                                                ChatMessage, CompletionRequest)
from compiled_llm.serve.openai.serving import ApiError, check_request_fields, sampling_params
from compiled_llm.serve.openai.structured_outputs import request_structured_outputs
from compiled_llm.serve.sampling_params import StructuredOutputsParams

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=[ChatMessage(role="user", content="hi")], **fields)


def completion(**fields) -> CompletionRequest:
    return CompletionRequest(prompt="hi", **fields)


def state():
    info = SimpleNamespace(max_model_len=64, generation_defaults={})
    return SimpleNamespace(core=SimpleNamespace(info=info))


def params_of(req):
    """The SamplingParams the endpoints build for ``req``."""
    check_request_fields(req, CHAT_NOT_SUPPORTED if isinstance(req, ChatCompletionRequest) else COMPLETION_NOT_SUPPORTED)
    return sampling_params(state(), req, max_tokens=8, prompt_len=2, fallback_max_tokens=None, logprobs=None,
                           prompt_logprobs=None, structured_outputs=request_structured_outputs(req))


class Weather(pydantic.BaseModel):
    city: str
    days: list[int]


@pytest.mark.parametrize("request_of", [chat, completion])
@pytest.mark.parametrize("fields, expected", [
    ({}, None),
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, StructuredOutputsParams(json_object=True)),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA, "strict": True}}},
     StructuredOutputsParams(json=SCHEMA)),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}}},
     StructuredOutputsParams(json=SCHEMA)),
    ({"structured_outputs": {"json": SCHEMA}}, StructuredOutputsParams(json=SCHEMA)),
    ({"structured_outputs": {"regex": "[a-z]+", "disable_any_whitespace": True}},
     StructuredOutputsParams(regex="[a-z]+", disable_any_whitespace=True)),
    ({"structured_outputs": {"choice": ["yes", "no"], "json": None}}, StructuredOutputsParams(choice=("yes", "no"))),
    ({"structured_outputs": {"grammar": 'root ::= "a"'}}, StructuredOutputsParams(grammar='root ::= "a"')),
    ({"structured_outputs": {"json_object": True, "disable_fallback": True}}, StructuredOutputsParams(json_object=True)),
    ({"structured_outputs": {"regex": "a", "whitespace_pattern": None, "structural_tag": None}},
     StructuredOutputsParams(regex="a")),
])
def test_response_format_and_structured_outputs_become_the_sampling_params_constraint(request_of, fields, expected):
    assert params_of(request_of(**fields)).structured_outputs == expected


def test_the_openai_clients_parse_with_a_pydantic_model_asks_for_its_schema():
    fmt = type_to_response_format_param(Weather)  # what client.chat.completions.parse sends
    assert params_of(chat(response_format=fmt)).structured_outputs == StructuredOutputsParams(
        json=Weather.model_json_schema() | {"additionalProperties": False})


@pytest.mark.parametrize("fields, named", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "w"}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}}, "json_schema.name"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema must be an object"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": [1]}}},
     "json_schema.schema must be a JSON schema object"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA, "strict": "yes"}}},
     "strict"),
    ({"response_format": {"type": "xml"}}, "response_format.type must be one of 'text', 'json_object', 'json_schema'"),
    ({"response_format": {}}, "response_format.type"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
     "either response_format or structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "exactly one of"),
    ({"structured_outputs": {}}, "exactly one of"),
    ({"structured_outputs": {"choice": []}}, "choice"),
    ({"structured_outputs": {"json": 3}}, "structured_outputs.json"),
    ({"structured_outputs": {"json_object": 1}}, "structured_outputs.json_object must be true or false"),
    ({"structured_outputs": {"regex": "a", "whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern"),
    ({"structured_outputs": {"regex": "a", "pattern": "b"}}, "structured_outputs.pattern is not a field"),
])
def test_a_wrong_shape_is_a_400_naming_the_field(fields, named):
    for request_of in (chat, completion):
        with pytest.raises(ApiError) as e:
            params_of(request_of(**fields))
        assert e.value.status == 400 and named in e.value.message
        assert e.value.param in ("response_format", "structured_outputs")


def test_structured_outputs_must_be_an_object_and_the_old_guided_fields_stay_refused():
    with pytest.raises(pydantic.ValidationError, match="structured_outputs"):
        chat(structured_outputs="json")
    with pytest.raises(ApiError) as e:
        params_of(completion(guided_json=SCHEMA))
    assert e.value.param == "guided_json" and "structured_outputs" in e.value.message


def test_logit_bias_keys_become_token_ids():
    assert params_of(chat(logit_bias={"5": 10, "17": -100.0})).logit_bias == {5: 10.0, 17: -100.0}
    assert params_of(completion(logit_bias={})).logit_bias is None


@pytest.mark.parametrize("bias, error, named", [
    ({"abc": 1}, ApiError, "logit_bias keys must be token ids (non-negative integers), got 'abc'"),
    ({"-3": 1}, ApiError, "got '-3'"),
    ({"1.5": 1}, ApiError, "got '1.5'"),
    ({"5": 150}, InvalidRequestError, "logit_bias[5] must be in [-100, 100], got 150"),
    ({"5": -100.5}, InvalidRequestError, "logit_bias[5] must be in [-100, 100]"),
])
def test_bad_logit_bias_is_a_400_naming_it(bias, error, named):  # InvalidRequestError is the server's 400 too
    with pytest.raises(error) as e:
        params_of(chat(logit_bias=bias))
    assert named in str(e.value)
