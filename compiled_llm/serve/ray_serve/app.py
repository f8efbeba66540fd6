"""The Ray Serve application: engine replicas behind one OpenAI endpoint, with prefix-aware routing.

Two deployments:

- ``CompiledLLMEngine``: ``RayServeConfig.num_replicas`` replicas (or autoscaled between
  ``min_replicas`` and ``max_replicas``), each an engine (``LLM(model, **engine_options)``,
  tensor-parallel ranks included) under the OpenAI server's own FastAPI app
  (``serve.openai.api_server.build_app``), which it runs in-process on the requests forwarded to
  it (``asgi_forward.call_app``): every route, error and stream is the server's.
- ``OpenAiIngress``: one replica that takes HTTP, reads each request's prompt and forwards the
  request to an engine replica through a handle whose request router is
  ``PrefixAwareRequestRouter``: the replica that was sent the prompt's prefix, else the least
  loaded. A replica that dies before its response starts gets the request retried once on
  another; one that dies mid-stream ends the stream with an error event.

Run it with ``serve run compiled_llm.serve.ray_serve.app:build_app model=ENGINE num_replicas=2``
(any other ``key=value`` is an engine option, a build option of ``LLM`` or a server option), or
from Python: ``serve.run(build_app(RayServeConfig(...)))``.

A Ray file: it imports Ray at the top, and nothing outside ``serve/ray_serve`` imports it.
"""

# no `from __future__ import annotations`: FastAPI reads the ingress route's annotations (Request) at runtime
import asyncio
import dataclasses
import logging
import typing
from typing import Any

import ray
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from ray import serve
from ray.serve.config import AutoscalingConfig, RequestRouterConfig

from compiled_llm.errors import InvalidOptionError, first_line
from compiled_llm.serve.engine_config import EngineConfig
from compiled_llm.serve.engine_process.engine_core_client import EngineCoreClient
from compiled_llm.serve.llm import BUILD_KEYWORDS
from compiled_llm.serve.openai.api_server import build_app as build_openai_app
from compiled_llm.serve.openai.api_server import error_response
from compiled_llm.serve.openai.serving import SSE_DONE, sse
from compiled_llm.serve.ray_serve.asgi_forward import call_app, forwarded_request, prompt_of
from compiled_llm.serve.ray_serve.prefix_routing import PrefixRoutingConfig
from compiled_llm.serve.ray_serve.request_router import PrefixAwareRequestRouter
from compiled_llm.serve.server_config import ServerConfig

logger = logging.getLogger("compiled_llm.serve.ray_serve")

ENGINE_DEPLOYMENT = "CompiledLLMEngine"
INGRESS_DEPLOYMENT = "OpenAiIngress"
REPLICA_HEADER = "x-compiled-llm-replica"  # which engine replica answered: routing made visible


