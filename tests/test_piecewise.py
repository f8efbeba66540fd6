"""The Inductor backend compiles only the pure pieces between KV-cache writes: the split program
computes what the unsplit one computes, writes the same cache, and each cut holds exactly one
paged-attention op."""

import torch

from compiled_llm.build import lower
from compiled_llm.graph.batch import ScheduledSeq, pack_batch
from compiled_llm.graph.export import FlatProgram
from compiled_llm.graph.spec import kv_cache_shape
from compiled_llm.passes import default_pass_names
from compiled_llm.piecewise import compile_pieces, split_at_cache_writes
from compiled_llm.sources import load_source_params, resolve_source


def _lowered():
    src = resolve_source("tiny-llama")
    params = load_source_params(src, torch.float32, "cpu")
    return src.config, lower(src.config, params, default_pass_names(), "cpu", torch.float32)


def _run(program, lowered, config, steps):
    kv = torch.zeros(kv_cache_shape(config, 16, 16))
    outs = [program(lowered.params, *pack_batch(step, 16), kv) for step in steps]
    return outs, kv


STEPS = [
    [ScheduledSeq([5, 6, 7, 8, 9], 0, [3, 1]), ScheduledSeq([10, 11], 0, [7])],  # prefill
    [ScheduledSeq([12], 5, [3, 1]), ScheduledSeq([13], 2, [7])],  # decode
]


def test_each_cut_holds_one_cache_write_and_the_rest_is_pure():
    config, lowered = _lowered()
    split, cut = split_at_cache_writes(lowered.gm)
    assert len(cut) == config.num_layers
    for name, child in split.named_children():
        writes = [n for n in child.graph.nodes if n.op == "call_function" and "paged_attention" in str(n.target)]
        assert len(writes) == (1 if name in cut else 0), name


def test_split_program_matches_unsplit_logits_and_cache():
    config, lowered = _lowered()
    whole = FlatProgram(lowered.gm, lowered.param_names)
    pieces = FlatProgram(compile_pieces(lowered.gm, lambda m: m), lowered.param_names)
    ref, ref_kv = _run(whole, lowered, config, STEPS)
    out, kv = _run(pieces, lowered, config, STEPS)
    assert ref_kv.abs().sum() > 0
    torch.testing.assert_close(kv, ref_kv, rtol=0, atol=0)
    for a, b in zip(out, ref):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_inductor_pieces_match_portable_on_cpu():
    config, lowered = _lowered()
    whole = FlatProgram(lowered.gm, lowered.param_names)
    compiled = FlatProgram(
        compile_pieces(lowered.gm, lambda m: torch.compile(m, fullgraph=True, dynamic=True)), lowered.param_names
    )
    ref, ref_kv = _run(whole, lowered, config, STEPS)
    out, kv = _run(compiled, lowered, config, STEPS)
    torch.testing.assert_close(kv, ref_kv, rtol=1e-5, atol=1e-5)
    for a, b in zip(out, ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
