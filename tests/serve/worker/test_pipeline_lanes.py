"""A pipeline stage's decode steps on lanes (``serve/worker/pipeline_lanes.py``), on the CPU:

- how many micro-batches a decode step is cut into: one while the stage's weights dominate what a
  micro-batch reads (each reads them again), more once the step's KV read dwarfs them;
- the plan: micro-batches of whole sequences and about equal rows, each padded to a bucket of its
  own lane; a step a lane cannot hold runs eagerly (no plan);
- a step's messages: a later stage posts every lane's receive before it runs any lane, each lane
  sends on its whole bucket, the last stage sends rank 0 only its real rows of logits, which rank 0
  receives after its own lanes, lane after lane, into consecutive rows of the step's logits;
- what the KV-cache sizing holds back for a stage's lanes (``lane_bytes``) is what they hold
  once they ran, graphs captured or not, plus the graphs' pool's copy of the largest bucket's
  outputs; asked before the stage knows its shapes, it is a one-line error.

Generation through lanes against transformers (PP=2, PP=2 x TP=2): tests/serve/executor/test_pipeline_parallel.py.
"""

from __future__ import annotations


import pytest
import torch
from helpers.fake_cuda import use_fake_cuda

from compiled_llm.errors import EngineError
from compiled_llm.serve.worker import pipeline_lanes
from compiled_llm.serve.worker.pipeline_lanes import LanePart, PipelineLanes, decode_micro_batches, lane_bytes

WEIGHT_BYTES = 4000  # the fake stage's one weight: 1,000 float32
KV_TOKEN_BYTES = 16  # its cache: 1 layer x (k, v) x 1 head x 2 dims x 4 bytes
WIDTH = 4
HIDDEN = 3


class FakeStage:
    """What lanes use of a ``PipelineStage``: stage ``stage`` of two, whose program multiplies
    what it receives by 10 (stage 0, which receives nothing, yields the token ids)."""

    def __init__(self, stage: int):
        self.stage, self.stages, self.micro_batches = stage, 2, 2
        self.param_names = ["w"]
        self.is_last = stage == 1
        self.is_driver = stage == 0
        self.sends_logits = self.is_last
        self.previous, self.next, self.last_rank = 0, 1, 1
        self.input_specs = [(torch.float32, (HIDDEN,))] if stage > 0 else None
        self.logits_spec = (torch.float32, (HIDDEN,)) if stage == 0 else None
        self.output_specs = [(torch.float32, (HIDDEN,))]

    def run_micro_batch(self, params, batch, kv_cache, inputs):
        if inputs:
            return [inputs[0] * 10]
        return [batch.token_ids.float()[:, None].expand(-1, HIDDEN).contiguous()]


