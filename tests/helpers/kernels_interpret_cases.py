"""Every Triton kernel against its reference on the CPU, through the Triton interpreter.

Not collected by itself: tests/kernels/test_kernels_interpret.py runs this file in a subprocess with
TRITON_INTERPRET=1 (the variable must be set before the kernels are decorated, and must not leak
into other test files' process). Shapes are small, fp32, and deliberately awkward: head_dim and
hidden sizes that are not powers of two, GQA groups of 3, block sizes smaller than a tile,
shuffled block tables, padding rows.
"""

import os

assert os.environ.get("TRITON_INTERPRET") == "1", "run through tests/kernels/test_kernels_interpret.py"

import pytest  # noqa: E402
import torch  # noqa: E402

from compiled_llm.graph import fused_ops, ops  # noqa: E402
from compiled_llm.kernels import (  # noqa: E402
    launch_configs,
    providers,
    triton_bitmask,
    triton_kv_store,
    triton_norm,
    triton_norm_mlp,
    triton_paged_attention,
    triton_qkv_rope,
)
from helpers.kernel_inputs import attention_case, mlp_gelu_inputs, mlp_glu_inputs, qkv_inputs, rel_err  # noqa: E402

F32 = torch.float32
TOL = 1e-5
# cases the interpreter takes seconds over (big shapes, many programs): the parent test runs them
# as its `slow` group, which `pytest -m "not slow"` leaves out and CI runs
SLOW = pytest.mark.slow


@pytest.fixture(autouse=True)
def _default_configs():
    launch_configs.use_configs(None)
    yield
    launch_configs.use_configs(None)


# ---------------------------------------------------------------------------------------------
# KV store and paged attention
# ---------------------------------------------------------------------------------------------


def test_kv_store_writes_rows_at_slots_and_skips_padding():
    case = attention_case([(5, 3), (0, 4)], 4, 2, 12, 4, F32, "cpu", seed=0, pad_rows=2)
    # k/v as strided views of a wider projection, as a split qkv gives them
    T = case.k.shape[0]
    wide = torch.randn(T, 3, 2, 12)
    k, v = wide[:, 0], wide[:, 2]
    out, ref = case.kv_cache.clone(), case.kv_cache.clone()
    triton_kv_store.kv_store(k, v, out, case.slot_mapping)
    ops.kv_store_ref(k, v, ref, case.slot_mapping)
    assert torch.equal(out.nan_to_num(7.0), ref.nan_to_num(7.0))
    written = out.view(2, -1, 2, 12)[:, case.slot_mapping[case.slot_mapping >= 0]]
    assert torch.isfinite(written).all()
    # padding rows wrote nowhere: NaN slots outside the batch stay NaN
    assert out.isnan().sum() == ref.isnan().sum() > 0


def _check_attention(case, expect_decode: bool):
    assert triton_paged_attention.is_decode_batch(case.q, case.query_start_loc) == expect_decode
    out_cache, ref_cache = case.kv_cache.clone(), case.kv_cache.clone()
    out = triton_paged_attention.paged_attention(*case.args(out_cache))
    ref = ops.paged_attention(*case.args(ref_cache))
    assert torch.equal(out_cache.nan_to_num(7.0), ref_cache.nan_to_num(7.0))
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) <= TOL, rel_err(out, ref)
    return out


@pytest.mark.parametrize("block_size", [4, 16])
def test_prefill_and_mixed_batch_match_reference(block_size):
    # a fresh prompt, a chunk after a cached prefix, a decode row, a chunk longer than BLOCK_M
    specs = [(0, 9), (13, 6), (21, 1), (3, 70)]
    case = attention_case(specs, num_heads=6, num_kv_heads=2, head_dim=24, block_size=block_size,
                          dtype=F32, device="cpu", seed=1)
    _check_attention(case, expect_decode=False)


