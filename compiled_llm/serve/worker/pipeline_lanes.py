"""A pipeline stage's decode steps on fixed buffers, "lanes": CUDA graphs replayed, no header
read, nothing waited for on the host.

A stage's eager step (``engine/pipeline_stage.py``) learns the shape of what it receives from a
header that it reads on the host, after the stage before has computed it. A decode step needs
no header: rank 0 plans it here (``plan``: how many micro-batches, which sequences each holds,
the bucket each is padded to) and sends the plan with the step's inputs, so every rank knows
every shape. Micro-batch j runs on lane j, whose buffers are its own: its step inputs, the
activations it receives (stage > 0, [its largest bucket, ...]) and its graphs by bucket, which
write its outputs into fixed buffers (``StepGraphs``, the runner's). Lanes do not share buffers,
so lane j+1's activations can arrive while lane j computes.

A step on every rank, in the same order (so the point-to-point messages pair up, and the
tensor-parallel collectives inside the graphs meet):

    stage > 0    post every lane's receive from the stage before, into the lane's buffers
    each lane    wait for its receive (on the stream), replay its bucket's graph (captured on
                 first use), send its outputs on: to the next stage, or from the last stage's tp
                 rank 0 its real rows of logits to rank 0
    rank 0       receive each lane's logits into its rows of one buffer: the step's logits
    the sends    waited for on the stream: the next step's replays overwrite what they read

Without graphs (a CPU, ``enforce_eager``) a lane runs its program eagerly on the same buffers.

The lanes' buffers are made after the KV cache (at the first decode step, and as each graph is
captured), and held from then on: the cache is sized around them (``lane_bytes``, each rank's;
at a 128k vocabulary and PP=2, rank 0's logits and the last stage's graph outputs are hundreds
of MB each).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np
import torch
from torch import Tensor

from compiled_llm.engine import micro_batches
from compiled_llm.engine.pipeline_stage import PipelineStage, logits_group, receive_into, send_static
from compiled_llm.errors import EngineError
from compiled_llm.serve.core.block_manager import cdiv
from compiled_llm.serve.worker.cuda_graphs import StepGraphs, decode_buckets
from compiled_llm.serve.worker.step_inputs import StepInputs, step_inputs_bytes

# (real rows, bucket) of each lane a step runs on, in order: what every rank is sent
LanePlan = tuple[tuple[int, int], ...]


def decode_micro_batches(most: int, stages: int, weight_bytes: int, kv_bytes: int) -> int:
    """How many micro-batches (1..``most``) a decode step runs fastest in, when a stage's time
    on a micro-batch is what it reads: all of the stage's ``weight_bytes`` (every micro-batch
    streams the weights again) and its share of the step's ``kv_bytes``. M micro-batches overlap
    on the stages, but the next step's tokens wait for the last of them on the last stage: the
    step takes (M + stages - 1) of their times. One micro-batch wins until the KV read dwarfs
    the weights (long contexts in a large batch): at two stages M = 2 once it is twice them.
    Compute, which grows with the rows like the KV read, is left out, so this splits a little
    later than it could."""
    def step_time(m: int) -> float:
        return (m + stages - 1) * (weight_bytes + kv_bytes / m)

    return min(range(1, max(most, 1) + 1), key=step_time)


def lane_rows(max_rows: int, micro_batches: int) -> list[int]:
    """The rows each lane holds: lane j runs only in steps of more than j micro-batches, each
    about 1/M of the step's rows, so it holds max_rows / (j + 1)."""
    return [cdiv(max_rows, j + 1) for j in range(micro_batches)]


def _row_bytes(specs: list[tuple[torch.dtype, tuple[int, ...]]]) -> int:
    return sum(dtype.itemsize * math.prod(shape) for dtype, shape in specs)


def lane_bytes(stage: PipelineStage, max_rows: int, width: int, graphs: bool) -> int:
    """The device bytes the lanes of ``stage`` (``PipelineLanes`` of ``max_rows`` rows at
    block-table width ``width``) hold once they have run, with CUDA graphs when ``graphs``:
    every lane's step inputs; its received activations (stage > 0); rank 0's logits, every
    lane's rows; and with graphs, each lane's outputs (``StepGraphs.outputs``) and, once more,
    the largest bucket's, which its captured forward wrote into the graphs' pool, where they
    stay (a decode step's other intermediates are far smaller than the last stage's logits).
    The shapes are those the header path recorded (the KV-sizing step runs that way first)."""
    needed = {"inputs": (stage.stage > 0, stage.input_specs), "logits": (stage.is_driver, stage.logits_spec),
              "outputs": (graphs, stage.output_specs)}
    missing = [name for name, (need, spec) in needed.items() if need and spec is None]
    if missing:
        raise EngineError(f"pipeline stage {stage.stage} sized its decode lanes before any step told it the shapes "
                          f"of its {' and '.join(missing)}")
    rows = lane_rows(max_rows, stage.micro_batches)
    total = sum(step_inputs_bytes(r, r, width) for r in rows)
    if stage.stage > 0:
        total += sum(rows) * _row_bytes(stage.input_specs)
    if stage.is_driver:
        total += sum(rows) * _row_bytes([stage.logits_spec])
    if graphs:
        total += (sum(rows) + rows[0]) * _row_bytes(stage.output_specs)
    return total


