"""`compiled-llm serve`'s data-parallel options refused before anything loads: one line naming
the problem, exit 2 (the engine-backed behaviour is tests/serve/engine_process/test_data_parallel.py's)."""

from __future__ import annotations

import pytest

from compiled_llm.cli.main import main


@pytest.mark.parametrize("flags, named", [
    (["--data-parallel-size", "0"], "data_parallel_size must be an integer >= 1, got 0"),
    (["--data-parallel-size", "-2"], "data_parallel_size must be an integer >= 1, got -2"),
    (["--device", "cuda:1", "--data-parallel-size", "2"], "--device cuda:1 names one GPU"),
])
def test_bad_data_parallel_options_are_one_line_naming_the_problem(flags, named, capsys):
    assert main(["serve", "tiny-qwen2", "--port", "0", *flags]) == 2
    err = capsys.readouterr().err
    assert named in err and err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.parametrize("flags, named", [
    (["--data-parallel-size", "2"],
     "data_parallel_size 2 x 1 GPU a replica (tensor x pipeline parallel) needs 2 GPUs, but 1 is visible"),
    (["--data-parallel-size", "2", "-tp", "2"],
     "data_parallel_size 2 x 2 GPUs a replica (tensor x pipeline parallel) needs 4 GPUs, but 1 is visible"),
    (["--data-parallel-size", "2", "-tp", "2", "--pipeline-parallel-size", "2"],
     "data_parallel_size 2 x 4 GPUs a replica (tensor x pipeline parallel) needs 8 GPUs, but 1 is visible"),
])
def test_more_replicas_than_gpus_is_one_line_naming_the_numbers(flags, named, capsys, monkeypatch):
    import torch

    # a machine of one GPU, as torch sees it (nothing here touches the device before the check)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert main(["serve", "tiny-qwen2", "--port", "0", "--device", "cuda", *flags]) == 2
    err = capsys.readouterr().err
    assert named in err and err.count("\n") == 1 and "Traceback" not in err
