"""SamplingParams: how to sample one request, with vLLM's names, defaults and checks.

This is the API type (``LLM.generate``, the HTTP server and the engine process all speak it);
the batched sampler that turns a batch of these into token ids on the device is
``worker/sampler.py``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
from typing import Any, Mapping

from compiled_llm.errors import InvalidRequestError

# The columns of a request's row in the sampler's parameter table (SamplingParams.sampling_row):
# the first seven travel to the device; logprobs is -1 when not asked; seeded is 0 or 1;
# min_tokens is 0 when not asked (the host looks at the rows' stop tokens only when it is not).
SAMPLING_COLUMNS = ("temperature", "top_k", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                    "repetition_penalty", "logprobs", "seeded", "min_tokens")
MIN_TOKENS_COLUMN = SAMPLING_COLUMNS.index("min_tokens")

# OpenAI's range for a logit_bias value.
MAX_LOGIT_BIAS = 100.0

# The most top log-probabilities one token may ask for (OpenAI's API allows 20 for chat, 5 for
# completions; vLLM's default cap is 20).
MAX_LOGPROBS = 20


@dataclasses.dataclass(frozen=True)
class StructuredOutputsParams:
    """What the output must match, as vLLM spells it: exactly one of a JSON schema (``json``, a
    dict or its JSON text), any JSON object (``json_object``), a regular expression (``regex``),
    one of fixed strings (``choice``) or an EBNF grammar (``grammar``, GBNF-style, as xgrammar
    reads it). ``disable_any_whitespace`` keeps JSON to single spaces (no newlines or runs of
    blanks between its tokens).

    This checks the form; whether the schema, regex or grammar is one the grammar backend can
    compile is checked when the request is validated (``core/structured_output``)."""

    json: str | dict | None = None
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    # a reasoning model's end-of-thinking token: the grammar constrains what follows it, and
    # leaves the thinking before it free (the server sets it with --reasoning-parser)
    start_after_token_id: int | None = None

    def __post_init__(self):
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        if self.json_object:
            given.append("json_object")
        if len(given) != 1:
            raise InvalidRequestError(
                "structured outputs need exactly one of json, regex, choice, grammar and json_object, got "
                + (", ".join(given) if given else "none"))
        if self.json is not None:
            if isinstance(self.json, str):
                try:
                    schema = json.loads(self.json)
                except ValueError as e:
                    raise InvalidRequestError(f"structured outputs json is not valid JSON: {e}") from None
            else:
                schema = self.json
            if not isinstance(schema, (Mapping, bool)):
                raise InvalidRequestError(f"a JSON schema is an object, got {type(schema).__name__}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise InvalidRequestError(f"structured outputs {name} must be a non-empty string")
        if self.choice is not None:
            if isinstance(self.choice, str) or not isinstance(self.choice, (list, tuple)) or not self.choice:
                raise InvalidRequestError("structured outputs choice must be a non-empty list of strings")
            if any(not isinstance(c, str) or not c for c in self.choice):
                raise InvalidRequestError("structured outputs choice entries must be non-empty strings")
            object.__setattr__(self, "choice", tuple(self.choice))
        if not isinstance(self.disable_any_whitespace, bool):
            raise InvalidRequestError("disable_any_whitespace must be True or False")
        if self.start_after_token_id is not None and (
                not isinstance(self.start_after_token_id, int) or self.start_after_token_id < 0):
            raise InvalidRequestError("start_after_token_id must be a token id")

    @property
    def kind(self) -> str:
        """"json", "json_object", "regex", "choice" or "grammar"."""
        for name in ("json", "regex", "choice", "grammar"):
            if getattr(self, name) is not None:
                return name
        return "json_object"

    @property
    def schema(self) -> Any:
        """The JSON schema as a Python value (``json`` only)."""
        return json.loads(self.json) if isinstance(self.json, str) else self.json

    @property
    def key(self) -> tuple[str, str, bool]:
        """What the compiled grammar depends on, canonical: equal keys compile to one grammar
        (the compile cache's key)."""
        kind = self.kind
        if kind == "json":  # keys in their order: a schema's property order is the output's
            text = json.dumps(self.schema, separators=(",", ":"))
        elif kind == "choice":
            text = json.dumps(list(self.choice))
        elif kind == "json_object":
            text = ""
        else:
            text = getattr(self, kind)
        return kind, text, self.disable_any_whitespace


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to sample one request, with vLLM's names and meanings.

    temperature 0 means greedy; top_k -1 (or 0), top_p 1.0 and min_p 0.0 mean no truncation;
    seed makes a sampled request reproducible on its own (completion i of ``n`` uses seed + i).
    Penalties act on the raw logits before temperature: presence and frequency subtract
    ``presence_penalty * (count > 0) + frequency_penalty * count`` over the output tokens so far
    (OpenAI's definition); ``repetition_penalty`` divides positive logits and multiplies
    negative ones of every token seen in the prompt or output (the CTRL/transformers one).
    ``logprobs`` = k returns, per output token, the sampled token's log-probability and the k
    most likely tokens' (``prompt_logprobs`` likewise per prompt token); log-probabilities are
    those of the model's raw logits, before penalties and temperature, as vLLM returns them.
    ``min_tokens``: until the request has that many output tokens, its stop tokens (EOS unless
    ``ignore_eos``, and ``stop_token_ids``) cannot be sampled and its stop strings do not end it.
    ``structured_outputs`` constrains every output token to a grammar (a JSON schema, a regex,
    ...; the tokens it rules out get probability 0, and log-probabilities are those of the
    masked distribution, as vLLM reports them); ``logit_bias`` {token id: bias in [-100, 100]}
    is added to the logits before sampling (not to the reported log-probabilities).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    stop: tuple[str, ...] | list[str] | str | None = None
    stop_token_ids: tuple[int, ...] | list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    # False skips incremental detokenization (token ids only; stop strings need it on).
    detokenize: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    logit_bias: Mapping[int, float] | None = None

    def __post_init__(self):
        for name in ("max_tokens", "top_k", "seed", "n", "logprobs", "prompt_logprobs", "min_tokens"):  # numpy integers and the like, as plain ints
            value = getattr(self, name)
            if isinstance(value, numbers.Integral) and not isinstance(value, bool):
                object.__setattr__(self, name, int(value))
        _check_int("max_tokens", self.max_tokens, low=1)
        _check_int("min_tokens", self.min_tokens, low=0)
        if self.min_tokens > self.max_tokens:
            raise InvalidRequestError(
                f"min_tokens must be at most max_tokens ({self.max_tokens}), got {self.min_tokens}")
        _check_real("temperature", self.temperature, low=0.0)
        _check_int("top_k", self.top_k)
        if self.top_k < 1 and self.top_k not in (-1, 0):
            raise InvalidRequestError(f"top_k must be -1 (disabled) or an integer >= 1, got {self.top_k!r}")
        _check_real("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p!r}")
        _check_real("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequestError(f"min_p must be in [0, 1], got {self.min_p!r}")
        _check_int("n", self.n, low=1)
        for name in ("presence_penalty", "frequency_penalty"):
            _check_real(name, getattr(self, name))
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise InvalidRequestError(f"{name} must be in [-2, 2], got {getattr(self, name)!r}")
        _check_real("repetition_penalty", self.repetition_penalty)
        if not self.repetition_penalty > 0.0:
            raise InvalidRequestError(f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) == -1:  # vLLM's "the whole vocabulary", past its default cap too
                raise InvalidRequestError(
                    f"{name} -1 asks for the whole vocabulary; at most {MAX_LOGPROBS} log-probabilities per token "
                    f"are returned (vLLM's default --max-logprobs)")
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), low=0)
                if getattr(self, name) > MAX_LOGPROBS:
                    raise InvalidRequestError(f"{name} must be at most {MAX_LOGPROBS}, got {getattr(self, name)}")
        if self.seed is not None:
            _check_int("seed", self.seed)
            if not -(2**63) <= self.seed < 2**64:  # what torch.Generator.manual_seed takes
                raise InvalidRequestError(f"seed must fit in 64 bits (-2**63 .. 2**64 - 1), got {self.seed}")
        for name in ("ignore_eos", "detokenize", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidRequestError(f"{name} must be True or False, got {getattr(self, name)!r}")
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if stop is not None and not isinstance(stop, (list, tuple)):
            raise InvalidRequestError(f"stop must be a string or a list of strings, got {type(stop).__name__}")
        if any(not isinstance(s, str) or s == "" for s in stop or ()):
            raise InvalidRequestError("stop strings must be non-empty strings")
        object.__setattr__(self, "stop", tuple(stop or ()))
        ids = self.stop_token_ids
        if ids is not None and not isinstance(ids, (list, tuple)):
            raise InvalidRequestError(f"stop_token_ids must be a list of integers, got {type(ids).__name__}")
        for t in ids or ():
            _check_int("stop_token_ids entry", t, low=0)
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in ids or ()))
        if self.stop and not self.detokenize:
            raise InvalidRequestError("stop strings need detokenize=True")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise InvalidRequestError(
                f"structured_outputs must be a StructuredOutputsParams, got {type(self.structured_outputs).__name__}")
        object.__setattr__(self, "logit_bias", _checked_logit_bias(self.logit_bias))
        # What the sampler reads every step, worked out once per request: its row of the
        # sampler's parameter table (SAMPLING_COLUMNS) and whether it needs penalties.
        object.__setattr__(self, "sampling_row", (
            float(self.temperature), float(self.top_k), float(self.top_p), float(self.min_p),
            float(self.presence_penalty), float(self.frequency_penalty), float(self.repetition_penalty),
            float(-1 if self.logprobs is None else self.logprobs), float(self.seed is not None),
            float(self.min_tokens),
        ))
        object.__setattr__(self, "_penalised", (
            self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0
        ))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self._penalised


