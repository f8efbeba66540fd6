"""The OpenAI-compatible HTTP server: ``build_app`` makes the FastAPI app over one engine core (the
engine's own process, ``EngineCoreClient``) or several data-parallel replicas of it
(``DataParallelClient``), ``serve`` runs it under uvicorn until SIGTERM (drain, then exit 0),
Ctrl-C, or the engine process's death (fail what runs, exit 1; with replicas, the last one's).

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``, ``POST
/tokenize`` and ``POST /detokenize`` (vLLM's shapes), ``GET /tokenizer_info`` (with
``--enable-tokenizer-info-endpoint``), and the open ones: ``GET /health`` (200 with an empty
body, as vLLM's; over replicas, 200 with how many are alive while any is), ``GET /metrics``
(Prometheus text), ``GET /version``. With an API key, every
route but the open ones needs it, checked before the body is read (``middleware``). Every error
is OpenAI's JSON, ``{"error": {"message", "type", "param", "code"}}``: 400 for invalid parameters
(a pydantic type error included), 401 without the key, 404 for an unknown model, 405 (with
Allow) for a method a route does not take, 500 once the engine has stopped, 503 with
Retry-After when the waiting queue is full or the server is shutting down, 504 when a request
times out. ``/openapi.json`` lists exactly these (``openapi``).

With ``--api-server-count N`` the app runs in N processes on the one port
(``api_servers``), each given its place (``ApiServerProcess``): its engine request ids are its
own, /metrics reports the whole server, and /health this process and its engines.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import importlib.metadata
import logging
import signal
import socket
import time
from typing import Callable

import uvicorn
from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict
from starlette.exceptions import HTTPException as StarletteHTTPException

from compiled_llm.errors import CompiledLLMError, EngineError
from compiled_llm.serve.engine_process.async_engine import AsyncEngine, ServiceUnavailableError
from compiled_llm.serve.engine_process.dp_client import DataParallelClient
from compiled_llm.serve.engine_process.engine_core_client import EngineCoreClient
from compiled_llm.serve.metrics import CONTENT_TYPE, ServerMetrics
from compiled_llm.serve.openai.middleware import ApiKeyMiddleware, RequestIdMiddleware, RootPathMiddleware
from compiled_llm.serve.openai.openapi import errors, honest_openapi, json_or_stream
from compiled_llm.serve.openai.protocol import (TOKENIZE_NOT_SUPPORTED, ChatCompletionRequest, ChatCompletionResponse,
                                                CompletionRequest, CompletionResponse, DetokenizeRequest,
                                                DetokenizeResponse, ModelCard, ModelList, TokenizeRequest,
                                                TokenizeResponse, unsupported_field)
from compiled_llm.serve.openai.serving import ApiError, ServerState
from compiled_llm.serve.openai.serving_chat import chat_prompt_ids, create_chat_completion
from compiled_llm.serve.openai.serving_completions import create_completion
from compiled_llm.serve.server_config import ServerConfig

logger = logging.getLogger("compiled_llm.serve.openai.api_server")


def error_response(status: int, message: str, type: str, param: str | None = None, code: str | None = None,
                   headers: dict | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": type, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """One line naming each bad field, and the first one's name."""
    parts, first = [], None
    for err in exc.errors():
        if err.get("type") == "json_invalid":
            return f"the request body is not valid JSON: {err.get('ctx', {}).get('error', 'cannot parse it')}", None
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        name = ".".join(loc) or "body"
        first = first or (loc[0] if loc else None)
        parts.append(f"{name}: {err.get('msg', 'invalid')}")
    return "; ".join(parts) or "invalid request body", first


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _bad_body(request, exc: RequestValidationError):
        message, param = _validation_message(exc)
        return error_response(400, message, "BadRequestError", param=param)

    @app.exception_handler(ApiError)
    async def _api_error(request, exc: ApiError):
        return error_response(exc.status, exc.message, exc.type, param=exc.param, code=exc.code)

    @app.exception_handler(ServiceUnavailableError)
    async def _unavailable(request, exc: ServiceUnavailableError):
        return error_response(503, str(exc), "ServiceUnavailableError", headers={"Retry-After": str(exc.retry_after)})

    @app.exception_handler(EngineError)
    async def _engine_error(request, exc: EngineError):
        return error_response(500, str(exc), "InternalServerError")

    @app.exception_handler(CompiledLLMError)
    async def _bad_request(request, exc: CompiledLLMError):  # InvalidRequestError and the like
        return error_response(400, str(exc), "BadRequestError")

    @app.exception_handler(Exception)
    async def _bug(request, exc: Exception):  # still logged with its traceback by the server
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}", "InternalServerError")

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, exc: StarletteHTTPException):  # 404, 405 (its Allow header kept), ...
        return error_response(exc.status_code, str(exc.detail), "NotFoundError" if exc.status_code == 404 else "HTTPError",
                              headers=exc.headers)


