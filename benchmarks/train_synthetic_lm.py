"""Train a preset's architecture briefly on a synthetic corpus, so accuracy checks see a model
with real logit margins instead of random-weight noise.

With random weights the top-1/top-2 logit gap is a few bf16 ulps, so bf16 rounding alone flips
picks and an agreement check measures noise, not kernel error. Real checkpoints predict most
tokens with a clear margin. No weights can be downloaded, so this script makes such a model:
the preset's exact shapes (``transformers.AutoModelForCausalLM.from_config`` on the preset's
config.json), trained for a few hundred steps on text drawn from a low-entropy source, saved as
an ordinary Hugging Face checkpoint (bf16 safetensors, config.json, the presets' byte-level
tokenizer) that ``compiled-llm build`` and ``benchmarks/kernel_bench.py agree --source DIR`` read.

The corpus is a first-order Markov chain over ``--states`` token ids (a random subset of the
vocabulary, specials excluded, in random order). The states sit on a cycle by that order: the
state of rank r moves to rank r + offsets[j] (mod S) with probability probs[j] (default
0.85 / 0.10 / 0.05), so every state has a few successors and a peaked distribution; the best
achievable margin is log(0.85 / 0.10) ~ 2.1 nats. Laying the chain out on a cycle keeps it a
random token-to-token table for the model (the ids are shuffled) while making a whole batch of
walks one cumsum: the rank at step t is the start plus the sum of the chosen offsets, no loop
over positions. offsets[0] is coprime to S, so the most-likely path visits every state before
repeating: greedy generation never loops back onto its own tokens within a check's 64 tokens.
Each state is equally frequent (the walk is doubly stochastic), so all of them train equally.

Why first order, not a source that needs attention (second order, repeated segments; not
tried): even a bigram table takes this model 50-150 steps to start learning (below), and
previous-token and induction heads form later still; until they do, the model averages over the
cases attention should tell apart, and those tokens get near-zero margins, which is the noise
this script exists to remove. Attention still runs on every token at the real shapes and its
output still feeds the residual stream, so an attention kernel's error still moves the logits;
only the model's pick does not hinge on it.

Defaults (1024 states, 300 steps of 32 x 256, peak lr 3e-4) were picked on an H200 at
Qwen2.5-0.5B shapes, 39 s of training: the model first learns only the states' unigram (loss
ln S) and leaves that plateau after ~50 steps with 1024 states but ~150 with 4096; at lr 1e-3
(4096 states, 200 steps) it stayed there until the rate had decayed and ended at loss 6.1. With
the defaults it ends at loss 0.55 (floor 0.52), argmax = most likely successor on 100% of
held-out tokens, top-1/top-2 gap median 2.2 and 1st percentile 1.2.

Prints the training loss and, on held-out walks, how often the model's argmax is the chain's
most likely successor and the median / 1st-percentile top-1 minus top-2 logit gap; writes
``prompts.json`` (``--num-prompts`` walks of 8..32 tokens, for ``kernel_bench.py agree
--prompts-file``) and ``training.json`` (the chain and the log).

    python benchmarks/train_synthetic_lm.py --out /tmp/cllm_trained [--preset qwen2.5-0.5b] [--steps 300]
        [--num-hidden-layers N]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from pathlib import Path

import torch
from torch import Tensor

DEFAULT_PROBS = (0.85, 0.10, 0.05)
DEFAULT_STATES = 1024
PROMPT_LEN = (8, 32)
HELD_OUT_WALKS = 8
CLIP_NORM = 1.0


@dataclasses.dataclass(frozen=True)
class Chain:
    """The state of rank r is token ``tokens[r]`` and moves to rank (r + offsets[j]) mod S with
    probability probs[j]; probs is descending, so offsets[0] is the most likely step."""

    tokens: Tensor  # [S] token ids
    offsets: Tensor  # [B] distinct, non-zero mod S
    probs: Tensor  # [B] float32, sums to 1

    @property
    def num_states(self) -> int:
        return int(self.tokens.numel())

    def to(self, device) -> "Chain":
        return Chain(self.tokens.to(device), self.offsets.to(device), self.probs.to(device))

    def top_successor(self, ranks: Tensor) -> Tensor:
        """Token id of each rank's most likely successor."""
        return self.tokens[(ranks + self.offsets[0]) % self.num_states]

    def describe(self) -> dict:
        return {"tokens": self.tokens.tolist(), "offsets": self.offsets.tolist(), "probs": self.probs.tolist()}


