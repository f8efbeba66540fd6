"""``LLM``'s front end to its data-parallel replicas: blocking calls, from any of the caller's
threads, over N engine processes (vLLM's SyncMPClient plays this part).

``LLM(model, data_parallel_size=N)`` starts N engine processes (``DataParallelClient``: each
request goes to the replica ``dp_router`` picks; a replica that dies takes only its own requests
down) and drives them through a ``SyncClient``:

- ``submit`` sends validated requests and returns a ``Submission``, whose ``take`` blocks until
  some of its outputs have come back;
- ``call`` asks every live replica for one of ``engine_core.CALLS`` (its stats, its CUDA graphs
  captured) and waits for their answers;
- ``shutdown`` stops every replica. So does the end of the interpreter: an ``atexit`` hook that
  runs before multiprocessing's, which would wait forever for engine processes that ignore
  SIGTERM (they end when told, or when their pipe closes).

The replicas' pipes are read by an asyncio event loop on a thread of this client's, as the
server's event loop reads them: the loop routes each output to its submission's queue, and the
caller's thread assembles it (``OutputAssembler``). A request that is not streamed costs this
process once, when it finishes: its engine reports it in that step's message only, all its tokens
at once, and its text is detokenized here (unless it has stop strings) in one go. A stream costs
a message per step, as in the server.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import itertools
import logging
import queue
import threading
import time
from typing import Callable, Sequence

from compiled_llm.errors import EngineError
from compiled_llm.serve.engine_process.dp_client import DataParallelClient
from compiled_llm.serve.engine_process.engine_messages import OutputAssembler, request_error
from compiled_llm.serve.llm_engine import LLMEngine
from compiled_llm.serve.outputs import RequestOutput

logger = logging.getLogger("compiled_llm.serve.engine_process.sync_client")


class Submission:
    """The requests of one ``submit``, read by the thread that submitted them. ``take`` blocks
    until outputs have arrived and returns ``(request index, RequestOutput)`` for each request
    that has news, everything since the previous ``take`` folded into one output; it raises the
    exception a request failed with. ``abort`` stops the requests that have not finished."""

    def __init__(self, client: "SyncClient", request_ids: list[str], assemblers: list[OutputAssembler]):
        self._client = client
        self.request_ids = request_ids
        self._assemblers = assemblers
        # (request index, encoded output or the exception it failed with), put by the loop thread
        self._arrived: queue.SimpleQueue = queue.SimpleQueue()
        self._finished = [False] * len(request_ids)  # its final output has been taken

    @property
    def finished(self) -> bool:
        return all(self._finished)

    def take(self) -> list[tuple[int, RequestOutput]]:
        items = [self._arrived.get()]
        while True:
            try:
                items.append(self._arrived.get_nowait())
            except queue.Empty:
                break
        by_request: dict[int, list] = {}
        for index, item in items:
            by_request.setdefault(index, []).append(item)
        ready = []
        for index, arrived in by_request.items():
            if isinstance(arrived[-1], BaseException):
                self._finished[index] = True
                raise arrived[-1]
            out = self._assemblers[index].take(arrived)
            self._finished[index] = out.finished
            ready.append((index, out))
        return ready

    def abort(self) -> None:
        """Stop the requests whose final output has not been taken (from any thread, a
        finalizer too); their last outputs, finish reason "abort", are not waited for."""
        ids = [rid for rid, done in zip(self.request_ids, self._finished) if not done]
        if ids:
            self._client.abort(ids)


class SyncClient:
    """See the module docstring. ``info``, ``tokenizer`` and ``validator`` are the most restrictive
    replica's (``DataParallelClient``); ``snapshots`` each replica's latest counters."""

    def __init__(self, replicas: DataParallelClient):
        self._dp = replicas
        self.info, self.tokenizer, self.validator = replicas.info, replicas.tokenizer, replicas.validator
        self.num_replicas = replicas.num_replicas
        self.snapshots = list(replicas.start_snapshots)
        self.failure: str | None = None  # why every replica stopped, once they have
        self._ids = itertools.count()
        self._call_ids = itertools.count()
        # the loop thread's alone: request id -> (its submission, its index there); (call id,
        # replica) -> the future of its answer
        self._routes: dict[str, tuple[Submission, int]] = {}
        self._answers: dict[tuple[int, int], concurrent.futures.Future] = {}
        self._closed = False
        self._close_lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run_loop, name="compiled_llm-replicas", daemon=True)
        self._thread.start()
        atexit.register(self.shutdown)
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result()

    @classmethod
    def start_processes(cls, loads: Sequence[Callable[[], LLMEngine]]) -> "SyncClient":
        """One engine process per ``loads[i]`` (``DataParallelClient.start_processes``: the
        first that cannot load names itself, and stops the others), driven from here."""
        replicas = DataParallelClient.start_processes(loads)
        try:
            return cls(replicas)
        except BaseException:
            for replica in replicas.replicas:
                replica.kill()
            raise

    def _run_loop(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()

    async def _start(self) -> None:
        self._dp.start(self._on_message)

    def _in_loop(self, fn: Callable, *args) -> None:
        # checked and queued under the lock that shutdown() takes to close: what is accepted is
        # queued before the loop's stop, so it runs (and its waiters hear of the shutdown)
        with self._close_lock:
            try:
                if not self._closed:
                    self._loop.call_soon_threadsafe(fn, *args)
                    return
            except RuntimeError:  # the loop closed meanwhile
                pass
        raise EngineError("this LLM has been shut down")

    # ---- any thread ------------------------------------------------------------------------------

    def submit(self, requests: Sequence[tuple], stream: bool = False) -> Submission:
        """Send validated requests (``RequestValidator.validate``'s tuples); ``stream``: an output
        every step, not only the last."""
        tokenizer = self.tokenizer
        ids, assemblers, entries = [], [], []
        for text, prompt_ids, params in requests:
            rid = str(next(self._ids))
            ids.append(rid)
            assemblers.append(OutputAssembler(rid, text, prompt_ids, params, tokenizer))
            entries.append((rid, text, prompt_ids, OutputAssembler.engine_params(params, tokenizer)))
        submission = Submission(self, ids, assemblers)
        self._in_loop(self._add, submission, entries, stream)
        return submission

    def abort(self, request_ids: Sequence[str]) -> None:
        try:
            self._in_loop(self._dp.send, ("abort", list(request_ids)))
        except EngineError:  # shut down: nothing runs any more
            pass

    def call(self, method: str) -> list:
        """Every replica's answer to ``method`` (``engine_core.CALLS``), None for a replica that
        has died; EngineError when a replica could not answer, or none is left."""
        futures = [concurrent.futures.Future() for _ in range(self.num_replicas)]
        self._in_loop(self._send_call, method, futures)
        return [f.result() for f in futures]

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop every replica, waiting up to ``timeout`` seconds for them (then killing those
        left), and the loop's thread; what was still running fails with EngineError. Idempotent.
        Blocking, with no event loop or new thread: it also runs at the interpreter's exit."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        atexit.unregister(self.shutdown)
        try:
            if threading.current_thread() is not self._thread:
                self._loop.call_soon_threadsafe(self._loop.stop)
                self._thread.join()
            else:  # a finalizer run by the loop's own thread: the loop stops after this callback
                self._loop.stop()
            deadline = time.monotonic() + timeout
            for replica in self._dp.replicas:  # all told first, so that they stop side by side
                replica.tell_to_stop()
            for replica in self._dp.replicas:
                replica.wait_stopped(deadline)
        except BaseException:  # interrupted: none may outlive this process
            for replica in self._dp.replicas:
                replica.kill()
            raise
        finally:
            if self.failure is None:
                self._fail("this LLM has been shut down")
            if not self._thread.is_alive():
                self._loop.close()

    # ---- the loop thread -------------------------------------------------------------------------

    def _add(self, submission: Submission, entries: list[tuple], stream: bool) -> None:
        if self.failure is not None:
            for i in range(len(entries)):
                submission._arrived.put((i, EngineError(f"the engine stopped: {self.failure}")))
            return
        for i, entry in enumerate(entries):
            self._routes[entry[0]] = (submission, i)
        if entries:
            self._dp.send(("add", entries, stream))

    def _send_call(self, method: str, futures: list[concurrent.futures.Future]) -> None:
        if self.failure is not None:
            for f in futures:
                f.set_exception(EngineError(f"the engine stopped: {self.failure}"))
            return
        call_id = next(self._call_ids)
        live = set(self._dp.live_replicas)
        for replica, future in enumerate(futures):
            if replica in live:
                self._answers[(call_id, replica)] = future
            else:
                future.set_result(None)
        self._dp.send(("call", call_id, method))

    def _on_message(self, message: tuple) -> None:
        kind = message[0]
        if kind == "step":
            _, outputs, errors, _, snapshot, replica = message
            self.snapshots[replica] = snapshot
            routes = self._routes
            for encoded in outputs:
                route = routes.get(encoded[0])
                if route is None:
                    continue
                if encoded[1]:  # finished
                    del routes[encoded[0]]
                route[0]._arrived.put((route[1], encoded))
            for rid, error_kind, text in errors:
                route = routes.pop(rid, None)
                if route is not None:
                    route[0]._arrived.put((route[1], request_error(error_kind, text)))
            if replica in self._dp.failures:  # it died: its calls go unanswered
                for key in [k for k in self._answers if k[1] == replica]:
                    self._answers.pop(key).set_result(None)
        elif kind == "called":
            _, call_id, error, value, replica = message
            future = self._answers.pop((call_id, replica), None)
            if future is not None:
                if error is None:
                    future.set_result(value)
                else:
                    future.set_exception(EngineError(f"data-parallel replica {replica}: {error}"))
        elif kind == "lost":
            self._fail(message[1])

    def _fail(self, reason: str) -> None:
        """Every replica has stopped: what runs fails, and so will whatever comes."""
        self.failure = reason
        for rid, (submission, index) in self._routes.items():
            submission._arrived.put((index, EngineError(f"the engine stopped: {reason}")))
        self._routes.clear()
        for future in self._answers.values():
            future.set_exception(EngineError(f"the engine stopped: {reason}"))
        self._answers.clear()

