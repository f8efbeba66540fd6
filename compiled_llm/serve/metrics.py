"""The server's Prometheus metrics, with vLLM's names (``compiled_llm:`` for ``vllm:``) and
meanings, and the periodic one-line stats log.

Every collector lives in the server's own ``CollectorRegistry``, so one process (a test) can run
several servers. Three kinds of updates, each where it is cheap:

- the engine gauges (running, waiting, KV-cache usage) are read when /metrics is scraped: a
  length or two, always current, even after an abort between steps;
- the engine counters (prompt and generation tokens, preemptions, prefix-cache queries and hits)
  advance by the deltas of the engine's own counters, from the stepping thread after each step;
- the histograms and the finished-request counter take one observation per finished request,
  from the server's timestamps (HTTP arrival, first token handed to the client, finish).
"""

from __future__ import annotations

import dataclasses
import logging
import time

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

logger = logging.getLogger("compiled_llm.serve.metrics")

PREFIX = "compiled_llm:"
CONTENT_TYPE = CONTENT_TYPE_LATEST

# Seconds. A GPU decode step takes milliseconds, a CPU one tens of them, and a queue under load
# minutes: the buckets span all three.
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0,
                    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_REQUEST_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                    60.0, 120.0, 240.0, 480.0, 960.0)


@dataclasses.dataclass
class _EngineCounts:
    """The engine's cumulative counters, as last seen."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    preemptions: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0

    @classmethod
    def of(cls, engine) -> "_EngineCounts":
        st, pc = engine.stats, engine.block_manager.stats
        return cls(st.prefill_tokens, st.generated_tokens, engine.scheduler.num_preemptions,
                   pc.queried_tokens, pc.hit_tokens)

    def minus(self, other: "_EngineCounts") -> "_EngineCounts":
        return _EngineCounts(*(a - b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other))))


def kv_cache_usage(engine) -> float:
    """Fraction of the KV-cache blocks held by requests (cached prefixes nobody holds are free)."""
    bm = engine.block_manager
    return 1.0 - bm.num_free_blocks / bm.num_blocks


class ServerMetrics:
    def __init__(self, engine, model_name: str, log_stats_interval: float = 10.0):
        self.engine = engine
        self.model_name = model_name
        self.registry = CollectorRegistry()
        reg, labels = self.registry, ["model_name"]

        def gauge(name: str, doc: str, read) -> None:
            Gauge(PREFIX + name, doc, labels, registry=reg).labels(model_name).set_function(read)

        def counter(name: str, doc: str) -> Counter:
            return Counter(PREFIX + name, doc, labels, registry=reg).labels(model_name)

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=reg).labels(model_name)

        sched = engine.scheduler
        gauge("num_requests_running", "Number of requests (sequences) in the running batch.", lambda: len(sched.running))
        gauge("num_requests_waiting", "Number of requests (sequences) waiting to be scheduled.", lambda: len(sched.waiting))
        gauge("kv_cache_usage_perc", "KV-cache usage: 1 means all blocks are held.", lambda: kv_cache_usage(engine))
        self.prompt_tokens = counter("prompt_tokens_total", "Number of prefill tokens processed.")
        self.generation_tokens = counter("generation_tokens_total", "Number of generation tokens processed.")
        self.preemptions = counter("num_preemptions_total", "Cumulative number of preemptions.")
        self.prefix_queries = counter("prefix_cache_queries_total", "Prefix-cache queries, in prompt tokens.")
        self.prefix_hits = counter("prefix_cache_hits_total", "Prefix-cache hits, in prompt tokens.")
        self._success = Counter(PREFIX + "request_success_total", "Count of finished requests by finish reason.",
                                ["model_name", "finished_reason"], registry=reg)
        self.ttft = histogram("time_to_first_token_seconds", "Time from arrival to the first token sent.",
                              _LATENCY_BUCKETS)
        self.tpot = histogram("time_per_output_token_seconds", "Time per output token after the first.",
                              _LATENCY_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Time from arrival to finish.", _REQUEST_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds", "Time from entering the engine to first scheduled.",
                                    _REQUEST_BUCKETS)
        self._seen = _EngineCounts.of(engine)
        self._log = StatsLog(engine, log_stats_interval)

    # ---- the stepping thread -------------------------------------------------------------------

    def on_step(self) -> None:
        """Advance the counters by what the engine counted since the previous call."""
        now = _EngineCounts.of(self.engine)
        d = now.minus(self._seen)
        self._seen = now
        for counter, value in ((self.prompt_tokens, d.prompt_tokens), (self.generation_tokens, d.generation_tokens),
                               (self.preemptions, d.preemptions), (self.prefix_queries, d.prefix_queries),
                               (self.prefix_hits, d.prefix_hits)):
            if value:
                counter.inc(value)
        self._log.after_step(now)

    def seconds_to_next_log(self) -> float | None:
        """How long an idle stepping thread may sleep before the last busy interval's log line
        is due; None when nothing is left to log."""
        return self._log.seconds_to_next(_EngineCounts.of(self.engine))

    def log_if_due(self) -> None:
        self._log.emit_if_due()

    # ---- the event loop ------------------------------------------------------------------------

    def observe_finished(self, output, arrival: float, first_token: float | None, finished: float) -> None:
        """One finished request (a RequestOutput with all its completions), by the server's
        time.perf_counter() timestamps."""
        for c in output.outputs:
            self._success.labels(self.model_name, c.finish_reason or "abort").inc()
        self.e2e.observe(max(finished - arrival, 0.0))
        if first_token is not None:
            self.ttft.observe(max(first_token - arrival, 0.0))
            tokens = max((len(c.token_ids) for c in output.outputs), default=0)
            if tokens > 1:
                self.tpot.observe(max(finished - first_token, 0.0) / (tokens - 1))
        m = output.metrics
        if m is not None and m.first_scheduled_time is not None:
            self.queue_time.observe(max(m.first_scheduled_time - m.arrival_time, 0.0))

    def observe_aborted(self, completions: int) -> None:
        """A request aborted before its final output was read (its client went away)."""
        self._success.labels(self.model_name, "abort").inc(completions)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class StatsLog:
    """vLLM's periodic line: average prompt and generation throughput over the interval,
    running and waiting requests, KV-cache usage and the interval's prefix-cache hit rate.
    Logged only for intervals in which the engine did something."""

    def __init__(self, engine, interval: float):
        self.engine = engine
        self.interval = interval
        self._last_time = time.monotonic()
        self._last = _EngineCounts.of(engine)

    def _active(self, now: _EngineCounts) -> bool:
        s = self.engine.scheduler
        return now != self._last or bool(s.running or s.waiting)

    def after_step(self, now: _EngineCounts) -> None:
        if time.monotonic() - self._last_time >= self.interval:
            self._emit(now)

    def seconds_to_next(self, now: _EngineCounts) -> float | None:
        if not self._active(now):
            return None
        return max(self.interval - (time.monotonic() - self._last_time), 0.0)

    def _emit(self, now: _EngineCounts) -> None:
        t = time.monotonic()
        elapsed = max(t - self._last_time, 1e-9)
        if self._active(now):
            d = now.minus(self._last)
            s = self.engine.scheduler
            hit_rate = d.prefix_hits / d.prefix_queries if d.prefix_queries else 0.0
            logger.info(
                "Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
                "Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, Prefix cache hit rate: %.1f%%",
                d.prompt_tokens / elapsed, d.generation_tokens / elapsed, len(s.running), len(s.waiting),
                100.0 * kv_cache_usage(self.engine), 100.0 * hit_rate,
            )
        self._last_time, self._last = t, now

    def emit_if_due(self) -> None:
        """From an idle stepping thread whose sleep ran out."""
        now = _EngineCounts.of(self.engine)
        if time.monotonic() - self._last_time >= self.interval:
            self._emit(now)