def test_prefill_leaves_rows_past_the_last_sequence_zero():
    case = attention_case([(0, 5), (2, 3)], 4, 4, 16, 4, F32, "cpu", seed=2)
    T = case.q.shape[0]
    q = torch.cat([case.q, torch.randn(3, 4, 16)])  # rows no sequence owns
    k = torch.cat([case.k, torch.randn(3, 4, 16)])
    v = torch.cat([case.v, torch.randn(3, 4, 16)])
    slots = torch.cat([case.slot_mapping, torch.full((3,), -1)])
    out = triton_paged_attention.paged_attention(q, k, v, case.kv_cache.clone(), slots, case.query_start_loc,
                                                 case.seq_lens, case.block_tables, case.scale)
    ref = ops.paged_attention(q, k, v, case.kv_cache.clone(), slots, case.query_start_loc,
                              case.seq_lens, case.block_tables, case.scale)
    assert out[T:].abs().sum() == 0
    assert rel_err(out, ref) <= TOL


@pytest.mark.parametrize("max_splits,block_n", [(1, 32), (4, 16), (16, 16)])
def test_decode_split_k_matches_reference_with_padding_rows(max_splits, block_n):
    launch_configs.use_configs({"paged_attention_decode": {"inf": {
        "BLOCK_N": block_n, "MAX_SPLITS": max_splits, "num_warps": 4, "num_stages": 1}}})
    # contexts from 1 token to several splits' worth; a wide block table like a runtime's
    specs = [(0, 1), (17, 1), (40, 1), (70, 1)]
    case = attention_case(specs, num_heads=6, num_kv_heads=2, head_dim=24, block_size=4,
                          dtype=F32, device="cpu", seed=3, pad_rows=2, max_blocks=24)
    out = _check_attention(case, expect_decode=True)
    assert out[-2:].abs().sum() == 0  # padding rows (seq_len 0) give zeros


def test_decode_splits_depend_on_shapes_only():
    dev = torch.device("cpu")
    a = triton_paged_attention.num_decode_splits(4, 2, 1024, 32, 16, dev)
    b = triton_paged_attention.num_decode_splits(4, 2, 1024, 32, 16, dev)
    assert a == b and 1 <= a <= 16
    assert triton_paged_attention.num_decode_splits(1, 1, 16, 32, 16, dev) == 1  # one tile of context
    assert triton_paged_attention.num_decode_splits(512, 8, 4096, 32, 16, dev) == 1  # batch fills the GPU


def test_decode_group_of_one_and_head_dim_128():
    case = attention_case([(30, 1), (5, 1)], num_heads=2, num_kv_heads=2, head_dim=128, block_size=16,
                          dtype=F32, device="cpu", seed=4)
    _check_attention(case, expect_decode=True)


# ---------------------------------------------------------------------------------------------
# norms
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("H", [48, 200])
def test_norms_match_reference(H):
    g = torch.Generator().manual_seed(H)
    x, r = torch.randn(7, H, generator=g) * 3 + 1, torch.randn(7, H, generator=g)
    w, b = torch.randn(H, generator=g), torch.randn(H, generator=g)
    assert rel_err(triton_norm.rms_norm(x, w, 1e-6), ops.rms_norm_ref(x, w, 1e-6)) <= TOL
    assert rel_err(triton_norm.layer_norm(x, w, b, 1e-5), ops.layer_norm_ref(x, w, b, 1e-5)) <= TOL
    normed, summed = triton_norm.fused_add_rms_norm(x, r, w, 1e-6)
    ref_n, ref_s = fused_ops.fused_add_rms_norm_ref(x, r, w, 1e-6)
    assert torch.equal(summed, ref_s) and rel_err(normed, ref_n) <= TOL
    normed, summed = triton_norm.fused_add_layer_norm(x, r, w, b, 1e-5)
    ref_n, ref_s = fused_ops.fused_add_layer_norm_ref(x, r, w, b, 1e-5)
    assert torch.equal(summed, ref_s) and rel_err(normed, ref_n) <= TOL
    # Gemma's post-norm: the residual added after the norm
    post = triton_norm.fused_rms_norm_residual(x, w, 1e-6, r)
    assert rel_err(post, fused_ops.fused_rms_norm_residual_ref(x, w, 1e-6, r)) <= TOL
    assert rel_err(post, r + ops.rms_norm_ref(x, w, 1e-6)) <= TOL


