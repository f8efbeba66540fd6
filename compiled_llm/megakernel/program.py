"""A program whose decode steps run the megakernel schedule.

``MegakernelProgram`` takes the per-op program's calls (``(params, batch, kv_cache) ->
logits``): a decode step of 1..max_rows sequences runs the schedule, every other step (prefill,
mixed, wider decode) runs the per-op program it wraps.

On a CPU the schedule runs in the interpreter (interpreter.py), which is how a megakernel engine
is run, served and compared there. On a GPU it runs as one launch of the persistent Triton kernel
(triton_kernel.py): a step is a decode step when its shapes say so (T tokens == S sequences <=
max_rows: every sequence of a batch has at least one token, so each has exactly one), with no
look at the values, so no host sync and the step can be captured in a CUDA graph. The activation
buffers ([max_rows, cols] each), the counters and the encoded schedule (whose tables hold the
weights' and buffers' addresses) are made once, on the first decode step; each step zeroes the
counters on the stream, launches the kernel, and returns the first S rows of the logits buffer
(which the next step overwrites, as a captured graph's output is).
"""

from __future__ import annotations

import torch
from torch import Tensor

from compiled_llm.errors import EngineError, first_line
from compiled_llm.megakernel import encoding
from compiled_llm.megakernel.interpreter import interpret, is_decode
from compiled_llm.megakernel.schedule import Schedule
from compiled_llm.model.spec import PackedBatch


def check_fits(schedule: Schedule, device: torch.device) -> None:
    """A persistent kernel needs every one of its programs resident at once: a schedule made for
    more SMs than ``device`` has is refused (one line)."""
    if device.type != "cuda":
        return
    have = torch.cuda.get_device_properties(device).multi_processor_count
    if schedule.num_sms > have:
        raise EngineError(f"the engine's megakernel schedule is made for {schedule.num_sms} SMs and "
                          f"{torch.cuda.get_device_name(device)} has {have}; rebuild the engine on this GPU")


class _DeviceState:
    """What the GPU path holds across steps: the buffers, the counters, the encoded schedule."""

    def __init__(self, schedule: Schedule, params: dict[str, Tensor], dtype: torch.dtype, device: torch.device):
        check_fits(schedule, device)  # a compare or a test may run an engine loaded elsewhere
        self.params = params
        self.buffers = encoding.activation_buffers(schedule, dtype, device)
        self.encoded = encoding.encode(schedule, params, self.buffers, dtype, device)
        self.counters = torch.zeros(max(1, schedule.num_counters), dtype=torch.int32, device=device)
        self.logits = self.buffers[schedule.logits]


class MegakernelProgram:
    def __init__(self, per_op, schedule: Schedule):
        self.per_op = per_op
        self.schedule = schedule
        self.param_names = per_op.param_names
        self.yields_chosen_rows = per_op.yields_chosen_rows
        self.decode_steps = 0  # steps the schedule ran (what a test asks to know it was used)
        self._device: _DeviceState | None = None
        self._checked = False

    @property
    def module(self):
        return self.per_op.module

    def __call__(self, params: dict[str, Tensor], batch: PackedBatch, kv_cache: Tensor) -> Tensor:
        if kv_cache.is_cuda:
            rows = batch.seq_lens.shape[0]
            if batch.token_ids.shape[0] == rows <= self.schedule.max_rows:
                self.decode_steps += 1
                return self._run_kernel(params, batch, kv_cache)
            return self.per_op(params, batch, kv_cache)
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

    def device_state(self, params: dict[str, Tensor], kv_cache: Tensor) -> _DeviceState:
        """The GPU path's buffers and encoded schedule for ``params`` (made on first use, and
        again only if a different params dict is passed)."""
        if self._device is None or self._device.params is not params:
            self._device = _DeviceState(self.schedule, params, kv_cache.dtype, kv_cache.device)
        return self._device

    def _run_kernel(self, params: dict[str, Tensor], batch: PackedBatch, kv_cache: Tensor) -> Tensor:
        from compiled_llm.megakernel import triton_kernel  # Triton only where a GPU runs it

        state = self.device_state(params, kv_cache)
        state.counters.zero_()
        triton_kernel.launch(state.encoded, state.counters, self.schedule.num_sms, batch.token_ids, batch.positions,
                             batch.slot_mapping, batch.seq_lens, batch.block_tables, kv_cache)
        return state.logits[:batch.seq_lens.shape[0]]

    def logits_of_rows(self, params: dict[str, Tensor], batch: PackedBatch, kv_cache: Tensor, rows: Tensor) -> Tensor:
        """The per-op program's (the rows of a speculative step's verification are not a decode
        step's)."""
        return self.per_op.logits_of_rows(params, batch, kv_cache, rows)
