"""``MultiprocExecutor``: tensor-parallel ranks 1..N-1 as processes of this host; this process
is rank 0.

Start-up: every worker process, a fresh interpreter on this process's ``sys.path`` (so that the
functions ``run_on_ranks`` sends are found by the same names), loads its rank's weights from the
engine directory (only its own file) and says so; then all ranks join one torch.distributed
group through a file store: NCCL on CUDA (rank r on cuda:r), gloo on CPU. A worker that fails to
load is an error here, before anyone waits in a collective. On CUDA the ranks then open the
custom all-reduce's workspace together (kernels/triton_all_reduce.py), unless asked not to; all
use it or none do.

Messages: rank 0 sends each call pickled once (plain pickle: a tensor travels by value, as
multiprocessing's handles to shared memory open only in processes it started); a worker answers
only the calls that wait for its result (``run_on_ranks``), and says so when it fails.

Failure: a monitor thread watches every worker. When one dies or reports an error, the others
are killed at once: a collective rank 0 waits in then fails (gloo and NCCL see the closed
connection; the group's timeout is the backstop), and every later call raises ``EngineError``
naming the rank. Shutting the failed engine down ends a gloo group, so the process can start
another engine; an NCCL group stays (its teardown would wait for the dead rank). Workers end
with this process, even when it is killed: each watches its parent.
"""

from __future__ import annotations

import atexit
import datetime
import json
import logging
import os
import pickle
import queue
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from compiled_llm.errors import EngineError, first_line
from compiled_llm.graph import collective_ops
from compiled_llm.engine import pipeline_stage
from compiled_llm.serve.executor.rank_failures import RankFailures, rank_name

log = logging.getLogger(__name__)

# How long a rank waits in a collective for the others before the group fails the step. Ranks
# run the same work, so only a stuck or dead rank makes another wait this long; the monitor sees
# a dead one sooner. NCCL's is longer: its watchdog ends the process rather than the call, and
# a first step may compile kernels.
COLLECTIVE_TIMEOUT_S = {"gloo": 20.0, "nccl": 300.0}
LOAD_TIMEOUT_S = 900.0
_STOP_GRACE_S = 5.0
_RESULT_POLL_S = 0.05  # how often a wait for the ranks' results looks for a failed rank


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def rank_device(device: torch.device, rank: int) -> torch.device:
    return torch.device("cuda", rank) if device.type == "cuda" else torch.device("cpu")


def check_devices(device: torch.device, size: int, tp_size: int | None = None) -> None:
    if device.type == "cuda" and torch.cuda.device_count() < size:
        if tp_size is not None and tp_size != size:
            raise EngineError(
                f"the engine runs {size // tp_size} pipeline stages x {tp_size} tensor-parallel ranks = {size} GPUs "
                f"but {torch.cuda.device_count()} are visible; rebuild it with a smaller --pipeline-parallel-size "
                f"or --tensor-parallel-size")
        raise EngineError(
            f"the engine is sharded over {size} GPUs but {torch.cuda.device_count()} are visible; "
            f"rebuild it with a smaller --tensor-parallel-size"
        )