@dataclasses.dataclass(frozen=True)
class LanePart:
    """One lane's share of a step: sequences [first_seq, end_seq), ``rows`` token rows, padded
    to ``bucket``."""

    first_seq: int
    end_seq: int
    rows: int
    bucket: int


class Lane:
    """Micro-batch j's buffers: its step inputs, its graphs by bucket (up to ``max_rows``), and
    the activations it receives (made at first use, ``PipelineLanes.make_buffers``)."""

    def __init__(self, max_rows: int, width: int, device: torch.device):
        self.inputs = StepInputs(max_rows, max_rows, width, device)
        self.graphs = StepGraphs()
        self.graphs.buckets = decode_buckets(max_rows)
        self.received: list[Tensor] = []

    def bucket_for(self, rows: int) -> int | None:
        return self.graphs.bucket_for(rows)


class PipelineLanes:
    """Decode steps of up to ``max_rows`` rows of pipeline stage ``stage`` (its weights
    ``params``, its layers' ``kv_cache``) at block-table width ``width``, on up to
    ``stage.micro_batches`` lanes. Lane j holds at most max_rows / (j + 1) rows: it runs only in
    steps of more than j micro-batches, each about 1/M of the rows."""

    def __init__(self, stage: PipelineStage, params: dict[str, Tensor], kv_cache: Tensor, max_rows: int, width: int,
                 device: torch.device):
        self.stage, self.params, self.kv_cache = stage, params, kv_cache
        self.width, self.device = width, torch.device(device)
        self.lanes = [Lane(rows, width, self.device) for rows in lane_rows(max_rows, stage.micro_batches)]
        self.logits: Tensor | None = None  # rank 0: the step's logits, rows of every lane in order
        self._weight_bytes = sum(params[n].nbytes for n in stage.param_names)
        # the KV one token of context holds in this stage's layers ([layers, 2, blocks, block_size, ...])
        self._kv_token_bytes = kv_cache.nbytes // max(kv_cache.shape[2] * kv_cache.shape[3], 1)

    @property
    def graphs(self) -> list[StepGraphs]:
        return [lane.graphs for lane in self.lanes]

    def held_bytes(self) -> int:
        """The bytes the lanes' buffers hold now (at most ``lane_bytes`` less the graphs' pool)."""
        held = [*(lane.inputs.dev_bytes for lane in self.lanes), *(t for lane in self.lanes for t in lane.received),
                *(t for lane in self.lanes for t in lane.graphs.outputs or ()),
                *([self.logits] if self.logits is not None else [])]
        return sum(t.nbytes for t in held)

    # ---- planning (rank 0) --------------------------------------------------------------------

    def plan(self, num_seqs: int, rows_per_seq: list[int] | None, context_tokens: int) -> list[LanePart] | None:
        """The lanes of a decode step of ``num_seqs`` sequences, each one row (or
        ``rows_per_seq``: a verification step's), attending to ``context_tokens`` tokens in all:
        micro-batches of whole sequences and about equal rows; None when one does not fit its
        lane (the step then runs eagerly, with headers)."""
        starts = list(range(num_seqs + 1)) if rows_per_seq is None else [0, *np.cumsum(rows_per_seq).tolist()]
        count = decode_micro_batches(min(len(self.lanes), num_seqs), self.stage.stages, self._weight_bytes,
                                     context_tokens * self._kv_token_bytes)
        cuts = micro_batches.cut_points(starts, count)
        parts = []
        for lane, a, b in zip(self.lanes, cuts, cuts[1:]):
            rows = starts[b] - starts[a]
            bucket = lane.bucket_for(rows)
            if bucket is None:
                return None
            parts.append(LanePart(a, b, rows, bucket))
        return parts

    # ---- the inputs ---------------------------------------------------------------------------

    def used(self, plan: LanePlan) -> list[dict[str, np.ndarray]]:
        """Each lane's filled inputs, what the other ranks are sent."""
        return [lane.inputs.used(bucket, bucket, self.width) for lane, (_, bucket) in zip(self.lanes, plan)]

    def fill_used(self, used: list[dict[str, np.ndarray]]) -> None:
        for lane, host in zip(self.lanes, used):
            lane.inputs.fill_used(host)

    def copy_in(self, plan: LanePlan) -> None:
        for lane, (_, bucket) in zip(self.lanes, plan):
            lane.inputs.copy_in(bucket, bucket, self.width)

    def set_tokens(self, plan: LanePlan, ids: Tensor, count: int) -> None:
        """The first ``count`` rows' input tokens (a step scheduled ahead) are ``ids``, on the
        device: row i of the step is a row of the lane holding it."""
        start = 0
        for lane, (rows, _) in zip(self.lanes, plan):
            n = min(rows, count - start)
            if n <= 0:
                break
            lane.inputs.dev["tok"][:n].copy_(ids[start:start + n])
            start += rows

    def idle(self) -> None:
        """Every lane's inputs set to rows that attend to one token of block 0 and write nowhere,
        its received activations zero (what the graphs are captured on)."""
        self.make_buffers()
        for lane in self.lanes:
            inputs = lane.inputs
            inputs.pad_tokens(0, inputs.max_tokens)
            inputs.pad_seqs(0, inputs.max_seqs, self.width, seq_len=1)
            inputs.copy_in(inputs.max_tokens, inputs.max_seqs, self.width)
            for t in lane.received:
                t.zero_()

    def make_buffers(self) -> None:
        """The lanes' receive buffers and rank 0's logits buffer, shaped as the header path
        received them (``PipelineStage.input_specs``, ``logits_spec``)."""
        stage = self.stage
        if stage.stage > 0 and not self.lanes[0].received:
            if stage.input_specs is None:
                raise EngineError(f"pipeline stage {stage.stage} ran a decode step before any step told it the shapes "
                                  "of its inputs")
            for lane in self.lanes:
                size = lane.inputs.max_tokens
                lane.received = [torch.zeros((size, *shape), dtype=dtype, device=self.device)
                                 for dtype, shape in stage.input_specs]
        if stage.is_driver and self.logits is None:
            if stage.logits_spec is None:
                raise EngineError("the pipelined engine ran a decode step before any step told rank 0 the logits' shape")
            dtype, shape = stage.logits_spec
            rows = sum(lane.inputs.max_tokens for lane in self.lanes)
            self.logits = torch.zeros((rows, *shape), dtype=dtype, device=self.device)

    # ---- graphs -------------------------------------------------------------------------------

    def prepare_graphs(self, pool) -> None:
        """Each lane's graphs, captured on first use (``StepGraphs``) in the shared ``pool``."""
        for lane in self.lanes:
            lane.graphs.prepare(lane.graphs.buckets, functools.partial(self._forward, lane),
                                lane.inputs.max_tokens, self.device, pool)

    def graph_jobs(self) -> list[tuple[StepGraphs, int]]:
        """(graphs, bucket) of every lane, lane by lane: every rank captures them in this order."""
        return [(lane.graphs, b) for lane in self.lanes if lane.graphs.enabled for b in lane.graphs.buckets]

    def release_graphs(self) -> None:
        for lane in self.lanes:
            lane.graphs.release()

    # ---- a step -------------------------------------------------------------------------------

    def run(self, plan: LanePlan) -> Tensor | None:
        """The step planned as ``plan`` on the inputs copied into its lanes; on rank 0 its
        logits (the lanes' real rows, in order), elsewhere None."""
        stage = self.stage
        self.make_buffers()
        lanes = self.lanes[:len(plan)]
        receiving = [receive_into([t[:bucket] for t in lane.received], stage.previous) if stage.stage > 0 else []
                     for lane, (_, bucket) in zip(lanes, plan)]
        sending = []
        for lane, works, (rows, bucket) in zip(lanes, receiving, plan):
            for work in works:
                work.wait()
            out = self._run_lane(lane, bucket)
            if not stage.is_last:
                sending += send_static(out, stage.next)
            elif stage.sends_logits:
                sending += send_static([out[0][:rows]], 0, logits_group())
        logits = None
        if stage.is_driver:
            # after the lanes: posted earlier, a receive would hold its kernel on the GPU for the
            # whole step (the logits come after the last lane anyway)
            start, works = 0, []
            for rows, _ in plan:
                works += receive_into([self.logits[start:start + rows]], stage.last_rank, logits_group())
                start += rows
            for work in works:
                work.wait()
            logits = self.logits[:start]
        for work, _ in sending:
            work.wait()
        return logits

    def _run_lane(self, lane: Lane, bucket: int) -> tuple[Tensor, ...]:
        if lane.graphs.enabled:
            return lane.graphs.run(bucket, bucket)
        return self._forward(lane, bucket)

    def _forward(self, lane: Lane, bucket: int) -> tuple[Tensor, ...]:
        """The stage's program on ``lane``'s first ``bucket`` rows (what its graphs capture)."""
        batch = lane.inputs.views(bucket, bucket, self.width)
        inputs = [t[:bucket] for t in lane.received]
        return tuple(self.stage.run_micro_batch(self.params, batch, self.kv_cache, inputs))
