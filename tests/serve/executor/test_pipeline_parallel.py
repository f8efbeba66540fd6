"""Pipeline parallelism on a CPU (gloo): stages as processes, alone and as tensor-parallel groups.

- A PP=2 engine (built with the CLI, three layers split 2 + 1) generates, batched, chunked and
  preempted, exactly what transformers generates for each request alone, through ``LLM`` and
  through ``compiled-llm run``; its prompt log-probabilities are transformers' too.
- ``LLM(SOURCE, pipeline_parallel_size=2, tensor_parallel_size=2)`` builds a PP=2 x TP=2 engine
  (four processes, each stage a TP group of its own), which does the same.
- Decode steps as a GPU runs them (``static_decode``): padded, cut into micro-batches on lanes
  of fixed buffers, sent without headers (``serve/worker/pipeline_lanes.py``), every rank
  following rank 0's plan, give the same tokens: at PP=2 every decode step, at PP=2 x TP=2 those
  that fit the lanes, between eager ones with headers. ``compiled-llm run`` decodes with headers.
  Rank 0 asks every rank for its graphs and what its lanes hold: what a GPU's KV sizing holds
  back for them.
- The engine directory holds one program per stage and one weights file per (stage, TP rank),
  each with its stage's layers only; the manifest and ``inspect`` record the pipeline size and
  each stage's layers, and an engine asked for at another pipeline size is refused.
- A stage that dies fails the generation with an error naming its rank and stage, and the
  process can start a pipelined engine again.
- Bad input is one line naming the problem: more stages than layers, more ranks than the
  devices, a program that does not cut at layer boundaries.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest
import torch
from helpers.lively import greedy_continuation
from helpers.parallel_checkpoints import FAMILIES, prompts_for
from safetensors import safe_open

from compiled_llm import LLM, SamplingParams
from compiled_llm.cli.main import main
from compiled_llm.engine.build import build_engine
from compiled_llm.engine.build_config import BuildConfig
from compiled_llm.errors import CompiledLLMError, EngineError, InvalidOptionError
from compiled_llm.passes import default_pass_names, register_pass, unregister_pass
from compiled_llm.passes.base import Pass
from compiled_llm.serve import llm_engine
from compiled_llm.serve.executor import multiproc
from compiled_llm.serve.worker import pipeline_lanes
from compiled_llm.serve.worker.pipeline_lanes import PipelineLanes

LAYERS = 3  # split 2 + 1: the stages differ
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A Qwen2 checkpoint written by transformers (fp32, 3 layers, 2 KV heads) and the model."""
    root = tmp_path_factory.mktemp("pp-checkpoint")
    torch.manual_seed(0)
    hf = FAMILIES["qwen2"](layers=LAYERS).eval()
    hf.save_pretrained(root)
    return root, hf


@pytest.fixture(scope="module")
def wants(checkpoint):
    _, hf = checkpoint
    prompts = prompts_for(hf.config.vocab_size)
    out = [greedy_continuation(hf, p, MAX_TOKENS) for p in prompts]
    assert min(w.min_margin for w in out) > 1e-4, "the oracle's greedy choices must not be near ties"
    return prompts, out


@pytest.fixture(scope="module")
def pp2_engine(checkpoint, tmp_path_factory):
    """The PP=2 engine, built with the command line."""
    out = tmp_path_factory.mktemp("pp2") / "engine"
    rc = main(["build", str(checkpoint[0]), "-o", str(out), "--pipeline-parallel-size", "2", "--dtype", "float32",
               "--device", "cpu", "--quiet"])
    assert rc == 0
    return out


@pytest.fixture(scope="module")
def pp2_tp2_run(checkpoint, wants):
    """``LLM(SOURCE, pipeline_parallel_size=2, tensor_parallel_size=2)`` (built into the engine
    cache) run over the prompts with decode steps of up to 2 sequences on lanes (the larger ones
    eager, with headers): (its engine directory, generate_all's results, the lane plans run)."""
    with static_decode() as plans:
        run = generate_all(str(checkpoint[0]), wants[0], pipeline_parallel_size=2, tensor_parallel_size=2,
                           dtype="float32", max_graph_batch_size=2)
    return (*run, plans)


@pytest.fixture(scope="module")
def pp2_tp2_engine(pp2_tp2_run):
    return pp2_tp2_run[0]


def manifest(engine: Path) -> dict:
    return json.loads((engine / "manifest.json").read_text())


def weight_names(path: Path) -> set[str]:
    with safe_open(str(path), "pt") as f:
        return set(f.keys())  # noqa: SIM118 - safe_open is no mapping


