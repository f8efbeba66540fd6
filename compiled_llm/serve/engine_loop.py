"""One owner for an engine: callers submit requests and read their own output queues.

``LLMEngine`` is not thread-safe, and one request's outputs must never reach another's caller.
So nothing touches the engine but ``EngineLoop.step``, under one lock: it applies the queued
submissions and aborts, runs one engine step and puts each output on its request's queue.

Whoever waits for output drives. A caller whose queue is empty runs steps until it is not
(``wait``); outputs of other requests go to their queues meanwhile. So any number of threads can
call ``LLM.generate`` and ``LLM.stream`` on one engine, and streams can be read in any order,
without losing a token. (The HTTP server does not share a process with its engine: its engine
process steps in a loop of its own, ``engine_core``.)

A submission is atomic: its requests are validated before it is queued and enter the engine
together in one step. If a step raises, the engine aborts the requests it held (their blocks go
back) and each of them gets the exception on its queue; the other requests carry on.
"""

from __future__ import annotations

import collections
import threading
from typing import Callable, Iterable

from compiled_llm.errors import EngineError, InvalidRequestError
from compiled_llm.serve.llm_engine import LLMEngine
from compiled_llm.serve.outputs import RequestOutput


class RequestQueue:
    """The outputs of one request, in order, ending with a finished output or an exception.
    ``notify(queue)`` runs after each put, in the thread that stepped."""

    def __init__(self, request_id: str, notify: Callable[["RequestQueue"], None] | None = None):
        self.request_id = request_id
        self._items: collections.deque[RequestOutput | BaseException] = collections.deque()
        self._notify = notify
        self.closed = False  # its last item (finished output, exception or abort) was put

    def put(self, item: RequestOutput | BaseException) -> None:
        self._items.append(item)
        if isinstance(item, BaseException) or item.finished:
            self.closed = True
        if self._notify is not None:
            self._notify(self)

    def get_nowait(self) -> RequestOutput | None:
        """The next output, None when none is ready; raises what the request failed with."""
        if not self._items:
            return None
        item = self._items.popleft()
        if isinstance(item, BaseException):
            raise item
        return item

    def ready(self) -> bool:
        return bool(self._items)


class EngineLoop:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._lock = threading.Lock()  # held while the engine is touched
        self._commands: collections.deque[tuple] = collections.deque()
        self._queues: dict[str, RequestQueue] = {}  # requests in the engine, or queued to enter it
        self._ids_lock = threading.Lock()

    # ---- any thread ----------------------------------------------------------------------------

    def submit(
        self,
        requests: Iterable[tuple],
        stream: bool = False,
        notify: Callable[[RequestQueue], None] | None = None,
        request_ids: Iterable[str] | None = None,
    ) -> list[RequestQueue]:
        """Queue validated requests (``LLMEngine.validate``'s tuples) to enter the engine
        together; one queue each, in order. ``stream``: every new token gives an output, not
        only the last."""
        requests = list(requests)
        with self._ids_lock:
            if request_ids is None:
                ids = [self.engine.new_request_id() for _ in requests]
            else:
                ids = [str(i) for i in request_ids]
                taken = [i for i in ids if i in self._queues]
                if taken or len(set(ids)) != len(ids):
                    raise InvalidRequestError(f"request id {(taken or ids)[0]!r} is already in use")
            queues = [RequestQueue(rid, notify) for rid in ids]
            self._queues.update(zip(ids, queues))
        self._commands.append(("add", list(zip(queues, requests)), stream))
        self._apply_if_idle()
        return queues

    def abort(self, request_id: str, now: bool = True) -> None:
        """Stop a request: at once if no step is running (``now``), else before the next step.
        ``now=False`` only queues the abort (a finalizer must not take locks)."""
        self._commands.append(("abort", str(request_id)))
        if now:
            self._apply_if_idle()

    def wait(self, done: Callable[[], bool]) -> None:
        """Run steps until ``done()`` (checked between steps)."""
        while not done():
            if not self.step(until=done) and not done():
                raise RuntimeError("the engine has nothing left to run, but an awaited request has no output")

    def step(self, until: Callable[[], bool] | None = None) -> bool:
        """Apply queued submissions and aborts, then run one engine step and route its
        outputs. Skipped if ``until()`` is already true once the lock is held (another thread's
        step got there first). False when there was nothing to run."""
        try:
            with self._lock:
                self._apply_commands()
                if until is not None and until():
                    return True
                if not self.engine.has_unfinished_requests():
                    return False
                self._step_locked()
                return True
        finally:
            self._apply_if_idle()

    def settle(self) -> None:
        """When no request is left, collect a decode step still queued ahead (all its rows
        finished), so an idle engine has nothing in flight. Skipped if a step is running."""
        if self._lock.acquire(blocking=False):
            try:
                self._apply_commands()
                if self.engine.has_unfinished_requests() and not self.engine.scheduler.has_unfinished():
                    self._step_locked()
            finally:
                self._lock.release()
            self._apply_if_idle()

    # ---- under the lock ------------------------------------------------------------------------

    def _step_locked(self) -> None:
        try:
            outputs = self.engine.step()
        except BaseException as e:
            failed = self.engine.failed_request_ids
            if not failed:  # it failed before any request was in flight (scheduling): fail them all
                failed = list(self._queues)
                for rid in failed:
                    self.engine.abort_request(rid)
            # an interrupt belongs to this thread's caller; the other callers get an error
            error = e if isinstance(e, Exception) else EngineError(f"the step was interrupted ({type(e).__name__})")
            for rid in failed:
                self._close(rid, error)
            if not isinstance(e, Exception):
                raise
            return
        for out in outputs:
            queue = self._queues.get(out.request_id)
            if queue is None:
                continue
            if out.finished:
                self._close(out.request_id, out)
            else:
                queue.put(out)

    def _close(self, request_id: str, last: RequestOutput | BaseException | None) -> None:
        queue = self._queues.pop(request_id, None)  # atomic: no lock (a finalizer may run inside submit)
        if queue is not None and last is not None:
            queue.put(last)

    def _apply_commands(self) -> None:
        while self._commands:
            command = self._commands.popleft()
            if command[0] == "add":
                _, pairs, stream = command
                for queue, request in pairs:
                    if queue.request_id not in self._queues:  # aborted while queued
                        continue
                    try:
                        self.engine.add_request(None, request_id=queue.request_id, stream=stream, _validated=request)
                    except Exception as e:  # only this request's caller hears of it
                        self._close(queue.request_id, e)
            else:
                rid = command[1]
                self._close(rid, self.engine.abort_request(rid))

    def _apply_if_idle(self) -> None:
        """Apply commands that arrived while a step held the lock, unless a step holds it now
        (that one applies them). Every command is followed by this call, and so is every
        release of the lock, so none is left behind."""
        while self._commands and self._lock.acquire(blocking=False):
            try:
                self._apply_commands()
            finally:
                self._lock.release()
