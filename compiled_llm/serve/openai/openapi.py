"""The server's OpenAPI document as the server behaves: each route lists the statuses it sends
with the content type of each (OpenAI's error JSON for errors, ``text/event-stream`` for a
stream, Prometheus' text for /metrics, nothing for /health's 200), and the API key where one is
needed.

FastAPI documents a 422 for every route with a body, but this server answers a bad body with
400 in OpenAI's shape (as vLLM does), so ``honest_openapi`` takes the 422 out.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from compiled_llm.serve.openai.middleware import OPEN_PATHS
from compiled_llm.serve.openai.protocol import ErrorResponse

WHY = {
    400: "Invalid parameters, or a body that is not the request's JSON: the message names the problem",
    401: "No API key, or a wrong one (send 'Authorization: Bearer KEY')",
    404: "The model named is not the one this server serves",
    500: "The engine stopped; the server exits",
    503: "The waiting queue is full (Retry-After says when to try again), the server is shutting down, "
         "or (/health) the engine stopped",
    504: "The request ran past the server's --request-timeout and was aborted",
}


def errors(*statuses: int) -> dict[int, dict]:
    """The ``responses`` entries of error statuses, each OpenAI's error JSON."""
    return {s: {"model": ErrorResponse, "description": WHY[s]} for s in statuses}


def json_or_stream(model: type, what: str) -> dict[int, dict]:
    """A 200 that is ``model`` as JSON, or with ``stream: true`` server-sent events of its
    chunks, ending with ``data: [DONE]``."""
    return {200: {"model": model, "description": f"The {what} (JSON), or with stream: true its chunks as "
                                                  "server-sent events, then 'data: [DONE]'",
                  "content": {"text/event-stream": {"schema": {"type": "string"}}}}}


def honest_openapi(app: FastAPI, api_key_required: bool) -> None:
    """Make ``app.openapi()`` give FastAPI's document without its 422s, with the bearer key on
    every route that needs it."""
    fastapi_openapi = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = _finish(fastapi_openapi(), api_key_required)
        return app.openapi_schema

    app.openapi = openapi


def _finish(schema: dict[str, Any], api_key_required: bool) -> dict[str, Any]:
    for path, item in schema.get("paths", {}).items():
        for operation in item.values():
            operation.get("responses", {}).pop("422", None)
            if api_key_required and path not in OPEN_PATHS:
                operation["security"] = [{"bearer": []}]
    components = schema.setdefault("components", {})
    for name in ("HTTPValidationError", "ValidationError"):
        components.get("schemas", {}).pop(name, None)
    if api_key_required:
        components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    return schema
