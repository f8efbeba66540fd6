"""The engine loop: requests in, one scheduled step at a time, outputs out.

``LLMEngine`` owns the KV cache, block manager, scheduler and model runner of one loaded model.
``add_request`` validates a request completely (a request that can never be served is refused
there, never left to hang), ``step`` runs one batch and returns the outputs that changed:
finished requests, and every new token of streaming ones.

A request with ``n`` > 1 runs as ``n`` sequences. The first computes the prompt; the others wait
until it has, then take its full prompt blocks by reference (the block manager counts the
holders) and compute only the prompt's last partial block before sampling on their own.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import logging
import time
from typing import Any, Callable, Iterable

import torch

from compiled_llm.errors import EngineError, InvalidOptionError, InvalidRequestError
from compiled_llm.serve.engine_config import EngineConfig
from compiled_llm.serve.worker.sampler import make_generator
from compiled_llm.serve.sampling_params import SamplingParams
from compiled_llm.serve.worker import kv_cache as kvc
from compiled_llm.serve.core.block_manager import BlockManager, cdiv, hybrid_kv_savings
from compiled_llm.serve.core.detokenizer import IncrementalDetokenizer
from compiled_llm.serve.executor.multiproc import MultiprocExecutor
from compiled_llm.engine.loaded_model import LoadedModel
from compiled_llm.serve.worker import pipeline_lanes
from compiled_llm.serve.worker.model_runner import ModelRunner, RankGraphs, _label, profile_step
from compiled_llm.serve.core.request_validator import RequestValidator
from compiled_llm.serve.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput
from compiled_llm.serve.core.scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from compiled_llm.serve.core.sequence import Sequence
from compiled_llm.serve.core.spec_decode.speculator import Speculator
from compiled_llm.serve.core.structured_output.grammar_matcher import accept_tokens
from compiled_llm.serve.core.structured_output.sampling_mode import any_masked_before


logger = logging.getLogger(__name__)

# How long an idle engine waits for a grammar compile before it looks at its callers again
GRAMMAR_WAIT_S = 0.02

# After a failed step of a tensor-parallel engine: how long a rank that is ending may take to be seen
FAILED_RANK_WAIT_S = 3.0


def start_executor(model: LoadedModel, config: EngineConfig):
    """The other ranks of ``model`` (tensor-parallel, and pipeline stages), run by the backend
    ``config`` names."""
    # the custom all-reduce's workspace spans every rank: a pipelined engine's stages all-reduce
    # through NCCL over their own groups
    custom_all_reduce = not config.disable_custom_all_reduce and model.pp_size == 1
    if config.distributed_executor_backend == "ray":
        # imported here: the Ray backend is an optional extra, and its module imports Ray only when started
        from compiled_llm.serve.executor.ray_executor import RayExecutor

        return RayExecutor(model.engine_dir, model.world_size, model.device, custom_all_reduce=custom_all_reduce,
                           tp_size=model.tp_size)
    return MultiprocExecutor(model.engine_dir, model.world_size, model.device, custom_all_reduce=custom_all_reduce,
                             tp_size=model.tp_size)


@dataclasses.dataclass
class EngineStats:
    steps: int = 0
    prefill_steps: int = 0  # steps with any prompt tokens (run eagerly)
    prefill_tokens: int = 0
    prefill_s: float = 0.0
    decode_steps: int = 0  # pure decode steps (CUDA graphs when captured)
    decode_tokens: int = 0
    decode_s: float = 0.0
    ahead_steps: int = 0  # decode steps queued before the previous step's tokens were read
    dropped_ahead_tokens: int = 0  # tokens computed ahead for sequences that had finished (or were redrawn)
    # structured rows whose grammar refused their unmasked draw: taking a later token of their
    # race, or (all of those refused too) drawn again masked
    grammar_candidates: int = 0
    grammar_redraws: int = 0
    generated_tokens: int = 0
    preemptions: int = 0  # sequences sent back to wait (their KV freed) for want of blocks
    prefix_hit_tokens: int = 0  # prompt tokens found in the prefix cache
    kv_num_blocks: int = 0
    graph_capture_s: float = 0.0
    graphs_captured: int = 0
    memory: dict = dataclasses.field(default_factory=dict)
    init_s: dict = dataclasses.field(default_factory=dict)  # engine start-up: KV sizing, KV allocation


def total_stats(stats: Iterable[EngineStats]) -> EngineStats:
    """The counters of several engines (data-parallel replicas) added up: steps, tokens, blocks,
    graphs and seconds (engine-seconds: replicas stepping side by side add theirs); ``memory`` and
    ``init_s`` are the first engine's."""
    stats = list(stats)
    total = EngineStats(memory=dict(stats[0].memory), init_s=dict(stats[0].init_s)) if stats else EngineStats()
    for f in dataclasses.fields(EngineStats):
        if f.name not in ("memory", "init_s"):
            setattr(total, f.name, sum(getattr(st, f.name) for st in stats))
    return total


