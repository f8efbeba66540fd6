"""The sampling features OpenAI clients send: penalties, min_p, logprobs, prompt_logprobs, n > 1
sharing the prompt's KV blocks, stop strings kept in the output, stop reasons.

Definitions are checked on fixed logits; the engine's results against transformers' logits of a
real (random-init, lively) checkpoint, on a CPU in float32."""

from __future__ import annotations

import math
import re

import pytest
import torch

from compiled_llm import LLM, SamplingParams
from compiled_llm.errors import InvalidRequestError
from compiled_llm.serve.core.detokenizer import IncrementalDetokenizer
from compiled_llm.serve.worker.sampler import SamplingTensors, apply_penalties, sample, suppress_tokens, truncate_logits
from compiled_llm.serve.sampling_params import stop_tokens

V = 12


def fixed_logits() -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    return torch.randn(3, V, generator=g) * 3


# ---- definitions, on fixed logits -----------------------------------------------------------


def test_penalties_match_their_definitions():
    logits = fixed_logits()
    outputs = [[1, 1, 4], [], [7, 2, 2, 2]]
    prompts = [[0, 4, 5], [3], [9]]
    counts = torch.zeros(3, V, dtype=torch.int32)
    mask = torch.zeros(3, V, dtype=torch.bool)
    for r in range(3):
        for t in outputs[r]:
            counts[r, t] += 1
        mask[r, prompts[r]] = True
    presence, frequency, repetition = [0.5, 0.0, -0.3], [0.25, 1.0, 0.7], [1.3, 2.0, 0.8]
    got = apply_penalties(logits, counts, mask, torch.tensor(presence), torch.tensor(frequency),
                          torch.tensor(repetition))
    for r in range(3):
        for t in range(V):
            x = float(logits[r, t])
            if t in outputs[r] or t in prompts[r]:  # repetition: every token seen
                x = x / repetition[r] if x > 0 else x * repetition[r]
            c = outputs[r].count(t)  # presence and frequency: output tokens only
            x -= frequency[r] * c + presence[r] * (c > 0)
            assert got[r, t].item() == pytest.approx(x, abs=1e-6), (r, t)


def test_min_p_keeps_exactly_the_tokens_above_its_share_of_the_best():
    logits = fixed_logits()
    min_p = torch.tensor([0.0, 0.1, 0.5])
    no_k = torch.full((3,), V)
    got = truncate_logits(logits, no_k, torch.ones(3), min_p)
    probs = logits.softmax(-1)
    for r in range(3):
        keep = probs[r] >= min_p[r] * probs[r].max()
        assert torch.equal(torch.isfinite(got[r]), keep)
        assert torch.equal(got[r][keep], logits[r][keep])


def test_sampling_never_draws_a_token_min_p_removes():
    logits = fixed_logits().repeat(200, 1)
    st = SamplingTensors.from_params([SamplingParams(temperature=1.5, min_p=0.3)] * len(logits), V, "cpu")
    ids = sample(logits, st)
    probs = (logits / 1.5).softmax(-1)  # min_p applies to the tempered distribution, as in vLLM
    allowed = probs >= 0.3 * probs.max(-1, keepdim=True).values
    assert allowed.gather(1, ids[:, None]).all()
    assert len(set(ids.tolist())) > 1  # it still samples


