"""`compiled-llm serve` as a subprocess, for tests that talk to it over HTTP.

    with serve_process(engine_dir, "--api-key", "k") as server:
        client = openai.OpenAI(base_url=server.api_url, api_key="k", max_retries=0)
        ...

The server listens on a free port of 127.0.0.1; the context manager returns once /health
answers 200 and, on exit, stops it with SIGTERM (a drain) and waits for it. Its log (stdout and
stderr) goes to a file, so a busy server never blocks on a full pipe.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families


@dataclasses.dataclass(frozen=True)
class RunningServer:
    url: str  # http://127.0.0.1:PORT
    process: subprocess.Popen
    log_path: Path

    @property
    def api_url(self) -> str:
        """The OpenAI client's base_url."""
        return self.url + "/v1"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def child_pids(pid: int) -> list[int]:
    """The processes ``pid`` started (Linux's /proc): a server's engine process, and
    multiprocessing's resource tracker."""
    children = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        children += [int(c) for c in (task / "children").read_text().split()]
    return children


def engine_pids(server_pid: int) -> list[int]:
    """A server's engine processes (multiprocessing's spawned children, but its API servers),
    one per replica."""
    spawned = [c for c in child_pids(server_pid) if "spawn_main" in Path(f"/proc/{c}/cmdline").read_text()]
    return [c for c in spawned if "LISTEN" not in tcp_sockets(c).values()]


def api_server_pids(server_pid: int) -> list[int]:
    """The API-server processes of a server run with --api-server-count: its children that
    listen on a TCP port."""
    return [c for c in child_pids(server_pid) if "LISTEN" in tcp_sockets(c).values()]


_TCP_STATES = {"01": "ESTABLISHED", "0A": "LISTEN"}


def tcp_table() -> dict[int, tuple[int, int, str]]:
    """Every TCP socket of this machine (Linux's /proc/net/tcp and tcp6), by inode: (local port,
    remote port, state)."""
    table = {}
    for name in ("tcp", "tcp6"):
        lines = Path(f"/proc/net/{name}").read_text().splitlines()[1:]
        for line in lines:
            fields = line.split()
            local, remote, state, inode = fields[1], fields[2], fields[3], int(fields[9])
            if inode:  # 0: not (yet) accepted by any process
                table[inode] = (int(local.rsplit(":", 1)[1], 16), int(remote.rsplit(":", 1)[1], 16),
                                _TCP_STATES.get(state, state))
    return table


def tcp_sockets(pid: int, table: dict | None = None) -> dict[int, str]:
    """The TCP sockets process ``pid`` holds: inode -> state ("LISTEN", "ESTABLISHED", ...)."""
    table = tcp_table() if table is None else table
    held = {}
    try:
        fds = list(Path(f"/proc/{pid}/fd").iterdir())
    except OSError:
        return held
    for fd in fds:
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inode = int(target[8:-1])
            if inode in table:
                held[inode] = table[inode][2]
    return held


def connections_by_pid(pids, port: int) -> dict[int, list[int]]:
    """For each of ``pids``, the client ports of the connections to ``port`` it has accepted."""
    table = tcp_table()
    return {pid: sorted(table[inode][1] for inode, state in tcp_sockets(pid, table).items()
                        if state == "ESTABLISHED" and table[inode][0] == port) for pid in pids}


def process_exists(pid: int) -> bool:
    """Running, or exited but not yet reaped (a zombie counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_status(url: str, timeout: float = 5.0) -> int | None:
    """The status of GET ``url``, None when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return None


@contextlib.contextmanager
def serve_process(source, *flags: str, log_path: Path | None = None, startup_timeout: float = 180.0,
                  stop_timeout: float = 60.0, env: dict | None = None):
    """Run ``compiled-llm serve SOURCE --device cpu --port <free> FLAGS...`` until the block
    ends; its log goes to ``log_path`` (default: a new temporary file)."""
    port = free_port()
    log = Path(log_path) if log_path is not None else Path(tempfile.mkstemp(prefix="compiled_llm_serve_", suffix=".log")[1])
    cmd = [sys.executable, "-m", "compiled_llm.cli.main", "serve", str(source), "--device", "cpu",
           "--host", "127.0.0.1", "--port", str(port), *flags]
    with open(log, "wb") as out:
        process = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    server = RunningServer(f"http://127.0.0.1:{port}", process, log)
    try:
        deadline = time.monotonic() + startup_timeout
        while http_status(server.url + "/health", timeout=1.0) != 200:
            if process.poll() is not None:
                raise RuntimeError(f"compiled-llm serve exited with {process.returncode}:\n{server.log()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"compiled-llm serve did not answer /health in {startup_timeout} s:\n{server.log()}")
            time.sleep(0.1)
        yield server
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(stop_timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def scrape(url: str, by_engine: bool = False) -> dict[str, float]:
    """/metrics as {sample name + sorted labels: value}, the model_name label left out, and the
    engine label too unless ``by_engine`` (its samples then add up: the server's total over its
    data-parallel replicas)."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    dropped = {"model_name"} if by_engine else {"model_name", "engine"}
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k not in dropped)
            key = s.name + (f"{{{labels}}}" if labels else "")
            values[key] = values.get(key, 0.0) + s.value
    return values


def wait_until(check, timeout: float = 20.0, what: str = "condition"):
    """``check()``'s first true value, polled every 50 ms; AssertionError after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)
