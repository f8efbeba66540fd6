"""``compiled-llm serve --api-server-count N`` (vLLM's flag): N HTTP front-end processes, the API
servers, on the server's one port in front of the engine processes, so that parsing,
detokenizing and streaming a fully loaded engine's outputs take N cores instead of one event
loop's.

The processes:

- this one, the server's main process: it holds the port (``reserve_port``: a port that is
  taken fails at once, before anything loads), starts the engine processes (one per
  data-parallel replica) and waits for them to load, then spawns the API servers and watches
  them. It serves no request itself;
- each API server runs the app of ``api_server`` on a listening socket of its own, bound to the
  port with SO_REUSEPORT, so that the kernel spreads new connections evenly over them (one
  socket shared by all, as uvicorn's workers share theirs, lets one event loop accept a whole
  burst of connections before another wakes), over channels of its own to every engine process
  (``StartingEngine(load, api_servers=N)`` makes them; the API servers never talk to each
  other). Its engine request ids are its own, and each engine sends it only its requests'
  outputs (``engine_core``). With replicas each API server runs its own router over all of
  them: it balances the requests it accepted and remembers only their prefixes, so a prompt
  prefix first sent through one API server is unknown to another's router (the price of the
  flag with ``--data-parallel-size``). Admission control (the waiting limits) also counts per
  API server;
- /metrics: every API server writes its values to a directory this process makes and removes
  (prometheus_client's multiprocess mode, ``ServerMetrics``), and whichever answers reports the
  whole server; the first counts the engines' snapshots and logs the stats lines. /health
  answers for the API server that took the connection and its engines.

Stopping: SIGTERM is passed on (each API server drains, as a server of one does: 503 for new
requests, running ones finish for up to ``--shutdown-timeout`` seconds); Ctrl-C, or a second
SIGTERM, aborts. Once every API server has exited, the engines are told to stop and the metrics
directory goes. An API server that exits otherwise (killed, crashed) takes the server down, as
in vLLM: its clients' connections are gone and the engines abort its requests; the others
drain, and the server exits 1 for a supervisor to restart it. So does the loss of the engine
(the last replica): the API servers fail their requests and exit. Whatever kills this process,
nothing outlives it: its engines stop when their pipes to it close, and the API servers when
their engines do. An API server that does not stop in time is killed.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from typing import Callable, Sequence

from compiled_llm.errors import CompiledLLMError, first_line
from compiled_llm.serve.engine_process.dp_client import DataParallelClient
from compiled_llm.serve.engine_process.engine_core_client import EngineCoreClient, StartingEngine, wait_all
from compiled_llm.serve.llm_engine import LLMEngine
from compiled_llm.serve.metrics import share_metrics_across_processes
from compiled_llm.serve.openai.api_server import ApiServerProcess, log_ready, serve
from compiled_llm.serve.server_config import ServerConfig

logger = logging.getLogger("compiled_llm.serve.openai.api_servers")

# seconds an API server gets beyond its drain (or after Ctrl-C) before it is killed
STOP_GRACE_S = 10.0


def _socket(host: str, reuse_port: bool) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    return sock


def reserve_port(host: str, port: int) -> socket.socket:
    """A socket bound to (host, port) with SO_REUSEPORT, not listening: it holds the port (the
    one the OS chose, for port 0) for the API servers to bind theirs beside it
    (``api_server_socket``). A one-line error when the port is taken: it is bound once without
    SO_REUSEPORT first, which fails while anything holds it (another server's API servers
    included, which SO_REUSEPORT alone would let share it)."""
    if not hasattr(socket, "SO_REUSEPORT"):
        raise CompiledLLMError("api_server_count > 1 needs SO_REUSEPORT (Linux), which this platform lacks")
    for reuse_port in (False, True):
        sock = _socket(host, reuse_port)
        try:
            sock.bind((host, port))
        except OSError as e:
            sock.close()
            raise CompiledLLMError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
        if not reuse_port:
            port = sock.getsockname()[1]
            sock.close()
    return sock


def api_server_socket(host: str, port: int) -> socket.socket:
    """An API server's own socket on the server's port (uvicorn makes it listen)."""
    sock = _socket(host, reuse_port=True)
    sock.bind((host, port))
    return sock


def serve_api_servers(loads: Sequence[Callable[[], LLMEngine]], config: ServerConfig, model_name: str | None = None,
                      setup: Callable[[], None] | None = None) -> int:
    """Serve with ``config.api_server_count`` API servers over one engine process per
    ``loads[i]`` (module docstring), until stopped; the exit code as ``serve``'s (0 after a
    drain, 1 when an API server or the engine died), KeyboardInterrupt after Ctrl-C.
    ``setup``: called first in each API server's process (a picklable function: logging)."""
    sock = reserve_port(config.host, config.port)
    metrics_dir = None
    try:
        starting = [StartingEngine(load, api_servers=config.api_server_count) for load in loads]
        engines = wait_all(starting)
        try:
            metrics_dir = tempfile.mkdtemp(prefix="compiled_llm_metrics_")
            supervisor = ApiServers(sock, starting, engines, config, model_name, metrics_dir, setup)
            return asyncio.run(supervisor.run())
        except BaseException:
            # an interrupt before the supervisor's loop closes them: the engines ignore SIGTERM
            # and would hold the interpreter's exit (multiprocessing joins its children)
            for engine in engines:
                engine.kill()
            raise
    finally:
        sock.close()
        if metrics_dir is not None:
            shutil.rmtree(metrics_dir, ignore_errors=True)


