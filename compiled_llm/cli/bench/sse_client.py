"""The client of one streamed completion: an HTTP/1.1 request on its own connection, its response
read by an asyncio protocol as the bytes arrive (the chunked transfer coding, then server-sent
events, each constant work per byte), and the request's timing (TTFT, the gaps between token
chunks, e2e) from its events.

Why not an HTTP library: a GPU server streams tens of thousands of chunks a second, one event per
read, and the client must read them as they come or its own delays become the server's TTFT and
ITL. Through httpx one process read 6k single-event chunks per CPU second on an H200's host;
through this protocol, called straight from the event loop with no stream or task between,
20-23k. ``http_module`` (httpx2 or httpx) still serves the bench's few plain requests (/health,
/metrics)."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

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
        if not isinstance(chunk, dict):
            self.error = f"an event that is not a JSON object: {data[:80]!r}"
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


class ChunkedDecoder:
    """The body of a response in HTTP/1.1's chunked transfer coding, from its bytes as they
    arrive: ``feed`` returns the body bytes the new bytes complete, ``done`` once the last
    (zero-size) chunk has been read. A chunk's data is passed on as it arrives, not when the
    chunk is whole; the buffer holds at most a partial size line."""

    __slots__ = ("_partial", "_left", "done")

    def __init__(self):
        self._partial = b""
        self._left = 0  # > 0: data bytes left in this chunk; < 0: bytes of its closing CRLF left
        self.done = False

    def feed(self, piece: bytes) -> bytes:
        buf = self._partial + piece if self._partial else piece
        out = []
        i, n = 0, len(buf)
        while i < n and not self.done:
            if self._left > 0:
                take = min(self._left, n - i)
                out.append(buf[i:i + take])
                i += take
                self._left -= take
                if self._left == 0:
                    self._left = -2
            elif self._left < 0:  # the CRLF that closes a chunk's data
                if buf[i:i + 1] != b"\r\n"[2 + self._left:3 + self._left]:
                    raise CompiledLLMError(f"a chunk's data is not followed by CRLF: {buf[i:i + 8]!r}")
                i += 1
                self._left += 1
            else:
                end = buf.find(b"\r\n", i)
                if end < 0:
                    break
                # a size in hex, maybe with extensions (";name=value"), which carry nothing here
                digits = buf[i:end].split(b";", 1)[0].strip()
                if not digits or digits.strip(b"0123456789abcdefABCDEF"):
                    raise CompiledLLMError(f"a malformed chunk size in the response: {buf[i:end][:40]!r}")
                size = int(digits, 16)
                i = end + 2
                if size == 0:  # trailers, if any, carry nothing the benchmark reads
                    self.done = True
                else:
                    self._left = size
        self._partial = buf[i:] if not self.done else b""
        return out[0] if len(out) == 1 else b"".join(out)


def http_request(method: str, url: str, body: bytes = b"", headers: dict | None = None) -> tuple[str, int, bytes]:
    """(host, port, the request's bytes) for ``url`` (http only: the bench talks to a server it
    started, or one on the local network)."""
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise CompiledLLMError(f"the serving workload's client speaks plain http only, not {url!r}")
    host, port = parts.hostname, parts.port or 80
    target = parts.path or "/"
    if parts.query:
        target += "?" + parts.query
    lines = [f"{method} {target} HTTP/1.1", f"Host: {parts.netloc}", f"Content-Length: {len(body)}",
             "Connection: close", *(f"{k}: {v}" for k, v in (headers or {}).items())]
    return host, port, ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


class _ResponseProtocol(asyncio.Protocol):
    """Reads one response: its status and headers, then its body (chunked, Content-Length or to
    the connection's end); a 200's body goes to ``on_body(bytes, arrival time)``, any other
    status's is kept for the error. ``done`` is set when the body has ended or the connection is
    lost."""

    def __init__(self, request: bytes, on_body, done: asyncio.Future):
        self._request = request
        self._on_body = on_body
        self.done = done
        self.transport = None
        self._head = b""
        self.status: int | None = None
        self._chunked: ChunkedDecoder | None = None
        self._length: int | None = None  # Content-Length bytes left, without chunking
        self.error_body = b""
        self.complete = False  # the body ended as its framing says (not by a lost connection)
        self.last_read = time.perf_counter()

    def connection_made(self, transport) -> None:
        self.transport = transport
        transport.write(self._request)

    def data_received(self, data: bytes) -> None:
        try:
            self._read(data)
        except Exception as e:  # a body the client cannot read: the request fails with why
            self.complete = False
            self._finish(e if isinstance(e, CompiledLLMError)
                         else CompiledLLMError(f"an unreadable response: {type(e).__name__}: {e}"))

    def _read(self, data: bytes) -> None:
        now = self.last_read = time.perf_counter()
        if self.status is None:
            self._head += data
            end = self._head.find(b"\r\n\r\n")
            if end < 0:
                return
            head, data = self._head[:end], self._head[end + 4:]
            self._head = b""
            status_line, _, fields = head.partition(b"\r\n")
            try:
                self.status = int(status_line.split(b" ", 2)[1])
            except (IndexError, ValueError):
                self._finish(CompiledLLMError(f"not an HTTP response: {status_line[:60]!r}"))
                return
            for field_line in fields.split(b"\r\n"):
                name, _, value = field_line.partition(b":")
                name = name.strip().lower()
                if name == b"transfer-encoding" and b"chunked" in value.lower():
                    self._chunked = ChunkedDecoder()
                elif name == b"content-length":
                    try:
                        self._length = int(value.strip())
                    except ValueError:
                        raise CompiledLLMError(f"a malformed Content-Length: {value[:40]!r}") from None
        if self._chunked is not None:
            data = self._chunked.feed(data)
            self.complete = self._chunked.done
        elif self._length is not None:
            data = data[:self._length]
            self._length -= len(data)
            self.complete = self._length == 0
        if data:
            if self.status == 200:
                self._on_body(data, now)
            else:
                self.error_body += data
        if self.complete:
            self._finish(None)

    def connection_lost(self, exc) -> None:
        if self.status is not None and self._chunked is None and self._length is None:
            self.complete = exc is None  # a body that runs to the connection's end
        self._finish(exc)

    def _finish(self, exc) -> None:
        if not self.done.done():
            self.done.set_result(exc)
        if self.transport is not None:  # abort: what is left of the request need not be sent
            self.transport.abort()


async def fetch(url: str, body: bytes, headers: dict, on_body, connect_timeout: float = 60.0,
                read_timeout: float = 900.0) -> tuple[int, bytes]:
    """Send one request (POST with a body, else GET) on a connection of its own and read its
    response, passing a 200's body to ``on_body`` as it arrives; (status, the body of any other
    status). CompiledLLMError when the connection fails, the response breaks off, or nothing
    arrives for ``read_timeout`` seconds."""
    loop = asyncio.get_running_loop()
    host, port, request = http_request("POST" if body else "GET", url, body, headers)
    done = loop.create_future()
    try:
        transport, protocol = await asyncio.wait_for(
            loop.create_connection(lambda: _ResponseProtocol(request, on_body, done), host, port), connect_timeout)
    except (OSError, asyncio.TimeoutError) as e:
        raise CompiledLLMError(f"cannot connect to {host}:{port}: {type(e).__name__}: {e}") from None
    try:
        while not done.done():
            idle = time.perf_counter() - protocol.last_read
            if idle >= read_timeout:
                raise CompiledLLMError(f"nothing from the server for {read_timeout:g} s")
            await asyncio.wait([done], timeout=read_timeout - idle)
    finally:
        transport.abort()
    exc = done.result()
    if isinstance(exc, CompiledLLMError):
        raise exc
    if protocol.status is None or not protocol.complete:
        reason = f": {type(exc).__name__}: {exc}" if exc is not None else ""
        raise CompiledLLMError(f"the server closed the connection before the response's end{reason}")
    return protocol.status, protocol.error_body


async def stream_one(url: str, body: bytes, prompt_len: int, send_at: float, start: float,
                     headers: dict) -> RequestRecord:
    """Send one streamed request at ``start + send_at`` (perf_counter seconds) and time it."""
    delay = start + send_at - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)
    sent = time.perf_counter()
    timer = StreamTimer(sent)
    decoder = SSEDecoder()

    def on_body(piece: bytes, now: float) -> None:
        for data in decoder.feed(piece):
            timer.on_event(data, now)

    try:
        status, error_body = await fetch(url, body, headers, on_body)
    except CompiledLLMError as e:
        return RequestRecord(ok=False, e2e=time.perf_counter() - sent, error=str(e))
    if status != 200:
        return RequestRecord(ok=False, e2e=time.perf_counter() - sent, error=error_message(status, error_body))
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
