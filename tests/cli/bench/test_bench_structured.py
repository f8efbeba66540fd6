"""The structured workload runs end to end (on a CPU, at small sizes) and reports what its
gates read: each ratio against the same engine unconstrained, each schema's compile time, and
the time to first token of a new and a cached schema."""

from __future__ import annotations

from compiled_llm import LLM
from compiled_llm.cli.bench.structured import SCHEMAS, format_table, run_structured


def test_structured_workload_reports_ratios_compile_times_and_first_tokens(structured_engine):
    llm = LLM(str(structured_engine), max_num_seqs=8, max_num_batched_tokens=256)
    (result,) = run_structured(llm, num_requests=8, max_len=100, new_tokens=16)
    m = result.metrics
    assert m["latency_ratio"] == m["decode_tok_s_json_schema"] / m["decode_tok_s_plain"] > 0
    # against the same engine unconstrained at the lengths the schemas' outputs had
    assert m["throughput_ratio"] == m["output_tok_s_8_schemas"] / m["output_tok_s_plain_same_lengths"] > 0
    assert m["throughput_ratio_to_full_lengths"] == m["output_tok_s_8_schemas"] / m["output_tok_s_plain"] > 0
    assert all(m[f"compile_ms_schema_{i}"] > 0 for i in range(len(SCHEMAS)))
    assert m["new_schema_compile_ms"] > 0 and m["ttft_ms_cached_schema"] > 0
    assert "throughput_ratio" in format_table([result])
    assert llm.engine.live_grammar_matchers == 0
