"""POST /v1/chat/completions: messages -> the tokenizer's chat template -> one engine request ->
a chat completion or a stream of chunks (each choice's role first, then its content deltas)."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import StreamingResponse

from compiled_llm.errors import CompiledLLMError, InvalidRequestError
from compiled_llm.model.tokenizer.chat_template import check_template_kwargs
from compiled_llm.serve.openai.protocol import (CHAT_NOT_SUPPORTED, ChatCompletionRequest, ChatCompletionResponse,
                                                ChatMessage)
from compiled_llm.serve.openai.reasoning.chat import ChatReasoning, after_thinking, prompt_tail, reasoning_parser
from compiled_llm.serve.openai.serving import (ApiError, ServerState, StreamWriter, chat_logprobs, check_request_fields,
                                               final_outputs, new_id, now_s, sampling_params, sse_stream,
                                               truncated_prompt, usage, usage_chunk, vllm_prompt_logprobs)
from compiled_llm.serve.openai.structured_outputs import request_structured_outputs
from compiled_llm.serve.openai.tool_calls import ToolPlan, check_no_other_constraint, template_tool_calls, tool_plan
from compiled_llm.serve.outputs import RequestOutput


def chat_messages(messages: list[ChatMessage]) -> list[dict]:
    """Plain {"role", "content"} dicts for the template; text parts are joined by newlines."""
    if not messages:
        raise InvalidRequestError("messages is empty; give at least one message")
    out = []
    for m in messages:
        content = m.content
        if isinstance(content, list):
            for part in content:
                if part.type != "text" or part.text is None:
                    raise InvalidRequestError(f"message content of type {part.type!r} is not supported, only 'text'")
            content = "\n".join(part.text for part in content)
        message = {"role": m.role, "content": content or ""}
        if m.name is not None:
            message["name"] = m.name
        if m.tool_calls:
            message["tool_calls"] = template_tool_calls(m.tool_calls)
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        out.append(message)
    return out


def chat_prompt_ids(state: ServerState, messages: list[ChatMessage], add_generation_prompt: bool = True,
                    template_kwargs: dict | None = None, tools: list[dict] | None = None) -> list[int]:
    tok = state.tokenizer
    if tok is None:
        raise InvalidRequestError("this model has no tokenizer, so it cannot chat; use /v1/completions with token ids")
    if not tok.has_chat_template:
        raise InvalidRequestError("this model's tokenizer has no chat template; use /v1/completions")
    dicts = chat_messages(messages)
    check_chat_template_kwargs(template_kwargs)
    try:
        return list(tok.apply_chat_template(dicts, add_generation_prompt=add_generation_prompt,
                                            template_kwargs=template_kwargs, tools=tools or None))
    except Exception as e:  # the template's own checks (roles must alternate, ...)
        raise InvalidRequestError(f"the chat template refused the messages: {e}") from None


def check_chat_template_kwargs(kwargs: dict | None) -> None:
    """400 for chat_template_kwargs that would shadow the renderer's own template variables."""
    try:
        check_template_kwargs(kwargs)
    except CompiledLLMError as e:
        raise ApiError(400, str(e), "BadRequestError", param="chat_template_kwargs") from None


def _validated(state: ServerState, req: ChatCompletionRequest, plan: ToolPlan) -> tuple:
    check_request_fields(req, CHAT_NOT_SUPPORTED)
    requested = request_structured_outputs(req)
    check_no_other_constraint(plan, requested)
    if req.add_special_tokens:  # vLLM's option to add BOS and the like on top of the template's
        raise ApiError(400, "add_special_tokens is not supported for chats: the chat template adds the special "
                            "tokens", "BadRequestError", param="add_special_tokens")
    if req.top_logprobs is not None and not req.logprobs:
        raise InvalidRequestError("top_logprobs needs logprobs to be true")
    ids = truncated_prompt(state, req, chat_prompt_ids(state, req.messages, req.add_generation_prompt,
                                                       req.chat_template_kwargs, req.tools))
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    structured = plan.structured_outputs or requested
    if state.config.reasoning_parser is not None:
        structured = after_thinking(structured, state.tokenizer, ids)
    params = sampling_params(state, req, max_tokens=max_tokens, prompt_len=len(ids), fallback_max_tokens=None,
                             logprobs=(req.top_logprobs or 0) if req.logprobs else None,
                             prompt_logprobs=req.prompt_logprobs, structured_outputs=structured)
    return state.validator.validate({"prompt_token_ids": ids}, params)


