"""pipeline_split: a post-pass program cut into pipeline stages at decoder-layer boundaries.

- Running the stages in order, each on its layers' slice of the KV cache and the previous
  stage's outputs, computes the whole program's logits and writes the same KV cache.
- Stage 0 holds the embedding and its layers, the last stage its layers, the final norm and the
  lm_head; a tied lm_head reads the embedding's weight in the last stage.
- Layers divide as evenly as they can, the earlier stages taking one more; more stages than
  layers is refused in one line, and so is a program that does not cut at layer boundaries
  (a layer reading another stage's KV cache, or the whole cache).
- A step's batch cut into micro-batches of whole sequences computes the same logits, and a
  pipeline stage sends each micro-batch on before it waits for the logits of the first.
"""

from __future__ import annotations

import pytest
import torch

from compiled_llm.engine import micro_batches, pipeline_stage
from compiled_llm.engine.build import lower
from compiled_llm.errors import CompiledLLMError
from compiled_llm.graph.batch import ScheduledSeq, pack_batch
from compiled_llm.model.sources import load_source_params, resolve_source
from compiled_llm.model.spec import kv_cache_shape
from compiled_llm.passes import default_pass_names
from compiled_llm.passes.pipeline_split import layer_ranges, split

BLOCK = 4


@pytest.fixture(scope="module")
def lowered():
    """``lowered(preset)``: the preset's post-pass program (fp32, CPU), made once."""
    cache = {}

    def get(preset: str):
        if preset not in cache:
            src = resolve_source(preset)
            params = load_source_params(src, torch.float32, torch.device("cpu"))
            cache[preset] = (src.config, lower(src.config, params, default_pass_names(), "cpu", torch.float32))
        return cache[preset]

    return get


def step_inputs(config, seed: int = 0):
    """A mixed step of three sequences (a prefill, a chunk after cached tokens, a decode) and
    a KV cache of random contents, as the runtime packs them."""
    g = torch.Generator().manual_seed(seed)
    seqs = [ScheduledSeq(torch.randint(0, config.vocab_size, (7,), generator=g).tolist(), 0, [0, 1]),
            ScheduledSeq(torch.randint(0, config.vocab_size, (5,), generator=g).tolist(), 4, [2, 3, 4]),
            ScheduledSeq(torch.randint(0, config.vocab_size, (1,), generator=g).tolist(), 5, [5, 6])]
    batch = pack_batch(seqs, BLOCK, "cpu")
    kv = torch.randn(kv_cache_shape(config, 8, BLOCK), generator=g)
    return batch, kv


def run_whole(lw, batch, kv):
    return lw.gm(*[lw.params[n] for n in lw.param_names], *batch, kv)[0]


def run_stages(lw, stages, batch, kv):
    """The stages in order, each on its slice of ``kv`` (written in place)."""
    acts = []
    for s in stages:
        local = kv[s.first_layer:s.first_layer + s.num_layers]
        acts = list(s.gm(*[lw.params[n] for n in s.param_names], *batch, local, *acts))
    return acts[0]


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen2", "tiny-gemma3"])
def test_stages_run_in_sequence_compute_the_whole_programs_logits_and_kv_cache(lowered, preset):
    config, lw = lowered(preset)
    batch, kv = step_inputs(config)
    want = run_whole(lw, batch, kv)
    for count in range(2, config.num_layers + 1):
        _, kv_stages = step_inputs(config)  # the same cache as the whole program's, before its step
        got = run_stages(lw, split(lw.gm, config.num_layers, count), batch, kv_stages)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        torch.testing.assert_close(kv_stages, kv, rtol=0, atol=0)


def test_stage_0_holds_the_embedding_and_the_last_stage_the_final_norm_and_lm_head(lowered):
    config, lw = lowered("tiny-llama")
    first, last = split(lw.gm, config.num_layers, 2)
    assert "embed.weight" in first.param_names and "lm_head.weight" not in first.param_names
    assert {"final_norm.weight", "lm_head.weight"} <= set(last.param_names) and "embed.weight" not in last.param_names
    assert all(not n.startswith("layers.1.") for n in first.param_names)
    assert all(not n.startswith("layers.0.") for n in last.param_names)
    assert (first.first_layer, first.num_layers, last.first_layer, last.num_layers) == (0, 1, 1, 1)
    # one residual stream crosses the boundary (the residual adds ride the fused ops)
    assert (first.num_inputs, first.num_outputs, last.num_inputs, last.num_outputs) == (0, 1, 1, 1)


def test_a_tied_lm_head_reads_the_embedding_weight_in_the_last_stage(lowered):
    config, lw = lowered("tiny-qwen2")  # tie_word_embeddings
    assert "lm_head.weight" not in lw.param_names
    first, last = split(lw.gm, config.num_layers, 2)
    assert "embed.weight" in first.param_names and "embed.weight" in last.param_names


