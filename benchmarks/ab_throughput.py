"""A/B of the throughput workload in one process: the engine as built, then with one change
reverted at a time (prefill attention with the host-read grid instead of the device-side tile
search; the torch sampler instead of the fused Gumbel-max kernel), each on a fresh set of
requests, with the prefill/decode step split.

    python benchmarks/ab_throughput.py [--source qwen2.5-0.5b]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--source", default="qwen2.5-0.5b")
    args = ap.parse_args(argv)

    from compiled_llm import LLM, sampling
    from compiled_llm.cli.bench import workloads as wl
    from compiled_llm.engine.build import build_engine
    from compiled_llm.kernels import triton_paged_attention as pa

    tmp = tempfile.TemporaryDirectory(prefix="ab_engine_")
    engine = str(Path(tmp.name) / "engine")
    build_engine(args.source, engine, dtype="bfloat16", device="cuda", max_model_len=4096,
                 progress=False)
    # no prefix caching: every variant runs the same prompts, later ones must not hit the cache
    llm = LLM(engine, device="cuda", max_model_len=4096, gpu_memory_utilization=0.85, enable_prefix_caching=False)

    original_prefill = pa.paged_attention_prefill
    original_sample = sampling.sample

    def host_grid_prefill(q, kv_cache, query_start_loc, seq_lens, block_tables, scale, max_query_len=None):
        if max_query_len is None:
            max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
        return original_prefill(q, kv_cache, query_start_loc, seq_lens, block_tables, scale, max_query_len)

    import torch

    def torch_sample(logits, st, generators=None):
        """sampling.sample's torch path (what runs without the fused kernel)."""
        if generators is not None and any(g is not None for g in generators) or st.needs_truncation or st.all_greedy:
            return original_sample(logits, st, generators)
        logits = logits.float()
        greedy_ids = logits.argmax(dim=-1)
        temp = torch.where(st.temperature > 0, st.temperature, torch.ones_like(st.temperature))
        probs = (logits / temp[:, None]).softmax(dim=-1)
        noise = torch.empty_like(probs).exponential_()
        return torch.where(st.temperature > 0, (probs / noise).argmax(dim=-1), greedy_ids)

    variants = [
        ("as built", None, None),
        ("prefill attention: host-read grid", host_grid_prefill, None),
        ("sampler: torch ops", None, torch_sample),
        ("as built (again)", None, None),
    ]
    import compiled_llm.serve.model_runner as mr

    for name, prefill, sampler in variants:
        pa.paged_attention_prefill = prefill or original_prefill
        mr.sample = sampler or original_sample
        r = wl.compiled_throughput(llm)
        print(f"{name:<36} {r.metrics['output_tok_s']:>10,.0f} tok/s  wall {r.metrics['wall_s']:.2f} s  ({r.note})", flush=True)
    pa.paged_attention_prefill = original_prefill
    mr.sample = original_sample

    # where a prefill-heavy mixed step's time goes: 16 prompts of 1,000 tokens, 2 tokens each
    import time

    from torch.profiler import ProfilerActivity, profile

    sys.path.insert(0, str(Path(__file__).parent))
    from profile_steps import _kernel_table

    from compiled_llm import SamplingParams

    prompts = [{"prompt_token_ids": [(7 * i + 13 * j) % 10_000 for j in range(1000)]} for i in range(16)]
    params = SamplingParams(max_tokens=2, temperature=0.6, ignore_eos=True, detokenize=False)
    llm.generate(prompts, params, use_tqdm=False)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        llm.generate([{"prompt_token_ids": [t + 1 for t in p["prompt_token_ids"]]} for p in prompts], params,
                     use_tqdm=False)
        torch.cuda.synchronize()
    print(f"16 x 1000-token prompts, 2 tokens each: {1e3 * (time.perf_counter() - t0):.1f} ms (profiled)")
    print(_kernel_table(prof, 14))
    cpu = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:10]
    for e in cpu:
        print(f"  host self {e.self_cpu_time_total / 1e3:8.2f} ms x{e.count:<5d} {e.key[:90]}")
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
