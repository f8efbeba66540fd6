"""The paged attention kernels against the reference on a GPU, at real model shapes.

Qwen2.5-0.5B (14 q / 2 kv heads, head_dim 64), Llama-3.2-1B (32 / 8, head_dim 64) and Qwen3-0.6B
(16 / 8, head_dim 128); bf16 and fp16; relative error ||out - ref|| / ||ref|| <= 1e-2.

Decode runs as the runtime runs it: captured in a CUDA graph and replayed on fresh inputs, twice,
so the fused split reduce's ticket counters must be back at 0 after every launch. Cache slots
outside every context hold NaN and the new tokens' slots are NaN before the step: a program that
read the new token's slot from the cache instead of from k/v (racing with the program that
stores it) would turn its output into NaN. Outputs are poisoned (the allocator's free blocks
filled with NaN) before eager calls, so a row the last program forgets to write shows.
"""

import pytest
import torch

pytest.importorskip("triton")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

from compiled_llm.graph import ops  # noqa: E402
from compiled_llm.kernels import launch_configs  # noqa: E402
from compiled_llm.kernels import triton_paged_attention as pa  # noqa: E402
from helpers.kernel_inputs import attention_case, poison_allocator, rel_err  # noqa: E402

DEV = "cuda"
TOL = 1e-2
DTYPES = [torch.bfloat16, torch.float16]
MODELS = {
    "qwen2.5-0.5b": dict(Hq=14, Hkv=2, D=64),
    "llama-3.2-1b": dict(Hq=32, Hkv=8, D=64),
    "qwen3-0.6b": dict(Hq=16, Hkv=8, D=128),
}
BLOCK = 16
WIDTH = 4096 // BLOCK  # block-table columns: max_model_len 4096


@pytest.fixture(autouse=True)
def _default_configs():
    launch_configs.use_configs(None)
    yield
    launch_configs.use_configs(None)


def _counters_zero() -> bool:
    return pa.split_counters(torch.device(DEV), 0).count_nonzero().item() == 0


def _same_cache(a, b) -> bool:
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))


def _decode_sets(m, dtype, contexts_per_set, pad_rows, seed):
    """One decode batch per entry of contexts_per_set (same batch size), caches padded with NaN
    blocks to one shape, as a graph's static inputs need."""
    cases = [attention_case([(c - 1, 1) for c in ctx], m["Hq"], m["Hkv"], m["D"], BLOCK, dtype, DEV,
                            seed=seed + i, pad_rows=pad_rows, max_blocks=WIDTH, extra_blocks=1)
             for i, ctx in enumerate(contexts_per_set)]
    nb = max(c.kv_cache.shape[1] for c in cases)
    for c in cases:
        c.kv_cache = torch.nn.functional.pad(c.kv_cache, (0, 0, 0, 0, 0, 0, 0, nb - c.kv_cache.shape[1]),
                                             value=float("nan"))
    return cases


def _capture(static_args):
    """Warm up on a side stream (compiles, allocates the counters), then capture one call."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            pa.paged_attention(*[a.clone() if isinstance(a, torch.Tensor) else a for a in static_args])
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = pa.paged_attention(*static_args)
    return graph, out


def _replay_and_check(graph, out, static, case):
    """Copy case's inputs into the static tensors, replay, compare with the reference."""
    new = case.args()
    for dst, src in zip(static, new):
        if isinstance(dst, torch.Tensor):
            dst.copy_(src)
    ref_cache = case.kv_cache.clone()
    ref = ops.paged_attention(*new[:3], ref_cache, *new[4:])
    graph.replay()
    torch.cuda.synchronize()
    err = rel_err(out, ref)
    assert err <= TOL, err
    assert _same_cache(static[3], ref_cache), "the decode step stored k/v in the wrong slots"
    assert _counters_zero()
    return out.clone()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("batch", [1, 64])
def test_decode_in_cuda_graph_replays_on_fresh_inputs(batch, model, dtype):
    m = MODELS[model]
    g = torch.Generator().manual_seed(batch)
    if batch == 1:
        sets = [[1], [384], [4096]]  # capture at one token; replay a short and the longest context
        pad = 0
    else:
        rnd = lambda: torch.randint(1, 4097, (batch - 3,), generator=g).tolist()  # noqa: E731
        sets = [rnd() + [1, 16, 17], rnd() + [4096, 2, 64], rnd() + [33, 4095, 1000]]
        pad = 3
    first, *fresh = _decode_sets(m, dtype, sets, pad, seed=10 * batch)
    static = list(first.args(first.kv_cache.clone()))
    graph, out = _capture(static)
    for case in fresh:
        got = _replay_and_check(graph, out, static, case)
        if pad:
            assert got[-pad:].abs().sum() == 0  # padding rows


def test_fused_decode_is_deterministic_across_replays():
    # the last program combines the splits in split order: same bits whichever finishes last
    m = MODELS["qwen2.5-0.5b"]
    (case,) = _decode_sets(m, torch.bfloat16, [[4096, 3000, 130, 2047]], 0, seed=5)
    static = list(case.args(case.kv_cache.clone()))
    assert pa.decode_plan(4, m["Hkv"], WIDTH * BLOCK, torch.device(DEV))["NUM_SPLITS"] > 1  # the fused reduce
    graph, out = _capture(static)
    runs = []
    for _ in range(5):
        graph.replay()
        torch.cuda.synchronize()
        runs.append(out.clone())
    assert all(torch.equal(r, runs[0]) for r in runs[1:])
    assert _counters_zero()


