"""A tensor-parallel engine's other ranks in a comparison. Rank 0 (this process) runs the
candidate's program; every other rank runs the same batch on its own weights, and the
program's collectives meet between them.

The ranks are driven through the executor compare is handed (``serve/executor``, which the
engine stage does not import): ``executor.run_on_ranks(fn, *args)`` has every other rank call
``fn(model, state, *args)`` with its loaded model and a dict it keeps between calls. The
functions below marked "on each rank" are what is sent; in ``state`` a rank keeps the program
compare rebuilt there (``"program"``) and the scratch KV cache its steps write (``"kv"``).
"""

from __future__ import annotations

from typing import Sequence

import torch

from compiled_llm.engine.compare.steps import StepFn, rebuilt_program
from compiled_llm.engine.loaded_model import LoadedModel
from compiled_llm.model.spec import PackedBatch


def sharded_step(engine, executor) -> StepFn:
    """A tensor-parallel engine's program over all its ranks: every other rank runs the same
    batch on its weights and a KV cache of its own shaped like this one's."""
    last = {"kv": None}

    def step(batch, kv):
        fresh, last["kv"] = last["kv"] is not kv, kv
        # no waiting: the ranks' step meets this one's collectives, so it ends only once this
        # rank runs its own
        executor.run_on_ranks(step_on_rank, tuple(t.cpu() for t in batch), tuple(kv.shape), fresh, wait=False)
        return engine.program(engine.params, batch, kv)

    return step


def rebuild_on_ranks(executor, pass_names: Sequence[str]) -> None:
    """Have every other rank rebuild its program with ``pass_names`` for the steps that follow,
    while this rank rebuilds its own."""
    executor.run_on_ranks(use_rebuilt_program, list(pass_names), wait=False)


def use_rebuilt_program(model: LoadedModel, state: dict, pass_names: list[str]) -> None:
    """On each rank: this rank's program rebuilt from the source with ``pass_names``, used by
    the steps that follow in place of the engine's."""
    state["program"] = rebuilt_program(model.manifest, pass_names, model.dtype, model.device, model.tp_rank)


@torch.inference_mode()
def step_on_rank(model: LoadedModel, state: dict, batch: tuple, kv_shape: tuple, fresh: bool) -> None:
    """On each rank: one step of rank 0's batch (``PackedBatch``'s fields, on the host) into the
    rank's scratch KV cache, a new one when rank 0 started a new cache (``fresh``)."""
    if fresh:
        state["kv"] = torch.zeros(kv_shape, dtype=model.dtype, device=model.device)
    program, params = state.get("program") or (model.program, model.params)
    program(params, PackedBatch(*(t.to(model.device) for t in batch)), state["kv"])
