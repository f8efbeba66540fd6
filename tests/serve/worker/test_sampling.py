"""The batched sampler against the definitions of greedy, temperature, top-k and top-p, seeded
reproducibility, and SamplingParams validation."""

import math

import pytest
import torch

from compiled_llm.errors import InvalidRequestError
from compiled_llm.graph import ops
from compiled_llm.kernels import registry
from compiled_llm.serve.worker.sampler import SamplingTensors, greedy_ids, make_generator, sample, truncate_logits
from compiled_llm.serve.sampling_params import SamplingParams

V = 8
# fixed logits with distinct, known probabilities
LOGITS = torch.log(torch.tensor([0.30, 0.25, 0.15, 0.12, 0.08, 0.05, 0.03, 0.02]))


def draw(params: SamplingParams, n=4000, seed=0):
    torch.manual_seed(seed)
    logits = LOGITS.repeat(n, 1)
    st = SamplingTensors.from_params([params] * n, V, "cpu")
    return sample(logits, st)


def frequencies(ids):
    return torch.bincount(ids, minlength=V).float() / len(ids)


def assert_matches(ids, probs, n_sigma=5.0):
    freq = frequencies(ids)
    sigma = torch.sqrt(probs * (1 - probs) / len(ids)).clamp_min(1e-3)
    assert ((freq - probs).abs() <= n_sigma * sigma).all(), (freq, probs)


def test_greedy_is_argmax_per_row():
    logits = torch.randn(5, 100)
    params = [SamplingParams(temperature=0.0)] * 5
    ids = sample(logits, SamplingTensors.from_params(params, 100, "cpu"))
    assert torch.equal(ids, logits.argmax(-1))


def test_temperature_scales_the_distribution():
    for t in (1.0, 0.5, 2.0):
        ids = draw(SamplingParams(temperature=t))
        assert_matches(ids, torch.softmax(LOGITS / t, -1))


def test_top_k_samples_only_the_k_best_renormalised():
    k = 3
    ids = draw(SamplingParams(temperature=1.0, top_k=k))
    assert set(ids.tolist()) <= {0, 1, 2}
    p = LOGITS.exp()[:k]
    assert_matches(ids, torch.cat([p / p.sum(), torch.zeros(V - k)]))


def test_top_p_keeps_the_smallest_set_reaching_p():
    # probs sorted: .30 .25 .15 .12 ...: cumulative .30 .55 .70 .82
    def kept(top_p):
        out = truncate_logits(LOGITS[None], torch.tensor([V]), torch.tensor([top_p]))
        return torch.isfinite(out[0]).nonzero().flatten().tolist()

    assert kept(0.69) == [0, 1, 2]  # .30+.25+.15 = .70 reaches .69, .30+.25 does not
    assert kept(0.71) == [0, 1, 2, 3]
    assert kept(0.05) == [0]  # the best token always stays
    assert kept(1.0) == list(range(V))
    ids = draw(SamplingParams(temperature=1.0, top_p=0.54))
    assert set(ids.tolist()) <= {0, 1}
    p = LOGITS.exp()[:2]
    assert_matches(ids, torch.cat([p / p.sum(), torch.zeros(V - 2)]))


def nucleus(probs: list[float], top_p: float) -> set[int]:
    """The smallest set of most likely tokens whose mass reaches top_p, by its definition."""
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    kept, mass = set(), 0.0
    for i in order:
        kept.add(i)
        mass += probs[i]
        if mass >= top_p - 1e-9:
            return kept
    return kept


def test_each_row_samples_only_inside_its_own_nucleus():
    # one batch, a different top_p per row, random distributions: every draw of a row must lie
    # in that row's nucleus, and with enough draws every nucleus token shows up
    gen = torch.Generator().manual_seed(3)
    rows, n = 6, 3000
    logits = torch.randn(rows, 32, generator=gen) * 2
    top_ps = [0.2, 0.5, 0.7, 0.9, 0.95, 0.99]
    params = [SamplingParams(temperature=1.0, top_p=p) for p in top_ps]
    st = SamplingTensors.from_params(params * n, 32, "cpu")
    torch.manual_seed(0)
    ids = sample(logits.repeat(n, 1), st).view(n, rows)
    for r, p in enumerate(top_ps):
        want = nucleus(torch.softmax(logits[r], -1).tolist(), p)
        assert set(ids[:, r].tolist()) == want, (p, sorted(want))


def test_top_k_and_top_p_together_apply_both():
    out = truncate_logits(LOGITS[None], torch.tensor([2]), torch.tensor([0.9]))
    assert torch.isfinite(out[0]).nonzero().flatten().tolist() == [0, 1]


def test_rows_keep_their_own_parameters():
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_k=1), SamplingParams(temperature=1.0)]
    logits = torch.stack([LOGITS, LOGITS.flip(0), LOGITS])
    st = SamplingTensors.from_params(params, V, "cpu")
    for _ in range(20):
        ids = sample(logits, st).tolist()
        assert ids[0] == 0 and ids[1] == V - 1


