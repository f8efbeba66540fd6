"""The load generator: a run's requests sent on their schedule (a Poisson process, or all at
once) from one client process or several, whose records are merged. A GPU server streams more
chunks a second than one Python process reads, so the requests can be dealt round-robin to
spawned processes that start together; each reports the CPU time it spent, so that a
saturated client shows."""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass

from compiled_llm.cli.bench.sse_client import RequestRecord, fetch, stream_one
from compiled_llm.errors import CompiledLLMError


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


def split_load(base_url: str, bodies: Sequence[bytes], prompt_lens: Sequence[int], send_at: Sequence[float],
               processes: int, api_key: str | None = None) -> list[ClientLoad]:
    """Requests dealt round-robin to ``processes`` loads: each keeps its requests' send times, so
    together they follow the run's schedule."""
    processes = min(processes, len(bodies))
    return [ClientLoad(base_url, tuple(bodies[i::processes]), tuple(prompt_lens[i::processes]),
                       tuple(send_at[i::processes]), api_key) for i in range(processes)]


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


def run_load(load: ClientLoad, start_time: float) -> ClientReport:
    """Send ``load`` in this process, starting at wall time ``start_time``."""
    return asyncio.run(_run_load(load, start_time))


async def _run_load(load: ClientLoad, start_time: float) -> ClientReport:
    headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
    if load.api_key:
        headers["Authorization"] = f"Bearer {load.api_key}"
    url = load.base_url + "/v1/completions"
    delay = start_time - time.time()
    if delay > 0:
        await asyncio.sleep(delay)
    began, cpu0, t0 = time.time(), time.process_time(), time.perf_counter()
    records = await asyncio.gather(*(
        stream_one(url, body, plen, at, t0, headers)
        for body, plen, at in zip(load.bodies, load.prompt_lens, load.send_at)))
    return ClientReport(list(records), time.process_time() - cpu0, time.perf_counter() - t0, began, time.time())


def warm_up_client(base_url: str) -> None:
    """One request (GET /health) through this process's client. A process's first connection
    pays for lazy set-up (the event loop's, the resolver's) that must not land in the first
    timed request's TTFT."""
    try:
        asyncio.run(fetch(base_url + "/health", b"", {}, lambda piece, now: None))
    except CompiledLLMError:
        pass  # a server that does not answer fails the run itself, with its own message
