"""The front end's handle on its engine core: the process (or, in tests, the thread) that runs
the engine, the channel to it, and what it reported when it loaded.

``start_process(load)`` spawns the engine process, which calls ``load()`` (a picklable function
that returns an ``LLMEngine``: the model loads, or builds, there and nowhere else) and returns
once the engine is ready, with its ``EngineInfo`` and tokenizer, or raises with the reason it
could not load. ``in_thread(engine)`` runs an engine already loaded in this process, through the
same messages.

On the event loop, ``start(on_message)`` reads the engine's messages as they arrive (the
channel's file descriptor is watched by the loop: no thread, nothing to wake) and hands each to
``on_message``; ``send`` never blocks (what the pipe cannot take yet goes when it can). If the
engine process dies, ``on_message`` gets ``("lost", reason)``, the reason worked out off the
loop (it may take waiting for the process, or for Ray, to say how the engine ended). ``close`` tells it to stop and
waits for it; a process that does not stop is killed, so none outlives the server.

With several API-server processes (``--api-server-count``), ``StartingEngine(load, api_servers=N)``
also makes one pair of pipes per API server, whose ends it hands on (``api_server_ends``); each
API server's process makes its client of them with ``attach``. Such a client never stops the
engine: ``close`` closes its own channel, and the process that started the engine stops it.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import select
import threading
import time
from typing import Callable, Sequence

from compiled_llm.errors import CompiledLLMError, EngineError, first_line
from compiled_llm.serve.engine_process.engine_core import EngineCore, run_engine_process
from compiled_llm.serve.engine_process.engine_messages import EngineInfo, EngineSnapshot
from compiled_llm.serve.llm_engine import LLMEngine
from compiled_llm.serve.engine_process.message_channel import MessageChannel
from compiled_llm.serve.core.request_validator import RequestValidator

logger = logging.getLogger("compiled_llm.serve.engine_process.engine_core_client")


class EngineCoreClient:
    def __init__(self, channel: MessageChannel, info: EngineInfo, tokenizer, snapshot: EngineSnapshot, *,
                 process: multiprocessing.process.BaseProcess | None = None, thread: threading.Thread | None = None,
                 owns_engine: bool = True):
        self.channel = channel
        self.info = info
        self.tokenizer = tokenizer
        self.start_snapshot = snapshot  # the engine's counters when it became ready
        self.validator = RequestValidator(
            tokenizer=tokenizer, vocab_size=info.vocab_size, max_model_len=info.max_model_len,
            block_size=info.block_size, num_blocks=info.num_blocks, max_num_seqs=info.max_num_seqs,
            kv_window=info.kv_window, max_step_tokens=info.max_step_tokens,
            yields_chosen_rows=info.yields_chosen_rows,
        )
        self._process = process
        self._thread = thread
        self.owns_engine = owns_engine  # close() stops the engine (else it only closes this channel)
        self._aio: asyncio.AbstractEventLoop | None = None
        self._on_message: Callable[[tuple], None] | None = None
        self._writing = False  # the loop watches the channel for room to write
        self._lost = False

    # ---- starting ------------------------------------------------------------------------------

    @classmethod
    def start_process(cls, load: Callable[[], LLMEngine]) -> "EngineCoreClient":
        """Spawn the engine process and wait until it has loaded ``load()``; CompiledLLMError
        with its reason if it could not."""
        return StartingEngine(load).wait()

    @classmethod
    def in_thread(cls, engine: LLMEngine) -> "EngineCoreClient":
        """An engine core over ``engine``, to run in a thread of this process once ``start``
        is called."""
        commands_r, commands_w = os.pipe()
        outputs_r, outputs_w = os.pipe()
        core = EngineCore(engine, MessageChannel(commands_r, outputs_w))

        def run() -> None:
            try:
                core.run()
            finally:
                core.channel.close()  # the front end sees the end of its pipe

        thread = threading.Thread(target=run, name="compiled_llm-engine", daemon=True)
        return cls(MessageChannel(outputs_r, commands_w), EngineInfo.of(engine), engine.tokenizer,
                   EngineSnapshot.of(engine), thread=thread)

    @classmethod
    def attach(cls, ends: tuple, info: EngineInfo, tokenizer, snapshot: EngineSnapshot) -> "EngineCoreClient":
        """In an API server's process: the client over its pair of ``StartingEngine.api_server_ends``
        (multiprocessing connections, as they arrive in a spawned process), with what the engine
        reported when it became ready."""
        outputs, commands = ends
        return cls(MessageChannel(_take_fd(outputs), _take_fd(commands)), info, tokenizer, snapshot,
                   owns_engine=False)

    @property
    def alive(self) -> bool:
        if self._process is not None:
            return self._process.is_alive()
        if self._thread is not None:
            return self._thread.is_alive()
        return not self._lost

    # what the server asks of its engines, as of ``DataParallelClient``'s: one replica here

    @property
    def start_snapshots(self) -> list[EngineSnapshot]:
        return [self.start_snapshot]

    @property
    def num_replicas(self) -> int:
        return 1

    @property
    def live_replicas(self) -> list[int]:
        return [] if self._lost else [0]

    # ---- the event loop ------------------------------------------------------------------------

    def start(self, on_message: Callable[[tuple], None]) -> None:
        """Hand every message from the engine to ``on_message``, from the running event loop."""
        self._aio = asyncio.get_running_loop()
        self._on_message = on_message
        if self._thread is not None and not self._thread.is_alive():
            self._thread.start()
        self._aio.add_reader(self.channel.read_fd, self._readable)
        self._watch_writes()

    def send(self, message: tuple) -> None:
        if self.channel.closed:
            return  # the engine has gone; its callers hear of it through "lost"
        self.channel.send(message)
        self._watch_writes()

    def _watch_writes(self) -> None:
        if self.channel.pending and not self._writing and self._aio is not None:
            self._writing = True
            self._aio.add_writer(self.channel.write_fd, self._writable)

    def _writable(self) -> None:
        if self.channel.flush():
            self._writing = False
            self._aio.remove_writer(self.channel.write_fd)

    def _readable(self) -> None:
        for message in self.channel.receive():
            self._on_message(message)
        if self.channel.closed and not self._lost:
            self._lost = True
            self._aio.remove_reader(self.channel.read_fd)
            self._report_lost()

    def _report_lost(self) -> None:
        """Hand on ``("lost", reason)`` from the loop once the reason is known. It is worked out
        in a thread: that waits (for the process to exit; for Ray to see a replica's actor end,
        and to release it), and the loop serves the other replicas' streams and /health meanwhile."""
        loop, on_message = self._aio, self._on_message

        def work() -> None:
            try:
                reason = self._exit_reason()
            except Exception as e:  # noqa: BLE001 - the engine is gone all the same
                reason = f"the engine stopped ({type(e).__name__}: {first_line(e, 300)})"
            try:
                loop.call_soon_threadsafe(on_message, ("lost", reason))
            except RuntimeError:  # the loop has closed: the server is gone, nobody is left to tell
                pass

        threading.Thread(target=work, name="compiled_llm-engine-lost", daemon=True).start()

    def _exit_reason(self) -> str:
        """Why the engine is gone, in one line (called off the event loop: it may wait)."""
        if self._process is None:
            return "the engine thread stopped" if self._thread is not None else "the engine process exited"
        self._process.join(1.0)
        return f"the engine process exited (exit code {self._process.exitcode})"

    async def close(self, timeout: float = 30.0) -> None:
        """Tell the engine to stop, and wait up to ``timeout`` seconds for it (then kill it); a
        client that does not own its engine (``attach``) sends what is still waiting to go and
        closes its channel."""
        if self._aio is not None and not self._lost:
            self._aio.remove_reader(self.channel.read_fd)
            self._lost = True
        if self._writing:
            self._aio.remove_writer(self.channel.write_fd)
            self._writing = False
        if self.owns_engine:
            self.send(("shutdown",))
        deadline = time.monotonic() + timeout
        while not self.channel.flush() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        if self._process is not None:
            await asyncio.to_thread(self._process.join, max(deadline - time.monotonic(), 0.1))
            _stop_process(self._process, None)
        elif self._thread is not None and self._thread.is_alive():
            await asyncio.to_thread(self._thread.join, max(deadline - time.monotonic(), 0.1))
        self.channel.close()


    # ---- stopping without the event loop (LLM's replicas) ----------------------------------------

    def tell_to_stop(self) -> None:
        """``close``'s first half, for a front end whose event loop has stopped (``LLM``'s
        replicas: its shutdown, or the interpreter's exit, when no thread can be started to
        wait in): stop reading the engine and tell it to stop. ``wait_stopped`` waits for it."""
        if self._aio is not None and not self._lost:
            self._aio.remove_reader(self.channel.read_fd)
        if self._writing:
            self._aio.remove_writer(self.channel.write_fd)
            self._writing = False
        self._lost = True
        if not self.channel.closed:
            self.channel.send(("shutdown",))

    def wait_stopped(self, deadline: float) -> None:
        """Wait until ``deadline`` (``time.monotonic()``) for an engine told to stop to end, kill
        it if it has not, and close the channel."""
        while not self.channel.flush() and time.monotonic() < deadline:
            select.select([], [self.channel.write_fd], [], 0.1)
        if self._process is not None:
            self._process.join(max(deadline - time.monotonic(), 0.1))
            _stop_process(self._process, None)
        elif self._thread is not None and self._thread.is_alive():
            self._thread.join(max(deadline - time.monotonic(), 0.1))
        self.channel.close()

    def kill(self) -> None:
        """Stop the engine process now, without asking (a shutdown that cannot wait for the event
        loop: an interrupted one, or the interpreter exiting)."""
        if self._process is not None:
            _stop_process(self._process, None)


