"""Capture: the exported spec is a flat graph with every weight an input (no constants), dynamic
in tokens, sequences, blocks and cache size, and computes exactly what the spec computes, for
batch shapes other than the example's, batch-1 decode included."""

import pytest
import torch

from compiled_llm.graph.batch import ScheduledSeq, pack_batch
from compiled_llm.graph.export import INPUT_NAMES, PARAM_META, FlatProgram, capture, param_placeholder_names
from compiled_llm.graph.spec import forward, kv_cache_shape
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