def excluded_ids(hf_config: dict) -> set[int]:
    """Ids the chain must not use: the byte-level tokenizer's specials and the config's EOS ids,
    so generation never stops early and special-token handling never sees a chain token."""
    from compiled_llm.model.presets import ENDOFTEXT_ID, IM_END_ID, IM_START_ID

    eos = hf_config.get("eos_token_id")
    eos = [eos] if isinstance(eos, int) else list(eos or [])
    return {ENDOFTEXT_ID, IM_START_ID, IM_END_ID, *eos}


def make_chain(vocab_size: int, num_states: int, probs, exclude, seed: int) -> Chain:
    gen = torch.Generator().manual_seed(seed)
    exclude = set(exclude)
    allowed = torch.tensor([i for i in range(vocab_size) if i not in exclude])
    probs = torch.tensor(sorted(probs, reverse=True), dtype=torch.float32)
    if not math.isclose(float(probs.sum()), 1.0, abs_tol=1e-6) or bool((probs <= 0).any()):
        raise ValueError(f"successor probabilities must be positive and sum to 1, got {probs.tolist()}")
    if not len(probs) < num_states <= len(allowed):
        raise ValueError(
            f"--states must be in ({len(probs)}, {len(allowed)}] (vocab {vocab_size} less specials), got {num_states}"
        )
    tokens = allowed[torch.randperm(len(allowed), generator=gen)[:num_states]]
    coprime = torch.tensor([o for o in range(1, num_states) if math.gcd(o, num_states) == 1])
    first = coprime[torch.randint(len(coprime), (1,), generator=gen)]
    rest = torch.randperm(num_states - 1, generator=gen) + 1
    rest = rest[rest != first][: len(probs) - 1]
    return Chain(tokens, torch.cat([first, rest]), probs)


def sample_ranks(chain: Chain, batch: int, length: int, gen: torch.Generator) -> Tensor:
    """[batch, length] ranks of ``batch`` independent walks from uniform random starts."""
    device = chain.tokens.device
    start = torch.randint(chain.num_states, (batch, 1), generator=gen, device=device)
    choice = torch.multinomial(chain.probs, batch * (length - 1), replacement=True, generator=gen)
    steps = chain.offsets[choice].view(batch, length - 1)
    return torch.cat([start, start + steps.cumsum(1)], dim=1) % chain.num_states


def sample_prompts(chain: Chain, num_prompts: int, seed: int, lengths=PROMPT_LEN) -> list[list[int]]:
    """Walks of random lengths in ``lengths`` (inclusive), as token-id lists; drawn on the CPU
    so the prompts do not depend on the training device."""
    chain = chain.to("cpu")
    gen = torch.Generator().manual_seed(seed)
    tokens = chain.tokens[sample_ranks(chain, num_prompts, lengths[1], gen)]
    lens = torch.randint(lengths[0], lengths[1] + 1, (num_prompts,), generator=gen).tolist()
    return [row[:n] for row, n in zip(tokens.tolist(), lens)]


def entropy(probs: Tensor) -> float:
    """The chain's per-token entropy in nats: the lowest loss a model can reach."""
    return float(-(probs * probs.log()).sum())


def lr_at(step: int, steps: int, peak: float, warmup: int, floor: float = 0.1) -> float:
    """Linear warm-up to ``peak`` over ``warmup`` steps, then cosine down to ``floor * peak``."""
    if step < warmup:
        return peak * (step + 1) / warmup
    t = (step - warmup) / max(1, steps - 1 - warmup)
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))


def autocast(device: torch.device):
    # bf16 matmuls over fp32 master weights on CUDA; plain fp32 on the CPU (bf16 is slow there)
    return torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")


@torch.no_grad()
def evaluate(model, chain: Chain, ranks: Tensor, device: torch.device) -> dict:
    """On held-out walks: loss against the sampled next tokens, how often the argmax is the
    chain's most likely successor, and the top-1 minus top-2 logit gap."""
    model.eval()
    tokens = chain.tokens[ranks]
    with autocast(device):
        logits = model(input_ids=tokens, use_cache=False).logits.float()
    model.train()
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
    top2 = logits.topk(2, dim=-1).values
    gap = (top2[..., 0] - top2[..., 1]).flatten()
    return {
        "loss": float(loss),
        "top_successor": float((logits.argmax(-1) == chain.top_successor(ranks)).float().mean()),
        "gap_median": float(gap.median()),
        "gap_p1": float(gap.quantile(0.01)),
    }


def build_model(hf_config: dict, seed: int, device: torch.device):
    """The preset's architecture in transformers, random init (fp32 master weights)."""
    import transformers

    kw = {k: v for k, v in hf_config.items() if k != "model_type"}
    cfg = transformers.AutoConfig.for_model(hf_config["model_type"], **kw)
    torch.manual_seed(seed)
    with device:  # initialise in place: 0.5B parameters are slow to init on the CPU and copy over
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="sdpa")
    return model.train()


