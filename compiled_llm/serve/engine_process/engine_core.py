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
is unfinished, send one message with what changed, and sleep in ``select`` only when idle. A
request's failure in ``add_request`` or in a step reaches its caller as an error; the other
requests carry on, as in ``EngineLoop``. ``LLM`` over data-parallel replicas drives engine
processes too, and asks them for what it asks an engine in its own process (``CALLS``: the stats,
the CUDA graphs captured); a call that touches the device waits until no request is in flight.
"""

from __future__ import annotations

import gc
import logging
import os
import select
import signal
import sys
import traceback
from typing import Callable

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


class EngineCore:
    def __init__(self, engine: LLMEngine, channel: MessageChannel):
        self.engine = engine
        self.channel = channel
        self._running: set[str] = set()  # requests in the engine
        self._waiting: set[str] = set()  # added, not yet seen leaving the waiting queue
        self._outputs: list = []
        self._errors: list[tuple[str, str, str]] = []
        self._stepped = False
        self._stop = False
        self._idle_calls: list[tuple] = []  # calls waiting for the engine to be idle

    def run(self) -> None:
        """Until the front end says shutdown or goes away."""
        engine = self.engine
        while True:
            for message in self.channel.receive():
                self._apply(message)
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
            if not busy:
                self._wait()
        self._report()
        self.channel.flush()

    def _wait(self) -> None:
        """Sleep until a command arrives (or the pipe takes more of what is waiting to go)."""
        writers = [self.channel.write_fd] if self.channel.pending else []
        readable, writable, _ = select.select([self.channel.read_fd], writers, [])
        if writable:
            self.channel.flush()

    # ---- commands ------------------------------------------------------------------------------

    def _apply(self, message: tuple) -> None:
        kind = message[0]
        if kind == "add":
            _, requests, stream = message
            for request_id, text, ids, params in requests:
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

    def _step(self) -> None:
        self._stepped = True
        try:
            deltas = self.engine.step_deltas()
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
        self.channel.send(("step", self._outputs, self._errors, scheduled, EngineSnapshot.of(self.engine)))
        self._outputs, self._errors, self._stepped = [], [], False


def run_engine_process(load: Callable[[], LLMEngine], read_fd: int, write_fd: int) -> None:
    """A spawned engine process's main: load the engine, say ready (or why not), serve the
    front end until it says shutdown or goes away. Interrupts are the front end's to handle
    (Ctrl-C reaches the whole process group): this process ends when told, or when its pipe
    closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    channel = MessageChannel(read_fd, write_fd)
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
    EngineCore(engine, channel).run()
    _flush_before_exit(channel)
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