@dataclasses.dataclass(frozen=True)
class RayServeConfig:
    """The application's options. Either ``num_replicas`` (fixed), or ``min_replicas`` and
    ``max_replicas`` (Ray Serve's autoscaling, aiming at ``target_ongoing_requests`` per
    replica); neither: one replica."""

    model: str  # an engine directory, or a model source (built into each node's engine cache)
    num_replicas: int | None = None
    min_replicas: int | None = None
    max_replicas: int | None = None
    target_ongoing_requests: float = 16.0
    max_ongoing_requests: int = 256  # requests one replica takes at once (its engine queues them)
    replica_num_cpus: float = 1.0
    replica_num_gpus: float = 0.0  # 1 for an engine on a GPU (a TP engine: 0, its ranks take theirs)
    engine_options: dict = dataclasses.field(default_factory=dict)  # LLM(...)'s keywords: device, max_num_seqs, ...
    server_options: dict = dataclasses.field(default_factory=dict)  # ServerConfig's: served_model_name, api_key, ...
    routing: dict = dataclasses.field(default_factory=dict)  # PrefixRoutingConfig's: block_size, max_imbalance, ...

    def __post_init__(self):
        if not isinstance(self.model, str) or not self.model:
            raise InvalidOptionError("the Ray Serve application needs model=ENGINE|SOURCE")
        for name in ("num_replicas", "min_replicas", "max_replicas", "max_ongoing_requests"):
            value = getattr(self, name)
            low = 0 if name == "min_replicas" else 1
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < low):
                raise InvalidOptionError(f"{name} must be an integer >= {low}, got {value!r}")
        scaling = (self.min_replicas, self.max_replicas)
        if self.num_replicas is not None and scaling != (None, None):
            raise InvalidOptionError("give either num_replicas or min_replicas/max_replicas (autoscaling), not both")
        if (None in scaling) != (scaling == (None, None)):
            raise InvalidOptionError("autoscaling needs both min_replicas and max_replicas")
        if self.max_replicas is not None and self.min_replicas > self.max_replicas:
            raise InvalidOptionError(f"min_replicas ({self.min_replicas}) is above max_replicas ({self.max_replicas})")
        engine_names = {f.name for f in dataclasses.fields(EngineConfig)} | set(BUILD_KEYWORDS)
        unknown = sorted(set(self.engine_options) - engine_names)
        if unknown:
            raise InvalidOptionError(f"unknown engine option {unknown[0]!r}")
        if self.engine_options.get("data_parallel_size", 1) != 1:
            raise InvalidOptionError("data_parallel_size is compiled-llm serve's; under Ray Serve each replica is one "
                                     "engine and num_replicas (or min_replicas/max_replicas) sets how many")
        ServerConfig(**self.server_options)  # refused here, with its own message, before any replica starts
        if self.server_options.get("api_server_count", 1) != 1:
            raise InvalidOptionError("api_server_count is compiled-llm serve's; under Ray Serve its HTTP proxies and "
                                     "num_replicas spread the requests")
        PrefixRoutingConfig(**self.routing)

    @classmethod
    def from_args(cls, args: dict[str, Any]) -> "RayServeConfig":
        """The config of ``serve run ...:build_app key=value ...``'s arguments (strings): this
        class's fields by name, any other key an engine, build or server option."""
        own = {f.name for f in dataclasses.fields(cls)} - {"engine_options", "server_options", "routing"}
        hints = {**typing.get_type_hints(cls), **typing.get_type_hints(EngineConfig), **typing.get_type_hints(ServerConfig)}
        server_names = {f.name for f in dataclasses.fields(ServerConfig)}
        fields: dict[str, Any] = {"engine_options": {}, "server_options": {}}
        for key, value in args.items():
            value = _parsed(value, hints.get(key))
            if key in own:
                fields[key] = value
            elif key in server_names:
                fields["server_options"][key] = value
            else:
                fields["engine_options"][key] = value
        return cls(**fields)

    def engine_deployment_options(self) -> dict:
        options: dict[str, Any] = dict(
            max_ongoing_requests=self.max_ongoing_requests,
            ray_actor_options={"num_cpus": self.replica_num_cpus, "num_gpus": self.replica_num_gpus},
            request_router_config=RequestRouterConfig(request_router_class=PrefixAwareRequestRouter,
                                                      request_router_kwargs=dict(self.routing)),
        )
        if self.min_replicas is not None:
            options["autoscaling_config"] = AutoscalingConfig(
                min_replicas=self.min_replicas, max_replicas=self.max_replicas,
                target_ongoing_requests=self.target_ongoing_requests)
        else:
            options["num_replicas"] = self.num_replicas or 1
        return options


def _parsed(value: Any, hint) -> Any:
    """A ``key=value`` string as its field's type (int, float, bool); other values as given."""
    if not isinstance(value, str) or hint is None:
        return value
    kinds = [k for k in typing.get_args(hint) if k is not type(None)] or [hint]
    if value.lower() in ("none", "null") and type(None) in typing.get_args(hint):
        return None
    for kind in kinds:
        if kind is bool:
            if value.lower() in ("true", "1", "yes", "false", "0", "no"):
                return value.lower() in ("true", "1", "yes")
        elif kind in (int, float):
            try:
                return kind(value)
            except ValueError:
                continue
    return value


