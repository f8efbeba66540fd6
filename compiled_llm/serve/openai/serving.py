"""What the completions and chat endpoints share: the server's state, the API request ->
SamplingParams mapping, logprob conversions, server-sent events and client-disconnect handling."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import re
import time
import uuid
from typing import Any, AsyncIterator, Iterable

from starlette.requests import Request

from compiled_llm.errors import CompiledLLMError
from compiled_llm.serve.engine_process.async_engine import AsyncEngine, RequestGroup, ServiceUnavailableError
from compiled_llm.serve.engine_process.dp_client import DataParallelClient
from compiled_llm.serve.engine_process.engine_core_client import EngineCoreClient
from compiled_llm.serve.metrics import ServerMetrics
from compiled_llm.serve.openai.middleware import request_id
from compiled_llm.serve.openai.protocol import unsupported_field
from compiled_llm.serve.outputs import Logprob, PositionLogprobs, RequestOutput
from compiled_llm.serve.sampling_params import SamplingParams, StructuredOutputsParams
from compiled_llm.serve.server_config import ServerConfig

# JSON has no -inf; vLLM sends this for a token the model rules out.
MIN_LOGPROB = -9999.0

_TOKEN_ID = re.compile(r"[0-9]+")


class ApiError(Exception):
    """An HTTP error in OpenAI's shape (401, 404, 504, ...)."""

    def __init__(self, status: int, message: str, type: str, code: str | None = None, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type, code, param


@dataclasses.dataclass
class ServerState:
    core: EngineCoreClient | DataParallelClient
    async_engine: AsyncEngine
    metrics: ServerMetrics
    config: ServerConfig
    model_name: str
    created: int  # when the server started (unix seconds): the model card's "created"

    @property
    def tokenizer(self):
        return self.core.tokenizer

    @property
    def validator(self):
        return self.core.validator

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise ApiError(404, f"The model `{name}` does not exist; this server serves `{self.model_name}`.",
                           "NotFoundError", code="model_not_found", param="model")

    def token_text(self, token_id: int, logprob: Logprob | None = None, as_id: bool = False) -> str:
        """A token's text in logprobs; ``as_id``: vLLM's "token_id:N" (return_tokens_as_token_ids)."""
        if as_id:
            return f"token_id:{token_id}"
        if logprob is not None and logprob.decoded_token is not None:
            return logprob.decoded_token
        if self.tokenizer is None:
            return f"<{token_id}>"
        return self.tokenizer.decode([token_id], skip_special_tokens=False)


def new_id(prefix: str, http: Request | None = None, body_id: str | None = None) -> str:
    """A response's id, as vLLM's: the request's X-Request-Id header when it has one, else the
    body's ``request_id`` (vLLM's field), else a fresh one."""
    given = None if http is None else request_id(http)
    return f"{prefix}-{given or body_id or uuid.uuid4().hex}"


# ---- request fields -------------------------------------------------------------------------------


def check_request_fields(req, not_supported: dict[str, tuple]) -> None:
    """400 for what this server cannot honour: one of vLLM's fields it lacks (``NOT_SUPPORTED``
    in protocol.py; vLLM's old ``guided_*`` spelling of structured outputs among them), and
    ``stream_options`` without ``stream`` (vLLM's rule and message)."""
    name = unsupported_field(req, not_supported)
    if name is not None:
        hint = "; ask with structured_outputs or response_format instead" if name.startswith("guided_") else ""
        raise ApiError(400, f"{name} is not supported by this server; leave {name} unset{hint}", "BadRequestError",
                       param=name)
    options = req.stream_options
    if options is not None and (options.model_fields_set or options.model_extra) and not req.stream:
        raise ApiError(400, "Stream options can only be defined when `stream=True`.", "BadRequestError",
                       param="stream_options")


def logit_bias_ids(bias: dict[str, float] | None) -> dict[int, float] | None:
    """``logit_bias`` with its keys (JSON object keys, so strings) as token ids; the biases' range
    is checked by SamplingParams, the ids against the vocabulary by the engine's validator."""
    if not bias:
        return None
    out = {}
    for key, value in bias.items():
        if not _TOKEN_ID.fullmatch(key):
            raise ApiError(400, f"logit_bias keys must be token ids (non-negative integers), got {key!r}",
                           "BadRequestError", param="logit_bias")
        out[int(key)] = value
    return out


def truncated_prompt(state: ServerState, req, ids: list[int]) -> list[int]:
    """The prompt ids ``truncate_prompt_tokens`` keeps, as vLLM: the last k (``truncation_side``
    "right": the first k); -1 means the model's max length."""
    k = req.truncate_prompt_tokens
    if k is None:
        return ids
    limit = state.core.info.max_model_len
    if k == -1:
        k = limit
    if k > limit:
        raise ApiError(400, f"truncate_prompt_tokens {k} is more than the model's max length of {limit} tokens",
                       "BadRequestError", param="truncate_prompt_tokens")
    if len(ids) <= k:
        return ids
    return ids[:k] if req.truncation_side == "right" else ids[len(ids) - k:]


# ---- request -> SamplingParams ----------------------------------------------------------------------


def sampling_params(state: ServerState, req, *, max_tokens: int | None, prompt_len: int, fallback_max_tokens: int | None,
                    logprobs: int | None, prompt_logprobs: int | None,
                    structured_outputs: StructuredOutputsParams | None = None) -> SamplingParams:
    """The request's sampling fields. One the client left unset (or null) takes the checkpoint's
    generation default (``LoadedModel.generation_defaults``), then OpenAI's. Unset max_tokens:
    the checkpoint's, else ``fallback_max_tokens`` (None: all the context left), at most the
    context left after the prompt. ``structured_outputs``: what the output must match (from
    response_format, structured_outputs or a tool_choice; see structured_outputs.py)."""
    defaults = state.core.info.generation_defaults
    given = req.model_fields_set

    def pick(name: str, fallback):
        value = getattr(req, name) if name in given else None
        return value if value is not None else defaults.get(name, fallback)

    if max_tokens is None:
        left = max(state.core.info.max_model_len - prompt_len, 1)
        max_tokens = min(defaults.get("max_tokens", fallback_max_tokens or left), left)
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=pick("temperature", 1.0),
        top_p=pick("top_p", 1.0),
        top_k=pick("top_k", -1),
        min_p=pick("min_p", 0.0),
        presence_penalty=pick("presence_penalty", 0.0),
        frequency_penalty=pick("frequency_penalty", 0.0),
        repetition_penalty=pick("repetition_penalty", 1.0),
        seed=req.seed,
        n=req.n,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        stop=req.stop,
        stop_token_ids=req.stop_token_ids,
        include_stop_str_in_output=req.include_stop_str_in_output,
        ignore_eos=req.ignore_eos,
        min_tokens=req.min_tokens,
        structured_outputs=structured_outputs,
        logit_bias=logit_bias_ids(req.logit_bias),
    )