def test_greedy_with_a_penalty_takes_the_argmax_of_the_penalised_logits():
    logits = fixed_logits()
    best = logits.argmax(-1)
    counts = torch.zeros(3, V, dtype=torch.int32)
    counts[torch.arange(3), best] = 1  # each row's favourite was already generated
    st = SamplingTensors.from_params([SamplingParams(temperature=0.0, presence_penalty=2.0)] * 3, V, "cpu")
    ids = sample(logits, st, seen=(counts, torch.zeros(3, V, dtype=torch.bool)))
    assert torch.equal(ids, (logits - 2.0 * counts).argmax(-1))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(n=0), "n must be an integer >= 1"),
        (dict(presence_penalty=2.5), "presence_penalty must be in [-2, 2]"),
        (dict(frequency_penalty=float("nan")), "frequency_penalty must be a finite number"),
        (dict(repetition_penalty=0.0), "repetition_penalty must be > 0"),
        (dict(min_p=1.5), "min_p must be in [0, 1]"),
        (dict(logprobs=21), "logprobs must be at most 20"),
        (dict(prompt_logprobs=-2), "prompt_logprobs must be an integer >= 0"),
        # vLLM's -1 (the whole vocabulary) is past the cap it has by default too
        (dict(logprobs=-1), "logprobs -1 asks for the whole vocabulary; at most 20"),
        (dict(prompt_logprobs=-1), "prompt_logprobs -1 asks for the whole vocabulary"),
        (dict(max_tokens=4, min_tokens=5), "min_tokens must be at most max_tokens (4), got 5"),
        (dict(min_tokens=-1), "min_tokens must be an integer >= 0"),
        (dict(min_tokens=True), "min_tokens must be an integer"),
        (dict(include_stop_str_in_output="yes"), "include_stop_str_in_output must be True or False"),
    ],
)
def test_bad_sampling_values_are_refused_with_their_name(kwargs, message):
    with pytest.raises(InvalidRequestError, match=re.escape(message)):
        SamplingParams(**kwargs)


def test_held_back_tokens_are_minus_inf_and_the_rest_untouched():
    logits = fixed_logits()
    got = suppress_tokens(logits, torch.tensor([0, 0, 2]), torch.tensor([3, 7, 3]))
    expected = logits.clone()
    expected[0, 3] = expected[0, 7] = expected[2, 3] = float("-inf")
    assert torch.equal(got, expected) and torch.isfinite(logits).all()  # a copy: raw logits stay
    assert stop_tokens(SamplingParams(stop_token_ids=[9, 2]), (2, 5)) == (2, 5, 9)
    assert stop_tokens(SamplingParams(stop_token_ids=[9], ignore_eos=True), (2, 5)) == (9,)


class _CharTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + i) for i in ids)


def test_a_stop_string_is_cut_off_or_kept_and_named():
    for include, text in ((False, "ab"), (True, "abcd")):
        det = IncrementalDetokenizer(_CharTokenizer(), ["zz", "cd"], include_stop=include)
        stopped = [det.add(t) for t in (0, 1, 2, 3)]
        assert stopped == [False, False, False, True]
        assert det.text == text and det.stop_string == "cd"


# ---- the engine against transformers' logits --------------------------------------------------


@pytest.fixture(scope="module")
def lively(lively_bpe_checkpoint, lively_bpe_engine):
    _, model = lively_bpe_checkpoint
    llm = LLM(str(lively_bpe_engine), block_size=4, max_num_seqs=8, max_num_batched_tokens=64)
    return llm, model


def prompt_ids(seed: int, length: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (length,), generator=g).tolist()


@torch.no_grad()
def reference_logprobs(model, ids: list[int]) -> torch.Tensor:
    """log_softmax of transformers' logits at every position of ids [len, V]."""
    return model(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def test_logprobs_equal_the_log_softmax_of_transformers_logits(lively):
    llm, model = lively
    prompt = prompt_ids(1, 9, model.config.vocab_size)
    out = llm.generate({"prompt_token_ids": prompt},
                       SamplingParams(temperature=0, max_tokens=6, logprobs=3, ignore_eos=True))[0]
    completion = out.outputs[0]
    ref = reference_logprobs(model, prompt + completion.token_ids)
    assert len(completion.logprobs) == 6
    total = 0.0
    for i, (token, position) in enumerate(zip(completion.token_ids, completion.logprobs)):
        row = ref[len(prompt) - 1 + i]
        top = row.topk(3)
        assert set(position) == set(top.indices.tolist()) | {token}
        for t, lp in position.items():
            assert lp.logprob == pytest.approx(row[t].item(), abs=1e-4)
            assert lp.rank == 1 + int((row > row[t]).sum())
            assert lp.decoded_token == llm.tokenizer.decode([t], skip_special_tokens=False)
        assert position[token].rank == 1  # greedy
        total += position[token].logprob
    assert completion.cumulative_logprob == pytest.approx(total, abs=1e-4)


def test_prompt_logprobs_equal_transformers_at_every_prompt_position(lively):
    llm, model = lively
    prompt = prompt_ids(2, 23, model.config.vocab_size)  # several blocks, and chunks of a small budget
    out = llm.generate({"prompt_token_ids": prompt},
                       SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=2, ignore_eos=True))[0]
    ref = reference_logprobs(model, prompt)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for p in range(1, len(prompt)):
        position, row = out.prompt_logprobs[p], ref[p - 1]
        assert prompt[p] in position
        assert position[prompt[p]].logprob == pytest.approx(row[prompt[p]].item(), abs=1e-4)
        assert {t for t in position if t != prompt[p]} <= set(row.topk(2).indices.tolist())
    # the generated tokens are those of a run without prompt logprobs
    plain = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))[0]
    assert out.token_ids == plain.token_ids


