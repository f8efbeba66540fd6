"""Runs one scheduled step on the device: packs the batch, calls the program (or replays a
CUDA graph for a decode step), samples.

Host work per step is kept small: inputs are written into preallocated (pinned, on CUDA) numpy
views and copied to preallocated device buffers with non_blocking copies (``StepInputs``); each
running request's block table is mirrored in a numpy array row that only receives its new blocks
(``RequestRows``, owned here); the only host sync of a step is fetching the sampled ids.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
from torch import Tensor

from compiled_llm.graph.batch import ScheduledSeq, pack_batch
from compiled_llm.graph.spec import PackedBatch
from compiled_llm.model.config import ModelConfig
from compiled_llm.serve import kv_cache as kvc
from compiled_llm.serve.block_manager import cdiv
from compiled_llm.serve.cuda_graphs import StepGraphs, decode_buckets, prefill_buckets
from compiled_llm.serve.request_rows import RequestRows
from compiled_llm.serve.sampling import SamplingParams, SamplingTensors, greedy_ids, sample
from compiled_llm.serve.scheduler import ScheduledBatch
from compiled_llm.serve.sequence import Sequence
from compiled_llm.serve.step_inputs import StepInputs

Program = Callable[[dict, PackedBatch, Tensor], Tensor]


@dataclass
class StepHandle:
    """A launched step: its sampled ids on the device, and the pinned host copy they are on
    their way to (ready once ``event`` completes)."""

    ids: Tensor | None  # [len(sample_rows)] int64 on the device; None when nothing is sampled
    host: Tensor | None
    event: "torch.cuda.Event | None"


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
    ):
        self.config = config
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
        self._ids_host = [torch.zeros(s, dtype=torch.int64).pin_memory() for _ in range(2)] if cuda else []
        self._ids_turn = 0

    # ---- CUDA graphs --------------------------------------------------------------------------

    def set_decode_buckets(self, max_batch_size: int) -> None:
        """Pad decode steps of up to max_batch_size sequences to buckets (CUDA only)."""
        if self.device.type == "cuda":
            self.decode_buckets = decode_buckets(min(max_batch_size, self.max_num_seqs))
            self.graphs.buckets = self.decode_buckets

    def prepare_graphs(self, prefill_max_tokens: int) -> bool:
        """Decode graphs by batch size and graphs of one sequence's prefill of up to
        ``prefill_max_tokens`` tokens (0: none), captured on first use in one memory pool (the
        two never run at once). CUDA only; False when there is nothing to capture."""
        if self.device.type != "cuda" or not self.decode_buckets:
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

    @torch.inference_mode()
    def capture_all_graphs(self, part: int = 0, parts: int = 1) -> bool:
        """Capture every prepared bucket now, on inputs that write nowhere (a build warms every
        kernel specialisation this way; profiling tools replay them). With ``parts`` > 1, only
        share ``part`` of the decode and prefill buckets (a build splits them over processes)."""
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
               ahead_rows: list[int] | None = None) -> StepHandle:
        """Queue the step's forward and sampling on the device without waiting for them.

        With ``ahead_of`` the batch is a decode step scheduled before the step ``ahead_of``
        finished: each row's input token is that step's sampled id (row ahead_rows[i] of it,
        all rows in order when None), copied on the device, and its position is one past the
        sequence's num_computed_tokens (which the earlier step has not yet advanced)."""
        with _label(self.profile_labels, "forward"):
            logits = self._forward(batch, ahead_of, ahead_rows)
        with _label(self.profile_labels, "sample"):
            ids = self._sample(batch, logits)
        if ids is None:
            return StepHandle(None, None, None)
        if self.device.type != "cuda":
            return StepHandle(ids, ids, None)
        # two pinned buffers, alternating: a launch may be queued while the previous one's ids
        # are still being read back. The read-back runs on a side stream, so the next step's
        # input copy and graph do not queue behind it.
        self._ids_turn ^= 1
        host = self._ids_host[self._ids_turn][: ids.shape[0]]
        self._readback.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._readback):
            host.copy_(ids, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        ids.record_stream(self._readback)  # the allocator must not reuse ids before the copy ran
        return StepHandle(ids, host, event)

    @staticmethod
    def collect(handle: StepHandle) -> list[int]:
        """Wait for a launched step; its sampled ids as Python ints."""
        if handle.ids is None:
            return []
        if handle.event is not None:
            handle.event.synchronize()
        return handle.host.tolist()

    def _forward(self, batch: ScheduledBatch, ahead_of: StepHandle | None = None,
                 ahead_rows: list[int] | None = None) -> Tensor:
        seqs = batch.seqs
        S = len(seqs)
        self._wait_for_copies()
        self.rows.release(batch.released_request_ids)
        rows = self.rows.rows_of(seqs)
        ahead = 0 if ahead_of is None else 1
        assert ahead == 0 or batch.is_decode, "only decode steps are scheduled ahead"
        if batch.is_decode:
            bucket = self.graphs.bucket_for(S) if self.decode_buckets else None
            if bucket is not None:
                # Padded to the bucket at full width, with or without graphs: eager decode
                # runs exactly the kernels and shapes the graphs replay.
                inputs, T, width = self.decode_inputs(), bucket, self.width
                graphs = self.graphs if self.graphs.enabled else None
            else:
                inputs, T, width, graphs = self.inputs, S, self._width_of(seqs), None
            self._fill_decode(inputs, seqs, rows, T, width, ahead)
            self._copy_in(inputs, T, T, width)
            self._tokens_from(ahead_of, ahead_rows, S, inputs.dev["tok"])
            if graphs is not None:
                return graphs.run(T, S)
            return self._run_program(inputs.views(T, T, width))[:S]
        inputs = self.inputs
        bucket = None
        if S == 1 and self.prefill_graphs.enabled:
            bucket = self.prefill_graphs.bucket_for(batch.num_new_tokens[0])
        width = self.width if bucket is not None else self._width_of(seqs)
        T = self._fill_mixed(inputs, seqs, rows, batch.num_new_tokens, width)
        if bucket is not None:
            inputs.pad_tokens(T, bucket)
            self._copy_in(inputs, bucket, 1, width)
            return self.prefill_graphs.run(bucket, 1)
        self._copy_in(inputs, T, S, width)
        return self._run_program(inputs.views(T, S, width))

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

    def _tokens_from(self, handle: StepHandle | None, rows: list[int] | None, S: int, tok: Tensor) -> None:
        """Input tokens of a step scheduled ahead: the earlier step's sampled ids, copied into
        ``tok`` on the device after (stream order) the host inputs landed."""
        if handle is None:
            return
        src = handle.ids
        if rows is not None:
            src = src.index_select(0, self._to_device(rows))
        tok[:S].copy_(src)

    def _to_device(self, values: list[int]) -> Tensor:
        """A small index list on the device without a host sync (pinned, non-blocking copy; a
        plain torch.tensor(..., device=cuda) waits for the stream)."""
        t = torch.tensor(values, dtype=torch.int64)
        if self.device.type != "cuda":
            return t
        return t.pin_memory().to(self.device, non_blocking=True)

    def _run_program(self, batch: PackedBatch) -> Tensor:
        return self.program(self.params, batch, self.kv_cache)

    def _sample(self, batch: ScheduledBatch, logits: Tensor) -> Tensor | None:
        rows = batch.sample_rows
        if not rows:
            return None
        if len(rows) != len(batch.seqs):
            logits = logits.index_select(0, self._to_device(rows))
        seqs = [batch.seqs[r] for r in rows]
        params = [s.params for s in seqs]
        if all(p.greedy for p in params):
            ids = greedy_ids(logits)
        else:
            st = SamplingTensors.from_params(params, logits.shape[-1], logits.device)
            gens = [s.generator for s in seqs]
            ids = sample(logits, st, gens if any(g is not None for g in gens) else None)
        return ids

    # ---- host-side batch building -------------------------------------------------------------

    def _fill_decode(self, inputs: StepInputs, seqs: list[Sequence], rows: np.ndarray, padded: int,
                     width: int, ahead: int = 0) -> None:
        """One new token per sequence (its last); rows S..padded-1 are padding. ``ahead`` = 1:
        the token after the last, not sampled yet (its id is copied in on the device)."""
        S = len(seqs)
        npb = inputs.np
        tables = self.rows.tables
        pos = np.fromiter((s.num_computed_tokens + ahead for s in seqs), dtype=np.int64, count=S)
        npb["tok"][:S] = 0 if ahead else [s.token_ids[-1] for s in seqs]
        npb["pos"][:S] = pos
        bs = self.block_size
        npb["slot"][:S] = tables[rows, pos // bs].astype(np.int64) * bs + pos % bs
        npb["sl"][:S] = pos + 1
        npb["qsl"][: S + 1] = np.arange(S + 1, dtype=np.int32)
        inputs.block_table(S, width)[:] = tables[rows, :width]
        if padded > S:
            inputs.pad_tokens(S, padded)
            inputs.pad_seqs(S, padded, width, seq_len=0)

    def _fill_mixed(self, inputs: StepInputs, seqs: list[Sequence], rows: np.ndarray, num_new: list[int],
                    width: int) -> int:
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
) -> None:
    """The largest step the engine runs: a prefill of num_tokens tokens, then sampling (with
    top-k/top-p sorting) of num_seqs rows of logits. Used to measure the activation peak."""
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, config.vocab_size, (max(num_tokens, 2),), generator=gen).tolist()
    # two sequences splitting the tokens (programs are exported for >= 2 sequences)
    half = len(tokens) // 2
    a, b = cdiv(half, block_size), cdiv(len(tokens) - half, block_size)
    kv = kvc.allocate(config, a + b, block_size, dtype, device)
    seqs = [ScheduledSeq(tokens[:half], 0, list(range(a))), ScheduledSeq(tokens[half:], 0, list(range(a, a + b)))]
    logits = program(params, pack_batch(seqs, block_size, device), kv)
    del kv
    rows = torch.randn((num_seqs, logits.shape[-1]), device=device, dtype=logits.dtype)
    p = SamplingParams(temperature=0.7, top_k=50, top_p=0.9)
    sample(rows, SamplingTensors.from_params([p] * num_seqs, logits.shape[-1], device))