class EngineReplica:
    """One engine and the OpenAI server's app over it, answering forwarded requests."""

    def __init__(self, model: str, engine_options: dict, server_options: dict):
        from compiled_llm.serve.llm import LLM  # the engine loads here, in the replica

        self.llm = LLM(model, **engine_options)
        core = EngineCoreClient.in_thread(self.llm.engine)
        self.app = build_openai_app(core, ServerConfig(**server_options), model_name=model)
        self._lifespan = None
        self._start_lock: asyncio.Lock | None = None
        self.replica_id = serve.get_replica_context().replica_id.unique_id

    async def _started(self) -> None:
        """The app's lifespan (the engine thread, reading its outputs), entered on the loop that
        serves the requests: the first request's."""
        if self._lifespan is not None:
            return
        self._start_lock = self._start_lock or asyncio.Lock()
        async with self._start_lock:
            if self._lifespan is None:
                lifespan = self.app.router.lifespan_context(self.app)
                await lifespan.__aenter__()
                self._lifespan = lifespan

    async def forward(self, request: dict):
        await self._started()
        async for item in call_app(self.app, request):
            if isinstance(item, tuple):  # (status, headers)
                status, headers = item
                item = (status, [*headers, (REPLICA_HEADER, self.replica_id)])
            yield item

    def check_health(self) -> None:
        failure = self.app.state.server.async_engine.failure
        if failure is not None:  # Ray Serve replaces a replica whose health check raises
            raise RuntimeError(f"the engine stopped: {failure}")

    def __del__(self):
        llm = getattr(self, "llm", None)
        if llm is not None:
            llm.shutdown()


ingress_app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)  # the engines' app describes the API


@serve.ingress(ingress_app)
class OpenAiIngress:
    """Every HTTP request, forwarded to the engine replica the router picks."""

    RETRIES = 1  # a request whose replica died before its response started is sent once more

    def __init__(self, engines):
        self.engines = engines.options(stream=True)

    @ingress_app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"])
    async def forward(self, path: str, request: Request) -> Response:
        body = await request.body()
        forwarded = forwarded_request(request.method, "/" + path, request.url.query, list(request.headers.items()),
                                      body, prompt_of("/" + path, body))
        for attempt in range(self.RETRIES + 1):
            stream = self.engines.forward.remote(forwarded)
            try:
                status, headers = await stream.__anext__()
                break
            except (ray.exceptions.RayError, StopAsyncIteration) as e:
                stream.cancel()
                why = f"the engine replica serving this request failed: {first_line(e)}"
                if attempt == self.RETRIES:
                    return error_response(503, why, "ServiceUnavailableError", headers={"Retry-After": "1"})
                logger.warning("%s; retrying on another replica", why)
        event_stream = any(k.lower() == "content-type" and v.startswith("text/event-stream") for k, v in headers)
        return StreamingResponse(self._rest(stream, event_stream), status_code=status,
                                 headers={k: v for k, v in headers if k.lower() != "content-length"})

    @staticmethod
    async def _rest(stream, event_stream: bool):
        """The response's body; a replica that dies mid-stream ends an event stream with an
        error event (what the server sends when its engine fails), anything else where it stopped.
        (A method: Ray Serve ships the ingress class by value, without this module's functions.)"""
        try:
            async for chunk in stream:
                yield chunk
        except ray.exceptions.RayError as e:
            why = f"the engine replica serving this request failed: {first_line(e)}"
            logger.warning("%s, mid-response", why)
            if event_stream:
                yield sse({"error": {"message": why, "type": "ServiceUnavailableError", "param": None,
                                     "code": None}}) + SSE_DONE
        finally:
            # a client that went away: its replica's app sees a disconnect and aborts the request
            # (Serve cancels a dropped stream too; a finished one ignores this)
            stream.cancel()


def build_app(config: RayServeConfig | dict) -> serve.Application:
    """The application (``serve.run`` it): ``config`` a ``RayServeConfig``, or ``serve run``'s
    ``key=value`` arguments."""
    if not isinstance(config, RayServeConfig):
        config = RayServeConfig.from_args(config)
    engines = serve.deployment(EngineReplica, name=ENGINE_DEPLOYMENT, **config.engine_deployment_options()).bind(
        config.model, dict(config.engine_options), dict(config.server_options))
    return serve.deployment(OpenAiIngress, name=INGRESS_DEPLOYMENT, num_replicas=1,
                            ray_actor_options={"num_cpus": 0}).bind(engines)