class PrometheusResponse(Response):
    media_type = CONTENT_TYPE


class VersionResponse(BaseModel):
    version: str


class HealthResponse(BaseModel):
    """/health of a server over data-parallel replicas: how many there are and which are alive."""

    data_parallel_size: int
    live_replicas: int
    dead_replicas: list[int]


class TokenizerInfoResponse(BaseModel):
    """vLLM's: the tokenizer's settings (transformers' init_kwargs), its class and chat template."""

    model_config = ConfigDict(extra="allow")
    tokenizer_class: str


def package_version() -> str:
    try:
        return importlib.metadata.version("compiled_llm")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


@dataclasses.dataclass(frozen=True)
class ApiServerProcess:
    """Which of the server's API-server processes an app runs in (``--api-server-count``): the
    ``index``-th of ``count``. Its engine request ids start with ``index``; the first alone counts
    the engines' metrics and logs the stats lines; /metrics reads every process's values from
    ``metrics_dir``; ``created`` is the server's start (every process's model card says the same)."""

    index: int
    count: int
    metrics_dir: str
    created: int


def build_app(core: EngineCoreClient | DataParallelClient, config: ServerConfig = ServerConfig(),
              model_name: str | None = None, api_server: ApiServerProcess | None = None) -> FastAPI:
    """The app serving ``core``'s engine (or its replicas); its lifespan starts reading the core
    and stops it. Clients name the model ``config.served_model_name``, else ``model_name``, else
    the engine's name. ``api_server``: where it runs when the server runs several."""
    info = core.info
    name = config.served_model_name or model_name or info.name
    metrics = ServerMetrics(name, core.start_snapshots, config.log_stats_interval, info.num_speculative_tokens,
                            engine_info=info, records_engines=api_server is None or api_server.index == 0,
                            multiprocess_dir=api_server and api_server.metrics_dir)
    async_engine = AsyncEngine(core, max_waiting_requests=config.max_waiting_requests,
                               max_waiting_prompt_tokens=config.max_waiting_prompt_tokens,
                               request_timeout=config.request_timeout, metrics=metrics,
                               request_id_prefix="" if api_server is None else f"{api_server.index}-")
    created = int(time.time()) if api_server is None else api_server.created
    state = ServerState(core, async_engine, metrics, config, name, created)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        async_engine.start()
        try:
            yield
        finally:
            await async_engine.stop()

    app = FastAPI(title="compiled_llm", description="An OpenAI-compatible server", version=package_version(),
                  lifespan=lifespan)
    app.state.server = state
    _install_error_handlers(app)
    # added last, runs first: the request id is sent back with a 401 too
    if config.api_key is not None:
        app.add_middleware(ApiKeyMiddleware, api_key=config.api_key)
    app.add_middleware(RequestIdMiddleware, always=config.enable_request_id_headers)
    if config.root_path is not None:
        app.add_middleware(RootPathMiddleware, root_path=config.root_path)
    honest_openapi(app, api_key_required=config.api_key is not None)
    key = (401,) if config.api_key is not None else ()

    v1 = APIRouter(prefix="/v1")

    @v1.get("/models", responses=errors(*key))
    async def models() -> ModelList:
        # root: the model as given on the command line (vLLM's), not the engine it was built into
        return ModelList(data=[ModelCard(id=name, created=state.created, root=model_name or info.name,
                                         max_model_len=info.max_model_len)])

    generation_errors = errors(400, *key, 404, 500, 503, 504)

    @v1.post("/completions", response_model=None,
             responses={**json_or_stream(CompletionResponse, "completion"), **generation_errors})
    async def completions(body: CompletionRequest, request: Request):
        return await create_completion(state, body, request, time.perf_counter())

    @v1.post("/chat/completions", response_model=None,
             responses={**json_or_stream(ChatCompletionResponse, "chat completion"), **generation_errors})
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await create_chat_completion(state, body, request, time.perf_counter())

    app.include_router(v1)

    replicated = core.num_replicas > 1
    # one engine: vLLM's empty 200; replicas: 200 with the live ones while any is (the server
    # serves on with the others), so a probe can tell a degraded server from a healthy one
    health_ok = ({"description": "The server and at least one of its engine replicas are up",
                  "model": HealthResponse} if replicated else
                 {"description": "The server and its engine are up (an empty body, as vLLM's)"})

    @app.get("/health", response_class=JSONResponse if replicated else Response,
             responses={200: health_ok, **errors(503)})
    async def health() -> Response:
        if async_engine.failure is not None:
            return error_response(503, f"the engine stopped: {async_engine.failure}", "ServiceUnavailableError")
        if not async_engine.accepting:
            return error_response(503, "the server is shutting down", "ServiceUnavailableError")
        if replicated:
            live = core.live_replicas
            return JSONResponse(HealthResponse(
                data_parallel_size=core.num_replicas, live_replicas=len(live),
                dead_replicas=[i for i in range(core.num_replicas) if i not in live]).model_dump())
        return Response(status_code=200)

    @app.get("/metrics", response_class=PrometheusResponse,
             responses={200: {"description": "Prometheus' text format", "content": {CONTENT_TYPE: {"schema": {"type": "string"}}}}})
    async def prometheus_metrics() -> Response:
        return PrometheusResponse(metrics.render())

    @app.get("/version")
    async def version() -> VersionResponse:
        return VersionResponse(version=app.version)

    @app.post("/tokenize", responses=errors(400, *key, 404))
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        state.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise ApiError(400, "give either prompt or messages", "BadRequestError")
        name = unsupported_field(body, TOKENIZE_NOT_SUPPORTED)
        if name is None and body.messages is not None and body.add_special_tokens:
            name = "add_special_tokens"  # a chat is rendered by its template alone
        if name is not None:
            raise ApiError(400, f"{name} is not supported by this server; leave {name} unset", "BadRequestError",
                           param=name)
        if body.messages is not None:
            ids = chat_prompt_ids(state, body.messages, body.add_generation_prompt)
        else:
            _, ids = core.validator.prompt_token_ids(body.prompt, body.add_special_tokens is not False)
        strs = None
        if body.return_token_strs and core.tokenizer is not None:  # vLLM's: the vocabulary's strings
            strs = core.tokenizer.token_strs(ids)
        return TokenizeResponse(count=len(ids), max_model_len=info.max_model_len, tokens=ids, token_strs=strs)

    @app.post("/detokenize", responses=errors(400, *key, 404))
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        state.check_model(body.model)
        if core.tokenizer is None:
            raise ApiError(400, "this model has no tokenizer", "BadRequestError")
        bad = next((t for t in body.tokens if not 0 <= t < info.vocab_size), None)
        if bad is not None:
            raise ApiError(400, f"token id {bad} is outside the model's vocabulary (0..{info.vocab_size - 1})",
                           "BadRequestError", param="tokens")
        return DetokenizeResponse(prompt=core.tokenizer.decode(body.tokens))

    if config.enable_tokenizer_info_endpoint:
        @app.get("/tokenizer_info", responses=errors(400, *key))
        async def tokenizer_info() -> TokenizerInfoResponse:
            if core.tokenizer is None:
                raise ApiError(400, "this model has no tokenizer", "BadRequestError")
            return TokenizerInfoResponse(**core.tokenizer.describe())

    return app


