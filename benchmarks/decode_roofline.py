"""Batch-1 decode against the weight-bytes roofline, and decode at two context lengths.

    python benchmarks/decode_roofline.py gemma-2-2b mistral-7b [--contexts] [--every-layer-global]

For each preset (random weights at the real shapes, bf16): the latency workload's decode tok/s
(``compiled-llm bench --workload latency``), the bytes of weights one decode step reads (every
param once, an untied embedding's table not, since a step reads one row of it, and of a
mixture's experts the top_k of E a token chooses), and the
roofline, the device's copy bandwidth (measured here, in the same run) over those bytes.
``--contexts`` adds decode tok/s after prompts of 1,024 and 8,000 tokens: a model whose sliding
layers read only their window slows down less than one whose layers all read the whole context,
which ``--every-layer-global`` adds to the list as ``<preset>-global`` (the same shapes with no
window).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

CONTEXTS = (1024, 8000)


def copy_gbps() -> float:
    """Device-to-device copy bandwidth of a 1 GiB buffer, read + write bytes per second / 1e9."""
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(20):
        y.copy_(x)
    torch.cuda.synchronize()
    return 2 * 20 * x.numel() / (time.perf_counter() - start) / 1e9


def weight_bytes(llm) -> int:
    """Bytes of weights a batch-1 decode step reads: every weight once, but the RoPE tables and an
    untied embedding (one row each) and a mixture's experts, of which a token reads its top_k of
    E: attention + router + dense MLPs + (top_k / E) x the stacked experts + the lm_head."""
    config = llm.model.config
    chosen = config.num_experts_per_tok / config.num_experts if config.num_experts else 1.0
    return int(sum(t.numel() * t.element_size() * (chosen if ".experts." in name else 1.0)
                   for name, t in llm.model.params.items()
                   if not name.startswith("rope.") and not (name == "embed.weight" and not config.tie_word_embeddings)))


def decode_at(llm, context: int, new_tokens: int = 128, repeats: int = 3) -> float:
    """Median decode tok/s after a prompt of ``context`` tokens."""
    from compiled_llm import SamplingParams
    from compiled_llm.cli.bench.workloads import latency_prompt

    prompt = {"prompt_token_ids": latency_prompt(llm.model.config.vocab_size, length=context)}
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True, detokenize=False)
    rates = []
    for _ in range(repeats):
        (out,) = llm.generate(prompt, params, use_tqdm=False)
        m = out.metrics
        rates.append((new_tokens - 1) / (m.finished_time - m.first_token_time))
    return statistics.median(rates)


def add_global_variant(name: str) -> str:
    """Register ``<name>-global``, preset ``name`` with no sliding window; returns its name."""
    from compiled_llm.model import presets

    presets._PRESETS[f"{name}-global"] = {**presets.preset_hf_config(name), "sliding_window": None}
    presets.PRESET_NAMES = tuple(presets._PRESETS)
    return f"{name}-global"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("presets", nargs="+")
    p.add_argument("--contexts", action="store_true", help="decode tok/s after 1,024- and 8,000-token prompts")
    p.add_argument("--every-layer-global", action="store_true", help="also each preset with no sliding window")
    p.add_argument("--load-format", default="auto", choices=("auto", "dummy"),
                   help="dummy: random weights made on the device, none written (mixtures of 61-93 GB)")
    args = p.parse_args()
    from compiled_llm import LLM
    from compiled_llm.cli.bench.workloads import compiled_latency

    names = list(args.presets)
    if args.every_layer_global:
        names += [add_global_variant(n) for n in args.presets]
    bandwidth = copy_gbps()
    print(f"device {torch.cuda.get_device_name()}: copy {bandwidth:.0f} GB/s", flush=True)
    for name in names:
        start = time.perf_counter()
        llm = LLM(name, dtype="bfloat16", load_format=args.load_format)
        loaded = time.perf_counter() - start
        read = weight_bytes(llm)
        tok_s = compiled_latency(llm).metrics["decode_tok_s"]
        roofline = bandwidth * 1e9 / read
        print(f"{name}: decode {tok_s:.1f} tok/s, weights {read / 1e9:.3f} GB, roofline {roofline:.0f} tok/s -> "
              f"{100 * tok_s / roofline:.1f}% (built and loaded in {loaded:.0f} s)", flush=True)
        if args.contexts:
            short, long = (decode_at(llm, n) for n in CONTEXTS)
            print(f"{name}: decode after {CONTEXTS[0]} tokens {short:.1f} tok/s, after {CONTEXTS[1]} {long:.1f} tok/s "
                  f"({100 * long / short:.1f}%)", flush=True)
        del llm
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
