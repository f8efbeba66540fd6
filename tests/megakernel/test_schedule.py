"""The megakernel schedule: what a decode step lowers to, how its tiles are ordered across SMs, the
hazard check that refuses an unsafe schedule, its JSON form and its timeline."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest

from compiled_llm.engine.artifact import load_engine
from compiled_llm.errors import EngineError
from compiled_llm.megakernel import scheduler, tiling
from compiled_llm.megakernel.check import ScheduleError, check_schedule, check_weights
from compiled_llm.megakernel.lowering import lower_decode
from compiled_llm.megakernel.schedule import schedule_from_json, schedule_to_json
from compiled_llm.megakernel.timeline import flat_order, measured, spent_lines, timeline


@pytest.fixture(scope="module")
def engine(tiny_engine):
    return load_engine(tiny_engine)


def lowered_ops(engine, num_sms):
    shapes = {n: tuple(t.shape) for n, t in engine.params.items()}
    return lower_decode(engine.program.module.gm, shapes, num_sms)


def made(engine, num_sms=4):
    return scheduler.schedule(lowered_ops(engine, num_sms), scheduler.Machine(num_sms))


def test_each_layer_lowers_to_six_ops_and_the_head_to_two(engine):
    c = engine.config
    lowered = lowered_ops(engine, 3 * c.num_heads)  # SMs for three splits of each head
    ops = lowered.ops
    layer = ["qkv_rope", "attention", "attention_combine", "linear", "glu", "linear"]
    assert [o.kind for o in ops] == ["embed", *layer * c.num_layers, "lm_head", "argmax"]
    assert [o.layer for o in ops[1:7]] == [0] * 6 and [o.layer for o in ops[7:13]] == [1] * 6
    assert [o.attrs["role"] for o in ops if o.kind == "linear"] == ["o", "down"] * c.num_layers
    qkv, attention, combine, o = ops[1:5]
    assert attention.attrs["splits"] == combine.attrs["splits"] == 3
    assert (qkv.tiles, attention.tiles, combine.tiles) == (c.num_heads + 2 * c.num_kv_heads, 3 * c.num_heads,
                                                           c.num_heads)
    # each (head, split)'s m, l and acc pass through a float32 buffer; the o-projection reads the combine's output
    assert attention.outputs == combine.inputs and o.inputs[0] == combine.outputs[0]
    partials = next(b for b in lowered.buffers if b.name == attention.outputs[0])
    assert (partials.cols, partials.dtype) == (c.num_heads * 3 * (attention.attrs["head_dim"] + 2), "float32")


def test_a_heads_context_is_split_to_fill_the_sms_up_to_eight_ways():
    assert tiling.attention_splits(132, 14) == 8  # Qwen2.5-0.5B on an H200: 112 tiles, not 14
    assert tiling.attention_splits(132, 32) == 4
    assert tiling.attention_splits(132, 4) == 8  # more would split short contexts into crumbs
    assert tiling.attention_splits(8, 14) == 1 and tiling.attention_splits(1, 4) == 1


@pytest.mark.parametrize("window", [0, 7, 48])
@pytest.mark.parametrize("splits", [1, 2, 3, 8])
def test_the_splits_cut_the_visible_context_in_order_into_whole_16_key_chunks(splits, window):
    for ctx in range(0, 300):
        start = max(ctx - window, 0) if window else 0
        spans = [tiling.split_span(ctx, window, splits, c) for c in range(splits)]
        assert spans[0][0] == start and spans[-1][1] == ctx
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))  # contiguous, in split order
        chunk = -(-(-(-(ctx - start) // splits)) // 16) * 16
        for lo, hi in spans:
            assert hi - lo == chunk or hi == ctx  # a short split only at the context's end
            assert hi > lo or lo == ctx  # an empty split sits at the end


def _bumpers(s) -> dict[int, set[str]]:
    """Counter -> the labels of the instructions that bump it."""
    bumpers: dict[int, set[str]] = {}
    for i, ins in enumerate(s.instructions):
        for counter in ins.bumps:
            bumpers.setdefault(counter, set()).add(s.label(i))
    return bumpers


def test_an_attention_split_waits_only_for_its_heads_own_q_k_and_v_heads(engine):
    """Not for the layer's whole q/k/v op: a counter it waits on is bumped by no q/k/v tile but
    its head's own q head and its group's k and v heads."""
    s = made(engine, 8)
    c = engine.config
    splits = next(op for op in s.ops if op.kind == "attention").attrs["splits"]
    assert splits == 2
    group = c.num_heads // c.num_kv_heads
    bumpers = _bumpers(s)
    waits = 0
    for ins in s.instructions:
        op = s.ops[ins.op]
        if op.kind != "attention" or op.layer != 0:
            continue
        head = ins.tile // splits
        g = head // group
        own = {f"qkv_rope.0[{head}]", f"qkv_rope.0[{c.num_heads + g}]",
               f"qkv_rope.0[{c.num_heads + c.num_kv_heads + g}]"}
        for counter, _ in ins.waits:
            qkv = {b for b in bumpers[counter] if b.startswith("qkv_rope.0")}
            assert qkv <= own
            waits += bool(qkv)
    assert waits >= c.num_heads  # and each head does wait for some of its own


def test_a_heads_combine_waits_for_its_own_splits_alone_and_the_o_projection_for_every_combine(engine):
    """A combine tile's counters are bumped by its own head's split tiles and no other tile; the
    o-projection's by the layer's whole combine op."""
    c = engine.config
    s = made(engine, 8 * c.num_heads)
    check_schedule(s)
    bumpers = _bumpers(s)
    splits = next(op for op in s.ops if op.kind == "attention").attrs["splits"]
    assert splits == 8
    combines = [i for i, ins in enumerate(s.instructions) if s.ops[ins.op].kind == "attention_combine"
                and s.ops[ins.op].layer == 0]
    assert len(combines) == c.num_heads
    for i in combines:
        h = s.instructions[i].tile
        own = {f"attention.0[{h * splits + k}]" for k in range(splits)}
        waited = set().union(*(bumpers[counter] for counter, _ in s.instructions[i].waits))
        assert waited <= own and len(waited) >= splits - 1  # one may run before it on its own SM
    every_combine = {f"attention_combine.0[{h}]" for h in range(c.num_heads)}
    o_tiles = [ins for ins in s.instructions if s.ops[ins.op].attrs.get("role") == "o" and s.ops[ins.op].layer == 0]
    for ins in o_tiles:
        assert [(bumpers[counter], v) for counter, v in ins.waits] == [(every_combine, c.num_heads)]


def test_dropping_any_wait_of_a_combine_on_a_split_is_a_hazard_the_check_names(engine):
    s = made(engine, 8 * engine.config.num_heads)
    dropped = 0
    for i, ins in enumerate(s.instructions):
        if s.ops[ins.op].kind != "attention_combine":
            continue
        for w in range(len(ins.waits)):
            with pytest.raises(ScheduleError, match=re.escape(f"{s.label(i)} reads p") + ".* which attention"):
                check_schedule(s.without_wait(i, w))
            dropped += 1
    assert dropped >= engine.config.num_layers * engine.config.num_heads * 7


def test_more_splits_than_the_kernels_combine_holds_are_refused(engine):
    s = made(engine, 8)
    k = next(k for k, op in enumerate(s.ops) if op.kind == "attention_combine")
    ops = list(s.ops)
    ops[k] = dataclasses.replace(ops[k], attrs={**ops[k].attrs, "splits": tiling.MAX_SPLITS + 1})
    with pytest.raises(ScheduleError, match=f"has {tiling.MAX_SPLITS + 1} splits, more than {tiling.MAX_SPLITS}"):
        check_schedule(dataclasses.replace(s, ops=tuple(ops)))
    with pytest.raises(ValueError, match="attention splits must be 1..8"):
        lower_decode(engine.program.module.gm, {n: tuple(t.shape) for n, t in engine.params.items()}, 8, 9)


def test_partials_not_kept_in_float32_are_refused(engine):
    s = made(engine, 8)
    attention = next(op for op in s.ops if op.kind == "attention")
    partials = s.buffer(attention.outputs[0])
    buffers = tuple(dataclasses.replace(b, dtype="act") if b == partials else b for b in s.buffers)
    with pytest.raises(ScheduleError, match=f"needs {partials.name} of float32, not act"):
        check_schedule(dataclasses.replace(s, buffers=buffers))


@pytest.mark.parametrize("num_sms", [1, 2, 7, 132])
def test_a_schedule_for_any_number_of_sms_is_safe_and_uses_them(engine, num_sms):
    s = made(engine, num_sms)
    order = check_schedule(s)
    assert sorted(order) == list(range(len(s.instructions)))
    busy = sum(1 for lst in s.sms if lst)
    assert busy == min(num_sms, max(op.tiles for op in s.ops))
    if num_sms == 1:
        assert all(not ins.waits for ins in s.instructions)  # one SM's order is all the ordering there is


def test_an_sm_that_waits_for_a_tile_queued_behind_it_is_a_deadlock(engine):
    s = made(engine, 2)
    waiter = next(i for i, ins in enumerate(s.instructions) if ins.waits)
    counter = s.instructions[waiter].waits[0][0]
    producer = next(i for i, ins in enumerate(s.instructions) if counter in ins.bumps)
    sm = s.instructions[waiter].sm
    lists = [[i for i in lst if i != producer] for lst in s.sms]
    lists[sm].insert(lists[sm].index(waiter) + 1, producer)
    moved = list(s.instructions)
    moved[producer] = dataclasses.replace(moved[producer], sm=sm)
    broken = dataclasses.replace(s, instructions=tuple(moved), sms=tuple(tuple(lst) for lst in lists))
    with pytest.raises(ScheduleError, match=re.escape(f"deadlock: SM {sm} waits forever at {s.label(waiter)}")):
        check_schedule(broken)


def test_a_wait_for_fewer_than_all_of_a_counters_bumps_is_refused(engine):
    s = made(engine, 4)
    index = next(i for i, ins in enumerate(s.instructions) if ins.waits and ins.waits[0][1] > 1)
    ins = s.instructions[index]
    (counter, value), *rest = ins.waits
    weaker = dataclasses.replace(ins, waits=((counter, value - 1), *rest))
    broken = dataclasses.replace(s, instructions=s.instructions[:index] + (weaker,) + s.instructions[index + 1:])
    with pytest.raises(ScheduleError, match="does not say which tiles have ended"):
        check_schedule(broken)


def test_two_ops_writing_one_buffer_are_refused(engine):
    s = made(engine, 4)
    o_ops = [k for k, op in enumerate(s.ops) if op.attrs.get("role") == "o"]
    first, second = s.ops[o_ops[0]], s.ops[o_ops[1]]
    ops = list(s.ops)
    ops[o_ops[1]] = dataclasses.replace(second, outputs=first.outputs)
    with pytest.raises(ScheduleError, match="both write"):
        check_schedule(dataclasses.replace(s, ops=tuple(ops)))


def test_the_json_form_reads_back_the_same_schedule(engine):
    s = made(engine, 5)
    text = json.dumps(schedule_to_json(s))
    assert schedule_from_json(json.loads(text)) == s


@pytest.mark.parametrize("tamper, message", [
    (lambda d: d.update(format="other"), "not a cllm-megakernel-schedule document"),
    (lambda d: d.update(version=99), "format version '99' is not 1"),
    (lambda d: d["instructions"][3].__setitem__(2, 99), "instruction 3's sm must be an integer in 0..4"),
    (lambda d: d["instructions"][3].__setitem__(3, [[10 ** 6, 1]]), "instruction 3's counter"),
    (lambda d: d["instructions"][0].__setitem__(1, 500), "instruction 0's tile"),
    (lambda d: d["ops"][1]["attrs"].__setitem__("eps", [1]), "op 1's attrs['eps']"),
    (lambda d: d["ops"][1].__setitem__("inputs", ["nowhere"]), "op 1 names a buffer"),
    (lambda d: d["sms"].pop(), "sms lists 4 SMs, not num_sms 5"),
    (lambda d: d.update(num_counters=10 ** 12), "num_counters must be an integer in 0.."),
    (lambda d: d["instructions"][2].__setitem__(6, float("inf")), "instruction 2's end_us must be a finite number"),
    (lambda d: d["instructions"][2].__setitem__(5, 1e9), "instruction 2 ends before it starts"),
])
def test_a_malformed_schedule_is_refused_in_one_line(engine, tamper, message):
    data = schedule_to_json(made(engine, 5))
    tamper(data)
    with pytest.raises(EngineError, match=re.escape(message)) as e:
        schedule_from_json(data)
    assert "\n" not in str(e.value) and "megakernel.json" in str(e.value)


def test_weights_that_are_not_the_schedules_are_refused(engine):
    s = made(engine, 4)
    shapes = {n: tuple(t.shape) for n, t in engine.params.items()}
    check_weights(s, shapes, engine.config.num_layers)
    down = next(op for op in s.ops if op.attrs.get("role") == "down").params["weight"]
    with pytest.raises(ScheduleError, match=f"reads {down} as weight of shape"):
        check_weights(s, {**shapes, down: (3, 3)}, engine.config.num_layers)
    with pytest.raises(ScheduleError, match="of a 1-layer cache"):
        check_weights(s, shapes, 1)


def test_the_timeline_draws_each_sms_tiles_in_time(engine):
    s = made(engine, 3)
    text = timeline(s, width=60).splitlines()
    rows = [line for line in text if line.startswith("SM ")]
    assert len(rows) == 3 and all(len(r.split("|")[1]) == 60 for r in rows)
    drawn = "".join(r.split("|")[1] for r in rows)
    assert set("EQACOGDLS") <= set(drawn)
    assert text[0].startswith(f"megakernel: {len(s.instructions)} instructions on 3 SMs")
    first = rows[0].split("|")[1]
    assert first.index("E") < first.index("Q") < first.rindex("L")  # the step's order, left to right


def test_a_timed_step_becomes_a_measured_timeline_and_a_split_of_the_sms_time(engine):
    """Stamps as the kernel's TIMED form writes them (wait, run, end ns per slot of its flat
    record array): each instruction waits 1 us and runs 2 us after its SM's previous one."""
    s = made(engine, 3)
    slots, clock = [], {}
    for index in flat_order(s):
        sm = s.instructions[index].sm
        t = clock.get(sm, 10_000)
        slots.append((t, t + 1000, t + 3000))
        clock[sm] = t + 3000
    timed, spent = measured(s, slots)
    assert spent["wait"] == pytest.approx(len(s.instructions) * 1.0)
    assert sum(us for k, us in spent.items() if k.startswith("run:")) == pytest.approx(len(s.instructions) * 2.0)
    assert spent["step"] == pytest.approx(3.0 * max(len(lst) for lst in s.sms))
    first = s.sms[0][0]
    assert (timed.instructions[first].start_us, timed.instructions[first].end_us) == (1.0, 3.0)
    text = timeline(timed, width=40, source="measured")
    assert text.startswith(f"megakernel: {len(s.instructions)} instructions on 3 SMs") and "measured step" in text
    lines = spent_lines(spent, 3)
    assert lines[0].startswith(f"step {spent['step']:.1f} us on 3 SMs") and any("wait" in line for line in lines)
    with pytest.raises(ValueError, match="out of order"):
        measured(s, [(3, 2, 1)] + slots[1:])
    with pytest.raises(ValueError, match="stamps for a schedule of"):
        measured(s, slots[1:])