def test_rms_norm_of_3d_heads_and_strided_rows():
    g = torch.Generator().manual_seed(5)
    q = torch.randn(5, 3, 40, generator=g)[:, :, :24]  # rows with a stride wider than the row
    w = torch.randn(24, generator=g)
    out = triton_norm.rms_norm(q, w, 1e-6)
    assert out.shape == q.shape
    assert rel_err(out, ops.rms_norm_ref(q, w, 1e-6)) <= TOL


# ---------------------------------------------------------------------------------------------
# QKV + RoPE
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bias,qk_norm,rope", [(True, False, True), (False, True, True), (False, False, True),
                                               (True, False, False)])
def test_qkv_rope_matches_reference(bias, qk_norm, rope):
    # 6 tokens: one token per epilogue program; 37: 16-token programs with a ragged last one
    for T in (6, 37):
        args = qkv_inputs(T, 40, 6, 2, 24, F32, "cpu", seed=6, bias=bias, qk_norm=qk_norm, rope=rope, max_pos=64)
        out = triton_qkv_rope.fused_qkv_rope(*args, form="prefill")
        ref = fused_ops.fused_qkv_rope_ref(*args)
        for o, r in zip(out, ref):
            assert o.shape == r.shape and o.is_contiguous()
            assert rel_err(o, r) <= TOL


def test_rotary_embedding_matches_reference():
    g = torch.Generator().manual_seed(7)
    q, k = torch.randn(5, 4, 20, generator=g), torch.randn(5, 2, 20, generator=g)
    pos = torch.tensor([0, 9, 3, 31, 2])
    cs = ops.rope_cos_sin(20, 32, 10000.0)
    for o, r in zip(triton_qkv_rope.rotary_embedding(q, k, pos, cs), ops.rotary_embedding(q, k, pos, cs)):
        assert rel_err(o, r) <= TOL


# ---------------------------------------------------------------------------------------------
# norm + MLP
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("activation", fused_ops.GLU_ACTIVATIONS)
@pytest.mark.parametrize("form", ["decode", "prefill"])
@pytest.mark.parametrize("T", [1, 3, 20])
def test_rms_norm_glu_mlp_matches_reference(form, T, activation):
    args = mlp_glu_inputs(T, 40, 56, F32, "cpu", seed=T)
    out = triton_norm_mlp.fused_rms_norm_glu_mlp(*args, activation=activation, form=form)
    assert rel_err(out, fused_ops.fused_rms_norm_glu_mlp_ref(*args, activation=activation)) <= TOL


@pytest.mark.parametrize("form", ["decode", "prefill"])
@pytest.mark.parametrize("T", [1, 2, pytest.param(17, marks=SLOW)])
def test_layer_norm_gelu_mlp_matches_reference(form, T):
    args = mlp_gelu_inputs(T, 48, 72, F32, "cpu", seed=T)
    before = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    out = triton_norm_mlp.fused_layer_norm_gelu_mlp(*args, form=form)
    # inputs untouched (an fp32 bias once aliased the kernel's atomic accumulator)
    assert all(torch.equal(a, b) for a, b in zip(args, before) if isinstance(a, torch.Tensor))
    assert rel_err(out, fused_ops.fused_layer_norm_gelu_mlp_ref(*args)) <= TOL


def test_norm_mlp_form_follows_launch_config():
    assert triton_norm_mlp.use_decode_form(1)
    launch_configs.use_configs({"norm_mlp_dispatch": {"inf": {"MAX_DECODE_TOKENS": 2}}})
    assert triton_norm_mlp.use_decode_form(2) and not triton_norm_mlp.use_decode_form(3)


def test_silu_mul_and_gelu():
    g = torch.Generator().manual_seed(8)
    gu = torch.randn(4, 2 * 30, generator=g)
    gate, up = gu.chunk(2, -1)
    assert rel_err(triton_norm_mlp.silu_mul(gu), torch.nn.functional.silu(gate) * up) <= TOL
    h = torch.randn(4, 30, generator=g) * 3
    assert rel_err(triton_norm_mlp.gelu_tanh(h), torch.nn.functional.gelu(h, approximate="tanh")) <= TOL
    geglu = torch.nn.functional.gelu(gate, approximate="tanh") * up
    assert rel_err(triton_norm_mlp.glu_mul(gu, "gelu_tanh"), geglu) <= TOL
    with pytest.raises(ValueError, match="unknown GLU activation"):
        triton_norm_mlp.glu_mul(gu, "gelu")


