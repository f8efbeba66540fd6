"""What every HTTP request passes through before its route: the proxy's root path, the request
id, then the API key.

All three are plain ASGI middleware: they cost a look-up or two per request and never wrap a
stream's body.

``ApiKeyMiddleware`` refuses a request without ``Authorization: Bearer KEY`` with 401 before
the route reads a byte of its body (a keyless caller learns nothing about what the body
should be). Every route needs the key except ``OPEN_PATHS``: the probes a load balancer and a
Prometheus scraper call (``/health``, ``/metrics``), ``/version``, and the description of the
API itself (``/openapi.json`` and its pages), as in vLLM, whose key guards only ``/v1``; here
``/tokenize``, ``/detokenize`` and ``/tokenizer_info`` need it too (they run the tokenizer, and
the last shows the chat template).

``RootPathMiddleware`` tells the app the path prefix a reverse proxy serves it under
(``--root-path``, which vLLM gives FastAPI as its ``root_path``): a request is routed whether
the proxy stripped the prefix or kept it, and ``/openapi.json`` names the prefix as its server.

``RequestIdMiddleware`` gives a request the id in its ``X-Request-Id`` header (or, with
``--enable-request-id-headers``, a new one when it has none or one with control characters)
and sends the id back in the response's ``X-Request-Id``. The completions endpoints name their
responses after it (``cmpl-ID``, ``chatcmpl-ID``), as vLLM does.
"""

from __future__ import annotations

import hmac
import json
import re
import uuid

OPEN_PATHS = frozenset({"/health", "/metrics", "/version", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"})

REQUEST_ID_HEADER = b"x-request-id"
# what no HTTP server may send in a header value (uvicorn's httptools server refuses to)
_CONTROL = re.compile(b"[\x00-\x08\x0a-\x1f\x7f]")


def route_path(scope) -> str:
    """The path the app routes, without a proxy's ``--root-path`` prefix if the request kept it."""
    path, root = scope.get("path", ""), scope.get("root_path", "")
    if root and (path == root or path.startswith(root + "/")):
        path = path[len(root):]
    return path.rstrip("/") or "/"


def header(scope, name: bytes) -> bytes | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value
    return None


def key_matches(authorization: bytes | None, key: bytes) -> bool:
    """Whether an Authorization header carries ``Bearer KEY`` (compared in constant time)."""
    if authorization is None:
        return False
    scheme, _, token = authorization.partition(b" ")
    return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), key)


async def send_error(send, status: int, message: str, type: str, code: str | None = None,
                     headers: list[tuple[bytes, bytes]] = ()) -> None:
    """OpenAI's error JSON, sent straight to the ASGI server."""
    body = json.dumps({"error": {"message": message, "type": type, "param": None, "code": code}}).encode()
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *headers]})
    await send({"type": "http.response.body", "body": body})


class RootPathMiddleware:
    def __init__(self, app, root_path: str):
        self.app = app
        self.root_path = root_path

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            scope["root_path"] = self.root_path
        await self.app(scope, receive, send)


class ApiKeyMiddleware:
    def __init__(self, app, api_key: str):
        self.app = app
        self.key = api_key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and route_path(scope) not in OPEN_PATHS \
                and not key_matches(header(scope, b"authorization"), self.key):
            await send_error(send, 401, "invalid or missing API key: send 'Authorization: Bearer <key>'",
                             "AuthenticationError", code="invalid_api_key",
                             headers=[(b"www-authenticate", b"Bearer")])
            return
        await self.app(scope, receive, send)


class RequestIdMiddleware:
    def __init__(self, app, always: bool = False):
        self.app = app
        self.always = always  # a new id for requests that bring none

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = header(scope, REQUEST_ID_HEADER) or None
        if given is not None and _CONTROL.search(given):
            given = None  # not one that can be sent back
        if given is None and not self.always:
            await self.app(scope, receive, send)
            return
        value = given if given is not None else uuid.uuid4().hex.encode()
        scope.setdefault("state", {})["request_id"] = value.decode("latin-1")

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), (b"x-request-id", value)]}
            await send(message)

        await self.app(scope, receive, send_with_id)


def request_id(request) -> str | None:
    """The id ``RequestIdMiddleware`` gave ``request`` (a Starlette request), if any."""
    return request.scope.get("state", {}).get("request_id")