def test_prompt_logprobs_of_a_long_prompt_beside_other_requests(lively):
    """A prompt longer than max_num_seqs tokens is split over steps (its logits rows count
    against max_num_seqs), next to requests that decode."""
    llm, model = lively
    long_prompt = prompt_ids(3, 40, model.config.vocab_size)
    others = [prompt_ids(10 + i, 5, model.config.vocab_size) for i in range(3)]
    params = [SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=0, ignore_eos=True)]
    params += [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)] * 3
    outs = llm.generate([{"prompt_token_ids": p} for p in [long_prompt] + others], params)
    ref = reference_logprobs(model, long_prompt)
    got = [outs[0].prompt_logprobs[p][long_prompt[p]].logprob for p in range(1, len(long_prompt))]
    want = [ref[p - 1, long_prompt[p]].item() for p in range(1, len(long_prompt))]
    assert got == pytest.approx(want, abs=1e-4)
    for p, out in zip(others, outs[1:]):
        alone = llm.generate({"prompt_token_ids": p}, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
        assert out.token_ids == alone.token_ids


class _RecordingProgram:
    """The engine's program, recording each call: (which entry, tokens, query segments, logits rows)."""

    def __init__(self, program):
        self.program, self.calls = program, []

    def __call__(self, params, batch, kv_cache):
        self.calls.append(("last_rows", len(batch.token_ids), len(batch.seq_lens), len(batch.seq_lens)))
        return self.program(params, batch, kv_cache)

    def logits_of_rows(self, params, batch, kv_cache, rows):
        self.calls.append(("chosen_rows", len(batch.token_ids), len(batch.seq_lens), len(rows)))
        return self.program.logits_of_rows(params, batch, kv_cache, rows)


def test_a_long_prompt_logprobs_prefill_runs_in_budget_chunks_while_another_request_decodes(tiny_engine):
    """A 900-token prompt_logprobs request is prefilled like any prompt, one query segment per
    step in chunks of the token budget, its logits computed in the same pass; a running request
    gets a token at every one of those steps, and steps without it compute last rows only."""
    from compiled_llm.engine.loader import load_model
    from compiled_llm.graph.batch import ScheduledSeq, pack_batch
    from compiled_llm.model.spec import forward
    from compiled_llm.serve.worker import kv_cache as kvc
    from compiled_llm.serve.engine_config import EngineConfig
    from compiled_llm.serve.llm_engine import LLMEngine

    budget = 128
    model = load_model(tiny_engine, device="cpu")
    engine = LLMEngine(model, EngineConfig(max_num_batched_tokens=budget, async_scheduling=False))
    recorder = engine.runner.program = _RecordingProgram(engine.runner.program)
    vocab = model.config.vocab_size
    other = engine.add_request({"prompt_token_ids": prompt_ids(5, 8, vocab)},
                               SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), stream=True)
    engine.step()
    prompt = prompt_ids(6, 900, vocab)
    long_id = engine.add_request({"prompt_token_ids": prompt},
                                 SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1, ignore_eos=True))
    recorder.calls.clear()
    done, steps = None, 0
    while done is None:
        outputs = {o.request_id: o for o in engine.step()}
        steps += 1
        assert other in outputs and len(outputs[other].outputs[0].delta_token_ids) == 1, f"step {steps}"
        done = outputs.get(long_id)
    chunk = budget - 1  # the decode takes one token of each step's budget
    assert steps == -(-len(prompt) // chunk) + 1  # the chunks, then the long request's second token
    prefill_calls, decode_calls = recorder.calls[:-1], recorder.calls[-1:]
    for i, (entry, tokens, segments, rows) in enumerate(prefill_calls):
        positions = min(chunk, len(prompt) - 1 - i * chunk)  # positions whose next token is a prompt token
        assert (entry, segments) == ("chosen_rows", 2), f"step {i}: {recorder.calls[i]}"
        assert tokens == 1 + min(chunk, len(prompt) - i * chunk) <= budget
        assert rows == positions + (1 if positions < chunk else 0) + 1  # + the long one's last row, the decode's row
    assert decode_calls == [("last_rows", 2, 2, 2)]

    # every position's values: the eager spec's log_softmax over the whole prompt in one pass
    assert done.prompt_logprobs[0] is None and len(done.prompt_logprobs) == len(prompt)
    source = load_model("tiny-qwen2", dtype="float32", device="cpu")
    blocks = -(-len(prompt) // 16)
    kv = kvc.allocate(source.config, blocks, 16, torch.float32, "cpu")
    batch = pack_batch([ScheduledSeq(prompt, 0, list(range(blocks)))], 16)
    with torch.inference_mode():
        logits = forward(source.config, source.params, batch, kv, logits_rows=torch.arange(len(prompt) - 1))
    want = logits.log_softmax(-1)
    for p in range(1, len(prompt)):
        position, row = done.prompt_logprobs[p], want[p - 1]
        assert position[prompt[p]].logprob == pytest.approx(row[prompt[p]].item(), abs=1e-4)
        assert position[prompt[p]].rank == 1 + int((row > row[prompt[p]]).sum())


@torch.no_grad()
def reference_penalised_greedy(model, prompt, n, presence=0.0, frequency=0.0, repetition=1.0):
    """Greedy decoding on transformers' logits with the penalties applied by their definitions."""
    ids = list(prompt)
    for _ in range(n):
        logits = model(torch.tensor([ids])).logits[0, -1].float()
        out = ids[len(prompt):]
        for t in set(ids):
            x = logits[t]
            logits[t] = x / repetition if x > 0 else x * repetition
        for t in set(out):
            logits[t] -= frequency * out.count(t) + presence
        ids.append(int(logits.argmax()))
    return ids[len(prompt):]


@pytest.mark.parametrize("penalties", [
    dict(repetition_penalty=1.8),
    dict(presence_penalty=1.5),
    dict(frequency_penalty=0.8, presence_penalty=-0.2),
])
def test_penalised_greedy_output_equals_the_definition_on_transformers_logits(lively, penalties):
    llm, model = lively
    prompts = [prompt_ids(20 + i, 4 + 3 * i, model.config.vocab_size) for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, **penalties)
    # a request without penalties in the same batch keeps its plain greedy output
    plain = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts + prompts[:1]], [params] * 3 + [plain])
    names = {"presence_penalty": "presence", "frequency_penalty": "frequency", "repetition_penalty": "repetition"}
    kw = {names[k]: v for k, v in penalties.items()}
    for p, out in zip(prompts, outs):
        assert out.token_ids == reference_penalised_greedy(model, p, 12, **kw)
    assert outs[3].token_ids == reference_penalised_greedy(model, prompts[0], 12)
    # the penalty changed something
    assert any(out.token_ids != reference_penalised_greedy(model, p, 12) for p, out in zip(prompts, outs))


