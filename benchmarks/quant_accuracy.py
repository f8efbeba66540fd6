"""Accuracy of the weight-only quantized engines (``--quantization int8|int4``) against the
unquantized one, on a checkpoint trained by ``train_synthetic_lm.py`` (real logit margins, so a
flipped pick means quantization error, not bf16 noise).

    python benchmarks/quant_accuracy.py CHECKPOINT_DIR [--schemes int8,int4] [--prompts 16] [--tokens 64]
        [--ppl-walks 32] [--device cuda|cpu] [--dtype bfloat16|float32] [--json PATH|-]

The acceptance points (bf16 engine as the baseline): greedy agreement >= 98% (int8) and >= 90%
(int4) over 16 prompts x 64 tokens; held-out perplexity at most +1% (int8) and +5% (int4).
Exit status 0 when every scheme passes, 1 otherwise.

Every engine is loaded through ``LLM(CHECKPOINT_DIR, quantization=...)`` (built into the engine
cache on first use), one at a time; the unquantized one last, since it is also the reference:

- greedy agreement, as ``kernel_bench.py agree`` and ``compiled-llm compare`` count it
  (``compiled_llm.engine.compare.judge``): the candidate generates greedily (its decode path,
  the one real generation runs); the reference is fed the candidate's tokens (teacher forcing:
  prompt + the 64 generated tokens as one prompt, scored with ``prompt_logprobs``), so every one
  of the 16 x 64 positions compares picks for the same context, and the agreement is the
  fraction of positions where the reference's top-1 is the candidate's token. No position is
  dropped after a first divergence: each is judged on the candidate's own context. Also shown:
  how many picks fall outside the reference's top 5, and, free-running, how many of the
  candidate's continuations equal the reference's own. The unquantized engine's row is its own
  decode path against its own prefill path: the engine's noise floor (100% on fp32).
- perplexity: exp(mean NLL) of fresh walks of the training chain (``training.json``'s chain,
  walks drawn by ``train_synthetic_lm.sample_ranks`` with a seed the training did not use), each
  walk scored as one prompt with ``prompt_logprobs=0`` (the log-probability of every prompt
  token after the first) and ``max_tokens=1``. The chain's own entropy gives the floor
  exp(H) that a perfect model reaches.

On a CPU (no GPU) it runs in float32 by default; the acceptance points are for bf16 on a GPU.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kernel_bench  # noqa: E402  (read_prompts: the same prompts file checks as `agree`)
import train_synthetic_lm as tsl  # noqa: E402

from compiled_llm import LLM, SamplingParams  # noqa: E402
from compiled_llm.engine.compare import TOP_K  # noqa: E402

BASELINE = "none"
SCHEMES = ("int8", "int4")
MIN_AGREEMENT = {"int8": 0.98, "int4": 0.90}
MAX_PPL_RATIO = {"int8": 1.01, "int4": 1.05}
HELD_OUT_SEED_OFFSET = 1000  # train_synthetic_lm uses seed, seed + 1 and seed + 2


def held_out_walks(record: dict, num_walks: int, length: int, seed: int) -> list[list[int]]:
    """``num_walks`` walks of ``length`` tokens of the chain in ``training.json``'s record."""
    c = record["chain"]
    chain = tsl.Chain(torch.tensor(c["tokens"]), torch.tensor(c["offsets"]),
                      torch.tensor(c["probs"], dtype=torch.float32))
    ranks = tsl.sample_ranks(chain, num_walks, length, torch.Generator().manual_seed(seed))
    return chain.tokens[ranks].tolist()


def load(checkpoint: Path, scheme: str, args) -> LLM:
    return LLM(str(checkpoint), dtype=args.dtype, device=args.device,
               quantization=None if scheme == BASELINE else scheme,
               max_model_len=args.max_model_len, gpu_memory_utilization=args.gpu_memory_utilization)


