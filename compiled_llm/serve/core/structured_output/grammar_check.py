"""Whether a request's structured output can be compiled, checked when it is validated (in the
server's front end too, without the tokenizer): the schema, regex or grammar parses, and the
schema uses no keyword that xgrammar would silently ignore (an output could then break it).

xgrammar reads a grammar in milliseconds; compiling it against the vocabulary is the slow part,
which runs later, in the engine (``grammar_compiler``)."""

from __future__ import annotations

import json
import re
from typing import Any

from compiled_llm.errors import InvalidRequestError
from compiled_llm.serve.sampling_params import StructuredOutputsParams

# JSON Schema keywords xgrammar's converter does not enforce (it accepts the schema and ignores
# them), so an output could violate them: refused, as vLLM refuses them for xgrammar.
UNSUPPORTED_SCHEMA_KEYWORDS = (
    "not", "if", "then", "else", "dependentSchemas", "dependentRequired", "dependencies", "contains",
    "minContains", "maxContains", "propertyNames", "patternProperties", "unevaluatedProperties",
    "unevaluatedItems", "$dynamicRef", "$recursiveRef",
)
# Keywords that hold sub-schemas (by name, list or dict), walked for unsupported keywords
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_ONE = ("items", "additionalProperties")

_XGRAMMAR_PREFIX = re.compile(r"^\[[0-9:]+\] [^:]+:\d+: ")


def ebnf_of_choice(choices: tuple[str, ...]) -> str:
    """An EBNF grammar whose sentences are exactly the choices (JSON string escapes are
    xgrammar's EBNF string escapes)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def unsupported_keyword(schema: Any, path: str = "#") -> str | None:
    """The path and name of the first keyword in ``schema`` that xgrammar would ignore."""
    if not isinstance(schema, dict):
        return None
    for key in UNSUPPORTED_SCHEMA_KEYWORDS:
        if key in schema and not (key in ("unevaluatedProperties", "unevaluatedItems") and schema[key] is False):
            return f"{path}/{key}"
    if schema.get("uniqueItems") is True:
        return f"{path}/uniqueItems"
    for key in _SUBSCHEMA_MAPS:
        for name, sub in (schema.get(key) or {}).items() if isinstance(schema.get(key), dict) else ():
            found = unsupported_keyword(sub, f"{path}/{key}/{name}")
            if found:
                return found
    for key in _SUBSCHEMA_LISTS:
        for i, sub in enumerate(schema.get(key) or ()) if isinstance(schema.get(key), list) else ():
            found = unsupported_keyword(sub, f"{path}/{key}/{i}")
            if found:
                return found
    for key in _SUBSCHEMA_ONE:
        found = unsupported_keyword(schema.get(key), f"{path}/{key}")
        if found:
            return found
    return None


def check_structured_outputs(params: StructuredOutputsParams) -> None:
    """InvalidRequestError naming the problem when ``params`` cannot be compiled."""
    import xgrammar as xgr  # only requests with structured outputs pay for the import

    kind = params.kind
    try:
        if kind == "json":
            schema = params.schema
            bad = unsupported_keyword(schema)
            if bad is not None:
                raise InvalidRequestError(f"JSON schema keyword {bad} is not supported by structured outputs "
                                          f"(xgrammar cannot enforce it)")
            xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=not params.disable_any_whitespace,
                                         strict_mode=True)
        elif kind == "regex":
            xgr.Grammar.from_regex(params.regex)
        elif kind == "grammar":
            xgr.Grammar.from_ebnf(params.grammar)
        elif kind == "choice":
            xgr.Grammar.from_ebnf(ebnf_of_choice(params.choice))
    except InvalidRequestError:
        raise
    except Exception as e:  # xgrammar's parse errors (RuntimeError, ValueError)
        what = {"json": "JSON schema", "regex": "regex", "grammar": "grammar", "choice": "choice"}[kind]
        raise InvalidRequestError(f"invalid {what} for structured outputs: {xgrammar_message(e)}") from None


def xgrammar_message(error: BaseException) -> str:
    """xgrammar's error text without its timestamp and source location, on one line."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return _XGRAMMAR_PREFIX.sub("", text)
