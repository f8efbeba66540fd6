"""What generate() and the engine return, shaped like vLLM's RequestOutput."""

from __future__ import annotations

from dataclasses import dataclass, field

from compiled_llm.serve.sequence import RequestMetrics


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | "abort" | None while running


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    delta_text: str = ""  # streamed text since the previous output of this request
    delta_token_ids: list[int] = field(default_factory=list)

    # conveniences for the single completion
    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason
