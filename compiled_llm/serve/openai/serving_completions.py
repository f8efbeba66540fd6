"""POST /v1/completions: prompts -> engine requests -> a completion or a stream of chunks.

Each prompt is its own engine request; its ``n`` completions are choices
``prompt_index * n + completion_index``, as in OpenAI's API and vLLM.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import StreamingResponse

from compiled_llm.errors import InvalidRequestError
from compiled_llm.serve.openai.protocol import COMPLETION_NOT_SUPPORTED, CompletionRequest, CompletionResponse
from compiled_llm.serve.openai.serving import (CompletionLogprobsWriter, ServerState, StreamWriter, check_request_fields,
                                               final_outputs, new_id, now_s, sampling_params, sse_stream,
                                               truncated_prompt, usage, usage_chunk, vllm_prompt_logprobs)
from compiled_llm.serve.openai.structured_outputs import request_structured_outputs
from compiled_llm.serve.outputs import CompletionOutput, RequestOutput

# OpenAI's default for the completions API
DEFAULT_MAX_TOKENS = 16


def completion_prompts(prompt) -> list[Any]:
    """The engine prompts of the API's ``prompt``: a text, a list of texts, token ids, or a
    list of token-id lists."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise InvalidRequestError("prompt is empty; give a text, a list of texts, token ids or lists of token ids")
    if all(isinstance(p, int) for p in prompt):
        return [{"prompt_token_ids": prompt}]
    return [p if isinstance(p, str) else {"prompt_token_ids": p} for p in prompt]


def _validated(state: ServerState, req: CompletionRequest) -> list[tuple]:
    check_request_fields(req, COMPLETION_NOT_SUPPORTED)
    structured_outputs = request_structured_outputs(req)
    if req.suffix:
        raise InvalidRequestError("suffix is not supported")
    prompt_logprobs = req.prompt_logprobs
    # vLLM's echo with max_tokens 0 (lm-eval's loglikelihood requests): one token is generated,
    # only the prompt is shown
    max_tokens = 1 if _echo_only(req) else req.max_tokens
    if req.echo and req.logprobs is not None and prompt_logprobs is None:
        prompt_logprobs = req.logprobs  # echoed prompt tokens carry logprobs too
    requests = []
    for prompt in completion_prompts(req.prompt):
        text, ids = state.validator.prompt_token_ids(prompt, req.add_special_tokens is not False)
        kept = truncated_prompt(state, req, ids)
        if len(kept) != len(ids):
            text, ids = None, kept  # the echo is the text of the tokens kept
        params = sampling_params(state, req, max_tokens=max_tokens, prompt_len=len(ids),
                                 fallback_max_tokens=DEFAULT_MAX_TOKENS, logprobs=req.logprobs,
                                 prompt_logprobs=prompt_logprobs, structured_outputs=structured_outputs)
        requests.append(state.validator.validate({"prompt_token_ids": ids, "prompt": text}, params))
    return requests


def _echo_only(req: CompletionRequest) -> bool:
    return req.echo and req.max_tokens == 0


def _prompt_text(state: ServerState, req: CompletionRequest, request: tuple) -> str:
    """The echo of a prompt: its text as given, else its tokens' text with the special tokens
    (vLLM's; with return_token_ids vLLM echoes nothing, the ids say it)."""
    text, ids, _ = request
    if req.return_token_ids:
        return ""
    if text is not None:
        return text
    return state.tokenizer.decode(ids, skip_special_tokens=False) if state.tokenizer is not None else ""


async def create_completion(state: ServerState, req: CompletionRequest, http: Request, arrival: float):
    state.check_model(req.model)
    requests = _validated(state, req)
    group = state.async_engine.submit(requests, stream=req.stream, arrival=arrival)
    echoes = [_prompt_text(state, req, r) for r in requests] if req.echo else None
    shape = _Shape(state, req, new_id("cmpl", http, req.request_id), now_s(), echoes)
    if req.stream:
        return StreamingResponse(sse_stream(group, http, _CompletionStream(shape, requests)),
                                 media_type="text/event-stream")
    return shape.response(await final_outputs(group, http))


