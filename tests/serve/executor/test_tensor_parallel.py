"""Tensor parallelism on a CPU (gloo, two ranks: this process and one worker process).

- A shape that does not split over N ranks is refused up front, in one line, before a build
  writes anything.
- A TP=2 engine of every family (KV heads split or replicated, a vocabulary padded to split)
  generates, batched, chunked and preempted, exactly what transformers generates for each
  request alone.
- The engine directory holds one weights file per rank, each with its rank's heads, columns
  and vocabulary rows, and the program carries one all-reduce per row-parallel linear (o and
  down/proj; each adds the residual) plus one after the embedding, and one all-gather of the
  logits.
- The executor runs a function on every other rank (``run_on_ranks``), with that rank's model
  and a state the rank keeps between calls, and brings back each rank's result; a function that
  meets rank 0 in a collective is sent without waiting; one that raises fails the ranks, naming
  the rank.
- ``compare`` checks a TP engine over both ranks, and names a wrong pass planted after ``shard``
  while every rank rebuilds its own program with each prefix of the pass list.
- A rank that dies fails the generation running and every later one with an ``EngineError``
  naming it, and the process can start a tensor-parallel engine again; a killed rank 0 takes
  its worker with it. Shutdown drops the CUDA graphs before the group ends.
- An engine directory is sharded at build time: asking it (``LLM``, ``bench``) for another size
  is refused.
"""

from __future__ import annotations

import dataclasses
import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import transformers
from helpers.rank_kill import kill_mid_generate
from helpers.hf_checkpoints import make_checkpoint
from helpers.lively import greedy_continuation
from helpers.parallel_checkpoints import FAMILIES, HEAD_DIM, HEADS, LAYERS, prompts_for
from helpers.rank_processes import run_ranks
from helpers.wrong_passes import drop_q_bias
from safetensors import safe_open

from compiled_llm import LLM, SamplingParams
from compiled_llm.engine.artifact import load_engine
from compiled_llm.engine.build import build_engine
from compiled_llm.engine.compare import compare_engine
from compiled_llm.errors import CompiledLLMError, EngineError, InvalidOptionError
from compiled_llm.model import sharding
from compiled_llm.model.config import ModelConfig
from compiled_llm.passes import default_pass_names, register_pass, unregister_pass
from compiled_llm.passes.base import Pass
from compiled_llm.serve.executor.multiproc import start_ranks

RANKS = 2


# ---- checkpoints and engines ------------------------------------------------------------------


@dataclasses.dataclass
class Built:
    checkpoint: Path
    hf: transformers.PreTrainedModel
    engine: Path

    @property
    def vocab_size(self) -> int:
        return self.hf.config.vocab_size


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """``built(family)``: a transformers checkpoint of ``family`` (fp32) and its TP=2 CPU engine,
    made on first use and shared by the module."""
    cache: dict[str, Built] = {}

    def get(family: str) -> Built:
        if family not in cache:
            root = tmp_path_factory.mktemp(f"tp-{family}")
            torch.manual_seed(0)
            hf = FAMILIES[family]().eval()
            hf.save_pretrained(root / "checkpoint")
            build_engine(str(root / "checkpoint"), root / "engine", dtype="float32", device="cpu",
                         progress=False, tensor_parallel_size=RANKS)
            cache[family] = Built(root / "checkpoint", hf, root / "engine")
        return cache[family]

    return get


@pytest.fixture(scope="module")
def qwen2(built) -> Built:
    return built("qwen2")


def manifest(engine: Path) -> dict:
    return json.loads((engine / "manifest.json").read_text())


