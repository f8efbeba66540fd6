"""The server's asynchronous front end to one engine core: requests in from asyncio, outputs back
to asyncio, the engine stepping in a process of its own (``engine_core``).

Each API call is a ``RequestGroup`` of engine requests (a completions call with several prompts
has one per prompt), read by one asyncio consumer. ``submit`` sends the requests to the engine
core; every message the core sends back (the outputs of one step, as deltas) is routed to the
requests' queues on the event loop, and wakes the groups they belong to.

The hot path is cheap at hundreds of streams and a step every few milliseconds:

- the engine's messages are read when the event loop comes round to them, all that have piled up
  at once, so the engine never waits for the event loop;
- a consumer takes everything that arrived for its requests and folds it into one output per
  request (``OutputAssembler.take``: the deltas of several steps concatenated, and detokenized
  in one go), so a busy event loop sends fewer, larger chunks instead of falling behind;
- nothing is proportional to the tokens generated so far;
- the event loop never spends long on streams' next chunks: a step's outputs wake at most
  ``WAKE_BATCH`` streams that have already started per turn of the loop, the others on the turns
  after (their deltas pile up meanwhile and go out together). Between turns the loop reads new
  requests and the engine's next outputs, so a request's arrival and its first token wait for a
  short turn, not for a chunk to every running stream. A request's first output, and calls that
  are not streamed, are woken at once.

Admission control counts the requests accepted but not yet scheduled, and their prompt tokens
(each API server its own, when there are several), as the core reports them leaving its waiting
queue; past ``max_waiting_requests`` or ``max_waiting_prompt_tokens`` a call is refused with
``ServiceUnavailableError`` (HTTP 503 + Retry-After), and so is every call once ``drain`` has
begun. A request past its timeout is
aborted (finish reason "abort"). ``RequestGroup.abort`` tells the core, which frees the
request's blocks before its next step.

If the engine core dies, every running call fails with ``EngineError`` (a stream ends with an
error event), new calls are refused, the stats log stops, and ``on_failure`` (the server's
shutdown) is called once: with no engine there is nothing left to serve, and a supervisor can
only restart a server that exits. Over data-parallel replicas (``DataParallelClient``, the same
messages, each step's tagged with its replica) that happens only when the last replica dies;
before that a dead replica's requests fail one by one (or start again on another replica), as
requests that failed in the engine do.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import itertools
import time
from typing import Callable

from compiled_llm.errors import CompiledLLMError, EngineError, InvalidRequestError
from compiled_llm.serve.engine_process.dp_client import DataParallelClient
from compiled_llm.serve.engine_process.engine_core_client import EngineCoreClient
from compiled_llm.serve.engine_process.engine_messages import OutputAssembler, request_error
from compiled_llm.serve.llm_engine import LLMEngine
from compiled_llm.serve.outputs import RequestOutput

logger = logging.getLogger("compiled_llm.serve.engine_process.async_engine")

# Streams woken per turn of the event loop (module docstring). A stream's chunk costs the event
# loop ~0.1 ms (fold, detokenize, JSON, socket write), so a turn stays near 1-2 ms however many
# streams run.
WAKE_BATCH = 16


class ServiceUnavailableError(CompiledLLMError):
    """The server refuses a call for now (its waiting queue is full, or it is shutting down);
    the client may retry after ``retry_after`` seconds."""

    def __init__(self, message: str, retry_after: int = 1):
        super().__init__(message)
        self.retry_after = retry_after


@dataclasses.dataclass(eq=False)
class _Request:
    request_id: str
    assembler: OutputAssembler
    n: int  # completions
    # what the engine core sent since the consumer last read: encoded outputs, or the
    # exception the request failed with
    pending: collections.deque = dataclasses.field(default_factory=collections.deque)
    closed: bool = False  # its last item has arrived
    first_token_time: float | None = None
    final: RequestOutput | None = None
    params: object | None = None  # its SamplingParams, for the request_params_* metrics
    failed: bool = False
    delivered: bool = False  # an output has been read: later ones may be paced (WAKE_BATCH)


class RequestGroup:
    """The engine requests of one API call, read together by one asyncio consumer:
    ``async for ready in group`` gives lists of ``(request index, RequestOutput)``, each output
    merging everything that request produced since the previous list, until every request has
    finished. ``release()`` (always, in a ``finally``) aborts what is left."""

    def __init__(self, owner: "AsyncEngine", requests: list[_Request], arrival: float, deadline: float | None,
                 stream: bool):
        self._owner = owner
        self._requests = requests
        self.arrival = arrival
        self._deadline = deadline
        self.stream = stream
        self._open = len(requests)  # requests whose final output has not been read
        self._waiter: asyncio.Future | None = None
        self.abort_reason: str | None = None  # "timeout", "disconnect", "shutdown", ... when aborted
        self.released = False

    @property
    def request_ids(self) -> list[str]:
        return [r.request_id for r in self._requests]

    @property
    def done(self) -> bool:
        return self._open == 0

    def __aiter__(self) -> "RequestGroup":
        return self

    async def __anext__(self) -> list[tuple[int, RequestOutput]]:
        ready = await self.next_outputs()
        if not ready:
            raise StopAsyncIteration
        return ready

    async def results(self) -> list[RequestOutput]:
        """Every request's final output, in order (for calls that are not streamed)."""
        async for _ in self:
            pass
        return [r.final for r in self._requests]  # type: ignore[misc]

    async def next_outputs(self) -> list[tuple[int, RequestOutput]]:
        """What is ready now, waiting for something if nothing is; [] once all have finished."""
        while True:
            ready = self._drain()
            if ready or self.done:
                return ready
            if self._owner.failure is not None:
                self.abort("error")
                raise EngineError(f"the engine stopped: {self._owner.failure}")
            timeout = None
            if self._deadline is not None:
                timeout = self._deadline - time.perf_counter()
                if timeout <= 0:
                    self._time_out()
                    continue
            # No await since the queues were drained, so an output put since then has not been
            # routed yet: its wake-up finds this future.
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await asyncio.wait_for(self._waiter, timeout)
            except asyncio.TimeoutError:
                self._time_out()
            finally:
                self._waiter = None

    def _time_out(self) -> None:
        """Abort what is left; the final outputs (finish reason "abort") still come from the
        engine core, with no deadline left to wait for them."""
        self._deadline = None
        self.abort("timeout")

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _drain(self) -> list[tuple[int, RequestOutput]]:
        ready = []
        for i, r in enumerate(self._requests):
            if r.final is not None or r.failed or not r.pending:
                continue
            items = list(r.pending)
            r.pending.clear()
            if isinstance(items[-1], BaseException):  # the engine failed this request: the call fails
                r.failed = True
                self._open -= 1
                self.abort("error")
                raise items[-1]
            out = r.assembler.take(items)
            if self.stream and r.first_token_time is None and any(c.delta_token_ids for c in out.outputs):
                r.first_token_time = time.perf_counter()
            if out.finished:
                r.final = out
                self._open -= 1
                self._owner._finished(self, r, out)
            ready.append((i, out))
            r.delivered = True
        return ready

    def abort(self, reason: str) -> None:
        """Stop the requests that have not finished (their final outputs still come, with
        finish reason "abort"); ``reason`` is kept in ``abort_reason``."""
        open_ = [r.request_id for r in self._requests if not r.closed]
        if open_ and self.abort_reason is None:
            self.abort_reason = reason
        if open_:
            self._owner._abort(open_)

    def release(self) -> None:
        """Abort what has not finished and forget the group (idempotent)."""
        if self.released:
            return
        self.abort(self.abort_reason or "closed")
        self.released = True
        self._owner._release(self)