# ---- logprobs -------------------------------------------------------------------------------------------


def clamp_logprob(value: float) -> float:
    return MIN_LOGPROB if math.isnan(value) or value < MIN_LOGPROB else value


def vllm_prompt_logprobs(positions: list[PositionLogprobs | None] | None) -> list[dict | None] | None:
    """vLLM's ``prompt_logprobs``: per prompt token, token id -> {logprob, rank, decoded_token}."""
    if positions is None:
        return None
    return [
        None if p is None else {
            str(t): {"logprob": clamp_logprob(lp.logprob), "rank": lp.rank, "decoded_token": lp.decoded_token}
            for t, lp in p.items()
        }
        for p in positions
    ]


def chosen_first(token_id: int, position: PositionLogprobs) -> list[tuple[int, Logprob]]:
    """A position's entries as vLLM lists them: the chosen token, then the others by rank."""
    others = sorted(((t, lp) for t, lp in position.items() if t != token_id), key=lambda e: e[1].rank)
    chosen = position.get(token_id)
    return others if chosen is None else [(token_id, chosen), *others]


class CompletionLogprobsWriter:
    """The completions API's logprobs of one choice, piece by piece (a stream sends the
    pieces). ``text_offset`` is each token's offset in the choice's text: it runs on across
    the pieces, from the echoed prompt's tokens into the completion's, as in vLLM."""

    def __init__(self, state: ServerState, offset: int = 0, as_ids: bool = False):
        self.state = state
        self.offset = offset
        self.as_ids = as_ids

    def piece(self, token_ids: Iterable[int], positions: Iterable[PositionLogprobs | None]) -> dict:
        text_of = self.state.token_text
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token_id, position in zip(token_ids, positions):
            chosen = None if position is None else position.get(token_id)
            text = text_of(token_id, chosen, self.as_ids)
            out["tokens"].append(text)
            out["token_logprobs"].append(None if chosen is None else clamp_logprob(chosen.logprob))
            out["top_logprobs"].append(None if position is None else {
                text_of(t, lp, self.as_ids): clamp_logprob(lp.logprob) for t, lp in chosen_first(token_id, position)
            })
            out["text_offset"].append(self.offset)
            self.offset += len(text)
        return out


