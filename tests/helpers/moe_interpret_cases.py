"""The mixture-of-experts kernels (triton_fused_moe) against fused_ops.fused_moe_ref on the CPU,
through the Triton interpreter: the device routing, the decode form (two weight-streaming
kernels), the prefill form (the pairs laid out by expert, two grouped GEMMs, the slot sum), and
the registered provider op.

Not collected by itself: tests/kernels/test_fused_moe_interpret.py runs this file in a subprocess
with TRITON_INTERPRET=1 (see tests/kernels/test_kernels_interpret.py for why). Shapes are tiny and
awkward: H = 48 and I = 40 (not powers of two), launch configs with 16-wide blocks so every loop
runs several steps and every edge tile is partial. The experts no token chose hold NaN weights:
a kernel that reads one shows it in its output.

bf16: the interpreter computes bf16 unlike a GPU in two ways that matter here: ``tl.dot``
multiplies bf16 operands' bit patterns as integers (triton-lang/triton#11584), and a cast from
fp32 to bf16 truncates where the GPU rounds to nearest even. ``_interpret_bf16_like_a_gpu``
patches both in this (child) process, so the bf16 cases check that the kernels round where the
reference rounds: under truncation every form is off by ~2e-2, far above BF16_TOL.
"""

import contextlib
import os

assert os.environ.get("TRITON_INTERPRET") == "1", "run through tests/kernels/test_fused_moe_interpret.py"

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.runtime import interpreter  # noqa: E402

from compiled_llm.graph import fused_ops  # noqa: E402
from compiled_llm.kernels import launch_configs, triton_fused_moe  # noqa: E402
from helpers.kernel_inputs import rel_err  # noqa: E402

F32, BF16 = torch.float32, torch.bfloat16
DTYPES = {"fp32": F32, "bf16": BF16}  # test ids name them
TOL = {F32: 1e-5, BF16: 5e-3}  # bf16: a sum order that differs from torch's may flip a rounding
H, I = 48, 40
# cases the interpreter takes seconds over: the parent test runs them as its `slow` group
SLOW = pytest.mark.slow

# every loop several steps deep and every edge tile partial at H = 48, I = 40
TINY_DECODE = {
    "fused_moe_route": {"inf": {"BLOCK_R": 2, "BLOCK_H": 16, "num_warps": 1, "num_stages": 1}},
    "fused_moe_decode": {"inf": {"BLOCK_I": 16, "BLOCK_H": 16, "num_warps": 1, "num_stages": 1}},
    "fused_moe_down": {"inf": {"BLOCK_N": 16, "BLOCK_K": 16, "num_warps": 1, "num_stages": 1}},
}
TINY_GEMM = {"fused_moe_gemm": {"inf": {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": 2,
                                        "num_warps": 1, "num_stages": 1}}}


# ---------------------------------------------------------------------------------------------
# the interpreter's bf16, as a GPU computes it (see the module docstring)
# ---------------------------------------------------------------------------------------------


def _as_fp32(handle):
    if handle.dtype.scalar != tl.bfloat16:
        return handle
    data = interpreter._convert_float(handle.data, tl.bfloat16, tl.float32, None).view(np.float32)
    return interpreter.TensorHandle(data, tl.float32)


def _to_bf16_nearest_even(src, dst_type):
    """fp32 -> bf16 rounded to nearest even (the GPU's cvt.rn), by torch; None for other casts."""
    if not (src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16):
        return None
    data = np.asarray(src.data, dtype=np.float32)
    bits = torch.from_numpy(np.ascontiguousarray(data).reshape(-1)).to(BF16).view(torch.int16).numpy()
    return interpreter.TensorHandle(bits.view(np.uint16).reshape(data.shape), tl.bfloat16)


def _interpret_bf16_like_a_gpu():
    builder = interpreter.InterpreterBuilder
    dot, cast, fp_to_fp = builder.create_dot, builder.cast_impl, builder.create_fp_to_fp

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return dot(self, _as_fp32(a), _as_fp32(b), d, input_precision, max_num_imprecise_acc)

    def cast_impl(self, src, dst_type):
        rounded = _to_bf16_nearest_even(src, dst_type)  # a TensorHandle's truth is data.all()
        return rounded if rounded is not None else cast(self, src, dst_type)

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        rounded = _to_bf16_nearest_even(src, dst_type)
        return rounded if rounded is not None else fp_to_fp(self, src, dst_type, rounding_mode)

    builder.create_dot, builder.cast_impl, builder.create_fp_to_fp = create_dot, cast_impl, create_fp_to_fp


_interpret_bf16_like_a_gpu()


# ---------------------------------------------------------------------------------------------
# inputs
# ---------------------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def _default_configs():
    launch_configs.use_configs(None)
    yield
    launch_configs.use_configs(None)


