"""A local Ray cluster for the tests of the Ray backend and the Ray Serve application, and what
its state API says is left on it.

Starting Ray takes seconds, so the test modules that need one share it: the ``ray_cluster``
fixture (conftest.py) starts ``shared_cluster`` for the first of them, the collection runs them
one after another, and the cluster ends after the last (left running, its idle processes would
take CPU from every later test). ``address="local"`` starts a cluster of the tests' own even when
another one runs on the machine; the dashboard (on a free port) is what answers the state API
(``ray.util.state``).
"""

from __future__ import annotations

import contextlib
import logging
import socket


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def local_ray_cluster(num_cpus: int):
    """``ray.init`` a local cluster of ``num_cpus`` logical CPUs; yields its address (what a
    process started by the test sets as $RAY_ADDRESS to join it)."""
    import ray

    ray.init(address="local", num_cpus=num_cpus, include_dashboard=True, dashboard_port=_free_port(),
             logging_level=logging.WARNING, log_to_driver=False)
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()


class SharedCluster:
    """One ``local_ray_cluster`` at a time: ``start`` returns the running one's address (starting
    it first when none runs), ``stop`` ends it."""

    def __init__(self):
        self._running = None  # the entered context manager
        self.address: str | None = None

    def start(self, num_cpus: int) -> str:
        if self._running is None:
            self._running = local_ray_cluster(num_cpus)
            self.address = self._running.__enter__()
        return self.address

    def stop(self) -> None:
        running, self._running, self.address = self._running, None, None
        if running is not None:
            running.__exit__(None, None, None)


shared_cluster = SharedCluster()


def alive_actors(class_name: str) -> list:
    """The cluster's actors of ``class_name`` that are alive or still starting."""
    from ray.util.state import list_actors

    return [a for a in list_actors(filters=[("class_name", "=", class_name)], raise_on_missing_output=False)
            if a.state != "DEAD"]


def live_placement_groups() -> list:
    """The cluster's placement groups that are not removed."""
    from ray.util.state import list_placement_groups

    return [g for g in list_placement_groups(raise_on_missing_output=False) if g.state != "REMOVED"]


def process_gone(pid: int, within_s: float = 15.0) -> bool:
    """Whether process ``pid`` has exited (or is a zombie) within ``within_s`` seconds."""
    import time
    from pathlib import Path

    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                return True
        except OSError:
            return True
        time.sleep(0.1)
    return False