# the far negative tail overflows exp in the interpreter's sigmoid (numpy warns), giving the
# right limit, 0
@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
def test_gelu_tanh_is_torchs_elementwise_in_fp32():
    """The kernels' tanh (2 sigmoid(2z) - 1, portable across Triton versions) against torch's
    gelu(approximate="tanh"), element by element over both tails and zero: within a few fp32
    ulps of the result, or of 1 where 1 + tanh cancels (torch's tanh loses the same bits)."""
    h = torch.linspace(-12.0, 12.0, 2 * 30 * 41).reshape(41, 2 * 30)
    want = torch.nn.functional.gelu(h, approximate="tanh")
    torch.testing.assert_close(triton_norm_mlp.gelu_tanh(h), want, rtol=4e-7, atol=1e-6)
    gate, up = h.chunk(2, -1)
    geglu = torch.nn.functional.gelu(gate, approximate="tanh") * up
    torch.testing.assert_close(triton_norm_mlp.glu_mul(h, "gelu_tanh"), geglu, rtol=4e-7, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# the provider ops: schema, fake and real implementations agree (torch.library.opcheck)
# ---------------------------------------------------------------------------------------------


def _opcheck_cases():
    attn_prefill = attention_case([(0, 5), (6, 3)], 4, 2, 16, 4, F32, "cpu", seed=9)
    attn_decode = attention_case([(6, 1), (0, 1)], 4, 2, 16, 4, F32, "cpu", seed=10, pad_rows=1)
    g = torch.Generator().manual_seed(11)
    x, r = torch.randn(3, 32, generator=g), torch.randn(3, 32, generator=g)
    w, b = torch.randn(32, generator=g), torch.randn(32, generator=g)
    q, k = torch.randn(3, 4, 16, generator=g), torch.randn(3, 2, 16, generator=g)
    pos, cs = torch.tensor([1, 0, 5]), ops.rope_cos_sin(16, 8, 10000.0)
    nan_free = lambda c: c.kv_cache.nan_to_num(0.0)  # noqa: E731  opcheck compares caches with NaN != NaN
    return {
        "rms_norm": (x, w, 1e-6),
        "layer_norm": (x, w, b, 1e-5),
        "fused_add_rms_norm": (x, r, w, 1e-6),
        "fused_add_layer_norm": (x, r, w, b, 1e-5),
        "fused_rms_norm_residual": (x, w, 1e-6, r),
        "rotary_embedding": (q, k, pos, cs),
        "fused_qkv_rope": qkv_inputs(3, 32, 4, 2, 16, F32, "cpu", 12, bias=True, qk_norm=True, rope=True, max_pos=8),
        "fused_rms_norm_glu_mlp": mlp_glu_inputs(3, 32, 24, F32, "cpu", 13),
        "fused_rms_norm_glu_mlp@gelu_tanh": (*mlp_glu_inputs(3, 32, 24, F32, "cpu", 13), None, "gelu_tanh"),
        "fused_layer_norm_gelu_mlp": mlp_gelu_inputs(3, 32, 24, F32, "cpu", 14),
        "paged_attention": attn_prefill.args(nan_free(attn_prefill)),
        "paged_attention@decode": attn_decode.args(nan_free(attn_decode)),
        "greedy_sample": (torch.randn(3, 3000, generator=g),),
        # temperature 0 everywhere: the draw is the argmax, so opcheck's repeated runs agree
        "temperature_sample": (torch.randn(3, 3000, generator=g), torch.zeros(3)),
        "apply_token_bitmask": (torch.randn(3, 300, generator=g),
                                torch.randint(-2**31, 2**31 - 1, (3, 10), generator=g, dtype=torch.int32)),
    }


@pytest.mark.parametrize("name", list(_opcheck_cases()))
def test_opcheck_triton_provider(name):
    op_name = name.split("@")[0]
    args = _opcheck_cases()[name]
    torch.library.opcheck(providers.provider_op(op_name, providers.TRITON), args)
    torch.library.opcheck(getattr(torch.ops.cllm, op_name), _opcheck_cases()[name])


# ---------------------------------------------------------------------------------------------
# sampling
# ---------------------------------------------------------------------------------------------


@SLOW
def test_gumbel_sampling_draws_from_softmax_and_takes_argmax_at_temperature_0():
    from compiled_llm.kernels.triton_sampling import gumbel_sample

    logits = torch.tensor([1.0, 2.5, -1.0, 0.3, 2.0, -3.0, 0.0])
    rows = 2000
    temps = torch.full((rows,), 0.7)
    temps[0] = 0.0
    ids = gumbel_sample(logits.expand(rows, -1), temps, torch.Generator().manual_seed(1))
    assert ids.dtype == torch.int64 and ids.shape == (rows,)
    assert ids[0].item() == int(logits.argmax())
    freq = torch.bincount(ids[1:], minlength=7).float() / (rows - 1)
    expect = torch.softmax(logits / 0.7, dim=0)
    assert (freq - expect).abs().max() < 0.04, (freq, expect)
    # another seed, other draws: 200 rows show it (the noise of (row, v) is counter row * V + v, so
    # these rows are the first 200 of a 2000-row call with that seed) at a tenth of the programs
    again = gumbel_sample(logits.expand(200, -1), temps[:200], torch.Generator().manual_seed(2))
    assert not torch.equal(ids[:200], again)


def test_greedy_argmax_split_over_the_vocabulary_matches_torch_and_breaks_ties_low():
    from compiled_llm.kernels.triton_sampling import greedy_argmax

    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 5000, generator=gen)
    logits[1, 4999] = 9.0  # in the last, partial chunk
    logits[2, [10, 2100, 4500]] = 7.0  # a tie across chunks: the lowest index wins
    logits[3, :] = 0.5  # all equal: index 0
    logits[4, 1023:1025] = 8.0  # a tie across a block boundary inside one chunk
    for splits in (1, 3, 4):
        ids = greedy_argmax(logits, splits=splits)
        assert ids.dtype == torch.int64
        assert ids.tolist() == logits.argmax(-1).tolist(), splits
    assert greedy_argmax(logits, splits=4)[2].item() == 10