class ApiServers:
    """The API-server processes of one server, and the engines under them (module docstring):
    ``run`` spawns them and returns once they have all exited and the engines have stopped."""

    def __init__(self, sock: socket.socket, starting: Sequence[StartingEngine], engines: Sequence[EngineCoreClient],
                 config: ServerConfig, model_name: str | None, metrics_dir: str, setup: Callable[[], None] | None):
        self.sock = sock  # the reserved port
        self.port = sock.getsockname()[1]  # the one the OS chose, for port 0
        self.starting = list(starting)
        self.engines = list(engines)
        self.config = config
        self.model_name = model_name
        self.metrics_dir = metrics_dir
        self.setup = setup
        self.processes: list[multiprocessing.process.BaseProcess] = []
        self._status: list = []  # each API server's pipe that says "ready"
        self._ready = 0
        self._exited: set[int] = set()
        self._lost_engines: set[int] = set()
        self._stopping = False
        self._signalled = False  # a signal stopped the API servers: exits by SIGTERM/SIGINT are clean
        self._failed = False
        self._interrupted = False
        self._kill_timer: asyncio.TimerHandle | None = None
        self._done: asyncio.Event | None = None

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        self._done = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._on_signal, sig)
        try:
            for replica, engine in enumerate(self.engines):
                engine.start(functools.partial(self._engine_message, replica))
            self._spawn(loop)
            await self._done.wait()
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
            if self._kill_timer is not None:
                self._kill_timer.cancel()
            for process in self.processes:  # only after an error here: they have all exited otherwise
                if process.is_alive():
                    process.kill()
                process.join(5.0)
            for status in self._status:
                loop.remove_reader(status.fileno())
                status.close()
            await asyncio.gather(*(engine.close() for engine in self.engines))
        if self._interrupted:
            raise KeyboardInterrupt
        clean = (0, -signal.SIGTERM, -signal.SIGINT) if self._signalled else (0,)
        failed = self._failed or any(p.exitcode not in clean for p in self.processes)
        return 1 if failed else 0

    # ---- starting ------------------------------------------------------------------------------

    def _spawn(self, loop: asyncio.AbstractEventLoop) -> None:
        ctx = multiprocessing.get_context("spawn")
        count, created = self.config.api_server_count, int(time.time())
        for index in range(count):
            place = ApiServerProcess(index, count, self.metrics_dir, created)
            replicas = [(e.info, e.tokenizer, e.start_snapshot, s.api_server_ends[index])
                        for e, s in zip(self.engines, self.starting)]
            status_r, status_w = ctx.Pipe(duplex=False)
            process = ctx.Process(target=run_api_server, name=f"compiled_llm-api-server-{index}", daemon=True,
                                  args=(place, self.port, replicas, self.config, self.model_name, self.setup, status_w))
            process.start()
            status_w.close()
            self.processes.append(process)
            self._status.append(status_r)
            loop.add_reader(process.sentinel, self._on_exit, loop, index)
            loop.add_reader(status_r.fileno(), self._on_status, loop, status_r)
        # the API servers hold theirs now: with these closed, an engine sees an API server go
        for engine in self.starting:
            engine.close_api_server_ends()

    def _on_status(self, loop: asyncio.AbstractEventLoop, status) -> None:
        try:
            status.recv()  # "ready"
        except (EOFError, OSError):  # its process has ended (its exit is handled on its own)
            loop.remove_reader(status.fileno())
            return
        self._ready += 1
        if self._ready == len(self.processes):
            log_ready(self.config.served_model_name or self.model_name or self.engines[0].info.name,
                      self.config.host, self.port, self.config, len(self.processes))

    # ---- stopping ------------------------------------------------------------------------------

    def _on_signal(self, sig: int) -> None:
        self._signalled = True
        if sig == signal.SIGTERM and not self._stopping:
            logger.info("SIGTERM: the API servers refuse new requests and let running ones finish for up to %g s",
                        self.config.shutdown_timeout)
            self._stop(signal.SIGTERM, self.config.shutdown_timeout + STOP_GRACE_S)
        else:  # Ctrl-C, or a second SIGTERM: abort
            self._interrupted = self._interrupted or sig == signal.SIGINT
            self._stop(signal.SIGINT, STOP_GRACE_S)

    def _stop(self, sig: int, within: float) -> None:
        """Pass ``sig`` on to every API server still running, and kill those still running
        ``within`` seconds from now."""
        self._stopping = True
        for index, process in enumerate(self.processes):
            if index not in self._exited:
                with contextlib.suppress(ProcessLookupError):  # it has just exited
                    os.kill(process.pid, sig)
        self._kill_after(within)

    def _kill_after(self, within: float) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within
        if self._kill_timer is None or deadline < self._kill_timer.when():
            if self._kill_timer is not None:
                self._kill_timer.cancel()
            self._kill_timer = loop.call_at(deadline, self._kill_the_rest)

    def _kill_the_rest(self) -> None:
        for index, process in enumerate(self.processes):
            if index not in self._exited:
                logger.warning("API server %d (pid %d) did not stop in time; killing it", index, process.pid)
                process.kill()

    def _on_exit(self, loop: asyncio.AbstractEventLoop, index: int) -> None:
        process = self.processes[index]
        loop.remove_reader(process.sentinel)
        process.join()
        self._exited.add(index)
        if not self._stopping:
            self._failed = True
            if not any(engine.alive for engine in self.engines):
                # it exited because the engine did (said once the engine's pipe is seen closed);
                # the others do too
                self._stopping = True
                self._kill_after(self.config.shutdown_timeout + STOP_GRACE_S)
            else:
                # vLLM's rule: the server does not carry on short of an API server
                logger.error("API server %d (pid %d) exited unexpectedly (%s); stopping the server", index,
                             process.pid, _exit_text(process.exitcode))
                self._stop(signal.SIGTERM, self.config.shutdown_timeout + STOP_GRACE_S)
        if len(self._exited) == len(self.processes):
            self._done.set()

    def _engine_message(self, replica: int, message: tuple) -> None:
        if message[0] != "lost":
            return
        self._lost_engines.add(replica)
        if len(self._lost_engines) == len(self.engines):
            # the API servers fail their requests and exit on their own, as a server of one does
            logger.error("%s; the server stops", message[1] if len(self.engines) == 1 else
                         f"every data-parallel replica stopped (the last, replica {replica}: {message[1]})")
            self._failed = self._stopping = True
            self._kill_after(self.config.shutdown_timeout + STOP_GRACE_S)