@contextlib.contextmanager
def static_decode():
    """Decode steps run as on a GPU, without the graphs: padded to buckets up to
    max_graph_batch_size (which a CPU engine does not do: ``decode_buckets_up_to``), on the
    lanes, cut into as many micro-batches as they hold (a tiny model's cost would keep its steps
    whole). Rank 0 plans each step and the other ranks follow it; yields the plans rank 0 ran."""
    plans = []
    run = PipelineLanes.run
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(llm_engine, "decode_buckets_up_to", lambda config, device: config.max_graph_batch_size)
        patch.setattr(pipeline_lanes, "decode_micro_batches", lambda most, *costs: most)
        patch.setattr(PipelineLanes, "run", lambda self, plan: plans.append(plan) or run(self, plan))
        yield plans


def generate_all(model: Path | str, prompts: list[list[int]], **build) -> tuple:
    """Batched (8 at once), chunked (16-token budget) and preempted (8 blocks of 16 for 6
    requests of up to 50 tokens); also one request's prompt log-probabilities. Returns (the
    engine directory, outputs, (preemptions, all blocks free after, worker processes, decode
    steps), the log-probabilities' output, (every rank's graphs as it reports them, what each
    rank's lanes would be held back in a GPU's KV sizing without graphs))."""
    llm = LLM(str(model), device="cpu", max_num_seqs=8, max_num_batched_tokens=16, num_blocks=8, **build)
    try:
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        stats = (llm.engine.scheduler.num_preemptions, llm.engine.block_manager.num_free_blocks == llm.engine.num_blocks,
                 len(llm.engine.executor._procs), llm.engine.stats.decode_steps)
        lp = llm.generate([{"prompt_token_ids": prompts[-1]}],
                          SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1), use_tqdm=False)[0]
        ranks = llm.engine.rank_graphs(), llm.engine.lane_bytes(graphs=False)
    finally:
        llm.shutdown()
    assert all(p.poll() is not None for p in llm.engine.executor._procs)  # shutdown stops every stage
    return llm.engine.model.engine_dir, outs, stats, lp, ranks


def check_ranks_lanes(ranks, world_size: int) -> None:
    """Every rank reports its two lanes (no graphs on a CPU), each holding what the KV sizing
    would hold back for it."""
    reports, held_back = ranks
    assert len(reports) == len(held_back) == world_size
    for rank, (report, expected) in enumerate(zip(reports, held_back)):
        assert [(g.name, g.captured, g.failed) for g in report.lanes] == [("lane 0", (), False), ("lane 1", (), False)]
        assert report.lane_bytes == expected > 0, f"rank {rank}"
    assert held_back[0] > held_back[-1], "rank 0 holds the step's logits"


def check_against_transformers(checkpoint, wants, outs, lp) -> None:
    prompts, expected = wants
    for i, (o, want) in enumerate(zip(outs, expected)):
        assert o.token_ids == list(want.token_ids), f"request {i} ({len(prompts[i])}-token prompt)"
    assert len({tuple(o.token_ids) for o in outs}) == len(outs)
    prompt = prompts[-1]
    with torch.no_grad():
        logp = checkpoint[1](torch.tensor([prompt])).logits[0].float().log_softmax(-1)
    got = [lp.prompt_logprobs[p][prompt[p]].logprob for p in range(1, len(prompt))]
    assert got == pytest.approx([logp[p - 1, prompt[p]].item() for p in range(1, len(prompt))], abs=1e-4)


# ---- generation matches transformers ----------------------------------------------------------


def test_pp2_engine_decoding_on_lanes_generates_what_transformers_does(checkpoint, wants, pp2_engine):
    with static_decode() as plans:
        _, outs, (preemptions, all_free, workers, decode_steps), lp, ranks = generate_all(pp2_engine, wants[0],
                                                                                          max_graph_batch_size=4)
    check_against_transformers(checkpoint, wants, outs, lp)
    check_ranks_lanes(ranks, 2)
    assert workers == 1  # stage 1; stage 0 is this process
    assert preemptions > 0 and all_free
    assert len(plans) == decode_steps > 0, "every decode step ran on the lanes"
    assert any(len(plan) == 2 and any(rows < bucket for rows, bucket in plan) for plan in plans), \
        "some step ran as two micro-batches, padded"


def test_pp2_tp2_llm_of_a_source_generates_what_transformers_does(checkpoint, wants, pp2_tp2_run):
    _, outs, (preemptions, all_free, workers, decode_steps), lp, ranks, plans = pp2_tp2_run
    check_against_transformers(checkpoint, wants, outs, lp)
    check_ranks_lanes(ranks, 4)
    assert workers == 3  # stage 0's second TP rank, and stage 1's two
    assert preemptions > 0 and all_free
    assert 0 < len(plans) < decode_steps, "decode steps on lanes and eager ones, with headers, in one run"
    assert {len(plan) for plan in plans} == {1, 2}


