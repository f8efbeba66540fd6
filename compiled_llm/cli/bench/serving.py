"""The serving workload: ``compiled-llm serve`` under the throughput workload's requests, timed by
a client in another process, in the style of vLLM's serving benchmark.

One run:

1. offline reference: ``LLM.generate`` on the same requests in this process
   (``workloads.compiled_throughput``); the LLM is then freed, since on a GPU the server must not
   find a second KV cache beside its own;
2. the server: ``compiled-llm serve ENGINE`` as a subprocess on a free 127.0.0.1 port, with the
   bench's engine options, warmed up with the workload's prompt lengths and every decode batch
   size up to the number of requests;
3. for each request rate: every request sent to ``/v1/completions`` with ``stream: true`` (token-id
   prompts, temperature 0.6, ``ignore_eos``), at a Poisson rate (exponential gaps from a seeded
   RNG) or all at once (``inf``). Each run's prompts are shifted by one token id from the
   previous run's, so the prefix cache cannot serve a run from an earlier one.

Per request: TTFT, from sending to the first chunk carrying a token; ITL, the gaps between token
chunks (per chunk, as vLLM counts it: a chunk may carry several tokens, as a server merges the
steps a slow reader missed); TPOT, (e2e - TTFT) / (output tokens - 1); e2e. Output tokens are the
server's ``usage`` count (``stream_options.include_usage``).

The client is asyncio + httpx (or httpx2) with its own SSE parsing, constant work per event. A GPU server
streams tens of thousands of chunks a second, more than one Python process reads, so the client
can run in several processes (``client_processes``) whose records are merged; each run reports
the chunks the client handled per CPU second, and warns when a client process was saturated.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from compiled_llm.cli.bench.workloads import Result
from compiled_llm.errors import CompiledLLMError, InvalidOptionError
from compiled_llm.serve.server_config import API_KEY_VAR

logger = logging.getLogger("compiled_llm.cli.bench.serving")

TEMPERATURE = 0.6  # the throughput workload's
SERVER_START_TIMEOUT_S = 900.0  # a GPU engine loads and warms its kernels before /health answers
SERVER_STOP_TIMEOUT_S = 60.0
# a client process busier than this may have delayed its timestamps
CLIENT_SATURATED_CPU_FRACTION = 0.9


@dataclass(frozen=True)
class ServingOptions:
    """What one ``bench --workload serving`` run sends."""

    request_rates: tuple[float, ...] = (math.inf,)
    num_requests: int = 256
    max_input_len: int = 1024
    max_output_len: int = 1024
    served_model_name: str | None = None
    client_processes: int = 1
    seed: int = 0

    def __post_init__(self):
        if not self.request_rates or any(not r > 0 for r in self.request_rates):
            raise InvalidOptionError(f"request rates must be > 0 (inf: all at once), got {list(self.request_rates)}")
        if self.num_requests < 1:
            raise InvalidOptionError(f"num_requests must be >= 1, got {self.num_requests}")
        # the throughput workload draws lengths uniform in 100..max
        if self.max_input_len < 100 or self.max_output_len < 100:
            raise InvalidOptionError(
                f"max_input_len and max_output_len must be >= 100 (lengths are drawn in 100..max), "
                f"got {self.max_input_len} and {self.max_output_len}")
        if self.client_processes < 1:
            raise InvalidOptionError(f"client_processes must be >= 1, got {self.client_processes}")


def parse_rate(text: str) -> float:
    """A request rate in requests/s: a positive number, or ``inf`` (all at once)."""
    try:
        rate = float(text)
    except ValueError:
        raise InvalidOptionError(f"request rate must be a number or inf, got {text!r}") from None
    if not rate > 0:
        raise InvalidOptionError(f"request rate must be > 0, got {text!r}")
    return rate


def default_client_processes(device_type: str) -> int:
    """One client process on a CPU (the server is slow and the cores are few). On a GPU, enough
    to read a fast server's stream without a saturated reader delaying its own timestamps: one
    process reads about 13k single-event chunks per second (50k when reads carry several), and
    a GPU server streams up to ~45k; half the cores, up to 8, leaving the rest to the server."""
    if device_type == "cpu":
        return 1
    return max(1, min(8, (os.cpu_count() or 1) // 2))


# ---------------------------------------------------------------------------------------------
# Workload
# ---------------------------------------------------------------------------------------------


def send_times(num_requests: int, rate: float, seed: int = 0) -> list[float]:
    """Seconds from the run's start at which each request is sent: a Poisson process of
    ``rate`` requests/s (exponential gaps, the first request at 0), or all at 0 for ``inf``."""
    if math.isinf(rate):
        return [0.0] * num_requests
    rng = random.Random(seed)
    times, t = [], 0.0
    for _ in range(num_requests):
        times.append(t)
        t += rng.expovariate(rate)
    return times


def shifted(prompts: Sequence[Sequence[int]], shift: int, vocab: int) -> list[list[int]]:
    """The prompts with every id moved by ``shift`` (mod ``vocab``): the same lengths, but prompts
    the prefix cache has not seen."""
    return [[(t + shift) % vocab for t in p] for p in prompts]


def completion_body(model: str, prompt: Sequence[int], max_tokens: int) -> bytes:
    """The JSON body of one streamed /v1/completions request of the workload."""
    return json.dumps({
        "model": model, "prompt": list(prompt), "max_tokens": max_tokens, "temperature": TEMPERATURE,
        "ignore_eos": True, "stream": True,
        # continuous_usage_stats (vLLM's): a usage count in every chunk, so a chunk's tokens are
        # counted even when its text is empty (an incomplete UTF-8 sequence)
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }).encode()


# ---------------------------------------------------------------------------------------------
# Client: SSE parsing and per-request timing
# ---------------------------------------------------------------------------------------------


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
    http = _http_module()

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


@dataclass(frozen=True)
class ClientLoad:
    """The part of a run one client process sends."""

    base_url: str
    bodies: tuple[bytes, ...]
    prompt_lens: tuple[int, ...]
    send_at: tuple[float, ...]
    api_key: str | None = None


@dataclass
class ClientReport:
    records: list[RequestRecord]
    cpu_s: float  # this process's CPU time during the run
    wall_s: float
    start_time: float  # time.time() when it began sending
    end_time: float  # time.time() when its last request ended


async def _run_load(load: ClientLoad, start_time: float) -> ClientReport:
    http = _http_module()

    n = len(load.bodies)
    headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
    if load.api_key:
        headers["Authorization"] = f"Bearer {load.api_key}"
    limits = http.Limits(max_connections=n, max_keepalive_connections=n)
    # read: the longest wait for a queued request's first bytes
    timeout = http.Timeout(connect=60.0, read=900.0, write=60.0, pool=None)
    async with http.AsyncClient(limits=limits, timeout=timeout, trust_env=False) as client:
        url = load.base_url + "/v1/completions"
        delay = start_time - time.time()
        if delay > 0:
            await asyncio.sleep(delay)
        began, cpu0, t0 = time.time(), time.process_time(), time.perf_counter()
        records = await asyncio.gather(*(
            stream_one(client, url, body, plen, at, t0, headers)
            for body, plen, at in zip(load.bodies, load.prompt_lens, load.send_at)))
        return ClientReport(list(records), time.process_time() - cpu0, time.perf_counter() - t0, began, time.time())


def run_load(load: ClientLoad, start_time: float) -> ClientReport:
    """Send ``load`` in this process, starting at wall time ``start_time``."""
    return asyncio.run(_run_load(load, start_time))


def warm_up_client(base_url: str) -> None:
    """One request (GET /health) through the HTTP client in this process. A process's first
    request pays for the client library's lazy set-up (tens of ms), which must not land in the
    first timed request's TTFT."""
    http = _http_module()

    async def get():
        async with http.AsyncClient(trust_env=False) as client:
            await client.get(base_url + "/health")

    try:
        asyncio.run(get())
    except http.HTTPError:
        pass  # a server that does not answer fails the run itself, with its own message