def run_api_server(place: ApiServerProcess, port: int, replicas: list[tuple], config: ServerConfig,
                   model_name: str | None, setup: Callable[[], None] | None, status) -> None:
    """An API server process's main: the app over its channels to the engines (``replicas``:
    each engine's info, tokenizer, start snapshot and this process's pipe ends), on a socket of
    its own on ``port``; ``status`` hears "ready" once it accepts connections. Exits with
    ``serve``'s code."""
    code = 0
    try:
        if setup is not None:
            setup()
        sock = api_server_socket(config.host, port)
        share_metrics_across_processes(place.metrics_dir)
        clients = [EngineCoreClient.attach(ends, info, tokenizer, snapshot)
                   for info, tokenizer, snapshot, ends in replicas]
        core = clients[0] if len(clients) == 1 else DataParallelClient(
            clients, load_balance_method=config.load_balance_method)
        code = serve(core, config, model_name, api_server=place, sock=sock, on_ready=lambda: status.send("ready"))
    except KeyboardInterrupt:  # Ctrl-C: uvicorn raises it again once the server has stopped
        pass
    except Exception as e:  # noqa: BLE001 - one line; the supervisor then stops the server
        logger.error("API server %d could not serve: %s", place.index, first_line(e))
        code = 1
    sys.exit(code)


def _exit_text(code: int | None) -> str:
    if code is not None and code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"