def echoed_content(req: ChatCompletionRequest) -> str:
    """vLLM's chat ``echo``: the reply starts with the last message's content when that message
    has the reply's role (the assistant's, or with add_generation_prompt false the last
    message's own)."""
    if not req.echo or not req.messages:
        return ""
    last = req.messages[-1]
    role = "assistant" if req.add_generation_prompt else last.role
    if last.role != role:
        return ""
    return chat_messages([last])[0]["content"]


async def create_chat_completion(state: ServerState, req: ChatCompletionRequest, http: Request, arrival: float):
    state.check_model(req.model)
    plan = tool_plan(state, req)
    request = _validated(state, req, plan)
    group = state.async_engine.submit([request], stream=req.stream, arrival=arrival)
    shape = _Shape(state, req, new_id("chatcmpl", http, req.request_id), now_s(), plan)
    parser = reasoning_parser(state.config.reasoning_parser)
    if parser is not None:
        shape.reasoning = ChatReasoning(parser, prompt_tail(state.tokenizer, request[1]))
    if req.stream:
        return StreamingResponse(sse_stream(group, http, _ChatStream(shape, request[1])),
                                 media_type="text/event-stream")
    (out,) = await final_outputs(group, http)
    return shape.response(out)


class _Shape:
    def __init__(self, state: ServerState, req: ChatCompletionRequest, id: str, created: int,
                 tools: ToolPlan = ToolPlan()):
        self.state, self.req, self.id, self.created, self.tools = state, req, id, created, tools
        self.top = req.top_logprobs or 0
        self.echo = echoed_content(req)
        self.token_ids = bool(req.return_token_ids)
        self.reasoning: ChatReasoning | None = None  # with --reasoning-parser

    def delta(self, index: int, text: str, finished: bool) -> dict:
        if self.reasoning is not None:
            return self.reasoning.delta(index, text, finished)
        return {"content": text}

    def logprobs(self, token_ids, positions) -> dict | None:
        if not self.req.logprobs:
            return None
        return chat_logprobs(self.state, token_ids, positions or [], self.top,
                             as_ids=bool(self.req.return_tokens_as_token_ids))

    def prompt_logprobs(self, out: RequestOutput):
        return vllm_prompt_logprobs(out.prompt_logprobs) if self.req.prompt_logprobs is not None else None

    def message(self, text: str) -> tuple[dict, bool]:
        """The assistant's message, and whether it calls tools. With a reasoning parser the think
        block is ``reasoning_content`` and the calls are parsed from the answer after it."""
        message = {"role": "assistant"}
        answer = text
        if self.reasoning is not None:
            message["reasoning_content"], answer = self.reasoning.split(text)
        content, calls = self.tools.parse(answer)
        if not calls:
            content = self.echo + answer
            # with a reasoning parser an empty answer is null, as vLLM's
            message["content"] = (content or None) if self.reasoning is not None else content
            return message, False
        content = self.echo + (content or "")
        message.update(content=content or None, tool_calls=[c.openai() for c in calls])
        return message, True

    def response(self, out: RequestOutput) -> ChatCompletionResponse:
        messages = [self.message(c.text) for c in out.outputs]
        choices = [{
            "index": c.index,
            "message": message,
            "logprobs": self.logprobs(c.token_ids, c.logprobs),
            "finish_reason": self.tools.finish_reason(called, c.finish_reason),
            "stop_reason": c.stop_reason,
            "token_ids": list(c.token_ids) if self.token_ids else None,
        } for c, (message, called) in zip(out.outputs, messages)]
        completion_tokens = sum(len(c.token_ids) for c in out.outputs)
        return ChatCompletionResponse(id=self.id, created=self.created, model=self.state.model_name, choices=choices,
                                      usage=usage(len(out.prompt_token_ids), completion_tokens),
                                      prompt_logprobs=self.prompt_logprobs(out),
                                      prompt_token_ids=list(out.prompt_token_ids) if self.token_ids else None)

    def chunk(self, choice: dict) -> dict:
        chunk = {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                 "model": self.state.model_name, "choices": [choice]}
        if self.req.include_usage:
            chunk["usage"] = None
        return chunk