def _client_process(conn) -> None:
    """A spawned client process: receives its load, warms up its HTTP client, says it is ready,
    waits for the start time, sends the load and returns its report through the pipe."""
    load = conn.recv()
    warm_up_client(load.base_url)  # before "ready": the start must not wait for it
    conn.send("ready")
    start_time = conn.recv()
    try:
        conn.send(run_load(load, start_time))
    except Exception as e:  # the parent names it; a traceback from a child helps nobody
        conn.send(CompiledLLMError(f"a client process failed: {type(e).__name__}: {e}"))
    conn.close()


def run_clients(loads: Sequence[ClientLoad]) -> list[ClientReport]:
    """Each load from its own process (this one for a single load), all starting together."""
    if len(loads) == 1:
        warm_up_client(loads[0].base_url)
        return [run_load(loads[0], time.time())]
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")  # this process may hold CUDA and threads: no fork
    pipes, procs = [], []
    try:
        for load in loads:
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_client_process, args=(child,), daemon=True)
            proc.start()
            child.close()
            parent.send(load)
            pipes.append(parent)
            procs.append(proc)
        for parent in pipes:
            if parent.recv() != "ready":
                raise CompiledLLMError("a client process failed to start")
        start_time = time.time() + 0.05
        for parent in pipes:
            parent.send(start_time)
        reports = [parent.recv() for parent in pipes]
        for report in reports:
            if isinstance(report, Exception):
                raise report
        return reports
    except (EOFError, OSError):
        raise CompiledLLMError("a client process died during the serving benchmark") from None
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()