@dataclasses.dataclass(eq=False)
class _Request:
    """One request's sequences (one per completion) and their detokenizers."""

    request_id: str
    seqs: list[Sequence]
    detoks: list[IncrementalDetokenizer | None]
    stream: bool
    # per completion: how many of its tokens / logprobs earlier outputs have carried
    sent_tokens: list[int]
    prompt_logprobs_sent: bool = False  # a delta has carried them

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)


class LLMEngine:
    def __init__(self, model: LoadedModel, config: EngineConfig = EngineConfig()):
        self.model = model
        self.config = config
        mc = model.config
        self.tokenizer = model.tokenizer
        self.device = torch.device(model.device)
        limit = min(mc.max_position_embeddings, model.max_model_len or mc.max_position_embeddings)
        if config.max_model_len is not None and config.max_model_len > limit:
            # vLLM refuses a length past the model's too, rather than serve a shorter one
            raise InvalidOptionError(f"max_model_len {config.max_model_len} is more than this engine's limit of {limit} "
                                     f"tokens (the model's max_position_embeddings or its build's --max-model-len)")
        self.max_model_len = config.max_model_len or limit
        if not config.enable_chunked_prefill and config.max_num_batched_tokens < self.max_model_len:
            # a prompt that does not fit one step's budget could never be scheduled
            raise InvalidOptionError(
                f"without chunked prefill, max_num_batched_tokens ({config.max_num_batched_tokens}) must be at least "
                f"max_model_len ({self.max_model_len})"
            )
        self._stats = EngineStats()
        # the other tensor-parallel ranks: every device operation below is sent to them first
        self.executor = start_executor(model, config) if model.world_size > 1 else None
        try:
            self._init_on_device(model, config)
        except BaseException:
            self.shutdown()
            raise

    def _init_on_device(self, model: LoadedModel, config: EngineConfig) -> None:
        """KV cache, scheduler, runner: everything after the options are checked."""
        mc = model.config
        bs = config.block_size
        max_num_seqs = config.max_num_seqs
        t0 = time.perf_counter()
        num_blocks = config.num_blocks
        graphs_on = not config.enforce_eager and self.device.type == "cuda"
        if num_blocks is None and self.device.type == "cuda":
            # a pipeline stage's cache holds its layers only; stage 0 (this rank) holds the most
            # (earlier stages take the extra layers), so its block count fits every stage's. The
            # decode lanes' buffers, made later, are held back: the most any rank's hold (rank 0's
            # logits, the last stage's graph outputs)
            num_blocks, self._stats.memory = kvc.gpu_num_blocks(
                mc, bs, model.dtype, self.device, config.gpu_memory_utilization, self.profile_largest_step,
                model.kv_layers, reserved=lambda: max(self.lane_bytes(graphs_on), default=0),
            )
            # Blocks beyond what every sequence can hold at once, twice over (the second half keeps
            # prefixes cached), would only cost start-up time: a tiny model on a large GPU would
            # otherwise get tens of millions of them.
            num_blocks = min(num_blocks, 2 * max_num_seqs * cdiv(self.max_model_len, bs))
        else:
            if num_blocks is None:
                num_blocks = kvc.cpu_num_blocks(
                    mc, bs, model.dtype, config.kv_cache_gib, max_num_seqs * cdiv(self.max_model_len, bs) + 1,
                    model.kv_layers,
                )
            # no sizing step ran the program: a two-token one does, so a program that does not
            # run on its weights is refused here rather than by the first request's step
            self._profile_step(2, 1)
        self._stats.kv_num_blocks = num_blocks
        t1 = time.perf_counter()
        kv_cache = kvc.allocate(mc, num_blocks, bs, model.dtype, self.device, model.kv_layers)
        self._stats.init_s = {"kv_sizing": t1 - t0, "kv_alloc": time.perf_counter() - t1}

        self.block_manager = BlockManager(num_blocks, bs, config.enable_prefix_caching, sliding_window=mc.kv_window)
        _log_kv_layout(mc, self.max_model_len, bs, config.max_num_batched_tokens)
        pipelined = model.pp_size > 1
        prefill_graph_tokens = solo_prefill_max_tokens(config, self.device, self.max_model_len, pipelined)
        self.speculator = Speculator(config.speculative) if config.speculative is not None else None
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_model_len=self.max_model_len,
                enable_chunked_prefill=config.enable_chunked_prefill,
                solo_prefill_max_tokens=prefill_graph_tokens,
            ),
            self.block_manager,
            stop_token_ids=model.eos_token_ids,
            speculator=self.speculator,
        )
        runner_options = dict(max_num_seqs=max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
                              max_model_len=self.max_model_len)
        # captured bucket by bucket on first use, so none stands before the first token
        graph_tokens = prefill_graph_tokens if graphs_on else None
        buckets_up_to = decode_buckets_up_to(config, self.device)
        if self.executor is not None:
            self.executor.send("make_runner", num_blocks, bs, runner_options, buckets_up_to, graph_tokens)
        self.runner = ModelRunner(mc, model.params, model.program, kv_cache, block_size=bs, device=self.device,
                                  tp_size=model.world_size, **runner_options)
        self.runner.peers = self.executor
        self.runner.eos_token_ids = tuple(model.eos_token_ids)
        if self.executor is not None:
            self.executor.before_teardown.append(self.runner.release_graphs)
        if buckets_up_to is not None:
            self.runner.set_decode_buckets(buckets_up_to)
        if graph_tokens is not None:
            self.runner.prepare_graphs(graph_tokens)

        self.validator = RequestValidator(
            tokenizer=self.tokenizer, vocab_size=mc.vocab_size, max_model_len=self.max_model_len, block_size=bs,
            num_blocks=num_blocks, max_num_seqs=max_num_seqs,
            yields_chosen_rows=getattr(model.program, "yields_chosen_rows", True),
            kv_window=mc.kv_window, max_step_tokens=config.max_num_batched_tokens,
        )
        self._requests: dict[str, _Request] = {}
        self._arrivals = itertools.count()
        self._ids = itertools.count()
        self.profile_labels = False
        self._pending = None  # (batch, handle) of a decode step queued ahead
        # step_deltas held back the streams' new tokens: the next call that does not sends them
        self._streams_held = False
        self._in_flight: ScheduledBatch | None = None  # the step being run, for clean-up if it fails
        self.failed_request_ids: list[str] = []  # requests the last step aborted because it raised
        self._grammars = None  # the GrammarCompiler, once a request has structured outputs

    @property
    def stats(self) -> EngineStats:
        """Counters so far; graphs are captured as their buckets first run, so the capture
        figures grow with use."""
        graphs = self.runner.all_graphs()
        self._stats.graphs_captured = sum(len(g.graphs) for g in graphs)
        self._stats.graph_capture_s = sum(g.capture_s for g in graphs)
        self._stats.preemptions = self.scheduler.num_preemptions
        self._stats.prefix_hit_tokens = self.block_manager.stats.hit_tokens
        return self._stats

    def capture_cuda_graphs(self, part: int = 0, parts: int = 1) -> bool:
        """Capture every CUDA graph bucket now instead of on first use (builds warming their
        kernels, benchmarks timing a steady state), or share ``part`` of ``parts`` of them.
        Call between steps; False when graphs are off."""
        if self.executor is not None:
            self.executor.send("capture_all_graphs", part, parts)
        return self.runner.capture_all_graphs(part, parts)

    def lane_bytes(self, graphs: bool) -> list[int]:
        """The bytes each rank's decode lanes will hold, with CUDA graphs when ``graphs``, rank 0
        first (``pipeline_lanes.lane_bytes``: asked once a step ran the header path, as the
        KV-sizing step does); [] for an engine without lanes (unpipelined, or whose decode steps
        run at their own sizes: ``decode_buckets_up_to``)."""
        up_to = decode_buckets_up_to(self.config, self.device)
        if self.model.pp_size == 1 or up_to is None:
            return []
        # the runner's lanes: up to max_graph_batch_size rows, the block table of max_model_len
        args = (min(up_to, self.config.max_num_seqs), cdiv(self.max_model_len, self.config.block_size), graphs)
        return [pipeline_lanes.lane_bytes(self.model.program, *args), *self.executor.ask("lane_bytes", *args)]

    def rank_graphs(self) -> list[RankGraphs]:
        """Every rank's CUDA graphs, rank 0 first: the buckets each set captured, whether a capture
        failed, and what its decode lanes hold (a rank whose capture fails runs eagerly, with a
        warning in its own log)."""
        others = self.executor.ask("graph_report") if self.executor is not None else []
        return [self.runner.graph_report(), *others]

    def profile_largest_step(self) -> None:
        """Run the step the KV-cache sizing measures (the largest prefill, then sampling of
        every row), without sizing anything: a build warms its kernels this way."""
        self._profile_step(min(self.config.max_num_batched_tokens, self.max_model_len), self.config.max_num_seqs)

    def _profile_step(self, num_tokens: int, num_seqs: int) -> None:
        size = (num_tokens, num_seqs, self.config.block_size)
        if self.executor is not None:
            self.executor.send("profile_step", *size)
        profile_step(self.model.config, self.model.params, self.model.program, num_tokens=size[0],
                     num_seqs=size[1], block_size=size[2], dtype=self.model.dtype, device=self.device,
                     kv_layers=self.model.kv_layers)

    def shutdown(self) -> None:
        """Stop the other tensor-parallel ranks, if any (the engine cannot step afterwards), and
        the grammar compiler's threads."""
        if getattr(self, "_grammars", None) is not None:
            self._grammars.shutdown()
        if self.executor is not None:
            self.executor.shutdown()

    # ---- requests -----------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return self.block_manager.num_blocks

    def set_profile_labels(self, on: bool) -> None:
        self.profile_labels = on
        self.runner.profile_labels = on

    def prompt_token_ids(self, prompt: Any) -> tuple[str | None, list[int]]:
        """(text, token ids) of a prompt given as text, {"prompt_token_ids": [...]} or a list of ids."""
        return self.validator.prompt_token_ids(prompt)

    def validate(self, prompt: Any, params: SamplingParams | None) -> tuple[str | None, list[int], SamplingParams]:
        """Everything that can be wrong with a request, checked before it is queued."""
        return self.validator.validate(prompt, params)

    def add_request(
        self,
        prompt: Any,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        stream: bool = False,
        _validated: tuple | None = None,
    ) -> str:
        text, ids, params = _validated or self.validate(prompt, params)
        arrival = next(self._arrivals)
        request_id = self.new_request_id() if request_id is None else str(request_id)
        if request_id in self._requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        seqs: list[Sequence] = []
        for i in range(params.n):
            seqs.append(Sequence(
                request_id=request_id,
                prompt_token_ids=ids,
                params=params,
                arrival=arrival,
                prompt=text,
                generator=make_generator(None if params.seed is None else params.seed + i, self.device),
                index=i,
                share_prompt_of=seqs[0] if i else None,
            ))
        detoks = [
            IncrementalDetokenizer(self.tokenizer, params.stop, params.include_stop_str_in_output, params.min_tokens)
            if params.detokenize and self.tokenizer is not None else None
            for _ in seqs
        ]
        self._requests[request_id] = _Request(request_id, seqs, detoks, stream, [0] * len(seqs))
        if params.structured_outputs is not None:
            for seq in seqs:  # one compile, a matcher each
                seq.grammar = self.grammar_compiler().matcher(params.structured_outputs)
        for seq in seqs:
            self.scheduler.add(seq)
        return request_id

    @property
    def live_grammar_matchers(self) -> int:
        """Structured sequences' matchers not yet released (0 once every one has finished)."""
        return 0 if self._grammars is None else self._grammars.live_matchers

    def grammar_compiler(self):
        """The engine's GrammarCompiler, made with the first structured request (it imports
        xgrammar, which an engine without one never loads)."""
        if self._grammars is None:
            from compiled_llm.serve.core.structured_output.grammar_compiler import GrammarCompiler

            self._grammars = GrammarCompiler(self.tokenizer, self.model.config.vocab_size, self.model.eos_token_ids)
        return self._grammars

    def new_request_id(self) -> str:
        """An id no request of this engine has had (safe from any thread)."""
        return str(next(self._ids))

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request now, freeing its blocks; its last output (finish reason "abort"),
        or None for an unknown or already finished request."""
        request = self._requests.pop(str(request_id), None)
        if request is None:
            return None
        for seq in request.seqs:
            self.scheduler.abort(seq)
        return self._output(request, range(len(request.seqs)))

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or self._pending is not None

    # ---- one step -----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One step's results: finished requests, and every new token of streaming ones."""
        return [self._output(request, indices) for request, indices in self._changes()]

    def step_deltas(self, hold_streams: bool = False) -> list[tuple]:
        """One step's results as what is new in them, the tuples the engine process sends
        (``engine_messages``): no output objects, nothing proportional to a request's length.

        ``hold_streams``: report the streams' first tokens and the requests that finished (or
        failed) only; the other new tokens wait for the next call without it, which sends each
        stream everything it has not sent, merged. The engine process holds them while its front
        ends have not read the outputs already sent: building and pickling every stream's delta
        is Python over every running row, every step, and a front end that is behind would merge
        them anyway."""
        changes = self._changes(report_streams=not hold_streams)
        if hold_streams:
            self._streams_held = True
        elif self._streams_held:
            self._streams_held = False
            changes = self._with_unsent(changes)
        return [self._delta(request, indices) for request, indices in changes]

    def _with_unsent(self, changes: list[tuple[_Request, list[int] | range]]):
        """``changes`` with every stream's completions that have tokens not yet sent (held by
        earlier steps) added, each request once."""
        by_request = {request.request_id: (request, indices) for request, indices in changes}
        for rid, request in self._requests.items():
            if not request.stream:
                continue
            unsent = {i for i, seq in enumerate(request.seqs) if request.sent_tokens[i] < seq.num_output_tokens}
            if not unsent:
                continue
            if rid in by_request:
                unsent.update(by_request[rid][1])
            by_request[rid] = (request, sorted(unsent))
        return list(by_request.values())

    def _changes(self, report_streams: bool = True) -> list[tuple[_Request, list[int] | range]]:
        """Run one step; the requests it finished, and the streamed ones it changed, with the
        completions that changed. With async scheduling a decode step is usually already
        queued on the device (launched by the previous call); this call queues the one after it
        before it waits, then applies the tokens of the step it waited for. A token computed
        ahead for a sequence that has finished meanwhile (EOS, stop string, abort) is dropped.

        If anything in the step raises, every request of the step (and of the step queued
        ahead) is aborted, so their blocks go back and the engine stays consistent for the
        others; their ids are in ``failed_request_ids`` and the exception propagates."""
        self.failed_request_ids = []
        try:
            if self.executor is not None:
                self.executor.check()
            return self._step(report_streams)
        except BaseException:
            self.failed_request_ids = self._abandon_steps()
            if self.executor is not None:  # a rank died: say which, not how the collective broke
                try:
                    self.executor.check(wait_s=FAILED_RANK_WAIT_S)
                except EngineError as e:
                    raise e from None
            raise
        finally:
            self._in_flight = None

    def _abandon_steps(self) -> list[str]:
        """Abort the requests of the failed step and of the one queued ahead of it. No prefix
        cache entry is left for KV they did not finish: blocks are registered only after a
        step's tokens are applied."""
        batches = [b for b in (self._in_flight, self._pending and self._pending[0]) if b]
        self._pending = None
        self.scheduler.stale_ahead.clear()
        # every request of the step, finished ones too: their outputs were not returned
        ids = list(dict.fromkeys(s.request_id for b in batches for s in b.seqs))
        for rid in ids:
            self.abort_request(rid)
        return ids

    def _step(self, report_streams: bool = True) -> list[tuple[_Request, list[int] | range]]:
        t0 = time.perf_counter()
        ahead = None
        if self._pending is not None:
            batch, handle = self._pending
            self._pending = None
            self._in_flight = batch
            if handle.deferred is not None:  # its grammars' bitmask needed the tokens applied last call
                # the next step's host inputs are filled while the bitmask fills on its thread,
                # so that its forward is queued right behind this step's sampling
                ahead = self._prepare_ahead(batch)
                self.runner.sample_deferred(handle, self.scheduler.stale_ahead)
        else:
            if not self.scheduler.has_unfinished():
                return []
            broken = self._requests_with_broken_grammars()
            if broken:
                return broken
            if not self.scheduler.has_schedulable():
                self._wait_for_grammars()
                return []
            with _label(self.profile_labels, "schedule"):
                batch = self.scheduler.schedule()
            if batch.is_empty:
                raise EngineError("the scheduler could not schedule any request (KV cache too small for the waiting ones)")
            self._in_flight = batch
            handle = self.runner.launch(batch)
        # prompt (or recomputed) tokens of this step, counted before update() appends tokens
        prompt_tokens = sum(n for s, n in zip(batch.seqs, batch.num_new_tokens) if n > 1 or s.num_output_tokens == 0)
        if ahead is None:
            ahead = self._prepare_ahead(batch)
        if ahead:
            ahead_batch, rows, prepared = ahead
            # rows that must be masked before sampling wait for this step's tokens
            masked = any_masked_before(ahead_batch.seqs)
            self._pending = (ahead_batch, self.runner.launch(ahead_batch, handle, rows, defer_sample=masked,
                                                             prepared=prepared))
            self._stats.ahead_steps += 1
        sampled = self.runner.collect(handle)
        logprobs = self.runner.collect_logprobs(handle)
        for i, positions in self.runner.collect_prompt_logprobs(handle):
            self._add_prompt_logprobs(batch.seqs[i], positions)
        if batch.is_verify:
            changed, logprobs = self._apply_verified(batch, sampled, logprobs)
            new_tokens = sum(n for _, n in changed)
        else:
            n_rows = len(batch.seqs)
            batch, sampled, logprobs, positions = _drop_finished(batch, sampled, logprobs, self.scheduler.stale_ahead)
            self._stats.dropped_ahead_tokens += n_rows - len(batch.seqs)
            if batch.is_empty:
                return []  # every sequence of the step queued ahead had finished
            stuck = self._advance_grammars(batch, sampled, positions, handle)
            if stuck:  # finished, their rows go
                batch, sampled, logprobs, _ = _drop_finished(batch, sampled, logprobs, set())
            changed = [(seq, 1) for seq in self.scheduler.update(batch, sampled)] + [(seq, 0) for seq in stuck]
            new_tokens = len(sampled)
            if self._pending is not None and self._pending[1].deferred is not None:
                # its grammars now hold this step's tokens: their bitmask fills while we go on
                self.runner.start_grammar_bitmask(self._pending[1])
        dt = time.perf_counter() - t0
        st = self._stats
        st.steps += 1
        st.generated_tokens += new_tokens
        if batch.is_decode or batch.is_verify:
            st.decode_steps += 1
            st.decode_tokens += new_tokens
            st.decode_s += dt
        else:
            st.prefill_steps += 1
            st.prefill_tokens += prompt_tokens
            st.prefill_s += dt

        changed_by_request: dict[str, list[int]] = {}
        lp_row = 0
        for seq, n in changed:
            request = self._requests.get(seq.request_id)
            first_lp, lp_row = lp_row, lp_row + n
            if request is None:
                continue
            det = request.detoks[seq.index]
            # the seq's new tokens, in order (several after a verification); nothing to do per
            # token without a detokenizer or logprobs (the engine process's streams, bench runs)
            for j in range(n if det is not None or logprobs is not None else 0):
                token = seq.token_ids[j - n]
                if logprobs is not None and seq.params.logprobs is not None:
                    self._add_logprobs(seq, token, logprobs[first_lp + j])
                if det is not None and det.add(token):
                    seq.stop_reason = det.stop_string
                    if j < n - 1:  # tokens after the one that completed the stop string go
                        del seq.token_ids[j + 1 - n:], seq.output_ids[j + 1 - n:]
                    if seq.is_finished:
                        seq.finish_reason = "stop"  # a stop string outranks max_tokens
                    else:
                        self.scheduler.finish(seq, "stop")
                    break
            if seq.is_finished:
                if det is not None:
                    det.finalize()
            elif not request.stream or (not report_streams and request.sent_tokens[seq.index]):
                continue  # nothing to report until it finishes (a held stream: until it is reported again)
            changed_by_request.setdefault(seq.request_id, []).append(seq.index)
        changes = []
        for rid, indices in changed_by_request.items():
            request = self._requests[rid]
            if request.finished:
                del self._requests[rid]
                changes.append((request, range(len(request.seqs))))
            elif request.stream:
                changes.append((request, indices))
        return changes

    def _prepare_ahead(self, batch: ScheduledBatch) -> tuple | bool:
        """The decode step queued behind ``batch`` before its tokens are known (async
        scheduling), with its host inputs filled: (its batch, the rows of ``batch`` its tokens
        come from, the prepared step); False when there is none."""
        if not (self.config.async_scheduling and batch.is_decode):
            return False
        with _label(self.profile_labels, "schedule"):
            ahead = self.scheduler.schedule_ahead(batch)
        if ahead is None:
            return False
        ahead_batch, rows = ahead
        return ahead_batch, rows, self.runner.prepare_decode(ahead_batch, True, rows)

    def _advance_grammars(self, batch: ScheduledBatch, sampled: list[int], positions: list[int] | None,
                          handle) -> list[Sequence]:
        """Give each structured row's token to its grammar before the tokens are applied. A
        checked row whose grammar refuses its token (``ModelRunner._sample``) takes the first
        later token of its race the grammar allows, else is drawn again under its mask, in
        ``sampled``; if the step queued ahead holds its seq, that row was computed from the
        refused token and is dropped there (``stale_ahead``).

        A row whose grammar refuses even the token drawn under its mask had every token masked:
        no token of the vocabulary continues the grammar (one the tokenizer cannot spell). Its
        seq is finished ("abort") and returned; the others go on."""
        structured = [j for j, row in enumerate(batch.sample_rows) if batch.seqs[row].grammar is not None]
        if not structured:
            return []
        taken = accept_tokens([batch.seqs[batch.sample_rows[j]].grammar for j in structured],
                              [sampled[j] for j in structured])
        refused = [j for j, ok in zip(structured, taken) if not ok]
        if not refused:
            return []
        # a row drawn under its mask already is stuck; a checked one takes the first of its
        # race's next tokens its grammar allows, else is drawn again masked
        checked = set(handle.check.positions) if handle.check is not None else set()
        place = (lambda j: j) if positions is None else positions.__getitem__
        stuck = [batch.seqs[batch.sample_rows[j]] for j in refused if place(j) not in checked]
        ahead = {s.seq_id for s in self._pending[0].seqs} if self._pending is not None else set()

        def replace(j: int, token: int) -> None:
            sampled[j] = token
            if batch.seqs[batch.sample_rows[j]].seq_id in ahead:
                self.scheduler.stale_ahead.add(batch.seqs[batch.sample_rows[j]].seq_id)

        # a greedy row is masked instead: a masked argmax breaks ties by the lowest id, a
        # ranking in no set order
        drawn, redraw = [], []
        for j in refused:
            if place(j) in checked:
                (drawn if batch.seqs[batch.sample_rows[j]].params.temperature > 0 else redraw).append(j)
        for j, candidates in zip(drawn, self.runner.race_candidates(handle, [place(j) for j in drawn]) if drawn else []):
            grammar = batch.seqs[batch.sample_rows[j]].grammar
            grammar.masks_first = True  # its state may allow few tokens: its next mask tells
            token = next((t for t in candidates if grammar.accept(t)), None)
            if token is None:
                redraw.append(j)
                continue
            replace(j, token)
            self._stats.grammar_candidates += 1
        if redraw:
            redrawn = self.runner.resample(handle, [place(j) for j in redraw])
            self._stats.grammar_redraws += len(redraw)
            for j, token in zip(redraw, redrawn):
                seq = batch.seqs[batch.sample_rows[j]]
                if seq.grammar.accept(token):
                    replace(j, token)
                else:
                    stuck.append(seq)
        for seq in stuck:
            logger.warning("request %s: no token of the vocabulary continues its grammar here; it is aborted",
                           seq.request_id)
            self.scheduler.finish(seq, "abort")
        return stuck

    def _wait_for_grammars(self, timeout_s: float = GRAMMAR_WAIT_S) -> None:
        """Block until a waiting sequence's grammar is compiled, or ``timeout_s`` (so that a
        caller driving the engine sees new submissions and aborts meanwhile)."""
        futures = [s.grammar.future for s in self.scheduler.waiting if s.waits_for_grammar]
        concurrent.futures.wait(futures, timeout=timeout_s, return_when=concurrent.futures.FIRST_COMPLETED)

    def _requests_with_broken_grammars(self) -> list[tuple[_Request, range]]:
        """Finish (reason "abort") the waiting requests whose grammar failed to compile: the
        front end checks every grammar, so this is xgrammar failing on one it had read."""
        out = []
        for seq in list(self.scheduler.waiting):
            error = seq.grammar.error if seq.grammar is not None and seq.grammar.ready else None
            request = self._requests.get(seq.request_id) if error is not None else None
            if request is None:
                continue
            logger.error("request %s: its grammar failed to compile (%s); it is aborted", seq.request_id, error)
            for s in request.seqs:
                self.scheduler.abort(s)
            del self._requests[seq.request_id]
            out.append((request, range(len(request.seqs))))
        return out

    def _apply_verified(self, batch: ScheduledBatch, sampled: list[int], logprobs: list | None):
        """Apply a verification step: (each seq with how many tokens it got, the log-probability
        entries of those tokens in the same order, or None)."""
        drafts = batch.draft_tokens
        emitted = self.speculator.verify(drafts, sampled)
        self.speculator.observe(batch.seqs, drafts, emitted)
        changed = self.scheduler.update_verified(batch, emitted)
        if logprobs is not None:
            # token j of seq i was sampled at its row j (rows of each seq consecutive)
            firsts = itertools.accumulate((1 + len(d) for d in drafts[:-1]), initial=0)
            logprobs = [logprobs[f + j] for f, (_, n) in zip(firsts, changed) for j in range(n)]
        return changed, logprobs

    # ---- outputs ------------------------------------------------------------------------------

    def _decoded(self, token_id: int) -> str | None:
        return self.tokenizer.decode([token_id], skip_special_tokens=False) if self.tokenizer is not None else None

    def _position(self, token_id: int, entry: tuple[float, int, list[int], list[float]]) -> PositionLogprobs:
        """token_id's and the top tokens' Logprobs at one position."""
        value, rank, top_ids, top_values = entry
        position = {t: Logprob(v, r + 1, self._decoded(t)) for r, (t, v) in enumerate(zip(top_ids, top_values))}
        position[token_id] = Logprob(value, rank, self._decoded(token_id))
        return position

    def _add_logprobs(self, seq: Sequence, token_id: int, entry) -> None:
        seq.logprobs.append(self._position(token_id, entry))
        seq.cumulative_logprob += entry[0]

    def _add_prompt_logprobs(self, seq: Sequence, positions: list) -> None:
        """Positions c+1.. of seq's prompt (c = its computed tokens before this step); those
        already held (a preempted seq recomputing its prompt) are skipped."""
        first = seq.num_computed_tokens + 1
        for p, entry in enumerate(positions, start=first):
            if p - 1 == len(seq.prompt_logprobs):
                seq.prompt_logprobs.append(self._position(seq.prompt_token_ids[p], entry))

    def _output(self, request: _Request, indices) -> RequestOutput:
        """The request's output for completions ``indices``, with what is new since their
        previous outputs. Its lists are copies once finished, else the live ones (a stream
        reads deltas)."""
        _, finished, _, _, deltas = self._delta(request, indices)
        first = request.seqs[0]
        completions = []
        for index, delta_text, delta_ids, finish_reason, stop_reason, cumulative, delta_logprobs in deltas:
            seq, det = request.seqs[index], request.detoks[index]
            done = seq.is_finished
            wants_lp = seq.params.logprobs is not None
            completions.append(CompletionOutput(
                index=index,
                text=det.snapshot() if det is not None else "",
                token_ids=list(seq.output_ids) if done else seq.output_ids,
                finish_reason=finish_reason,
                stop_reason=stop_reason,
                cumulative_logprob=cumulative,
                logprobs=(list(seq.logprobs) if done else seq.logprobs) if wants_lp else None,
                delta_text=delta_text,
                delta_token_ids=delta_ids,
                delta_logprobs=delta_logprobs,
            ))
        return RequestOutput(
            request_id=request.request_id,
            prompt=first.prompt,
            prompt_token_ids=first.prompt_token_ids,
            outputs=completions,
            finished=finished,
            metrics=first.metrics,
            prompt_logprobs=None if first.params.prompt_logprobs is None else [None] + first.prompt_logprobs,
        )

    def _delta(self, request: _Request, indices) -> tuple:
        """What is new in completions ``indices`` since their previous outputs, as
        ``engine_messages.EncodedOutput``: the metrics once finished, the prompt logprobs with
        the first output (a request's first token comes after its whole prompt)."""
        completions = []
        for index in indices:
            seq, det = request.seqs[index], request.detoks[index]
            sent, now = request.sent_tokens[index], seq.num_output_tokens
            request.sent_tokens[index] = now
            wants_lp = seq.params.logprobs is not None
            completions.append((
                index,
                det.take_delta(seq.is_finished) if det is not None else "",
                seq.output_ids[sent:now],
                seq.finish_reason,
                seq.stop_reason,
                seq.cumulative_logprob if wants_lp else None,
                seq.logprobs[sent:now] if wants_lp else None,
            ))
        first, finished = request.seqs[0], request.finished
        prompt_logprobs = None
        if first.params.prompt_logprobs is not None and not request.prompt_logprobs_sent:
            request.prompt_logprobs_sent = True
            prompt_logprobs = [None] + first.prompt_logprobs
        return request.request_id, finished, first.metrics if finished else None, prompt_logprobs, completions

    def prefix_cache_stats(self):
        return self.block_manager.stats


