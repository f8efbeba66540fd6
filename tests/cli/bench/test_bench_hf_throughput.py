"""bench's transformers throughput peer (workloads.hf_throughput): static batches of the
workload's requests, the whole workload at once where it fits in memory and batches half as
large, and so on, where it does not (a mixture's weights can leave no room for 256 padded
sequences on one GPU); its note says which batches ran and, for a mixture, transformers'
experts implementation."""

import pytest
import torch

from compiled_llm.cli.bench import workloads as wl
from compiled_llm.model.presets import preset_hf_config

CPU = torch.device("cpu")
SMALL = dict(num_requests=6, measured_steps=2, max_input_len=120, max_output_len=104)  # lengths start at 100


def test_a_mixture_runs_in_transformers_as_one_static_batch_and_says_its_experts_implementation():
    res = wl.hf_throughput(preset_hf_config("tiny-qwen3-moe"), torch.float32, CPU, **SMALL)
    assert res.workload == "throughput" and res.metrics["output_tok_s"] > 0
    assert "1 batch(es) of 6" in res.note and "experts implementation" in res.note


def test_batches_halve_until_they_fit_in_memory(monkeypatch):
    measured = []
    real = wl._static_batch_wall

    def wall(model, prompts, max_tokens, measured_steps, device):
        if len(prompts) > 2:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
        measured.append(len(prompts))
        return real(model, prompts, max_tokens, measured_steps, device)

    monkeypatch.setattr(wl, "_static_batch_wall", wall)
    res = wl.hf_throughput(preset_hf_config("tiny-qwen2"), torch.float32, CPU, **SMALL)
    assert measured == [2, 2, 2]  # 6 -> 3 -> 2 requests a batch: every request in a batch once
    assert "3 batch(es) of 2" in res.note and "experts" not in res.note
    assert res.metrics["output_tok_s"] > 0


def test_a_request_that_fits_no_batch_is_an_error(monkeypatch):
    def never_fits(*_):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")

    monkeypatch.setattr(wl, "_static_batch_wall", never_fits)
    with pytest.raises(torch.cuda.OutOfMemoryError):
        wl.hf_throughput(preset_hf_config("tiny-qwen2"), torch.float32, CPU, **SMALL)
