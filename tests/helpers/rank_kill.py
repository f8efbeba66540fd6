"""Kill a tensor-parallel rank's process while an engine generates (any executor), and check
what the engine's caller sees: a one-line EngineError naming the rank within 30 s, and every
later call refused at once."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from compiled_llm import SamplingParams
from compiled_llm.errors import EngineError


def kill_mid_generate(llm, pid: int, max_tokens: int) -> EngineError:
    """Start three greedy requests of ``max_tokens`` in a thread, SIGKILL ``pid`` after the
    engine's third step, and return the error that generate raised (failing the test unless it
    raised one within 30 s, and unless a later generate fails at once, naming rank 1)."""
    result: dict = {}

    def generate():
        prompts = [{"prompt_token_ids": [i + 1] * (5 + i)} for i in range(3)]
        try:
            result["outs"] = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
                                          use_tqdm=False)
        except BaseException as e:  # noqa: BLE001 - the caller inspects it
            result["error"] = e

    thread = threading.Thread(target=generate, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while llm.engine.stats.steps < 3:
        assert thread.is_alive() and time.monotonic() < deadline, result
        time.sleep(0.02)
    os.kill(pid, signal.SIGKILL)  # as a crash would
    killed = time.monotonic()
    thread.join(30)
    assert not thread.is_alive(), "generate still running 30 s after its rank was killed"
    assert time.monotonic() - killed < 30
    error = result.get("error")
    assert isinstance(error, EngineError), repr(error)
    t0 = time.monotonic()
    with pytest.raises(EngineError, match="tensor-parallel rank 1"):
        llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=4), use_tqdm=False)
    assert time.monotonic() - t0 < 5
    return error
