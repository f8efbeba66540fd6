"""What generate() and the engine return, shaped like vLLM's RequestOutput."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from compiled_llm.serve.core.sequence import RequestMetrics
from compiled_llm.serve.core.text_pieces import LazyText


@dataclass(frozen=True)
class Logprob:
    """One token's log-probability under the model's raw logits, its rank among the
    vocabulary (1 = most likely) and its text."""

    logprob: float
    rank: int
    decoded_token: str | None = None


# Per position: token id -> Logprob, holding the chosen token and the top-k.
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    """One of a request's ``n`` completions. ``text``, ``token_ids`` and ``logprobs`` are the
    whole completion so far; the ``delta_`` fields what is new since this completion's previous
    output (a streamed request gets an output for every step that changes it). ``tool_calls``:
    from ``LLM.chat`` with tools, the calls its text makes, in OpenAI's shape ({"id", "type",
    "function": {"name", "arguments"}}, the arguments a JSON text); None when it makes none."""

    index: int
    # a str, or a TextSnapshot joined on first read: a streamed output costs nothing per step
    # for its whole text unless that is read
    text: str = LazyText()
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | "abort" | None while running
    # the stop string or stop token id that ended it; None for EOS, length and abort
    stop_reason: str | int | None = None
    cumulative_logprob: float | None = None  # sum of the output tokens' logprobs (if asked)
    logprobs: list[PositionLogprobs] | None = None  # one per output token (SamplingParams.logprobs)
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    delta_logprobs: list[PositionLogprobs] | None = None
    tool_calls: list[dict[str, Any]] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """A request's state. For a streamed request, ``outputs`` holds only the completions that
    changed in this step (each with its ``index``), and the finished output holds all ``n``;
    otherwise it always holds all ``n``, in index order."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    # per prompt token (None for the first), when SamplingParams.prompt_logprobs is set
    prompt_logprobs: list[PositionLogprobs | None] | None = None

    # conveniences for the first completion
    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def delta_text(self) -> str:
        return self.outputs[0].delta_text

    @property
    def delta_token_ids(self) -> list[int]:
        return self.outputs[0].delta_token_ids