def _moe_inputs(T, E, dtype, seed):
    """(x [T, H], router_weight [E, H], gate_up_weight [E, 2I, H], down_weight [E, H, I])."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=gen)
    router = torch.randn(E, H, generator=gen) * H ** -0.5
    gate_up = torch.randn(E, 2 * I, H, generator=gen) * H ** -0.5
    down = torch.randn(E, H, I, generator=gen) * I ** -0.5
    return tuple(t.to(dtype) for t in (x, router, gate_up, down))


def _one_expert_for_all(T, E, dtype, seed):
    """Inputs where every token's first choice is expert 0 and no token chooses expert E - 1: a
    constant column of x that the router weighs +3 for expert 0, -3 for expert E - 1 and 0 for
    the rest, over logits of spread ~0.3 otherwise."""
    x, router, gate_up, down = (t.float() for t in _moe_inputs(T, E, F32, seed))
    x[:, 0] = 1.0
    router *= 0.3
    router[:, 0] = 0.0
    router[0, 0], router[E - 1, 0] = 3.0, -3.0
    return tuple(t.to(dtype) for t in (x, router, gate_up, down))


def _unchosen_as_nan(args, top_k):
    """The inputs with every expert that no token routes to (the reference's routing) filled
    with NaN, and the number of such experts."""
    x, router, gate_up, down = args
    _, ids = fused_ops.moe_routing_ref(x, router, top_k, False)
    unchosen = torch.ones(router.shape[0], dtype=torch.bool)
    unchosen[ids.flatten()] = False
    gate_up, down = gate_up.clone(), down.clone()
    gate_up[unchosen] = float("nan")
    down[unchosen] = float("nan")
    return (x, router, gate_up, down), int(unchosen.sum())


def _assert_matches(out, ref):
    """out is the reference up to sum order. In bf16 nearly every element is bit-identical:
    a dropped or misplaced rounding leaves a third to two thirds of them an ulp off, which a
    norm-wise tolerance loose enough for bf16 would let through."""
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert rel_err(out, ref) <= TOL[ref.dtype], rel_err(out, ref)
    if ref.dtype == BF16:
        assert (out == ref).float().mean() >= 0.95, (out == ref).float().mean()


def _check_reads_only_the_chosen_experts(args, top_k, renormalize, form, norm=()):
    """The kernels' output over NaN-filled unchosen experts equals the reference's over the
    clean weights (the dense reference reads every expert). ``norm``: (norm weight, eps,
    residual), the op's optional arguments, when given."""
    ref = fused_ops.fused_moe_ref(*args, top_k, renormalize, *norm)
    routed = args if not norm else (fused_ops.rms_norm_ref(args[0], norm[0], norm[1]), *args[1:])
    poisoned, _ = _unchosen_as_nan(routed, top_k)
    poisoned = (args[0], *poisoned[1:])
    out = triton_fused_moe.fused_moe(*poisoned, top_k, renormalize, *norm, form=form)
    assert torch.isfinite(out).all(), "read an expert no token chose"
    _assert_matches(out, ref)


@contextlib.contextmanager
def _recorded_loads():
    """The addresses every kernel load reads (its lanes the mask lets through) while the block
    runs, as a list of uint64 arrays."""
    builder = interpreter.InterpreterBuilder
    load = builder.create_masked_load
    seen = []

    def create_masked_load(self, ptrs, mask, other, cache_policy, is_volatile):
        addresses = np.asarray(ptrs.data)
        seen.append(addresses[np.broadcast_to(np.asarray(mask.data, dtype=bool), addresses.shape)].ravel())
        return load(self, ptrs, mask, other, cache_policy, is_volatile)

    builder.create_masked_load = create_masked_load
    try:
        yield seen
    finally:
        builder.create_masked_load = load


def _experts_read(addresses, buffer):
    """The experts (indices along dim 0) of ``buffer`` that ``addresses`` fall in."""
    base, per_expert = buffer.data_ptr(), buffer.stride(0) * buffer.element_size()
    inside = addresses[(addresses >= base) & (addresses < base + buffer.numel() * buffer.element_size())]
    return set(((inside - base) // per_expert).tolist())


# ---------------------------------------------------------------------------------------------
# routing
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,E,top_k", [(5, 8, 2), (33, 4, 1), (2, 8, 3)])
def test_router_picks_the_reference_top_k_with_its_weights(T, E, top_k, dtype, renormalize):
    x, router, _, _ = _moe_inputs(T, E, DTYPES[dtype], seed=T + E)
    weights, ids = triton_fused_moe.route(x, router, top_k, renormalize)
    want_weights, want_ids = fused_ops.moe_routing_ref(x, router, top_k, renormalize)
    assert ids.dtype == torch.int32 and torch.equal(ids.long(), want_ids)
    assert weights.dtype == torch.float32 and torch.allclose(weights, want_weights, rtol=1e-6, atol=1e-7)


# ---------------------------------------------------------------------------------------------
# the two forms
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("T,E,top_k,renormalize,dtype", [
    (1, 4, 1, False, "fp32"),
    (2, 8, 2, True, "fp32"),
    (5, 8, 2, False, "fp32"),
    (1, 8, 2, True, "bf16"),
    (5, 4, 2, True, "bf16"),
    pytest.param(33, 8, 2, False, "bf16", marks=SLOW),
])
def test_decode_form_reads_only_the_chosen_experts_and_matches_the_reference(T, E, top_k, renormalize, dtype):
    launch_configs.use_configs(TINY_DECODE)
    _check_reads_only_the_chosen_experts(_moe_inputs(T, E, DTYPES[dtype], seed=10 + T), top_k, renormalize, "decode")


@pytest.mark.parametrize("T,E,top_k,renormalize,dtype", [
    (1, 4, 1, True, "fp32"),
    (5, 8, 2, True, "fp32"),
    (33, 8, 2, False, "fp32"),
    (2, 8, 2, False, "bf16"),
    (33, 4, 1, True, "bf16"),
])
def test_prefill_form_reads_only_the_chosen_experts_and_matches_the_reference(T, E, top_k, renormalize, dtype):
    launch_configs.use_configs(TINY_GEMM)
    _check_reads_only_the_chosen_experts(_moe_inputs(T, E, DTYPES[dtype], seed=20 + T), top_k, renormalize, "prefill")


def _norm_and_residual(T, dtype, seed):
    """(norm weight [H], eps, residual [T, H]): the op's input norm and residual."""
    gen = torch.Generator().manual_seed(seed)
    return ((torch.rand(H, generator=gen) + 0.5).to(dtype), 1e-6, torch.randn(T, H, generator=gen).to(dtype))


@pytest.mark.parametrize("form,T,dtype", [("decode", 1, "fp32"), ("decode", 3, "bf16"), ("prefill", 5, "fp32"),
                                          ("prefill", 33, "bf16")])
def test_both_forms_normalise_their_input_and_add_the_residual_as_the_reference(form, T, dtype):
    launch_configs.use_configs({**TINY_DECODE, **TINY_GEMM})
    E, top_k = 8, 2
    args = _moe_inputs(T, E, DTYPES[dtype], seed=60 + T)
    _check_reads_only_the_chosen_experts(args, top_k, True, form, _norm_and_residual(T, DTYPES[dtype], seed=61))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_norm", [True, False])
def test_decode_routing_is_one_launch_that_routes_every_token_and_leaves_its_counters_at_zero(with_norm, dtype):
    """Several programs per token (two router rows each) count in; the last one writes the
    token's routing. Twice in a row, so the counters must have been reset by the first call."""
    launch_configs.use_configs(TINY_DECODE)
    T, E, top_k = 4, 7, 3
    x, router, _, _ = _moe_inputs(T, E, DTYPES[dtype], seed=70)
    norm_weight, eps, _ = _norm_and_residual(T, DTYPES[dtype], seed=71)
    if not with_norm:
        norm_weight = None
    normed = fused_ops.rms_norm_ref(x, norm_weight, eps) if with_norm else x
    want_weights, want_ids = fused_ops.moe_routing_ref(normed, router, top_k, True)
    for _ in range(2):
        xn, weights, ids = triton_fused_moe._route_decode(x, norm_weight, eps, router, top_k, True, pdl=False)
        assert torch.equal(ids.long(), want_ids)
        assert torch.allclose(weights, want_weights, rtol=1e-6, atol=1e-7)
        if dtype == "fp32":
            torch.testing.assert_close(xn, normed, rtol=1e-6, atol=1e-6)
        else:  # an rstd summed in another order may move a rounding or two
            assert (xn == normed).float().mean() >= 0.95
        assert not triton_fused_moe._route_counters(x.device).any()


def test_a_decode_call_with_more_tokens_than_routing_counters_routes_in_two_launches(monkeypatch):
    """Past ROUTE_COUNTERS tokens the decode form normalises and routes as the prefill form does
    (triton_norm, then the router and the top-k kernel), with the same result."""
    launch_configs.use_configs(TINY_DECODE)
    monkeypatch.setattr(triton_fused_moe, "ROUTE_COUNTERS", 2)
    T, E, top_k = 3, 8, 2
    args = _moe_inputs(T, E, F32, seed=80)
    _check_reads_only_the_chosen_experts(args, top_k, True, "decode", _norm_and_residual(T, F32, seed=81))


@pytest.mark.parametrize("form,T,dtype", [("decode", 3, "fp32"), ("prefill", 33, "fp32"), ("prefill", 33, "bf16")])
def test_every_token_choosing_one_expert_and_an_expert_nobody_chooses(form, T, dtype):
    """At the default launch configs: expert 0 takes every token (in the prefill form, 33 rows:
    three blocks of one expert), expert E - 1 none (its weights NaN)."""
    E, top_k = 8, 2
    args = _one_expert_for_all(T, E, DTYPES[dtype], seed=30 + T)
    _, ids = fused_ops.moe_routing_ref(args[0], args[1], top_k, False)
    assert (ids[:, 0] == 0).all() and not (ids == E - 1).any()  # the premise
    for renormalize in (False, True):
        _check_reads_only_the_chosen_experts(args, top_k, renormalize, form)


@pytest.mark.parametrize("form,T", [("decode", 2), ("prefill", 5)])
def test_the_kernels_load_no_weight_of_an_expert_no_token_chose(form, T):
    """Every weight address the kernels read, at the default launch configs, lies in a chosen
    expert. Each weight is a view of a buffer one expert longer: a read past the last expert
    (a padding block of the prefill layout that did not exit) lands in that guard expert."""
    E, top_k = 8, 2
    x, router, gate_up, down = _moe_inputs(T, E, F32, seed=50 + T)
    gate_up_buffer = torch.cat([gate_up, torch.zeros_like(gate_up[:1])])
    down_buffer = torch.cat([down, torch.zeros_like(down[:1])])
    _, ids = fused_ops.moe_routing_ref(x, router, top_k, False)
    chosen = set(ids.flatten().tolist())
    assert len(chosen) < E  # the premise: some expert is left out
    with _recorded_loads() as loads:
        out = triton_fused_moe.fused_moe(x, router, gate_up_buffer[:E], down_buffer[:E], top_k, False, form=form)
    addresses = np.concatenate(loads)
    assert _experts_read(addresses, gate_up_buffer) == chosen
    assert _experts_read(addresses, down_buffer) == chosen
    _assert_matches(out, fused_ops.fused_moe_ref(x, router, gate_up, down, top_k, False))


def test_the_registered_provider_runs_the_kernels():
    """cllm::fused_moe__triton (what select_kernels swaps in) takes the op's arguments."""
    from compiled_llm.kernels import providers

    args = _moe_inputs(3, 4, F32, seed=40)
    out = providers.provider_op("fused_moe", "triton")(*args, 2, True)
    _assert_matches(out, fused_ops.fused_moe_ref(*args, 2, True))


def test_no_tokens_give_an_empty_output():
    x, router, gate_up, down = _moe_inputs(0, 4, F32, seed=41)
    for form in triton_fused_moe.FORMS:
        assert triton_fused_moe.fused_moe(x, router, gate_up, down, 2, True, form=form).shape == (0, H)


def test_the_form_follows_the_dispatch_table():
    limit = launch_configs.DEFAULT_CONFIGS["fused_moe_dispatch"]["inf"]["MAX_DECODE_PAIRS"]
    assert triton_fused_moe.use_decode_form(limit // 2, 2) and not triton_fused_moe.use_decode_form(limit // 2 + 1, 2)
    with pytest.raises(ValueError, match="form must be"):
        triton_fused_moe.fused_moe(*_moe_inputs(1, 4, F32, seed=42), 1, False, form="fast")


# ---------------------------------------------------------------------------------------------
# the prefill form's layout
# ---------------------------------------------------------------------------------------------


def test_prefill_layout_groups_the_pairs_by_expert_in_whole_blocks():
    """Expert 0: 3 pairs, expert 1: none, expert 2: exactly one block, expert 3: a block and one,
    in blocks of 4 rows: each block one expert's, its pairs in token order, padding rows marked
    with the pair count, the rows in use on the device, the buffer sized for the worst case."""
    block_m, E = 4, 4
    ids = torch.tensor([[3, 0], [2, 3], [0, 2], [3, 2], [2, 3], [3, 0]], dtype=torch.int32)
    num_pairs = ids.numel()
    sorted_pairs, block_expert, num_padded = triton_fused_moe.expert_blocks(ids, E, block_m)
    assert sorted_pairs.shape == (-(-(num_pairs + E * (block_m - 1)) // block_m) * block_m,)
    assert block_expert.shape == (sorted_pairs.shape[0] // block_m,)
    assert num_padded.tolist() == [4 + 0 + 4 + 8]
    used = sorted_pairs[: int(num_padded)].view(-1, block_m)
    flat = ids.flatten()
    want = {0: [[1, 4, 11, num_pairs]], 2: [[2, 5, 7, 8]], 3: [[0, 3, 6, 9], [10, num_pairs, num_pairs, num_pairs]]}
    got = {}
    for block, expert in zip(used.tolist(), block_expert[: used.shape[0]].tolist()):
        got.setdefault(expert, []).append(block)
        assert all(flat[p] == expert for p in block if p < num_pairs)
    assert got == want