# ---- running it ---------------------------------------------------------------------------------


def serve(core: EngineCoreClient | DataParallelClient, config: ServerConfig, model_name: str | None = None, *,
          api_server: ApiServerProcess | None = None, sock: socket.socket | None = None,
          on_ready: Callable[[], None] | None = None) -> int:
    """Serve until SIGTERM (refuse new requests with 503, let running ones finish for up to
    ``config.shutdown_timeout`` seconds, abort the rest, stop the engine core, return 0),
    Ctrl-C (abort all, and uvicorn re-raises the interrupt), or the engine process's death
    (running requests fail, then return 1: a supervisor restarts a server that exits, as vLLM's
    does when its engine core dies). As one of several API servers (``api_server``): on the
    listening socket ``sock`` they share, calling ``on_ready`` once it accepts connections."""
    app = build_app(core, config, model_name, api_server)
    # after the drain, connections get a few seconds to send their last bytes
    uv_config = uvicorn.Config(app, host=config.host, port=config.port, log_level="warning",
                               access_log=config.access_log, lifespan="on", timeout_graceful_shutdown=5)
    server = DrainingServer(uv_config, app.state.server, on_ready=on_ready)
    server.run(sockets=None if sock is None else [sock])
    return 0 if app.state.server.async_engine.failure is None else 1


