"""The reference generation loop: greedy equals transformers, sampling is seeded and truncated
as asked, and the stop rules (EOS, stop ids, stop strings, max_tokens) end generation."""

from __future__ import annotations

import pytest
import torch

from compiled_llm.model.config import load_config
from compiled_llm.errors import InvalidRequestError
from compiled_llm.model.weights import load_params
from compiled_llm.serve.reference import generate_reference
from compiled_llm.serve.sampling_params import SamplingParams
from helpers.greedy_oracle import hf_greedy, lively_checkpoint


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen2")
    hf = lively_checkpoint("qwen2", d)
    config = load_config(d)
    return config, load_params(config, d, torch.float32, "cpu"), hf


PROMPT = [3, 17, 42, 99, 5, 200, 7]


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, **kw)


def test_greedy_matches_transformers_generate(qwen2):
    config, params, hf = qwen2
    (out,) = generate_reference(config, params, [PROMPT], greedy(20, ignore_eos=True))
    assert out.token_ids == hf_greedy(hf, PROMPT, 20)
    assert len(set(out.token_ids)) >= 5  # a varied sequence, not one token repeated
    assert out.prompt_token_ids == PROMPT
    assert out.finish_reason == "length"
    assert out.prefill_s > 0 and out.decode_s > 0


def test_prompts_run_independently(qwen2):
    config, params, _ = qwen2
    other = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18]  # spans two blocks
    both = generate_reference(config, params, [PROMPT, other], greedy(6))
    alone = generate_reference(config, params, [other], greedy(6))
    assert both[1].token_ids == alone[0].token_ids
    assert both[0].token_ids != both[1].token_ids


def test_eos_stops_and_is_kept_unless_ignored(qwen2):
    config, params, _ = qwen2
    (free,) = generate_reference(config, params, [PROMPT], greedy(12, ignore_eos=True))
    eos = free.token_ids[3]
    first = free.token_ids.index(eos)
    (stopped,) = generate_reference(config, params, [PROMPT], greedy(12), eos_token_ids=[eos])
    assert stopped.token_ids == free.token_ids[: first + 1]
    assert stopped.finish_reason == "stop"
    (ignored,) = generate_reference(config, params, [PROMPT], greedy(12, ignore_eos=True), eos_token_ids=[eos])
    assert ignored.token_ids == free.token_ids and ignored.finish_reason == "length"


def test_stop_token_ids_apply_even_with_ignore_eos(qwen2):
    config, params, _ = qwen2
    (free,) = generate_reference(config, params, [PROMPT], greedy(10, ignore_eos=True))
    stop = free.token_ids[5]
    (out,) = generate_reference(config, params, [PROMPT], greedy(10, ignore_eos=True, stop_token_ids=[stop]))
    assert out.token_ids == free.token_ids[: free.token_ids.index(stop) + 1]
    assert out.finish_reason == "stop"


def test_stop_string_cuts_text(qwen2):
    config, params, _ = qwen2

    def detok(ids):  # a toy detokenizer: one letter per id
        return "".join(chr(ord("a") + i % 26) for i in ids)

    (free,) = generate_reference(config, params, [PROMPT], greedy(10), detokenize=detok)
    assert free.text == detok(free.token_ids)
    stop = free.text[4:6]
    (out,) = generate_reference(config, params, [PROMPT], greedy(10, stop=stop), detokenize=detok)
    cut = free.text.index(stop)
    assert out.finish_reason == "stop"
    assert out.text == free.text[:cut]
    assert out.token_ids == free.token_ids[: cut + len(stop)]


def test_max_tokens_is_respected(qwen2):
    config, params, _ = qwen2
    for n in (1, 2, 5):
        (out,) = generate_reference(config, params, [PROMPT], greedy(n, ignore_eos=True))
        assert len(out.token_ids) == n and out.finish_reason == "length"


def test_seeded_sampling_is_reproducible(qwen2):
    config, params, _ = qwen2
    sp = lambda seed: SamplingParams(max_tokens=16, temperature=1.0, seed=seed, ignore_eos=True)  # noqa: E731
    a = generate_reference(config, params, [PROMPT], sp(1))[0].token_ids
    b = generate_reference(config, params, [PROMPT], sp(1))[0].token_ids
    c = generate_reference(config, params, [PROMPT], sp(2))[0].token_ids
    g = generate_reference(config, params, [PROMPT], greedy(16, ignore_eos=True))[0].token_ids
    assert a == b
    assert a != c
    assert a != g


def test_top_k_one_is_greedy(qwen2):
    config, params, _ = qwen2
    g = generate_reference(config, params, [PROMPT], greedy(12, ignore_eos=True))[0].token_ids
    k1 = generate_reference(
        config, params, [PROMPT], SamplingParams(max_tokens=12, temperature=1.5, top_k=1, seed=3, ignore_eos=True)
    )[0].token_ids
    assert k1 == g


@pytest.mark.parametrize("top_k, top_p", [(3, 1.0), (-1, 0.3)])
def test_sampled_tokens_stay_inside_top_k_and_top_p(qwen2, top_k, top_p):
    """Replay each step in transformers and check the sampled token was allowed."""
    config, params, hf = qwen2
    temp = 2.0  # flatten the distribution so truncation matters
    sp = SamplingParams(max_tokens=12, temperature=temp, top_k=top_k, top_p=top_p, seed=5, ignore_eos=True)
    out = generate_reference(config, params, [PROMPT], sp)[0].token_ids
    seq = list(PROMPT)
    sizes = []
    for tok in out:
        with torch.no_grad():
            probs = (hf(torch.tensor([seq])).logits[0, -1] / temp).softmax(-1)
        order = probs.argsort(descending=True).tolist()
        if top_k > 0:
            allowed = order[:top_k]
        else:  # smallest prefix whose mass reaches top_p
            mass, allowed = 0.0, []
            for i in order:
                allowed.append(i)
                mass += probs[i].item()
                if mass >= top_p:
                    break
        sizes.append(len(allowed))
        assert tok in allowed
        seq.append(tok)
    assert max(sizes) > 1  # the check is not trivially greedy


def test_bfloat16_params_run(qwen2):
    config, params, _ = qwen2
    half = {k: (v.to(torch.bfloat16) if k != "rope.cos_sin" else v) for k, v in params.items()}
    (out,) = generate_reference(config, half, [PROMPT], greedy(4, ignore_eos=True))
    assert len(out.token_ids) == 4 and all(0 <= t < config.vocab_size for t in out.token_ids)


def test_invalid_requests_raise(qwen2):
    config, params, _ = qwen2
    ctx = config.max_position_embeddings
    with pytest.raises(InvalidRequestError, match=f"context of {ctx} tokens"):
        generate_reference(config, params, [[1] * (ctx - 3)], greedy(4))
    with pytest.raises(InvalidRequestError, match="empty"):
        generate_reference(config, params, [[]], greedy(4))
    with pytest.raises(InvalidRequestError, match="token id 256 is outside"):
        generate_reference(config, params, [[1, 256]], greedy(4))
    # the context limit is exact: prompt + max_tokens == context is allowed
    (out,) = generate_reference(config, params, [[1] * (ctx - 4)], greedy(4, ignore_eos=True))
    assert len(out.token_ids) == 4
