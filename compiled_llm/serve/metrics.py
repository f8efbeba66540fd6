"""The server's Prometheus metrics, with vLLM's names (``compiled_llm:`` for ``vllm:``) and
meanings, and the periodic one-line stats log.

Every collector lives in the server's own ``CollectorRegistry``, so one process (a test) can run
several servers. Two kinds of updates, each where it is cheap:

- the engine's gauges (running, waiting, KV-cache usage) and counters (prompt and generation
  tokens, preemptions, prefix-cache queries and hits; with speculative decoding, drafts, draft
  tokens and accepted tokens, in all and by position) come with each message of the engine core
  (an ``EngineSnapshot``): the gauges show the latest, the counters advance by the differences;
- the histograms and the finished-request counter take one observation per finished request,
  from the server's timestamps (HTTP arrival, first token handed to the client, finish).
"""

from __future__ import annotations

import logging
import time

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from compiled_llm.serve.engine_messages import EngineSnapshot

logger = logging.getLogger("compiled_llm.serve.metrics")

PREFIX = "compiled_llm:"
CONTENT_TYPE = CONTENT_TYPE_LATEST

# Seconds. A GPU decode step takes milliseconds, a CPU one tens of them, and a queue under load
# minutes: the buckets span all three.
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0,
                    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_REQUEST_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                    60.0, 120.0, 240.0, 480.0, 960.0)


_COUNTERS = ("prompt_tokens", "generation_tokens", "preemptions", "prefix_queries", "prefix_hits")
_SPEC_COUNTERS = ("spec_drafts", "spec_draft_tokens", "spec_accepted_tokens")


def _counts(snapshot: EngineSnapshot, names=_COUNTERS) -> tuple[int, ...]:
    return tuple(getattr(snapshot, name) for name in names)


def _per_position(snapshot: EngineSnapshot, positions: int) -> tuple[int, ...]:
    counts = snapshot.spec_accepted_per_position[:positions]
    return (*counts, *(0,) * (positions - len(counts)))


class ServerMetrics:
    def __init__(self, model_name: str, start: EngineSnapshot, log_stats_interval: float = 10.0,
                 num_speculative_tokens: int = 0):
        """``start``: the engine's snapshot when the server starts (what it counted loading and
        warming up is not the server's). ``num_speculative_tokens``: the engine's draft length,
        0 when it does not speculate (no speculation counters then, as in vLLM)."""
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self.snapshot = start  # the engine's latest
        reg, labels = self.registry, ["model_name"]

        def gauge(name: str, doc: str, read) -> None:
            Gauge(PREFIX + name, doc, labels, registry=reg).labels(model_name).set_function(read)

        def counter(name: str, doc: str) -> Counter:
            return Counter(PREFIX + name, doc, labels, registry=reg).labels(model_name)

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=reg).labels(model_name)

        gauge("num_requests_running", "Number of requests (sequences) in the running batch.", lambda: self.snapshot.running)
        gauge("num_requests_waiting", "Number of requests (sequences) waiting to be scheduled.",
              lambda: self.snapshot.waiting)
        gauge("kv_cache_usage_perc", "KV-cache usage: 1 means all blocks are held.", lambda: self.snapshot.kv_cache_usage)
        self._counters = (
            counter("prompt_tokens_total", "Number of prefill tokens processed."),
            counter("generation_tokens_total", "Number of generation tokens processed."),
            counter("num_preemptions_total", "Cumulative number of preemptions."),
            counter("prefix_cache_queries_total", "Prefix-cache queries, in prompt tokens."),
            counter("prefix_cache_hits_total", "Prefix-cache hits, in prompt tokens."),
        )
        self._positions = num_speculative_tokens
        self._spec_counters = self._accepted_by_position = ()
        if num_speculative_tokens:
            self._spec_counters = (
                counter("spec_decode_num_drafts_total", "Sequence-steps that verified draft tokens."),
                counter("spec_decode_num_draft_tokens_total", "Draft tokens proposed."),
                counter("spec_decode_num_accepted_tokens_total", "Draft tokens accepted."),
            )
            by_position = Counter(PREFIX + "spec_decode_num_accepted_tokens_per_pos_total",
                                  "Accepted draft tokens by their position in the draft.",
                                  ["model_name", "position"], registry=reg)
            self._accepted_by_position = tuple(by_position.labels(model_name, str(i))
                                               for i in range(num_speculative_tokens))
        self._success = Counter(PREFIX + "request_success_total", "Count of finished requests by finish reason.",
                                ["model_name", "finished_reason"], registry=reg)
        self.ttft = histogram("time_to_first_token_seconds", "Time from arrival to the first token sent.",
                              _LATENCY_BUCKETS)
        self.tpot = histogram("time_per_output_token_seconds", "Time per output token after the first.",
                              _LATENCY_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Time from arrival to finish.", _REQUEST_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds", "Time from entering the engine to first scheduled.",
                                    _REQUEST_BUCKETS)
        self._seen = start
        self._log = StatsLog(log_stats_interval, start, num_speculative_tokens)

    def on_snapshot(self, snapshot: EngineSnapshot) -> None:
        """The engine's state after a step: gauges now, counters advanced by what it counted
        since the previous snapshot."""
        pairs = [*zip(self._counters, _counts(snapshot), _counts(self._seen)),
                 *zip(self._spec_counters, _counts(snapshot, _SPEC_COUNTERS), _counts(self._seen, _SPEC_COUNTERS)),
                 *zip(self._accepted_by_position, _per_position(snapshot, self._positions),
                      _per_position(self._seen, self._positions))]
        for counter, now, before in pairs:
            if now > before:
                counter.inc(now - before)
        self._seen = self.snapshot = snapshot
        self._log.after_step(snapshot)

    def seconds_to_next_log(self) -> float:
        return self._log.seconds_to_next()

    def log_if_due(self) -> None:
        self._log.emit_if_due(self.snapshot)

    # ---- finished requests ---------------------------------------------------------------------

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
    Logged only for intervals in which the engine did something; with speculative decoding, a
    second line for intervals that verified drafts: mean acceptance length, tokens drafted and
    accepted, and the acceptance rate by position."""

    def __init__(self, interval: float, start: EngineSnapshot, num_speculative_tokens: int = 0):
        self.interval = interval
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
                "Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
                "Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, Prefix cache hit rate: %.1f%%",
                d["prompt_tokens"] / elapsed, d["generation_tokens"] / elapsed, now.running, now.waiting,
                100.0 * now.kv_cache_usage, 100.0 * hit_rate,
            )
        drafts, drafted, accepted = (a - b for a, b in zip(_counts(now, _SPEC_COUNTERS),
                                                            _counts(self._last, _SPEC_COUNTERS)))
        if drafts:
            by_position = [a - b for a, b in zip(_per_position(now, self._positions),
                                                  _per_position(self._last, self._positions))]
            logger.info(
                "SpecDecoding metrics: Mean acceptance length: %.2f, Accepted: %d tokens, Drafted: %d tokens, "
                "Per-position acceptance rate: %s, Avg Draft acceptance rate: %.1f%%",
                1.0 + accepted / drafts, accepted, drafted, ", ".join(f"{n / drafts:.3f}" for n in by_position),
                100.0 * accepted / drafted if drafted else 0.0,
            )
        self._last_time, self._last = t, now
