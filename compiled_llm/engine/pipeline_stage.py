"""``PipelineStage``: one pipeline stage's program (passes/pipeline_split.py), called as the
runtime calls any program, ``program(params, batch, kv_cache) -> logits``, with the
activations carried between stages by torch.distributed point-to-point messages.

Ranks are numbered stage-major: rank = stage * tp_size + tp_rank, so rank 0, the engine (the
scheduler and the sampler), is stage 0's first tensor-parallel rank. Every rank runs every step
(rank 0 sends it to the others first, ``serve/executor``); then

    stage k > 0       receives its inputs from rank (k-1) * tp_size + tp_rank
    stage k < last    sends its outputs to rank (k+1) * tp_size + tp_rank
    last stage        its tp rank 0 sends the logits to rank 0
    rank 0            returns those logits (the other ranks' return values are dropped)

Micro-batches: every rank cuts the step into up to ``micro_batches`` groups of whole sequences
(``micro_batches.py``; by default as many as there are stages) and runs them in order, sending
each one's outputs without waiting for them to arrive: stage k starts micro-batch j+1 while stage
k+1 runs micro-batch j, so the stages overlap within a step; rank 0 collects the logits of every
micro-batch at the end and puts them back in order.

Each tensor goes as a small header (dtype, shape), then its data: the receiver learns a
micro-batch's token count without another message. Every TP rank of a stage holds the same activations (the
stage ends in an all-reduce), so each sends to its peer of the next stage.
The header is read on the host, which waits for the stage before: this is how prefill steps
(and any step the runner does not pad) run. Decode steps go headerless: the runner cuts and pads
them itself, so every rank knows every shape, and each micro-batch replays a CUDA graph of
``run_micro_batch`` on fixed buffers, received into and sent from with ``receive_into`` and
``send_static`` (``serve/worker/pipeline_lanes.py``). The fixed buffers' per-token shapes and
dtypes are what the header path received first (``input_specs``, ``logits_spec``; with what
the stage's program returned, ``output_specs``): every engine runs a step that way (its
KV-sizing step) before any decode step, and sizes its KV cache around those buffers.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from compiled_llm.engine import micro_batches
from compiled_llm.engine.program import with_direct_calls
from compiled_llm.graph.logits_rows import with_logits_rows
from compiled_llm.model.spec import PackedBatch

_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32)
_HEADER = 6  # dtype code, rank, up to 4 dims


# The logits go back to rank 0 over a group of their own (``set_logits_group``): on NCCL a pair of
# ranks shares one communicator and one stream both ways, and at two stages rank 0's next
# activation send and the last stage's logits send would each wait for the other's receive.
_logits_group = None


def set_logits_group(group) -> None:
    """The group of rank 0 and the last stage's rank 0 (made by every rank, ``serve/executor``),
    or None (the default group)."""
    global _logits_group
    _logits_group = group


def logits_group():
    """The group the logits go back to rank 0 over (``set_logits_group``)."""
    return _logits_group


# A spec: what a receiver needs to hold a tensor of any token count, its dtype and the shape of
# one token's row.
Spec = tuple[torch.dtype, tuple[int, ...]]


def spec_of(t: Tensor) -> Spec:
    return t.dtype, tuple(t.shape[1:])


def send_tensors(tensors: list[Tensor], dst: int, group=None) -> list:
    """Queue the sends of ``tensors`` to rank ``dst`` (isend: the caller goes on to its next
    micro-batch); returns what to ``wait()`` on before the step ends, which also keeps the
    tensors alive until they are sent."""
    works = []
    for t in tensors:
        if t.dim() > _HEADER - 2 or t.dtype not in _DTYPES:
            raise ValueError(f"cannot send a {t.dim()}-D {t.dtype} activation between pipeline stages")
        header = _on_device(torch.tensor([_DTYPES.index(t.dtype), t.dim(), *t.shape] + [0] * (_HEADER - 2 - t.dim()),
                                         dtype=torch.int64), t.device)
        data = t.contiguous()
        works += [(dist.isend(header, dst, group=group), header), (dist.isend(data, dst, group=group), data)]
    return works


def receive_tensors(count: int, src: int, device: torch.device, group=None) -> list[Tensor]:
    out = []
    for _ in range(count):
        header = torch.empty(_HEADER, dtype=torch.int64, device=device)
        dist.recv(header, src, group=group)
        code, ndim, *dims = header.tolist()
        t = torch.empty(dims[:ndim], dtype=_DTYPES[code], device=device)
        dist.recv(t, src, group=group)
        out.append(t)
    return out


def send_static(tensors: list[Tensor], dst: int, group=None) -> list:
    """Queue the sends of ``tensors`` to rank ``dst`` without headers: the receiver knows their
    shapes (``receive_into``). Returns what to ``wait()`` on before the tensors are written
    again, as ``send_tensors`` does."""
    works = []
    for t in tensors:
        data = t.contiguous()
        works.append((dist.isend(data, dst, group=group), data))
    return works


def receive_into(tensors: list[Tensor], src: int, group=None) -> list:
    """Post the receives of ``send_static``'s tensors from rank ``src`` into ``tensors``
    (contiguous, of the shapes sent); returns the works, to ``wait()`` on before reading them
    (on CUDA that orders the reader's stream after the receive; the host goes on)."""
    return [dist.irecv(t, src, group=group) for t in tensors]


def _on_device(t: Tensor, device: torch.device) -> Tensor:
    """A small host tensor on ``device`` without waiting for its stream (from pinned memory;
    a copy from pageable memory waits for everything queued on the stream before it)."""
    if device.type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)