def train(model, chain: Chain, args, device: torch.device, log) -> list[dict]:
    fused = {"fused": True} if device.type == "cuda" else {}
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0, **fused)
    gen = torch.Generator(device=device).manual_seed(args.seed)
    held_out = sample_ranks(chain, HELD_OUT_WALKS, args.seq_len, torch.Generator(device=device).manual_seed(args.seed + 1))
    warmup = max(1, args.steps // 10)
    history, t0 = [], time.perf_counter()
    for step in range(args.steps):
        lr = lr_at(step, args.steps, args.lr, warmup)
        for group in opt.param_groups:
            group["lr"] = lr
        tokens = chain.tokens[sample_ranks(chain, args.batch, args.seq_len, gen)]
        with autocast(device):
            loss = model(input_ids=tokens, labels=tokens, use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP_NORM)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % args.log_every == 0 or step == args.steps - 1:
            ev = evaluate(model, chain, held_out, device)
            entry = {"step": step, "loss": float(loss.detach()), "lr": lr, "seconds": time.perf_counter() - t0, "held_out": ev}
            history.append(entry)
            log(f"step {step:4d}  loss {entry['loss']:.3f}  lr {lr:.2e}  held-out: loss {ev['loss']:.3f}, "
                f"argmax = top successor {ev['top_successor']:.1%}, gap median {ev['gap_median']:.2f} "
                f"p1 {ev['gap_p1']:.2f}  ({entry['seconds']:.0f} s)")
    return history


def save_checkpoint(model, out: Path) -> None:
    """bf16 safetensors + config.json, and the byte-level tokenizer the presets carry, so the
    checkpoint behaves like its preset (text prompts, chat template, EOS ids)."""
    from compiled_llm.model.tokenizer import byte_level_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(out)  # safetensors is the default (and only) format
    byte_level_tokenizer().save(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="qwen2.5-0.5b")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--states", type=int, default=None, help=f"chain size (default {DEFAULT_STATES}, or all usable ids if fewer)")
    ap.add_argument("--probs", default=",".join(map(str, DEFAULT_PROBS)), help="successor probabilities, comma separated")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--log-every", type=int, default=20)
    ap.add_argument("--num-hidden-layers", type=int, default=None,
                    help="the preset's shapes with this many layers (a 30B mixture's two layers train on one GPU)")
    args = ap.parse_args(argv)

    from compiled_llm.model.presets import preset_hf_config

    device = torch.device(args.device)
    hf = preset_hf_config(args.preset)
    if args.num_hidden_layers is not None:
        if args.num_hidden_layers < 1:
            ap.error(f"--num-hidden-layers must be at least 1, not {args.num_hidden_layers}")
        hf["num_hidden_layers"] = args.num_hidden_layers
    model = build_model(hf, args.seed, device)
    exclude = excluded_ids(hf)
    num_states = args.states or min(DEFAULT_STATES, hf["vocab_size"] - len(exclude))
    chain = make_chain(hf["vocab_size"], num_states, [float(p) for p in args.probs.split(",")], exclude, args.seed)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"{args.preset}: {n_params / 1e6:.1f}M parameters on {device}; chain of {num_states} states, "
          f"successor probs {[round(p, 4) for p in chain.probs.tolist()]}, "
          f"entropy {entropy(chain.probs):.3f} nats (the lowest loss), "
          f"best margin {math.log(chain.probs[0] / chain.probs[1]):.2f}; {args.steps} steps of {args.batch} x {args.seq_len}")
    history = train(model, chain.to(device), args, device, log=print)

    save_checkpoint(model, args.out)
    prompts = sample_prompts(chain, args.num_prompts, args.seed + 2)
    (args.out / "prompts.json").write_text(json.dumps(prompts))
    record = {"preset": args.preset, "args": {k: str(v) for k, v in vars(args).items()}, "chain": chain.describe(),
              "entropy": entropy(chain.probs), "history": history}
    (args.out / "training.json").write_text(json.dumps(record))
    final = history[-1]
    print(f"final: loss {final['loss']:.3f} (floor {entropy(chain.probs):.3f}), held-out argmax = top successor "
          f"{final['held_out']['top_successor']:.2%}, gap median {final['held_out']['gap_median']:.2f} "
          f"p1 {final['held_out']['gap_p1']:.2f}; saved to {args.out} with {len(prompts)} prompts")
    return 0


if __name__ == "__main__":
    sys.exit(main())
