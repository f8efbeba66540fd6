"""The data-parallel routing comparison: the ``prefix_repetition`` dataset (``prefix_repetition.py``)
served by ``compiled-llm serve`` with ``--data-parallel-size N`` (N > 1) under each routing.

The bench starts three servers one after another and sends each the same requests at each
request rate:

- DP=1: one engine with the replicas' KV cache together (``--num-blocks`` x N when it is given);
- DP=N under ``--load-balance-method prefix_aware`` (the server's default);
- DP=N under ``--load-balance-method round_robin``, which makes every replica compute and cache
  every prefix.

(With N = 1, the first alone.) Each run reports, besides the serving figures
(``serving_report.summarize``), the prefix-cache hit rate the engines counted during it: the
growth of ``compiled_llm:prefix_cache_hits_total`` over that of ``prefix_cache_queries_total`` on
the server's /metrics, each summed over the ``engine`` labels. The prefix-aware run adds its
ratios: hit rate against DP=1's and round-robin's, TTFT p50 against round-robin's.

Prefix-aware routing pays when the replicas' KV caches together hold the prefixes but one
replica's does not hold them all: give ``--num-blocks`` so that ``num_prefixes x prefix_len /
block_size`` is about N times a replica's blocks (each run's note says how many prefixes a
replica's cache has room for). Without ``--num-blocks`` each engine sizes its cache from its
GPU's memory, DP=1 on one GPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from compiled_llm.cli.bench.prefix_repetition import TOKEN_IDS, PrefixRepetition, prefix_repetition_prompts
from compiled_llm.cli.bench.server_launcher import SERVER_START_TIMEOUT_S, launched_server, option_flags, served_model
from compiled_llm.cli.bench.serving import ServingOptions, rate_label, serving_run, shifted, warm_up
from compiled_llm.cli.bench.sse_client import error_message, http_module
from compiled_llm.cli.bench.workloads import Result
from compiled_llm.errors import CompiledLLMError, InvalidOptionError

HITS, QUERIES = "compiled_llm:prefix_cache_hits_total", "compiled_llm:prefix_cache_queries_total"
CACHE_INFO = "compiled_llm:cache_config_info"


# ---- the servers compared ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class ServerSetup:
    """One server of the comparison: its replicas, their routing and each one's KV blocks."""

    data_parallel_size: int
    load_balance_method: str = "prefix_aware"
    num_blocks: int | None = None

    @property
    def label(self) -> str:
        return "DP=1" if self.data_parallel_size == 1 else f"DP={self.data_parallel_size} {self.load_balance_method}"

    def flags(self) -> list[str]:
        flags = ["--data-parallel-size", str(self.data_parallel_size)]
        if self.num_blocks is not None:
            flags += ["--num-blocks", str(self.num_blocks)]
        if self.data_parallel_size > 1:
            flags += ["--load-balance-method", self.load_balance_method]
        return flags


def routing_setups(data_parallel_size: int, num_blocks: int | None) -> list[ServerSetup]:
    """DP=1 alone, or DP=1 with the KV blocks of all N replicas, then N replicas routed
    prefix-aware, then round-robin (module docstring)."""
    if data_parallel_size == 1:
        return [ServerSetup(1, num_blocks=num_blocks)]
    return [ServerSetup(1, num_blocks=None if num_blocks is None else data_parallel_size * num_blocks),
            ServerSetup(data_parallel_size, "prefix_aware", num_blocks),
            ServerSetup(data_parallel_size, "round_robin", num_blocks)]


# ---- the server's counters ----------------------------------------------------------------------------------


def metric_samples(text: str) -> list:
    """The samples of a Prometheus exposition (prometheus_client's parser)."""
    from prometheus_client.parser import text_string_to_metric_families

    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def prefix_cache_counts(samples: Sequence) -> tuple[float, float]:
    """(hits, queries) in prompt tokens, summed over the replicas' ``engine`` labels."""
    hits = sum(s.value for s in samples if s.name == HITS)
    queries = sum(s.value for s in samples if s.name == QUERIES)
    return hits, queries


def cache_config(samples: Sequence) -> tuple[int, int] | None:
    """(block_size, num_gpu_blocks) of cache_config_info (a replica's), or None."""
    info = next((s.labels for s in samples if s.name == CACHE_INFO), None)
    return None if info is None else (int(info["block_size"]), int(info["num_gpu_blocks"]))


def scrape(base_url: str) -> list:
    http = http_module()

    response = http.get(base_url + "/metrics", timeout=30.0, trust_env=False)
    if response.status_code != 200:
        raise CompiledLLMError(f"GET /metrics failed: {error_message(response.status_code, response.content)}")
    return metric_samples(response.text)


def hit_rate(before: tuple[float, float], after: tuple[float, float]) -> float:
    """The share of the prompt tokens queried between two scrapes that the cache held."""
    queries = after[1] - before[1]
    return (after[0] - before[0]) / queries if queries > 0 else 0.0


# ---- the run ------------------------------------------------------------------------------------------------


def engine_facts(engine: str) -> tuple[int, str]:
    """(vocabulary size, dtype) of a built engine, from its manifest."""
    from compiled_llm.engine.artifact import build_config as built_with, read_manifest

    manifest = read_manifest(engine)
    return int(manifest["model_config"]["vocab_size"]), built_with(manifest).dtype