def test_each_parameter_is_a_contiguous_row_of_values_per_request():
    """The kernels index a parameter by row (``temp_ptr + row``): each must be contiguous."""
    params = [SamplingParams(temperature=t, top_p=p, min_p=m, presence_penalty=0.5)
              for t, p, m in ((0.0, 1.0, 0.0), (0.7, 0.9, 0.05), (1.3, 0.5, 0.0))]
    st = SamplingTensors.from_params(params, V, "cpu")
    for name, want in (("temperature", [0.0, 0.7, 1.3]), ("top_p", [1.0, 0.9, 0.5]), ("min_p", [0.0, 0.05, 0.0]),
                       ("presence_penalty", [0.5] * 3), ("top_k", [V] * 3)):
        t = getattr(st, name)
        assert t.is_contiguous(), name
        assert t.tolist() == pytest.approx(want), name


def test_seeded_rows_reproduce_and_ignore_their_neighbours():
    def run(batch_params, seed_row):
        gens = [make_generator(p.seed, "cpu") for p in batch_params]
        st = SamplingTensors.from_params(batch_params, V, "cpu")
        logits = LOGITS.repeat(len(batch_params), 1)
        return [sample(logits, st, gens)[seed_row].item() for _ in range(30)]

    seeded = SamplingParams(temperature=1.0, seed=1234)
    alone = run([seeded], 0)
    torch.manual_seed(99)  # unseeded neighbours draw from the global generator
    crowded = run([SamplingParams(temperature=1.0), seeded, SamplingParams(temperature=0.7, top_k=3)], 1)
    assert alone == crowded
    assert len(set(alone)) > 1  # really sampled
    other = run([SamplingParams(temperature=1.0, seed=4321)], 0)
    assert other != alone


_SEEN = []


def _test_greedy(logits):
    _SEEN.append("greedy_sample")
    return ops.greedy_sample_ref(logits)


def _test_temperature(logits, temperature):
    _SEEN.append("temperature_sample")
    return ops.temperature_sample_ref(logits, temperature)


def test_sampler_runs_the_kernels_the_registry_picks():
    """Greedy batches and plain temperature batches run the registry's choice for the logits'
    device and dtype (a CPU-only provider here); top-k/top-p and seeded batches run the torch race."""
    logits = torch.randn(3, V)
    plain = SamplingTensors.from_params([SamplingParams(temperature=0.8)] * 3, V, "cpu")
    truncated = SamplingTensors.from_params([SamplingParams(temperature=0.8, top_k=2)] * 3, V, "cpu")
    try:
        for op, fn in (("greedy_sample", _test_greedy), ("temperature_sample", _test_temperature)):
            registry.register_kernel(op, "test_cpu", fn, supports=lambda d, t: d == "cpu" and t == torch.float32,
                                     priority=100)
        _SEEN.clear()
        assert torch.equal(greedy_ids(logits), logits.argmax(-1))
        sample(logits, plain)
        sample(logits, truncated)
        sample(logits, plain, [make_generator(1, "cpu"), None, None])
        greedy_ids(logits.bfloat16())  # a dtype the provider does not support: the reference
        assert _SEEN == ["greedy_sample", "temperature_sample"]
    finally:
        for op in ("greedy_sample", "temperature_sample"):
            registry.unregister_provider(op, "test_cpu")
    _SEEN.clear()
    greedy_ids(logits)
    assert _SEEN == []


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(max_tokens=-3), "max_tokens"),
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=math.nan), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(stop=[""]), "stop"),
    ],
)
def test_invalid_sampling_params_are_refused(kwargs, fragment):
    with pytest.raises(InvalidRequestError, match=fragment):
        SamplingParams(**kwargs)


def test_stop_is_normalised_to_a_tuple():
    assert SamplingParams(stop="###").stop == ("###",)
    assert SamplingParams(stop_token_ids=[3, 4]).stop_token_ids == (3, 4)


def test_the_first_allowed_race_candidate_is_the_masked_race_token():
    """A grammar-checked row keeps its race's next tokens: the first of them its grammar allows
    is the token the race picks, with the same noise, from the logits masked to what it allows."""
    from compiled_llm.serve.worker.sampler import race_candidates

    g = torch.Generator().manual_seed(0)
    rows, vocab, k = 64, 3000, 64  # a row has an allowed token among its first 64 (0.8^64 it has not)
    logits = torch.randn(rows, vocab, generator=g) * 3
    temperature = torch.tensor([0.0, 0.7, 1.0, 1.5] * (rows // 4))
    noise = torch.empty(rows, vocab).exponential_(generator=g)
    allowed = torch.rand(rows, vocab, generator=g) < 0.2
    allowed[:, 0] = True  # at least one token
    logits[1::2, 1], allowed[1::2, 1] = 200.0, False  # a refused favourite: the others' p underflows
    candidates = race_candidates(logits, temperature, k, noise)
    assert torch.equal(candidates[:, 0], ops.exponential_race(logits, temperature, noise=noise))
    masked = ops.exponential_race(logits.masked_fill(~allowed, float("-inf")), temperature, noise=noise)
    first_allowed = [next(t for t in row.tolist() if allowed[i, t]) for i, row in enumerate(candidates)]
    assert first_allowed == masked.tolist()


def test_top_ids_over_chunks_are_the_rows_best_in_order():
    from compiled_llm.serve.worker.sampler import TOP_IDS_CHUNK, top_ids

    score = torch.randn(3, 5 * TOP_IDS_CHUNK + 17, generator=torch.Generator().manual_seed(1))
    score[1, -3:] = 100.0 + torch.arange(3.0)  # the best in the last, partial chunk
    assert torch.equal(top_ids(score, 8), score.topk(8, dim=-1).indices)
