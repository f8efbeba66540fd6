"""A program whose decode steps run the megakernel schedule.

``MegakernelProgram`` takes the per-op program's calls (``(params, batch, kv_cache) ->
logits``): a decode step of 1..max_rows sequences runs the schedule, every other step (prefill,
mixed, wider decode) runs the per-op program it wraps. On a CPU the schedule runs in the
interpreter (interpreter.py), which is how a megakernel engine is run, served and compared
there; the persistent GPU kernel that runs the same schedule in one launch is not written yet,
and a CUDA build with the backend is refused (``engine/build.py``).
"""

from __future__ import annotations

from torch import Tensor

from compiled_llm.errors import EngineError, first_line
from compiled_llm.megakernel.interpreter import interpret, is_decode
from compiled_llm.megakernel.schedule import Schedule
from compiled_llm.model.spec import PackedBatch


class MegakernelProgram:
    def __init__(self, per_op, schedule: Schedule):
        self.per_op = per_op
        self.schedule = schedule
        self.param_names = per_op.param_names
        self.yields_chosen_rows = per_op.yields_chosen_rows
        self.decode_steps = 0  # steps the schedule ran (what a test asks to know it was used)
        self._checked = False

    @property
    def module(self):
        return self.per_op.module

    def __call__(self, params: dict[str, Tensor], batch: PackedBatch, kv_cache: Tensor) -> Tensor:
        if not is_decode(batch, self.schedule.max_rows):
            return self.per_op(params, batch, kv_cache)
        self.decode_steps += 1
        if self._checked:
            return interpret(self.schedule, params, batch, kv_cache)[0]
        try:  # the first step is the schedule's last check, as the per-op program's first is its
            logits = interpret(self.schedule, params, batch, kv_cache)[0]
        except (RuntimeError, TypeError, ValueError, IndexError, KeyError) as e:
            raise EngineError(f"megakernel.json does not run on the engine's weights ({first_line(e)}); "
                              "rebuild the engine") from None
        self._checked = True
        return logits

    def logits_of_rows(self, params: dict[str, Tensor], batch: PackedBatch, kv_cache: Tensor, rows: Tensor) -> Tensor:
        """The per-op program's (the rows of a speculative step's verification are not a decode
        step's)."""
        return self.per_op.logits_of_rows(params, batch, kv_cache, rows)
