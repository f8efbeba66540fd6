"""Runs one scheduled step on the device: packs the batch, calls the program (or replays a
CUDA graph for a decode step; a pipeline stage's decode step runs on its lanes,
``pipeline_lanes.py``), samples.

Host work per step is kept small: inputs are written into preallocated (pinned, on CUDA) numpy
views and copied to preallocated device buffers with non_blocking copies (``StepInputs``); each
running request's block table is mirrored in a numpy array row that only receives its new blocks
(``RequestRows``, owned here); the only host sync of a step is fetching the sampled ids.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Callable, Collection

import numpy as np
import torch
from torch import Tensor

from compiled_llm.engine.pipeline_stage import PipelineStage
from compiled_llm.errors import EngineError
from compiled_llm.graph.batch import ScheduledSeq, pack_batch
from compiled_llm.model.spec import PackedBatch
from compiled_llm.model.config import ModelConfig
from compiled_llm.serve.worker import kv_cache as kvc
from compiled_llm.serve.core.block_manager import cdiv
from compiled_llm.serve.worker.cuda_graphs import GraphsSummary, StepGraphs, decode_buckets, prefill_buckets
from compiled_llm.serve.worker.pipeline_lanes import LanePlan, PipelineLanes
from compiled_llm.serve.worker.request_rows import RequestRows
from compiled_llm.serve.worker.sampler import (SamplingTensors, TokenLogprobs, greedy_ids, penalised_rows, race_candidates,
                                               sample, seeded_noise, suppress_tokens, token_logprobs)
from compiled_llm.serve.sampling_params import MIN_TOKENS_COLUMN, SAMPLING_COLUMNS, SamplingParams, stop_tokens
from compiled_llm.serve.core.scheduler import ScheduledBatch
from compiled_llm.serve.core.sequence import Sequence
from compiled_llm.serve.core.structured_output.sampling_mode import masks_before_sampling, may_check_after
from compiled_llm.kernels import registry
from compiled_llm.serve.worker.step_inputs import StepInputs
from compiled_llm.serve.worker.token_history import TokenHistory

Program = Callable[[dict, PackedBatch, Tensor], Tensor]

# A checked row's tokens read back in its race's order: the first its grammar allows is taken
# when the sampled one is refused (inside a JSON string nearly every token is allowed)
RACE_CANDIDATES = 8

# One position's log-probabilities: (chosen token's, its rank, top ids, top values).
PositionLogprobs = tuple[float, int, list[int], list[float]]


@dataclass
class StepHandle:
    """A launched step: its sampled ids on the device, and the pinned host copy they are on
    their way to (ready once ``event`` completes), with the log-probabilities asked for, copied
    the same way."""

    ids: Tensor | None  # [len(sample_rows)] int64 on the device; None when nothing is sampled
    host: Tensor | None
    event: "torch.cuda.Event | None"
    logprobs: TokenLogprobs | None = None  # host copies, one row per sampled row
    # host copies of the prompt log-probabilities, and per batch row (seq index, how many positions)
    prompt_logprobs: TokenLogprobs | None = None
    prompt_logprob_rows: list[tuple[int, int]] | None = None
    # launched with defer_sample: (batch, logits, runner rows) until sample_deferred runs
    deferred: tuple | None = None
    # structured rows sampled unmasked, their tokens to be checked by their grammars
    check: "GrammarCheck | None" = None


@dataclass(frozen=True)
class GrammarCheck:
    """A step's structured rows sampled as if unconstrained (``ModelRunner._sample``): their
    logits kept for a row whose grammar refuses its token, to draw it again masked."""

    logits: Tensor  # [len(positions), V]
    positions: list[int]  # their places among the step's sampled rows
    seqs: list  # their sequences
    step_rows: np.ndarray  # their runner rows
    # each seeded row's generator state just before this step drew its token (None: unseeded)
    generator_states: list | None = None

    def before_draw(self) -> "GrammarCheck":
        """This check with its seeded rows' generator states taken now, before the draw."""
        states = [s.generator.get_state() if s.generator is not None else None for s in self.seqs]
        return dataclasses.replace(self, generator_states=states)


@dataclass(frozen=True)
class DeviceStep:
    """What a step runs once its host inputs are filled (``ModelRunner.run_device_step``): what
    a tensor-parallel rank 0 sends its peers, with the inputs, so that they run it too."""

    decode_buffers: bool  # the bucketed decode input buffers, else the general ones
    tokens: int  # token rows copied in (and run)
    seqs: int  # query segments copied in (and run)
    width: int  # block-table columns
    run: str  # "decode_graph", "prefill_graph", "program", "program_rows" or "lanes"
    rows: int  # logits rows the step yields
    ahead_seqs: int = 0  # scheduled ahead: the first ahead_seqs input tokens are the last step's ids
    ahead_rows: list[int] | None = None  # ... rows ahead_rows of them (all, in order, when None)
    ahead_ids: int = 0  # how many ids the last step sampled
    # "program_rows": the token rows whose logits the step yields, in order (ModelRunner._logits_rows)
    logits_rows: tuple[int, ...] | None = None
    # "lanes": a pipeline stage's decode step, (rows, bucket) of each lane it runs on (PipelineLanes)
    lanes: LanePlan | None = None


@dataclass(frozen=True)
class RankGraphs:
    """One rank's CUDA graphs (``ModelRunner.graph_report``): each set's summary, and the bytes
    its decode lanes' buffers hold (0 without lanes)."""

    graphs: tuple[GraphsSummary, ...]
    lane_bytes: int

    @property
    def lanes(self) -> list[GraphsSummary]:
        return [g for g in self.graphs if g.name.startswith("lane ")]


def _label(enabled: bool, name: str):
    if enabled:
        return torch.profiler.record_function(name)
    return contextlib.nullcontext()