def free(llm) -> None:
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def greedy(llm: LLM, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.token_ids) for o in outs]


def prompt_logprobs(llm: LLM, sequences: list[list[int]], top: int) -> list[list[dict]]:
    """Per sequence, the engine's log-probability entries for tokens 1.. (vLLM's
    ``prompt_logprobs``: the token's own entry and the ``top`` most likely tokens)."""
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, detokenize=False, prompt_logprobs=top)
    outs = llm.generate([{"prompt_token_ids": s} for s in sequences], params, use_tqdm=False)
    result = []
    for s, o in zip(sequences, outs):
        entries = o.prompt_logprobs
        if entries is None or len(entries) != len(s) or entries[0] is not None:
            raise RuntimeError(f"prompt_logprobs: expected {len(s)} entries (the first None), got "
                               f"{None if entries is None else len(entries)}")
        result.append(entries[1:])
    return result


def perplexity(llm: LLM, walks: list[list[int]]) -> dict:
    """exp(mean NLL) over every token after each walk's first."""
    nll, count = 0.0, 0
    for walk, entries in zip(walks, prompt_logprobs(llm, walks, 0)):
        for token, entry in zip(walk[1:], entries):
            nll -= entry[token].logprob
            count += 1
    return {"nll": nll / count, "ppl": math.exp(nll / count), "tokens_scored": count}


def teacher_forced(llm: LLM, prompts: list[list[int]], generated: list[list[int]]) -> dict:
    """The reference ``llm`` on each prompt + the candidate's tokens: at each generated position,
    is the candidate's token the reference's top-1 (and in its top TOP_K)?"""
    sequences = [p + g for p, g in zip(prompts, generated)]
    agree = outside = steps = 0
    for p, g, entries in zip(prompts, generated, prompt_logprobs(llm, sequences, TOP_K)):
        # entries[i] scores token i + 1 of the sequence: generated token j is token len(p) + j
        for j, token in enumerate(g):
            entry = entries[len(p) + j - 1]
            top1 = next(t for t, lp in entry.items() if lp.rank == 1)
            agree += top1 == token
            outside += entry[token].rank > TOP_K
            steps += 1
    return {"agree": agree, "steps": steps, "agreement": agree / steps, "outside_top_k": outside}


def free_running(generated: list[list[int]], reference: list[list[int]]) -> dict:
    """How many continuations equal the reference's own, and the mean first-divergence index."""
    firsts = [next((j for j, (a, b) in enumerate(zip(g, r)) if a != b), len(g)) for g, r in zip(generated, reference)]
    return {"identical": sum(f == len(g) for f, g in zip(firsts, generated)),
            "mean_first_divergence": sum(firsts) / len(firsts)}


def verdict(scheme: str, row: dict) -> bool | None:
    if scheme == BASELINE:
        return None
    return row["agreement"] >= MIN_AGREEMENT[scheme] and row["ppl_ratio"] <= MAX_PPL_RATIO[scheme]