def rank_weights(engine: Path, rank: int) -> dict[str, torch.Tensor]:
    with safe_open(str(engine / f"weights.rank{rank}.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open is no mapping


def worker_children() -> set[int]:
    """Pids of this process's living tensor-parallel worker processes."""
    pids = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if fields[0] != "Z" and int(fields[1]) == os.getpid() and b"compiled_llm.serve.executor" in cmdline:
            pids.add(int(entry.name))
    return pids


def is_running(pid: int) -> bool:
    """False once ``pid`` has exited (gone, or a zombie nobody has reaped yet)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


# ---- shapes that do not split -----------------------------------------------------------------


def config(heads=4, kv_heads=2, intermediate=128, vocab=256) -> ModelConfig:
    return ModelConfig(
        architecture="Qwen2ForCausalLM", vocab_size=vocab, hidden_size=64, intermediate_size=intermediate,
        num_layers=LAYERS, num_heads=heads, num_kv_heads=kv_heads, head_dim=64 // heads,
        max_position_embeddings=512, norm_eps=1e-6, norm_type="rms", mlp_type="silu_glu", position_type="rope",
    )


@pytest.mark.parametrize("cfg, size, says", [
    (config(heads=4, kv_heads=2), 3, "4 attention heads over 3 ranks"),
    (config(heads=6, kv_heads=3), 2, "3 KV heads over 2 ranks"),  # neither divides the other
    (config(heads=12, kv_heads=6), 4, "6 KV heads over 4 ranks"),  # the q heads split, the KV heads do not
    (config(heads=4, kv_heads=2, intermediate=130), 4, "MLP's 130 columns over 4 ranks"),
    (config(), 0, "tensor_parallel_size must be an integer >= 1"),
])
def test_a_shape_that_does_not_split_is_refused_in_one_line(cfg, size, says):
    with pytest.raises(CompiledLLMError) as e:
        sharding.plan(cfg, size)
    assert says in str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("heads, kv_heads, size, local_kv, kv_starts", [
    (4, 2, 2, 1, [0, 1]),  # one KV head per rank
    (4, 1, 2, 1, [0, 0]),  # fewer KV heads than ranks: each rank holds the one its q heads read
    (8, 2, 4, 1, [0, 0, 1, 1]),
    (8, 8, 4, 2, [0, 2, 4, 6]),
])
def test_a_rank_computes_its_heads_and_columns_of_the_whole_hidden_size(heads, kv_heads, size, local_kv, kv_starts):
    whole = config(heads=heads, kv_heads=kv_heads, vocab=257)
    p = sharding.plan(whole, size)
    assert [p.kv_head_start(r) for r in range(size)] == kv_starts
    assert p.vocab_per_rank * size >= 257 and [p.vocab_start(r) for r in range(size)] == [r * p.vocab_per_rank for r in range(size)]
    local = sharding.local_config(whole, size)
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size) == (heads // size, local_kv, 128 // size)
    assert (local.hidden_size, local.vocab_size, local.head_dim) == (whole.hidden_size, 257, whole.head_dim)


def test_build_refuses_a_checkpoint_that_does_not_split_before_writing_anything(qwen2, tmp_path):
    out = tmp_path / "engine"
    with pytest.raises(CompiledLLMError, match="4 attention heads over 3 ranks"):
        build_engine(str(qwen2.checkpoint), out, dtype="float32", device="cpu", progress=False, tensor_parallel_size=3)
    assert not out.exists()
    assert list(tmp_path.iterdir()) == []  # no work directory left beside it either


# ---- generation matches transformers ----------------------------------------------------------

MAX_TOKENS = 12


@pytest.mark.parametrize("family", list(FAMILIES))
def test_tp2_engine_generates_what_transformers_does(built, family):
    """Batched, chunked (16-token budget) and preempted (8 blocks of 16 for 6 requests of up to
    52 tokens): every request's greedy output is transformers' for it alone."""
    b = built(family)
    prompts = prompts_for(b.vocab_size)
    wants = [greedy_continuation(b.hf, p, MAX_TOKENS) for p in prompts]
    assert min(w.min_margin for w in wants) > 1e-4, "the oracle's greedy choices must not be near ties"
    llm = LLM(str(b.engine), device="cpu", max_num_seqs=8, max_num_batched_tokens=16, num_blocks=8)
    try:
        assert llm.engine.executor is not None and len(llm.engine.executor._procs) == RANKS - 1
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        for i, (o, want) in enumerate(zip(outs, wants)):
            assert o.token_ids == list(want.token_ids), f"request {i} ({len(prompts[i])}-token prompt)"
            assert o.finish_reason == "length"
        assert len({t for o in outs for t in o.token_ids}) > 20  # outputs vary
        assert len({tuple(o.token_ids) for o in outs}) == len(outs)
        assert llm.engine.scheduler.num_preemptions > 0
        assert llm.engine.block_manager.num_free_blocks == llm.engine.num_blocks
    finally:
        llm.shutdown()
    assert all(p.poll() is not None for p in llm.engine.executor._procs)  # shutdown stops the worker


def test_tp2_prompt_logprobs_equal_transformers_at_every_prompt_position(qwen2):
    """Both ranks run the prefill chunks that yield every prompt position's logits (each
    gathers its vocabulary shard in the same pass), beside a request that decodes."""
    prompt = prompts_for(qwen2.vocab_size)[-1]
    llm = LLM(str(qwen2.engine), device="cpu", max_num_seqs=8, max_num_batched_tokens=16)
    try:
        params = [SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=1, ignore_eos=True),
                  SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)]
        out = llm.generate([{"prompt_token_ids": prompt}, {"prompt_token_ids": prompt[:5]}], params, use_tqdm=False)
    finally:
        llm.shutdown()
    with torch.no_grad():
        want = qwen2.hf(torch.tensor([prompt])).logits[0].float().log_softmax(-1)
    got = [out[0].prompt_logprobs[p][prompt[p]].logprob for p in range(1, len(prompt))]
    assert got == pytest.approx([want[p - 1, prompt[p]].item() for p in range(1, len(prompt))], abs=1e-4)
    assert out[1].token_ids == list(greedy_continuation(qwen2.hf, prompt[:5], MAX_TOKENS).token_ids)


# ---- the engine directory ---------------------------------------------------------------------


@pytest.mark.parametrize("family", list(FAMILIES))
def test_engine_has_one_weights_file_per_rank_and_its_collectives(built, family):
    engine = built(family).engine
    m = manifest(engine)
    assert m["build_options"]["tensor_parallel_size"] == RANKS
    assert not (engine / "weights.safetensors").exists()
    for r in range(RANKS):
        assert (engine / f"weights.rank{r}.safetensors").is_file()
        assert f"weights.rank{r}.safetensors" in m["files"]
    ops = m["ops_after"]
    assert ops["cllm::all_reduce"] == 2 * LAYERS + 1  # after o and down/proj in every layer, after the embedding
    assert ops["cllm::all_gather_columns"] == 1  # the logits
    assert ops["cllm::vocab_shard_embedding"] == 1
    assert ops["cllm::linear"] == LAYERS  # the attention output's row-parallel linear, on the engine's GEMV
    assert "aten::add.Tensor" not in ops  # every residual add rides its all-reduce
    assert m["model_config"]["num_heads"] == HEADS  # the manifest describes the whole model


def _q_k_v_o(hf, layer: int):
    a = hf.model.layers[layer].self_attn
    return a.q_proj.weight, a.k_proj.weight, a.v_proj.weight, a.o_proj.weight


@pytest.mark.parametrize("family, kv_rows", [
    ("qwen2", lambda r: slice(r * HEAD_DIM, (r + 1) * HEAD_DIM)),  # KV head r
    ("llama", lambda r: slice(0, HEAD_DIM)),  # the one KV head, on both ranks
])
def test_each_rank_file_holds_its_heads_and_columns(built, family, kv_rows):
    b = built(family)
    half_q = HEADS // RANKS * HEAD_DIM
    for layer in range(LAYERS):
        q, k, v, o = _q_k_v_o(b.hf, layer)
        mlp = b.hf.model.layers[layer].mlp
        for r in range(RANKS):
            w = rank_weights(b.engine, r)
            cols = slice(r * half_q, (r + 1) * half_q)
            qkv = w[f"layers.{layer}.qkv.weight"]
            assert qkv.shape == (half_q + 2 * HEAD_DIM, 64)  # half of the q rows, one KV head
            torch.testing.assert_close(qkv, torch.cat([q[cols], k[kv_rows(r)], v[kv_rows(r)]]), rtol=0, atol=0)
            torch.testing.assert_close(w[f"layers.{layer}.o.weight"], o[:, cols], rtol=0, atol=0)
            torch.testing.assert_close(w[f"layers.{layer}.down.weight"], mlp.down_proj.weight[:, r * 64:(r + 1) * 64],
                                       rtol=0, atol=0)
            assert w[f"layers.{layer}.gate_up.weight"].shape == (2 * 64, 64)
    for r in range(RANKS):
        w = rank_weights(b.engine, r)
        torch.testing.assert_close(w["embed.weight"], b.hf.model.embed_tokens.weight[r * 128:(r + 1) * 128], rtol=0, atol=0)
        torch.testing.assert_close(w["lm_head.weight"], b.hf.lm_head.weight[r * 128:(r + 1) * 128], rtol=0, atol=0)


def test_gpt2_vocabulary_is_padded_with_zero_rows_to_split_evenly(built):
    b = built("gpt2")
    wte = b.hf.transformer.wte.weight  # 257 rows
    r0, r1 = rank_weights(b.engine, 0), rank_weights(b.engine, 1)
    assert r0["embed.weight"].shape == r1["embed.weight"].shape == (129, 64)
    torch.testing.assert_close(r0["embed.weight"], wte[:129], rtol=0, atol=0)
    torch.testing.assert_close(r1["embed.weight"][:128], wte[129:], rtol=0, atol=0)
    assert not r1["embed.weight"][128].any()
    assert (int(r0[sharding.VOCAB_START]), int(r1[sharding.VOCAB_START])) == (0, 129)
    # row-parallel biases are added once: by rank 0
    proj = b.hf.transformer.h[0].attn.c_proj.bias
    torch.testing.assert_close(r0["layers.0.o.bias"], proj, rtol=0, atol=0)
    assert not r1["layers.0.o.bias"].any()


# ---- running a function on every other rank (the executor's run_on_ranks) ---------------------
# What is sent runs in the worker, found there by name: module-level functions of this module.


def param_shape(model, state, name: str) -> tuple[int, tuple[int, ...]]:
    """This rank's number and the shape of its shard of ``name``."""
    return model.tp_rank, tuple(model.params[name].shape)


def count_calls(model, state) -> int:
    """How often this rank has run it, kept in the rank's state."""
    state["calls"] = state.get("calls", 0) + 1
    return state["calls"]


def all_reduce_rank_numbers(model, state) -> None:
    """Meets rank 0 in an all-reduce of every rank's number + 1 and keeps the sum."""
    total = torch.tensor([model.tp_rank + 1.0])
    torch.distributed.all_reduce(total)
    state["sum"] = total.item()


def kept_sum(model, state) -> float:
    return state["sum"]


def refuse(model, state) -> None:
    raise ValueError(f"rank {model.tp_rank} refuses")


def test_a_function_runs_on_every_other_rank_on_that_ranks_model_and_state(qwen2):
    executor = start_ranks(load_engine(qwen2.engine))
    try:
        assert executor.run_on_ranks(param_shape, "embed.weight") == [(1, (128, 64))]  # half the vocabulary
        q_and_kv_rows = HEADS // RANKS * HEAD_DIM + 2 * HEAD_DIM  # half the q heads, one KV head
        assert executor.run_on_ranks(param_shape, "layers.0.qkv.weight") == [(1, (q_and_kv_rows, 64))]
        assert [executor.run_on_ranks(count_calls) for _ in range(3)] == [[1], [2], [3]]

        def local(model, state):  # the workers could not find it by name
            return 0

        with pytest.raises(TypeError, match="needs a function importable by name"):
            executor.run_on_ranks(local)
        assert executor.run_on_ranks(count_calls) == [4]  # the ranks are untouched
        # a call whose wait was cut short (Ctrl-C) leaves its answer behind; the next call's
        # answer is its own, not that one
        executor._calls += 1
        executor._post("run", (count_calls,), reply=executor._calls)
        assert executor.run_on_ranks(count_calls) == [6]
    finally:
        executor.shutdown()


def test_a_function_that_meets_rank_0_in_a_collective_is_sent_without_waiting(qwen2):
    executor = start_ranks(load_engine(qwen2.engine))
    try:
        assert executor.run_on_ranks(all_reduce_rank_numbers, wait=False) is None
        total = torch.tensor([1.0])  # rank 0's side of the all-reduce
        torch.distributed.all_reduce(total)
        assert total.item() == 3.0
        assert executor.run_on_ranks(kept_sum) == [3.0]
    finally:
        executor.shutdown()


# ---- compare ----------------------------------------------------------------------------------


def test_compare_checks_a_tp_engine_over_both_ranks(qwen2):
    before = worker_children()
    lines: list[str] = []
    verdict, culprit = compare_engine(qwen2.engine, num_prompts=3, max_tokens=8, out=lines.append,
                                     start_ranks=start_ranks)
    assert verdict.ok, "\n".join(lines)
    assert culprit is None
    assert any("2 tensor-parallel ranks" in line for line in lines), lines
    assert worker_children() == before  # the worker it started is gone


def plant_drop_q_bias(model, state) -> None:
    """On the other rank: the wrong pass, known there too, since every rank rebuilds its program."""
    register_pass(Pass("drop_q_bias", drop_q_bias, "test: a wrong rewrite"))


def start_ranks_knowing_drop_q_bias(engine):
    executor = start_ranks(engine)
    executor.run_on_ranks(plant_drop_q_bias)
    return executor


def test_compare_names_a_wrong_pass_planted_after_shard(tmp_path):
    make_checkpoint("qwen2", tmp_path / "checkpoint")  # its q bias is not zero, unlike a fresh init's
    register_pass(Pass("drop_q_bias", drop_q_bias, "test: a wrong rewrite"))
    try:
        names = default_pass_names()
        names.insert(names.index("shard") + 1, "drop_q_bias")
        build_engine(str(tmp_path / "checkpoint"), tmp_path / "engine", pass_names=names, dtype="float32", device="cpu",
                     progress=False, tensor_parallel_size=RANKS)
        lines: list[str] = []
        verdict, culprit = compare_engine(tmp_path / "engine", num_prompts=2, max_tokens=4, out=lines.append,
                                         start_ranks=start_ranks_knowing_drop_q_bias)
    finally:
        unregister_pass("drop_q_bias")
    assert not verdict.ok and culprit == "drop_q_bias", "\n".join(lines)
    assert any("after shard" in line and line.endswith("ok") for line in lines), lines


# ---- shutdown and bench ---------------------------------------------------------------------


def test_shutdown_drops_the_runners_graphs_while_the_group_still_stands(qwen2, monkeypatch):
    """NCCL's teardown waits for every CUDA graph that captured one of its collectives, so rank
    0's runner lets its graphs go before the group ends (the workers do the same)."""
    from compiled_llm.serve.worker.model_runner import ModelRunner

    seen = []
    release = ModelRunner.release_graphs

    def recording(runner):
        seen.append(torch.distributed.is_initialized())
        release(runner)

    monkeypatch.setattr(ModelRunner, "release_graphs", recording)
    llm = LLM(str(qwen2.engine), device="cpu")
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=4), use_tqdm=False)
    llm.shutdown()
    assert seen == [True]
    assert not torch.distributed.is_initialized()
    assert not llm.engine.runner.graphs.enabled
    with pytest.raises(EngineError, match="shut down"):
        llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=4), use_tqdm=False)


