"""n-gram speculative decoding against plain decoding, same engine, same run.

On a model trained by ``train_synthetic_lm.py`` (its greedy continuation is the chain's most
likely path, so what the model will say is known):

- **repeating**: batch 1, each prompt is a stretch of the most likely path followed by its own
  first ``--repeat-head`` tokens again; the greedy continuation then retraces the path from
  there, so it repeats text of the prompt token for token (the pattern of code edits, quoting
  and summaries that copy their input). ``--new-tokens`` stays within the repeated stretch.
- **random**: batch 1, the latency workload's prompt (random ids): the continuation repeats
  nothing, so speculation should find no match and cost nothing.
- **throughput**: the throughput workload (256 requests, temperature 0.6).

Each is timed with speculation off and on, alternating, on one engine (speculation is switched
by giving the scheduler the speculator or not), decode tok/s = (new tokens - 1) / (finish -
first token), the median of ``--repeats``; the acceptance stats of the runs with it on.

    python benchmarks/spec_decode_bench.py TRAINED_DIR [--engine ENGINE_DIR]
        [--speculative-config '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}']
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

DEFAULT_CONFIG = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}


def most_likely_path(chain: dict, start_rank: int, length: int) -> list[int]:
    """Token ids of the chain's most likely walk from ``start_rank`` (training.json's chain)."""
    tokens, step = chain["tokens"], chain["offsets"][0]
    return [tokens[(start_rank + i * step) % len(tokens)] for i in range(length)]


def repeating_prompts(chain: dict, num: int, new_tokens: int, head: int, body: int) -> list[list[int]]:
    """Prompts path[:body] + path[:head]: the continuation retraces path[head:], which the
    prompt holds up to ``body``, so ``new_tokens`` <= body - head tokens all repeat it."""
    assert new_tokens <= body - head, "the continuation must stay within the repeated stretch"
    step = max(1, len(chain["tokens"]) // num)
    return [(lambda p: p + p[:head])(most_likely_path(chain, i * step, body)) for i in range(num)]


@contextlib.contextmanager
def speculation(llm, on: bool):
    """The engine with its speculator in the scheduler (on) or not (off)."""
    sched = llm.engine.scheduler
    saved = sched.speculator
    sched.speculator = llm.engine.speculator if on else None
    try:
        yield
    finally:
        sched.speculator = saved


def decode_rate(llm, prompts: list[list[int]], new_tokens: int) -> float:
    from compiled_llm import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True, detokenize=False)
    rates = []
    for p in prompts:
        (out,) = llm.generate({"prompt_token_ids": p}, params, use_tqdm=False)
        m = out.metrics
        rates.append((new_tokens - 1) / (m.finished_time - m.first_token_time))
    return statistics.median(rates)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trained", type=Path, help="a train_synthetic_lm.py output directory")
    ap.add_argument("--engine", help="an engine built from it (default: the trained directory as a source)")
    ap.add_argument("--speculative-config", default=json.dumps(DEFAULT_CONFIG))
    ap.add_argument("--new-tokens", type=int, default=192)
    ap.add_argument("--repeat-head", type=int, default=32)
    ap.add_argument("--repeat-body", type=int, default=224)
    ap.add_argument("--prompts", type=int, default=5, help="prompts per batch-1 case (the median is reported)")
    ap.add_argument("--rounds", type=int, default=2, help="off/on alternations")
    ap.add_argument("--no-throughput", action="store_true")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)

    from compiled_llm import LLM, SamplingParams
    from compiled_llm.cli.bench.workloads import compiled_throughput, latency_prompt

    chain = json.loads((args.trained / "training.json").read_text())["chain"]
    llm = LLM(args.engine or str(args.trained), speculative_config=args.speculative_config, max_model_len=4096)
    vocab = llm.model.config.vocab_size
    cases = {
        "repeating": repeating_prompts(chain, args.prompts, args.new_tokens, args.repeat_head, args.repeat_body),
        "random": [latency_prompt(vocab, 128, seed=i) for i in range(args.prompts)],
    }
    # warm-up: every graph captured, both paths run once
    llm.generate({"prompt_token_ids": cases["repeating"][0]}, SamplingParams(max_tokens=16, temperature=0.0,
                                                                             ignore_eos=True), use_tqdm=False)
    llm.engine.capture_cuda_graphs()
    results: dict[str, dict[str, list[float]]] = {}
    stats = {}
    spec = llm.engine.speculator
    for name, prompts in cases.items():
        for _ in range(args.rounds):
            for on in (False, True):
                before = dataclasses.replace(spec.stats)
                with speculation(llm, on):
                    rate = decode_rate(llm, prompts, args.new_tokens)
                results.setdefault(name, {}).setdefault("on" if on else "off", []).append(rate)
                if on:
                    after = spec.stats
                    stats[name] = {f: getattr(after, f) - getattr(before, f)
                                   for f in ("verify_steps", "draft_tokens", "accepted_tokens", "emitted_tokens",
                                             "drafting_seqs")}
    if not args.no_throughput:
        for _ in range(args.rounds):
            for on in (False, True):
                before = dataclasses.replace(spec.stats)
                with speculation(llm, on):
                    r = compiled_throughput(llm)
                results.setdefault("throughput", {}).setdefault("on" if on else "off", []).append(
                    r.metrics["output_tok_s"])
                if on:
                    stats["throughput"] = {f: getattr(spec.stats, f) - getattr(before, f)
                                           for f in ("verify_steps", "draft_tokens", "accepted_tokens")}
    rows = []
    for name, by in results.items():
        off, on = statistics.median(by["off"]), statistics.median(by["on"])
        s = stats.get(name, {})
        acc = s.get("accepted_tokens", 0) / s["draft_tokens"] if s.get("draft_tokens") else 0.0
        mean_len = s["emitted_tokens"] / s["drafting_seqs"] if s.get("drafting_seqs") else 0.0
        rows.append({"case": name, "off": off, "on": on, "ratio": on / off, "acceptance": acc,
                     "mean_accepted_length": mean_len, "verify_steps": s.get("verify_steps", 0),
                     "runs_off": by["off"], "runs_on": by["on"]})
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        unit = {"throughput": "output tok/s"}
        print(f"speculative_config {args.speculative_config}; {time.strftime('%Y-%m-%d')}")
        print(f"{'case':<11}{'off':>12}{'on':>12}{'on/off':>8}{'accept':>8}{'mean len':>9}  unit")
        for r in rows:
            print(f"{r['case']:<11}{r['off']:>12,.1f}{r['on']:>12,.1f}{r['ratio']:>8.3f}{r['acceptance']:>8.1%}"
                  f"{r['mean_accepted_length']:>9.2f}  {unit.get(r['case'], 'decode tok/s, batch 1')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
