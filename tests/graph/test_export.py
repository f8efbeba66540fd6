"""Capture: the exported spec is a flat graph with every weight an input (no constants), dynamic
in tokens, sequences, blocks and cache size, and computes exactly what the spec computes, for
batch shapes other than the example's, batch-1 decode included."""

import pytest
import torch

from compiled_llm.graph.batch import ScheduledSeq, pack_batch
from compiled_llm.graph.export import INPUT_NAMES, PARAM_META, FlatProgram, capture, param_placeholder_names
from compiled_llm.model.spec import forward, kv_cache_shape
from compiled_llm.model.weights import random_params
from compiled_llm.model.presets import preset_config


@pytest.fixture(scope="module", params=["tiny-qwen3", "tiny-gpt2"])
def captured(request):
    config = preset_config(request.param)
    params = random_params(config, seed=3)
    return config, params, capture(config, params)


def test_weights_are_inputs_in_order_then_batch_inputs(captured):
    config, params, cap = captured
    placeholders = [n for n in cap.gm.graph.nodes if n.op == "placeholder"]
    assert [n.meta.get(PARAM_META) for n in placeholders[: len(params)]] == list(params)
    assert len(placeholders) == len(params) + len(INPUT_NAMES)
    assert param_placeholder_names(cap.gm) == list(params)
    # no weight baked into the program
    assert not [n for n in cap.gm.graph.nodes if n.op == "get_attr"]
    cllm_ops = {n.target.name() for n in cap.gm.graph.nodes if n.op == "call_function" and hasattr(n.target, "name") and n.target.name().startswith("cllm::")}
    assert "cllm::paged_attention" in cllm_ops


@pytest.mark.parametrize("shape", [
    [(0, 1)],  # one sequence, one token: sizes the export never saw
    [(0, 7), (0, 3), (0, 12)],
    [(5, 1), (9, 1), (2, 1), (30, 1)],  # decode of 4 sequences
    [(4, 6), (0, 9)],  # mixed
], ids=["single", "prefill3", "decode4", "mixed"])
def test_program_matches_spec_for_other_shapes(captured, shape):
    config, params, cap = captured
    gen = torch.Generator().manual_seed(len(shape))
    block = 8
    seqs = []
    for i, (cached, new) in enumerate(shape):
        ctx = cached + new
        blocks = list(range(i * 6, i * 6 + (ctx + block - 1) // block))
        seqs.append(ScheduledSeq(torch.randint(0, config.vocab_size, (new,), generator=gen).tolist(), cached, blocks))
    batch = pack_batch(seqs, block)
    kv = torch.randn(kv_cache_shape(config, 6 * len(shape) + 3, block), generator=gen)
    kv_ref = kv.clone()
    out = FlatProgram(cap.gm, cap.param_names)(params, *batch, kv)
    ref = forward(config, params, batch, kv_ref)
    assert out.shape == (len(shape), config.vocab_size)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-6)
    torch.testing.assert_close(kv, kv_ref, rtol=0, atol=0)  # the same cache writes


def test_the_logits_rows_variant_yields_the_spec_logits_of_the_rows_asked(captured):
    """``with_logits_rows``: the same program with the rows to select as one more input (a
    prompt's log-probabilities need every position); the captured program is left as it was."""
    from compiled_llm.graph.logits_rows import LOGITS_ROWS, with_logits_rows

    config, params, cap = captured
    before = cap.gm.code
    variant = with_logits_rows(cap.gm)
    assert cap.gm.code == before
    assert [n.target for n in variant.graph.nodes if n.op == "placeholder"][-1] == LOGITS_ROWS
    gen = torch.Generator().manual_seed(5)
    seqs = [ScheduledSeq(torch.randint(0, config.vocab_size, (n,), generator=gen).tolist(), c, [2 * i, 2 * i + 1])
            for i, (c, n) in enumerate([(3, 9), (0, 5)])]
    batch = pack_batch(seqs, 8)
    kv = torch.randn(kv_cache_shape(config, 5, 8), generator=gen)
    rows = torch.tensor([13, 0, 4, 8, 9])
    kv_ref = kv.clone()
    (out,) = variant(*[params[n] for n in cap.param_names], *batch, kv, rows)
    ref = forward(config, params, batch, kv_ref, logits_rows=rows)
    assert out.shape == (len(rows), config.vocab_size)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-6)
    last = forward(config, params, batch, kv_ref.clone())
    torch.testing.assert_close(out[[3, 0]], last, rtol=0, atol=1e-5)  # rows 8 and 13 end the segments


def test_a_program_without_its_last_rows_selection_cannot_yield_chosen_rows():
    from compiled_llm.errors import EngineError
    from compiled_llm.graph.logits_rows import with_logits_rows

    gm = torch.fx.symbolic_trace(lambda query_start_loc, h: h * 2)
    with pytest.raises(EngineError, match="0 selections of each sequence's last row"):
        with_logits_rows(gm)


def test_an_engine_whose_program_cannot_yield_chosen_rows_refuses_prompt_logprobs_at_submit(captured):
    """Checked at load (PortableProgram.yields_chosen_rows), so the request is refused up front
    instead of failing inside a step beside other requests."""
    from compiled_llm.engine.program import PortableProgram
    from compiled_llm.errors import InvalidRequestError
    from compiled_llm.serve.core.request_validator import RequestValidator
    from compiled_llm.serve.sampling_params import SamplingParams

    _, params, cap = captured
    assert PortableProgram(cap.gm, list(params)).yields_chosen_rows
    plain = torch.fx.symbolic_trace(lambda query_start_loc, h: h * 2)
    assert not PortableProgram(plain, []).yields_chosen_rows
    validator = RequestValidator(tokenizer=None, vocab_size=100, max_model_len=64, block_size=16, num_blocks=8,
                                 max_num_seqs=4, yields_chosen_rows=False)
    validator.validate([1, 2, 3], SamplingParams(max_tokens=4))
    with pytest.raises(InvalidRequestError, match="prompt_logprobs is not supported by this engine"):
        validator.validate([1, 2, 3], SamplingParams(max_tokens=4, prompt_logprobs=1))