def _log_kv_layout(mc, max_model_len: int, block_size: int, step_tokens: int) -> None:
    """Say once, at start-up, how a sliding window shapes the KV cache of ``mc`` (the
    ModelConfig): a model whose layers all slide gives back the blocks behind the window; one
    mixing sliding and global layers keeps one pool with the whole context for every layer, and
    this says what a hybrid allocator (a pool per layer kind) would save, its sliding pools
    holding a step's ``step_tokens`` (a prefill chunk) on top of the window."""
    if mc.kv_window is not None:
        logger.info("sliding window of %d tokens on every layer: each sequence's KV blocks behind it are given back",
                    mc.kv_window)
        return
    saved = hybrid_kv_savings(mc, max_model_len, block_size, step_tokens)
    if saved > 0:
        local = sum(1 for layer in range(mc.num_layers) if mc.layer_window(layer))
        logger.info("%d of %d layers attend within a sliding window of %d tokens, but the KV cache keeps one pool with "
                    "the whole context for every layer: a hybrid allocator would save %.0f%% of the KV memory at "
                    "max_model_len %d (steps of up to %d tokens)", local, mc.num_layers, mc.sliding_window,
                    100 * saved, max_model_len, step_tokens)


def solo_prefill_max_tokens(config: EngineConfig, device: torch.device, max_model_len: int,
                            pipelined: bool = False) -> int:
    """The scheduler's ``solo_prefill_max_tokens``: the prefill graphs' largest prompt when the
    runner captures them (CUDA, graphs on, not a pipeline stage: its prefill runs eagerly), else 0."""
    if config.enforce_eager or device.type != "cuda" or pipelined:
        return 0
    return min(config.prefill_graph_max_tokens, max_model_len)


