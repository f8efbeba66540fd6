"""``distributed_executor_backend`` (``--distributed-executor-backend``), vLLM's option: ``mp``
(the default) or ``ray``. A name that is neither, or ``ray`` where Ray is not installed, is
refused in one line before any rank starts. The Ray backend's placement (one bundle per rank,
rank 0's pinned to this node; a data-parallel replica's groups, one per pipeline stage) and its
naming of rank 0's GPU are plain functions. Runs without Ray: that is what it checks."""

from __future__ import annotations

import sys

import pytest
import torch

from compiled_llm import LLM
from compiled_llm.cli.main import main
from compiled_llm.engine.build import build_engine
from compiled_llm.errors import InvalidOptionError
from compiled_llm.serve.engine_config import EngineConfig


@pytest.fixture(scope="module")
def tp2_engine(tmp_path_factory):
    out = tmp_path_factory.mktemp("backend-option") / "engine"
    build_engine("tiny-qwen2", out, dtype="float32", device="cpu", progress=False, tensor_parallel_size=2)
    return out


def test_the_default_backend_is_mp_and_an_unknown_name_is_refused_in_one_line(capsys):
    assert EngineConfig().distributed_executor_backend == "mp"
    with pytest.raises(InvalidOptionError) as e:
        EngineConfig(distributed_executor_backend="slurm")
    assert str(e.value) == "unknown distributed_executor_backend 'slurm'; choose one of: mp, ray"
    with pytest.raises(SystemExit) as exit_:
        main(["run", "some-engine", "--distributed-executor-backend", "slurm"])
    assert exit_.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert "argument --distributed-executor-backend: invalid choice: 'slurm'" in last and "mp" in last


def test_the_ray_backend_without_ray_is_refused_in_one_line_before_any_rank_starts(tp2_engine, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)  # what `import ray` meets where Ray is not installed
    with pytest.raises(InvalidOptionError) as e:
        LLM(str(tp2_engine), device="cpu", distributed_executor_backend="ray")
    assert str(e.value) == ("distributed_executor_backend 'ray' needs Ray, which is not installed: "
                            "pip install 'compiled_llm[ray]' (or use the default backend, mp)")
    assert not torch.distributed.is_initialized()  # refused before any group formed
    assert main(["run", str(tp2_engine), "--device", "cpu", "--prompt-ids", "1,2,3", "--max-tokens", "2",
                 "--distributed-executor-backend", "ray"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error: distributed_executor_backend 'ray' needs Ray")


def test_the_ray_placement_is_one_bundle_per_rank_with_rank_0s_pinned_to_this_node():
    from compiled_llm.serve.executor.ray_executor import rank_bundles  # imports without Ray

    assert rank_bundles(2, torch.device("cpu"), "10.0.0.7") == [{"CPU": 1.0, "node:10.0.0.7": 0.001}, {"CPU": 1.0}]
    assert rank_bundles(3, torch.device("cuda"), "10.0.0.7") == [{"GPU": 1.0, "node:10.0.0.7": 0.001},
                                                                 {"GPU": 1.0}, {"GPU": 1.0}]


def test_a_ray_replica_is_a_group_per_pipeline_stage_of_a_bundle_per_rank_on_the_device_the_cluster_has():
    from compiled_llm.serve.engine_process.ray_replicas import replica_bundles, replica_device_type  # without Ray

    assert replica_bundles(2, 3, "cuda") == [[{"GPU": 1.0}, {"GPU": 1.0}]] * 3
    assert replica_bundles(1, 1, "cpu") == [[{"CPU": 1.0}]]
    # auto asks the cluster, whose other nodes may have GPUs where the front end's has none
    assert [replica_device_type("auto", gpus) for gpus in (0, 8)] == ["cpu", "cuda"]
    assert [replica_device_type(d, 8) for d in ("cpu", "cuda")] == ["cpu", "cuda"]


def test_rank_0s_gpu_is_named_as_ray_names_gpus(monkeypatch):
    """What the Ray backend compares with the GPUs Ray gave the actors, so that no two ranks share one."""
    from compiled_llm.serve.executor.ray_executor import physical_gpu

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    assert physical_gpu(torch.device("cuda", 1)) == "5"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert physical_gpu(torch.device("cuda", 2)) == "2"