class _Shape:
    """What every choice and chunk of one call shares."""

    def __init__(self, state: ServerState, req: CompletionRequest, id: str, created: int, echoes: list[str] | None):
        self.state, self.req, self.id, self.created, self.echoes = state, req, id, created, echoes
        self.n = req.n
        self.token_ids = bool(req.return_token_ids)
        self.echo_only = _echo_only(req)  # the generated token is not shown

    def writer(self) -> CompletionLogprobsWriter:
        return CompletionLogprobsWriter(self.state, as_ids=bool(self.req.return_tokens_as_token_ids))

    def choice_logprobs(self, out: RequestOutput, c: CompletionOutput, echo: str | None) -> dict | None:
        if self.req.logprobs is None:
            return None
        writer = self.writer()
        if echo is not None:
            prompt = writer.piece(out.prompt_token_ids, out.prompt_logprobs or [None] * len(out.prompt_token_ids))
        else:
            prompt = None
        own = writer.piece([] if self.echo_only else c.token_ids, c.logprobs or [])
        if prompt is None:
            return own
        return {k: prompt[k] + own[k] for k in own}

    def response(self, outputs: list[RequestOutput]) -> CompletionResponse:
        choices = []
        for i, out in enumerate(outputs):
            echo = self.echoes[i] if self.echoes is not None else None
            for c in out.outputs:
                choices.append({
                    "index": i * self.n + c.index,
                    "text": (echo or "") + ("" if self.echo_only else c.text),
                    "logprobs": self.choice_logprobs(out, c, echo),
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                    "prompt_logprobs": vllm_prompt_logprobs(out.prompt_logprobs) if self.req.prompt_logprobs is not None else None,
                    "prompt_token_ids": list(out.prompt_token_ids) if self.token_ids else None,
                    "token_ids": list(c.token_ids) if self.token_ids else None,
                })
        prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
        completion_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
        return CompletionResponse(id=self.id, created=self.created, model=self.state.model_name, choices=choices,
                                  usage=usage(prompt_tokens, completion_tokens))


class _CompletionStream(StreamWriter):
    """One chunk per choice that changed since the previous write (its deltas merged), the
    echoed prompt first; a choice's last chunk carries its finish reason."""

    def __init__(self, shape: _Shape, requests: list[tuple]):
        self.shape = shape
        self.prompt_lens = [len(ids) for _, ids, _ in requests]
        self.prompt_tokens = sum(self.prompt_lens)
        self.completion_tokens = 0
        self.finished: set[int] = set()
        self.writers: dict[int, CompletionLogprobsWriter] = {}
        self.sent_tokens: dict[int, int] = {}  # per choice, for continuous usage

    def _chunk(self, choice: dict) -> dict:
        s = self.shape
        chunk = {"id": s.id, "object": "text_completion", "created": s.created, "model": s.state.model_name,
                 "choices": [choice]}
        if s.req.include_usage:
            chunk["usage"] = None
        return chunk

    def chunks(self, ready: list[tuple[int, RequestOutput]]) -> list[dict]:
        s = self.shape
        events = []
        for i, out in ready:
            for c in out.outputs:
                index = i * s.n + c.index
                if index in self.finished:
                    continue  # a finished request's output repeats its completions
                text, logprobs = ("" if s.echo_only else c.delta_text), None
                first = index not in self.writers
                if first and s.echoes is not None:
                    text = s.echoes[i] + text
                if not text and not c.delta_token_ids and c.finish_reason is None:
                    continue
                if first:
                    self.writers[index] = s.writer()
                writer = self.writers[index]
                prompt_piece = None
                if first and s.echoes is not None and s.req.logprobs is not None:
                    prompt_piece = writer.piece(out.prompt_token_ids,
                                                out.prompt_logprobs or [None] * len(out.prompt_token_ids))
                if s.req.logprobs is not None:
                    logprobs = writer.piece([] if s.echo_only else c.delta_token_ids, c.delta_logprobs or [])
                    if prompt_piece is not None:
                        logprobs = {k: prompt_piece[k] + logprobs[k] for k in logprobs}
                choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": c.finish_reason,
                          "stop_reason": c.stop_reason}
                if first and s.req.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = vllm_prompt_logprobs(out.prompt_logprobs)
                if s.token_ids:
                    choice["prompt_token_ids"] = list(out.prompt_token_ids) if first else None
                    choice["token_ids"] = list(c.delta_token_ids)
                chunk = self._chunk(choice)
                self.sent_tokens[index] = self.sent_tokens.get(index, 0) + len(c.delta_token_ids)
                if s.req.continuous_usage:
                    chunk["usage"] = usage(self.prompt_lens[i], self.sent_tokens[index])
                events.append(chunk)
                if c.finish_reason is not None:
                    self.finished.add(index)
                    self.completion_tokens += len(c.token_ids)
        return events

    def tail(self) -> list[dict]:
        return usage_chunk(self.shape, "text_completion", self.prompt_tokens, self.completion_tokens)