def test_n_completions_share_the_prompt_blocks(lively):
    llm, model = lively
    engine = llm.engine
    bs = engine.config.block_size
    prompt = prompt_ids(30, 4 * bs + 2, model.config.vocab_size)  # 4 full blocks + 2 tokens
    rid = engine.add_request({"prompt_token_ids": prompt}, SamplingParams(n=4, temperature=1.0, seed=5, max_tokens=5, ignore_eos=True))
    seqs = engine._requests[rid].seqs
    outputs = []
    while not all(s.block_table for s in seqs) or not all(s.num_computed_tokens >= len(prompt) for s in seqs):
        outputs += engine.step()
    shared = seqs[0].block_table[:4]
    for s in seqs[1:]:
        assert s.block_table[:4] == shared  # the prompt's full blocks, held by reference
        assert s.block_table[4] != seqs[0].block_table[4]  # the partial block is each one's own
    assert [engine.block_manager.ref_counts[b] for b in shared] == [4] * 4
    used = engine.num_blocks - engine.block_manager.num_free_blocks
    assert used < 4 * len(seqs[0].block_table)
    while engine.has_unfinished_requests():
        outputs += engine.step()
    (final,) = [o for o in outputs if o.finished]
    assert [c.index for c in final.outputs] == [0, 1, 2, 3]
    assert all(len(c.token_ids) == 5 and c.finish_reason == "length" for c in final.outputs)
    assert len({tuple(c.token_ids) for c in final.outputs}) > 1  # seeds seed + i: different draws
    assert engine.block_manager.num_free_blocks == engine.num_blocks
    engine.block_manager.check_invariants()