def test_gumbel_sampling_does_not_depend_on_the_split_count():
    from compiled_llm.kernels.triton_sampling import gumbel_sample

    logits = torch.randn(3, 3000, generator=torch.Generator().manual_seed(4))
    temps = torch.tensor([0.8, 0.0, 1.3])
    one = gumbel_sample(logits, temps, torch.Generator().manual_seed(5), splits=1)
    four = gumbel_sample(logits, temps, torch.Generator().manual_seed(5), splits=4)
    assert one.tolist() == four.tolist()
    assert one[1].item() == int(logits[1].argmax())


def test_gumbel_sampling_reads_each_rows_temperature_from_a_strided_view():
    """A row's temperature is its own even when the temperatures are a column of a wider table
    (a view with a stride): greedy rows take their argmax, the rest sample."""
    from compiled_llm.kernels.triton_sampling import gumbel_sample

    logits = torch.randn(6, 2000, generator=torch.Generator().manual_seed(8))
    table = torch.tensor([[0.0, 5000.0], [1.0, 0.0], [0.0, 1.0], [1.0, 0.0], [0.0, 2.0], [1.0, 0.0]])
    strided = table[:, 0]  # stride 2: reading it as contiguous would give row 1 temperature 5000
    ids = gumbel_sample(logits, strided, torch.Generator().manual_seed(3))
    assert ids.tolist() == gumbel_sample(logits, strided.contiguous(), torch.Generator().manual_seed(3)).tolist()
    assert ids[[0, 2, 4]].tolist() == logits[[0, 2, 4]].argmax(-1).tolist()


# ---------------------------------------------------------------------------------------------
# the grammar bitmask of structured output
# ---------------------------------------------------------------------------------------------