def test_bench_runs_a_tp_engine_and_holds_it_to_the_asked_size(qwen2, capsys, monkeypatch):
    import functools

    from compiled_llm.cli.bench import workloads
    from compiled_llm.cli.main import main

    # the latency workload through both ranks, one repeat of 32 tokens instead of 3 of 256: the
    # same bench path (load, warm-up, timed decode, median, JSON row) in 40 decode steps over gloo,
    # not 776 (test_llm.py's test_bench_latency_on_cpu runs the workload at full size on one rank)
    monkeypatch.setattr(workloads, "compiled_latency",
                        functools.partial(workloads.compiled_latency, new_tokens=32, repeats=1))
    argv = ["bench", str(qwen2.engine), "--workload", "latency", "--no-hf", "--device", "cpu", "--json"]
    assert main([*argv, "--tensor-parallel-size", "2"]) == 0
    assert not torch.distributed.is_initialized()  # the workers ended with the measurement
    (row,) = json.loads(capsys.readouterr().out)
    assert row["workload"] == "latency" and row["metrics"]["decode_tok_s"] > 0
    assert main([*argv, "--tensor-parallel-size", "1"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error:") and "tensor_parallel_size 2, not 1" in line


# ---- failures (last: after a rank dies, this process keeps the broken group, so no other
# tensor-parallel engine can start in it) ---------------------------------------------------------


def test_a_function_that_raises_on_a_rank_fails_the_ranks_naming_it(qwen2):
    executor = start_ranks(load_engine(qwen2.engine))
    try:
        with pytest.raises(EngineError, match=r"^tensor-parallel rank 1 failed: ValueError: rank 1 refuses$"):
            executor.run_on_ranks(refuse)
        with pytest.raises(EngineError, match=r"^tensor-parallel rank 1 failed: ValueError"):
            executor.run_on_ranks(count_calls)  # and every later call
    finally:
        executor.shutdown()
    assert not torch.distributed.is_initialized()  # the failed ranks' gloo group ended with them


def test_a_killed_worker_fails_the_running_generate_and_every_later_one(qwen2):
    llm = LLM(str(qwen2.engine), device="cpu", max_num_seqs=4)
    try:
        (worker,) = llm.engine.executor._procs
        error = kill_mid_generate(llm, worker.pid, max_tokens=480)
        assert "tensor-parallel rank 1" in str(error)
        assert worker.poll() == -signal.SIGKILL  # reaped
    finally:
        llm.shutdown()
    # the failed engine's group is gone with it: this process can run a tensor-parallel engine again
    assert not torch.distributed.is_initialized()
    again = LLM(str(qwen2.engine), device="cpu")
    try:
        (out,) = again.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=4, temperature=0),
                                use_tqdm=False)
        assert len(out.outputs[0].token_ids) == 4
    finally:
        again.shutdown()


