"""The fused Gumbel-max sampler on the GPU at a real vocabulary: draws follow
softmax(logits / T), temperature-0 rows are the argmax, and ``sampling.sample`` routes unseeded,
untruncated batches to it."""

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

from compiled_llm.serve.worker.sampler import SamplingTensors, sample  # noqa: E402
from compiled_llm.serve.sampling_params import SamplingParams  # noqa: E402

V = 151_936


def test_draws_follow_softmax_at_real_vocab_size():
    gen = torch.Generator(device="cuda").manual_seed(0)
    row = torch.randn(V, device="cuda", generator=gen) - 8.0
    hot = torch.tensor([17, 4242, 99_999, 151_935], device="cuda")
    row[hot] = torch.tensor([3.0, 2.2, 1.5, 2.8], device="cuda")
    rows = 8192
    logits = row.to(torch.bfloat16).expand(rows, -1).contiguous()
    params = [SamplingParams(temperature=0.8)] * (rows - 1) + [SamplingParams(temperature=0.0)]
    st = SamplingTensors.from_params(params, V, "cuda")
    ids = sample(logits, st)
    assert ids[-1].item() == int(logits[-1].float().argmax())
    expect = torch.softmax(logits[0].float() / 0.8, dim=0)
    freq = torch.bincount(ids[:-1], minlength=V).float() / (rows - 1)
    assert (freq[hot] - expect[hot]).abs().max() < 0.03, (freq[hot], expect[hot])
    # mass outside the hot tokens lands on the rest in proportion too
    cold = 1 - expect[hot].sum()
    assert abs((1 - freq[hot].sum()) - cold) < 0.03


@pytest.mark.parametrize("rows", [1, 3, 64, 300])
def test_greedy_argmax_matches_torch_at_real_vocab_size(rows):
    from compiled_llm.kernels.triton_sampling import greedy_argmax, num_splits

    gen = torch.Generator(device="cuda").manual_seed(rows)
    logits = torch.randn(rows, V, device="cuda", generator=gen).to(torch.bfloat16)
    logits[0, [7, 80_000, 151_000]] = 30.0  # a tie across chunks: the lowest index, as torch
    assert num_splits(rows, V, logits.device) > 1 or rows > 64
    for _ in range(3):  # repeated launches reuse the ticket counters
        ids = greedy_argmax(logits)
        assert torch.equal(ids, logits.argmax(-1))
    assert ids[0].item() == 7