def add_ratios(results: Sequence[Result]) -> None:
    """Into each prefix-aware run's metrics, its ratios against DP=1's and round-robin's runs at
    the same rate: hit rate over theirs, TTFT p50 over round-robin's."""
    by_key = {(r.extra["setup"], r.extra["request_rate"]): r for r in results if "setup" in r.extra}
    for (setup, rate), aware in by_key.items():
        if not setup.endswith(" prefix_aware"):
            continue
        one = by_key.get(("DP=1", rate))
        rr = by_key.get((setup.replace("prefix_aware", "round_robin"), rate))
        m = aware.metrics
        if one is not None and one.metrics["prefix_cache_hit_rate"] > 0:
            m["hit_rate_vs_dp1"] = m["prefix_cache_hit_rate"] / one.metrics["prefix_cache_hit_rate"]
        if rr is not None:
            if rr.metrics["prefix_cache_hit_rate"] > 0:
                m["hit_rate_vs_round_robin"] = m["prefix_cache_hit_rate"] / rr.metrics["prefix_cache_hit_rate"]
            if rr.metrics.get("ttft_ms_p50") and "ttft_ms_p50" in m:
                m["ttft_p50_vs_round_robin"] = m["ttft_ms_p50"] / rr.metrics["ttft_ms_p50"]


def run_routing_comparison(engine: str, device, engine_options: dict, options: ServingOptions,
                           start_timeout_s: float = SERVER_START_TIMEOUT_S) -> list[Result]:
    """Each server of ``routing_setups`` in turn, each under the dataset at every request rate
    (``options.prefix_repetition`` set); one Result per server and rate, the prefix-aware ones
    with their ratios (``add_ratios``)."""
    shape: PrefixRepetition = options.prefix_repetition
    users = shape.users(options.num_requests)
    max_model_len = engine_options.get("max_model_len")
    if max_model_len is not None and shape.prompt_len + shape.output_len > max_model_len:
        raise InvalidOptionError(
            f"prefix_repetition's requests need {shape.prompt_len + shape.output_len} tokens (prefix "
            f"{shape.prefix_len} + suffix {shape.suffix_len} + output {shape.output_len}), more than max_model_len "
            f"{max_model_len}")
    vocab_size, dtype = engine_facts(engine)
    vocab = min(vocab_size, TOKEN_IDS)
    prompts = prefix_repetition_prompts(options.num_requests, shape, vocab_size, options.seed)
    max_tokens = [shape.output_len] * len(prompts)
    rates = options.request_rates
    dp = engine_options.get("data_parallel_size") or 1
    common = {k: v for k, v in engine_options.items() if k not in ("data_parallel_size", "num_blocks")}
    waiting = ["--max-waiting-requests", str(options.num_requests),  # rate inf: all may wait at once
               "--max-waiting-prompt-tokens", str(sum(len(p) for p in prompts))]
    if options.served_model_name:
        waiting += ["--served-model-name", options.served_model_name]
    if options.api_server_count is not None:  # each API server routes its own requests
        waiting += ["--api-server-count", str(options.api_server_count)]
    results = []
    for setup in routing_setups(dp, engine_options.get("num_blocks")):
        args = [*option_flags({"device": device.type, **common}), *setup.flags(), *waiting]
        with launched_server(engine, args, start_timeout_s) as server:
            model = options.served_model_name or served_model(server.base_url)
            # prompts of the same shape that share no prefix with the timed runs'
            warm_up(server.base_url, model, shifted(prompts, len(rates), vocab), shape.output_len)
            for k, rate in enumerate(rates):
                before = scrape(server.base_url)
                metrics, extra = serving_run(server.base_url, model, shifted(prompts, k, vocab), max_tokens, rate,
                                             options)
                after = scrape(server.base_url)
                counts = prefix_cache_counts(before), prefix_cache_counts(after)
                metrics = {"prefix_cache_hit_rate": hit_rate(*counts), **metrics}
                config = cache_config(after)
                held = ""
                if config is not None:
                    block_size, blocks = config
                    prefix_blocks = -(-shape.prefix_len // block_size)
                    held = (f"; {blocks} KV blocks of {block_size} tokens a replica, room for "
                            f"{blocks / prefix_blocks:.1f} of the {shape.num_prefixes} prefixes")
                label = rate_label(rate)
                results.append(Result(
                    "serving", f"compiled-llm serve {setup.label}, rate {label}", metrics,
                    note=f"{options.num_requests} requests: {shape.num_prefixes} prefixes of {shape.prefix_len} "
                         f"tokens x {users} users, suffix {shape.suffix_len}, output {shape.output_len}{held}",
                    extra={**extra, "dtype": dtype, "setup": setup.label, "column": f"{setup.label} rate={label}",
                           "data_parallel_size": setup.data_parallel_size,
                           "load_balance_method": setup.load_balance_method if setup.data_parallel_size > 1 else None,
                           "num_blocks": config[1] if config else None,
                           "prefix_cache_hits": counts[1][0] - counts[0][0],
                           "prefix_cache_queries": counts[1][1] - counts[0][1]}))
    add_ratios(results)
    return results
