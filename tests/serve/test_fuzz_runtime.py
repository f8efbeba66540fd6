"""Differential fuzzing of the runtime against transformers.

Each draw is a random engine configuration (token budget 1-4096, 1-64 sequences, a KV pool just
big enough for the largest request, block size, prefix caching, chunked prefill and async
scheduling on or off) and a random workload over a pool of prompts (shared prefixes, text and
token-id prompts, random max_tokens, EOS on or off, stop strings that span tokens), driven one of
four ways: one ``generate`` call, two threads calling ``generate`` at once, streams consumed in a
random order and some closed early, or the engine's own add/abort/step loop with random aborts.
Every request that was not aborted must give exactly what transformers' greedy ``generate``
gives for it alone (token ids, text, finish reason), and at the end every KV block must be free.
Structured draws put half the requests under a grammar: theirs must match it.

The checkpoint is ``lively.make_lively_checkpoint``: its greedy outputs vary, so a token fed at
the wrong position, a wrong stop cut or a lost stream delta changes what is compared.
Continuations whose top-1/top-2 logit gap ever falls below ``MIN_MARGIN`` are left out of the
pool: there, float rounding alone may pick either token.

``pytest tests/serve/test_fuzz_runtime.py --soak 600`` keeps drawing for ten minutes.
"""

from __future__ import annotations

import random
import time

import pytest

from compiled_llm import LLM, SamplingParams
from compiled_llm.engine.loader import load_model
from helpers.lively import greedy_continuation
from helpers.runtime_fuzz import MAX_NEW_TOKENS, expected_output, run_draw
from helpers.trained_tokenizers import WORDS

# Draw counts: each past the last draw that reaches a branch of compiled_llm (coverage.py, line
# arcs) no earlier draw reached, among as many draws as the counts these replaced (1000, 150,
# 100, 40): plain draw 32, speculative 54, window 47, experts 21, structured 39 (so kept at 40).
# The plain 500 also hold every pair of drawn option values (driver, block size, budget band,
# sequence cap, chunking, prefix caching, async) that 1000 did. --soak draws for longer.
NUM_DRAWS = 500
NUM_SPECULATIVE_DRAWS = 75
NUM_STRUCTURED_DRAWS = 40
NUM_WINDOW_DRAWS = 60
NUM_EXPERT_DRAWS = 25
WINDOW = 12  # the sliding-window family's: most prompts and generations outrun it
MIN_MARGIN = 1e-3
# Draws that failed before prefill and decode were told apart per row (with budgets of 1-5
# tokens, a step of one-token prompt chunks was taken for a decode: the chunks were fed each
# sequence's last token, or a step queued ahead read sampled ids that did not exist).
REGRESSION_SEEDS = (2, 11, 33, 37, 42, 50, 160)


@pytest.fixture(scope="module")
def lively(lively_bpe_checkpoint, lively_bpe_engine):
    """(loaded engine, tokenizer, pool of (prompt, continuation)) for the whole module."""
    _, model = lively_bpe_checkpoint
    return lively_pool(load_model(str(lively_bpe_engine), device="cpu"), model)


@pytest.fixture(scope="module")
def windowed_lively(tmp_path_factory):
    """The same, of a Mistral whose every layer attends within WINDOW tokens."""
    from compiled_llm.engine.build import build_engine
    from helpers.lively import make_lively_checkpoint

    checkpoint = tmp_path_factory.mktemp("windowed") / "checkpoint"
    model = make_lively_checkpoint(checkpoint, seed=2, sliding_window=WINDOW)
    engine = checkpoint.parent / "engine"
    build_engine(str(checkpoint), engine, dtype="float32", device="cpu", progress=False)
    loaded = load_model(str(engine), device="cpu")
    assert loaded.config.kv_window == WINDOW
    return lively_pool(loaded, model)


@pytest.fixture(scope="module")
def experts_lively(tmp_path_factory):
    """The same, of a Qwen3-MoE whose MLPs are 4 experts, 2 per token."""
    from compiled_llm.engine.build import build_engine
    from helpers.lively import make_lively_checkpoint

    checkpoint = tmp_path_factory.mktemp("experts") / "checkpoint"
    model = make_lively_checkpoint(checkpoint, seed=3, experts=4)
    engine = checkpoint.parent / "engine"
    build_engine(str(checkpoint), engine, dtype="float32", device="cpu", progress=False)
    loaded = load_model(str(engine), device="cpu")
    assert loaded.config.moe_layers == (0, 1)
    return lively_pool(loaded, model)