def test_n_greedy_completions_equal_the_single_one(lively):
    llm, model = lively
    prompt = prompt_ids(31, 11, model.config.vocab_size)
    one = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=7, ignore_eos=True))[0]
    many = llm.generate({"prompt_token_ids": prompt}, SamplingParams(n=3, temperature=0, max_tokens=7, ignore_eos=True))[0]
    assert [c.token_ids for c in many.outputs] == [one.token_ids] * 3
    assert [c.text for c in many.outputs] == [one.text] * 3


def test_seeded_n_completions_are_reproducible(lively):
    llm, model = lively
    prompt = prompt_ids(32, 6, model.config.vocab_size)
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=6, ignore_eos=True)
    a = llm.generate({"prompt_token_ids": prompt}, params)[0]
    b = llm.generate({"prompt_token_ids": prompt}, params)[0]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]


def test_streamed_n_completions_carry_their_index_and_deltas(lively):
    llm, model = lively
    engine = llm.engine
    prompt = prompt_ids(33, 5, model.config.vocab_size)
    engine.add_request({"prompt_token_ids": prompt},
                       SamplingParams(n=2, temperature=1.0, seed=1, max_tokens=4, logprobs=1, ignore_eos=True),
                       stream=True)
    deltas = {0: [], 1: []}
    lps = {0: [], 1: []}
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            for c in out.outputs:
                deltas[c.index] += c.delta_token_ids
                lps[c.index] += c.delta_logprobs
            final = out
    assert final.finished
    for c in final.outputs:
        assert deltas[c.index] == c.token_ids and len(c.token_ids) == 4
        assert lps[c.index] == c.logprobs


def test_stop_token_and_stop_string_are_named_as_stop_reason(lively):
    llm, model = lively
    prompt = prompt_ids(34, 7, model.config.vocab_size)
    free = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    token = free.token_ids[3]
    first = free.token_ids.index(token)
    out = llm.generate({"prompt_token_ids": prompt},
                       SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[token], ignore_eos=True))[0]
    assert out.token_ids == free.token_ids[: first + 1]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == token
    stop = free.text[len(free.text) // 2:][:2]
    if not stop.strip():
        pytest.skip("the lively output has no usable stop string here")
    kept = llm.generate({"prompt_token_ids": prompt},
                        SamplingParams(temperature=0, max_tokens=8, stop=[stop], include_stop_str_in_output=True,
                                       ignore_eos=True))[0]
    cut = llm.generate({"prompt_token_ids": prompt},
                       SamplingParams(temperature=0, max_tokens=8, stop=[stop], ignore_eos=True))[0]
    at = free.text.index(stop)
    assert cut.text == free.text[:at] and kept.text == free.text[: at + len(stop)]
    assert kept.outputs[0].stop_reason == stop and math.isfinite(len(kept.token_ids))


def test_stop_strings_wait_for_min_tokens():
    # "cd" completes at the 4th token: with min_tokens 4 it is not looked for yet, and a later
    # one ends the text (vLLM looks only at text that tokens past min_tokens add)
    det = IncrementalDetokenizer(_CharTokenizer(), ["cd"], min_tokens=4)
    assert [det.add(t) for t in (0, 1, 2, 3, 4, 2, 3)] == [False] * 6 + [True]
    assert det.text == "abcde"
