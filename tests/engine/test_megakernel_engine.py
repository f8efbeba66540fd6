"""An engine built with ``--decode-backend megakernel`` carries its decode step's schedule: the
build writes and checks it, the loader refuses one that is unsafe or does not fit the weights, the
runtime runs its decode steps through it (on a CPU, in the interpreter) and generates what
transformers generates, ``inspect`` draws it per SM, and ``compare`` checks it and names it when it
is what breaks the numbers."""

from __future__ import annotations

import json

import pytest

from compiled_llm.cli.main import main
from compiled_llm.engine.artifact import MANIFEST, load_engine
from compiled_llm.engine.build import build_engine
from compiled_llm.engine.build_config import BuildConfig
from compiled_llm.engine.compare import compare_engine
from compiled_llm.errors import EngineError, InvalidOptionError
from compiled_llm.megakernel import interpreter
from compiled_llm.megakernel.program import MegakernelProgram
from compiled_llm.serve.llm import LLM
from compiled_llm.serve.sampling_params import SamplingParams
from helpers.greedy_oracle import hf_greedy, lively_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    d = tmp_path_factory.mktemp("llama") / "checkpoint"
    return d, lively_checkpoint("llama", d)


@pytest.fixture(scope="module")
def megakernel_engine(checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("megakernel") / "engine"
    build_engine(str(checkpoint[0]), out, dtype="float32", device="cpu", decode_backend="megakernel", progress=False)
    return out


def test_a_megakernel_engine_generates_what_transformers_generates(checkpoint, megakernel_engine):
    _, hf = checkpoint
    prompts = [[5, 9, 33, 100], [7] * 19, [200, 3, 44, 51, 60, 71, 2]]
    llm = LLM(str(megakernel_engine), device="cpu")  # the engine is built for the CPU
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    assert isinstance(llm.model.program, MegakernelProgram)
    assert llm.model.program.decode_steps >= 23  # the decode steps ran the schedule, not the per-op program
    for p, out in zip(prompts, outputs):
        assert list(out.outputs[0].token_ids) == hf_greedy(hf, p, 24)


def test_the_manifest_records_the_schedule_and_inspect_draws_it(megakernel_engine, capsys):
    manifest = json.loads((megakernel_engine / MANIFEST).read_text())
    entry = manifest["megakernel"]
    assert manifest["build_options"]["decode_backend"] == "megakernel"
    assert entry["file"] in manifest["files"] and entry["num_sms"] == 132 and entry["instructions"] > 0
    assert main(["inspect", str(megakernel_engine)]) == 0
    assert "decode backend: megakernel (" in capsys.readouterr().out
    assert main(["inspect", str(megakernel_engine), "--timeline"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"megakernel: {entry['instructions']} instructions on 132 SMs")
    assert sum(line.startswith("SM ") for line in lines) == 132


def test_inspect_timeline_of_a_per_op_engine_says_it_has_none(tiny_engine, capsys):
    assert main(["inspect", str(tiny_engine), "--timeline"]) == 2
    err = capsys.readouterr().err
    assert "runs decode steps per op: it has no megakernel schedule" in err


def _tampered(megakernel_engine, tmp_path, change) -> str:
    """A copy of the engine whose megakernel.json ``change`` edited (its checksum updated, as
    whoever writes an engine may do): the load's error."""
    import shutil

    out = shutil.copytree(megakernel_engine, tmp_path / "engine")
    path = out / "megakernel.json"
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))
    manifest = json.loads((out / MANIFEST).read_text())
    from compiled_llm.engine.artifact import sha256_file

    manifest["files"]["megakernel.json"] = sha256_file(path)
    (out / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(EngineError) as e:
        load_engine(out)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_a_schedule_with_a_wait_removed_is_refused_at_load(megakernel_engine, tmp_path):
    def drop_a_wait(data):
        ins = next(i for i in data["instructions"] if i[3])
        ins[3] = ins[3][1:]

    assert "without waiting for it" in _tampered(megakernel_engine, tmp_path, drop_a_wait)


def test_a_schedule_naming_a_weight_the_engine_lacks_is_refused_at_load(megakernel_engine, tmp_path):
    def rename(data):
        data["ops"][-2]["params"]["weight"] = "no.such.weight"

    assert "(lm_head) is not the program's lm_head" in _tampered(megakernel_engine, tmp_path, rename)


def _op(kind: str, n: int = 0):
    """The n-th op of ``kind`` in a schedule's JSON."""
    return lambda data: [o for o in data["ops"] if o["kind"] == kind][n]


@pytest.mark.parametrize("change, message", [
    (lambda d: _op("glu")(d)["attrs"].update(eps="x"), "op 5 (glu.0) is not the program's glu.0"),
    (lambda d: _op("glu")(d)["attrs"].update(activation="relu"), "is not the program's glu.0"),
    (lambda d: _op("attention")(d)["attrs"].update(sliding_window=-3), "is not the program's attention.0"),
    (lambda d: _op("attention", 1)(d)["attrs"].update(layer="0"), "has layer '0', not a layer's index"),
    (lambda d: _op("linear")(d)["params"].update(norm=_op("glu")(d)["params"]["norm"]), "is not the program's"),
    (lambda d: _op("linear")(d)["params"].update(weight=_op("linear", 2)(d)["params"]["weight"]), "is not the program's"),
    (lambda d: d.update(logits=d["tokens"]), "its buffers are not those of the program's decode step"),
    (lambda d: d.update(ops=[], instructions=[], sms=[[] for _ in d["sms"]], num_counters=0), "it has 0 ops"),
    (lambda d: d.update(num_counters=10 ** 12), "num_counters must be an integer in 0.."),
])
def test_a_schedule_that_is_not_the_programs_decode_step_is_refused_at_load(megakernel_engine, tmp_path, change,
                                                                           message):
    assert message in _tampered(megakernel_engine, tmp_path, change)


@pytest.mark.parametrize("options, flag", [
    ({"quantization": "int8"}, "--quantization"),
    ({"tensor_parallel_size": 2}, "--tensor-parallel-size"),
    ({"pipeline_parallel_size": 2}, "--pipeline-parallel-size"),
])
def test_the_megakernel_does_not_cover_quantized_or_parallel_builds_yet(options, flag):
    with pytest.raises(InvalidOptionError, match=f"does not cover {flag} yet"):
        BuildConfig(decode_backend="megakernel", **options)


def test_a_family_the_instruction_set_lacks_fails_the_build_in_one_line(tmp_path):
    from compiled_llm.megakernel.lowering import NotCovered

    with pytest.raises(NotCovered, match="does not cover node .* build it with --decode-backend per-op"):
        build_engine("tiny-gemma2", tmp_path / "engine", device="cpu", decode_backend="megakernel", progress=False)
    assert not (tmp_path / "engine").exists()


def test_compare_checks_the_schedule_and_names_it_when_it_breaks(megakernel_engine, monkeypatch):
    lines: list[str] = []
    verdict, culprit = compare_engine(megakernel_engine, num_prompts=4, max_tokens=8, out=lines.append)
    assert verdict.ok and culprit is None

    right = interpreter.RUN["glu"]

    def off_by_one_column(st, op, tile):  # a tile that computes its neighbour's columns
        right(st, op, tile)
        start, stop = interpreter.tiling.span(op, tile)
        out = st.bufs[op.outputs[0]]
        out[:, start:stop] = out[:, start:stop].roll(1, dims=1)

    monkeypatch.setitem(interpreter.RUN, "glu", off_by_one_column)
    lines.clear()
    verdict, culprit = compare_engine(megakernel_engine, num_prompts=4, max_tokens=8, out=lines.append)
    assert not verdict.ok and culprit == "megakernel"
    assert any("after fuse_qkv_rope" in line and line.endswith("ok") for line in lines)
    assert any("after megakernel" in line and line.endswith("FAIL") for line in lines)
    assert lines[-1].endswith("the megakernel's decode schedule changes the numbers")
