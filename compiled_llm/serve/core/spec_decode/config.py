"""``SpeculativeConfig``: the ``speculative_config`` option, spelled as vLLM spells it.

``LLM(..., speculative_config={"method": "ngram", "num_speculative_tokens": 4,
"prompt_lookup_max": 4})`` or ``run``/``serve --speculative-config '{"method": "ngram", ...}'``.
As in vLLM, an unset ``prompt_lookup_min`` takes ``prompt_lookup_max``'s value and both default
to 5; ``disable_by_batch_size`` turns speculation off for steps with more running sequences than
that (unset: the speculator's own limit on verification rows decides).
"""

from __future__ import annotations

import dataclasses
import json
import numbers
from typing import Any, Mapping

from compiled_llm.errors import InvalidOptionError

METHODS = ("ngram",)
DEFAULT_PROMPT_LOOKUP = 5
# one verification step computes 1 + k tokens per sequence; beyond this, a rejected tail costs
# more than the weight read it shares
MAX_SPECULATIVE_TOKENS = 16


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int = DEFAULT_PROMPT_LOOKUP
    prompt_lookup_min: int = DEFAULT_PROMPT_LOOKUP
    disable_by_batch_size: int | None = None

    @classmethod
    def parse(cls, value: "str | Mapping[str, Any] | SpeculativeConfig | None") -> "SpeculativeConfig | None":
        """The config of a JSON object string, a mapping, or None (no speculation); anything
        malformed is refused in one line naming the problem."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise InvalidOptionError(f"speculative_config is not valid JSON: {e.msg} (at character {e.pos})") from None
        if not isinstance(value, Mapping):
            raise InvalidOptionError(f"speculative_config must be a JSON object, got {type(value).__name__}")
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = [k for k in value if k not in names]
        if unknown:
            raise InvalidOptionError(f"unknown speculative_config key {unknown[0]!r}; the keys are: {', '.join(names)}")
        method = value.get("method")
        if method not in METHODS:
            raise InvalidOptionError(f"speculative_config method must be one of {', '.join(METHODS)}, got {method!r}")
        ints = {}
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "disable_by_batch_size"):
            v = value.get(name)
            if v is not None and (not isinstance(v, numbers.Integral) or isinstance(v, bool) or v < 1):
                raise InvalidOptionError(f"speculative_config {name} must be an integer >= 1, got {v!r}")
            ints[name] = None if v is None else int(v)
        k = ints["num_speculative_tokens"]
        if k is None:
            raise InvalidOptionError("speculative_config needs num_speculative_tokens")
        if k > MAX_SPECULATIVE_TOKENS:
            raise InvalidOptionError(
                f"speculative_config num_speculative_tokens must be at most {MAX_SPECULATIVE_TOKENS}, got {k}")
        hi, lo = ints["prompt_lookup_max"], ints["prompt_lookup_min"]
        if hi is None and lo is None:
            hi = lo = DEFAULT_PROMPT_LOOKUP
        hi, lo = hi or lo, lo or hi
        if lo > hi:
            raise InvalidOptionError(f"speculative_config prompt_lookup_min ({lo}) is above prompt_lookup_max ({hi})")
        return cls(method, k, hi, lo, ints["disable_by_batch_size"])
