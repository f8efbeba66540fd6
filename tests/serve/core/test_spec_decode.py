"""n-gram speculative decoding: proposals, verification, and the runtime with speculation on.

Speculation must never change what a greedy request returns, whatever else the step holds
(prompt chunks of other requests, preempted sequences coming back, small budgets); sampled
requests must keep the target distribution; and what verification accepted shows in the stats.
"""

from __future__ import annotations

import json
import math
import random

import pytest
import torch

from compiled_llm import LLM, SamplingParams
from compiled_llm.engine.build import build_engine
from compiled_llm.engine.loader import load_model
from compiled_llm.errors import InvalidOptionError
from compiled_llm.serve.worker.sampler import SamplingTensors, make_generator, sample
from compiled_llm.serve.core.sequence import Sequence
from compiled_llm.serve.core.spec_decode.config import SpeculativeConfig
from compiled_llm.serve.core.spec_decode.ngram_proposer import NgramIndex
from compiled_llm.serve.core.spec_decode.speculator import Speculator
from helpers.hf_checkpoints import make_checkpoint

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


# ---- the option ---------------------------------------------------------------------------------


def test_config_reads_vllm_spelling_with_its_defaults():
    cfg = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}')
    assert (cfg.num_speculative_tokens, cfg.prompt_lookup_max, cfg.prompt_lookup_min) == (4, 3, 3)
    cfg = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2})
    assert (cfg.prompt_lookup_max, cfg.prompt_lookup_min, cfg.disable_by_batch_size) == (5, 5, None)
    assert SpeculativeConfig.parse(None) is None


@pytest.mark.parametrize("value, message", [
    ("{method: ngram}", "not valid JSON"),
    ("[1, 2]", "must be a JSON object"),
    ({"method": "eagle", "num_speculative_tokens": 2}, "method must be one of ngram"),
    ({"method": "ngram"}, "needs num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be an integer >= 1"),
    ({"method": "ngram", "num_speculative_tokens": 99}, "at most 16"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "above"),
    ({"method": "ngram", "num_speculative_tokens": 2, "draft_model": "x"}, "unknown speculative_config key 'draft_model'"),
])
def test_a_bad_config_is_refused_in_one_line(value, message):
    with pytest.raises(InvalidOptionError, match=message) as e:
        SpeculativeConfig.parse(value)
    assert "\n" not in str(e.value)


def test_llm_refuses_a_bad_config_before_loading_anything(tmp_path):
    with pytest.raises(InvalidOptionError, match="num_speculative_tokens"):
        LLM(str(tmp_path / "missing"), speculative_config={"method": "ngram"})


# ---- proposals ----------------------------------------------------------------------------------


def test_ngram_proposes_what_followed_the_longest_latest_match():
    index = NgramIndex(1, 3)
    #         0  1  2  3  4  5  6  7  8  9
    tokens = [5, 6, 7, 8, 9, 6, 7, 1, 5, 6, 7]
    # "5 6 7" occurred at 0..2 followed by 8 9 6; "6 7" more recently at 5..6, but the 3-gram wins
    assert index.propose(tokens, 3) == [8, 9, 6]
    assert index.propose(tokens + [2], 3) == []  # 2 never occurred before
    assert NgramIndex(2, 2).propose([1, 2, 3, 4], 2) == []


def test_ngram_continues_a_repeat_through_its_own_proposal():
    # a loop of period 2 still proposes k tokens (an overlapping copy)
    assert NgramIndex(1, 2).propose([4, 1, 2, 1, 2], 5) == [1, 2, 1, 2, 1]


def test_ngram_index_grows_with_the_sequence():
    index, tokens = NgramIndex(2, 2), [3, 4, 5]
    assert index.propose(tokens, 2) == []
    tokens += [3, 4]
    assert index.propose(tokens, 2) == [5, 3]


def test_verification_keeps_the_drafts_up_to_the_first_mismatch():
    spec = Speculator(SpeculativeConfig.parse(NGRAM))
    drafts = [[7, 8, 9], [], [4]]
    sampled = [7, 8, 1, 2,   5,   4, 6]  # seq 0: 7, 8 accepted, 9 rejected for 1; seq 2: all + bonus
    assert spec.verify(drafts, sampled) == [[7, 8, 1], [5], [4, 6]]