def _checked_logit_bias(bias) -> dict[int, float] | None:
    """{token id: bias} with int ids and float biases in OpenAI's range; None when empty."""
    if bias is None:
        return None
    if not isinstance(bias, Mapping):
        raise InvalidRequestError(f"logit_bias must map token ids to numbers, got {type(bias).__name__}")
    out = {}
    for token, value in bias.items():
        if isinstance(token, str) and token.strip().lstrip("-").isdigit():
            token = int(token)  # JSON object keys are strings
        _check_int("logit_bias token id", token, low=0)
        _check_real(f"logit_bias[{token}]", value)
        if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
            raise InvalidRequestError(f"logit_bias[{token}] must be in [-100, 100], got {value!r}")
        out[int(token)] = float(value)
    return out or None


def _check_int(name: str, value, low: int | None = None) -> None:
    # bool is an int subclass, but True as a token count or a seed is a mistake
    if not isinstance(value, numbers.Integral) or isinstance(value, bool):
        raise InvalidRequestError(f"{name} must be an integer, got {value!r}")
    if low is not None and value < low:
        raise InvalidRequestError(f"{name} must be an integer >= {low}, got {value!r}")


def _check_real(name: str, value, low: float | None = None) -> None:
    try:
        finite = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
    except OverflowError:  # an int too large for a float
        finite = False
    if not finite:
        raise InvalidRequestError(f"{name} must be a finite number, got {value!r}")
    if low is not None and value < low:
        raise InvalidRequestError(f"{name} must be >= {low}, got {value!r}")



def stop_tokens(params: SamplingParams, eos_token_ids) -> tuple[int, ...]:
    """The tokens that would end a request: what ``min_tokens`` holds back (as vLLM's
    all_stop_token_ids)."""
    eos = () if params.ignore_eos else tuple(eos_token_ids)
    return tuple(dict.fromkeys((*eos, *params.stop_token_ids)))
