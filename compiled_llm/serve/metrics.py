"""The server's Prometheus metrics, with vLLM's names (``compiled_llm:`` for ``vllm:``) and
meanings, and the periodic one-line stats log.

Every collector lives in the server's own ``CollectorRegistry``, so one process (a test) can run
several servers. Two kinds of updates, each where it is cheap:

- the engine's gauges (running, waiting, KV-cache usage) and counters (prompt and generation
  tokens, preemptions, prefix-cache queries and hits; with speculative decoding, drafts, draft
  tokens and accepted tokens, in all and by position) come with each message of the engine core
  (an ``EngineSnapshot``): the gauges show the latest, the counters advance by the differences.
  Each carries vLLM's ``engine`` label, the index of the data-parallel replica it counts ("0"
  when there is one engine), and each replica has its own stats line; the histograms below are
  the server's, over every replica (no engine label);
- the histograms and the finished-request counter take one observation per finished request,
  from the server's timestamps (HTTP arrival, first token handed to the client, finish) and the
  engine's (scheduled, first token, finished), with its token counts and parameters;
- ``iteration_tokens_total`` takes one observation per engine step: the prompt and generated
  tokens it handled (from the snapshots' counters).

The inter-token latency (and its older name, time per output token) counts every gap between a
request's tokens, as vLLM's; the server sees a request's tokens when they are delivered, not
step by step, so each of its gaps is observed as the request's mean gap (the count and the sum
are exact).

Several API-server processes (``--api-server-count``) share their metrics through
prometheus_client's multiprocess mode (``share_metrics_across_processes``, before any metric is
made): each writes its values to files of one directory, and /metrics, whichever process
answers, adds up every process's (the gauges: the latest value set). Each counts the requests it
served; the first alone counts the engines' snapshots and logs the stats lines
(``records_engines``), so that nothing is counted twice.
"""

from __future__ import annotations

import bisect
import logging
import os
import time
from typing import Sequence

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import values
from prometheus_client.multiprocess import MultiProcessCollector

from compiled_llm.serve.engine_process.engine_messages import EngineSnapshot

logger = logging.getLogger("compiled_llm.serve.metrics")

PREFIX = "compiled_llm:"
CONTENT_TYPE = CONTENT_TYPE_LATEST

# Seconds. A GPU decode step takes milliseconds, a CPU one tens of them, and a queue under load
# minutes: the buckets span all three.
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0,
                    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_REQUEST_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                    60.0, 120.0, 240.0, 480.0, 960.0)


# vLLM's: tokens per engine step (powers of two up to a large step's budget), n, and token counts
# on a 1-2-5 scale up to the model's length
_ITERATION_BUCKETS = tuple(float(2 ** i) for i in range(15))
_N_BUCKETS = (1.0, 2.0, 5.0, 10.0, 20.0)


