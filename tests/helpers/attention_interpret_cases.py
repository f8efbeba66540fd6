"""Paged attention kernels against the reference on the CPU, through the Triton interpreter.

Not collected by itself: tests/kernels/test_attention_interpret.py runs this file in a subprocess with
TRITON_INTERPRET=1 (the variable must be set before the kernels are decorated, and must not leak
into other test files' process). Shapes are small and fp32; cache slots outside every context
hold NaN, so a read past a context or a write outside the batch's slots shows.

What is specified here:
  * decode is one launch that stores the new k/v itself and reduces its splits itself, with the
    same cache and (to fp32 rounding) the same output as the reference, for one split (no
    reduce) and several (the fused reduce), for GQA groups 1/3/7 and head_dim 64/128, padding
    rows included; its ticket counters are back at 0 after every call,
    so consecutive calls (decode steps, layers) reuse them;
  * prefill / mixed batches (chunked prefill over a cached prefix, decode rows among prompts)
    with the GQA group stacked into one tile, for groups 3 and 7, block sizes 4 and 16, tiles
    smaller and larger than the chunks, lengths that fit no tile;
  * sliding layers (windows shorter than a tile, than a block, than the chunk, and longer than
    the context) read no block wholly before their window, nor its block-table entry, in
    decode and prefill; soft-capped scores (Gemma 2) in both.
"""

import os

assert os.environ.get("TRITON_INTERPRET") == "1", "run through tests/kernels/test_attention_interpret.py"

import pytest  # noqa: E402
import torch  # noqa: E402

from compiled_llm.graph import ops  # noqa: E402
from compiled_llm.kernels import launch_configs  # noqa: E402
from compiled_llm.kernels import triton_paged_attention as pa  # noqa: E402
from helpers.kernel_inputs import AttnCase, attention_case, rel_err  # noqa: E402

F32 = torch.float32
TOL = 1e-5
# cases the interpreter takes seconds over (big shapes, many programs): the parent test runs them
# as its `slow` group, which `pytest -m "not slow"` leaves out and CI runs
SLOW = pytest.mark.slow
CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _default_configs():
    launch_configs.use_configs(None)
    yield
    launch_configs.use_configs(None)


def use_decode_config(block_n: int, max_splits: int, combine_splits: int = 16, prefetch: bool = False) -> None:
    """Decode knobs for the test; PROGRAMS_PER_SM is large so MAX_SPLITS (and the context)
    decide the number of splits, not the interpreter's stand-in SM count."""
    launch_configs.use_configs({"paged_attention_decode": {"inf": {
        "BLOCK_N": block_n, "MAX_SPLITS": max_splits, "PROGRAMS_PER_SM": 64,
        "COMBINE_SPLITS": combine_splits, "num_warps": 4, "num_stages": 1, **({"PREFETCH": 1} if prefetch else {})}}})


def use_prefill_config(block_m: int, block_n: int) -> None:
    launch_configs.use_configs({"paged_attention_prefill": {"inf": {
        "BLOCK_M": block_m, "BLOCK_N": block_n, "num_warps": 4, "num_stages": 1}}})


def counters_are_zero() -> bool:
    return pa.split_counters(CPU, 0).count_nonzero().item() == 0


def run_both(case: AttnCase, kv_cache=None):
    """(our output, reference output, our cache, reference cache) from the same inputs."""
    start = case.kv_cache if kv_cache is None else kv_cache
    ours, ref = start.clone(), start.clone()
    out = pa.paged_attention(*case.args(ours))
    expect = ops.paged_attention(*case.args(ref))
    return out, expect, ours, ref


