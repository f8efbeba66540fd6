"""A request's output constraints as SamplingParams takes them.

Two ways to ask for structured output, on completions and chat alike (one of them per request):

- OpenAI's ``response_format``: ``{"type": "text"}`` (no constraint), ``{"type": "json_object"}``
  (any JSON object) or ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...},
  "strict": ...}}`` (JSON that matches the schema; constrained whether ``strict`` is true or not,
  as vLLM does);
- vLLM's ``structured_outputs`` object: one of ``json`` (a schema), ``regex``, ``choice``,
  ``grammar`` (EBNF) and ``json_object``, with ``disable_any_whitespace``.

Whether a schema, regex or grammar compiles is the engine's validator's question: here only the
shape of the fields is checked, each error a 400 naming the field.
"""

from __future__ import annotations

from typing import Any

from compiled_llm.errors import InvalidRequestError
from compiled_llm.serve.openai.serving import ApiError
from compiled_llm.serve.sampling_params import StructuredOutputsParams

RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")
# vLLM's structured_outputs fields this server takes
STRUCTURED_FIELDS = ("json", "regex", "choice", "grammar", "json_object", "disable_any_whitespace")
# vLLM's others, with the values that ask for nothing (disable_fallback: there is one backend)
STRUCTURED_NEUTRAL: dict[str, tuple] = {
    "disable_fallback": (False, True),
    "disable_additional_properties": (False,),
    "whitespace_pattern": (None,),
    "structural_tag": (None,),
}


def _bad(message: str, param: str) -> ApiError:
    return ApiError(400, message, "BadRequestError", param=param)


def request_structured_outputs(req) -> StructuredOutputsParams | None:
    """What the request's ``response_format`` or ``structured_outputs`` asks for (None: nothing)."""
    from_format = response_format_params(req.response_format)
    given = structured_outputs_params(req.structured_outputs)
    if from_format is not None and given is not None:
        raise _bad("give either response_format or structured_outputs, not both: each constrains the whole "
                   "output", "structured_outputs")
    return from_format if from_format is not None else given


def response_format_params(fmt: dict[str, Any] | None) -> StructuredOutputsParams | None:
    if fmt is None:
        return None
    kind = fmt.get("type")
    if kind not in RESPONSE_FORMAT_TYPES:
        raise _bad(f"response_format.type must be one of {', '.join(map(repr, RESPONSE_FORMAT_TYPES))}, got {kind!r}",
                   "response_format")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict):
        raise _bad("response_format.json_schema must be an object with the schema's name and schema", "response_format")
    name = spec.get("name")
    if not isinstance(name, str) or not name:
        raise _bad("response_format.json_schema.name must be a non-empty string", "response_format")
    if spec.get("schema") is None:
        raise _bad("response_format.json_schema.schema is missing: give the JSON schema the output must match",
                   "response_format")
    if not isinstance(spec["schema"], dict):
        raise _bad(f"response_format.json_schema.schema must be a JSON schema object, got "
                   f"{type(spec['schema']).__name__}", "response_format")
    if not isinstance(spec.get("strict", False), (bool, type(None))):
        raise _bad("response_format.json_schema.strict must be true or false", "response_format")
    return StructuredOutputsParams(json=spec["schema"])


def structured_outputs_params(given: dict[str, Any] | None) -> StructuredOutputsParams | None:
    """vLLM's ``structured_outputs`` object; its null fields count as not given."""
    if given is None:
        return None
    fields = {}
    for name, value in given.items():
        if value is None:
            continue
        if name in STRUCTURED_FIELDS:
            fields[name] = value
        elif name in STRUCTURED_NEUTRAL:
            if not any(value == ok and type(value) is type(ok) for ok in STRUCTURED_NEUTRAL[name]):
                raise _bad(f"structured_outputs.{name} is not supported by this server; leave it unset",
                           "structured_outputs")
        else:
            raise _bad(f"structured_outputs.{name} is not a field of structured_outputs (one of "
                       f"{', '.join(STRUCTURED_FIELDS)})", "structured_outputs")
    for name in ("json_object", "disable_any_whitespace"):
        if name in fields and not isinstance(fields[name], bool):
            raise _bad(f"structured_outputs.{name} must be true or false", "structured_outputs")
    if "json" in fields and not isinstance(fields["json"], (dict, str)):
        raise _bad("structured_outputs.json must be a JSON schema (an object, or its JSON text)", "structured_outputs")
    try:
        return StructuredOutputsParams(**fields)
    except InvalidRequestError as e:
        raise _bad(str(e), "structured_outputs") from None