def split_load(base_url: str, bodies: Sequence[bytes], prompt_lens: Sequence[int], send_at: Sequence[float],
               processes: int, api_key: str | None = None) -> list[ClientLoad]:
    """Requests dealt round-robin to ``processes`` loads: each keeps its requests' send times, so
    together they follow the run's schedule."""
    processes = min(processes, len(bodies))
    return [ClientLoad(base_url, tuple(bodies[i::processes]), tuple(prompt_lens[i::processes]),
                       tuple(send_at[i::processes]), api_key) for i in range(processes)]


# ---------------------------------------------------------------------------------------------
# Statistics
# ---------------------------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between the closest ranks (numpy's
    default), of a non-empty sequence."""
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def summarize(records: Sequence[RequestRecord], duration_s: float) -> dict[str, float]:
    """vLLM's serving-benchmark figures over the completed requests; latencies in ms."""
    ok = [r for r in records if r.ok]
    output = sum(r.output_tokens for r in ok)
    prompt = sum(r.prompt_tokens for r in ok)
    metrics = {
        "completed": float(len(ok)), "failed": float(len(records) - len(ok)),
        "output_tokens": float(output), "duration_s": duration_s,
        "request_s": len(ok) / duration_s, "output_tok_s": output / duration_s,
        "total_tok_s": (prompt + output) / duration_s,
    }
    series = {
        "ttft_ms": [1e3 * r.ttft for r in ok],
        "tpot_ms": [1e3 * (r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1],
        "itl_ms": [1e3 * gap for r in ok for gap in r.itl],
        "e2e_ms": [1e3 * r.e2e for r in ok],
    }
    for name, values in series.items():
        if values:
            metrics[f"{name}_mean"] = sum(values) / len(values)
            metrics[f"{name}_p50"] = percentile(values, 50)
            metrics[f"{name}_p99"] = percentile(values, 99)
    return metrics


# ---------------------------------------------------------------------------------------------
# The server process
# ---------------------------------------------------------------------------------------------


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now (the OS's choice)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def option_flags(options: dict) -> list[str]:
    """Command-line flags of keyword options (``engine_args`` spelling): ``--name value``,
    ``--name`` / ``--no-name`` for booleans; None (unset) left out."""
    flags = []
    for name, value in options.items():
        dashed = name.replace("_", "-")
        if value is None:
            continue
        if isinstance(value, bool):
            flags.append(f"--{dashed}" if value else f"--no-{dashed}")
        else:
            flags += [f"--{dashed}", str(value)]
    return flags


@dataclass
class Server:
    """A running ``compiled-llm serve`` subprocess."""

    process: subprocess.Popen
    base_url: str
    log_path: Path

    @property
    def pid(self) -> int:
        return self.process.pid

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def _wait_healthy(server: Server, timeout_s: float) -> None:
    http = _http_module()

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise CompiledLLMError(f"compiled-llm serve exited with code {server.process.returncode} before "
                                   f"/health answered; its log ends:\n{server.log_tail()}")
        try:
            if http.get(server.base_url + "/health", timeout=2.0, trust_env=False).status_code == 200:
                return
        except http.HTTPError:
            pass
        time.sleep(0.2)
    raise CompiledLLMError(f"compiled-llm serve did not answer /health within {timeout_s:.0f} s; its log ends:\n"
                           f"{server.log_tail()}")


def stop_server(server: Server, timeout_s: float = SERVER_STOP_TIMEOUT_S) -> int | None:
    """SIGTERM (the server drains and exits), then SIGKILL if it has not exited in time; its
    exit code."""
    if server.process.poll() is None:
        server.process.send_signal(signal.SIGTERM)
        try:
            server.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            logger.warning("compiled-llm serve did not exit %.0f s after SIGTERM; killing it", timeout_s)
            server.process.kill()
            server.process.wait()
    return server.process.returncode


@contextlib.contextmanager
def launched_server(engine: str, args: Sequence[str] = (), start_timeout_s: float = SERVER_START_TIMEOUT_S,
                    env: dict | None = None) -> Iterator[Server]:
    """``compiled-llm serve ENGINE --host 127.0.0.1 --port P *args`` on a free port, ready (its
    /health answers) when this yields; stopped with SIGTERM on exit. Its output goes to a log
    file, whose tail is in the error when it fails to start. The default environment is this
    process's without $COMPILED_LLM_API_KEY: the server wants a key only if ``args`` give one."""
    port = free_port()
    log_dir = Path(tempfile.mkdtemp(prefix="compiled_llm_serve_"))
    log_path = log_dir / "server.log"
    cmd = [sys.executable, "-m", "compiled_llm.cli.main", "serve", str(engine), "--host", "127.0.0.1",
           "--port", str(port), *args]
    logger.info("starting %s", " ".join(cmd))
    with open(log_path, "wb") as log:
        process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   env=env if env is not None else {k: v for k, v in os.environ.items() if k != API_KEY_VAR})
    server = Server(process, f"http://127.0.0.1:{port}", log_path)
    try:
        _wait_healthy(server, start_timeout_s)
        yield server
    finally:
        code = stop_server(server)
        if code not in (0, None):
            logger.warning("compiled-llm serve exited with code %s; its log ends:\n%s", code, server.log_tail())
        else:
            with contextlib.suppress(OSError):
                log_path.unlink()
                log_dir.rmdir()


def served_model(base_url: str, api_key: str | None = None) -> str:
    """The first model id /v1/models lists."""
    http = _http_module()

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    response = http.get(base_url + "/v1/models", headers=headers, timeout=30.0, trust_env=False)
    if response.status_code != 200:
        raise CompiledLLMError(f"GET /v1/models failed: {error_message(response.status_code, response.content)}")
    return response.json()["data"][0]["id"]


# ---------------------------------------------------------------------------------------------
# The workload
# ---------------------------------------------------------------------------------------------


def offline_reference(engine: str, device, engine_options: dict, options: ServingOptions) -> Result:
    """``LLM.generate`` on the workload in this process (the throughput workload's measurement),
    then the LLM freed, CUDA's cached blocks included."""
    import gc

    import torch

    from compiled_llm.cli.bench import workloads as wl
    from compiled_llm.serve.llm import LLM

    llm = LLM(engine, device=device, **engine_options)
    try:
        result = wl.compiled_throughput(llm, options.num_requests, options.max_input_len, options.max_output_len)
        dtype = str(llm.model.dtype).removeprefix("torch.")
        vocab_size = llm.model.config.vocab_size
    finally:
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return Result("serving", "offline LLM.generate", result.metrics, note=result.note,
                  extra={"dtype": dtype, "vocab_size": vocab_size})


def warm_up(base_url: str, model: str, prompts: Sequence[Sequence[int]], max_output_len: int,
            api_key: str | None = None) -> None:
    """Every prompt at once, the i-th with i + 1 new tokens, so that the decode batch shrinks one
    size at a time from all of them: the server runs the workload's prefill shapes and every
    decode batch size (capturing their CUDA graphs) before the timed runs."""
    n = len(prompts)
    max_tokens = [min(1 + i, max_output_len) for i in range(n)]
    bodies = [completion_body(model, p, m) for p, m in zip(prompts, max_tokens)]
    (report,) = run_clients([ClientLoad(base_url, tuple(bodies), tuple(len(p) for p in prompts),
                                        (0.0,) * n, api_key)])
    failed = [r.error for r in report.records if not r.ok]
    if failed:
        raise CompiledLLMError(f"{len(failed)} of {n} warm-up requests failed, the first with: {failed[0]}")


def serving_run(base_url: str, model: str, prompts: Sequence[Sequence[int]], max_tokens: Sequence[int],
                rate: float, options: ServingOptions, api_key: str | None = None) -> tuple[dict, dict]:
    """One timed run at ``rate``: (metrics, extra) with the client's load figures in extra."""
    bodies = [completion_body(model, p, m) for p, m in zip(prompts, max_tokens)]
    loads = split_load(base_url, bodies, [len(p) for p in prompts], send_times(len(prompts), rate, options.seed),
                       options.client_processes, api_key)
    reports = run_clients(loads)
    duration = max(r.end_time for r in reports) - min(r.start_time for r in reports)
    records = [rec for r in reports for rec in r.records]
    metrics = summarize(records, duration)
    errors = [r.error for r in records if not r.ok]
    if errors:
        logger.warning("%d of %d requests failed at rate %s, the first with: %s", len(errors), len(records), rate,
                       errors[0])
    chunks = sum(rec.chunks for rec in records)
    cpu = sum(r.cpu_s for r in reports)
    busiest = max(r.cpu_s / r.wall_s for r in reports if r.wall_s > 0) if reports else 0.0
    if busiest > CLIENT_SATURATED_CPU_FRACTION:
        logger.warning("a client process was busy %.0f%% of the run at rate %s: its timings may include its own "
                       "delays; use more --client-processes", 100 * busiest, rate)
    # the rate as text: --json must stay strict JSON, which has no inf
    extra = {"request_rate": rate_label(rate), "client_processes": len(reports), "client_chunks": chunks,
             "client_cpu_s": cpu, "client_chunks_per_cpu_s": chunks / cpu if cpu > 0 else 0.0,
             "client_busiest_cpu_fraction": busiest, "errors": errors[:5]}
    return metrics, extra


def rate_label(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def run_serving(engine: str, device, engine_options: dict, options: ServingOptions,
                start_timeout_s: float = SERVER_START_TIMEOUT_S) -> list[Result]:
    """The offline reference, then one server and a timed run per request rate (module docstring)."""
    from compiled_llm.cli.bench import workloads as wl

    offline = offline_reference(engine, device, engine_options, options)
    vocab = min(offline.extra["vocab_size"], 10_001)
    prompts, max_tokens = wl.throughput_requests(options.num_requests, options.max_input_len,
                                                 options.max_output_len, offline.extra["vocab_size"])
    rates = options.request_rates
    args = [*option_flags({"device": device.type, **engine_options}),
            # the whole workload may wait at once (rate inf): admission control must not refuse it
            "--max-waiting-requests", str(options.num_requests),
            "--max-waiting-prompt-tokens", str(sum(len(p) for p in prompts))]
    if options.served_model_name:
        args += ["--served-model-name", options.served_model_name]
    results = [offline]
    with launched_server(engine, args, start_timeout_s) as server:
        model = options.served_model_name or served_model(server.base_url)
        warm_up(server.base_url, model, shifted(prompts, len(rates), vocab), options.max_output_len)
        for k, rate in enumerate(rates):
            metrics, extra = serving_run(server.base_url, model, shifted(prompts, k, vocab), max_tokens, rate, options)
            metrics["vs_offline"] = metrics["output_tok_s"] / offline.metrics["output_tok_s"]
            results.append(Result("serving", f"compiled-llm serve, rate {rate_label(rate)}", metrics,
                                  note=f"{options.num_requests} requests, client {extra['client_processes']} "
                                       f"process(es), {extra['client_chunks_per_cpu_s']:,.0f} chunks per client "
                                       f"CPU s", extra=extra))
    return results


# ---------------------------------------------------------------------------------------------
# The table
# ---------------------------------------------------------------------------------------------

COUNTS = {"completed", "failed", "output_tokens"}


def _cell(metric: str, value: float | None) -> str:
    if value is None:
        return "-"
    if metric in COUNTS:
        return f"{value:,.0f}"
    if metric == "vs_offline":
        return f"{value:.2f}x"
    return f"{value:,.1f}" if abs(value) >= 10 else f"{value:,.2f}"


def format_table(results: Sequence[Result]) -> str:
    """One column per request rate, one row per figure; the offline reference below it."""
    runs = [r for r in results if r.workload == "serving" and r.system.startswith("compiled-llm serve")]
    offline = next((r for r in results if r.workload == "serving" and r.system.startswith("offline")), None)
    metrics: list[str] = []
    for r in runs:
        metrics += [m for m in r.metrics if m not in metrics]
    header = ("serving", *(f"rate={r.extra['request_rate']}" for r in runs))
    rows = [header] + [(m, *(_cell(m, r.metrics.get(m)) for r in runs)) for m in metrics]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = []
    for i, row in enumerate(rows):
        lines.append("  ".join(c.ljust(widths[j]) if j == 0 else c.rjust(widths[j]) for j, c in enumerate(row)))
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    if offline is not None:
        lines.append(f"offline LLM.generate, same requests: output_tok_s {offline.metrics['output_tok_s']:,.1f}, "
                     f"wall_s {offline.metrics['wall_s']:,.2f} ({offline.note})")
    lines += [f"rate={r.extra['request_rate']}: {r.note}" for r in runs]
    return "\n".join(lines)


def _http_module():
    """The HTTP client library: httpx2 (what openai 3.x installs) or httpx, which share an API."""
    try:
        import httpx2 as http
    except ImportError:
        try:
            import httpx as http
        except ImportError:
            raise CompiledLLMError("the serving workload's client needs httpx: pip install httpx") from None
    return http