@pytest.mark.parametrize("max_splits", [1, 8, 32])
def test_decode_split_counts_agree(max_splits):
    launch_configs.use_configs({"paged_attention_decode": {"inf": {
        "BLOCK_N": 64, "MAX_SPLITS": max_splits, "PROGRAMS_PER_SM": 64,
        "COMBINE_SPLITS": 16, "num_warps": 4, "num_stages": 2}}})
    m = MODELS["llama-3.2-1b"]
    (case,) = _decode_sets(m, torch.bfloat16, [[4096, 1, 700, 1500, 64, 65]], 2, seed=7)
    out_cache, ref_cache = case.kv_cache.clone(), case.kv_cache.clone()
    poison_allocator(DEV, 1 << 20, 1 << 16)
    out = pa.paged_attention(*case.args(out_cache))
    ref = ops.paged_attention(*case.args(ref_cache))
    torch.cuda.synchronize()
    assert rel_err(out, ref) <= TOL
    assert _same_cache(out_cache, ref_cache)
    assert out[-2:].abs().sum() == 0
    assert _counters_zero()


# ---------------------------------------------------------------------------------------------
# prefill / mixed
# ---------------------------------------------------------------------------------------------


def _check_eager(case):
    out_cache, ref_cache = case.kv_cache.clone(), case.kv_cache.clone()
    poison_allocator(DEV, 1 << 22, 1 << 20)
    out = pa.paged_attention(*case.args(out_cache))
    ref = ops.paged_attention(*case.args(ref_cache))
    torch.cuda.synchronize()
    err = rel_err(out, ref)
    assert err <= TOL, err
    assert _same_cache(out_cache, ref_cache)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("model", list(MODELS))
def test_prefill_of_a_1024_token_prompt(model, dtype):
    m = MODELS[model]
    _check_eager(attention_case([(0, 1024)], m["Hq"], m["Hkv"], m["D"], BLOCK, dtype, DEV, seed=20))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("model", list(MODELS))
def test_mixed_chunked_batch(model, dtype):
    # chunks after cached prefixes (one long), decode rows among prompts, odd lengths
    m = MODELS[model]
    specs = [(0, 300), (500, 128), (1000, 1), (0, 17), (33, 64), (2000, 700), (7, 1)]
    _check_eager(attention_case(specs, m["Hq"], m["Hkv"], m["D"], BLOCK, dtype, DEV, seed=21))


@pytest.mark.parametrize("block_m,block_n,num_warps,num_stages", [
    (64, 64, 4, 2), (64, 32, 4, 3), (128, 64, 8, 2), (128, 64, 8, 3), (128, 128, 8, 2), (128, 32, 8, 3),
    (32, 64, 4, 2),
])
def test_prefill_configs_a_benchmark_may_pick(block_m, block_n, num_warps, num_stages):
    launch_configs.use_configs({"paged_attention_prefill": {"inf": {
        "BLOCK_M": block_m, "BLOCK_N": block_n, "num_warps": num_warps, "num_stages": num_stages}}})
    for m in (MODELS["qwen2.5-0.5b"], MODELS["qwen3-0.6b"]):
        _check_eager(attention_case([(0, 1024), (90, 333)], m["Hq"], m["Hkv"], m["D"], BLOCK, torch.bfloat16,
                                    DEV, seed=22))


# ---------------------------------------------------------------------------------------------
# sliding layers and soft-capped scores (Mistral, Gemma 2, Gemma 3), same kernels
# ---------------------------------------------------------------------------------------------

# (heads, window, soft cap): windows shorter than the contexts below, so the blocks wholly
# before them are NaN and their table entries point at a NaN block
LAYER_VARIANTS = {
    "mistral-7b-local": (dict(Hq=32, Hkv=8, D=128), 1000, 0.0),
    "gemma-2-2b-local": (dict(Hq=8, Hkv=4, D=256), 700, 50.0),
    "gemma-2-2b-global": (dict(Hq=8, Hkv=4, D=256), 0, 50.0),
    "gemma-3-1b-local": (dict(Hq=4, Hkv=1, D=256), 512, 0.0),
}


@pytest.mark.parametrize("variant", list(LAYER_VARIANTS))
@pytest.mark.parametrize("batch", [1, 64])
def test_decode_of_sliding_and_capped_layers_in_cuda_graph(variant, batch):
    m, window, cap = LAYER_VARIANTS[variant]
    g = torch.Generator().manual_seed(batch)
    if batch == 1:
        sets, pad = [[1], [384], [4096]], 0
    else:
        rnd = lambda: torch.randint(1, 4097, (batch - 3,), generator=g).tolist()  # noqa: E731
        sets, pad = [rnd() + [1, 16, 17], rnd() + [4096, 2, 64], rnd() + [33, 4095, 1000]], 3
    first, *fresh = _decode_sets(m, torch.bfloat16, sets, pad, seed=30 * batch)
    for case in (first, *fresh):
        case.sliding_window, case.softcap = window, cap
        if window:
            case.drop_blocks_outside_window()
    static = list(first.args(first.kv_cache.clone()))
    graph, out = _capture(static)
    for case in fresh:
        got = _replay_and_check(graph, out, static, case)
        if pad:
            assert got[-pad:].abs().sum() == 0


@pytest.mark.parametrize("variant", list(LAYER_VARIANTS))
def test_mixed_chunked_batch_of_sliding_and_capped_layers(variant):
    m, window, cap = LAYER_VARIANTS[variant]
    specs = [(0, 300), (500, 128), (1000, 1), (0, 17), (33, 64), (2000, 700), (7, 1), (0, 1500)]
    case = attention_case(specs, m["Hq"], m["Hkv"], m["D"], BLOCK, torch.bfloat16, DEV, seed=23)
    case.sliding_window, case.softcap = window, cap
    if window:
        case.drop_blocks_outside_window()
    _check_eager(case)