def test_each_instruction_prefetches_the_weight_rows_its_tile_reads_and_no_more_than_the_cap(engine, monkeypatch):
    """The kernel asks L2 for an instruction's weights before it waits (encoding.weight_ranges):
    a column tile's rows, glu's gate rows and the same rows of its up half, a q/k/v tile its
    head's rows; nothing for attention, its combine, embed and argmax; at most PREFETCH_BYTES, the first rows."""
    from compiled_llm.megakernel import encoding, tiling

    s = made(engine)
    params = engine.params
    for index, ins in enumerate(s.instructions):
        op = s.ops[ins.op]
        ranges = encoding.weight_ranges(s, index, params)
        if op.kind in ("attention", "attention_combine", "embed", "argmax"):
            assert ranges == []
            continue
        w = params[op.params["weight"]]
        row = w.shape[1] * w.element_size()
        if op.kind == "qkv_rope":
            nh, nkv, hd = tiling.heads(op)
            part, h = tiling.qkv_part(op, ins.tile)
            rows = [({"q": 0, "k": nh, "v": nh + nkv}[part] + h) * hd]
            count = hd
        else:
            c0, c1 = tiling.span(op, ins.tile)
            rows = [c0, w.shape[0] // 2 + c0] if op.kind == "glu" else [c0]
            count = c1 - c0
        assert ranges == [(w.data_ptr() + r * row, count * row) for r in rows], (op.kind, ins.tile)

    monkeypatch.setattr(encoding, "PREFETCH_BYTES", 4 * 1024)
    for index, ins in enumerate(s.instructions):
        ranges = encoding.weight_ranges(s, index, params)
        assert sum(n for _, n in ranges) <= 4 * 1024
        if s.ops[ins.op].kind == "lm_head":  # vocab rows of 64 fp32: 16 rows fit
            assert [n for _, n in ranges] == [16 * 64 * 4]


def test_the_encoded_prefetch_table_is_each_records_ranges_aligned_and_inside_its_weight(engine):
    """encode() lays the ranges out in the records' order (SM by SM), every address and size
    a multiple of 16 bytes (what cp.async.bulk requires) and inside the weight it names."""
    from compiled_llm.megakernel import encoding
    from compiled_llm.megakernel.timeline import flat_order

    s = made(engine)
    buffers = encoding.activation_buffers(s, engine.dtype, "cpu")
    enc = encoding.encode(s, engine.params, buffers, engine.dtype, "cpu")
    assert enc.aligned  # the tiny engine's weights are: the table is not all zeros
    table = enc.prefetch.tolist()
    assert len(table) == len(s.instructions)
    spans = [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in engine.params.values()]
    for slot, index in enumerate(flat_order(s)):
        want = encoding.weight_ranges(s, index, engine.params)
        assert [tuple(table[slot][:2]), tuple(table[slot][2:])][:len(want)] == want
        assert table[slot][2 * len(want):] == [0, 0] * (2 - len(want))
        for addr, size in want:
            assert addr % 16 == 0 and size % 16 == 0 and size > 0
            assert any(lo <= addr and addr + size <= hi for lo, hi in spans)
