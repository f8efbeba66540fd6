"""``compiled-llm serve ENGINE`` as a subprocess on a free 127.0.0.1 port: started with the
bench's engine options as flags, ready when its /health answers, stopped with SIGTERM (then
SIGKILL), its output in a log file whose tail goes into the error when it fails."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from compiled_llm.cli.bench.sse_client import error_message, http_module
from compiled_llm.errors import CompiledLLMError
from compiled_llm.serve.server_config import API_KEY_VAR

logger = logging.getLogger("compiled_llm.cli.bench.server_launcher")

SERVER_START_TIMEOUT_S = 900.0  # a GPU engine loads and warms its kernels before /health answers
SERVER_STOP_TIMEOUT_S = 60.0


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now (the OS's choice)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def option_flags(options: dict) -> list[str]:
    """Command-line flags of keyword options (``engine_args`` spelling): ``--name value``,
    ``--name`` / ``--no-name`` for booleans; None (unset) left out."""
    flags = []
    for name, value in options.items():
        dashed = name.replace("_", "-")
        if value is None:
            continue
        if isinstance(value, bool):
            flags.append(f"--{dashed}" if value else f"--no-{dashed}")
        else:
            flags += [f"--{dashed}", str(value)]
    return flags


@dataclass
class Server:
    """A running ``compiled-llm serve`` subprocess."""

    process: subprocess.Popen
    base_url: str
    log_path: Path

    @property
    def pid(self) -> int:
        return self.process.pid

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


@contextlib.contextmanager
def launched_server(engine: str, args: Sequence[str] = (), start_timeout_s: float = SERVER_START_TIMEOUT_S,
                    env: dict | None = None) -> Iterator[Server]:
    """``compiled-llm serve ENGINE --host 127.0.0.1 --port P *args`` on a free port, ready (its
    /health answers) when this yields; stopped with SIGTERM on exit. Its output goes to a log
    file, whose tail is in the error when it fails to start. The default environment is this
    process's without $COMPILED_LLM_API_KEY: the server wants a key only if ``args`` give one."""
    port = free_port()
    log_dir = Path(tempfile.mkdtemp(prefix="compiled_llm_serve_"))
    log_path = log_dir / "server.log"
    cmd = [sys.executable, "-m", "compiled_llm.cli.main", "serve", str(engine), "--host", "127.0.0.1",
           "--port", str(port), *args]
    logger.info("starting %s", " ".join(cmd))
    with open(log_path, "wb") as log:
        process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   env=env if env is not None else {k: v for k, v in os.environ.items() if k != API_KEY_VAR})
    server = Server(process, f"http://127.0.0.1:{port}", log_path)
    try:
        _wait_healthy(server, start_timeout_s)
        yield server
    finally:
        code = stop_server(server)
        if code not in (0, None):
            logger.warning("compiled-llm serve exited with code %s; its log ends:\n%s", code, server.log_tail())
        else:
            with contextlib.suppress(OSError):
                log_path.unlink()
                log_dir.rmdir()


def _wait_healthy(server: Server, timeout_s: float) -> None:
    http = http_module()

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise CompiledLLMError(f"compiled-llm serve exited with code {server.process.returncode} before "
                                   f"/health answered; its log ends:\n{server.log_tail()}")
        try:
            if http.get(server.base_url + "/health", timeout=2.0, trust_env=False).status_code == 200:
                return
        except http.HTTPError:
            pass
        time.sleep(0.2)
    raise CompiledLLMError(f"compiled-llm serve did not answer /health within {timeout_s:.0f} s; its log ends:\n"
                           f"{server.log_tail()}")


def stop_server(server: Server, timeout_s: float = SERVER_STOP_TIMEOUT_S) -> int | None:
    """SIGTERM (the server drains and exits), then SIGKILL if it has not exited in time; its
    exit code."""
    if server.process.poll() is None:
        server.process.send_signal(signal.SIGTERM)
        try:
            server.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            logger.warning("compiled-llm serve did not exit %.0f s after SIGTERM; killing it", timeout_s)
            server.process.kill()
            server.process.wait()
    return server.process.returncode


def served_model(base_url: str, api_key: str | None = None) -> str:
    """The first model id /v1/models lists."""
    http = http_module()

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    response = http.get(base_url + "/v1/models", headers=headers, timeout=30.0, trust_env=False)
    if response.status_code != 200:
        raise CompiledLLMError(f"GET /v1/models failed: {error_message(response.status_code, response.content)}")
    return response.json()["data"][0]["id"]