def make_lanes(stage: int = 1, max_rows: int = 16) -> PipelineLanes:
    kv = torch.zeros(1, 2, 4, 4, 1, 2)  # [layers, k/v, blocks, block_size, heads, dim]
    return PipelineLanes(FakeStage(stage), {"w": torch.zeros(WEIGHT_BYTES // 4)}, kv, max_rows, WIDTH,
                         torch.device("cpu"))


class Messages:
    """``receive_into`` and ``send_static`` recorded in order; a receive fills its buffer with
    the sender's values: 1, 2, 3, ... counting over every row received so far."""

    def __init__(self):
        self.events: list[tuple] = []
        self.rows = 0

    def receive_into(self, tensors, src, group=None):
        for t in tensors:
            t.copy_(torch.arange(self.rows + 1, self.rows + 1 + t.shape[0], dtype=t.dtype)[:, None].expand_as(t))
            self.rows += t.shape[0]
            self.events.append(("receive", src, t.shape[0]))
        return []

    def send_static(self, tensors, dst, group=None):
        for t in tensors:
            self.events.append(("send", dst, t.shape[0], t[:, 0].tolist()))
        return []


@pytest.fixture
def messages(monkeypatch):
    m = Messages()
    monkeypatch.setattr(pipeline_lanes, "receive_into", m.receive_into)
    monkeypatch.setattr(pipeline_lanes, "send_static", m.send_static)
    return m


# ---- how many micro-batches ------------------------------------------------------------------


def test_a_decode_step_stays_whole_until_its_kv_read_is_twice_the_stages_weights():
    w = 1_000
    assert decode_micro_batches(2, stages=2, weight_bytes=w, kv_bytes=0) == 1
    assert decode_micro_batches(2, stages=2, weight_bytes=w, kv_bytes=1_900) == 1
    assert decode_micro_batches(2, stages=2, weight_bytes=w, kv_bytes=2_100) == 2
    assert decode_micro_batches(4, stages=2, weight_bytes=w, kv_bytes=100 * w) == 4  # at most as many as asked
    assert decode_micro_batches(1, stages=2, weight_bytes=w, kv_bytes=100 * w) == 1
    # more stages idle longer behind one micro-batch: they split sooner
    assert decode_micro_batches(4, stages=4, weight_bytes=w, kv_bytes=w) == 2


# ---- the plan ---------------------------------------------------------------------------------


def test_a_step_is_cut_into_whole_sequences_of_about_equal_rows_each_padded_to_its_lanes_bucket():
    lanes = make_lanes()
    assert [lane.inputs.max_tokens for lane in lanes.lanes] == [16, 8]  # lane j holds 16 / (j + 1) rows
    split_context = 2 * WEIGHT_BYTES // KV_TOKEN_BYTES + 1  # KV read past twice the weights: two micro-batches
    assert lanes.plan(5, None, context_tokens=10) == [LanePart(0, 5, 5, 8)]
    assert lanes.plan(5, None, split_context) == [LanePart(0, 3, 3, 4), LanePart(3, 5, 2, 2)]
    assert lanes.plan(1, None, split_context) == [LanePart(0, 1, 1, 1)]
    # a verification step: each sequence's rows stay in one micro-batch
    assert lanes.plan(4, [1, 3, 1, 2], split_context) == [LanePart(0, 2, 4, 4), LanePart(2, 4, 3, 4)]
    assert lanes.plan(16, None, split_context) == [LanePart(0, 8, 8, 8), LanePart(8, 16, 8, 8)]


def test_a_step_a_lane_cannot_hold_has_no_plan():
    lanes = make_lanes()
    assert lanes.plan(17, None, 0) is None
    assert lanes.plan(2, [1, 12], 10**6) is None  # the second micro-batch's 12 rows; lane 1 holds 8


# ---- a step's messages ----------------------------------------------------------------------


def test_the_last_stage_posts_every_receive_first_and_sends_rank_0_only_real_rows_of_logits(messages):
    lanes = make_lanes(stage=1)
    logits = lanes.run(((3, 4), (2, 2)))
    assert logits is None  # rank 0's to return
    assert messages.events == [
        ("receive", 0, 4), ("receive", 0, 2),  # whole buckets, posted before any lane runs
        ("send", 0, 3, [10.0, 20.0, 30.0]),  # lane 0: rows 1..4 received, its 3 real rows sent
        ("send", 0, 2, [50.0, 60.0]),  # lane 1: rows 5..6
    ]


def test_rank_0_sends_whole_buckets_then_receives_each_lanes_logits_into_consecutive_rows(messages):
    lanes = make_lanes(stage=0)
    for lane, tokens in zip(lanes.lanes, ([7, 8, 9, 0], [5, 6])):
        lane.inputs.np["tok"][:len(tokens)] = tokens
    logits = lanes.run(((3, 4), (2, 2)))
    assert messages.events == [
        ("send", 1, 4, [7.0, 8.0, 9.0, 0.0]),  # each lane's whole bucket, padding included
        ("send", 1, 2, [5.0, 6.0]),
        ("receive", 1, 3), ("receive", 1, 2),  # after the lanes ran, real rows only
    ]
    assert logits[:, 0].tolist() == [1.0, 2.0, 3.0, 4.0, 5.0]


def test_a_decode_step_before_the_stage_knows_its_input_shapes_is_a_one_line_error(messages):
    lanes = make_lanes(stage=1)
    lanes.stage.input_specs = None
    with pytest.raises(EngineError) as e:
        lanes.run(((1, 1),))
    assert str(e.value) == "pipeline stage 1 ran a decode step before any step told it the shapes of its inputs"


# ---- what the KV-cache sizing holds back ------------------------------------------------------


@pytest.mark.parametrize("stage", [0, 1])
def test_the_bytes_held_back_for_a_stages_lanes_are_what_they_hold_after_a_step(stage, messages, monkeypatch):
    """Stage 0 (rank 0) holds the step's logits, every lane's rows; stage 1 the activations it
    receives; each lane its step inputs and, with graphs, its outputs. The graphs' pool keeps
    what the largest bucket's captured forward wrote (16 rows of outputs) on top."""
    max_rows, width = 16, WIDTH
    eager = make_lanes(stage, max_rows)
    eager.run(((16, 16),))
    assert eager.held_bytes() == lane_bytes(eager.stage, max_rows, width, graphs=False)

    use_fake_cuda(monkeypatch)  # StepGraphs' torch.cuda calls as CPU no-ops
    graphed = make_lanes(stage, max_rows)
    graphed.prepare_graphs(pool=None)
    graphed.run(((8, 8), (8, 8)))  # lane 0 and lane 1 capture their bucket, making their outputs
    assert [sorted(lane.graphs.graphs) for lane in graphed.lanes] == [[8], [8]]
    pool_copy = 16 * HIDDEN * 4
    assert graphed.held_bytes() + pool_copy == lane_bytes(graphed.stage, max_rows, width, graphs=True)
    outputs = (16 + 8) * HIDDEN * 4
    assert graphed.held_bytes() == eager.held_bytes() + outputs


def test_sizing_lanes_before_the_stage_knows_its_shapes_is_a_one_line_error():
    stage = make_lanes(stage=0).stage
    stage.logits_spec = stage.output_specs = None
    with pytest.raises(EngineError) as e:
        lane_bytes(stage, 16, WIDTH, graphs=True)
    assert str(e.value) == ("pipeline stage 0 sized its decode lanes before any step told it the shapes of its "
                            "logits and outputs")
    stage.logits_spec = (torch.float32, (HIDDEN,))
    assert lane_bytes(stage, 16, WIDTH, graphs=False) > 0  # without graphs, the outputs' shapes are not needed