def lively_pool(loaded, model):
    """(loaded, tokenizer, pool of (prompt, continuation)): prompts of words and of ids, some
    behind shared prefixes, whose continuations have clear margins."""
    tok = loaded.tokenizer
    rng = random.Random(1234)
    vocab = model.config.vocab_size
    prefixes = [[rng.randrange(vocab) for _ in range(rng.randint(8, 40))] for _ in range(3)]
    prompts: list[str | list[int]] = []
    for i in range(56):
        if i % 4 == 0:
            prompts.append(" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 12))))
        else:
            ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 24))]
            prompts.append(rng.choice(prefixes) + ids if i % 4 == 1 else ids)
    pool = []
    for p in prompts:
        ids = tok.encode(p) if isinstance(p, str) else p
        cont = greedy_continuation(model, ids, MAX_NEW_TOKENS)
        if cont.min_margin >= MIN_MARGIN:
            pool.append((p, cont))
    assert len(pool) >= 40, f"only {len(pool)} prompts with clear margins"
    return loaded, tok, pool


@pytest.mark.parametrize("budget", [1, 2, 3, 4, 7, 4096])
@pytest.mark.parametrize("max_num_seqs", [1, 3, 64])
def test_any_token_budget_and_sequence_cap_give_transformers_outputs(lively, budget, max_num_seqs):
    loaded, tok, pool = lively
    eos = set(loaded.eos_token_ids)
    params = SamplingParams(max_tokens=12, temperature=0.0)
    requests = [({"prompt_token_ids": list(c.prompt)}, expected_output(tok, c, params, eos)) for _, c in pool[:20]]
    llm = LLM.from_loaded(loaded, max_num_batched_tokens=budget, max_num_seqs=max_num_seqs)
    outs = llm.generate([p for p, _ in requests], params, use_tqdm=False)
    assert [(o.token_ids, o.text, o.finish_reason) for o in outs] == [(e.token_ids, e.text, e.finish_reason) for _, e in requests]


@pytest.mark.parametrize("seed", REGRESSION_SEEDS)
def test_fuzz_regression_seed(seed, lively):
    assert run_draw(seed, lively)[1] == []


def test_fuzz_against_transformers(lively, request):
    soak = request.config.getoption("--soak")
    deadline = time.monotonic() + soak if soak else None
    problems, seed = [], 0
    while (seed < NUM_DRAWS) if deadline is None else (time.monotonic() < deadline):
        problems += run_draw(seed, lively)[1]
        seed += 1
    if deadline is not None:
        print(f"\n{seed} draws in {soak:.0f} s, {len(problems)} differences")
    assert not problems, f"{len(problems)} differences in {seed} draws:\n" + "\n".join(problems[:10])


def test_fuzz_with_speculation_against_transformers(lively):
    """The same draws with n-gram speculation on: outputs stay transformers' greedy ones (stop
    strings cut inside a run of accepted drafts, EOS among them, max_tokens, aborts, preemption,
    budgets of a few tokens), and drafts were both accepted and rejected along the way."""
    problems, stats = [], []
    for seed in range(NUM_SPECULATIVE_DRAWS):
        problems += run_draw(seed, lively, speculate=True, stats=stats)[1]
    assert not problems, f"{len(problems)} differences:\n" + "\n".join(problems[:10])
    accepted, drafted = sum(s.accepted_tokens for s in stats), sum(s.draft_tokens for s in stats)
    assert 0 < accepted < drafted


def test_fuzz_on_a_sliding_window_family(windowed_lively):
    """The draws on a Mistral whose every layer attends within WINDOW tokens, some with
    speculation: blocks behind the window go back to the pool while prefixes are cached,
    prompts chunked and sequences preempted, and outputs stay transformers' (with the window)."""
    problems = []
    for seed in range(NUM_WINDOW_DRAWS):
        problems += run_draw(seed, windowed_lively, speculate=seed % 4 == 0)[1]
    assert not problems, f"{len(problems)} differences:\n" + "\n".join(problems[:10])


def test_fuzz_on_a_mixture_of_experts_family(experts_lively):
    """The draws on a Qwen3-MoE (every token routed to 2 of 4 experts), some with speculation:
    outputs stay transformers' whatever the batch around a token."""
    problems = []
    for seed in range(NUM_EXPERT_DRAWS):
        problems += run_draw(seed, experts_lively, speculate=seed % 4 == 0)[1]
    assert not problems, f"{len(problems)} differences:\n" + "\n".join(problems[:10])


def test_fuzz_with_structured_requests(lively):
    """The draws with half the requests under a regex, a choice or an EBNF grammar (greedy or
    sampled, n up to 3, masked before sampling or checked after it), some with speculation:
    every finished structured output matches its grammar, the other requests still give transformers' outputs, every block is free and every
    grammar matcher released at the end."""
    problems, redraws = [], []
    for seed in range(NUM_STRUCTURED_DRAWS):
        problems += run_draw(seed, lively, structured=True, speculate=seed % 3 == 0, structured_stats=redraws)[1]
    assert not problems, f"{len(problems)} differences:\n" + "\n".join(problems[:10])
    # tokens the grammars refused were replaced by a later token of their race, or drawn again masked
    assert sum(c for c, _ in redraws) > 0 and sum(r for _, r in redraws) > 0, redraws