class StartingEngine:
    """An engine process spawned and loading: ``poll`` (never blocks) or ``wait`` for it to say
    ready, ``stop`` it. Several start at once this way (data-parallel replicas, ``wait_all``), and
    one that fails, or an interrupt, stops the others without waiting for them to load.
    ``api_servers``: the API-server processes that will talk to it besides this one, each over
    a pair of pipes of its own: ``api_server_ends[i]`` (outputs to read, commands to write),
    multiprocessing connections to hand to API server i's process (and close here then)."""

    def __init__(self, load: Callable[[], LLMEngine], api_servers: int = 0):
        ctx = multiprocessing.get_context("spawn")  # CUDA cannot be forked
        commands_r, commands_w = ctx.Pipe(duplex=False)
        outputs_r, outputs_w = ctx.Pipe(duplex=False)
        engine_ends, self.api_server_ends = [], []
        for _ in range(api_servers):
            their_commands_r, their_commands_w = ctx.Pipe(duplex=False)
            their_outputs_r, their_outputs_w = ctx.Pipe(duplex=False)
            engine_ends.append((their_commands_r, their_outputs_w))
            self.api_server_ends.append((their_outputs_r, their_commands_w))
        self.process = ctx.Process(target=_engine_process_main, args=(load, commands_r, outputs_w, engine_ends),
                                   name="compiled_llm-engine", daemon=True)
        self.process.start()
        # the child's ends: closed here, so either side sees the other go
        for end in (commands_r, outputs_w, *(e for pair in engine_ends for e in pair)):
            end.close()
        self.channel = MessageChannel(_take_fd(outputs_r), _take_fd(commands_w))

    def poll(self) -> EngineCoreClient | None:
        """The client once the engine is ready, None while it loads; CompiledLLMError (it could
        not load) or EngineError (its process died), the process stopped, if it cannot be."""
        messages = self.channel.receive()
        if not messages:
            if self.channel.closed or not self.process.is_alive():
                self.stop()
                raise EngineError(f"the engine process exited while loading (exit code {self.process.exitcode})")
            return None
        message = messages[0]
        if message[0] == "failed":
            self.stop()
            raise CompiledLLMError(f"the engine could not start: {message[1]}")
        _, info, tokenizer, snapshot = message
        return EngineCoreClient(self.channel, info, tokenizer, snapshot, process=self.process)

    def fileno(self) -> int:
        """What to wait on for the engine's next word (``select``)."""
        return self.channel.read_fd

    def wait(self) -> EngineCoreClient:
        """Block until ``poll`` has the client (loading may build the engine: minutes)."""
        try:
            while (client := self.poll()) is None:
                select.select([self], [], [], 1.0)
        except BaseException:
            self.stop()
            raise
        return client

    def stop(self) -> None:
        self.close_api_server_ends()
        _stop_process(self.process, self.channel)

    def close_api_server_ends(self) -> None:
        """Close this process's copies of the API servers' ends (once their processes hold
        theirs), so that the engine sees an API server go when its process ends."""
        for pair in self.api_server_ends:
            for end in pair:
                end.close()


