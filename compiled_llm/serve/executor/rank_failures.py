"""What every executor keeps of its ranks' failures: the first one, recorded once and ordered
against shutdown, and the other ranks stopped when it comes."""

from __future__ import annotations

import logging
import threading

from compiled_llm.errors import EngineError

log = logging.getLogger(__name__)


def rank_name(rank: int, size: int, tp_size: int) -> str:
    """How an error names a rank: with its pipeline stage when the engine has several."""
    if tp_size == size:
        return f"tensor-parallel rank {rank}"
    stage, tp_rank = divmod(rank, tp_size)
    return f"rank {rank} (pipeline stage {stage}, tensor-parallel rank {tp_rank})"


class RankFailures:
    """Mixed into an executor that stops its other ranks with ``_stop_ranks()`` (kills their
    processes or actors) and calls ``_init_failures()`` as it starts."""

    def _init_failures(self) -> None:
        self.failure: str | None = None
        # orders a failure the monitor thread sees against shutdown: a shutdown that finds no
        # failure tears the group down with every rank, which waits for ranks a later _fail kills
        self._state_lock = threading.Lock()
        self._stopping = False

    def _fail(self, why: str) -> None:
        """Record ``why`` as the failure (the first only, and none once shutdown has begun) and
        stop the other ranks."""
        with self._state_lock:
            if self.failure is not None or self._stopping:
                return
            self.failure = why
        log.error("%s; stopping the other ranks", why)
        self._stop_ranks()

    def _begin_stop(self) -> bool | None:
        """Mark shutdown begun: None when it already had, else whether a rank failed first."""
        with self._state_lock:
            if self._stopping:
                return None
            self._stopping = True
            return self.failure is not None

    def _refuse_if_shut_down(self) -> None:
        if self._stopping and self.failure is None:
            raise EngineError("the tensor-parallel engine is shut down")

    def _stop_ranks(self) -> None:
        raise NotImplementedError