def chat_logprobs(state: ServerState, token_ids: Iterable[int], positions: Iterable[PositionLogprobs], top: int,
                  as_ids: bool = False) -> dict:
    """The chat API's logprobs: per token its text, logprob, UTF-8 bytes and the ``top`` most
    likely tokens in rank order (``as_ids``: tokens as "token_id:N")."""
    content = []
    for token_id, position in zip(token_ids, positions):
        chosen = position.get(token_id)
        text = state.token_text(token_id, chosen, as_ids)
        best = sorted(((lp.rank, t, lp) for t, lp in position.items() if lp.rank <= top), key=lambda e: e[0])
        content.append({
            "token": text,
            "logprob": MIN_LOGPROB if chosen is None else clamp_logprob(chosen.logprob),
            "bytes": list(text.encode("utf-8")),
            "top_logprobs": [
                {"token": (s := state.token_text(t, lp, as_ids)), "logprob": clamp_logprob(lp.logprob),
                 "bytes": list(s.encode("utf-8"))}
                for _, t, lp in best
            ],
        })
    return {"content": content}


# ---- responses --------------------------------------------------------------------------------------------


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def usage_chunk(shape, object_name: str, prompt_tokens: int, completion_tokens: int) -> list[dict]:
    """A stream's last chunk before [DONE] when the client asked for usage
    (stream_options.include_usage): no choices, the request's token counts."""
    if not shape.req.include_usage:
        return []
    return [{"id": shape.id, "object": object_name, "created": shape.created, "model": shape.state.model_name,
             "choices": [], "usage": usage(prompt_tokens, completion_tokens)}]


def sse(payload: Any) -> str:
    return "data: " + json.dumps(payload, ensure_ascii=False, separators=(",", ":")) + "\n\n"


SSE_DONE = "data: [DONE]\n\n"


async def abort_on_disconnect(request: Request, group: RequestGroup) -> None:
    """Abort ``group`` as soon as the client disconnects. Once the body is read, ASGI's
    ``receive`` blocks until the disconnect (no polling)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            group.abort("disconnect")
            return
        await asyncio.sleep(0.1)  # not expected after the body, but never spin


async def final_outputs(group: RequestGroup, request: Request) -> list[RequestOutput]:
    """Every request's final output for a call that is not streamed; the call is aborted if
    its client disconnects, and a call the server aborted is an error."""
    watcher = asyncio.ensure_future(abort_on_disconnect(request, group))
    try:
        outputs = await group.results()
    finally:
        watcher.cancel()
        group.release()
    reason = group.abort_reason
    if reason == "timeout":
        raise ApiError(504, f"the request took longer than the server's request timeout of "
                            f"{group._owner.request_timeout} s and was aborted", "Timeout", code="timeout")
    if reason == "shutdown":
        raise ServiceUnavailableError("the server shut down before the request finished", retry_after=5)
    if reason is not None:  # the client is gone; nobody reads this
        raise ApiError(499, "the client disconnected", "ClientDisconnected")
    return outputs


class StreamWriter:
    """Turns a group's merged outputs into SSE chunks: ``head`` before any output, ``chunks``
    for each list of ready outputs, ``tail`` after the last (the usage chunk)."""

    def head(self) -> list[dict]:
        return []

    def chunks(self, ready: list[tuple[int, RequestOutput]]) -> list[dict]:
        raise NotImplementedError

    def tail(self) -> list[dict]:
        return []


async def sse_stream(group: RequestGroup, request: Request, writer: StreamWriter) -> AsyncIterator[str]:
    """The events of a streamed call: each batch of ready outputs is one write. Closing or
    cancelling this generator (the client went away) aborts the call at once."""
    watcher = asyncio.ensure_future(abort_on_disconnect(request, group))
    try:
        head = writer.head()
        if head:
            yield "".join(map(sse, head))
        async for ready in group:
            events = writer.chunks(ready)
            if events:
                yield "".join(map(sse, events))
        tail = writer.tail()
        yield "".join(map(sse, tail)) + SSE_DONE
    except CompiledLLMError as e:  # the engine failed the call: tell the client in the stream
        yield sse({"error": {"message": str(e), "type": "InternalServerError", "param": None, "code": None}}) + SSE_DONE
    finally:
        watcher.cancel()
        group.release()


def now_s() -> int:
    return int(time.time())