def _bitmask_case(seed, rows, words):
    """Random mask words (every bit pattern, the sign bit included), row 1 all -1."""
    bitmask = torch.randint(-2**31, 2**31 - 1, (rows, words), generator=torch.Generator().manual_seed(seed),
                            dtype=torch.int32)
    bitmask[1] = -1
    return bitmask


@pytest.mark.parametrize("dtype", [F32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("words", [4, 3], ids=["mask covers the logits", "mask narrower than the logits"])
def test_bitmask_kernel_masks_a_strided_view_as_the_reference_does(words, dtype):
    """S=3, V=100 logits viewed out of a wider table (row stride 112): the kernel writes the
    disallowed logits of the view, -inf also past a narrower mask (tokens 96..99), and nothing
    beside the view; a row of all -1 words over the whole vocabulary keeps every logit."""
    table = torch.randn(3, 112, generator=torch.Generator().manual_seed(words)).to(dtype)
    bitmask = _bitmask_case(words, 3, words)
    want = table.clone()
    ops.apply_token_bitmask_ref(want[:, :100], bitmask)
    got = table.clone()
    triton_bitmask.apply_token_bitmask(got[:, :100], bitmask)
    assert torch.equal(got, want)
    assert torch.equal(got[:, 100:], table[:, 100:])
    if words == 4:
        assert torch.equal(got[1], table[1])
    else:
        assert torch.isneginf(got[:, 96:100]).all()


def test_bitmask_kernel_takes_logits_with_strided_columns_and_a_strided_mask():
    """Strided columns (a transposed table) and mask words of a column slice: the same -inf."""
    logits = torch.randn(5000, 2, generator=torch.Generator().manual_seed(3)).t()  # [2, 5000], columns 2 apart
    bitmask = _bitmask_case(4, 2, 2 * 157)[:, ::2]
    want = logits.clone()
    ops.apply_token_bitmask_ref(want, bitmask)
    triton_bitmask.apply_token_bitmask(logits, bitmask)
    assert torch.equal(logits, want)


def test_bitmask_kernel_splits_a_row_over_vocabulary_blocks():
    """Several blocks a row (one past BLOCK_V), the last one partial: the same -inf as the reference."""
    V = triton_bitmask.BLOCK_V * 2 + 37
    logits = torch.randn(2, V, generator=torch.Generator().manual_seed(5))
    bitmask = _bitmask_case(6, 2, (V + 31) // 32)
    want = logits.clone()
    ops.apply_token_bitmask_ref(want, bitmask)
    triton_bitmask.apply_token_bitmask(logits, bitmask)
    assert torch.equal(logits, want)


# ---------------------------------------------------------------------------------------------
# custom all-reduce: one rank's kernel over buffers laid out as symmetric memory would be
# ---------------------------------------------------------------------------------------------


def _all_reduce_calls(rank, world, calls, capacity=1 << 19, max_blocks=8):
    """Run ``rank``'s kernel on each call ``(xs, residual)`` in turn, as if the peers had pushed
    their x into this rank's buffer and raised its flags first. Yields, after each call, its
    number, its output, and the header and slots of every rank's buffer."""
    from compiled_llm.kernels import triton_all_reduce as ar

    bufs = [torch.zeros(ar.buffer_bytes(world, capacity), dtype=torch.uint8) for _ in range(world)]
    bases = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64)
    ws = ar.install(ar.Workspace(rank, world, bases, capacity, 10**9, max_blocks, None, bufs[rank]))
    headers = [b[:ar.HEADER_BYTES].view(torch.int64) for b in bufs]
    try:
        for number, (xs, residual) in enumerate(calls, start=1):
            n, dtype = xs[0].numel(), xs[0].dtype
            slots = [b[ar.HEADER_BYTES:].view(dtype).view(2, world, capacity // xs[0].element_size()) for b in bufs]
            for peer in range(world):
                if peer != rank:
                    slots[rank][number % 2, peer, :n].copy_(xs[peer].flatten())
                    for b in range(ar.blocks_for(n, ws)):
                        headers[rank][b * world + peer] = number
            out = ar.all_reduce(xs[rank], residual)
            yield number, out, headers, slots
    finally:
        ar.close_workspace(torch.device("cpu"))


@pytest.mark.parametrize("world,rank,n,max_blocks,blocks,chunk", [
    (2, 0, 5000, 8, 3, 2048),  # one pass, the last chunk partial
    (2, 1, 3 * 8 * 2048 + 37, 8, 7, 8192),  # one pass at the largest chunk (x held in registers)
    (2, 1, 3 * 8 * 2048 + 37, 3, 3, 2048),  # a grid capped lower (the ranks' smallest SM count): blocks loop
    (2, 1, 37, 8, 1, 2048),
    (3, 2, 4100, 8, 3, 2048),  # the sum's order is the ranks', on every rank
])  # fp32 only: the interpreter truncates to bf16 where GPUs round (bf16 on 2 GPUs: test_tensor_parallel_gpu)
def test_custom_all_reduce_sums_the_ranks_in_order_and_adds_the_residual(world, rank, n, max_blocks, blocks, chunk):
    from compiled_llm.kernels import triton_all_reduce as ar

    g = torch.Generator().manual_seed(world * 10 + rank)
    calls = [([torch.randn(n, generator=g) for _ in range(world)],
              torch.randn(n, generator=g) if number != 2 else None) for number in range(1, 4)]
    for number, out, headers, slots in _all_reduce_calls(rank, world, calls, max_blocks=max_blocks):
        xs, residual = calls[number - 1]
        ws = ar.workspace_for(out)
        assert (ar.blocks_for(n, ws), ar.chunk_for(n, ws)) == (blocks, chunk)
        total = torch.zeros(n)
        for x in xs:  # fp32, rank by rank
            total = total + x.float()
        want = total if residual is None else total + residual
        assert torch.equal(out, want), number
        for peer in range(world):
            if peer != rank:  # x pushed into this call's parity of every peer, every block signalled
                assert torch.equal(slots[peer][number % 2, rank, :n], xs[rank]), (number, peer)
                # the grid it ran: blocks 0..blocks-1 signalled, no block past them
                assert [int(headers[peer][b * world + rank]) for b in range(max_blocks)] == \
                    [number] * blocks + [0] * (max_blocks - blocks)
        # the call counter advanced once, and the count of finished blocks is back to zero
        assert int(headers[rank][ar.CALL_INDEX]) == number and int(headers[rank][ar.DONE_INDEX]) == 0


def test_custom_all_reduce_calls_of_any_grid_alternate_parities():
    """A call's blocks share its parity whatever the grid of the calls before (one counter per
    call, not per block): a small call between two large ones leaves the large ones' blocks in
    step."""
    from compiled_llm.kernels import triton_all_reduce as ar

    g = torch.Generator().manual_seed(3)
    sizes = [3 * ar.MIN_CHUNK, 10, 3 * ar.MIN_CHUNK, 5 * ar.MAX_CHUNK]
    calls = [([torch.randn(n, generator=g) for _ in range(2)], None) for n in sizes]
    for number, out, headers, slots in _all_reduce_calls(0, 2, calls):
        xs, _ = calls[number - 1]
        assert torch.equal(out, xs[0] + xs[1]), number
        assert torch.equal(slots[1][number % 2, 0, :xs[0].numel()], xs[0]), number


def test_custom_all_reduce_takes_only_what_its_workspace_holds():
    from compiled_llm.kernels import triton_all_reduce as ar

    x = torch.randn(64, 32)
    assert not ar.handles(x)  # no workspace on this device
    buf = torch.zeros(ar.buffer_bytes(2, 4096), dtype=torch.uint8)
    ar.install(ar.Workspace(0, 2, torch.tensor([buf.data_ptr()] * 2), 4096, 10**9, 8, None, buf))
    try:
        assert ar.handles(torch.randn(32, 32)) and not ar.handles(torch.randn(33, 32))  # 4 KiB
        assert not ar.handles(torch.randn(32, 16).t())
    finally:
        ar.close_workspace(torch.device("cpu"))
    assert not ar.handles(torch.randn(32, 32))
