"""Runs one scheduled step on the device: packs the batch, calls the program (or replays a
CUDA graph for a decode step), samples.

Host work per step is kept small: inputs are written into preallocated (pinned, on CUDA) numpy
views and copied to preallocated device buffers with non_blocking copies; each running
sequence's block table is mirrored in a numpy array row that only receives its new blocks; the
only host sync of a step is fetching the sampled ids.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
from torch import Tensor

from compiled_llm.model.config import ModelConfig
from compiled_llm.graph.spec import PackedBatch
from compiled_llm.serve.sampling import SamplingTensors, greedy_ids, sample
from compiled_llm.serve.block_manager import cdiv
from compiled_llm.serve.cuda_graphs import StepGraphs, decode_buckets, prefill_buckets
from compiled_llm.serve.scheduler import ScheduledBatch
from compiled_llm.serve.sequence import Sequence

Program = Callable[[dict, PackedBatch, Tensor], Tensor]


@dataclass
class StepHandle:
    """A launched step: its sampled ids on the device, and the pinned host copy they are on
    their way to (ready once ``event`` completes)."""

    ids: Tensor | None  # [len(sample_rows)] int64 on the device; None when nothing is sampled
    host: Tensor | None
    event: "torch.cuda.Event | None"


class DecodeStaging:
    """The inputs of a decode step of up to ``max_rows`` sequences in one pinned host buffer and
    one device buffer with the same byte layout: tok, pos, slot (int64), sl, qsl (int32), then the
    block table (int32, rows x width) last. A step of ``rows`` rows uses a prefix of every field,
    so everything it needs lies in the first ``nbytes(rows)`` bytes and goes over in one copy
    (six separate small copies cost ~1 µs of device time each plus their gaps, on the critical
    path of every decode step). The few KB of unused field tails that ride along cost nothing
    measurable."""

    FIELDS = (("tok", torch.int64), ("pos", torch.int64), ("slot", torch.int64), ("sl", torch.int32),
              ("qsl", torch.int32), ("bt", torch.int32))

    def __init__(self, max_rows: int, width: int, device: torch.device):
        self.width = width
        counts = {"tok": max_rows, "pos": max_rows, "slot": max_rows, "sl": max_rows, "qsl": max_rows + 1,
                  "bt": max_rows * width}
        self.offset: dict[str, int] = {}
        end = 0
        for name, dtype in self.FIELDS:
            end = -(-end // 16) * 16  # every field 16-byte aligned
            self.offset[name] = end
            end += counts[name] * dtype.itemsize
        self.max_rows = max_rows
        cuda = torch.device(device).type == "cuda"
        self.host_bytes = torch.zeros(end, dtype=torch.uint8)
        # on a CPU the program reads the host buffer itself
        self.host_bytes = self.host_bytes.pin_memory() if cuda else self.host_bytes
        self.dev_bytes = torch.zeros(end, dtype=torch.uint8, device=device) if cuda else self.host_bytes

        def view(buf: Tensor, name: str, dtype: torch.dtype) -> Tensor:
            return buf[self.offset[name]: self.offset[name] + counts[name] * dtype.itemsize].view(dtype)

        self.host = {name: view(self.host_bytes, name, dt) for name, dt in self.FIELDS}
        self.np = {name: t.numpy() for name, t in self.host.items()}
        self.dev = {name: view(self.dev_bytes, name, dt) for name, dt in self.FIELDS}

    def nbytes(self, rows: int) -> int:
        return self.offset["bt"] + rows * self.width * 4

    def copy_in(self, rows: int) -> None:
        if self.dev_bytes is not self.host_bytes:
            n = self.nbytes(rows)
            self.dev_bytes[:n].copy_(self.host_bytes[:n], non_blocking=True)


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

        def host(n: int, dtype: torch.dtype) -> Tensor:
            t = torch.zeros(n, dtype=dtype)
            return t.pin_memory() if cuda else t

        n, s = self.max_tokens, max_num_seqs
        self._host = {
            "tok": host(n, torch.int64),
            "pos": host(n, torch.int64),
            "slot": host(n, torch.int64),
            "qsl": host(s + 1, torch.int32),
            "sl": host(s, torch.int32),
            "bt": host(s * self.width, torch.int32),
        }
        self._np = {k: v.numpy() for k, v in self._host.items()}
        # on a CPU the program reads the host buffers themselves
        self._dev = {k: v.to(self.device) if cuda else v for k, v in self._host.items()}
        self._copied = torch.cuda.Event() if cuda else None
        self._readback = torch.cuda.Stream(self.device) if cuda else None
        self._arange = np.arange(s + 1, dtype=np.int32)
        # block-table mirror: one row per running sequence (Sequence.row)
        self._tables = np.zeros((s, self.width), dtype=np.int32)
        self._row_key: list[tuple | None] = [None] * s
        self._row_synced = [0] * s
        self._staging: DecodeStaging | None = None  # bucketed decode steps' inputs (CUDA)
        self.graphs = StepGraphs()  # decode, by batch size
        self.decode_buckets: list[int] = []
        self.prefill_graphs = StepGraphs()  # prefill of one sequence, by token count
        self._ids_host = [host(s, torch.int64) for _ in range(2)] if cuda else []
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
        st = self._decode_staging()
        self.graphs.prepare(
            self.decode_buckets, lambda b: self._run_program(self._views(b, b, self.width, st.dev)),
            max(self.decode_buckets), self.device, pool,
        )
        if prefill_max_tokens > 0:
            self.prefill_graphs.prepare(
                prefill_buckets(min(prefill_max_tokens, self.max_tokens)),
                lambda t: self._run_program(self._views(t, 1, self.width)), 1, self.device, pool,
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
        self._np["tok"][:] = 0
        self._np["pos"][:] = 0
        self._np["slot"][:] = -1
        self._np["bt"][:] = 0
        self._np["qsl"][:2] = (0, 1)
        self._np["sl"][:1] = 1
        for k in self._dev:
            self._dev[k].copy_(self._host[k])
        jobs = [(self.graphs, b) for b in self.graphs.buckets]
        if self.prefill_graphs.enabled:
            jobs += [(self.prefill_graphs, b) for b in self.prefill_graphs.buckets]
        return all([graphs.capture(b) for graphs, b in jobs[part::parts]])

    def idle_decode_inputs(self) -> DecodeStaging:
        """The bucketed decode inputs set so that every row attends to one token of block 0 and
        writes nowhere (what graphs are captured with; profiling replays them too)."""
        if self._copied is not None:
            self._copied.synchronize()  # a queued step's copies have read the host buffers
        st = self._decode_staging()
        st.np["tok"][:] = 0
        st.np["pos"][:] = 0
        st.np["slot"][:] = -1
        st.np["sl"][:] = 1
        st.np["qsl"][:] = self._arange[: st.np["qsl"].shape[0]]
        st.np["bt"][:] = 0
        st.copy_in(st.max_rows)
        return st

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
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copies have read the host buffers
        self._sync_tables(seqs)
        ahead = 0 if ahead_of is None else 1
        assert ahead == 0 or batch.is_decode, "only decode steps are scheduled ahead"
        if batch.is_decode:
            bucket = self.graphs.bucket_for(S) if self.decode_buckets else None
            if bucket is not None:
                # Padded to the bucket at full width, with or without graphs: eager decode
                # runs exactly the kernels and shapes the graphs replay. Inputs go over in one
                # copy (DecodeStaging).
                st = self._decode_staging()
                self._fill_decode(seqs, bucket, self.width, ahead, st.np)
                st.copy_in(bucket)
                if self._copied is not None:
                    self._copied.record()
                self._tokens_from(ahead_of, ahead_rows, S, st.dev["tok"])
                if self.graphs.enabled:
                    return self.graphs.run(bucket, S)
                return self._run_program(self._views(bucket, bucket, self.width, st.dev))[:S]
            width = max(len(s.block_table) for s in seqs)
            self._fill_decode(seqs, S, width, ahead)
            self._copy_in(S, S, width)
            self._tokens_from(ahead_of, ahead_rows, S, self._dev["tok"])
            return self._run_program(self._views(S, S, width))
        elif S == 1 and self.prefill_graphs.enabled:
            bucket = self.prefill_graphs.bucket_for(batch.num_new_tokens[0])
            if bucket is not None:
                T = self._fill_mixed(seqs, batch.num_new_tokens, self.width)
                # rows T..bucket-1 belong to no sequence: they write nowhere
                self._np["tok"][T:bucket] = 0
                self._np["pos"][T:bucket] = 0
                self._np["slot"][T:bucket] = -1
                self._copy_in(bucket, 1, self.width)
                return self.prefill_graphs.run(bucket, 1)
            width = max(len(s.block_table) for s in seqs)
            T = self._fill_mixed(seqs, batch.num_new_tokens, width)
        else:
            width = max(len(s.block_table) for s in seqs)
            T = self._fill_mixed(seqs, batch.num_new_tokens, width)
        self._copy_in(T, S, width)
        return self._run_program(self._views(T, S, width))

    def _decode_staging(self) -> DecodeStaging:
        """The bucketed decode steps' input buffers, sized for the largest bucket (made once,
        before the graphs that read them are captured)."""
        need = max(self.decode_buckets)
        if self._staging is None or self._staging.max_rows < need or self._staging.width != self.width:
            self._staging = DecodeStaging(need, self.width, self.device)
        return self._staging

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

    def _sync_tables(self, seqs: list[Sequence]) -> None:
        """Copy new block-table entries of each sequence into its mirror row."""
        for s in seqs:
            r = s.row
            key = (s.request_id, s.table_epoch)
            if self._row_key[r] != key:
                self._row_key[r] = key
                self._row_synced[r] = 0
            k, n = self._row_synced[r], len(s.block_table)
            if n > k:
                self._tables[r, k:n] = s.block_table[k:n]
                self._row_synced[r] = n

    def _fill_decode(self, seqs: list[Sequence], padded: int, width: int, ahead: int = 0,
                     npb: dict[str, np.ndarray] | None = None) -> None:
        """One new token per sequence (its last); rows S..padded-1 are padding. ``ahead`` = 1:
        the token after the last, not sampled yet (its id is copied in on the device). ``npb``:
        the host arrays to fill (the general step buffers by default)."""
        S = len(seqs)
        npb = self._np if npb is None else npb
        rows = np.fromiter((s.row for s in seqs), dtype=np.int64, count=S)
        pos = np.fromiter((s.num_computed_tokens + ahead for s in seqs), dtype=np.int64, count=S)
        npb["tok"][:S] = 0 if ahead else [s.token_ids[-1] for s in seqs]
        npb["pos"][:S] = pos
        bs = self.block_size
        npb["slot"][:S] = self._tables[rows, pos // bs].astype(np.int64) * bs + pos % bs
        npb["sl"][:S] = pos + 1
        npb["qsl"][: padded + 1] = self._arange[: padded + 1]
        bt = npb["bt"][: padded * width].reshape(padded, width)
        bt[:S] = self._tables[rows, :width]
        if padded > S:
            npb["tok"][S:padded] = 0
            npb["pos"][S:padded] = 0
            npb["slot"][S:padded] = -1
            npb["sl"][S:padded] = 0
            bt[S:] = 0

    def _fill_mixed(self, seqs: list[Sequence], num_new: list[int], width: int) -> int:
        npb = self._np
        bs = self.block_size
        bt = npb["bt"][: len(seqs) * width].reshape(len(seqs), width)
        t = 0
        npb["qsl"][0] = 0
        for i, (s, n) in enumerate(zip(seqs, num_new)):
            c = s.num_computed_tokens
            npb["tok"][t:t + n] = s.token_ids[c:c + n]
            pos = np.arange(c, c + n, dtype=np.int64)
            npb["pos"][t:t + n] = pos
            row = self._tables[s.row]
            npb["slot"][t:t + n] = row[pos // bs].astype(np.int64) * bs + pos % bs
            npb["sl"][i] = c + n
            bt[i] = row[:width]
            t += n
            npb["qsl"][i + 1] = t
        return t

    def _copy_in(self, T: int, S: int, width: int) -> None:
        if self._copied is None:
            return
        sizes = {"tok": T, "pos": T, "slot": T, "qsl": S + 1, "sl": S, "bt": S * width}
        for k, n in sizes.items():
            self._dev[k][:n].copy_(self._host[k][:n], non_blocking=True)
        self._copied.record()

    def _views(self, T: int, S: int, width: int, d: dict[str, Tensor] | None = None) -> PackedBatch:
        d = self._dev if d is None else d
        return PackedBatch(
            token_ids=d["tok"][:T],
            positions=d["pos"][:T],
            query_start_loc=d["qsl"][: S + 1],
            seq_lens=d["sl"][:S],
            block_tables=d["bt"][: S * width].view(S, width),
            slot_mapping=d["slot"][:T],
        )


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
    from compiled_llm.graph.batch import ScheduledSeq, pack_batch
    from compiled_llm.serve.sampling import SamplingParams
    from compiled_llm.serve import kv_cache as kvc

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