class _ChatStream(StreamWriter):
    """The role first (with the prompt's ids under return_token_ids, and the echoed content
    under echo), then each choice's deltas; with continuous_usage_stats every chunk carries the
    usage so far."""

    def __init__(self, shape: _Shape, prompt_ids: list[int]):
        self.shape = shape
        self.prompt_ids = prompt_ids
        self.prompt_tokens = len(prompt_ids)
        self.completion_tokens = 0
        self.sent_tokens: dict[int, int] = {}
        self.finished: set[int] = set()
        self.prompt_logprobs_sent = False
        streams = {i: shape.tools.stream() for i in range(shape.req.n)}
        self.tool_streams = {i: stream for i, stream in streams.items() if stream is not None}

    def _usage(self, chunk: dict, index: int) -> dict:
        if self.shape.req.continuous_usage:
            chunk["usage"] = usage(self.prompt_tokens, self.sent_tokens.get(index, 0))
        return chunk

    def head(self) -> list[dict]:
        s = self.shape
        events = []
        for i in range(s.req.n):
            chunk = s.chunk({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None})
            if s.token_ids and i == 0:
                chunk["prompt_token_ids"] = list(self.prompt_ids)
            events.append(self._usage(chunk, i))
        if s.echo:
            events += [self._usage(s.chunk({"index": i, "delta": {"content": s.echo}, "logprobs": None,
                                            "finish_reason": None}), i) for i in range(s.req.n)]
        return events

    def chunks(self, ready: list[tuple[int, RequestOutput]]) -> list[dict]:
        s = self.shape
        events = []
        for _, out in ready:
            for c in out.outputs:
                if c.index in self.finished:
                    continue  # a finished request's output repeats its completions
                if not c.delta_text and not c.delta_token_ids and c.finish_reason is None:
                    continue
                choice = {"index": c.index, "delta": s.delta(c.index, c.delta_text, c.finish_reason is not None),
                          "logprobs": s.logprobs(c.delta_token_ids, c.delta_logprobs),
                          "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                if s.token_ids:
                    choice["token_ids"] = list(c.delta_token_ids)
                calls = self._tool_call_chunks(choice, choice["delta"].get("content", ""), c.finish_reason is not None)
                chunk = s.chunk(choice)
                if not self.prompt_logprobs_sent and s.req.prompt_logprobs is not None and out.prompt_logprobs:
                    chunk["prompt_logprobs"] = s.prompt_logprobs(out)  # at the top level, as in a response
                    self.prompt_logprobs_sent = True
                self.sent_tokens[c.index] = self.sent_tokens.get(c.index, 0) + len(c.delta_token_ids)
                events.append(self._usage(chunk, c.index))
                events += [self._usage(s.chunk(call), c.index) for call in calls]
                if c.finish_reason is not None:
                    self.finished.add(c.index)
                    self.completion_tokens += len(c.token_ids)
        return events

    def _tool_call_chunks(self, choice: dict, delta_text: str, final: bool) -> list[dict]:
        """With tools to parse: the choice's content delta becomes the text outside calls, its
        first call delta rides in the choice's own chunk when that has no content, and the
        others follow as chunks of their own; the finish reason moves to the last, "tool_calls"
        when the answer called tools (``ToolPlan.finish_reason``)."""
        stream = self.tool_streams.get(choice["index"])
        if stream is None:
            return []
        content, deltas = stream.feed(delta_text, final)
        delta = choice["delta"]
        if content or not ("reasoning_content" in delta or deltas):
            delta["content"] = content
        else:  # a delta of reasoning or calls alone
            delta.pop("content", None)
        if deltas and not content:
            delta["tool_calls"] = [deltas.pop(0)]
        calls = [{"index": choice["index"], "delta": {"tool_calls": [d]}, "logprobs": None, "finish_reason": None}
                 for d in deltas]
        if final:
            choice["finish_reason"] = self.shape.tools.finish_reason(stream.called, choice["finish_reason"])
        if calls and final:
            calls[-1]["finish_reason"], calls[-1]["stop_reason"] = choice["finish_reason"], choice["stop_reason"]
            choice["finish_reason"] = choice["stop_reason"] = None
        return calls

    def tail(self) -> list[dict]:
        return usage_chunk(self.shape, "chat.completion.chunk", self.prompt_tokens, self.completion_tokens)
