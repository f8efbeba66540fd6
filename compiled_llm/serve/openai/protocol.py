"""Request and response bodies in OpenAI's shapes, with vLLM's extra fields.

As in vLLM, a field neither OpenAI nor vLLM defines is ignored, not refused. A known one with a
wrong type is a 400: request models are strict, so JSON ``true`` is no integer and ``1`` no
boolean, exactly as ``SamplingParams`` takes them (an integer is still a number). Values are
range-checked by ``SamplingParams`` (one place for the rules), so the models here only fix types
and defaults. A field left unset (``model_fields_set``) takes the checkpoint's generation
defaults, then OpenAI's.

vLLM's fields that this server does not implement are declared in ``NOT_SUPPORTED``: a request
that sets one to anything but its neutral value is refused with a 400 naming it, never served as
if the field were not there.
"""

from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

# vLLM's range for seeds, priorities and the like: a signed 64-bit integer
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="ignore")


class OpenAIRequest(OpenAIModel):
    # extras are kept (model_extra) so that vLLM's fields this server lacks can be refused
    model_config = ConfigDict(extra="allow", strict=True)


# vLLM request fields this server does not implement, with the values that ask for nothing
# (a request may send those): anything else is a 400 naming the field (see ``unsupported_field``).
_COMMON_NOT_SUPPORTED: dict[str, tuple] = {
    "use_beam_search": (False,),
    "length_penalty": (1, 1.0),
    "watermarking": (None, False),
    "allowed_token_ids": (None,),
    "logprob_token_ids": (None,),
    "bad_words": (None, []),
    "skip_special_tokens": (True,),
    "spaces_between_special_tokens": (True,),
    "priority": (0,),
    "cache_salt": (None,),
    "kv_transfer_params": (None,),
    "ec_transfer_params": (None,),
    "vllm_xargs": (None,),
    "repetition_detection": (None,),
    "thinking_token_budget": (None, -1),
    "stream_interval": (None, 1),
    "routed_experts_prompt_start": (0,),
    # vLLM's old spelling of structured_outputs
    "guided_json": (None,),
    "guided_regex": (None,),
    "guided_choice": (None,),
    "guided_grammar": (None,),
    "guided_decoding_backend": (None,),
    "logits_processors": (None,),
}
COMPLETION_NOT_SUPPORTED = {**_COMMON_NOT_SUPPORTED, "prompt_embeds": (None,)}
CHAT_NOT_SUPPORTED = {
    **_COMMON_NOT_SUPPORTED,
    "functions": (None,),
    "function_call": (None, "none"),
    "reasoning_effort": (None,),
    "continue_final_message": (False,),
    "documents": (None,),
    "chat_template": (None,),
    "return_prompt_text": (None, False),
    "media_io_kwargs": (None,),
    "mm_processor_kwargs": (None,),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
}


def unsupported_field(req: OpenAIRequest, table: dict[str, tuple]) -> str | None:
    """The first field of ``table`` the request sets to a value that asks for something."""
    for name, value in (req.model_extra or {}).items():
        if name in table and not any(value == ok and type(value) is type(ok) for ok in table[name]):
            return name
    return None


# ---- requests ------------------------------------------------------------------------------------


class StreamOptions(OpenAIRequest):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage on every chunk


class SamplingRequest(OpenAIRequest):
    """The fields completions and chat completions share."""

    model: str | None = None
    n: int = 1
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)  # vLLM's range
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted, unused
    logit_bias: dict[str, float] | None = None  # token id (a JSON key, so a string) -> bias in [-100, 100]
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    prompt_logprobs: int | None = None
    min_tokens: int = 0
    # keep the prompt's last k tokens (-1: as many as the model takes); truncation_side "right"
    # keeps the first k instead
    truncate_prompt_tokens: int | None = Field(None, ge=-1, le=INT64_MAX)
    truncation_side: Literal["left", "right"] | None = None
    return_token_ids: bool | None = None  # prompt_token_ids and each choice's token_ids
    return_tokens_as_token_ids: bool | None = None  # logprob tokens as "token_id:N"
    # OpenAI's text / json_object / json_schema, or vLLM's structured_outputs object (one of them;
    # see structured_outputs.py)
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    request_id: str | None = None  # the response id's suffix, as in vLLM
    # vLLM's: a text prompt gets the tokenizer's special tokens (BOS); a chat does not (its
    # template has them), and this server renders chats only that way
    add_special_tokens: bool | None = None

    @field_validator("n", mode="before")
    @classmethod
    def _null_n_is_one(cls, value):
        return 1 if value is None else value

    @field_validator("stream", "echo", mode="before", check_fields=False)
    @classmethod
    def _null_is_false(cls, value):  # vLLM's bool | None for these two
        return False if value is None else value

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        """Usage on every chunk (vLLM: continuous_usage_stats, with include_usage)."""
        return self.include_usage and self.stream_options.continuous_usage_stats


