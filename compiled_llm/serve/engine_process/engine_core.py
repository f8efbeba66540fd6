"""The engine side of the server: one ``LLMEngine`` stepping as fast as the device allows, fed and
read by the front end over a ``MessageChannel`` (messages in ``engine_messages``). vLLM calls
this its EngineCore.

``compiled-llm serve`` runs it in a process of its own (``run_engine_process``). A stepping
thread beside the HTTP event loop would share the GIL with it: every step would wait for the
event loop's Python (request parsing, JSON, server-sent events) and every stream for the engine's,
and under load the engine stepped at a fraction of its offline rate. In its own process the engine
steps as it does offline, and the front end takes whatever outputs have piled up at each turn of
its loop. Tests also run it in a thread (``EngineCoreClient.in_thread``), through the same
messages.

The loop: take the commands that have arrived (submissions, aborts), run one step while anything
is unfinished, send one message with what changed, and sleep in ``select`` only when idle. While
every front end has yet to read an earlier message than the last, the streams' new tokens wait
(their first tokens and ends do not) and go merged once one has caught up: a busy front end
merges them anyway, and building every stream's delta every step is Python over every row. A
request's failure in ``add_request`` or in a step reaches its caller as an error; the other
requests carry on, as in ``EngineLoop``. ``LLM`` over data-parallel replicas drives engine
processes too, and asks them for what it asks an engine in its own process (``CALLS``: the stats,
the CUDA graphs captured); a call that touches the device waits until no request is in flight.

Front ends. With one API server (``compiled-llm serve``'s default) the process that started the
engine is its only front end, over one channel: it submits, reads every step's message, and its
"shutdown", or its going away, stops the engine. With ``--api-server-count N`` the engine also
takes one channel per API-server process (``front_ends``): each submits its own requests (their
ids unique per front end) and hears back only about them: their outputs and errors, which of
them were scheduled, with the engine's snapshot; the first front end also hears of every step
(it alone counts the engine's counters and logs the stats lines, ``ServerMetrics``). The owner's
channel then carries only "ready" and "shutdown". A front end that goes away has its requests
aborted (nobody would read them) and the engine serves the others on; whether the server carries
on without it is the owner's call (``serve.openai.api_servers``: it does not).
"""

from __future__ import annotations

import gc
import logging
import os
import select
import signal
import sys
import traceback
from typing import Callable, Sequence

from compiled_llm.errors import CompiledLLMError
from compiled_llm.serve.engine_process.engine_messages import EngineInfo, EngineSnapshot, encode_output
from compiled_llm.serve.llm_engine import LLMEngine
from compiled_llm.serve.engine_process.message_channel import MessageChannel

logger = logging.getLogger("compiled_llm.serve.engine_process.engine_core")

# What a front end may call on the engine: name -> (what it runs, whether it waits for the engine
# to be idle: a capture must not run beside a step queued on the device)
CALLS: dict[str, tuple[Callable[[LLMEngine], object], bool]] = {
    "stats": (lambda engine: engine.stats, False),
    "capture_cuda_graphs": (lambda engine: engine.capture_cuda_graphs(), True),
}


# Streamed tokens are held back at most this many steps in a row (~60 ms of a small model's
# decode): a front end that has stopped reading for longer gets them as they come again
MAX_HELD_STEPS = 32


