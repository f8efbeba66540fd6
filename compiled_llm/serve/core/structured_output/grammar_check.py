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


# A string's characters that JSON takes unescaped, as a JSON Schema pattern of n to m of them:
# every code point but the controls, '"', the backslash and the UTF-16 surrogates, as ranges of
# the characters themselves. For a negated class, as in the regex [^"\\\x00-\x1f], xgrammar's
# pattern rule also takes the bytes of an encoded surrogate and of overlong encodings, which
# are not UTF-8: a decoder reads each of those bytes as a U+FFFD, and the string outgrows its
# maxLength.
_PLAIN_CHARACTERS = '^[ !#-\\[\\]-\ud7ff\ue000-\U0010ffff]{%d,%s}$'
# keywords whose values are data, not schemas
_DATA_KEYWORDS = ("enum", "const", "default", "examples")


def json_safe_string_lengths(schema):
    """``schema`` with each length-bounded string (minLength/maxLength, no pattern or format)
    also given the pattern of that many plain characters. xgrammar 0.2's rule for such strings
    lets control characters through unescaped, which no JSON parser takes; its pattern rule
    does not. (Escapes are not counted as one character there, so they are left out.)"""
    if isinstance(schema, list):
        return [json_safe_string_lengths(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: (v if k in _DATA_KEYWORDS else json_safe_string_lengths(v)) for k, v in schema.items()}
    bounded = "minLength" in out or "maxLength" in out
    if out.get("type") == "string" and bounded and "pattern" not in out and "format" not in out:
        low, high = out.pop("minLength", 0), out.pop("maxLength", None)
        out["pattern"] = _PLAIN_CHARACTERS % (low, "" if high is None else high)
    return out


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
            # as the compiler will read it (json_safe_string_lengths)
            xgr.Grammar.from_json_schema(json.dumps(json_safe_string_lengths(schema)),
                                         any_whitespace=not params.disable_any_whitespace, strict_mode=True)
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
