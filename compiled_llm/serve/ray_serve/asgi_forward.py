"""An HTTP request carried to another process as a plain dict, and run there through an ASGI app
(the OpenAI server's FastAPI app, ``serve.openai.api_server.build_app``) in-process, its response
coming back as a stream: first ``(status, headers)``, then the body's chunks as they are sent.

What lets a Ray Serve replica answer every OpenAI route by the server's own code: the ingress
forwards requests unread but for their prompt (``forwarded_request``), the replica replays them
(``call_app``). No Ray here.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any, AsyncIterator


def forwarded_request(method: str, path: str, query: str, headers: list[tuple[str, str]], body: bytes,
                      routing_prompt: Any = None) -> dict:
    return {"method": method, "path": path, "query": query, "headers": headers, "body": body,
            "routing_prompt": routing_prompt}


def prompt_of(path: str, body: bytes) -> Any:
    """What a generation request's prefix is, for routing: a completion's prompt (its first, of a
    batch), a chat's messages as text; None for any other request or a body that is not JSON."""
    if not path.endswith(("/completions", "/chat/completions")):
        return None
    try:
        payload = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(payload, dict):
        return None
    if "messages" in payload and isinstance(payload["messages"], list):
        parts = []
        for m in payload["messages"]:
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, list):  # content parts
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
            parts.append(f"{m.get('role', '') if isinstance(m, dict) else ''}:{content or ''}\n")
        return "".join(parts)
    prompt = payload.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (list, str)):
        prompt = prompt[0]
    if isinstance(prompt, str) or (isinstance(prompt, list) and all(isinstance(t, int) for t in prompt)):
        return prompt
    return None


async def call_app(app, request: dict) -> AsyncIterator[Any]:
    """Run ``request`` (``forwarded_request``) through the ASGI ``app``: yields ``(status,
    headers)``, then each body chunk. Closing the iterator early (the client went away) tells
    the app the client disconnected, as a closed connection would."""
    path = request["path"]
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": request["method"],
        "scheme": "http", "path": path, "raw_path": path.encode(), "root_path": "",
        "query_string": request["query"].encode(), "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 80),
        "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in request["headers"]],
    }
    body_sent = False
    disconnected = asyncio.Event()

    async def receive() -> dict:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": request["body"], "more_body": False}
        await disconnected.wait()
        return {"type": "http.disconnect"}

    messages: asyncio.Queue = asyncio.Queue()
    task = asyncio.ensure_future(app(scope, receive, messages.put))
    try:
        while True:
            if not messages.empty():
                message = messages.get_nowait()
            elif task.done():
                task.result()  # the app raised: let it propagate; else it returned without a body's end
                return
            else:
                get = asyncio.ensure_future(messages.get())
                await asyncio.wait({get, task}, return_when=asyncio.FIRST_COMPLETED)
                if not get.done():
                    get.cancel()
                    continue
                message = get.result()
            if message["type"] == "http.response.start":
                yield message["status"], [(k.decode("latin-1"), v.decode("latin-1")) for k, v in message.get("headers", [])]
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield message["body"]
                if not message.get("more_body", False):
                    return
    finally:
        disconnected.set()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