def decode_buckets_up_to(config: EngineConfig, device: torch.device) -> int | None:
    """The largest decode step the runner pads to a bucket: on CUDA the graphs' (eager steps
    too, so that they run the kernels the graphs replay), on a CPU none (None: every step runs
    at its own size)."""
    return config.max_graph_batch_size if device.type == "cuda" else None


def _drop_finished(batch: ScheduledBatch, sampled: list[int], logprobs: list | None, stale: set[int]):
    """The rows of a step whose sequences still run (a step queued ahead may hold sequences
    that finished or were aborted after it was queued, or whose row was computed from a token
    drawn again since: ``stale``, from which they are removed), with their sampled ids and
    logprobs, and each kept sampled row's place among the step's sampled rows (None when all
    are kept)."""
    if all(not s.is_finished for s in batch.seqs) and not stale:
        return batch, sampled, logprobs, None  # None: every sampled row, in place
    kept = ScheduledBatch()
    by_row = {row: j for j, row in enumerate(batch.sample_rows)}
    tokens, kept_lp, positions = [], [], []
    for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
        if seq.seq_id in stale:
            stale.discard(seq.seq_id)
            continue
        if seq.is_finished:
            continue
        if i in by_row:
            kept.sample_rows.append(len(kept.seqs))
            tokens.append(sampled[by_row[i]])
            positions.append(by_row[i])
            if logprobs is not None:
                kept_lp.append(logprobs[by_row[i]])
        kept.seqs.append(seq)
        kept.num_new_tokens.append(n)
    return kept, tokens, (kept_lp if logprobs is not None else None), positions