# ---- sampled verification keeps the distribution ------------------------------------------------


def _chi2_critical(df: int, z: float = 3.29) -> float:
    """Wilson-Hilferty upper quantile of chi-square(df) at normal quantile z (3.29: p = 5e-4)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    expected = probs * counts.sum()
    keep = expected > 5  # the usual rule; the rare tail is pooled
    stat = ((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum().item()
    rest_c, rest_e = counts[~keep].sum(), expected[~keep].sum()
    if rest_e > 0:
        stat += ((rest_c - rest_e) ** 2 / rest_e).item()
    return stat, int(keep.sum().item()) + (1 if rest_e > 0 else 0) - 1


@pytest.mark.parametrize("top_k", [-1, 5])
def test_seeded_sampling_with_drafts_keeps_the_target_distribution(top_k):
    """Fixed logits at three positions, a draft that the target finds likely then one it finds
    unlikely: the first emitted token must follow p0 and, after an accepted first draft, the
    second must follow p1, as without speculation."""
    torch.manual_seed(0)
    V, trials, temperature = 12, 6000, 0.8
    logits = torch.randn(3, V) * 1.5
    drafts = [int(logits[0].argmax()), int(logits[1].argmin())]
    params = SamplingParams(temperature=temperature, top_k=top_k, seed=1)
    rows = logits.repeat(trials, 1)  # trial t's positions are rows 3t..3t+2
    st = SamplingTensors.from_params([params] * len(rows), V, "cpu")
    gen = make_generator(1, "cpu")
    ids = sample(rows, st, [gen] * len(rows)).tolist()
    spec = Speculator(SpeculativeConfig.parse(NGRAM))
    emitted = spec.verify([drafts] * trials, ids)

    def target(i):
        scaled = logits[i] / temperature
        if top_k > 0:
            scaled = scaled.masked_fill(scaled < scaled.topk(top_k).values[-1], float("-inf"))
        return scaled.softmax(-1)

    first = torch.bincount(torch.tensor([e[0] for e in emitted]), minlength=V).float()
    stat, df = _chi2(first, target(0))
    assert stat < _chi2_critical(df), (stat, df)
    second = torch.bincount(torch.tensor([e[1] for e in emitted if len(e) > 1]), minlength=V).float()
    assert second.sum() > 1000  # the first draft is the likeliest token, so it is often accepted
    stat, df = _chi2(second, target(1))
    assert stat < _chi2_critical(df), (stat, df)
    # the test can tell: keeping every draft would emit drafts[0] always
    always = torch.zeros(V)
    always[drafts[0]] = trials
    assert _chi2(always, target(0))[0] > _chi2_critical(df)
    # and the seeded stream repeats itself
    again = sample(rows, st, [make_generator(1, "cpu")] * len(rows)).tolist()
    assert again == ids


# ---- the runtime --------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=["qwen2", "qwen3", "llama", "gpt2"])
def family_engine(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"spec_{request.param}")
    model = make_checkpoint(request.param, root / "checkpoint")
    # a wide initialisation (lively.py's): outputs that vary, so drafts are rejected as well
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.2, generator=torch.Generator().manual_seed(p.numel()))
    model.save_pretrained(root / "checkpoint")
    build_engine(str(root / "checkpoint"), root / "engine", dtype="float32", device="cpu", progress=False)
    return load_model(str(root / "engine"), device="cpu")


def _prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    """Prompts that repeat a segment (their continuation often copies it) and random ones."""
    rng = random.Random(seed)
    out = []
    for i in range(12):
        if i % 2 == 0:
            seg = [rng.randrange(vocab) for _ in range(rng.randint(3, 9))]
            out.append((seg * 4)[: rng.randint(10, 30)])
        else:
            out.append([rng.randrange(vocab) for _ in range(rng.randint(4, 30))])
    return out


def test_speculation_leaves_greedy_outputs_identical(family_engine):
    """Mixed steps (budget 7: prompts in chunks next to decodes), preemption (a KV pool too
    small for every request at once), async scheduling on: every output equals the one
    decoding without speculation gives, and drafts were proposed, accepted and rejected."""
    prompts = [{"prompt_token_ids": p} for p in _prompts(family_engine.config.vocab_size)]
    params = [SamplingParams(max_tokens=8 + 3 * i, temperature=0.0, ignore_eos=True) for i in range(len(prompts))]
    plain = LLM.from_loaded(family_engine, max_num_seqs=6)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    llm = LLM.from_loaded(family_engine, max_num_seqs=6, max_num_batched_tokens=7, block_size=4, num_blocks=40,
                          speculative_config=json.dumps(NGRAM))
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want
    stats = llm.engine.speculator.stats
    assert stats.accepted_tokens > 0 and stats.accepted_tokens < stats.draft_tokens
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.stats.decode_steps < plain.engine.stats.decode_steps
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    bm.check_invariants()


def _seq(tokens, **params) -> Sequence:
    return Sequence("r", list(tokens), SamplingParams(**params), arrival=0)


def test_a_sequence_whose_drafts_fail_backs_off_and_retries():
    spec = Speculator(SpeculativeConfig.parse(NGRAM))
    seq = _seq([1, 2, 3, 1, 2, 3, 1, 2])  # proposes 3, 1, 2, 3
    tries = 0
    for step in range(60):
        drafts = spec.propose([seq], [4], max_rows=64)
        if drafts is not None:
            tries += 1
            spec.observe([seq], drafts, [[9]])  # the target always disagrees
        seq.token_ids.append(seq.token_ids[-3])  # the text keeps repeating: only the back-off stops it
    # without the back-off: 60 wasted verifications; with it, two misses, then retries after
    # 4, 8 and 16 tokens
    assert tries == 5, tries
    state = seq.draft_state
    assert state.backoff >= 16


def test_accepted_drafts_keep_a_sequence_drafting():
    spec = Speculator(SpeculativeConfig.parse(NGRAM))
    seq = _seq([1, 2, 3, 1, 2])
    for _ in range(10):
        drafts = spec.propose([seq], [4], max_rows=64)
        assert drafts and drafts[0]
        emitted = spec.verify(drafts, drafts[0] + [7])  # all accepted, then a bonus token
        spec.observe([seq], drafts, emitted)
        seq.token_ids.extend(drafts[0])
    assert spec.stats.acceptance_rate == 1.0
    assert spec.stats.mean_accepted_length == 5.0


def test_penalised_requests_and_large_batches_do_not_draft():
    cfg = dict(NGRAM, disable_by_batch_size=2)
    spec = Speculator(SpeculativeConfig.parse(cfg))
    repeating = [1, 2, 3, 1, 2]
    assert spec.propose([_seq(repeating, presence_penalty=0.5)], [4], 64) is None
    assert spec.propose([_seq(repeating)] * 2, [4, 4], 64) is not None
    assert spec.propose([_seq(repeating)] * 3, [4] * 3, 64) is None  # over disable_by_batch_size
    assert spec.propose([_seq(repeating)], [0], 64) is None  # no room (max_tokens, model length)
    # rows: 2 seqs and 3 rows left => 3 drafts in all
    spec = Speculator(SpeculativeConfig.parse(NGRAM), max_rows=5)
    assert sum(map(len, spec.propose([_seq(repeating), _seq(repeating)], [4, 4], 64))) == 3


def test_logprobs_with_speculation_equal_those_without(family_engine):
    prompts = [{"prompt_token_ids": p} for p in _prompts(family_engine.config.vocab_size)[:6]]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=3)
    plain = LLM.from_loaded(family_engine).generate(prompts, params, use_tqdm=False)
    llm = LLM.from_loaded(family_engine, speculative_config=NGRAM)
    spec = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.speculator.stats.accepted_tokens > 0
    for a, b in zip(plain, spec):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for pa, pb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert pa.keys() == pb.keys()
            for t in pa:
                assert pb[t].logprob == pytest.approx(pa[t].logprob, abs=1e-4)
                assert pb[t].rank == pa[t].rank


def test_run_prints_the_acceptance_and_refuses_speculation_on_the_reference_loop(tmp_path, capsys):
    from compiled_llm.cli.main import main

    config = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2})
    assert main(["run", "tiny-qwen2", "--prompt", "hello hello hello", "--max-tokens", "24",
                 "--speculative-config", config]) == 0
    out = capsys.readouterr().out
    assert "of " in out and "draft tokens accepted, mean accepted length" in out
    assert main(["run", "tiny-qwen2", "--eager", "--prompt", "hi", "--speculative-config", config]) != 0
    assert "--speculative-config needs the compiled runtime" in capsys.readouterr().err


def test_the_server_speculates_and_streams_what_plain_decoding_gives(tiny_engine, tmp_path):
    """``serve --speculative-config``: concurrent streamed completions of repeating prompts come
    back token for token as the offline engine without speculation gives them."""
    import asyncio

    import openai
    from helpers.server_fixtures import serve_process

    loaded = load_model(str(tiny_engine), device="cpu")
    prompts = _prompts(loaded.config.vocab_size, seed=3)[::2]  # the repeating ones
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    want = [o.outputs[0].text for o in LLM.from_loaded(loaded).generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]

    async def one(client, prompt) -> str:
        stream = await client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0.0,
                                                 stream=True, extra_body={"ignore_eos": True})
        return "".join([c.choices[0].text async for c in stream])

    async def all_of_them(url) -> list[str]:
        async with openai.AsyncOpenAI(base_url=url, api_key="k", max_retries=0) as client:
            return await asyncio.gather(*(one(client, p) for p in prompts))

    with serve_process(tiny_engine, "--served-model-name", "tiny", "--speculative-config", json.dumps(NGRAM),
                       log_path=tmp_path / "serve.log") as server:
        assert asyncio.run(all_of_them(server.api_url)) == want


@pytest.mark.parametrize("family_engine", ["llama"], indirect=True)
def test_the_servers_metrics_count_drafts_and_acceptance_under_vllms_names(family_engine, caplog):
    import asyncio
    import logging

    from compiled_llm.serve.engine_process.async_engine import AsyncEngine
    from compiled_llm.serve.engine_process.engine_messages import EngineInfo, EngineSnapshot
    from compiled_llm.serve.metrics import ServerMetrics

    engine = LLM.from_loaded(family_engine, speculative_config=NGRAM).engine
    caplog.set_level(logging.INFO, logger="compiled_llm.serve.metrics")
    info = EngineInfo.of(engine)
    assert info.num_speculative_tokens == NGRAM["num_speculative_tokens"]
    metrics = ServerMetrics("m", EngineSnapshot.of(engine), 0.05, info.num_speculative_tokens)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    requests = [engine.validate({"prompt_token_ids": p}, params) for p in _prompts(family_engine.config.vocab_size)]

    async def main():
        front = AsyncEngine.in_thread(engine, metrics=metrics)
        front.start()
        try:
            group = front.submit(requests)
            await group.results()
            group.release()  # read: released, so stop() need not wait 5 s for it
            await asyncio.sleep(0.2)  # the idle thread still logs the busy interval's lines
        finally:
            await front.stop()

    asyncio.run(main())
    st = engine.speculator.stats

    def value(name, **labels):
        return metrics.registry.get_sample_value("compiled_llm:" + name, {"model_name": "m", "engine": "0", **labels})

    assert 0 < st.accepted_tokens < st.draft_tokens
    assert value("spec_decode_num_drafts_total") == st.drafting_seqs
    assert value("spec_decode_num_draft_tokens_total") == st.draft_tokens
    assert value("spec_decode_num_accepted_tokens_total") == st.accepted_tokens
    by_position = [value("spec_decode_num_accepted_tokens_per_pos_total", position=str(i))
                   for i in range(NGRAM["num_speculative_tokens"])]
    assert sum(by_position) == st.accepted_tokens
    lines = [r.getMessage() for r in caplog.records if r.name == "compiled_llm.serve.metrics"]
    assert any(line.startswith("SpecDecoding metrics: Mean acceptance length") for line in lines), lines