@pytest.mark.parametrize("layers, stages, ranges", [
    (2, 2, [(0, 1), (1, 2)]),
    (3, 2, [(0, 2), (2, 3)]),
    (7, 3, [(0, 3), (3, 5), (5, 7)]),
    (4, 1, [(0, 4)]),
])
def test_layers_divide_as_evenly_as_they_can(layers, stages, ranges):
    assert layer_ranges(layers, stages) == ranges


def test_more_stages_than_layers_is_refused_in_one_line(lowered):
    config, lw = lowered("tiny-llama")
    with pytest.raises(CompiledLLMError, match="--pipeline-parallel-size 3 is more than the model's 2 layers") as e:
        split(lw.gm, config.num_layers, 3)
    assert "\n" not in str(e.value)


def _kv_selects(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is torch.ops.aten.select.int
            and n.args[0].op == "placeholder" and n.args[0].target == "kv_cache"]


def test_a_layer_reading_another_stages_kv_cache_is_refused(lowered):
    import copy

    config, lw = lowered("tiny-llama")
    gm = copy.deepcopy(lw.gm)
    second = _kv_selects(gm)[1]
    second.args = (second.args[0], 0, 0)  # layer 1 attends over layer 0's cache
    gm.recompile()
    with pytest.raises(CompiledLLMError, match="stage 1 \\(layers 1..1\\) reads layer 0's KV cache") as e:
        split(gm, config.num_layers, 2)
    assert str(e.value).startswith("cannot split this program into 2 pipeline stages")


def test_a_program_reading_the_whole_kv_cache_is_refused(lowered):
    import copy

    config, lw = lowered("tiny-llama")
    gm = copy.deepcopy(lw.gm)
    kv = next(n for n in gm.graph.nodes if n.op == "placeholder" and n.target == "kv_cache")
    first = _kv_selects(gm)[0]
    with gm.graph.inserting_before(first):
        whole = gm.graph.call_function(torch.ops.aten.clone.default, (kv,))
    first.args = (whole, 0, 0)
    gm.recompile()
    with pytest.raises(CompiledLLMError, match="reads the whole KV cache"):
        split(gm, config.num_layers, 2)


# ---- micro-batches ----------------------------------------------------------------------------


@pytest.mark.parametrize("qsl, parts, cuts", [
    ([0, 7, 10, 11], 2, [0, 1, 3]),  # about half the tokens each
    ([0, 1, 2, 3, 4], 2, [0, 2, 4]),  # decode: half the sequences each
    ([0, 1, 2], 4, [0, 1, 2]),  # no more groups than sequences
    ([0, 5], 2, [0, 1]),
    ([0, 1, 2, 30], 3, [0, 1, 2, 3]),  # none empty
])
def test_a_batch_cuts_into_groups_of_whole_sequences_of_about_equal_tokens(qsl, parts, cuts):
    assert micro_batches.cut_points(qsl, parts) == cuts


def test_micro_batches_compute_the_steps_logits_in_order(lowered):
    config, lw = lowered("tiny-llama")
    batch, kv = step_inputs(config)
    want = run_whole(lw, batch, kv.clone())
    parts = micro_batches.split(batch, 2)
    assert len(parts) == 2
    got = torch.cat([run_whole(lw, mb.batch, kv) for mb in parts])
    # the same arithmetic on fewer rows: only the GEMMs' blocking may round differently
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    rows = torch.tensor([0, 3, 6, 10, 12])  # token rows of the step; the second group starts at row 7
    assert [micro_batches.rows_within(rows, mb).tolist() for mb in parts] == [[0, 3, 6], [3, 5]]


def test_a_stage_queues_every_micro_batchs_send_before_waiting_for_logits(lowered, monkeypatch):
    """Stage 0 (the engine's rank) queues micro-batch 2's activations before it waits for micro-batch
    1's logits (the order of its calls; that the stages then overlap needs two devices to show)."""
    config, lw = lowered("tiny-llama")
    first, _ = split(lw.gm, config.num_layers, 2)
    events = []
    monkeypatch.setattr(pipeline_stage, "send_tensors",
                        lambda ts, dst, group=None: events.append(("send", dst, ts[0].shape[0])) or [])
    logits = [torch.zeros(1, config.vocab_size)]
    monkeypatch.setattr(pipeline_stage, "receive_tensors",
                        lambda n, src, device, group=None: events.append(("receive", src)) or logits)
    stage = pipeline_stage.PipelineStage(first.gm, list(first.param_names), stage=0, stages=2, tp_rank=0, tp_size=1,
                                         num_inputs=0, num_outputs=1, yields_chosen_rows=True)
    batch, kv = step_inputs(config)
    logits = stage(lw.params, batch, kv[:1])
    tokens = [n for _, _, n in events[:2]]
    assert events == [("send", 1, tokens[0]), ("send", 1, tokens[1]), ("receive", 1), ("receive", 1)]
    assert sum(tokens) == batch.token_ids.shape[0]
    assert logits.shape == (2, config.vocab_size)  # each micro-batch's logits, in order
