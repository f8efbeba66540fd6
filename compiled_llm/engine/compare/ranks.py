"""A tensor-parallel engine's other ranks in a comparison. Rank 0 (this process) runs the
candidate's program; every other rank runs the same batch on its own weights, and the
program's collectives meet between them. The ranks are driven through the executor compare is
handed (``serve/executor``, which the engine stage does not import).
"""

from __future__ import annotations

from compiled_llm.engine.compare.steps import StepFn


def sharded_step(engine, executor) -> StepFn:
    """A tensor-parallel engine's program over all its ranks: every other rank runs the same
    batch on its weights and a KV cache of its own shaped like this one's."""
    state = {"kv": None}

    def step(batch, kv):
        fresh, state["kv"] = state["kv"] is not kv, kv
        # numpy, not tensors: multiprocessing would share a tensor's memory through a handle
        # only processes it started may open
        executor.send("compare_step", tuple(t.cpu().numpy() for t in batch), tuple(kv.shape), fresh)
        return engine.program(engine.params, batch, kv)

    return step