class ModelRunner:
    def __init__(
        self,
        config: ModelConfig,
        params: dict[str, Tensor],
        program: Program,
        kv_cache: Tensor,
        *,
        block_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        device: torch.device,
        tp_size: int = 1,
    ):
        self.config = config
        self.tp_size = tp_size
        self.peers = None  # a tensor-parallel rank 0's executor: every device step is sent to it first
        self.params = params
        self.program = program
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.device = torch.device(device)
        self.width = cdiv(max_model_len, block_size)  # block-table columns
        self.max_tokens = max(max_num_batched_tokens, max_num_seqs)
        self.profile_labels = False
        cuda = self.device.type == "cuda"
        s = max_num_seqs
        self.inputs = StepInputs(self.max_tokens, s, self.width, self.device)  # general steps
        self._decode_inputs: StepInputs | None = None  # bucketed decode steps, made with the graphs
        self._copied = torch.cuda.Event() if cuda else None
        self._readback = torch.cuda.Stream(self.device) if cuda else None
        self.rows = RequestRows(s, self.width)
        self.graphs = StepGraphs()  # decode, by batch size
        self.decode_buckets: list[int] = []
        self.prefill_graphs = StepGraphs()  # prefill of one sequence, by token count
        self.lanes: PipelineLanes | None = None  # a pipeline stage's decode steps (set_decode_buckets)
        self._ids_host = [torch.zeros(s, dtype=torch.int64).pin_memory() for _ in range(2)] if cuda else []
        self._ids_turn = 0
        # a tensor-parallel (or pipelined) rank's copy of the last step's sampled ids, for a step
        # scheduled ahead; ``tp_size`` here counts every rank of the engine
        self._ahead_ids = torch.zeros(s, dtype=torch.int64, device=self.device) if tp_size > 1 else None
        self.history = TokenHistory(s, self.width * block_size, config.vocab_size, self.device)
        # Each row's sampling parameters (SamplingParams.sampling_row), written when a sequence
        # takes the row, so a step reads its rows' parameters with one fancy index; and the
        # last sampled step's parameters on the device, reused while the same rows run on.
        self._row_params = np.zeros((s, len(SAMPLING_COLUMNS)), dtype=np.float32)
        self._params_epoch = 0
        self._last_params: tuple | None = None  # (epoch, rows, table, SamplingTensors)
        self._step_rows = np.zeros(0, dtype=np.int64)  # the runner row of each of the step's seqs
        # logits row of each seq's last token in the step, when the step yields the logits of
        # more rows than those (prompt log-probabilities): None = one row per seq
        self._last_logit_rows: list[int] | None = None
        self._prompt_lp_rows: list[tuple[int, int, int]] = []  # (seq index, first logits row, count)
        self.eos_token_ids: tuple[int, ...] = ()  # what min_tokens holds back, with stop_token_ids
        self._bitmask = None  # the StepBitmask, made by the first structured step
        self._bitmask_dev: Tensor | None = None
        self._redraw_stream = None  # the CUDA stream refused rows are drawn again on, made at first use

    # ---- CUDA graphs --------------------------------------------------------------------------

    def set_decode_buckets(self, max_batch_size: int) -> None:
        """Pad decode steps of up to max_batch_size sequences to buckets, the shapes CUDA graphs
        replay (the engine asks on CUDA). A pipeline stage pads each micro-batch of the step on a
        lane of its own, headerless (``PipelineLanes``)."""
        size = min(max_batch_size, self.max_num_seqs)
        if isinstance(self.program, PipelineStage):
            self.lanes = PipelineLanes(self.program, self.params, self.kv_cache, size, self.width, self.device)
            return
        self.decode_buckets = decode_buckets(size)
        self.graphs.buckets = self.decode_buckets

    def prepare_graphs(self, prefill_max_tokens: int) -> bool:
        """Decode graphs by batch size and graphs of one sequence's prefill of up to
        ``prefill_max_tokens`` tokens (0: none), captured on first use in one memory pool (the
        two never run at once); a pipeline stage's decode graphs, lane by lane (its prefill
        runs eagerly). CUDA only; False when there is nothing to capture."""
        if self.device.type != "cuda":
            return False
        if self.lanes is not None:
            self.lanes.prepare_graphs(torch.cuda.graph_pool_handle())
            return True
        if not self.decode_buckets:
            return False
        pool = torch.cuda.graph_pool_handle()
        decode = self.decode_inputs()
        self.graphs.prepare(
            self.decode_buckets, lambda b: self._run_program(decode.views(b, b, self.width)),
            max(self.decode_buckets), self.device, pool,
        )
        if prefill_max_tokens > 0:
            self.prefill_graphs.prepare(
                prefill_buckets(min(prefill_max_tokens, self.max_tokens)),
                lambda t: self._run_program(self.inputs.views(t, 1, self.width)), 1, self.device, pool,
            )
        return True

    def release_graphs(self) -> None:
        """Drop the CUDA graphs before the tensor-parallel group ends (StepGraphs.release says
        why); the runner steps no more."""
        for graphs in self.all_graphs():
            graphs.release()

    def all_graphs(self) -> list[StepGraphs]:
        """Every set of graphs the runner replays (each bucket's graph captured on first use)."""
        return [self.graphs, self.prefill_graphs, *(self.lanes.graphs if self.lanes is not None else ())]

    def graph_report(self) -> RankGraphs:
        """What this rank's graphs hold: "decode", "prefill", and each lane's ("lane 0", ...)."""
        lanes = self.lanes.graphs if self.lanes is not None else []
        named = [("decode", self.graphs), ("prefill", self.prefill_graphs),
                 *((f"lane {j}", g) for j, g in enumerate(lanes))]
        return RankGraphs(tuple(g.summary(name) for name, g in named),
                          self.lanes.held_bytes() if self.lanes is not None else 0)

    @torch.inference_mode()
    def capture_all_graphs(self, part: int = 0, parts: int = 1) -> bool:
        """Capture every prepared bucket now, on inputs that write nowhere (a build warms every
        kernel specialisation this way; profiling tools replay them). With ``parts`` > 1, only
        share ``part`` of the decode and prefill buckets (a build splits them over processes)."""
        if self.lanes is not None:
            return self._capture_lanes(part, parts)
        if not self.graphs.enabled:
            return False
        self.idle_decode_inputs()
        self._wait_for_copies()
        general = self.inputs
        general.pad_tokens(0, general.max_tokens)
        general.pad_seqs(0, 1, self.width, seq_len=1)
        self._copy_in(general, general.max_tokens, 1, self.width)
        jobs = [(self.graphs, b) for b in self.graphs.buckets]
        if self.prefill_graphs.enabled:
            jobs += [(self.prefill_graphs, b) for b in self.prefill_graphs.buckets]
        return all([graphs.capture(b) for graphs, b in jobs[part::parts]])

    def _capture_lanes(self, part: int, parts: int) -> bool:
        jobs = self.lanes.graph_jobs()
        if not jobs:
            return False
        self._wait_for_copies()
        self.lanes.idle()
        if self._copied is not None:
            self._copied.record()
        return all([graphs.capture(b) for graphs, b in jobs[part::parts]])

    def decode_inputs(self) -> StepInputs:
        """The bucketed decode steps' input buffers, sized for the largest bucket (made once,
        before the graphs that read them are captured)."""
        need = max(self.decode_buckets)
        if self._decode_inputs is None or self._decode_inputs.max_seqs < need:
            self._decode_inputs = StepInputs(need, need, self.width, self.device)
        return self._decode_inputs

    def idle_decode_inputs(self) -> StepInputs:
        """The bucketed decode inputs set so that every row attends to one token of block 0 and
        writes nowhere (what graphs are captured with; profiling replays them too)."""
        self._wait_for_copies()
        decode = self.decode_inputs()
        decode.pad_tokens(0, decode.max_tokens)
        decode.pad_seqs(0, decode.max_seqs, self.width, seq_len=1)
        self._copy_in(decode, decode.max_tokens, decode.max_seqs, self.width)
        return decode

    # ---- a step -------------------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> list[int]:
        """Run the step; the sampled token of each row in batch.sample_rows, in that order."""
        return self.collect(self.launch(batch))

    @torch.inference_mode()
    def launch(self, batch: ScheduledBatch, ahead_of: StepHandle | None = None,
               ahead_rows: list[int] | None = None, defer_sample: bool = False,
               prepared: DeviceStep | None = None) -> StepHandle:
        """Queue the step's forward and sampling on the device without waiting for them.

        With ``ahead_of`` the batch is a decode step scheduled before the step ``ahead_of``
        finished: each row's input token is that step's sampled id (row ahead_rows[i] of it,
        all rows in order when None), copied on the device, and its position is one past the
        sequence's num_computed_tokens (which the earlier step has not yet advanced).

        ``defer_sample``: queue only the forward; ``sample_deferred`` queues the sampling once
        the earlier step's tokens are applied (a grammar's bitmask needs them). The device
        runs the forward meanwhile. ``prepared``: the step's host inputs, filled by
        ``prepare_decode``."""
        with _label(self.profile_labels, "forward"):
            logits = self._forward(batch, ahead_of, ahead_rows, prepared)
        prompt_lp = self._prompt_logprobs(batch, logits) if self._prompt_lp_rows else None
        if self._last_logit_rows is not None:
            logits = logits.index_select(0, self._to_device(self._last_logit_rows))
        if defer_sample:
            assert prompt_lp is None
            handle = StepHandle(None, None, None)
            handle.deferred = (batch, logits, self._step_rows)
            return handle
        with _label(self.profile_labels, "sample"):
            ids, lp, check = self._sample(batch, logits, self._step_rows, ahead=0 if ahead_of is None else 1)
        handle = self._read_back(ids, lp, prompt_lp)
        handle.check = check
        return handle

    @torch.inference_mode()
    def sample_deferred(self, handle: StepHandle, stale: Collection[int] = ()) -> None:
        """Queue the sampling of a step launched with ``defer_sample`` (its sequences now hold
        the tokens of the step before it) and its read-back, filling in ``handle``. ``stale``:
        seq ids whose rows were computed from a token since drawn again, to be dropped: their
        draws leave their generators where they were (the row is sampled again next step)."""
        batch, logits, step_rows = handle.deferred
        handle.deferred = None
        generators = [s.generator for s in batch.seqs if s.seq_id in stale and s.generator is not None]
        states = [g.get_state() for g in generators]
        with _label(self.profile_labels, "sample"):
            ids, lp, check = self._sample(batch, logits, step_rows, ahead=0)
        for g, state in zip(generators, states):
            g.set_state(state)
        done = self._read_back(ids, lp, None)
        handle.ids, handle.host, handle.event, handle.logprobs = done.ids, done.host, done.event, done.logprobs
        handle.check = check

    def start_grammar_bitmask(self, handle: StepHandle) -> None:
        """Begin filling the grammar bitmask of a step launched with ``defer_sample``, once the
        tokens before it are accepted: on a thread, while the host goes on (``StepBitmask``);
        ``sample_deferred`` takes it."""
        batch, logits, _ = handle.deferred
        grammars = [s.grammar if masks_before_sampling(s) else None for s in (batch.seqs[r] for r in batch.sample_rows)]
        self._step_bitmask(logits.shape[0]).start(grammars)

    def _step_bitmask(self, rows: int):
        # xgrammar is imported by the first structured step, not by every engine's start-up
        from compiled_llm.serve.core.structured_output.step_bitmask import StepBitmask

        if self._bitmask is None or self._bitmask.buffers[0].shape[0] < rows:
            if self._bitmask is not None:
                self._bitmask.close()
            self._bitmask = StepBitmask(max(rows, self.max_num_seqs), self.config.vocab_size,
                                        pin=self.device.type == "cuda")
            self._bitmask_dev = torch.empty_like(self._bitmask.buffers[0], device=self.device)
        return self._bitmask

    def _read_back(self, ids: Tensor | None, lp: TokenLogprobs | None, prompt_lp: TokenLogprobs | None) -> StepHandle:
        """A handle for a step's sampled ids and log-probabilities, with their copies to the host
        queued."""
        if ids is None and prompt_lp is None:
            return StepHandle(None, None, None)
        rows = [(i, n) for i, _, n in self._prompt_lp_rows] or None
        if self.device.type != "cuda":
            return StepHandle(ids, ids, None, lp, prompt_lp, rows)
        # two pinned buffers, alternating: a launch may be queued while the previous one's ids
        # are still being read back. The read-back runs on a side stream, so the next step's
        # input copy and graph do not queue behind it.
        self._readback.wait_stream(torch.cuda.current_stream())
        host = None
        with torch.cuda.stream(self._readback):
            if ids is not None:
                self._ids_turn ^= 1
                host = self._ids_host[self._ids_turn][: ids.shape[0]]
                host.copy_(ids, non_blocking=True)
                ids.record_stream(self._readback)  # the allocator must not reuse ids before the copy ran
            lp, prompt_lp = _to_host(lp, self._readback), _to_host(prompt_lp, self._readback)
            event = torch.cuda.Event()
            event.record()
        return StepHandle(ids, host, event, lp, prompt_lp, rows)

    @staticmethod
    def collect(handle: StepHandle) -> list[int]:
        """Wait for a launched step; its sampled ids as Python ints."""
        if handle.event is not None:
            handle.event.synchronize()
        if handle.ids is None:
            return []
        return handle.host.tolist()

    @staticmethod
    def collect_logprobs(handle: StepHandle) -> list[PositionLogprobs] | None:
        """After ``collect``: each sampled row's log-probabilities (None when no row asked)."""
        return _positions(handle.logprobs)

    @staticmethod
    def collect_prompt_logprobs(handle: StepHandle) -> list[tuple[int, list[PositionLogprobs]]]:
        """After ``collect``: (batch row, its prompt positions' log-probabilities) for each row
        that computed prompt tokens whose log-probabilities were asked for."""
        positions = _positions(handle.prompt_logprobs) or []
        out, start = [], 0
        for i, n in handle.prompt_logprob_rows or ():
            out.append((i, positions[start:start + n]))
            start += n
        return out

    def _forward(self, batch: ScheduledBatch, ahead_of: StepHandle | None = None,
                 ahead_rows: list[int] | None = None, prepared: DeviceStep | None = None) -> Tensor:
        if batch.is_decode or batch.is_verify:
            step = prepared or self.prepare_decode(batch, ahead_of is not None, ahead_rows)
            if ahead_of is not None:
                step = dataclasses.replace(step, ahead_ids=len(ahead_of.ids))
            return self.run_device_step(step, ahead_of)
        seqs = batch.seqs
        rows = self._start_step(batch)
        inputs = self.inputs
        bucket = None
        if len(seqs) == 1 and self.prefill_graphs.enabled and not seqs[0].wants_prompt_logprobs:
            bucket = self.prefill_graphs.bucket_for(batch.num_new_tokens[0])
        width = self.width if bucket is not None else self._width_of(seqs)
        T = self._fill_mixed(inputs, seqs, rows, batch.num_new_tokens, width)
        if bucket is not None:
            inputs.pad_tokens(T, bucket)
            return self.run_device_step(DeviceStep(False, bucket, 1, width, "prefill_graph", 1))
        logits_rows = self._logits_rows(seqs, batch.num_new_tokens)
        if logits_rows is not None:
            return self.run_device_step(DeviceStep(False, T, len(seqs), width, "program_rows", len(logits_rows),
                                                   logits_rows=logits_rows))
        return self.run_device_step(DeviceStep(False, T, len(seqs), width, "program", len(seqs)))

    @torch.inference_mode()
    def prepare_decode(self, batch: ScheduledBatch, ahead: bool = False,
                       ahead_rows: list[int] | None = None) -> DeviceStep:
        """The host part of a decode (or verification) step: its inputs filled, nothing queued
        on the device yet (``launch(..., prepared=)`` queues it). ``ahead``: queued before the
        previous step's tokens are applied, as ``launch``'s ahead_of."""
        seqs = batch.seqs
        S = len(seqs)
        rows = self._start_step(batch)
        ahead = int(ahead)
        assert ahead == 0 or batch.is_decode, "only decode steps are scheduled ahead"
        if self.lanes is not None:
            step = self._prepare_lanes(batch, rows, ahead, ahead_rows)
            if step is not None:
                return step
        # a verification step is a decode step of one row per token: each row a one-token
        # query whose context ends at its own position, so the decode graphs (by row count)
        # replay it and every position yields its logits
        R = batch.num_tokens
        bucket = self.graphs.bucket_for(R) if self.decode_buckets else None
        if bucket is not None:
            # Padded to the bucket at full width, with or without graphs: eager decode
            # runs exactly the kernels and shapes the graphs replay.
            inputs, T, width = self.decode_inputs(), bucket, self.width
            graphs = self.graphs if self.graphs.enabled else None
        else:
            inputs, T, width, graphs = self.inputs, R, self._width_of(seqs), None
        if batch.is_verify:
            self._fill_verify(inputs, seqs, rows, batch.draft_tokens, T, width)
        else:
            self._fill_decode(inputs, seqs, rows, T, width, ahead, batch.host_fed)
        return DeviceStep(bucket is not None, T, T, width, "decode_graph" if graphs is not None else "program", R,
                          S - batch.host_fed if ahead else 0, ahead_rows)

    def _prepare_lanes(self, batch: ScheduledBatch, rows: np.ndarray, ahead: int,
                       ahead_rows: list[int] | None) -> DeviceStep | None:
        """``prepare_decode`` of a pipeline stage: the step cut into micro-batches of whole
        sequences, each filled into its lane padded to its bucket; None when one does not fit
        (the step runs through the general inputs, eagerly)."""
        seqs = batch.seqs
        drafts = batch.draft_tokens if batch.is_verify else None
        parts = self.lanes.plan(len(seqs), None if drafts is None else [1 + len(d) for d in drafts],
                                sum(s.num_computed_tokens for s in seqs))
        if parts is None:
            return None
        fed = len(seqs) - batch.host_fed if ahead else 0  # rows whose token comes from the device
        for lane, p in zip(self.lanes.lanes, parts):
            a, b = p.first_seq, p.end_seq
            if drafts is not None:
                self._fill_verify(lane.inputs, seqs[a:b], rows[a:b], drafts[a:b], p.bucket, self.width)
            else:
                self._fill_decode(lane.inputs, seqs[a:b], rows[a:b], p.bucket, self.width, ahead, b - max(a, min(b, fed)))
        padded = sum(p.bucket for p in parts)
        return DeviceStep(True, padded, padded, self.width, "lanes", batch.num_tokens, fed, ahead_rows,
                          lanes=tuple((p.rows, p.bucket) for p in parts))

    def _start_step(self, batch: ScheduledBatch) -> np.ndarray:
        """The runner rows of the step's seqs (new ones take their sampling parameters)."""
        seqs = batch.seqs
        self._wait_for_copies()
        self.rows.release(batch.released_seq_ids)
        rows = self._step_rows = self.rows.rows_of(seqs)
        for i in self.rows.assigned_now:
            self._row_params[rows[i]] = seqs[i].params.sampling_row
            self._params_epoch += 1
            if seqs[i].params.has_penalties:
                self.history.fill(int(rows[i]), seqs[i].token_ids, seqs[i].num_prompt_tokens)
        self._last_logit_rows, self._prompt_lp_rows = None, []
        return rows

    def run_device_step(self, step: DeviceStep, ahead_of: StepHandle | None = None) -> Tensor:
        """The device part of a step whose host inputs are filled: copy them in, run the graph
        or the program. Tensor-parallel peers are sent the step first and run it alongside."""
        if step.run == "lanes":
            return self._run_lanes(step, ahead_of)
        inputs = self.decode_inputs() if step.decode_buffers else self.inputs
        if self.peers is not None:
            self.peers.send("replay_step", step, inputs.used(step.tokens, step.seqs, step.width))
        self._copy_in(inputs, step.tokens, step.seqs, step.width)
        if step.ahead_seqs:
            inputs.dev["tok"][:step.ahead_seqs].copy_(self._ahead_tokens(ahead_of, step.ahead_rows, step.ahead_ids))
        if step.run == "decode_graph":
            return self.graphs.run(step.tokens, step.rows)
        if step.run == "prefill_graph":
            return self.prefill_graphs.run(step.tokens, step.seqs)
        batch = inputs.views(step.tokens, step.seqs, step.width)
        if step.run == "program_rows":
            return self._logits_of_rows(batch, self._to_device(list(step.logits_rows)))
        return self._run_program(batch)[:step.rows]

    def _run_lanes(self, step: DeviceStep, ahead_of: StepHandle | None) -> Tensor | None:
        """``run_device_step`` of a pipeline stage's decode step: every rank runs the same lanes."""
        if self.peers is not None:
            self.peers.send("replay_step", step, self.lanes.used(step.lanes))
        self.lanes.copy_in(step.lanes)
        if self._copied is not None:
            self._copied.record()
        if step.ahead_seqs:
            self.lanes.set_tokens(step.lanes, self._ahead_tokens(ahead_of, step.ahead_rows, step.ahead_ids),
                                  step.ahead_seqs)
        return self.lanes.run(step.lanes)

    @torch.inference_mode()
    def replay_step(self, step: DeviceStep, host: dict[str, np.ndarray] | list[dict[str, np.ndarray]]) -> None:
        """A tensor-parallel peer's side of rank 0's ``run_device_step``: the same inputs, the
        same graph or program (its collectives meet rank 0's); the logits are rank 0's to use.
        A pipeline stage's decode step comes with each lane's inputs."""
        self._wait_for_copies()
        if step.run == "lanes":
            self.lanes.fill_used(host)
        else:
            (self.decode_inputs() if step.decode_buffers else self.inputs).fill_used(host)
        self.run_device_step(step, None)

    @staticmethod
    def _width_of(seqs: list[Sequence]) -> int:
        return max(len(s.block_table) for s in seqs)

    def _wait_for_copies(self) -> None:
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copies have read the host buffers

    def _copy_in(self, inputs: StepInputs, T: int, S: int, width: int) -> None:
        inputs.copy_in(T, S, width)
        if self._copied is not None:
            self._copied.record()

    def _ahead_tokens(self, handle: StepHandle | None, rows: list[int] | None, count: int) -> Tensor:
        """Input tokens of a step scheduled ahead, in its row order: the earlier step's
        ``count`` sampled ids (rows ``rows`` of them), on the device, for the caller to copy in
        after (stream order) the host inputs landed. Tensor-parallel peers (``handle`` None)
        receive them from rank 0, which alone samples."""
        if self.tp_size > 1:
            src = self._ahead_ids[:count]
            if handle is not None:
                src.copy_(handle.ids)
            torch.distributed.broadcast(src, src=0)
        else:
            src = handle.ids
        if rows is not None:
            src = src.index_select(0, self._to_device(rows))
        return src

    def _to_device(self, values: list, dtype: torch.dtype = torch.int64) -> Tensor:
        """A small list (an index list by default) on the device without a host sync (pinned,
        non-blocking copy; a plain torch.tensor(..., device=cuda) waits for the stream)."""
        t = torch.tensor(values, dtype=dtype)
        if self.device.type != "cuda":
            return t
        return t.pin_memory().to(self.device, non_blocking=True)

    def _run_program(self, batch: PackedBatch) -> Tensor:
        return self.program(self.params, batch, self.kv_cache)

    def _logits_of_rows(self, batch: PackedBatch, rows: Tensor) -> Tensor:
        run = getattr(self.program, "logits_of_rows", None)
        if run is None:
            raise EngineError("this engine's program yields only each sequence's last logits; "
                              "it cannot compute prompt_logprobs")
        return run(self.params, batch, self.kv_cache, rows)

    def _sample(self, batch: ScheduledBatch, logits: Tensor, step_rows: np.ndarray,
                ahead: int = 0) -> tuple[Tensor | None, TokenLogprobs | None, GrammarCheck | None]:
        """The sampled ids of batch.sample_rows, their log-probabilities if any row asks, and
        what a grammar check of the ids needs (see below). ``ahead`` = 1: the step was queued
        before the previous one's tokens were applied, so each seq has one output token more
        than it holds.

        Structured rows are sampled one of two ways. Exactly: their logits are masked by their
        grammars first (in place: what the log-probabilities report too), which needs their
        bitmask filled on the host before sampling. Or checked (where
        ``sampling_mode.masks_before_sampling`` says no): the rows sample as if unconstrained,
        and the host then asks each grammar whether it takes its row's token, a few
        microseconds; a row whose token it refuses takes a later token of its race
        (``race_candidates``) or is masked and drawn again (``resample``), from the logits kept
        for that. A token drawn from p and kept when allowed, else drawn from p masked, is
        distributed as p masked: the output is the same either way. logit_bias and min_tokens act on the sampling logits only."""
        rows = batch.sample_rows
        if not rows:
            return None, None, None
        seqs = batch.seqs
        drafts = None
        if batch.is_verify:
            drafts = batch.draft_tokens
        elif len(rows) != len(batch.seqs):
            logits = logits.index_select(0, self._to_device(rows))
            step_rows = step_rows[rows]
            seqs = [batch.seqs[r] for r in rows]
        check = None
        if any(s.grammar is not None for s in seqs):
            if batch.is_verify:
                self._apply_grammars(logits, [s.grammar for s in seqs], drafts)
            else:
                masked = [ahead == 0 and masks_before_sampling(s) for s in seqs]
                # a dormant grammar's row too: the token it samples may wake it
                checked = [i for i, s in enumerate(seqs) if s.grammar is not None and not masked[i]]
                assert ahead == 0 or all(may_check_after(seqs[i]) for i in checked), \
                    "a row that must be masked was queued before its grammar had the tokens"
                if checked:
                    check = self._keep_for_check(logits, seqs, step_rows, checked)
                if any(masked):
                    self._apply_grammars(logits, [s.grammar if m else None for s, m in zip(seqs, masked)], None)
        offsets = None  # per row: its token's place after the seq's current output (verify steps)
        if batch.is_verify:
            # every position of every seq samples with its seq's parameters and generator
            counts = batch.num_new_tokens
            step_rows = np.repeat(step_rows, counts)
            seqs = [s for s, n in zip(seqs, counts) for _ in range(n)]
            offsets = [j for n in counts for j in range(n)]
        table = self._row_params[step_rows]
        if check is not None:
            check = check.before_draw()
        ids = self._draw(logits, seqs, step_rows, table, offsets, ahead, batch.is_verify)
        k = int(table[:, 7].max())
        return ids, (token_logprobs(logits, ids, k) if k >= 0 else None), check

    def _draw(self, logits: Tensor, seqs: list[Sequence], step_rows: np.ndarray, table: np.ndarray,
              offsets: list[int] | None, ahead: int, is_verify: bool, keep_tensors: bool = True) -> Tensor:
        """Token ids [rows] sampled from ``logits`` with each row's parameters (``table``, its
        seq's generator and penalties). ``keep_tensors``: the sampling tensors may be kept for
        the next step with the same rows (not a redraw's, made on its own stream)."""
        sample_logits = self._sampling_logits(logits, seqs, table, offsets, ahead)
        if not (table[:, 0] > 0).any() and not penalised_rows(table).any():
            return greedy_ids(sample_logits)
        st = (self._sampling_tensors(step_rows, table, logits) if keep_tensors
              else SamplingTensors.from_table(table, logits.shape[-1], logits.device))
        gens = [s.generator for s in seqs] if table[:, 8].any() else None
        seen = None
        if st.has_penalties:
            runner_rows = self._to_device(step_rows.tolist())
            seen = self.history.counts_and_prompt_mask(runner_rows, max(s.num_tokens for s in seqs) + 1)
        ids = sample(sample_logits, st, gens, seen)
        if st.has_penalties and is_verify:
            # penalised seqs never draft: their one row's sample is their new token; the
            # drafting rows' samples are not all kept, and their history is never read
            keep = self._to_device(np.flatnonzero(penalised_rows(table)).tolist())
            self.history.append(runner_rows.index_select(0, keep), ids.index_select(0, keep))
        elif st.has_penalties:
            self.history.append(runner_rows, ids)
        return ids

    def _sampling_logits(self, logits: Tensor, seqs: list[Sequence], table: np.ndarray, offsets: list[int] | None,
                         ahead: int) -> Tensor:
        """The logits the rows sample from: stop tokens held back (min_tokens) and logit_bias
        added, on a copy (the raw ones stay for the log-probabilities)."""
        if table[:, MIN_TOKENS_COLUMN].any():
            logits = self._hold_back_stops(logits, table, seqs, offsets, ahead)
        if any(s.params.logit_bias for s in seqs):
            logits = self._add_logit_bias(logits, seqs)
        return logits

    def _keep_for_check(self, logits: Tensor, seqs: list[Sequence], step_rows: np.ndarray,
                        positions: list[int]) -> GrammarCheck:
        """The check of the rows ``positions`` (sampled unmasked, checked after), with their
        logits copied (a graph's logits are overwritten by the next step, which may be queued
        before these ids are checked)."""
        kept = logits.index_select(0, self._to_device(positions)) if len(positions) < len(seqs) else logits.clone()
        return GrammarCheck(kept, positions, [seqs[i] for i in positions], step_rows[positions])

    def race_candidates(self, handle: StepHandle, positions: list[int]) -> list[list[int]]:
        """For the sampled rows ``positions`` of a checked step (their grammars refused their
        tokens): each row's first RACE_CANDIDATES tokens of its race, in order, from the kept
        logits (``sampler.race_candidates``). A seeded row's generator is set back to before
        its draw and draws the same noise again, so its first allowed candidate is the token
        its masked draw would be; the others draw new noise (a draw from p, refused, then a
        draw from p restricted to what the grammar allows, is a draw from the latter)."""
        return self._on_redraw_stream(self._race_candidates, handle, positions)

    def resample(self, handle: StepHandle, positions: list[int]) -> list[int]:
        """New tokens for the sampled rows ``positions`` of a checked step (their grammars
        refused their tokens, and every candidate of their race): their kept logits masked by
        their grammars, drawn again."""
        return self._on_redraw_stream(self._resample, handle, positions)

    @torch.inference_mode()
    def _on_redraw_stream(self, fn, *args):
        """fn(*args) on a stream of its own: the step queued ahead is running on the main one,
        and waiting for it would idle the device while the host catches up."""
        if self.device.type != "cuda":
            return fn(*args)
        if self._redraw_stream is None:
            self._redraw_stream = torch.cuda.Stream(self.device)
        # the kept logits are complete: the step's read-back, queued after them, was waited for
        with torch.cuda.stream(self._redraw_stream):
            return fn(*args)

    def _refused_rows(self, check: GrammarCheck, positions: list[int]) -> tuple[Tensor, list[Sequence], np.ndarray]:
        """The kept logits, seqs and runner rows of a check's sampled rows ``positions``, each
        seeded row's generator set back to before the step drew: drawn again, it takes the
        refused draw's noise, so the race picks the token the masked draw would have (the same
        noise, the refused logits at -inf), and the generator ends where the masked draw
        leaves it, whatever was queued since."""
        index = [check.positions.index(p) for p in positions]
        seqs = [check.seqs[i] for i in index]
        for i, seq in zip(index, seqs):
            if check.generator_states[i] is not None:
                seq.generator.set_state(check.generator_states[i])
        return check.logits.index_select(0, self._to_device(index)), seqs, check.step_rows[index]

    def _race_candidates(self, handle: StepHandle, positions: list[int]) -> list[list[int]]:
        logits, seqs, step_rows = self._refused_rows(handle.check, positions)
        table = self._row_params[step_rows]
        logits = self._sampling_logits(logits, seqs, table, None, 0)
        noise = seeded_noise(logits, [s.generator for s in seqs]) if table[:, 8].any() else None
        temperature = self._to_device(table[:, 0].tolist(), torch.float32)
        return race_candidates(logits, temperature, RACE_CANDIDATES, noise).tolist()

    def _resample(self, handle: StepHandle, positions: list[int]) -> list[int]:
        logits, seqs, step_rows = self._refused_rows(handle.check, positions)
        self._apply_grammars(logits, [s.grammar for s in seqs], None, own_buffer=True)
        ids = self._draw(logits, seqs, step_rows, self._row_params[step_rows], None, 0, False, keep_tensors=False)
        return ids.tolist()

    def _apply_grammars(self, logits: Tensor, grammars: list, drafts: list[list[int]] | None,
                        own_buffer: bool = False) -> None:
        """Set to -inf, in place, every logit a row's grammar rules out (rows of seqs without
        one are left alone): the rows' bitmask filled on the host by their matchers, one copy
        to the device, one kernel. ``own_buffer``: the device copy is a new tensor, not the
        steps' buffer (a redraw, on its own stream)."""
        host = self._step_bitmask(logits.shape[0]).fill(grammars, drafts)
        dev = torch.empty_like(host, device=self.device) if own_buffer else self._bitmask_dev[:host.shape[0]]
        dev.copy_(host, non_blocking=True)
        registry.kernel_for("apply_token_bitmask", logits.device.type, logits.dtype)(logits, dev)

    def _add_logit_bias(self, logits: Tensor, seqs: list[Sequence]) -> Tensor:
        """A float32 copy of ``logits`` with each row's logit_bias added."""
        rows, token_ids, values = [], [], []
        for r, seq in enumerate(seqs):
            for token, bias in (seq.params.logit_bias or {}).items():
                rows.append(r)
                token_ids.append(token)
                values.append(bias)
        out = logits.float()
        bias = torch.tensor(values, dtype=torch.float32)
        if self.device.type == "cuda":
            bias = bias.pin_memory().to(self.device, non_blocking=True)
        return out.index_put_((self._to_device(rows), self._to_device(token_ids)), bias, accumulate=True)

    def _hold_back_stops(self, logits: Tensor, table: np.ndarray, seqs: list[Sequence], offsets: list[int] | None,
                         ahead: int) -> Tensor:
        """``logits`` with each row's stop tokens at -inf while its seq has fewer than
        min_tokens output tokens before the row's token (SamplingParams.min_tokens). Host work
        only for the rows whose min_tokens is set."""
        rows, token_ids = [], []
        for r in np.flatnonzero(table[:, MIN_TOKENS_COLUMN]).tolist():
            seq = seqs[r]
            if seq.grammar is not None:
                continue  # the grammar alone decides where a structured output may end
            done = seq.num_output_tokens + ahead + (offsets[r] if offsets is not None else 0)
            if done < seq.params.min_tokens:
                stops = stop_tokens(seq.params, self.eos_token_ids)
                rows.extend([r] * len(stops))
                token_ids.extend(stops)
        if not rows:
            return logits
        return suppress_tokens(logits, self._to_device(rows), self._to_device(token_ids))

    def _sampling_tensors(self, step_rows: np.ndarray, table: np.ndarray, logits: Tensor) -> SamplingTensors:
        """The step's SamplingTensors: the previous step's when the same rows, holding the same
        sequences, sample again (a steady decode), else copied from the table."""
        last = self._last_params
        if last is not None and last[0] == self._params_epoch and np.array_equal(last[1], step_rows):
            return last[2]
        st = SamplingTensors.from_table(table, logits.shape[-1], logits.device)
        self._last_params = (self._params_epoch, step_rows.copy(), st)
        return st

    def _prompt_logprobs(self, batch: ScheduledBatch, logits: Tensor) -> TokenLogprobs:
        """Log-probabilities of the prompt tokens the split rows' logits predict: logits row
        r of a split seq predicts the token after it, while that token is still a prompt token."""
        rows, targets, ks = [], [], []
        for i, first, n in self._prompt_lp_rows:
            seq = batch.seqs[i]
            c = seq.num_computed_tokens
            rows.extend(range(first, first + n))
            targets.extend(seq.token_ids[c + 1:c + 1 + n])
            ks.append(seq.params.prompt_logprobs)
        sel = logits.index_select(0, self._to_device(rows))
        return token_logprobs(sel, self._to_device(targets), max(ks))

    # ---- host-side batch building -------------------------------------------------------------

    def _fill_decode(self, inputs: StepInputs, seqs: list[Sequence], rows: np.ndarray, padded: int,
                     width: int, ahead: int = 0, host_fed: int = 0) -> None:
        """One new token per sequence (its last); rows S..padded-1 are padding. ``ahead`` = 1:
        the token after the last, not sampled yet (its id is copied in on the device), except
        for the last ``host_fed`` rows, which compute their last token (``ScheduledBatch``)."""
        S = len(seqs)
        fed = S - host_fed if ahead else 0  # rows whose token comes from the device
        pos = np.fromiter((s.num_computed_tokens + (ahead if i < fed else 0) for i, s in enumerate(seqs)),
                          dtype=np.int64, count=S)
        tok = 0 if fed == S else [0 if i < fed else s.token_ids[-1] for i, s in enumerate(seqs)]
        self._fill_token_rows(inputs, tok, pos, rows, padded, width)

    def _fill_verify(self, inputs: StepInputs, seqs: list[Sequence], rows: np.ndarray, drafts: list[list[int]],
                     padded: int, width: int) -> None:
        """Seq i's last token and its drafts as 1 + len(drafts[i]) one-token rows at
        consecutive positions, each attending up to its own position (every layer stores the
        step's K/V before it attends); rows past them up to ``padded`` are padding."""
        counts = np.fromiter((1 + len(d) for d in drafts), dtype=np.int64, count=len(seqs))
        R = int(counts.sum())
        owner = np.repeat(np.arange(len(seqs)), counts)
        first = np.cumsum(counts) - counts
        start = np.fromiter((s.num_computed_tokens for s in seqs), dtype=np.int64, count=len(seqs))
        pos = start[owner] + np.arange(R) - first[owner]
        tok = [t for s, d in zip(seqs, drafts) for t in (s.token_ids[-1], *d)]
        self._fill_token_rows(inputs, tok, pos, rows[owner], padded, width)

    def _fill_token_rows(self, inputs: StepInputs, tok, pos: np.ndarray, runner_rows: np.ndarray, padded: int,
                         width: int) -> None:
        """Rows of one token each: row r is token tok[r] at position pos[r] of the request in
        runner row runner_rows[r], attending up to that position; rows past them up to
        ``padded`` write nowhere and attend to nothing."""
        R = len(pos)
        npb = inputs.np
        tables = self.rows.tables
        npb["tok"][:R] = tok
        npb["pos"][:R] = pos
        bs = self.block_size
        npb["slot"][:R] = tables[runner_rows, pos // bs].astype(np.int64) * bs + pos % bs
        npb["sl"][:R] = pos + 1
        npb["qsl"][: R + 1] = np.arange(R + 1, dtype=np.int32)
        inputs.block_table(R, width)[:] = tables[runner_rows, :width]
        if padded > R:
            inputs.pad_tokens(R, padded)
            inputs.pad_seqs(R, padded, width, seq_len=0)

    def _fill_mixed(self, inputs: StepInputs, seqs: list[Sequence], rows: np.ndarray, num_new: list[int],
                    width: int) -> int:
        """Pack the step, one query segment per seq; the number of tokens."""
        npb = inputs.np
        bs = self.block_size
        bt = inputs.block_table(len(seqs), width)
        t = 0
        npb["qsl"][0] = 0
        for i, (s, n) in enumerate(zip(seqs, num_new)):
            c = s.num_computed_tokens
            npb["tok"][t:t + n] = s.token_ids[c:c + n]
            pos = np.arange(c, c + n, dtype=np.int64)
            npb["pos"][t:t + n] = pos
            table = self.rows.tables[rows[i]]
            npb["slot"][t:t + n] = table[pos // bs].astype(np.int64) * bs + pos % bs
            npb["sl"][i] = c + n
            bt[i] = table[:width]
            t += n
            npb["qsl"][i + 1] = t
        return t

    def _logits_rows(self, seqs: list[Sequence], num_new: list[int]) -> tuple[int, ...] | None:
        """The token rows whose logits a prefill step needs when a seq's prompt
        log-probabilities are asked for (None when none is): every such seq's rows whose next
        token is a prompt token, and every seq's last row. Records which logits rows are each
        seq's last (``_last_logit_rows``) and which are prompt positions (``_prompt_lp_rows``)."""
        if not any(s.wants_prompt_logprobs for s in seqs):
            return None
        out: list[int] = []
        last_rows = []
        t = 0
        for i, (s, n) in enumerate(zip(seqs, num_new)):
            known = 0
            if s.wants_prompt_logprobs:
                c = s.num_computed_tokens
                known = max(0, min(c + n, s.num_prompt_tokens - 1) - c)  # positions whose next token is a prompt token
                if known:
                    self._prompt_lp_rows.append((i, len(out), known))
                out.extend(range(t, t + known))
            if known < n:
                out.append(t + n - 1)
            last_rows.append(len(out) - 1)
            t += n
        self._last_logit_rows = last_rows
        return tuple(out)


@torch.inference_mode()
def profile_step(
    config: ModelConfig,
    params: dict[str, Tensor],
    program: Program,
    *,
    num_tokens: int,
    num_seqs: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    kv_layers: int | None = None,
) -> None:
    """The largest step the engine runs: a prefill of num_tokens tokens, then sampling (with
    top-k/top-p sorting) of num_seqs rows of logits. Used to measure the activation peak.
    ``kv_layers``: the layers a pipeline stage's cache holds (None: all)."""
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, config.vocab_size, (max(num_tokens, 2),), generator=gen).tolist()
    # two sequences splitting the tokens (programs are exported for >= 2 sequences)
    half = len(tokens) // 2
    a, b = cdiv(half, block_size), cdiv(len(tokens) - half, block_size)
    kv = kvc.allocate(config, a + b, block_size, dtype, device, kv_layers)
    seqs = [ScheduledSeq(tokens[:half], 0, list(range(a))), ScheduledSeq(tokens[half:], 0, list(range(a, a + b)))]
    logits = program(params, pack_batch(seqs, block_size, device), kv)
    del kv
    rows = torch.randn((num_seqs, logits.shape[-1]), device=device, dtype=logits.dtype)
    p = SamplingParams(temperature=0.7, top_k=50, top_p=0.9)
    sample(rows, SamplingTensors.from_params([p] * num_seqs, logits.shape[-1], device))


def _to_host(lp: TokenLogprobs | None, stream: "torch.cuda.Stream") -> TokenLogprobs | None:
    """Non-blocking copies of ``lp`` into pinned host memory, queued on ``stream`` (current)."""
    if lp is None:
        return None
    copies = []
    for t in (lp.sampled, lp.rank, lp.top_values, lp.top_ids):
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t, non_blocking=True)
        t.record_stream(stream)
        copies.append(host)
    return TokenLogprobs(*copies)


def _positions(lp: TokenLogprobs | None) -> list[PositionLogprobs] | None:
    if lp is None:
        return None
    return list(zip(lp.sampled.tolist(), lp.rank.tolist(), lp.top_ids.tolist(), lp.top_values.tolist()))
