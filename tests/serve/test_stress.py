"""Randomized stress of scheduler + block manager + runner with a fake model.

The fake model stores each token id in the KV cache at its slot, and computes the next token
from the context it reads back through the block table, so any wrong slot, block table, prefix
cache hit or recompute after preemption changes the output. Thousands of requests of random
lengths (many sharing prefixes), random aborts and a KV pool small enough to force preemption
must all end finished or aborted, with outputs equal to the history-only oracle (greedy) or to
an unpreempted run (seeded sampling), and every block free.
"""

import random

import numpy as np
import torch

from compiled_llm.model.config import ModelConfig
from compiled_llm.serve.sampling_params import SamplingParams
from compiled_llm.serve.llm_engine import EngineConfig, LLMEngine
from compiled_llm.engine.loaded_model import LoadedModel

V = 61
EOS = 0
BS = 4
MAX_LEN = 128

CONFIG = ModelConfig(
    architecture="Qwen2ForCausalLM", vocab_size=V, hidden_size=1, intermediate_size=1, num_layers=1,
    num_heads=1, num_kv_heads=1, head_dim=1, max_position_embeddings=MAX_LEN, norm_eps=1e-6,
    norm_type="rms", mlp_type="silu_glu", position_type="rope", eos_token_ids=(EOS,),
)


def next_token(history) -> int:
    h = np.asarray(history, dtype=np.int64)
    weights = np.arange(len(h), dtype=np.int64) * 31 + 7
    return int((h * weights).sum() % 1_000_003 % V)


def fake_program(params, batch, kv_cache):
    tok = batch.token_ids.numpy()
    slots = batch.slot_mapping.numpy()
    qsl, lens, tables = batch.query_start_loc.numpy(), batch.seq_lens.numpy(), batch.block_tables.numpy()
    flat = kv_cache[0, 0].reshape(-1).numpy()  # one float per slot
    keep = slots >= 0
    flat[slots[keep]] = tok[keep] + 1  # +1: 0 means "never written"
    logits = torch.zeros(len(lens), V)
    for s, n in enumerate(lens):
        if n == 0:
            continue
        blocks = tables[s, : -(-n // BS)]
        ctx = flat[(blocks[:, None] * BS + np.arange(BS)).reshape(-1)[:n]].astype(np.int64) - 1
        assert (ctx >= 0).all(), "read a slot nobody wrote"
        assert qsl[s + 1] > qsl[s]
        logits[s, next_token(ctx)] = 3.0
    return logits


def make_engine(num_blocks, max_num_seqs=16, budget=48, prefix_caching=True):
    model = LoadedModel(
        name="fake", config=CONFIG, params={}, program=fake_program, tokenizer=None,
        eos_token_ids=(EOS,), dtype=torch.float32, device=torch.device("cpu"),
    )
    cfg = EngineConfig(block_size=BS, num_blocks=num_blocks, max_num_seqs=max_num_seqs,
                       max_num_batched_tokens=budget, max_model_len=MAX_LEN, enable_prefix_caching=prefix_caching)
    return LLMEngine(model, cfg)


def oracle(prompt, params):
    out = []
    history = list(prompt)
    while True:
        t = next_token(history)
        out.append(t)
        history.append(t)
        if (t == EOS and not params.ignore_eos) or len(out) >= params.max_tokens:
            return out


def make_requests(n, seed):
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1, V) for _ in range(rng.randint(5, 20))] for _ in range(4)]
    reqs = []
    for i in range(n):
        prompt = [rng.randrange(1, V) for _ in range(rng.randint(1, 40))]
        if rng.random() < 0.5:
            prompt = rng.choice(prefixes) + prompt
        sampled = rng.random() < 0.3
        params = SamplingParams(
            max_tokens=rng.randint(1, 40),
            temperature=1.0 if sampled else 0.0,
            seed=rng.randrange(10**6) if sampled else None,
            ignore_eos=rng.random() < 0.5,
        )
        reqs.append((str(i), prompt, params))
    return reqs


def run(engine, reqs, abort_rate=0.0, seed=0, max_steps=100_000):
    """Submit requests in waves, abort some at random; returns {id: output}, aborted ids."""
    rng = random.Random(seed)
    pending = list(reqs)
    done, aborted, live = {}, set(), []
    steps = 0
    while pending or engine.has_unfinished_requests():
        for _ in range(rng.randint(0, 8)):
            if pending:
                rid, prompt, params = pending.pop(0)
                engine.add_request({"prompt_token_ids": prompt}, params, request_id=rid)
                live.append(rid)
        if live and rng.random() < abort_rate:
            victim = live.pop(rng.randrange(len(live)))
            if victim not in done:
                engine.abort_request(victim)
                aborted.add(victim)
        for out in engine.step():
            assert out.finished
            done[out.request_id] = out
            live.remove(out.request_id)
        steps += 1
        assert steps < max_steps, "engine did not finish in bounded steps"
    return done, aborted


def test_stress_preemption_aborts_prefix_cache():
    reqs = make_requests(2000, seed=1)
    small = make_engine(num_blocks=40)
    done, aborted = run(small, reqs, abort_rate=0.05, seed=2)

    # everything ended, nothing leaked
    assert set(done) | aborted == {rid for rid, _, _ in reqs}
    assert not set(done) & aborted
    assert len(aborted) > 20
    bm = small.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    bm.check_invariants()
    assert small.scheduler.num_preemptions > 100  # the pool really was too small
    assert bm.stats.hit_tokens > 0  # shared prefixes were reused

    # greedy requests equal the oracle; all requests equal an unpreempted run
    by_id = {rid: (prompt, params) for rid, prompt, params in reqs}
    for rid, out in done.items():
        prompt, params = by_id[rid]
        if params.greedy:
            assert out.token_ids == oracle(prompt, params), rid
        assert out.finish_reason == ("stop" if out.token_ids[-1] == EOS and not params.ignore_eos else "length")

    big = make_engine(num_blocks=4000, max_num_seqs=64, budget=512, prefix_caching=False)
    ref, _ = run(big, [r for r in reqs if r[0] in done], seed=3)
    assert big.scheduler.num_preemptions == 0
    mismatched = [rid for rid in done if done[rid].token_ids != ref[rid].token_ids]
    assert not mismatched, mismatched[:5]


def test_request_needing_more_blocks_than_exist_is_refused_at_submit():
    import pytest

    from compiled_llm.errors import InvalidRequestError

    engine = make_engine(num_blocks=5)  # 20 tokens
    with pytest.raises(InvalidRequestError, match="blocks"):
        engine.add_request({"prompt_token_ids": [1] * 15}, SamplingParams(max_tokens=10))
    engine.add_request({"prompt_token_ids": [1] * 10}, SamplingParams(max_tokens=10, ignore_eos=True), request_id="ok")
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert [o.request_id for o in outs] == ["ok"] and len(outs[0].token_ids) == 10