CHILD = """
import sys, time
from compiled_llm import LLM
llm = LLM(sys.argv[1], device="cpu")
print(llm.engine.executor._procs[0].pid, flush=True)
time.sleep(600)
"""


def test_a_killed_rank0_takes_its_worker_with_it(qwen2, tmp_path):
    log = tmp_path / "child.log"
    with open(log, "w") as err:
        child = subprocess.Popen([sys.executable, "-c", CHILD, str(qwen2.engine)], stdout=subprocess.PIPE,
                                 stderr=err, text=True)
    try:
        ready, _, _ = select.select([child.stdout], [], [], 60)
        assert ready, f"the child printed no worker pid in 60 s: {log.read_text()[-2000:]}"
        line = child.stdout.readline()
        assert line.strip().isdigit(), f"{line!r}: {log.read_text()[-2000:]}"
        worker = int(line)
        assert is_running(worker)
        child.kill()
        child.wait(10)
        deadline = time.monotonic() + 30
        while is_running(worker):
            assert time.monotonic() < deadline, f"worker {worker} outlived its rank 0 by 30 s"
            time.sleep(0.1)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        child.stdout.close()


def test_an_engine_is_sharded_at_build_time(qwen2):
    before = worker_children()
    with pytest.raises(InvalidOptionError, match="tensor_parallel_size 2, not 1"):
        LLM(str(qwen2.engine), device="cpu", tensor_parallel_size=1)
    assert worker_children() == before  # refused before any worker started