def same_cache(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values and NaN in the same places (NaN marks slots nobody may touch)."""
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))


def decode_steps(case: AttnCase, steps: int, pad_rows: int = 0) -> list[AttnCase]:
    """Consecutive decode batches from a case built with (cached, steps) specs: step j gives
    every sequence its j-th new token (position cached + j, context cached + j + 1), plus
    ``pad_rows`` padding rows (seq_len 0, slot -1) as a CUDA-graph bucket has."""
    S = case.seq_lens.shape[0]
    first = case.query_start_loc[:-1].long()
    assert torch.equal(case.query_start_loc[1:] - case.query_start_loc[:-1], torch.full((S,), steps, dtype=torch.int32))
    out = []
    for j in range(steps):
        rows = first + j

        def pad(t, value=0):
            return torch.cat([t, torch.full((pad_rows, *t.shape[1:]), value, dtype=t.dtype)])

        out.append(AttnCase(
            q=pad(case.q[rows]), k=pad(case.k[rows]), v=pad(case.v[rows]), kv_cache=case.kv_cache,
            slot_mapping=pad(case.slot_mapping[rows], -1),
            query_start_loc=torch.arange(S + pad_rows + 1, dtype=torch.int32),
            seq_lens=pad(case.seq_lens - (steps - 1 - j)),
            block_tables=pad(case.block_tables),
            scale=case.scale, sliding_window=case.sliding_window, softcap=case.softcap,
        ))
    return out


# ---------------------------------------------------------------------------------------------
# decode: one launch, KV store and split reduce folded in
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("prefetch", [False, True])  # True: the next tile's loads before this tile's math
@pytest.mark.parametrize("max_splits", [1, 3, pytest.param(8, marks=SLOW)])
def test_decode_matches_reference_for_every_split_count(max_splits, prefetch):
    use_decode_config(block_n=16, max_splits=max_splits, prefetch=prefetch)
    # contexts from 1 token to several splits' worth: a new token at a block start, mid-block,
    # at a block end; a wide block table like a runtime's
    case = decode_steps(attention_case([(0, 1), (16, 1), (40, 1), (70, 1), (7, 1)], num_heads=6, num_kv_heads=2,
                                       head_dim=24, block_size=4, dtype=F32, device="cpu", seed=3, max_blocks=32),
                        steps=1, pad_rows=2)[0]
    assert pa.is_decode_batch(case.q, case.query_start_loc)
    plan = pa.decode_plan(7, 2, 32 * 4, CPU)  # at 8 splits, the longest context leaves 3 empty
    assert plan["NUM_SPLITS"] == max_splits
    out, ref, cache, ref_cache = run_both(case)
    assert same_cache(cache, ref_cache)
    assert rel_err(out, ref) <= TOL, rel_err(out, ref)
    assert out[-2:].abs().sum() == 0  # padding rows: nothing to attend to
    assert counters_are_zero()


@pytest.mark.parametrize("group,head_dim,prefetch", [(1, 64, False), (3, 64, False), (7, 64, False), (3, 128, False),
                                                     (7, 128, False), (7, 128, True)])
def test_decode_gqa_groups_and_head_dims(group, head_dim, prefetch):
    use_decode_config(block_n=16, max_splits=4, prefetch=prefetch)
    case = decode_steps(attention_case([(37, 1), (5, 1), (0, 1)], num_heads=2 * group, num_kv_heads=2,
                                       head_dim=head_dim, block_size=16, dtype=F32, device="cpu", seed=group,
                                       max_blocks=4), steps=1, pad_rows=1)[0]
    out, ref, cache, ref_cache = run_both(case)
    assert same_cache(cache, ref_cache)
    assert rel_err(out, ref) <= TOL, rel_err(out, ref)
    assert counters_are_zero()


@pytest.mark.parametrize("max_splits,combine_splits",
                         [pytest.param(8, 16, marks=SLOW), pytest.param(8, 2, marks=SLOW), (1, 16)])
def test_consecutive_decode_steps_reuse_the_counters(max_splits, combine_splits):
    # three steps of the same sequences, each reading what the previous one stored; a
    # combine of 2 splits per step walks the partials in several steps
    use_decode_config(block_n=8, max_splits=max_splits, combine_splits=combine_splits)
    base = attention_case([(30, 3), (6, 3), (13, 3)], num_heads=6, num_kv_heads=2, head_dim=16, block_size=4,
                          dtype=F32, device="cpu", seed=7, max_blocks=12)
    cache, ref_cache = base.kv_cache.clone(), base.kv_cache.clone()
    for step in decode_steps(base, steps=3, pad_rows=1):
        out = pa.paged_attention(*step.args(cache))
        ref = ops.paged_attention(*step.args(ref_cache))
        assert same_cache(cache, ref_cache)
        assert rel_err(out, ref) <= TOL, rel_err(out, ref)
        assert counters_are_zero()


def test_decode_row_with_slot_minus_one_writes_nothing_and_reads_the_cache():
    # the runtime's capture inputs: every row attends to one cached token and stores nowhere
    use_decode_config(block_n=16, max_splits=4)
    case = decode_steps(attention_case([(3, 1), (9, 1)], num_heads=4, num_kv_heads=2, head_dim=16, block_size=4,
                                       dtype=F32, device="cpu", seed=8, max_blocks=4), steps=1)[0]
    case.slot_mapping = torch.full_like(case.slot_mapping, -1)
    case.seq_lens = case.seq_lens - 1  # the cached tokens only; the new k/v are not attended to
    out, ref, cache, ref_cache = run_both(case)
    assert torch.equal(cache.isnan(), case.kv_cache.isnan())  # no slot written
    assert rel_err(out, ref) <= TOL


def test_decode_splits_follow_shapes_and_knobs_only():
    a = pa.num_decode_splits(1, 2, 4096, 64, 32, CPU)
    assert a == pa.num_decode_splits(1, 2, 4096, 64, 32, CPU)
    assert pa.num_decode_splits(1, 2, 4096, 64, 32, CPU, programs_per_sm=64) == 32  # capped by MAX_SPLITS
    assert pa.num_decode_splits(1, 2, 100, 64, 32, CPU, programs_per_sm=64) == 2  # two tiles of table
    assert pa.num_decode_splits(64, 8, 4096, 64, 32, CPU) == 1  # the batch alone fills the GPU


def test_split_counters_grow_and_keep_old_buffers_alive():
    first = pa.split_counters(CPU, 1)
    assert first.dtype == torch.int32 and first.numel() >= pa.MIN_COUNTERS and counters_are_zero()
    assert pa.split_counters(CPU, 10) is first  # no growth while it fits
    bigger = pa.split_counters(CPU, first.numel() + 1)
    assert bigger.numel() > first.numel() and bigger.count_nonzero() == 0
    assert any(t is first for t in pa._RETIRED)  # a captured graph may still point at it
    assert pa.split_counters(CPU, 1) is bigger


# ---------------------------------------------------------------------------------------------
# prefill / mixed: the GQA group stacked in one tile, masks on diagonal tiles only
# ---------------------------------------------------------------------------------------------


def test_prefill_tile_stacks_the_group():
    assert pa.prefill_tile(14, 2, 64) == (64, 9)  # qwen2.5: 7 heads x 9 tokens = 63 of 64 rows
    assert pa.prefill_tile(32, 8, 128) == (128, 32)
    assert pa.prefill_tile(16, 8, 64) == (64, 32)
    assert pa.prefill_tile(4, 4, 64) == (64, 64)  # no GQA: one head, 64 tokens
    assert pa.prefill_tile(32, 1, 16) == (32, 1)  # a group larger than the tile: one token of it


# a fresh prompt, chunks after cached prefixes (one ending mid-tile, one at a tile boundary),
# decode rows among prompts, a chunk longer than several tiles, lengths that fit no tile
MIXED = [(0, 9), (13, 6), (21, 1), (3, 70), (32, 33), (0, 1), (47, 17)]


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("group", [3, 7])
def test_prefill_and_mixed_batch_match_reference(group, block_size):
    case = attention_case(MIXED, num_heads=2 * group, num_kv_heads=2, head_dim=24, block_size=block_size,
                          dtype=F32, device="cpu", seed=10 + group)
    assert not pa.is_decode_batch(case.q, case.query_start_loc)
    out, ref, cache, ref_cache = run_both(case)
    assert same_cache(cache, ref_cache)
    assert rel_err(out, ref) <= TOL, rel_err(out, ref)


@pytest.mark.parametrize("block_m,block_n",
                         [pytest.param(16, 16, marks=SLOW), pytest.param(32, 16, marks=SLOW), (64, 32), (128, 64)])
def test_prefill_tile_shapes(block_m, block_n):
    # tiles of 2 tokens (group 7 in 16 rows) up to 18; key tiles smaller and larger than them
    use_prefill_config(block_m, block_n)
    case = attention_case(MIXED, num_heads=14, num_kv_heads=2, head_dim=32, block_size=16, dtype=F32,
                          device="cpu", seed=20 + block_m)
    out, ref, cache, ref_cache = run_both(case)
    assert same_cache(cache, ref_cache)
    assert rel_err(out, ref) <= TOL, rel_err(out, ref)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_chunked_prefill_over_a_long_cached_prefix(head_dim):
    # the second chunk of a prompt reads 100 cached tokens through a shuffled block table
    use_prefill_config(32, 16)
    case = attention_case([(100, 23), (0, 5)], num_heads=6, num_kv_heads=2, head_dim=head_dim, block_size=16,
                          dtype=F32, device="cpu", seed=30)
    out, ref, cache, ref_cache = run_both(case)
    assert same_cache(cache, ref_cache)
    assert rel_err(out, ref) <= TOL, rel_err(out, ref)


@pytest.mark.parametrize("pad", [3, 40])
def test_prefill_rows_past_the_last_sequence_are_zero(pad, monkeypatch):
    # the kernel writes the padding rows itself (no fill launch): fresh buffers are poisoned
    # with NaN so a row nobody wrote shows; 40 rows need several surplus tiles
    use_prefill_config(16, 16)
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **kw: empty(*a, **kw).fill_(float("nan"))
                        if kw.get("dtype", torch.float32).is_floating_point else empty(*a, **kw))
    case = attention_case([(0, 5), (2, 3)], num_heads=6, num_kv_heads=2, head_dim=16, block_size=4, dtype=F32,
                          device="cpu", seed=31)
    T = case.q.shape[0]
    g = torch.Generator().manual_seed(32)
    extra = lambda t: torch.cat([t, torch.randn((pad, *t.shape[1:]), generator=g)])  # noqa: E731
    case.q, case.k, case.v = extra(case.q), extra(case.k), extra(case.v)
    case.slot_mapping = torch.cat([case.slot_mapping, torch.full((pad,), -1)])
    out, ref, cache, ref_cache = run_both(case)
    assert not out.isnan().any()
    assert out[T:].abs().sum() == 0
    assert same_cache(cache, ref_cache)
    assert rel_err(out, ref) <= TOL


# ---------------------------------------------------------------------------------------------
# sliding windows and soft-capping: arguments of the same kernels
# ---------------------------------------------------------------------------------------------


def windowed(case: AttnCase, window: int, softcap: float = 0.0) -> AttnCase:
    """``case`` on a sliding layer: blocks wholly before each sequence's window hold NaN and its
    table points them at a NaN block, as after the cache gave them back."""
    case.sliding_window, case.softcap = window, softcap
    if window:
        case.drop_blocks_outside_window()
    return case


@pytest.mark.parametrize("window", [3, 37, 1000])
@pytest.mark.parametrize("max_splits", [1, 3])
def test_decode_on_a_sliding_layer_reads_only_the_window(window, max_splits):
    use_decode_config(block_n=16, max_splits=max_splits)
    case = decode_steps(attention_case([(0, 1), (16, 1), (40, 1), (70, 1), (7, 1)], num_heads=6, num_kv_heads=2,
                                       head_dim=24, block_size=4, dtype=F32, device="cpu", seed=41, max_blocks=32),
                        steps=1, pad_rows=1)[0]
    windowed(case, window)
    out, ref, cache, ref_cache = run_both(case)
    assert same_cache(cache, ref_cache)
    assert rel_err(out, ref) <= TOL, rel_err(out, ref)
    assert counters_are_zero()


def test_decode_window_sizes_the_splits_not_the_block_table():
    use_decode_config(block_n=16, max_splits=64)
    wide = pa.decode_plan(1, 2, 1024, CPU)["NUM_SPLITS"]
    assert wide > pa.decode_plan(1, 2, 32, CPU)["NUM_SPLITS"] == 2


@pytest.mark.parametrize("window", [2, 16, 40, 1000])
@pytest.mark.parametrize("block_size", [4, 16])
def test_prefill_and_mixed_batch_on_a_sliding_layer(window, block_size):
    use_prefill_config(32, 16)
    case = windowed(attention_case(MIXED, num_heads=6, num_kv_heads=2, head_dim=24, block_size=block_size,
                                   dtype=F32, device="cpu", seed=50 + window), window)
    out, ref, cache, ref_cache = run_both(case)
    assert same_cache(cache, ref_cache)
    assert rel_err(out, ref) <= TOL, rel_err(out, ref)


@pytest.mark.parametrize("window", [0, 9])
def test_soft_capped_scores_in_decode_and_prefill(window):
    use_decode_config(block_n=16, max_splits=3)
    use_prefill_config(32, 16)
    prefill = attention_case(MIXED, num_heads=6, num_kv_heads=2, head_dim=24, block_size=4, dtype=F32,
                             device="cpu", seed=60)
    # scores of a few units: a cap of 2 bends them, so a kernel without it is far off
    prefill.q = prefill.q * 3
    decode = decode_steps(attention_case([(40, 1), (3, 1)], num_heads=6, num_kv_heads=2, head_dim=24, block_size=4,
                                         dtype=F32, device="cpu", seed=61, max_blocks=16), steps=1)[0]
    decode.q = decode.q * 3
    for case in (windowed(prefill, window, 2.0), windowed(decode, window, 2.0)):
        out, ref, cache, ref_cache = run_both(case)
        assert same_cache(cache, ref_cache)
        assert rel_err(out, ref) <= TOL, rel_err(out, ref)
        uncapped = ops.paged_attention(*AttnCase(**{**case.__dict__, "softcap": 0.0}).args(case.kv_cache.clone()))
        assert rel_err(uncapped, ref) > 0.05