def _is_id(value) -> bool:
    return type(value) is int  # JSON true/false are no token ids


def _prompt_shape(value):
    """One error naming the four shapes, instead of one per shape the union tried."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and (all(_is_id(t) for t in value) or all(isinstance(t, str) for t in value)
                                    or all(isinstance(p, list) and all(_is_id(t) for t in p) for p in value)):
        return value
    raise ValueError("prompt must be a text, a list of texts, a list of token ids (integers) or a list of such lists")


class CompletionRequest(SamplingRequest):
    # a text, a list of texts, token ids, or a list of token-id lists: one engine request each
    prompt: Union[list[int], list[list[int]], str, list[str]]

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_error_for_a_bad_prompt(cls, value):
        return _prompt_shape(value)
    echo: bool = False
    logprobs: int | None = None  # the completions API's top-logprobs count
    suffix: str | None = None  # refused when given


class TextPart(OpenAIRequest):
    type: str
    text: str | None = None


class ChatMessage(OpenAIRequest):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's calls, arguments a JSON text
    tool_call_id: str | None = None  # a "tool" message's answer to that call


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage]
    logprobs: bool = False
    top_logprobs: int | None = None
    max_completion_tokens: int | None = None
    add_generation_prompt: bool = True  # vLLM's extra
    echo: bool = False  # vLLM's: the reply starts with the last message's content, same role
    tools: list[dict[str, Any]] | None = None  # {"type": "function", "function": {"name", ...}}
    # "none", "auto" (the default with tools; see tool_calls.py), "required" or a named function
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = True  # false: the first call only
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: extra chat template variables


TOKENIZE_NOT_SUPPORTED = {
    name: CHAT_NOT_SUPPORTED[name]
    for name in ("continue_final_message", "chat_template", "mm_processor_kwargs")
} | {"chat_template_kwargs": (None, {}), "tools": (None, [])}


class TokenizeRequest(OpenAIRequest):
    """vLLM's /tokenize: a text (``prompt``) or a chat (``messages``)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    # vLLM's default: True for a text, False for a chat (its template adds them)
    add_special_tokens: bool | None = None
    return_token_strs: bool | None = False  # vLLM's: each token's string in token_strs


class DetokenizeRequest(OpenAIRequest):
    model: str | None = None
    tokens: list[int]


# ---- responses -----------------------------------------------------------------------------------


class UsageInfo(OpenAIModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(OpenAIModel):
    """The completions API's (legacy) logprobs: per token its text, logprob (None for the first
    echoed prompt token), its top alternatives, and its character offset in the choice's text."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class VllmLogprob(OpenAIModel):
    logprob: float
    rank: int
    decoded_token: str | None = None


class CompletionChoice(OpenAIModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # vLLM's: per prompt token (None for the first), token id -> logprob
    prompt_logprobs: list[dict[str, VllmLogprob] | None] | None = None
    # vLLM's, with return_token_ids
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None


class CompletionResponse(OpenAIModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None


class TopLogprob(OpenAIModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(OpenAIModel):
    content: list[TokenLogprob] | None = None


class AssistantMessage(OpenAIModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None  # vLLM's, with --reasoning-parser
    tool_calls: list[dict[str, Any]] = Field(default_factory=list)  # as vLLM: [] when none


class ChatChoice(OpenAIModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # vLLM's, with return_token_ids


class ChatCompletionResponse(OpenAIModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None
    # vLLM's: at the top level, null when not asked for
    prompt_logprobs: list[dict[str, VllmLogprob] | None] | None = None
    prompt_token_ids: list[int] | None = None  # vLLM's, with return_token_ids


class ModelCard(OpenAIModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "compiled_llm"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(OpenAIModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(OpenAIModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(OpenAIModel):
    prompt: str


class ErrorInfo(OpenAIModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(OpenAIModel):
    error: ErrorInfo
