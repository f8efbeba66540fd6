"""``distributed_executor_backend`` (``--distributed-executor-backend``), vLLM's option: ``mp``
(the default) or ``ray``. A name that is neither, or ``ray`` where Ray is not installed, is
refused in one line before any rank starts. Runs without Ray: that is what it checks."""

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