class DrainingServer(uvicorn.Server):
    """uvicorn's Server, with SIGTERM draining the engine before uvicorn shuts down (uvicorn's
    own SIGTERM would stop accepting connections at once, and re-raise the signal so the
    process dies of it). Ctrl-C, or a second SIGTERM, aborts every request and stops. When the
    engine process dies, the server stops once the failed requests have had their errors sent
    (at most ``FAILED_REQUESTS_GRACE`` seconds).

    One of several API servers (``on_ready`` given) is told by the process that started it, which
    may pass on a signal the process group got too (Ctrl-C, a supervisor's SIGTERM to every
    process): each signal counts once (SIGTERM drains, SIGINT aborts), and instead of the ready
    line it calls ``on_ready`` (that process logs one line for them all)."""

    FAILED_REQUESTS_GRACE = 2.0

    def __init__(self, config: uvicorn.Config, state: ServerState, on_ready: Callable[[], None] | None = None):
        super().__init__(config)
        self.state = state
        self.on_ready = on_ready
        self._signals_seen: set[int] = set()
        self._aio: asyncio.AbstractEventLoop | None = None
        self._drain_requested = False
        self._drain_task: asyncio.Task | None = None
        self._exit_task: asyncio.Task | None = None
        state.async_engine.on_failure = self._engine_failed

    def _engine_failed(self, reason: str) -> None:
        self._exit_task = asyncio.ensure_future(self._exit_after_failed_requests())

    async def _exit_after_failed_requests(self) -> None:
        await self.state.async_engine.wait_idle(self.FAILED_REQUESTS_GRACE)
        self.should_exit = True

    async def serve(self, sockets=None):
        self._aio = asyncio.get_running_loop()
        await super().serve(sockets)

    async def startup(self, sockets=None):
        await super().startup(sockets)
        if self.started:
            # everything made so far lives as long as the server: keep it out of the collector's
            # full passes, which would otherwise pause every stream for milliseconds at a time
            gc.collect()
            gc.freeze()
            if self.on_ready is None:
                _log_ready(self, self.state)
            else:
                self.on_ready()

    def handle_exit(self, sig, frame):
        if self.on_ready is not None:
            if sig in self._signals_seen:
                return
            self._signals_seen.add(sig)
        if sig == signal.SIGTERM and self._aio is not None and not self._drain_requested:
            self._drain_requested = True
            self._aio.call_soon_threadsafe(self._start_drain)  # a signal handler must not touch the loop itself
            return
        if self._aio is not None:
            self._aio.call_soon_threadsafe(self.state.async_engine.abort_all)
        super().handle_exit(sig, frame)

    def _start_drain(self) -> None:
        self._drain_task = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        grace = self.state.config.shutdown_timeout
        if self.on_ready is None:  # else the process that started this one has said so
            logger.info("SIGTERM: refusing new requests, letting running ones finish for up to %g s", grace)
        try:
            await self.state.async_engine.drain(grace)
        finally:
            self.should_exit = True


def _log_ready(server: uvicorn.Server, state: ServerState) -> None:
    host, port = state.config.host, state.config.port
    for s in server.servers:
        for sock in s.sockets or ():
            host, port = sock.getsockname()[:2]
            break
    log_ready(state.model_name, host, port, state.config)


def log_ready(model_name: str, host: str, port: int, config: ServerConfig, api_servers: int = 1) -> None:
    """The line that says the server is up, and where."""
    shown = f"[{host}]" if ":" in host else host
    logger.info("serving %r at http://%s:%d/v1 (OpenAI API; /health, /metrics)%s%s", model_name, shown, port,
                "" if config.api_key is None else ", API key required",
                "" if api_servers == 1 else f", {api_servers} API server processes")