class EngineCore:
    def __init__(self, engine: LLMEngine, channel: MessageChannel, front_ends: Sequence[MessageChannel] = ()):
        """``channel``: the owner's (the process that started the engine); ``front_ends``: the
        API servers' channels, when they are not the owner's (module docstring)."""
        self.engine = engine
        self.channel = channel
        # the channels requests come over; None once that front end has gone
        self.front_ends: list[MessageChannel | None] = list(front_ends) or [channel]
        self._several = bool(front_ends)
        self._owner: dict[str, int] = {}  # request id -> its front end, with several of them
        self._running: set[str] = set()  # requests in the engine
        self._waiting: set[str] = set()  # added, not yet seen leaving the waiting queue
        self._outputs: list = []
        self._errors: list[tuple[str, str, str]] = []
        self._stepped = False
        self._stop = False
        self._idle_calls: list[tuple] = []  # calls waiting for the engine to be idle
        self._held_steps = 0  # steps in a row whose streamed tokens were held back

    def run(self) -> None:
        """Until the owner says shutdown or goes away."""
        engine = self.engine
        while True:
            if self._several:
                self._receive_all()
            else:
                for message in self.channel.receive():
                    self._apply(0, message)
            if self._stop or self.channel.closed:
                break
            busy = engine.has_unfinished_requests()
            if busy:
                self._step()
            elif self._idle_calls:
                calls, self._idle_calls = self._idle_calls, []
                for call_id, method in calls:
                    self._call(call_id, method)
            self._report()
            if self._several:
                # a front end is sent a message only when it has outputs: what its pipe could
                # not take goes now, not with its next output (its last tokens would wait for it)
                for channel in self.channels():
                    if channel.pending:
                        channel.flush()
            if not busy:
                self._wait()
        self._report()
        for channel in self.channels():
            channel.flush()

    def channels(self) -> list[MessageChannel]:
        """The owner's channel and the front ends' still open."""
        return [self.channel, *(c for c in self.front_ends if c is not None and c is not self.channel)]

    def _receive_all(self) -> None:
        for message in self.channel.receive():
            if message[0] == "shutdown":
                self._stop = True
        for index, channel in enumerate(self.front_ends):
            if channel is None:
                continue
            for message in channel.receive():
                self._apply(index, message)
            if channel.closed:
                self._front_end_gone(index)

    def _front_end_gone(self, index: int) -> None:
        """A front end's channel closed (its process ended): abort its requests, forget it."""
        self.front_ends[index].close()
        self.front_ends[index] = None
        mine = [rid for rid, owner in self._owner.items() if owner == index]
        for rid in mine:
            self.engine.abort_request(rid)
            self._running.discard(rid)
            self._waiting.discard(rid)
            del self._owner[rid]
        if mine:  # else it stopped as told, its requests done
            logger.warning("API server %d went away; aborted its %d requests", index, len(mine))

    def _wait(self) -> None:
        """Sleep until a command arrives (or a pipe takes more of what is waiting to go)."""
        channels = self.channels()
        readers = [c.read_fd for c in channels]
        writers = [c.write_fd for c in channels if c.pending]
        _, writable, _ = select.select(readers, writers, [])
        for channel in channels:
            if channel.write_fd in writable:
                channel.flush()

    # ---- commands ------------------------------------------------------------------------------

    def _apply(self, front_end: int, message: tuple) -> None:
        kind = message[0]
        if kind == "add":
            _, requests, stream = message
            for request_id, text, ids, params in requests:
                if self._several:
                    self._owner[request_id] = front_end
                try:
                    self.engine.add_request(None, request_id=request_id, stream=stream,
                                            _validated=(text, ids, params))
                except Exception as e:  # only this request's caller hears of it
                    self._errors.append((request_id, "invalid", str(e)))
                    continue
                self._running.add(request_id)
                self._waiting.add(request_id)
        elif kind == "abort":
            for request_id in message[1]:
                out = self.engine.abort_request(request_id)
                if out is not None:
                    self._add(encode_output(out))
        elif kind == "call":
            _, call_id, method = message
            if method in CALLS and CALLS[method][1]:
                self._idle_calls.append((call_id, method))
            else:
                self._call(call_id, method)
        elif kind == "shutdown":
            if not self._several:  # a front end of several does not stop the engine the others use
                self._stop = True
        else:
            raise ValueError(f"unknown command {kind!r}")

    def _call(self, call_id, method: str) -> None:
        if method not in CALLS:
            self.channel.send(("called", call_id, f"unknown call {method!r}", None))
            return
        try:
            value = CALLS[method][0](self.engine)
        except Exception as e:
            logger.exception("the call %s failed", method)
            self.channel.send(("called", call_id, f"{type(e).__name__}: {e}", None))
            return
        self.channel.send(("called", call_id, None, value))

    # ---- stepping ------------------------------------------------------------------------------

    def _hold_streams(self) -> bool:
        """Whether this step's streamed tokens wait for a later one
        (``LLMEngine.step_deltas(hold_streams=True)``): every front end has yet to read outputs
        sent before the last message, and fewer than ``MAX_HELD_STEPS`` steps have been held in
        a row. One that has caught up gets every step's tokens, so no stream waits for another
        front end's reader."""
        channels = [c for c in self.front_ends if c is not None]
        hold = bool(channels) and self._held_steps < MAX_HELD_STEPS and all(c.reader_behind for c in channels)
        self._held_steps = self._held_steps + 1 if hold else 0
        return hold

    def _step(self) -> None:
        self._stepped = True
        try:
            deltas = self.engine.step_deltas(hold_streams=self._hold_streams())
        except Exception as e:
            failed = self.engine.failed_request_ids or list(self._running)
            # a rank is gone (the error names it): no step can run again, so the core stops once
            # these errors are sent, and the front end hears the engine lost (data-parallel:
            # routes around it)
            ranks_failed = getattr(self.engine.executor, "failure", None) is not None
            if ranks_failed:
                logger.error("an engine step failed: %s; aborting its %d requests and stopping", e, len(failed))
            else:
                logger.exception("an engine step failed; aborting its %d requests", len(failed))
            message = f"the engine step failed: {type(e).__name__}: {e}"
            for request_id in failed:
                self.engine.abort_request(request_id)
                if request_id in self._running:
                    self._running.discard(request_id)
                    self._errors.append((request_id, "engine", message))
            self._stop = self._stop or ranks_failed
            return
        for delta in deltas:
            self._add(delta)

    def _add(self, delta: tuple) -> None:
        if delta[1]:  # finished
            self._running.discard(delta[0])
        self._outputs.append(delta)

    def _scheduled(self) -> list[str]:
        """Requests that have left the waiting queue since the previous report (admission
        control counts the others)."""
        if not self._waiting:
            return []
        still = {s.request_id for s in self.engine.scheduler.waiting}
        left = [rid for rid in self._waiting if rid not in still]
        self._waiting.difference_update(left)
        return left

    def _report(self) -> None:
        scheduled = self._scheduled()
        if not (self._outputs or self._errors or scheduled or self._stepped):
            return
        snapshot = EngineSnapshot.of(self.engine)
        if self._several:
            self._report_to_each(scheduled, snapshot)
        else:
            self.channel.send(("step", self._outputs, self._errors, scheduled, snapshot))
        self._outputs, self._errors, self._stepped = [], [], False

    def _report_to_each(self, scheduled: list[str], snapshot: EngineSnapshot) -> None:
        """Each front end's share of a step: its requests' outputs, errors and scheduling, sent
        when it has any (the first front end's every step, for the engine's metrics)."""
        shares = [([], [], []) for _ in self.front_ends]
        owner = self._owner
        for delta in self._outputs:
            index = owner.pop(delta[0], None) if delta[1] else owner.get(delta[0])
            if index is not None:  # None: its front end has gone
                shares[index][0].append(delta)
        for error in self._errors:
            index = owner.pop(error[0], None)
            if index is not None:
                shares[index][1].append(error)
        for rid in scheduled:
            index = owner.get(rid)
            if index is not None:
                shares[index][2].append(rid)
        for index, (channel, (outputs, errors, left)) in enumerate(zip(self.front_ends, shares)):
            if channel is not None and (index == 0 or outputs or errors or left):
                channel.send(("step", outputs, errors, left, snapshot))


