"""`bench --workload serving --dataset-name prefix_repetition`: the dataset's shape, the servers it
compares (DP=1 with the replicas' KV cache together, prefix-aware, round-robin), the prefix-cache
hit rate read from a server's /metrics, the ratios and the table; then one real run on a CPU
(one engine, a request at a time) whose hit rate is what the dataset implies."""

from __future__ import annotations

import collections
import json

import pytest
from prometheus_client import generate_latest

from compiled_llm.cli.bench import prefix_repetition as pr
from compiled_llm.cli.bench import routing_comparison as rc
from compiled_llm.cli.bench import serving, serving_report
from compiled_llm.cli.bench.workloads import Result
from compiled_llm.errors import InvalidOptionError
from compiled_llm.serve.engine_process.engine_messages import EngineInfo, EngineSnapshot
from compiled_llm.serve.metrics import ServerMetrics

IDLE = EngineSnapshot(0, 0, 0.0, 0, 0, 0, 0, 0)


def test_each_prefix_is_shared_by_its_users_each_with_a_suffix_of_its_own_in_seeded_random_order():
    shape = pr.PrefixRepetition(prefix_len=20, suffix_len=5, num_prefixes=4, output_len=3)
    prompts = pr.prefix_repetition_prompts(12, shape, vocab_size=50, seed=1)
    assert len(prompts) == 12 and all(len(p) == 25 for p in prompts)
    assert all(0 <= t < 50 for p in prompts for t in p)
    by_prefix = collections.Counter(tuple(p[:20]) for p in prompts)
    assert sorted(by_prefix.values()) == [3, 3, 3, 3]
    assert len({tuple(p[20:]) for p in prompts}) == 12
    assert prompts == pr.prefix_repetition_prompts(12, shape, vocab_size=50, seed=1)
    assert prompts != pr.prefix_repetition_prompts(12, shape, vocab_size=50, seed=2)
    # shuffled: the users of a prefix do not come one after another
    firsts = [tuple(p[:20]) for p in prompts]
    assert firsts != sorted(firsts, key=firsts.index)


def test_the_dataset_refuses_a_partial_prefix_group_and_empty_lengths_in_one_line():
    with pytest.raises(InvalidOptionError) as e:
        pr.prefix_repetition_prompts(100, pr.PrefixRepetition(), vocab_size=1000)
    assert str(e.value) == ("num_requests 100 must be a multiple of prefix_repetition_num_prefixes 32 (each prefix "
                            "is shared by num_requests / num_prefixes requests)")
    with pytest.raises(InvalidOptionError, match="prefix_repetition_suffix_len must be an integer >= 1, got 0"):
        pr.PrefixRepetition(suffix_len=0)
    with pytest.raises(InvalidOptionError, match="multiple of"):
        serving.ServingOptions(num_requests=40, prefix_repetition=pr.PrefixRepetition())


def test_dp_one_gets_the_kv_blocks_of_all_replicas_and_each_dp_server_its_routing():
    one, aware, rr = rc.routing_setups(2, 300)
    assert [s.label for s in (one, aware, rr)] == ["DP=1", "DP=2 prefix_aware", "DP=2 round_robin"]
    assert one.flags() == ["--data-parallel-size", "1", "--num-blocks", "600"]
    assert rr.flags() == ["--data-parallel-size", "2", "--num-blocks", "300", "--load-balance-method", "round_robin"]
    assert aware.flags() == ["--data-parallel-size", "2", "--num-blocks", "300", "--load-balance-method", "prefix_aware"]
    assert [s.num_blocks for s in rc.routing_setups(2, None)] == [None, None, None]  # each sized from its memory
    assert rc.routing_setups(1, 300) == [rc.ServerSetup(1, num_blocks=300)]


def test_the_hit_rate_is_read_from_a_servers_metrics_summed_over_its_replicas():
    info = EngineInfo(name="m", vocab_size=10, max_model_len=64, block_size=16, num_blocks=300, max_num_seqs=4,
                      generation_defaults={}, device="cpu")
    metrics = ServerMetrics("m", [IDLE, IDLE], engine_info=info)
    metrics.on_snapshot(IDLE._replace(prefix_queries=1000, prefix_hits=600), engine=0)
    before = rc.metric_samples(generate_latest(metrics.registry).decode())
    assert rc.prefix_cache_counts(before) == (600, 1000)
    metrics.on_snapshot(IDLE._replace(prefix_queries=2000, prefix_hits=1500), engine=0)
    metrics.on_snapshot(IDLE._replace(prefix_queries=1000, prefix_hits=100), engine=1)
    after = rc.metric_samples(generate_latest(metrics.registry).decode())
    assert rc.prefix_cache_counts(after) == (1600, 3000)
    assert rc.hit_rate(rc.prefix_cache_counts(before), rc.prefix_cache_counts(after)) == pytest.approx(1000 / 2000)
    assert rc.cache_config(after) == (16, 300)
    assert rc.hit_rate((5, 10), (5, 10)) == 0.0  # no query in between