class PipelineStage:
    """Stage ``stage`` of ``stages`` (its program takes ``num_inputs`` activations after
    ``kv_cache``, the stage's layers only), as tensor-parallel rank ``tp_rank`` of ``tp_size``."""

    def __init__(self, gm: torch.fx.GraphModule, param_names: list[str], *, stage: int, stages: int,
                 tp_rank: int, tp_size: int, num_inputs: int, num_outputs: int, yields_chosen_rows: bool,
                 micro_batches: int | None = None):
        self.param_names = list(param_names)
        self.stage, self.stages = stage, stages
        self.num_inputs, self.num_outputs = num_inputs, num_outputs
        self.is_last = stage == stages - 1
        self.micro_batches = micro_batches or stages
        self.previous = (stage - 1) * tp_size + tp_rank  # the rank this one receives from (stage > 0)
        self.next = (stage + 1) * tp_size + tp_rank  # the rank it sends to (all but the last stage)
        self.last_rank = (stages - 1) * tp_size  # the last stage's tp rank 0 hands the logits back
        self.is_driver = stage == 0 and tp_rank == 0
        self.sends_logits = self.is_last and tp_rank == 0
        self._run = with_direct_calls(gm)
        self._rows_gm: torch.fx.GraphModule | None = None
        # the engine (rank 0, stage 0) answers for the last stage, whose graph selects the rows
        self.yields_chosen_rows = yields_chosen_rows
        # what the header path received last: the activations (stage > 0), the logits (rank 0);
        # and what the stage's program returned (what its decode graphs write, ``pipeline_lanes``)
        self.input_specs: list[Spec] | None = None
        self.logits_spec: Spec | None = None
        self.output_specs: list[Spec] | None = None

    def __call__(self, params: dict[str, Tensor], batch: PackedBatch, kv_cache: Tensor) -> Tensor:
        return self._step(params, batch, kv_cache, None)

    def logits_of_rows(self, params: dict[str, Tensor], batch: PackedBatch, kv_cache: Tensor, rows: Tensor) -> Tensor:
        return self._step(params, batch, kv_cache, rows)

    def run_micro_batch(self, params: dict[str, Tensor], batch: PackedBatch, kv_cache: Tensor, inputs: list[Tensor],
                        rows: Tensor | None = None) -> list[Tensor]:
        """The stage's program on one micro-batch whose received activations are ``inputs``,
        nothing sent or received: its outputs (the last stage's: [logits], of ``rows`` when given)."""
        args = [*(params[n] for n in self.param_names), *batch, kv_cache, *inputs]
        if self.is_last and rows is not None:
            if self._rows_gm is None:
                self._rows_gm = with_logits_rows(self._run)
            out = self._rows_gm(*args, rows)
        else:
            out = self._run(*args)
        return list(out) if isinstance(out, (tuple, list)) else [out]

    def _step(self, params, batch, kv_cache: Tensor, rows: Tensor | None) -> Tensor:
        device = kv_cache.device
        parts = micro_batches.split(batch, self.micro_batches)
        sending, results = [], []
        for mb in parts:
            inputs = []
            if self.stage > 0:
                inputs = receive_tensors(self.num_inputs, self.previous, device)
                self.input_specs = [spec_of(t) for t in inputs]
            chosen = micro_batches.rows_within(rows, mb) if self.is_last and rows is not None else None
            out = self.run_micro_batch(params, mb.batch, kv_cache, inputs, chosen)
            self.output_specs = [spec_of(t) for t in out]
            if not self.is_last:
                sending += send_tensors(out, self.next)
            elif self.sends_logits:
                sending += send_tensors(out[:1], 0, _logits_group)
            results.append(out[0])
        if self.is_driver:
            results = [receive_tensors(1, self.last_rank, device, _logits_group)[0] for _ in parts]
            self.logits_spec = spec_of(results[0])
        for work, _ in sending:
            work.wait()
        return results[0] if len(results) == 1 else torch.cat(results)