class AsyncEngine:
    """See the module docstring. ``start()`` from the event loop that will read the outputs."""

    def __init__(self, core: EngineCoreClient | DataParallelClient, *, max_waiting_requests: int = 1024,
                 max_waiting_prompt_tokens: int = 1 << 20, request_timeout: float | None = None, metrics=None,
                 on_failure: Callable[[str], None] | None = None, request_id_prefix: str = ""):
        self.core = core
        self.max_waiting_requests = max_waiting_requests
        self.max_waiting_prompt_tokens = max_waiting_prompt_tokens
        self.request_timeout = request_timeout
        self.metrics = metrics  # ServerMetrics or None
        self.accepting = True
        self.failure: str | None = None  # why the engine core stopped, once it has
        self.on_failure = on_failure  # called with that reason, once, when it does
        self._ids = itertools.count()
        # the engine's request ids: unique among the API servers that share it ("0-", "1-", ...)
        self.request_id_prefix = request_id_prefix
        self._requests: dict[str, _Request] = {}  # requests in the engine (not closed)
        # admission: requests accepted but not yet scheduled, id -> prompt tokens
        self._unscheduled: dict[str, int] = {}
        self._unscheduled_tokens = 0
        self._groups: dict[str, RequestGroup] = {}  # request id -> its group
        self._active: set[RequestGroup] = set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._stats_task: asyncio.Task | None = None
        # streams with new outputs, woken WAKE_BATCH per turn of the event loop (ordered set)
        self._to_wake: collections.OrderedDict[RequestGroup, None] = collections.OrderedDict()
        self._waking = False  # _wake_some is scheduled

    @classmethod
    def in_thread(cls, engine: LLMEngine, **options) -> "AsyncEngine":
        """A front end over an engine loaded in this process, stepped by a thread (tests)."""
        return cls(EngineCoreClient.in_thread(engine), **options)

    # ---- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        self.core.start(self._on_message)
        if self.metrics is not None:
            self._stats_task = asyncio.ensure_future(self._log_stats())

    async def drain(self, grace: float) -> None:
        """Refuse new calls, let the running ones finish for up to ``grace`` seconds, abort the
        rest, then stop the engine core."""
        self.accepting = False
        if self._active:
            logger.info("draining: waiting up to %g s for %d running requests", grace, len(self._active))
            try:
                await asyncio.wait_for(self._idle.wait(), grace)
            except asyncio.TimeoutError:
                logger.warning("aborting %d requests still running after %g s", len(self._active), grace)
        await self.stop()

    async def wait_idle(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for every call to have been released; whether they were."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return True

    def abort_all(self, reason: str = "shutdown") -> None:
        """Refuse new calls and abort every running one (their streams end with "abort")."""
        self.accepting = False
        for group in list(self._active):
            group.abort(reason)

    async def stop(self) -> None:
        """Abort every call still running, give their consumers a moment to end, and stop the
        engine core."""
        self.abort_all()
        if self._active and self.failure is None:
            try:
                await asyncio.wait_for(self._idle.wait(), 5.0)
            except asyncio.TimeoutError:
                pass
        if self._stats_task is not None:
            self._stats_task.cancel()
        await self.core.close()

    async def _log_stats(self) -> None:
        """The periodic stats line, also for the last busy interval once the engine is idle."""
        while True:
            await asyncio.sleep(self.metrics.seconds_to_next_log())
            self.metrics.log_if_due()

    # ---- requests ------------------------------------------------------------------------------

    @property
    def num_unscheduled(self) -> tuple[int, int]:
        """(requests, prompt tokens) accepted but not yet scheduled."""
        return len(self._unscheduled), self._unscheduled_tokens

    def submit(self, requests: list[tuple], stream: bool = False, arrival: float | None = None) -> RequestGroup:
        """Queue validated requests (``RequestValidator.validate``'s tuples) as one group, or
        refuse them all: ``ServiceUnavailableError`` when the server is busy or draining,
        ``InvalidRequestError`` when the call alone exceeds the waiting limits."""
        if self.failure is not None:
            raise EngineError(f"the engine stopped: {self.failure}")
        if not self.accepting:
            raise ServiceUnavailableError("the server is shutting down", retry_after=5)
        arrival = time.perf_counter() if arrival is None else arrival
        lengths = [len(ids) for _, ids, _ in requests]
        tokens = sum(lengths)
        if len(requests) > self.max_waiting_requests:
            raise InvalidRequestError(
                f"{len(requests)} prompts in one call exceed the server's limit of {self.max_waiting_requests} waiting requests")
        if tokens > self.max_waiting_prompt_tokens:
            raise InvalidRequestError(
                f"{tokens} prompt tokens in one call exceed the server's limit of {self.max_waiting_prompt_tokens} waiting prompt tokens")
        waiting, waiting_tokens = self.num_unscheduled
        if waiting + len(requests) > self.max_waiting_requests or waiting_tokens + tokens > self.max_waiting_prompt_tokens:
            raise ServiceUnavailableError(
                f"the server is busy: {waiting} requests ({waiting_tokens} prompt tokens) are waiting to be "
                "scheduled; retry later")
        tokenizer = self.core.tokenizer
        entries, records = [], []
        for (text, ids, params), n in zip(requests, lengths):
            rid = f"{self.request_id_prefix}{next(self._ids)}"
            records.append(_Request(rid, OutputAssembler(rid, text, ids, params, tokenizer), params.n, params=params))
            entries.append((rid, text, ids, OutputAssembler.engine_params(params, tokenizer)))
            self._unscheduled[rid] = n
            self._unscheduled_tokens += n
        self.core.send(("add", entries, stream))
        deadline = None if self.request_timeout is None else arrival + self.request_timeout
        group = RequestGroup(self, records, arrival, deadline, stream)
        for r in records:
            self._requests[r.request_id] = r
            self._groups[r.request_id] = group
        self._active.add(group)
        self._idle.clear()
        return group

    def _abort(self, request_ids: list[str]) -> None:
        self.core.send(("abort", request_ids))

    def _finished(self, group: RequestGroup, r: _Request, out: RequestOutput) -> None:
        if self.metrics is None:
            return
        first = r.first_token_time
        if not group.stream and out.metrics is not None:
            first = out.metrics.first_token_time
        self.metrics.observe_finished(out, group.arrival, first, time.perf_counter(), r.params)

    def _release(self, group: RequestGroup) -> None:
        for rid in group.request_ids:
            self._scheduled(rid)
            self._groups.pop(rid, None)
        if self.metrics is not None:
            for r in group._requests:
                if r.final is None and not r.failed:  # aborted unread: counted by its completions
                    self.metrics.observe_aborted(r.n)
        self._active.discard(group)
        self._to_wake.pop(group, None)
        if not self._active:
            self._idle.set()

    def _wake_some(self) -> None:
        """Wake the first WAKE_BATCH streams waiting to be, and come back on the loop's next
        turn for the rest."""
        for _ in range(min(WAKE_BATCH, len(self._to_wake))):
            self._to_wake.popitem(last=False)[0]._wake()
        if self._to_wake:
            asyncio.get_running_loop().call_soon(self._wake_some)
        else:
            self._waking = False

    def _scheduled(self, request_id: str) -> None:
        n = self._unscheduled.pop(request_id, None)
        if n is not None:
            self._unscheduled_tokens -= n

    # ---- the engine core's messages --------------------------------------------------------------

    def _on_message(self, message: tuple) -> None:
        kind = message[0]
        if kind == "step":
            # a DataParallelClient appends the replica that stepped
            _, outputs, errors, scheduled, snapshot, *replica = message
            # request id -> whether its group may be paced (the request has delivered before),
            # in output order
            woken: dict[str, bool] = {}
            for encoded in outputs:
                rid = encoded[0]
                r = self._requests.get(rid)
                if r is None:
                    continue
                r.pending.append(encoded)
                if encoded[1]:  # finished
                    r.closed = True
                    del self._requests[rid]
                    self._scheduled(rid)
                woken[rid] = r.delivered
            for rid, error_kind, text in errors:
                r = self._requests.pop(rid, None)
                if r is not None:
                    r.pending.append(request_error(error_kind, text))
                    r.closed = True
                    self._scheduled(rid)
                    woken[rid] = False
            for rid in scheduled:
                self._scheduled(rid)
            if self.metrics is not None:
                self.metrics.on_snapshot(snapshot, replica[0] if replica else 0)
            for rid, paced in woken.items():
                group = self._groups.get(rid)
                if group is None:
                    continue
                if group.stream and paced:
                    self._to_wake[group] = None
                else:
                    group._wake()
            if self._to_wake and not self._waking:
                self._waking = True
                asyncio.get_running_loop().call_soon(self._wake_some)
        elif kind == "lost":
            self._lost(message[1])

    def _lost(self, reason: str) -> None:
        """The engine core is gone: fail what runs (each consumer, woken, raises EngineError),
        refuse what comes, stop the stats log, and tell the server."""
        logger.error("%s; failing %d running requests%s", reason, len(self._requests),
                     "" if self.on_failure is None else " and shutting down")
        self.failure = reason
        self.accepting = False
        for r in self._requests.values():
            r.closed = True
        self._requests.clear()
        self._unscheduled.clear()
        self._unscheduled_tokens = 0
        if self._stats_task is not None:
            self._stats_task.cancel()
        for group in list(self._active):
            group._wake()
        if self.on_failure is not None:
            self.on_failure(reason)