def test_cli_run_of_a_pp2_engine_generates_what_transformers_does(wants, pp2_engine, capsys):
    prompts, expected = wants
    rc = main(["run", str(pp2_engine), "--prompt-ids", ",".join(map(str, prompts[1])), "--prompt-ids",
               ",".join(map(str, prompts[4])), "--max-tokens", str(MAX_TOKENS), "--ignore-eos", "--json",
               "--device", "cpu"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    records = [json.loads(line) for line in out.out.splitlines()]
    assert [r["token_ids"] for r in records] == [list(expected[1].token_ids), list(expected[4].token_ids)]


# ---- the engine directory ---------------------------------------------------------------------


def test_a_stages_kv_cache_takes_its_budget_in_blocks_of_its_own_layers(pp2_engine):
    """Stage 0 holds 2 of the 3 layers: a GiB of cache holds 3/2 the blocks one of every layer
    would, and both stages get that many (stage 1, with 1 layer, has room to spare)."""
    from compiled_llm.serve.worker import kv_cache as kvc

    gib = 0.001
    llm = LLM(str(pp2_engine), device="cpu", kv_cache_gib=gib)
    try:
        mc, dtype, bs = llm.engine.model.config, llm.engine.model.dtype, llm.engine.block_manager.block_size
        stage0 = int(gib * 2**30 // kvc.block_bytes(mc, bs, dtype, kv_layers=2))
        assert llm.engine.num_blocks == stage0 > int(gib * 2**30 // kvc.block_bytes(mc, bs, dtype))
        assert llm.engine.runner.kv_cache.shape[0] == 2  # its own two layers' caches
    finally:
        llm.shutdown()


def test_each_stage_has_its_program_and_weights_of_its_layers_only(pp2_engine, pp2_tp2_engine):
    m = manifest(pp2_engine)
    assert m["build_options"]["pipeline_parallel_size"] == 2
    stages = m["pipeline"]["stages"]
    assert [(s["first_layer"], s["num_layers"]) for s in stages] == [(0, 2), (2, 1)]
    assert [s["file"] for s in stages] == ["program.stage0.json", "program.stage1.json"]
    assert not (pp2_engine / "program.json").exists() and not (pp2_engine / "weights.safetensors").exists()
    first, last = (weight_names(pp2_engine / f"weights.stage{k}.safetensors") for k in (0, 1))
    assert {n.split(".")[1] for n in first if n.startswith("layers.")} == {"0", "1"}
    assert {n.split(".")[1] for n in last if n.startswith("layers.")} == {"2"}
    assert "embed.weight" in first and "embed.weight" not in last
    assert "lm_head.weight" in last and "lm_head.weight" not in first
    files = sorted(p.name for p in pp2_tp2_engine.glob("weights*"))
    assert files == [f"weights.stage{k}.rank{r}.safetensors" for k in (0, 1) for r in (0, 1)]
    assert manifest(pp2_tp2_engine)["build_options"]["tensor_parallel_size"] == 2


def test_inspect_shows_the_pipeline_size_and_each_stages_layers(pp2_tp2_engine, capsys):
    assert main(["inspect", str(pp2_tp2_engine)]) == 0
    assert "parallel: tensor 2 x pipeline 2 (stage 0 layers 0-1, stage 1 layers 2-2)" in capsys.readouterr().out
    assert main(["inspect", str(pp2_tp2_engine), "--json"]) == 0
    parallel = json.loads(capsys.readouterr().out)["parallel"]
    assert (parallel["tensor_parallel_size"], parallel["pipeline_parallel_size"]) == (2, 2)
    assert [s["layers"] for s in parallel["stages"]] == [[0, 1], [2, 2]]


@pytest.mark.parametrize("asked", [1, 3])
def test_an_engine_asked_for_at_another_pipeline_size_is_refused(pp2_engine, asked):
    with pytest.raises(InvalidOptionError) as e:
        LLM(str(pp2_engine), device="cpu", pipeline_parallel_size=asked)
    assert f"was built with pipeline_parallel_size 2, not {asked}" in str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("stage, key, value, message", [
    (1, "num_layers", 2, "its stages hold 4 of the model's 3 layers"),
    (1, "inputs", 5, "stage 1 takes 5 activations but stage 0 sends"),
    (1, "outputs", 2, "the last return the logits alone"),
])
def test_a_manifest_whose_stages_do_not_fit_together_is_refused_before_any_rank_waits(pp2_engine, tmp_path, stage,
                                                                                       key, value, message):
    import shutil

    copy = tmp_path / "engine"
    shutil.copytree(pp2_engine, copy)
    m = manifest(copy)
    m["pipeline"]["stages"][stage][key] = value
    (copy / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(EngineError, match=message):
        LLM(str(copy), device="cpu")


# ---- bad input ------------------------------------------------------------------------------


def test_more_stages_than_layers_is_refused_before_writing_anything(checkpoint, tmp_path, capsys):
    out = tmp_path / "engine"
    with pytest.raises(CompiledLLMError, match="--pipeline-parallel-size 4 is more than the model's 3 layers") as e:
        build_engine(str(checkpoint[0]), out, dtype="float32", device="cpu", progress=False, pipeline_parallel_size=4)
    assert "\n" not in str(e.value)
    assert list(tmp_path.iterdir()) == []
    rc = main(["build", str(checkpoint[0]), "-o", str(out), "-pp", "4", "--device", "cpu", "--quiet"])
    err = capsys.readouterr().err.strip()
    assert rc != 0 and "--pipeline-parallel-size 4 is more than the model's 3 layers" in err
    assert len(err.splitlines()) == 1


def test_more_ranks_than_one_engine_runs_is_refused_in_one_line():
    with pytest.raises(InvalidOptionError) as e:
        BuildConfig(pipeline_parallel_size=16, tensor_parallel_size=8)
    assert str(e.value) == ("pipeline_parallel_size 16 x tensor_parallel_size 8 is 128 ranks, more than the 64 one "
                            "engine runs")
    with pytest.raises(InvalidOptionError, match="pipeline_parallel_size must be an integer in 1..64, got 0"):
        BuildConfig(pipeline_parallel_size=0)


def test_more_ranks_than_visible_gpus_is_refused_naming_both_sizes(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(EngineError) as e:
        multiproc.check_devices(torch.device("cuda"), 4, tp_size=2)
    assert str(e.value).startswith("the engine runs 2 pipeline stages x 2 tensor-parallel ranks = 4 GPUs but 2 are "
                                   "visible")
    assert "\n" not in str(e.value)


def read_first_layers_cache(gm, ctx) -> int:
    """A program that does not cut at layer boundaries: every layer attends over layer 0's cache."""
    count = 0
    for node in gm.graph.nodes:
        if (node.op == "call_function" and node.target is torch.ops.aten.select.int
                and node.args[0].op == "placeholder" and node.args[0].target == "kv_cache" and node.args[2] != 0):
            node.args = (node.args[0], 0, 0)
            count += 1
    gm.recompile()
    return count


def test_a_program_that_does_not_cut_at_layer_boundaries_is_refused(checkpoint, tmp_path):
    register_pass(Pass("read_first_layers_cache", read_first_layers_cache, "wrong on purpose"))
    try:
        with pytest.raises(CompiledLLMError) as e:
            build_engine(str(checkpoint[0]), tmp_path / "engine", dtype="float32", device="cpu", progress=False,
                         pipeline_parallel_size=2, pass_names=[*default_pass_names(), "read_first_layers_cache"])
    finally:
        unregister_pass("read_first_layers_cache")
    assert str(e.value) == ("cannot split this program into 2 pipeline stages: stage 1 (layers 2..2) reads layer 0's "
                            "KV cache")
    assert not (tmp_path / "engine").exists()


def test_compare_refuses_a_pipelined_engine_in_one_line(pp2_engine):
    from compiled_llm.engine.compare import compare_engine

    with pytest.raises(CompiledLLMError, match="is a pipelined engine \\(2 stages\\), which compare does not check yet"):
        compare_engine(pp2_engine)


def test_a_stage_that_dies_fails_the_generation_naming_its_stage_and_the_process_can_start_again(pp2_engine):
    import os
    import signal

    llm = LLM(str(pp2_engine), device="cpu")
    try:
        (stage1,) = llm.engine.executor._procs
        os.kill(stage1.pid, signal.SIGKILL)
        with pytest.raises(EngineError) as e:
            llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=4), use_tqdm=False)
    finally:
        llm.shutdown()
    assert str(e.value).startswith("rank 1 (pipeline stage 1, tensor-parallel rank 0) (pid ")
    assert "\n" not in str(e.value)
    again = LLM(str(pp2_engine), device="cpu")  # the process can start a pipelined engine again
    try:
        assert len(again.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=2),
                                  use_tqdm=False)[0].token_ids) == 2
    finally:
        again.shutdown()
