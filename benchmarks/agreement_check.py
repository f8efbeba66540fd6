"""Fused kernels + CUDA graphs against eager: the kernels issue's accuracy check.

The engine (fused Triton kernels, decode CUDA graphs, one-sequence prefill graphs, async
scheduling) generates greedily for 16 random prompts x 64 tokens; its logits at every step are
recorded from the sampler's input. The eager reference is the unfused spec with the reference
ops on the source's original weights, fed the engine's tokens (teacher forcing), so every step
compares logits for the same context. Verdict as in ``compiled-llm compare``: bf16 needs >= 99%
greedy agreement and every flip inside the other side's top 5.

With ``--prompts-file`` (a JSON list of token-id lists, such as the prompts.json that
benchmarks/train_synthetic_lm.py writes next to its checkpoint) the first ``--prompts`` of those
prompts replace the random ones: a trained model's margins show only on text like its own.

    python benchmarks/agreement_check.py [--source qwen2.5-0.5b] [--prompts 16] [--tokens 64] [--prompts-file F]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path


def read_prompts(path: Path, num_prompts: int) -> list[list[int]]:
    """The first ``num_prompts`` prompts of a JSON list of token-id lists, checked before the
    (slow) build, so a bad file fails at once."""
    prompts = json.loads(Path(path).read_text())
    if not isinstance(prompts, list) or len(prompts) < num_prompts:
        raise SystemExit(f"{path}: need a JSON list of at least {num_prompts} prompts")
    prompts = prompts[:num_prompts]
    for i, p in enumerate(prompts):
        if not (isinstance(p, list) and p and all(isinstance(t, int) and t >= 0 for t in p)):
            raise SystemExit(f"{path}: prompt {i} is not a non-empty list of token ids")
    return prompts


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--source", default="qwen2.5-0.5b")
    ap.add_argument("--engine", default=None, help="an engine built beforehand (default: build the source)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--prompts", type=int, default=16, help="how many prompts (the first N of --prompts-file)")
    ap.add_argument("--prompts-file", type=Path, default=None, help="a JSON list of token-id lists to use as prompts")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-model-len", type=int, default=1024)
    args = ap.parse_args(argv)
    file_prompts = read_prompts(args.prompts_file, args.prompts) if args.prompts_file is not None else None

    import torch

    from compiled_llm import LLM, SamplingParams
    from compiled_llm.engine import compare as cmp
    from compiled_llm.engine.build import build_engine
    from compiled_llm.model.sources import load_source_params

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tmp = None
    engine = args.engine
    if engine is None:
        tmp = tempfile.TemporaryDirectory(prefix="agree_engine_")
        engine = str(Path(tmp.name) / "engine")
        build_engine(args.source, engine, dtype=args.dtype, device=device.type,
                     max_model_len=args.max_model_len, progress=False)
    llm = LLM(engine, device=device, max_model_len=args.max_model_len, gpu_memory_utilization=0.5)
    runner = llm.engine.runner
    recorded: dict[tuple[str, int], torch.Tensor] = {}
    original_sample, original_launch = runner._sample, runner.launch
    queued_ahead = [False]

    def recording_launch(batch, ahead_of=None, ahead_rows=None):
        queued_ahead[0] = ahead_of is not None
        return original_launch(batch, ahead_of, ahead_rows)

    def recording_sample(batch, logits):
        for j, row in enumerate(batch.sample_rows):
            seq = batch.seqs[row]
            # output index of the token this row samples: one past the sequence's tokens, two
            # past when the step was queued before the previous step's token was appended
            index = seq.num_tokens - seq.num_prompt_tokens + (1 if queued_ahead[0] else 0)
            recorded[(seq.request_id, index)] = logits[j].float().cpu()
        return original_sample(batch, logits)

    runner._sample = recording_sample
    runner.launch = recording_launch
    vocab = llm.model.config.vocab_size
    prompts = file_prompts or cmp.random_prompts(vocab, args.prompts, args.seed)
    if max(max(p) for p in prompts) >= vocab:
        raise SystemExit(f"{args.prompts_file}: token ids must be below the model's vocab size {vocab}")
    params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    st = llm.stats
    print(f"engine: {st.graphs_captured} graphs, {st.decode_steps} decode steps ({st.ahead_steps} queued ahead), "
          f"{st.prefill_steps} prefill steps")
    tokens = torch.tensor([o.token_ids for o in outs])  # [N, K]
    logits = torch.stack([torch.stack([recorded[(o.request_id, k)] for o in outs]) for k in range(args.tokens)])

    manifest = llm.model.manifest
    config, dtype = llm.model.config, llm.model.dtype
    del llm, runner
    torch.cuda.empty_cache() if device.type == "cuda" else None
    spec_params = load_source_params(cmp.source_of(manifest), dtype, device)
    ref, _ = cmp.run_steps(cmp.spec_step(config, spec_params), config, prompts, args.tokens, device, dtype, forced=tokens)
    v = cmp.judge(logits, tokens, ref, prompts, dtype)
    # the noise floor of the dtype on this model: the same eager spec in float32, fed the same
    # tokens; how often does each bf16 side pick what float32 picks?
    spec32 = load_source_params(cmp.source_of(manifest), torch.float32, device)
    ref32, _ = cmp.run_steps(cmp.spec_step(config, spec32), config, prompts, args.tokens, device, torch.float32,
                             forced=tokens)
    pick32 = ref32.argmax(-1)
    engine_vs_32 = (logits.argmax(-1) == pick32).float().mean().item()
    eager_vs_32 = (ref.argmax(-1) == pick32).float().mean().item()
    top2 = ref32.topk(2, dim=-1).values
    gap = (top2[..., 0] - top2[..., 1]).median().item()
    print(f"against the float32 eager spec on the same tokens: engine {engine_vs_32:.2%}, eager {args.dtype} "
          f"{eager_vs_32:.2%} (median top-1/top-2 logit gap {gap:.3f}; max|logit| {ref32.abs().max().item():.2f})")
    print(f"fused kernels + graphs vs eager spec ({args.prompts} prompts x {args.tokens} tokens, {args.dtype}): "
          f"greedy agreement {v.agreement:.2%} ({v.agree}/{v.steps}), flips outside top {cmp.TOP_K}: {v.flips_outside_top_k}, "
          f"max|dlogit| {v.max_abs_delta:.3f} (max|logit| {v.max_abs_logit:.2f}) -> {'PASS' if v.ok else 'FAIL'} [{v.rule}]")
    if tmp is not None:
        tmp.cleanup()
    return 0 if v.ok else 1


if __name__ == "__main__":
    sys.exit(main())