def run_engine_process(load: Callable[[], LLMEngine], read_fd: int, write_fd: int,
                       front_end_fds: Sequence[tuple[int, int]] = ()) -> None:
    """A spawned engine process's main: load the engine, say ready (or why not) to its owner,
    serve the front ends (the owner itself, or one channel per API server of
    ``front_end_fds``: (read, write) descriptors) until the owner says shutdown or goes away.
    Interrupts are the front end's to handle (Ctrl-C reaches the whole process group): this
    process ends when told, or when its owner's pipe closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    channel = MessageChannel(read_fd, write_fd)
    front_ends = [MessageChannel(r, w) for r, w in front_end_fds]
    try:
        engine = load()
    except Exception as e:
        logger.debug("loading the engine failed:\n%s", traceback.format_exc())
        channel.send(("failed", str(e) if isinstance(e, CompiledLLMError) else f"{type(e).__name__}: {e}"))
        _flush_before_exit(channel)
        return
    channel.send(("ready", EngineInfo.of(engine), engine.tokenizer, EngineSnapshot.of(engine)))
    # What loading made lives as long as the process: the collector need not scan it again
    # (a full collection over the model's objects is a pause of many milliseconds mid-step).
    # The first call of a custom op imports torch._dynamo, hundreds of modules: imported now,
    # they are frozen with the rest instead of weighing on every full collection while serving.
    import torch._dynamo  # noqa: F401

    gc.collect()
    gc.freeze()
    core = EngineCore(engine, channel, front_ends)
    core.run()
    for c in core.channels():
        _flush_before_exit(c)
    st = engine.stats
    logger.info("engine stopped: %d steps, %d with prompts (%.2f s), %d decode (%.2f s), %d tokens generated",
                st.steps, st.prefill_steps, st.prefill_s, st.decode_steps, st.decode_s, st.generated_tokens)
    _quiet_exit()


def _quiet_exit() -> None:
    """Nothing more goes to the stderr this process shares with its front end (a terminal, for
    LLM): the interpreter's exit would have triton's bindings report every object that
    ``gc.freeze`` kept from being finalized as leaked, some hundred lines per engine."""
    for handler in logging.getLogger("compiled_llm").handlers + logging.getLogger().handlers:
        handler.flush()
    sys.stderr.flush()
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    os.close(devnull)


def _flush_before_exit(channel: MessageChannel, timeout: float = 5.0) -> None:
    while not channel.flush():
        if not select.select([], [channel.write_fd], [], timeout)[1]:
            return
