"""The serving workload's figures and table: vLLM's serving-benchmark statistics (TTFT, TPOT,
ITL, e2e: mean, p50, p99) over a run's request records, and one column per request rate with
the offline reference below; under the prefix_repetition dataset one column per server and rate,
with the prefix-cache hit rates and a line per rate comparing the routings."""

from __future__ import annotations

import math
from collections.abc import Sequence

from compiled_llm.cli.bench.sse_client import RequestRecord
from compiled_llm.cli.bench.workloads import Result


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between the closest ranks (numpy's
    default), of a non-empty sequence."""
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def summarize(records: Sequence[RequestRecord], duration_s: float) -> dict[str, float]:
    """vLLM's serving-benchmark figures over the completed requests; latencies in ms."""
    ok = [r for r in records if r.ok]
    output = sum(r.output_tokens for r in ok)
    prompt = sum(r.prompt_tokens for r in ok)
    metrics = {
        "completed": float(len(ok)), "failed": float(len(records) - len(ok)),
        "output_tokens": float(output), "duration_s": duration_s,
        "request_s": len(ok) / duration_s, "output_tok_s": output / duration_s,
        "total_tok_s": (prompt + output) / duration_s,
    }
    series = {
        "ttft_ms": [1e3 * r.ttft for r in ok],
        "tpot_ms": [1e3 * (r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1],
        "itl_ms": [1e3 * gap for r in ok for gap in r.itl],
        "e2e_ms": [1e3 * r.e2e for r in ok],
    }
    for name, values in series.items():
        if values:
            metrics[f"{name}_mean"] = sum(values) / len(values)
            metrics[f"{name}_p50"] = percentile(values, 50)
            metrics[f"{name}_p99"] = percentile(values, 99)
    return metrics


COUNTS = {"completed", "failed", "output_tokens"}
RATIOS = {"vs_offline", "hit_rate_vs_dp1", "hit_rate_vs_round_robin", "ttft_p50_vs_round_robin"}
# what issue 45 asks of prefix-aware routing: (ratio, its bound, whether the ratio must be at least it)
ROUTING_TARGETS = (("hit_rate_vs_dp1", 0.9, True), ("hit_rate_vs_round_robin", 1.5, True),
                   ("ttft_p50_vs_round_robin", 1.0, False))


def _cell(metric: str, value: float | None) -> str:
    if value is None:
        return "-"
    if metric in COUNTS:
        return f"{value:,.0f}"
    if metric in RATIOS:
        return f"{value:.2f}x"
    if metric == "prefix_cache_hit_rate":
        return f"{value:.3f}"
    return f"{value:,.1f}" if abs(value) >= 10 else f"{value:,.2f}"


def column(result: Result) -> str:
    """A run's column heading: its rate, or its server and rate (the routing comparison)."""
    return result.extra.get("column") or f"rate={result.extra['request_rate']}"


def routing_line(result: Result) -> str | None:
    """A prefix-aware run's ratios against DP=1 and round-robin, each against its target."""
    parts = []
    for metric, bound, at_least in ROUTING_TARGETS:
        value = result.metrics.get(metric)
        if value is not None:
            met = value >= bound if at_least else value < bound
            parts.append(f"{metric} {value:.2f}x ({'>=' if at_least else '<'} {bound:g} "
                         f"{'met' if met else 'NOT met'})")
    return f"{column(result)}: " + ", ".join(parts) if parts else None


def format_table(results: Sequence[Result]) -> str:
    """One column per request rate (per server and rate in the routing comparison), one row per
    figure; the offline reference, the runs' notes and the routing ratios below it."""
    runs = [r for r in results if r.workload == "serving" and r.system.startswith("compiled-llm serve")]
    offline = next((r for r in results if r.workload == "serving" and r.system.startswith("offline")), None)
    metrics: list[str] = []
    for r in runs:
        metrics += [m for m in r.metrics if m not in metrics]
    header = ("serving", *(column(r) for r in runs))
    rows = [header] + [(m, *(_cell(m, r.metrics.get(m)) for r in runs)) for m in metrics]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = []
    for i, row in enumerate(rows):
        lines.append("  ".join(c.ljust(widths[j]) if j == 0 else c.rjust(widths[j]) for j, c in enumerate(row)))
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    if offline is not None:
        lines.append(f"offline LLM.generate, same requests: output_tok_s {offline.metrics['output_tok_s']:,.1f}, "
                     f"wall_s {offline.metrics['wall_s']:,.2f} ({offline.note})")
    lines += [f"{column(r)}: {r.note}" for r in runs]
    lines += [line for line in map(routing_line, runs) if line]
    return "\n".join(lines)