def wait_all(starting: Sequence, poll_s: float = 1.0) -> list[EngineCoreClient]:
    """Wait until every engine of ``starting`` (loading at the same time: ``StartingEngine``s,
    or anything with their ``poll``, ``stop`` and ``fileno``) is ready: their clients, in
    order, looking again at least every ``poll_s`` seconds. The first that cannot start, or an
    interrupt, stops all the others at once (loading may take minutes), and its reason is
    raised, naming the data-parallel replica when there are several."""
    ready: dict[int, EngineCoreClient] = {}
    try:
        while len(ready) < len(starting):
            for i, engine in enumerate(starting):
                if i in ready:
                    continue
                try:
                    client = engine.poll()
                except CompiledLLMError as error:
                    if len(starting) == 1:
                        raise
                    raise type(error)(f"data-parallel replica {i} of {len(starting)}: {error}") from error
                if client is not None:
                    ready[i] = client
            pending = [e for i, e in enumerate(starting) if i not in ready]
            if pending:
                select.select(pending, [], [], poll_s)
    except BaseException:
        for engine in starting:
            engine.stop()
        raise
    return [ready[i] for i in range(len(starting))]


def _take_fd(connection) -> int:
    """The connection's pipe end as a file descriptor of our own (the connection is closed)."""
    fd = os.dup(connection.fileno())
    connection.close()
    return fd


def _engine_process_main(load, commands, outputs, api_server_ends=()) -> None:
    run_engine_process(load, _take_fd(commands), _take_fd(outputs),
                       [(_take_fd(r), _take_fd(w)) for r, w in api_server_ends])


def _stop_process(process, channel: MessageChannel | None) -> None:
    if channel is not None:
        channel.close()  # a live process sees its pipe close and ends
        process.join(10.0)
    if process.is_alive():
        logger.warning("the engine process did not stop; killing it")
        process.kill()
        process.join(5.0)