def measure(args) -> dict:
    checkpoint = Path(args.checkpoint)
    record = json.loads((checkpoint / "training.json").read_text())
    prompts = kernel_bench.read_prompts(checkpoint / "prompts.json", args.prompts)
    train_args = record.get("args", {})
    length = args.ppl_len or int(train_args.get("seq_len", 256))
    seed = args.seed if args.seed is not None else int(train_args.get("seed", 0)) + HELD_OUT_SEED_OFFSET
    walks = held_out_walks(record, args.ppl_walks, length, seed)

    generated, rows = {}, {}
    for scheme in [*args.schemes, BASELINE]:  # the baseline last: it scores the others' tokens
        llm = load(checkpoint, scheme, args)
        generated[scheme] = greedy(llm, prompts, args.tokens)
        rows[scheme] = {"scheme": scheme, **perplexity(llm, walks)}
        if scheme == BASELINE:
            for s in rows:
                rows[s].update(teacher_forced(llm, prompts, generated[s]))
                rows[s].update(free_running(generated[s], generated[BASELINE]))
        free(llm)
    base = rows[BASELINE]["ppl"]
    ordered = [rows[BASELINE]] + [rows[s] for s in args.schemes]
    for row in ordered:
        row["ppl_ratio"] = row["ppl"] / base
        row["pass"] = verdict(row["scheme"], row)
        if row["scheme"] in MIN_AGREEMENT:
            row["thresholds"] = {"min_agreement": MIN_AGREEMENT[row["scheme"]], "max_ppl_ratio": MAX_PPL_RATIO[row["scheme"]]}
    return {
        "checkpoint": str(checkpoint), "device": str(args.device), "dtype": args.dtype,
        "prompts": len(prompts), "tokens": args.tokens,
        "held_out": {"walks": args.ppl_walks, "length": length, "seed": seed,
                     "floor_ppl": math.exp(record["entropy"]) if "entropy" in record else None},
        "results": ordered,
        "pass": all(r["pass"] is not False for r in ordered),
    }


def format_table(report: dict) -> str:
    baseline = f"{report['dtype']} unquantized"
    head = ("scheme", f"agreement vs {baseline}", f"outside top {TOP_K}", "identical", "ppl", "ppl ratio", "verdict")
    rows = [head]
    for r in report["results"]:
        limits = r.get("thresholds")
        if limits is None:
            verdict_text = "baseline (agreement: decode vs prefill path)"
        else:
            verdict_text = (f"{'PASS' if r['pass'] else 'FAIL'} (>= {limits['min_agreement']:.0%}, "
                            f"<= +{limits['max_ppl_ratio'] - 1:.0%})")
        rows.append((r["scheme"], f"{r['agreement']:.2%} ({r['agree']}/{r['steps']})", str(r["outside_top_k"]),
                     f"{r['identical']}/{report['prompts']}", f"{r['ppl']:.4f}", f"{r['ppl_ratio']:.4f}", verdict_text))
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    h = report["held_out"]
    floor = f"; the chain's floor exp(H) = {h['floor_ppl']:.4f}" if h["floor_ppl"] else ""
    lines.append(f"{report['prompts']} prompts x {report['tokens']} greedy tokens; perplexity of {h['walks']} held-out "
                 f"walks of {h['length']} tokens (seed {h['seed']}){floor}")
    lines.append("PASS" if report["pass"] else "FAIL")
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", help="a checkpoint directory written by train_synthetic_lm.py")
    ap.add_argument("--schemes", default=",".join(SCHEMES),
                    type=lambda s: [x for x in s.split(",") if x],
                    help="quantization schemes to check against the unquantized engine (default int8,int4)")
    ap.add_argument("--prompts", type=int, default=16, help="how many prompts (the first N of prompts.json)")
    ap.add_argument("--tokens", type=int, default=64, help="greedy tokens per prompt")
    ap.add_argument("--ppl-walks", type=int, default=32, help="held-out walks scored for perplexity")
    ap.add_argument("--ppl-len", type=int, default=None, help="tokens per walk (default: the training's --seq-len)")
    ap.add_argument("--seed", type=int, default=None,
                    help=f"seed of the held-out walks (default: the training's seed + {HELD_OUT_SEED_OFFSET})")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="the engines' dtype (default bfloat16 on cuda, float32 on cpu)")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    ap.add_argument("--json", metavar="PATH", help="also write the report as JSON to PATH ('-': stdout, no table)")
    return ap


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    args.dtype = args.dtype or ("bfloat16" if str(args.device).startswith("cuda") else "float32")
    bad = [s for s in args.schemes if s not in SCHEMES]
    if bad:
        raise SystemExit(f"--schemes: unknown {bad}; choose from {list(SCHEMES)}")
    report = measure(args)
    if args.json == "-":
        print(json.dumps(report, indent=1))
    else:
        print(format_table(report))
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return 0 if report["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