def one_two_five_buckets(limit: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to ``limit`` (vLLM's build_1_2_5_buckets)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > limit:
                return tuple(float(v) for v in out)
            out.append(m * scale)
        scale *= 10


MULTIPROCESS_DIR_VAR = "PROMETHEUS_MULTIPROC_DIR"  # prometheus_client's


def share_metrics_across_processes(directory: str) -> None:
    """From now on this process's metric values live in files under ``directory``, where every
    process sharing it reads them all (``ServerMetrics(multiprocess_dir=directory)``). Call it
    before any metric is made: prometheus_client's multiprocess mode, chosen explicitly (the
    environment variable alone would have to be set before prometheus_client is imported)."""
    os.environ[MULTIPROCESS_DIR_VAR] = directory
    values.ValueClass = values.MultiProcessValue()


class WeightedHistogram:
    """A labelled histogram (one model_name) that can observe one value many times at once:
    ``observe(value, times)`` costs one bucket search, not ``times``. A prometheus_client
    Histogram underneath, so that multiprocess mode covers it too; its bucket and sum values are
    advanced directly (its own ``observe`` counts one observation at a time)."""

    def __init__(self, name: str, doc: str, model_name: str, buckets, registry: CollectorRegistry):
        self._child = Histogram(name, doc, ["model_name"], buckets=buckets, registry=registry).labels(model_name)
        self.bounds = tuple(self._child._upper_bounds)  # the given bounds, then +Inf

    def observe(self, value: float, times: int = 1) -> None:
        if times <= 0:
            return
        self._child._buckets[bisect.bisect_left(self.bounds, value)].inc(times)  # the first bound >= value
        self._child._sum.inc(value * times)


_COUNTERS = ("prompt_tokens", "generation_tokens", "preemptions", "prefix_queries", "prefix_hits")
_SPEC_COUNTERS = ("spec_drafts", "spec_draft_tokens", "spec_accepted_tokens")


def _counts(snapshot: EngineSnapshot, names=_COUNTERS) -> tuple[int, ...]:
    return tuple(getattr(snapshot, name) for name in names)


def _per_position(snapshot: EngineSnapshot, positions: int) -> tuple[int, ...]:
    counts = snapshot.spec_accepted_per_position[:positions]
    return (*counts, *(0,) * (positions - len(counts)))


class _EngineSeries:
    """One engine's gauges and counters (the samples of one ``engine`` label), and the snapshot
    it sent last: what the next snapshot's counts are told from."""

    def __init__(self, start: EngineSnapshot):
        self.snapshot = start
        self.gauges: tuple = ()  # running, waiting, KV-cache usage
        self.counters: tuple = ()
        self.spec_counters: tuple = ()
        self.accepted_by_position: tuple = ()


class ServerMetrics:
    def __init__(self, model_name: str, start: EngineSnapshot | Sequence[EngineSnapshot], log_stats_interval: float = 10.0,
                 num_speculative_tokens: int = 0, engine_info=None, *, records_engines: bool = True,
                 multiprocess_dir: str | None = None):
        """``start``: the engine's snapshot when the server starts (what it counted loading and
        warming up is not the server's), or one per data-parallel replica. ``num_speculative_tokens``:
        the engine's draft length, 0 when it does not speculate (no speculation counters then, as in
        vLLM). ``engine_info`` (an EngineInfo): the model length the token histograms reach, and the
        cache settings of cache_config_info. With several API servers: ``records_engines``, whether
        this one counts the engines' snapshots and logs the stats lines; ``multiprocess_dir``, the
        directory they all share (``share_metrics_across_processes``), which ``render`` reads."""
        starts = [start] if isinstance(start, EngineSnapshot) else list(start)
        self.model_name = model_name
        self.records_engines = records_engines
        self.multiprocess_dir = multiprocess_dir
        self.log_stats_interval = log_stats_interval
        self.registry = CollectorRegistry()
        self.engines = [_EngineSeries(s) for s in starts]
        reg, labels, engine_labels = self.registry, ["model_name"], ["model_name", "engine"]

        def engine_gauge(name: str, doc: str) -> list[Gauge]:
            # set from each snapshot; across API servers, the latest value set is the value
            family = Gauge(PREFIX + name, doc, engine_labels, registry=reg, multiprocess_mode="mostrecent")
            return [family.labels(model_name, str(i)) for i in range(len(self.engines))]

        def engine_counter(name: str, doc: str) -> list[Counter]:
            family = Counter(PREFIX + name, doc, engine_labels, registry=reg)
            return [family.labels(model_name, str(i)) for i in range(len(self.engines))]

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=reg).labels(model_name)

        gauges = list(zip(
            engine_gauge("num_requests_running", "Number of requests (sequences) in the running batch."),
            engine_gauge("num_requests_waiting", "Number of requests (sequences) waiting to be scheduled."),
            engine_gauge("kv_cache_usage_perc", "KV-cache usage: 1 means all blocks are held."),
        ))
        for series, series_gauges in zip(self.engines, gauges):
            series.gauges = series_gauges
            if records_engines:
                _set_gauges(series)
        by_engine = list(zip(
            engine_counter("prompt_tokens_total", "Number of prefill tokens processed."),
            engine_counter("generation_tokens_total", "Number of generation tokens processed."),
            engine_counter("num_preemptions_total", "Cumulative number of preemptions."),
            engine_counter("prefix_cache_queries_total", "Prefix-cache queries, in prompt tokens."),
            engine_counter("prefix_cache_hits_total", "Prefix-cache hits, in prompt tokens."),
        ))
        for series, counters in zip(self.engines, by_engine):
            series.counters = counters
        self._positions = num_speculative_tokens
        if num_speculative_tokens:
            spec = list(zip(
                engine_counter("spec_decode_num_drafts_total", "Sequence-steps that verified draft tokens."),
                engine_counter("spec_decode_num_draft_tokens_total", "Draft tokens proposed."),
                engine_counter("spec_decode_num_accepted_tokens_total", "Draft tokens accepted."),
            ))
            by_position = Counter(PREFIX + "spec_decode_num_accepted_tokens_per_pos_total",
                                  "Accepted draft tokens by their position in the draft.",
                                  ["model_name", "engine", "position"], registry=reg)
            for i, series in enumerate(self.engines):
                series.spec_counters = spec[i]
                series.accepted_by_position = tuple(by_position.labels(model_name, str(i), str(k))
                                                    for k in range(num_speculative_tokens))
        self._success = Counter(PREFIX + "request_success_total", "Count of finished requests by finish reason.",
                                ["model_name", "finished_reason"], registry=reg)
        self.ttft = histogram("time_to_first_token_seconds", "Time from arrival to the first token sent.",
                              _LATENCY_BUCKETS)

        def weighted(name: str, doc: str, buckets) -> WeightedHistogram:
            return WeightedHistogram(PREFIX + name, doc, model_name, buckets, reg)

        self.tpot = weighted("time_per_output_token_seconds",
                             "Time per output token after the first (older name of inter_token_latency_seconds).",
                             _LATENCY_BUCKETS)
        self.itl = weighted("inter_token_latency_seconds", "Time between a request's consecutive tokens.",
                            _LATENCY_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Time from arrival to finish.", _REQUEST_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds", "Time from entering the engine to first scheduled.",
                                    _REQUEST_BUCKETS)
        self.inference_time = histogram("request_inference_time_seconds",
                                        "Time from first scheduled to finish (prefill and decode).", _REQUEST_BUCKETS)
        self.prefill_time = histogram("request_prefill_time_seconds", "Time from first scheduled to the first token.",
                                      _REQUEST_BUCKETS)
        self.decode_time = histogram("request_decode_time_seconds", "Time from the first token to finish.",
                                     _REQUEST_BUCKETS)
        max_len = getattr(engine_info, "max_model_len", None) or 1 << 20
        token_buckets = one_two_five_buckets(max_len)
        self.prompt_tokens = histogram("request_prompt_tokens", "Number of prefill tokens of finished requests.",
                                       token_buckets)
        self.generation_tokens = histogram("request_generation_tokens",
                                           "Number of generation tokens of finished requests (all n completions).",
                                           token_buckets)
        self.params_n = histogram("request_params_n", "The n parameter of finished requests.", _N_BUCKETS)
        self.params_max_tokens = histogram("request_params_max_tokens", "The max_tokens parameter of finished requests.",
                                           token_buckets)
        self.iteration_tokens = weighted("iteration_tokens_total", "Number of tokens (prompt and generated) per "
                                         "engine step.", _ITERATION_BUCKETS)
        if engine_info is not None:
            # vLLM's: a gauge of 1 whose labels are the KV cache's settings
            cache = {"block_size": str(engine_info.block_size), "num_gpu_blocks": str(engine_info.num_blocks),
                     "max_model_len": str(engine_info.max_model_len), "model_name": model_name}
            Gauge(PREFIX + "cache_config_info", "Information of the KV cache's configuration.", list(cache),
                  registry=reg, multiprocess_mode="max").labels(**cache).set(1.0)
        many = len(self.engines) > 1
        self._logs = [StatsLog(log_stats_interval, s.snapshot, num_speculative_tokens,
                               f"Engine {i:03d}: " if many else "")
                      for i, s in enumerate(self.engines)] if records_engines else []

    @property
    def snapshot(self) -> EngineSnapshot:
        """The first engine's latest snapshot (the only one's, without data parallelism)."""
        return self.engines[0].snapshot

    def on_snapshot(self, snapshot: EngineSnapshot, engine: int = 0) -> None:
        """Engine ``engine``'s state after a step: gauges now, counters advanced by what it
        counted since its previous snapshot."""
        if not self.records_engines:
            return
        series = self.engines[engine]
        seen = series.snapshot
        pairs = [*zip(series.counters, _counts(snapshot), _counts(seen)),
                 *zip(series.spec_counters, _counts(snapshot, _SPEC_COUNTERS), _counts(seen, _SPEC_COUNTERS)),
                 *zip(series.accepted_by_position, _per_position(snapshot, self._positions),
                      _per_position(seen, self._positions))]
        for counter, now, before in pairs:
            if now > before:
                counter.inc(now - before)
        steps = snapshot.steps - seen.steps
        if steps > 0:  # one snapshot per step; should several come as one, their mean
            tokens = (snapshot.prompt_tokens - seen.prompt_tokens
                      + snapshot.generation_tokens - seen.generation_tokens)
            self.iteration_tokens.observe(tokens / steps, steps)
        series.snapshot = snapshot
        _set_gauges(series)
        self._logs[engine].after_step(snapshot)

    def seconds_to_next_log(self) -> float:
        return min((log.seconds_to_next() for log in self._logs), default=self.log_stats_interval)

    def log_if_due(self) -> None:
        for log, series in zip(self._logs, self.engines):
            log.emit_if_due(series.snapshot)

    # ---- finished requests ---------------------------------------------------------------------

    def observe_finished(self, output, arrival: float, first_token: float | None, finished: float,
                         params=None) -> None:
        """One finished request (a RequestOutput with all its completions), by the server's
        time.perf_counter() timestamps; ``params``: its SamplingParams."""
        for c in output.outputs:
            self._success.labels(self.model_name, c.finish_reason or "abort").inc()
        self.e2e.observe(max(finished - arrival, 0.0))
        if first_token is not None:
            self.ttft.observe(max(first_token - arrival, 0.0))
            tokens = max((len(c.token_ids) for c in output.outputs), default=0)
            if tokens > 1:
                gap = max(finished - first_token, 0.0) / (tokens - 1)
                self.tpot.observe(gap, tokens - 1)
                self.itl.observe(gap, tokens - 1)
        self.prompt_tokens.observe(len(output.prompt_token_ids))
        self.generation_tokens.observe(sum(len(c.token_ids) for c in output.outputs))
        if params is not None:
            self.params_n.observe(params.n)
            self.params_max_tokens.observe(params.max_tokens)
        m = output.metrics
        if m is not None and m.first_scheduled_time is not None:
            self.queue_time.observe(max(m.first_scheduled_time - m.arrival_time, 0.0))
            if m.finished_time is not None:
                self.inference_time.observe(max(m.finished_time - m.first_scheduled_time, 0.0))
            if m.first_token_time is not None:
                self.prefill_time.observe(max(m.first_token_time - m.first_scheduled_time, 0.0))
                if m.finished_time is not None:
                    self.decode_time.observe(max(m.finished_time - m.first_token_time, 0.0))

    def observe_aborted(self, completions: int) -> None:
        """A request aborted before its final output was read (its client went away)."""
        self._success.labels(self.model_name, "abort").inc(completions)

    def render(self) -> bytes:
        """The text /metrics sends: this server's, or every API server's that shares the
        multiprocess directory."""
        if self.multiprocess_dir is None:
            return generate_latest(self.registry)
        everyone = CollectorRegistry()
        MultiProcessCollector(everyone, path=self.multiprocess_dir)
        return generate_latest(everyone)


def _set_gauges(series: _EngineSeries) -> None:
    running, waiting, usage = series.gauges
    running.set(series.snapshot.running)
    waiting.set(series.snapshot.waiting)
    usage.set(series.snapshot.kv_cache_usage)


class StatsLog:
    """vLLM's periodic line: average prompt and generation throughput over the interval,
    running and waiting requests, KV-cache usage and the interval's prefix-cache hit rate.
    Logged only for intervals in which the engine did something; with speculative decoding, a
    second line for intervals that verified drafts: mean acceptance length, tokens drafted and
    accepted, and the acceptance rate by position."""

    def __init__(self, interval: float, start: EngineSnapshot, num_speculative_tokens: int = 0, prefix: str = ""):
        self.interval = interval
        self.prefix = prefix  # "Engine 001: " (vLLM's) when there are several
        self._positions = num_speculative_tokens
        self._last_time = time.monotonic()
        self._last = start

    def after_step(self, now: EngineSnapshot) -> None:
        if time.monotonic() - self._last_time >= self.interval:
            self._emit(now)

    def seconds_to_next(self) -> float:
        return max(self.interval - (time.monotonic() - self._last_time), 0.01)

    def emit_if_due(self, now: EngineSnapshot) -> None:
        if time.monotonic() - self._last_time >= self.interval:
            self._emit(now)

    def _emit(self, now: EngineSnapshot) -> None:
        t = time.monotonic()
        elapsed = max(t - self._last_time, 1e-9)
        if _counts(now) != _counts(self._last) or now.running or now.waiting:
            d = dict(zip(_COUNTERS, (a - b for a, b in zip(_counts(now), _counts(self._last)))))
            hit_rate = d["prefix_hits"] / d["prefix_queries"] if d["prefix_queries"] else 0.0
            logger.info(
                "%sAvg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
                "Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, Prefix cache hit rate: %.1f%%",
                self.prefix, d["prompt_tokens"] / elapsed, d["generation_tokens"] / elapsed, now.running, now.waiting,
                100.0 * now.kv_cache_usage, 100.0 * hit_rate,
            )
        drafts, drafted, accepted = (a - b for a, b in zip(_counts(now, _SPEC_COUNTERS),
                                                            _counts(self._last, _SPEC_COUNTERS)))
        if drafts:
            by_position = [a - b for a, b in zip(_per_position(now, self._positions),
                                                  _per_position(self._last, self._positions))]
            logger.info(
                "%sSpecDecoding metrics: Mean acceptance length: %.2f, Accepted: %d tokens, Drafted: %d tokens, "
                "Per-position acceptance rate: %s, Avg Draft acceptance rate: %.1f%%",
                self.prefix, 1.0 + accepted / drafts, accepted, drafted, ", ".join(f"{n / drafts:.3f}" for n in by_position),
                100.0 * accepted / drafted if drafted else 0.0,
            )
        self._last_time, self._last = t, now