def init_group(device: torch.device, rank: int, size: int, init_method: str, timeout_s: float,
               custom_all_reduce: bool, tp_size: int | None = None) -> bool:
    """Join the group through ``init_method`` (a ``file://`` store on one host, a ``tcp://``
    store that rank 0 hosts across hosts); on GPUs also open the custom all-reduce's workspace
    (a collective too), unless ``custom_all_reduce`` is off. True when it opened, which it does
    on every rank or on none (ranks that disagreed would wait in different collectives). With
    ``tp_size`` below ``size`` the ranks are pipeline stages of ``tp_size`` ranks each
    (stage-major): each stage's collectives run over a group of its own."""
    if dist.is_initialized():
        raise EngineError("torch.distributed is already initialized in this process; a tensor-parallel engine starts its own group")
    dist.init_process_group(
        backend_for(device), init_method=init_method, rank=rank, world_size=size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    collective_ops.set_group(None)  # not a failed engine's stage group, whose process group is gone
    pipeline_stage.set_logits_group(None)
    if tp_size is not None and tp_size < size:
        # every rank makes every stage's group, in the same order (new_group is collective)
        for first in range(0, size, tp_size):
            group = dist.new_group(list(range(first, first + tp_size)))
            if first <= rank < first + tp_size:
                collective_ops.set_group(group)
        pipeline_stage.set_logits_group(dist.new_group([0, size - tp_size]))
    if device.type != "cuda" or not custom_all_reduce:
        return False
    from compiled_llm.kernels import triton_all_reduce

    opened = triton_all_reduce.open_workspace(device, timeout_s=min(timeout_s, triton_all_reduce.DEFAULT_TIMEOUT_S))
    return opened is not None


def end_group(device: torch.device) -> None:
    """Leave the group, every rank together (NCCL's teardown waits for the others)."""
    collective_ops.set_group(None)
    pipeline_stage.set_logits_group(None)
    if device.type == "cuda":
        from compiled_llm.kernels import triton_all_reduce

        torch.cuda.synchronize(device)
        triton_all_reduce.close_workspace(device)
    dist.destroy_process_group()



class MultiprocExecutor(RankFailures):
    def __init__(self, engine_dir: Path, size: int, device: torch.device, timeout_s: float | None = None,
                 custom_all_reduce: bool = True, tp_size: int | None = None):
        """``size`` ranks in all; ``tp_size`` per pipeline stage (None: one stage of ``size``)."""
        device = torch.device(device)
        timeout_s = timeout_s or COLLECTIVE_TIMEOUT_S[backend_for(device)]
        tp_size = tp_size or size
        check_devices(device, size, tp_size)
        self.size = size
        self.tp_size = tp_size
        self._device = device
        if custom_all_reduce and device.type == "cuda" and not _symmetric_memory_fresh():
            log.info("this process opened a custom all-reduce workspace before; this tensor-parallel engine's "
                     "all-reduces go through NCCL (torch counts symmetric-memory rendezvous per process: pytorch#196082)")
            custom_all_reduce = False
        # whether the steps' all-reduces that fit its slot run the custom kernel (else NCCL's)
        self.custom_all_reduce = False
        self._init_failures()
        # run on rank 0 before the group ends (the runner drops its CUDA graphs: NCCL's
        # teardown waits for graphs that captured its collectives)
        self.before_teardown: list[Callable[[], None]] = []
        self._dir = Path(tempfile.mkdtemp(prefix="cllm-tp-"))
        store = self._dir / "store"
        self._procs: list[subprocess.Popen] = []
        self._conns: list[Connection] = []
        # each rank's answers to run_on_ranks as (call number, result), in order; the monitor
        # thread reads every socket. The number ties an answer to its call: a wait cut short
        # (say, by Ctrl-C) leaves answers that the next call must not take for its own.
        self._results: list[queue.SimpleQueue] = [queue.SimpleQueue() for _ in range(1, size)]
        self._calls = 0
        # one reader of the sockets at a time (the monitor, or check() finding a dead rank), each
        # acting on what it read before the other reads: a dying rank's error is never lost
        # between them, and its text, not "exited", names the failure
        self._receive_lock = threading.Lock()
        try:
            for rank in range(1, size):
                ours, theirs = socket.socketpair()
                cmd = [sys.executable, "-m", __name__, str(engine_dir), str(rank), str(size), device.type, str(store),
                       str(theirs.fileno()), str(os.getpid()), str(timeout_s), str(int(custom_all_reduce)),
                       str(tp_size), json.dumps([str(p) for p in sys.path])]
                # a fresh interpreter, not multiprocessing: nothing of the caller's __main__ is
                # re-run, and a daemonic engine process may start it too
                self._procs.append(subprocess.Popen(cmd, pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL))
                theirs.close()
                self._conns.append(Connection(ours.detach()))
            self._wait_ready()
            self.custom_all_reduce = init_group(device, 0, size, f"file://{store}", timeout_s, custom_all_reduce,
                                                tp_size)
        except BaseException:
            self._stop_ranks()
            shutil.rmtree(self._dir, ignore_errors=True)
            raise
        self._monitor = threading.Thread(target=self._watch, name="tp-monitor", daemon=True)
        self._monitor.start()
        atexit.register(_shutdown_ref, weakref.ref(self))

    # ---- the interface (see the package docstring) ----------------------------------------------

    def send(self, method: str, *args) -> None:
        self._post(method, args, reply=None)

    def ask(self, method: str, *args) -> list[Any]:
        """``send``, then wait for every other rank's result, rank 1 first."""
        self._calls += 1
        self._post(method, args, reply=self._calls)
        return [self._result(rank, self._calls) for rank in range(1, self.size)]

    def run_on_ranks(self, fn: Callable[..., Any], *args, wait: bool = True) -> list[Any] | None:
        """Have every other rank call ``fn(model, state, *args)``, in order with what ``send``
        sends: ``model`` is the rank's ``LoadedModel``, ``state`` a dict the rank keeps for such
        functions between calls. ``fn`` travels by name (a module-level function, importable in
        the workers), ``args`` by value.

        Returns the ranks' results, rank 1 first. With ``wait=False`` it returns at once and the
        results are dropped: what a function that meets rank 0 in a collective needs, since
        rank 0 must run its own side before any rank returns. A function that raises fails the
        ranks as a dying rank does: ``EngineError`` naming the rank, now or at the next call."""
        if fn.__module__ == "__main__" or "<locals>" in fn.__qualname__:
            # the ranks find fn by module and name; theirs is not the caller's __main__
            raise TypeError(f"run_on_ranks needs a function importable by name, not {fn.__module__}.{fn.__qualname__}; "
                            "define it at the top level of a module")
        if not wait:
            self.send("run", fn, *args)
            return None
        return self.ask("run", fn, *args)

    def check(self, wait_s: float = 0.0) -> None:
        """Raise EngineError if a rank has failed or the engine was shut down; with ``wait_s``,
        give a rank that is ending (a collective just failed) that long to be seen."""
        self._refuse_if_shut_down()
        deadline = time.monotonic() + wait_s
        while self.failure is None:
            dead = next((r for r, p in enumerate(self._procs, start=1) if p.poll() is not None), None)
            if dead is not None:
                with self._receive_lock:
                    last = self._receive(dead) if self._conns[dead - 1].poll() else None
                    self._fail(self._describe(dead, last))
            elif time.monotonic() >= deadline:
                return
            else:
                time.sleep(0.05)
        raise EngineError(self.failure)

    def shutdown(self) -> None:
        failed = self._begin_stop()
        if failed is None:
            return
        for conn in self._conns:
            try:
                conn.send(None)
            except OSError:
                pass
        # every rank tears the group down together (NCCL's waits for the others). After a
        # failure the ranks it would wait for are gone: gloo's teardown waits for no one, so this
        # process can start another group; NCCL's could wait for ever, so its group is left
        if dist.is_initialized() and not failed:
            for release in self.before_teardown:
                release()
            end_group(self._device)
        elif dist.is_initialized() and backend_for(self._device) == "gloo":
            dist.destroy_process_group()
        deadline = time.monotonic() + _STOP_GRACE_S
        for proc in self._procs:
            try:
                proc.wait(max(deadline - time.monotonic(), 0))
            except subprocess.TimeoutExpired:
                pass
        self._stop_ranks()
        shutil.rmtree(self._dir, ignore_errors=True)

    # ---- messages ----------------------------------------------------------------------------------

    def _post(self, method: str, args: tuple, reply: int | None) -> None:
        """``RankWorker.<method>(*args)`` on every other rank; ``reply``: the call's number, with
        which each rank answers with its result (None: no answer)."""
        self.check()
        message = pickle.dumps((method, args, reply))  # before any rank is sent anything
        for rank, conn in enumerate(self._conns, start=1):
            try:
                conn.send_bytes(message)
            except OSError:
                self._fail(f"{self._name(rank)} is gone (its pipe closed)")
                self.check()

    def _result(self, rank: int, call: int) -> Any:
        """Rank ``rank``'s answer to call number ``call`` (answers to earlier calls, whose wait
        was cut short, are dropped); EngineError once a rank fails."""
        while True:
            try:
                number, result = self._results[rank - 1].get(timeout=_RESULT_POLL_S)
            except queue.Empty:
                self.check()
                continue
            if number == call:
                return result

    # ---- start-up and failure ---------------------------------------------------------------------

    def _wait_ready(self) -> None:
        waiting = dict(enumerate(self._conns, start=1))
        deadline = time.monotonic() + LOAD_TIMEOUT_S
        while waiting:
            ready = wait(list(waiting.values()), timeout=max(deadline - time.monotonic(), 0))
            if not ready:
                raise EngineError(f"tensor-parallel ranks {sorted(waiting)} did not load within {LOAD_TIMEOUT_S:.0f} s")
            for conn in ready:
                rank = next(r for r, c in waiting.items() if c is conn)
                message = self._receive(rank)
                if message is None or message[0] != "ready":
                    raise EngineError(self._describe(rank, message))
                waiting.pop(rank)

    def _receive(self, rank: int):
        try:
            return self._conns[rank - 1].recv()
        except (EOFError, OSError):  # the process is gone
            return None

    def _name(self, rank: int) -> str:
        return rank_name(rank, self.size, self.tp_size)

    def _describe(self, rank: int, message) -> str:
        if message is not None and message[0] == "error":
            return f"{self._name(rank)} failed: {message[1]}"
        proc = self._procs[rank - 1]
        try:
            status = proc.wait(2.0)
        except subprocess.TimeoutExpired:
            status = "unknown"
        return f"{self._name(rank)} (pid {proc.pid}) exited with status {status}"

    def _watch(self) -> None:
        """After start-up a worker sends only its results (``run_on_ranks``), which go to its
        queue; any other message, or the end of its socket, is a failure."""
        ranks = {c: r for r, c in enumerate(self._conns, start=1)}
        while not self._stopping and self.failure is None:
            ready = wait(list(ranks), timeout=1.0)
            if self._stopping:
                return
            for conn in ready:
                rank = ranks[conn]
                with self._receive_lock:
                    if self.failure is not None:  # check() read and failed it first
                        return
                    try:
                        message = self._receive(rank)
                    except Exception as e:  # noqa: BLE001 - a result this process cannot unpickle
                        self._fail(f"{self._name(rank)} sent a result rank 0 cannot read: {first_line(e)}")
                        return
                    if message is None or message[0] != "result":
                        self._fail(self._describe(rank, message))
                        return
                    self._results[rank - 1].put((message[1], message[2]))

    def _stop_ranks(self) -> None:
        for proc in self._procs:
            if proc.poll() is None:
                proc.kill()
        for proc in self._procs:
            try:
                proc.wait(_STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                log.warning("tensor-parallel worker pid %d did not end after SIGKILL", proc.pid)


def _symmetric_memory_fresh() -> bool:
    """Whether this process has not yet rendezvoused symmetric memory. torch before the fix of
    pytorch#196082 names a rendezvous's store keys by how many the process has made, so a second
    engine's rank 0 and its fresh workers would wait on different keys for ever."""
    from compiled_llm.kernels import triton_all_reduce

    return triton_all_reduce.rendezvous_count() == 0


def _shutdown_ref(ref) -> None:
    executor = ref()
    if executor is not None:
        executor.shutdown()


# ---- the worker process -------------------------------------------------------------------------


def _exit_with_parent(parent_pid: int) -> None:
    """A worker must not outlive rank 0's process, however that ends (even SIGKILL)."""
    while True:
        if os.getppid() != parent_pid:
            os._exit(1)
        time.sleep(0.5)


def _worker_main(engine_dir: str, rank: int, size: int, device_type: str, store: str, conn: Connection,
                 timeout_s: float, custom_all_reduce: bool, tp_size: int) -> None:
    try:
        from compiled_llm.engine.artifact import load_engine
        from compiled_llm.serve.executor.rank_worker import RankWorker

        device = rank_device(torch.device(device_type), rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        worker = RankWorker(load_engine(engine_dir, device=device, rank=rank))
        conn.send(("ready", None))
        init_group(device, rank, size, f"file://{store}", timeout_s, custom_all_reduce, tp_size)
        while True:
            message = conn.recv()
            if message is None:
                worker.release_graphs()  # before the group ends: see MultiprocExecutor.before_teardown
                break
            method, args, reply = message
            result = getattr(worker, method)(*args)
            if reply is not None:
                conn.send_bytes(pickle.dumps(("result", reply, result)))
    except EOFError:  # rank 0 is gone
        os._exit(1)
    except BaseException as e:
        try:
            conn.send(("error", f"{type(e).__name__}: {e}".splitlines()[0][:500]))
        except OSError:
            pass
        os._exit(1)
    if dist.is_initialized():
        end_group(device)


def start_ranks(engine) -> MultiprocExecutor:
    """The other ranks of a loaded tensor-parallel engine (a ``LoadedModel``), started as the
    runtime starts them: what ``engine.compare.compare_engine`` is handed to drive them."""
    return MultiprocExecutor(engine.engine_dir, engine.world_size, engine.device, tp_size=engine.tp_size)


if __name__ == "__main__":
    _engine_dir, _rank, _size, _device_type, _store, _fd, _parent, _timeout, _custom, _tp, _sys_path = sys.argv[1:]
    sys.path[:] = json.loads(_sys_path)  # rank 0's, as multiprocessing's spawn gives its children
    threading.Thread(target=_exit_with_parent, args=(int(_parent),), daemon=True).start()
    _worker_main(_engine_dir, int(_rank), int(_size), _device_type, _store, Connection(int(_fd)), float(_timeout),
                 _custom == "1", int(_tp))