# each rank: open_workspace with one step failing on one rank only; every rank must come back
# with None (NCCL's path) and then meet the others in the next collective
_WORKSPACE_RANK = """
import datetime, sys
import torch, torch.distributed as dist
from compiled_llm.kernels import triton_all_reduce as ar

rank, store, failing_step = int(sys.argv[1]), sys.argv[2], sys.argv[3]
dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=20))

def fails(step, works):
    def call(*args):
        if rank == 1 and step == failing_step:
            raise RuntimeError(f"{step} failed on purpose")
        return works(*args)
    return call

ar._allocate = fails("allocation", lambda size, device, world: torch.zeros(size, dtype=torch.uint8))
ar._rendezvous = fails("rendezvous", lambda buffer: object())
assert ar.open_workspace(torch.device("cpu")) is None
out = torch.tensor([rank + 1.0])
dist.all_reduce(out)
assert out.item() == 3.0
dist.destroy_process_group()
print("rank", rank, "agreed")
"""


@pytest.mark.parametrize("failing_step", ["allocation", "rendezvous"])
def test_the_custom_all_reduce_workspace_opens_on_every_rank_or_on_none(tmp_path, failing_step):
    for rank, (status, out) in enumerate(run_ranks(tmp_path, _WORKSPACE_RANK, failing_step)):
        assert status == 0 and f"rank {rank} agreed" in out, out[-2000:]


