"""``asgi_forward``, without Ray: a request carried as a dict runs through an ASGI app in-process
and comes back as ``(status, headers)`` then its body's chunks, as sent (a stream stays a
stream); closing the response early is the client's disconnect; a generation request's prompt
is read for routing."""

from __future__ import annotations

import asyncio
import json

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from compiled_llm.serve.ray_serve.asgi_forward import call_app, forwarded_request, prompt_of


def make_app(seen: dict) -> FastAPI:
    app = FastAPI()

    @app.post("/echo")
    async def echo(request: Request):
        body = await request.json()
        return JSONResponse({"body": body, "query": request.url.query, "key": request.headers.get("x-key")},
                            status_code=201)

    @app.get("/stream")
    async def stream(request: Request):
        async def chunks():
            try:
                for i in range(1000):
                    if await request.is_disconnected():
                        seen["disconnected"] = True
                        return
                    yield f"data: {i}\n\n"
                    await asyncio.sleep(0.01)
            finally:
                seen["ended"] = True

        return StreamingResponse(chunks(), media_type="text/event-stream")

    @app.get("/broken")
    async def broken():
        raise RuntimeError("boom")

    return app


async def collect(app, request: dict, limit: int | None = None) -> list:
    items = []
    stream = call_app(app, request)
    async for item in stream:
        items.append(item)
        if limit is not None and len(items) == limit:
            break
    await stream.aclose()
    return items


def test_a_forwarded_request_runs_through_the_app_with_its_body_query_and_headers():
    body = json.dumps({"prompt": [1, 2, 3]}).encode()
    request = forwarded_request("POST", "/echo", "a=1", [("X-Key", "k"), ("content-type", "application/json")], body)
    (status, headers), *chunks = asyncio.run(collect(make_app({}), request))
    assert status == 201 and ("content-type", "application/json") in headers
    assert json.loads(b"".join(chunks)) == {"body": {"prompt": [1, 2, 3]}, "query": "a=1", "key": "k"}


def test_a_stream_comes_back_chunk_by_chunk_and_closing_it_is_the_clients_disconnect():
    seen: dict = {}

    async def run():
        items = await collect(make_app(seen), forwarded_request("GET", "/stream", "", [], b""), limit=4)
        await asyncio.sleep(0.1)
        return items

    (status, _), *chunks = asyncio.run(run())
    assert status == 200 and chunks == [b"data: 0\n\n", b"data: 1\n\n", b"data: 2\n\n"]
    assert seen.get("ended")  # the app stopped producing: it was told, or cancelled


def test_an_app_error_answers_as_the_app_answers_it():
    (status, _), *chunks = asyncio.run(collect(make_app({}), forwarded_request("GET", "/broken", "", [], b"")))
    assert status == 500


@pytest.mark.parametrize("path, body, prompt", [
    ("/v1/completions", {"prompt": "hello"}, "hello"),
    ("/v1/completions", {"prompt": [1, 2, 3]}, [1, 2, 3]),
    ("/v1/completions", {"prompt": [[4, 5], [6]]}, [4, 5]),  # a batch: its first
    ("/v1/completions", {"prompt": ["a", "b"]}, "a"),
    ("/v1/chat/completions", {"messages": [{"role": "system", "content": "be brief"},
                                           {"role": "user", "content": [{"type": "text", "text": "hi"}]}]},
     "system:be brief\nuser:hi\n"),
    ("/v1/models", {}, None),
    ("/v1/completions", {"prompt": [1, "x"]}, None),
])
def test_the_routing_prompt_of_a_request(path, body, prompt):
    assert prompt_of(path, json.dumps(body).encode()) == prompt


def test_a_body_that_is_not_json_has_no_routing_prompt():
    assert prompt_of("/v1/completions", b"{not json") is None
    assert prompt_of("/v1/completions", b"\xff") is None
