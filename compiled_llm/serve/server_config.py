"""``ServerConfig``: the options of ``compiled-llm serve`` beyond the engine's, the one place their
names, defaults and help live (``cli/engine_args.py`` makes a flag of each field, as it does for
``EngineConfig``). Plain Python: building the command line imports no torch."""

from __future__ import annotations

import dataclasses
import math

from compiled_llm.errors import InvalidOptionError

API_KEY_VAR = "COMPILED_LLM_API_KEY"
# serve.openai.reasoning's parsers and serve.openai.tool_parsers' (this module sits below them, so
# it names them here)
REASONING_PARSERS = ("deepseek_r1", "qwen3")
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "none")
# serve.engine_process.dp_router's routers, the first the default
LOAD_BALANCE_METHODS = ("prefix_aware", "round_robin")


def _option(default, help: str):
    return dataclasses.field(default=default, metadata={"help": help})


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    """How the OpenAI-compatible server listens, whom it serves and how much it queues."""

    # vLLM listens on every interface by default; a server reachable from elsewhere should be a
    # decision (and come with --api-key), so ours listens on this machine only unless told.
    host: str = _option("127.0.0.1", "address to listen on: 127.0.0.1 (the default) serves this machine "
                                     "only; 0.0.0.0 every interface (vLLM's default)")
    port: int = _option(8000, "TCP port to listen on (0: any free port; the log names it)")
    # vLLM's flag. vLLM's default is the data-parallel size; here it is 1 however many replicas
    # run, so that one prefix-aware router sees every request (each API server routes its own).
    api_server_count: int = _option(
        1, "HTTP front-end processes sharing the port, as vLLM's flag: each takes the connections it accepts, "
           "parses, detokenizes and streams their requests, and talks to the engine processes itself. 1 was the "
           "fastest measured with one GPU engine under full-load streaming (README); the waiting limits hold "
           "per process, and with --data-parallel-size each one routes its own requests")
    api_key: str | None = dataclasses.field(default=None, repr=False, metadata={"help": (
        f"clients must send 'Authorization: Bearer KEY' to every route but /health, /metrics, /version and "
        f"the API's description (/openapi.json, /docs, /redoc); unset: ${API_KEY_VAR}, else no key is needed")})
    served_model_name: str | None = _option(
        None, "the model name clients send and /v1/models lists; unset: ENGINE|SOURCE as given")
    max_waiting_requests: int = _option(
        1024, "most requests accepted but not yet scheduled; more are refused with 503 and Retry-After")
    max_waiting_prompt_tokens: int = _option(
        1 << 20, "most prompt tokens of requests accepted but not yet scheduled; more are refused with 503")
    request_timeout: float | None = _option(
        None, "seconds a request may take before it is aborted (finish reason 'abort'); unset: no limit")
    shutdown_timeout: float = _option(
        30.0, "on SIGTERM, seconds to let running requests finish before the rest are aborted")
    log_stats_interval: float = _option(
        10.0, "seconds between the log lines of throughput, queue and KV-cache usage while busy")
    access_log: bool = _option(False, "log every HTTP request (uvicorn's access log)")
    root_path: str | None = _option(
        None, "the path prefix a reverse proxy serves this server under (e.g. /llm), as FastAPI's root_path: "
              "requests are routed with or without it, and /openapi.json names it")
    enable_request_id_headers: bool = _option(
        False, "send an X-Request-Id header with every response (a new id when the request brings none); "
               "without it, only a request's own X-Request-Id is sent back")
    enable_tokenizer_info_endpoint: bool = _option(
        False, "serve GET /tokenizer_info (the tokenizer's settings and chat template), as vLLM's flag")
    reasoning_parser: str | None = _option(
        None, f"return chat replies' <think> block as reasoning_content, as vLLM's flag: one of "
              f"{', '.join(REASONING_PARSERS)}; unset: the reply's text is all content")
    # tool calling, as vLLM's flags (see serve/openai/tool_calls.py)
    enable_auto_tool_choice: bool = _option(
        False, "let chats with tools use tool_choice 'auto' (the default with tools): the calls the model "
               "writes are parsed into message.tool_calls, as vLLM's flag")
    tool_call_parser: str | None = dataclasses.field(default=None, metadata={"choices": TOOL_CALL_PARSERS, "help": (
        "how tool calls are found in the model's text: hermes (Qwen's <tool_call> tags), llama3_json "
        "(Llama 3.1's JSON calls) or none; unset: the one the chat template implies")})
    # SGLang's flag; its router's cache_aware policy is prefix_aware here
    load_balance_method: str = dataclasses.field(default="prefix_aware", metadata={
        "choices": LOAD_BALANCE_METHODS, "help": (
            "with --data-parallel-size N: which replica a request goes to. prefix_aware: the one that was sent "
            "the longest prefix of its prompt, else the least loaded; round_robin: each in turn (the baseline "
            "'bench --dataset-name prefix_repetition' measures prefix_aware against)")})

    def __post_init__(self):
        if not isinstance(self.port, int) or isinstance(self.port, bool) or not 0 <= self.port <= 65535:
            raise InvalidOptionError(f"port must be an integer in 0..65535, got {self.port!r}")
        for name in ("api_server_count", "max_waiting_requests", "max_waiting_prompt_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidOptionError(f"{name} must be an integer >= 1, got {value!r}")
        for name in ("request_timeout", "shutdown_timeout", "log_stats_interval"):
            value = getattr(self, name)
            if value is None and name == "request_timeout":
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise InvalidOptionError(f"{name} must be a number of seconds, got {value!r}")
            if value < 0 or (value == 0 and name != "shutdown_timeout"):
                raise InvalidOptionError(f"{name} must be {'>= 0' if name == 'shutdown_timeout' else '> 0'} seconds, got {value}")
        if self.root_path is not None and (not self.root_path.startswith("/") or self.root_path.endswith("/")):
            raise InvalidOptionError(f"root_path must start with '/' and not end with one (e.g. /llm), got {self.root_path!r}")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise InvalidOptionError(f"unknown reasoning parser {self.reasoning_parser!r}; choose one of: "
                                     f"{', '.join(REASONING_PARSERS)}")
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise InvalidOptionError(f"unknown tool call parser {self.tool_call_parser!r}; choose one of: "
                                     f"{', '.join(TOOL_CALL_PARSERS)}")
        if self.load_balance_method not in LOAD_BALANCE_METHODS:
            raise InvalidOptionError(f"unknown load_balance_method {self.load_balance_method!r}; choose one of: "
                                     f"{', '.join(LOAD_BALANCE_METHODS)}")
        if self.api_key is not None and not self.api_key.strip():
            raise InvalidOptionError("api_key is empty; leave it unset to serve without a key")
