"""The server's asynchronous front end to one engine: requests in from asyncio, outputs back to
asyncio, the engine stepped by one thread.

It builds on ``EngineLoop`` (the engine's one owner, see its docstring). One stepping thread runs
``EngineLoop.step`` while the engine has work and sleeps on a ``threading.Event`` otherwise;
``submit`` and ``abort`` wake it. Each API call is a ``RequestGroup`` of engine requests (a
completions call with several prompts has one per prompt), read by one asyncio consumer.

The hot path is cheap at hundreds of streams and a step every few milliseconds:

- the queues' ``notify`` only collects the touched queues; after each step the thread wakes the
  event loop once (one ``call_soon_threadsafe`` for the whole step, none while the previous one
  is still pending), which resolves the waiting groups' futures;
- a consumer takes everything its queues hold and merges it into one output per request
  (``merge_outputs``: the deltas of several steps concatenated), so a slow event loop sends fewer,
  larger chunks instead of falling behind;
- nothing is proportional to the tokens generated so far.

Admission control counts the requests accepted but not yet scheduled (and their prompt tokens);
past ``max_waiting_requests`` or ``max_waiting_prompt_tokens`` a call is refused with
``ServiceUnavailableError`` (HTTP 503 + Retry-After), and so is every call once ``drain`` has
begun. A request past its timeout is aborted (finish reason "abort"). ``RequestGroup.abort``
frees a request's blocks at once when no step is running, else right after the running step.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from typing import Sequence

from compiled_llm.errors import CompiledLLMError, EngineError, InvalidRequestError
from compiled_llm.serve.engine_loop import EngineLoop, RequestQueue
from compiled_llm.serve.llm_engine import LLMEngine
from compiled_llm.serve.outputs import CompletionOutput, RequestOutput

logger = logging.getLogger("compiled_llm.serve.async_engine")


class ServiceUnavailableError(CompiledLLMError):
    """The server refuses a call for now (its waiting queue is full, or it is shutting down);
    the client may retry after ``retry_after`` seconds."""

    def __init__(self, message: str, retry_after: int = 1):
        super().__init__(message)
        self.retry_after = retry_after


def merge_outputs(items: Sequence[RequestOutput]) -> RequestOutput:
    """One output of a request for several consecutive ones: each completion's latest state
    with the deltas of all of them, in order."""
    if len(items) == 1:
        return items[0]
    by_index: dict[int, list[CompletionOutput]] = {}
    for item in items:
        for c in item.outputs:
            by_index.setdefault(c.index, []).append(c)
    merged = []
    for index in sorted(by_index):
        parts = by_index[index]
        last = parts[-1]
        if len(parts) > 1:
            logprobs = [c.delta_logprobs for c in parts]
            last = dataclasses.replace(
                last,
                delta_text="".join(c.delta_text for c in parts),
                delta_token_ids=[t for c in parts for t in c.delta_token_ids],
                delta_logprobs=None if all(lp is None for lp in logprobs) else [p for lp in logprobs for p in lp or ()],
            )
        merged.append(last)
    prompt_logprobs = next((i.prompt_logprobs for i in items if i.prompt_logprobs is not None), None)
    return dataclasses.replace(items[-1], outputs=merged, prompt_logprobs=prompt_logprobs)


@dataclasses.dataclass(eq=False)
class _Request:
    queue: RequestQueue
    n: int  # completions
    first_token_time: float | None = None
    final: RequestOutput | None = None
    failed: bool = False  # its queue gave an exception


class RequestGroup:
    """The engine requests of one API call, read together by one asyncio consumer:
    ``async for ready in group`` gives lists of ``(request index, RequestOutput)``, each output
    merging everything that request produced since the previous list, until every request has
    finished. ``release()`` (always, in a ``finally``) aborts what is left."""

    def __init__(self, owner: "AsyncEngine", queues: list[RequestQueue], ns: list[int], arrival: float,
                 deadline: float | None, stream: bool):
        self._owner = owner
        self._requests = [_Request(q, n) for q, n in zip(queues, ns)]
        self.arrival = arrival
        self._deadline = deadline
        self.stream = stream
        self._open = len(queues)  # requests whose final output has not been read
        self._waiter: asyncio.Future | None = None
        self.abort_reason: str | None = None  # "timeout", "disconnect", "shutdown", ... when aborted
        self.released = False

    @property
    def request_ids(self) -> list[str]:
        return [r.queue.request_id for r in self._requests]

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
                    self.abort("timeout")
                    continue
            # No await since the queues were drained, so an output put since then has not been
            # routed yet: its wake-up finds this future.
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await asyncio.wait_for(self._waiter, timeout)
            except asyncio.TimeoutError:
                self.abort("timeout")
            finally:
                self._waiter = None

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _drain(self) -> list[tuple[int, RequestOutput]]:
        ready = []
        for i, r in enumerate(self._requests):
            if r.final is not None or r.failed or not r.queue.ready():
                continue
            items = []
            try:
                while (item := r.queue.get_nowait()) is not None:
                    items.append(item)
            except Exception:  # the engine failed this request: the call fails
                r.failed = True
                self._open -= 1
                self.abort("error")
                raise
            out = merge_outputs(items)
            if self.stream and r.first_token_time is None and any(c.delta_token_ids for c in out.outputs):
                r.first_token_time = time.perf_counter()
            if out.finished:
                r.final = out
                self._open -= 1
                self._owner._finished(self, r, out)
            ready.append((i, out))
        return ready

    def abort(self, reason: str) -> None:
        """Stop the requests that have not finished (their final outputs still come, with
        finish reason "abort"); ``reason`` is kept in ``abort_reason``."""
        open_ = [r for r in self._requests if r.final is None and not r.failed and not r.queue.closed]
        if open_ and self.abort_reason is None:
            self.abort_reason = reason
        for r in open_:
            self._owner._loop.abort(r.queue.request_id)
        self._owner._flush_here()

    def release(self) -> None:
        """Abort what has not finished and forget the group (idempotent)."""
        if self.released:
            return
        self.abort(self.abort_reason or "closed")
        self.released = True
        self._owner._release(self)


class AsyncEngine:
    """See the module docstring. ``start()`` from the event loop that will read the outputs."""

    def __init__(self, engine: LLMEngine, *, max_waiting_requests: int = 1024, max_waiting_prompt_tokens: int = 1 << 20,
                 request_timeout: float | None = None, metrics=None):
        self.engine = engine
        self._loop = EngineLoop(engine)
        self.max_waiting_requests = max_waiting_requests
        self.max_waiting_prompt_tokens = max_waiting_prompt_tokens
        self.request_timeout = request_timeout
        self.metrics = metrics  # ServerMetrics or None
        self.accepting = True
        self.failure: BaseException | None = None  # what killed the stepping thread
        self._aio: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._work = threading.Event()
        self._stopping = False
        # queues given outputs since the last wake-up of the event loop
        self._touched: list[RequestQueue] = []
        self._touched_lock = threading.Lock()
        self._wake_pending = False  # a _wake_touched is scheduled on the event loop
        # admission: requests accepted but not yet scheduled, id -> prompt tokens
        self._admission = threading.Lock()
        self._unscheduled: dict[str, int] = {}
        self._unscheduled_tokens = 0
        # event loop only
        self._groups: dict[str, RequestGroup] = {}  # request id -> its group
        self._active: set[RequestGroup] = set()
        self._idle = asyncio.Event()
        self._idle.set()

    # ---- lifecycle (event loop) ------------------------------------------------------------------

    def start(self) -> None:
        self._aio = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="compiled_llm-engine", daemon=True)
        self._thread.start()

    async def drain(self, grace: float) -> None:
        """Refuse new calls, let the running ones finish for up to ``grace`` seconds, abort the
        rest, then stop the stepping thread."""
        self.accepting = False
        if self._active:
            logger.info("draining: waiting up to %g s for %d running requests", grace, len(self._active))
            try:
                await asyncio.wait_for(self._idle.wait(), grace)
            except asyncio.TimeoutError:
                logger.warning("aborting %d requests still running after %g s", len(self._active), grace)
        await self.stop()

    def abort_all(self, reason: str = "shutdown") -> None:
        """Refuse new calls and abort every running one (their streams end with "abort")."""
        self.accepting = False
        for group in list(self._active):
            group.abort(reason)

    async def stop(self) -> None:
        """Abort every call still running, give their consumers a moment to end, and stop the
        stepping thread."""
        self.abort_all()
        if self._active:
            try:
                await asyncio.wait_for(self._idle.wait(), 5.0)
            except asyncio.TimeoutError:
                pass
        self._stopping = True
        self._work.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 30.0)

    # ---- requests (event loop) -----------------------------------------------------------------

    @property
    def num_unscheduled(self) -> tuple[int, int]:
        """(requests, prompt tokens) accepted but not yet scheduled."""
        with self._admission:
            return len(self._unscheduled), self._unscheduled_tokens

    def submit(self, requests: list[tuple], stream: bool = False, arrival: float | None = None) -> RequestGroup:
        """Queue validated requests (``LLMEngine.validate``'s tuples) as one group, or refuse
        them all: ``ServiceUnavailableError`` when the server is busy or draining,
        ``InvalidRequestError`` when the call alone exceeds the waiting limits. From the event
        loop only."""
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
        # Only this thread adds to the count (the stepping thread only takes away), so checking
        # it first and adding after the submission never admits past the limits.
        waiting, waiting_tokens = self.num_unscheduled
        if waiting + len(requests) > self.max_waiting_requests or waiting_tokens + tokens > self.max_waiting_prompt_tokens:
            raise ServiceUnavailableError(
                f"the server is busy: {waiting} requests ({waiting_tokens} prompt tokens) are waiting to be "
                "scheduled; retry later")
        queues = self._loop.submit(requests, stream=stream, notify=self._on_put)
        with self._admission:  # once submitted: the stepping thread looks for them in the engine from now on
            for q, n in zip(queues, lengths):
                if not q.closed:
                    self._unscheduled[q.request_id] = n
                    self._unscheduled_tokens += n
        deadline = None if self.request_timeout is None else arrival + self.request_timeout
        group = RequestGroup(self, queues, [p.n for _, _, p in requests], arrival, deadline, stream)
        for q in queues:
            self._groups[q.request_id] = group
        self._active.add(group)
        self._idle.clear()
        self._work.set()
        self._flush_here()  # a request that failed entering the engine has its error queued already
        return group

    def _finished(self, group: RequestGroup, r: _Request, out: RequestOutput) -> None:
        if self.metrics is None:
            return
        first = r.first_token_time
        if not group.stream and out.metrics is not None:
            first = out.metrics.first_token_time
        self.metrics.observe_finished(out, group.arrival, first, time.perf_counter())

    def _release(self, group: RequestGroup) -> None:
        with self._admission:
            for rid in group.request_ids:
                n = self._unscheduled.pop(rid, None)
                if n is not None:
                    self._unscheduled_tokens -= n
        for rid in group.request_ids:
            self._groups.pop(rid, None)
        if self.metrics is not None:
            for r in group._requests:
                if r.final is None and not r.failed:  # aborted unread: counted by its completions
                    self.metrics.observe_aborted(r.n)
        self._active.discard(group)
        if not self._active:
            self._idle.set()

    # ---- waking consumers ----------------------------------------------------------------------

    def _on_put(self, queue: RequestQueue) -> None:
        """RequestQueue.notify, in whichever thread put the output."""
        with self._touched_lock:
            self._touched.append(queue)

    def _take_touched(self) -> list[RequestQueue]:
        with self._touched_lock:
            touched, self._touched = self._touched, []
        return touched

    def _wake_groups(self, touched: list[RequestQueue]) -> None:
        for q in touched:
            group = self._groups.get(q.request_id)
            if group is not None:
                group._wake()

    def _flush_here(self) -> None:
        """From the event loop, after a submit or an abort applied in this thread."""
        touched = self._take_touched()
        if touched:
            self._wake_groups(touched)

    def _flush_from_thread(self) -> None:
        """Wake the event loop once for everything put since its last wake-up; while that
        wake-up is still pending (a busy loop), the next steps' queues join it."""
        with self._touched_lock:
            if not self._touched or self._wake_pending:
                return
            self._wake_pending = True
        try:
            self._aio.call_soon_threadsafe(self._wake_touched)
        except RuntimeError:  # the event loop has closed: nobody is left to wake
            pass

    def _wake_touched(self) -> None:
        with self._touched_lock:
            touched, self._touched = self._touched, []
            self._wake_pending = False
        self._wake_groups(touched)

    def _wake_all(self) -> None:
        for group in list(self._active):
            group._wake()

    # ---- the stepping thread -------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                self._work.clear()
                if self._stopping:
                    return
                with self._admission:
                    entered = list(self._unscheduled)  # submitted: in the engine once step() applies them
                worked = self._loop.step()
                self._flush_from_thread()
                if entered:
                    self._forget_scheduled(entered)
                if worked:
                    if self.metrics is not None:
                        self.metrics.on_step()
                    continue
                timeout = self.metrics.seconds_to_next_log() if self.metrics is not None else None
                if not self._work.wait(timeout) and self.metrics is not None:
                    self.metrics.log_if_due()
        except BaseException as e:  # the engine is unusable: fail every caller rather than hang them
            logger.exception("the engine's stepping thread stopped")
            self.failure = e
            try:
                self._aio.call_soon_threadsafe(self._wake_all)
            except RuntimeError:
                pass

    def _forget_scheduled(self, entered: list[str]) -> None:
        """Drop from the waiting count the requests no longer in the scheduler's waiting queue
        (scheduled, or finished). ``tuple()`` copies the deque in one C call, which no engine
        call on the event loop can interleave."""
        waiting = {s.request_id for s in tuple(self.engine.scheduler.waiting)}
        with self._admission:
            for rid in entered:
                if rid not in waiting:
                    n = self._unscheduled.pop(rid, None)
                    if n is not None:
                        self._unscheduled_tokens -= n