def run_result(setup: str, rate: str, hit_rate: float, ttft_p50: float) -> Result:
    return Result("serving", f"compiled-llm serve {setup}, rate {rate}",
                  {"prefix_cache_hit_rate": hit_rate, "ttft_ms_p50": ttft_p50}, note="n",
                  extra={"request_rate": rate, "setup": setup, "column": f"{setup} rate={rate}"})


def test_the_prefix_aware_run_gets_its_ratios_and_the_table_says_which_targets_are_met():
    results = [run_result("DP=1", "inf", 0.90, 30.0), run_result("DP=2 prefix_aware", "inf", 0.85, 40.0),
               run_result("DP=2 round_robin", "inf", 0.50, 80.0), run_result("DP=1", "8", 0.9, 10.0),
               run_result("DP=2 prefix_aware", "8", 0.6, 12.0), run_result("DP=2 round_robin", "8", 0.5, 11.0)]
    rc.add_ratios(results)
    aware = results[1].metrics
    assert aware["hit_rate_vs_dp1"] == pytest.approx(0.85 / 0.90)
    assert aware["hit_rate_vs_round_robin"] == pytest.approx(1.7)
    assert aware["ttft_p50_vs_round_robin"] == pytest.approx(0.5)
    assert "hit_rate_vs_dp1" not in results[0].metrics and "hit_rate_vs_dp1" not in results[2].metrics
    table = serving_report.format_table(results)
    header = table.splitlines()[0].split("  ")
    assert [c.strip() for c in header if c.strip()][1:4] == ["DP=1 rate=inf", "DP=2 prefix_aware rate=inf",
                                                            "DP=2 round_robin rate=inf"]
    assert ("DP=2 prefix_aware rate=inf: hit_rate_vs_dp1 0.94x (>= 0.9 met), hit_rate_vs_round_robin 1.70x "
            "(>= 1.5 met), ttft_p50_vs_round_robin 0.50x (< 1 met)") in table
    assert ("DP=2 prefix_aware rate=8: hit_rate_vs_dp1 0.67x (>= 0.9 NOT met), hit_rate_vs_round_robin 1.20x "
            "(>= 1.5 NOT met), ttft_p50_vs_round_robin 1.09x (< 1 NOT met)") in table


def test_prefix_repetition_flags_are_refused_with_the_random_dataset(capsys):
    from compiled_llm.cli.main import main

    code = main(["bench", "tiny-qwen2", "--workload", "serving", "--prefix-repetition-prefix-len", "64",
                 "--device", "cpu"])
    assert code == 2
    assert capsys.readouterr().err.strip() == \
        "error: --prefix-repetition-prefix-len apply to --dataset-name prefix_repetition only"


def test_bench_prefix_repetition_on_cpu_counts_each_prefix_computed_once(capsys):
    from compiled_llm.cli.main import main

    prefix, suffix, prefixes, users = 64, 8, 3, 2
    code = main(["bench", "tiny-qwen2", "--workload", "serving", "--dataset-name", "prefix_repetition",
                 "--prefix-repetition-prefix-len", str(prefix), "--prefix-repetition-suffix-len", str(suffix),
                 "--prefix-repetition-num-prefixes", str(prefixes), "--prefix-repetition-output-len", "2",
                 "--num-requests", str(prefixes * users), "--max-num-seqs", "1", "--no-hf", "--device", "cpu",
                 "--json"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    (run,) = [Result(**r) for r in json.loads(captured.out)]
    assert run.extra["setup"] == "DP=1" and run.extra["request_rate"] == "inf"
    m = run.metrics
    assert (m["completed"], m["failed"], m["output_tokens"]) == (prefixes * users, 0, prefixes * users * 2)
    # one request at a time: each prefix is computed by its first user and found by the others
    assert run.extra["prefix_cache_queries"] == prefixes * users * (prefix + suffix)
    assert run.extra["prefix_cache_hits"] == prefixes * (users - 1) * prefix
    assert m["prefix_cache_hit_rate"] == pytest.approx((users - 1) / users * prefix / (prefix + suffix))
    assert 0 < m["ttft_ms_p50"] <= m["ttft_ms_p99"]