# each rank: open_workspace on GPUs of different SM counts (rank 1's has 5, the CPU stand-in 8);
# the grid's cap must be the same on both, or their blocks would wait on flags never raised
_WORKSPACE_GRID = """
import datetime, sys
import torch, torch.distributed as dist
from compiled_llm.kernels import triton_all_reduce as ar

rank, store = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=20))

class Mapped:  # what symm_mem.rendezvous returns, over this rank's buffer alone
    def __init__(self, buffer):
        self.rank, self.world_size, self.buffer = rank, 2, buffer
    def get_buffer(self, peer, shape, dtype):
        return self.buffer

ar._allocate = lambda size, device, world: torch.zeros(size, dtype=torch.uint8)
ar._rendezvous = Mapped
if rank == 1:
    ar.sm_count = lambda device: 5
ws = ar.open_workspace(torch.device("cpu"))
print("rank", rank, "max_blocks", ws.max_blocks, "blocks", ar.blocks_for(1 << 20, ws))
dist.destroy_process_group()
"""


def test_ranks_with_unlike_gpus_agree_on_the_custom_all_reduce_grid(tmp_path):
    for rank, (status, out) in enumerate(run_ranks(tmp_path, _WORKSPACE_GRID)):
        assert status == 0 and f"rank {rank} max_blocks 5 blocks 5" in out, out[-2000:]


def test_a_custom_all_reduce_slot_must_keep_vector_alignment():
    from compiled_llm.kernels import triton_all_reduce as ar

    with pytest.raises(ValueError, match="multiple of 16"):
        ar.open_workspace(torch.device("cpu"), capacity=(1 << 20) + 8)
