"""The client of one streamed completion: server-sent events parsed from the response's bytes as
they arrive (constant work per event), and the request's timing (TTFT, the gaps between token
chunks, e2e) from its events. The HTTP library is httpx2 or httpx, imported when a request is
sent."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

from compiled_llm.errors import CompiledLLMError


class SSEDecoder:
    """Server-sent events from the bytes of a response as they arrive: ``feed`` returns the
    ``data`` of each event completed by the new bytes. Work is proportional to the new bytes
    only (the buffer holds at most one partial line)."""

    __slots__ = ("_partial", "_data")

    def __init__(self):
        self._partial = b""
        self._data: list[bytes] = []

    def feed(self, piece: bytes) -> list[bytes]:
        buf = self._partial + piece if self._partial else piece
        events = []
        start = 0
        while (end := buf.find(b"\n", start)) >= 0:
            line = buf[start:end]
            start = end + 1
            if line.endswith(b"\r"):
                line = line[:-1]
            if not line:  # a blank line ends an event
                if self._data:
                    events.append(self._data[0] if len(self._data) == 1 else b"\n".join(self._data))
                    self._data = []
            elif line.startswith(b"data:"):
                self._data.append(line[6:] if line.startswith(b"data: ") else line[5:])
            # comments (":...") and the event/id/retry fields carry nothing the benchmark reads
        self._partial = buf[start:]
        return events


@dataclass
class RequestRecord:
    """One request as the client saw it; times in seconds."""

    ok: bool
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    e2e: float = 0.0
    finish_reason: str | None = None
    chunks: int = 0  # SSE events read
    error: str = ""


class StreamTimer:
    """Reads one streamed completion's events and times its token chunks.

    A chunk's tokens: the growth of ``usage.completion_tokens`` when the server sends usage with
    every chunk; otherwise one per chunk carrying a choice, except a chunk with no text that only
    closes the stream (finish_reason set). The final usage, when sent, is the output count."""

    __slots__ = ("sent", "last", "ttft", "itl", "tokens", "usage_tokens", "prompt_tokens", "finish_reason",
                 "done", "error", "chunks")

    def __init__(self, sent: float):
        self.sent = sent
        self.last = 0.0
        self.ttft = 0.0
        self.itl: list[float] = []
        self.tokens = 0
        self.usage_tokens: int | None = None
        self.prompt_tokens: int | None = None
        self.finish_reason: str | None = None
        self.done = False
        self.error = ""
        self.chunks = 0

    def on_event(self, data: bytes, now: float) -> None:
        self.chunks += 1
        if data == b"[DONE]":
            self.done = True
            return
        try:
            chunk = json.loads(data)
        except ValueError:
            self.error = f"an event that is not JSON: {data[:80]!r}"
            return
        if "error" in chunk:
            error = chunk["error"]
            self.error = str(error.get("message", error) if isinstance(error, dict) else error)
            return
        usage = chunk.get("usage")
        choices = chunk.get("choices")
        new = 0
        if choices:
            choice = choices[0]
            if usage and usage.get("completion_tokens") is not None:
                new = usage["completion_tokens"] - self.tokens
            elif choice.get("text") or choice.get("finish_reason") is None:
                new = 1
            if choice.get("finish_reason") is not None:
                self.finish_reason = choice["finish_reason"]
        if usage:
            self.usage_tokens = usage.get("completion_tokens", self.usage_tokens)
            self.prompt_tokens = usage.get("prompt_tokens", self.prompt_tokens)
        if new > 0:
            if self.tokens == 0:
                self.ttft = now - self.sent
            else:
                self.itl.append(now - self.last)
            self.tokens += new
            self.last = now

    def record(self, now: float, prompt_len: int) -> RequestRecord:
        output = self.usage_tokens if self.usage_tokens is not None else self.tokens
        error = self.error
        if not error and self.finish_reason is None:
            error = "the stream ended without a finish_reason"
        if not error and output < 1:
            error = "no tokens"
        return RequestRecord(
            ok=not error, prompt_tokens=self.prompt_tokens if self.prompt_tokens is not None else prompt_len,
            output_tokens=output, ttft=self.ttft, itl=self.itl, e2e=now - self.sent,
            finish_reason=self.finish_reason, chunks=self.chunks, error=error)


def error_message(status: int, body: bytes) -> str:
    """A failed response in one line: its status and the OpenAI error JSON's message."""
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = body[:200].decode(errors="replace")
    return f"HTTP {status}: {message}"


async def stream_one(client, url: str, body: bytes, prompt_len: int, send_at: float, start: float,
                     headers: dict) -> RequestRecord:
    """Send one streamed request at ``start + send_at`` (perf_counter seconds) and time it."""
    http = http_module()

    delay = start + send_at - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)
    sent = time.perf_counter()
    timer = StreamTimer(sent)
    try:
        async with client.stream("POST", url, content=body, headers=headers) as response:
            if response.status_code != 200:
                return RequestRecord(ok=False, e2e=time.perf_counter() - sent,
                                     error=error_message(response.status_code, await response.aread()))
            decoder = SSEDecoder()
            async for piece in response.aiter_raw():
                now = time.perf_counter()
                for data in decoder.feed(piece):
                    timer.on_event(data, now)
    except http.HTTPError as e:
        return RequestRecord(ok=False, e2e=time.perf_counter() - sent, error=f"{type(e).__name__}: {e}")
    return timer.record(time.perf_counter(), prompt_len)


def http_module():
    """The HTTP client library: httpx2 (what openai 3.x installs) or httpx, which share an API."""
    try:
        import httpx2 as http
    except ImportError:
        try:
            import httpx as http
        except ImportError:
            raise CompiledLLMError("the serving workload's client needs httpx: pip install httpx") from None
    return http
