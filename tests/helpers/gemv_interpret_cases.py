"""The weight-streaming GEMV kernels against their references on the CPU, through the Triton
interpreter: triton_gemv (o projection + residual, and the plain linear), the norm + MLP decode form (gate/up kernel +
down GEMV), and the one-launch q/k/v decode kernel.

Not collected by itself: tests/kernels/test_gemv_interpret.py runs this file in a subprocess with
TRITON_INTERPRET=1 (see tests/kernels/test_kernels_interpret.py for why). Shapes are small, fp32 and
awkward on purpose: N and K not multiples of the blocks, half-heads that are not powers of two,
GQA groups of 3, more rows than BLOCK_T, launch configs with tiny blocks so every loop runs
several steps and every edge tile is partial.
"""

import os

assert os.environ.get("TRITON_INTERPRET") == "1", "run through tests/kernels/test_gemv_interpret.py"

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from compiled_llm.graph import fused_ops, ops  # noqa: E402
from compiled_llm.kernels import launch_configs, triton_gemv, triton_norm, triton_norm_mlp, triton_qkv_rope  # noqa: E402
from helpers.kernel_inputs import mlp_gelu_inputs, mlp_glu_inputs, qkv_inputs, rel_err  # noqa: E402

F32 = torch.float32
TOL = 1e-5
# cases the interpreter takes seconds over (big shapes, many programs): the parent test runs them
# as its `slow` group, which `pytest -m "not slow"` leaves out and CI runs
SLOW = pytest.mark.slow
MAX_TOKENS = launch_configs.DEFAULT_CONFIGS["gemv_dispatch"]["inf"]["MAX_TOKENS"]

# every loop several steps deep and every edge tile partial at the shapes below
TINY_GEMV = {"BLOCK_T": 2, "BLOCK_N": 4, "BLOCK_K": 16, "num_warps": 1, "num_stages": 1}
TINY_MLP = {"BLOCK_T": 2, "BLOCK_I": 4, "BLOCK_H": 16, "num_warps": 1, "num_stages": 1}
TINY_QKV = {"BLOCK_T": 2, "BLOCK_P": 4, "BLOCK_K": 16, "num_warps": 1, "num_stages": 1}


@pytest.fixture(autouse=True)
def _default_configs():
    launch_configs.use_configs(None)
    yield
    launch_configs.use_configs(None)


def _rand(gen, *shape, scale=1.0):
    return torch.randn(shape, generator=gen) * scale


def _linear_case(T, N, K, bias, seed, lead=()):
    gen = torch.Generator().manual_seed(seed)
    x = _rand(gen, *lead, T, K)
    w = _rand(gen, N, K, scale=K ** -0.5)
    b = _rand(gen, N, scale=0.5) if bias else None
    r = _rand(gen, *lead, T, N)
    return x, w, b, r


# ---------------------------------------------------------------------------------------------
# GEMV: linear + residual
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("T", [*range(1, MAX_TOKENS + 1), MAX_TOKENS + 5])
def test_linear_residual_matches_reference(T, bias):
    x, w, b, r = _linear_case(T, 37, 50, bias, seed=T)
    before = [t.clone() for t in (x, w, r)]
    out = triton_gemv.linear_residual(x, w, b, r)
    ref = fused_ops.fused_linear_residual_ref(x, w, b, r)
    assert out.shape == ref.shape and out.dtype == ref.dtype and out.is_contiguous()
    assert rel_err(out, ref) <= TOL
    assert all(torch.equal(a, c) for a, c in zip((x, w, r), before))  # inputs untouched
    assert out.data_ptr() != r.data_ptr()  # a fresh output, never the residual updated in place


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("T", [1, 3, MAX_TOKENS + 5])
def test_linear_matches_reference(T, bias):
    """cllm::linear (a sharded program's row-parallel linear): the GEMV at decode sizes, cuBLAS's
    form above."""
    x, w, b, _ = _linear_case(T, 37, 50, bias, seed=100 + T)
    out = triton_gemv.linear(x, w, b)
    ref = fused_ops.linear_ref(x, w, b)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert rel_err(out, ref) <= TOL


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("T", [1, 5])
def test_gemv_with_tiny_blocks_covers_partial_tiles(T, bias):
    # 5 rows = 3 row blocks, 37 outputs = 10 row tiles (last has 1 row), 50 columns = 4 chunks
    launch_configs.use_configs({"gemv": {"inf": TINY_GEMV}})
    x, w, b, r = _linear_case(T, 37, 50, bias, seed=10 + T)
    assert rel_err(triton_gemv.gemv(x, w, b, r), r + F.linear(x, w, b)) <= TOL
    assert rel_err(triton_gemv.gemv(x, w, b), F.linear(x, w, b)) <= TOL


@pytest.mark.parametrize("tiny", [False, True])
@pytest.mark.parametrize("T", [1, 3])
def test_int8_gemv_equals_the_linear_of_the_dequantized_weight(T, tiny):
    """Weight-only int8: the weights stream as int8, the output channel's scale applies once
    after the K loop; the result is the linear of the dequantized weight."""
    from compiled_llm.graph.quantized_ops import dequantize, quantize

    if tiny:
        launch_configs.use_configs({"gemv": {"inf": TINY_GEMV}})
    x, w, b, r = _linear_case(T, 37, 50, True, seed=20 + T)
    q, scale, _ = quantize(w, "int8")
    deq = dequantize(q, scale, None, F32)
    assert rel_err(triton_gemv.gemv(x, q, b, r, scale=scale), r + F.linear(x, deq, b)) <= TOL
    assert rel_err(triton_gemv.gemv(x, q, scale=scale), F.linear(x, deq)) <= TOL


def test_gemv_takes_leading_dims_and_strided_rows():
    gen = torch.Generator().manual_seed(3)
    wide = _rand(gen, 2, 3, 80)
    x = wide[..., 5:55]  # rows with a stride wider than the row
    w, r = _rand(gen, 37, 50), _rand(gen, 2, 3, 37)
    out = triton_gemv.linear_residual(x, w, None, r)
    assert out.shape == (2, 3, 37)
    assert rel_err(out, fused_ops.fused_linear_residual_ref(x, w, None, r)) <= TOL
    w_t = _rand(gen, 50, 37).t()  # a weight whose rows are not contiguous
    assert rel_err(triton_gemv.gemv(x, w_t), F.linear(x, w_t)) <= TOL


def test_gemv_of_no_rows_is_empty():
    x, w, b, r = _linear_case(0, 37, 50, True, seed=4)
    assert triton_gemv.linear_residual(x, w, b, r).shape == (0, 37)


def test_linear_residual_switches_to_cublas_above_max_tokens():
    assert triton_gemv.use_gemv(MAX_TOKENS) and not triton_gemv.use_gemv(MAX_TOKENS + 1)
    launch_configs.use_configs({"gemv_dispatch": {"inf": {"MAX_TOKENS": 2}}})
    assert triton_gemv.use_gemv(2) and not triton_gemv.use_gemv(3)


def test_warps_lie_along_k_in_whole_vectors():
    # bf16: 8 elements a 16-byte vector, so 1024 columns hold 128 vectors = 4 warps
    assert triton_gemv.warps_along_k(1024, 2, 8) == 4
    assert triton_gemv.warps_along_k(1024, 4, 8) == 8  # fp32: 4 elements a vector
    assert triton_gemv.warps_along_k(4096, 2, 8) == 8  # capped by the config
    assert triton_gemv.warps_along_k(64, 2, 4) == 1  # never fewer than one
    assert triton_gemv.warps_along_k(1536, 2, 8) == 4  # a power of two


def test_tile_config_caps_blocks_at_the_problem_size():
    cfg = {"BLOCK_T": 8, "BLOCK_N": 16, "BLOCK_K": 4096, "num_warps": 8}
    tile = triton_gemv.tile_config(cfg, T=3, rows=5, K=50, itemsize=2)
    assert tile == {"BLOCK_T": 4, "BLOCK_ROWS": 8, "BLOCK_K": 64, "num_warps": 1, "num_stages": 1}
    # a hand-written table with values that are not powers of two still launches
    odd = {"BLOCK_T": 3, "BLOCK_N": 3, "BLOCK_K": 1000, "num_warps": 3, "num_stages": 2}
    tile = triton_gemv.tile_config(odd, T=3, rows=100, K=4096, itemsize=2)
    assert tile == {"BLOCK_T": 4, "BLOCK_ROWS": 4, "BLOCK_K": 1024, "num_warps": 2, "num_stages": 2}


# ---------------------------------------------------------------------------------------------
# norm + MLP: decode form (two GEMV launches) and prefill form, with and without residual
# ---------------------------------------------------------------------------------------------


def _residual(T, H, seed):
    return torch.randn((T, H), generator=torch.Generator().manual_seed(seed))


GLU_FORMS = [("decode", 1), ("decode", 3), ("decode", 7), ("prefill", 2), ("prefill", 9)]


# SwiGLU (Llama, Qwen) with and without the residual epilogue; GeGLU (Gemma) without it, since
# the epilogue does not depend on the activation, nor at 7 rows, whose extra row blocks do not either
@pytest.mark.parametrize("form,T,with_residual,activation", [
    *[(form, T, with_residual, "silu") for form, T in GLU_FORMS for with_residual in (False, True)],
    *[(form, T, False, "gelu_tanh") for form, T in GLU_FORMS if T != 7]])
def test_rms_norm_glu_mlp_matches_reference(form, T, with_residual, activation):
    args = mlp_glu_inputs(T, 40, 56, F32, "cpu", seed=20 + T)
    r = _residual(T, 40, T) if with_residual else None
    out = triton_norm_mlp.fused_rms_norm_glu_mlp(*args, residual=r, activation=activation, form=form)
    assert rel_err(out, fused_ops.fused_rms_norm_glu_mlp_ref(*args, residual=r, activation=activation)) <= TOL


@pytest.mark.parametrize("activation", fused_ops.GLU_ACTIVATIONS)
@pytest.mark.parametrize("form,T", [("decode", 1), ("prefill", 9)])
def test_rms_norm_glu_mlp_with_its_own_input_as_residual(form, T, activation):
    # h + mlp(norm(h)), as every Llama/Qwen layer calls it: the prefill form accumulates down into
    # the copy of h its norm launch writes; h itself must stay untouched
    x, *rest = mlp_glu_inputs(T, 40, 56, F32, "cpu", seed=70 + T)
    before = x.clone()
    out = triton_norm_mlp.fused_rms_norm_glu_mlp(x, *rest, residual=x, activation=activation, form=form)
    assert torch.equal(x, before) and out.data_ptr() != x.data_ptr()
    assert rel_err(out, fused_ops.fused_rms_norm_glu_mlp_ref(x, *rest, residual=x, activation=activation)) <= TOL


def test_rms_norm_and_copy_returns_the_norm_and_a_fresh_copy():
    x = _residual(6, 40, 71)
    w = _residual(1, 40, 72)[0]
    normed, copy = triton_norm.rms_norm_and_copy(x, w, 1e-6)
    assert rel_err(normed, triton_norm.rms_norm(x, w, 1e-6)) == 0.0
    assert torch.equal(copy, x) and copy.data_ptr() != x.data_ptr()


@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("form,T", [("decode", 1), ("decode", 3), pytest.param("decode", 7, marks=SLOW), ("prefill", 2),
                                    ("prefill", 9)])
def test_layer_norm_gelu_mlp_matches_reference(form, T, with_residual):
    args = mlp_gelu_inputs(T, 48, 72, F32, "cpu", seed=30 + T)
    r = _residual(T, 48, T) if with_residual else None
    before = [a.clone() for a in args if isinstance(a, torch.Tensor)]
    out = triton_norm_mlp.fused_layer_norm_gelu_mlp(*args, residual=r, form=form)
    assert all(torch.equal(a, b) for a, b in zip([a for a in args if isinstance(a, torch.Tensor)], before))
    assert rel_err(out, fused_ops.fused_layer_norm_gelu_mlp_ref(*args, residual=r)) <= TOL


# GeGLU at 1 row only: the general kernel's row blocks do not depend on the gate's activation
# (SwiGLU takes them at 5 rows; GeGLU takes the general kernel in test_rms_norm_glu_mlp_matches_reference)
@pytest.mark.parametrize("mlp,T", [("swiglu", 1), ("geglu", 1), ("gelu", 1), pytest.param("swiglu", 5, marks=SLOW),
                                   pytest.param("gelu", 5, marks=SLOW)])
def test_norm_mlp_decode_with_tiny_blocks(mlp, T):
    # 5 rows in blocks of 2 (1 row: the one-row kernels), 56/72 intermediate rows in blocks of 4,
    # H in chunks of 16 (last partial)
    launch_configs.use_configs({"norm_mlp_decode": {"inf": TINY_MLP}, "norm_mlp_down": {"inf": TINY_GEMV}})
    r = _residual(T, 40, 42)
    if mlp == "gelu":
        args = mlp_gelu_inputs(T, 40, 72, F32, "cpu", seed=40)
        out = triton_norm_mlp.fused_layer_norm_gelu_mlp(*args, residual=r, form="decode")
        assert rel_err(out, fused_ops.fused_layer_norm_gelu_mlp_ref(*args, residual=r)) <= TOL
        return
    activation = "gelu_tanh" if mlp == "geglu" else "silu"
    args = mlp_glu_inputs(T, 40, 56, F32, "cpu", seed=41)
    out = triton_norm_mlp.fused_rms_norm_glu_mlp(*args, residual=r, activation=activation, form="decode")
    assert rel_err(out, fused_ops.fused_rms_norm_glu_mlp_ref(*args, r, activation)) <= TOL


@pytest.mark.parametrize("T", [1, 3])  # the one-row kernel, the general one
@pytest.mark.parametrize("activation", fused_ops.GLU_ACTIVATIONS)
def test_norm_mlp_decode_activation_is_the_gate_activation_times_up(activation, T):
    x, nw, eps, gate_up, _ = mlp_glu_inputs(T, 40, 56, F32, "cpu", seed=43)
    act = triton_norm_mlp.decode_activation(x, nw, None, eps, gate_up, None, True, True, activation=activation)
    gate, up = F.linear(ops.rms_norm_ref(x, nw, eps), gate_up).chunk(2, -1)
    want = F.silu(gate) * up if activation == "silu" else F.gelu(gate, approximate="tanh") * up
    assert act.shape == (T, 56) and rel_err(act, want) <= TOL


def test_norm_mlp_refuses_an_unknown_activation():
    """A name the kernels do not know (a tampered program.json) is an error, never silu."""
    args = mlp_glu_inputs(1, 40, 56, F32, "cpu", seed=44)
    for form in ("decode", "prefill"):
        with pytest.raises(ValueError, match="unknown GLU activation 'gelu'"):
            triton_norm_mlp.fused_rms_norm_glu_mlp(*args, activation="gelu", form=form)


def test_norm_mlp_takes_leading_dims():
    x, *rest = mlp_glu_inputs(6, 40, 56, F32, "cpu", seed=44)
    x3, r3 = x.view(2, 3, 40), _residual(6, 40, 45).view(2, 3, 40)
    out = triton_norm_mlp.fused_rms_norm_glu_mlp(x3, *rest, residual=r3, form="decode")
    assert out.shape == (2, 3, 40)
    assert rel_err(out, fused_ops.fused_rms_norm_glu_mlp_ref(x3, *rest, residual=r3)) <= TOL


def test_norm_mlp_form_follows_launch_config():
    limit = launch_configs.DEFAULT_CONFIGS["norm_mlp_dispatch"]["inf"]["MAX_DECODE_TOKENS"]
    assert triton_norm_mlp.use_decode_form(limit) and not triton_norm_mlp.use_decode_form(limit + 1)
    with pytest.raises(ValueError):
        triton_norm_mlp.fused_rms_norm_glu_mlp(*mlp_glu_inputs(1, 40, 56, F32, "cpu", 0), form="fast")


# ---------------------------------------------------------------------------------------------
# q/k/v: one decode launch from x (optionally RMS-normalised) to q, k, v
# ---------------------------------------------------------------------------------------------

POSITIONS = [7, 0, 63, 5, 33, 1, 40]  # out of order, odd, the table's first and last row

# (bias, q/k norm, rope, head_dim): Qwen2 (bias, rope), Qwen3 (q/k norm), half-heads of 12 that
# are not a power of two, no rope
QKV_KINDS = [(True, False, True, 24), (False, True, True, 32), (False, True, False, 16),
             (True, False, False, 24), (False, False, True, 24)]


def _qkv_args(T, bias, qk_norm, rope, head_dim, seed):
    args = list(qkv_inputs(T, 40, 6, 2, head_dim, F32, "cpu", seed=seed, bias=bias, qk_norm=qk_norm, rope=rope,
                           max_pos=64))
    args[5] = torch.tensor(POSITIONS[:T])
    norm_weight = torch.randn(40, generator=torch.Generator().manual_seed(seed)) * 0.1 + 1.0
    return args, norm_weight


def _check_qkv(out, ref):
    assert len(out) == 3
    for o, r in zip(out, ref):
        assert o.shape == r.shape and o.is_contiguous()
        assert rel_err(o, r) <= TOL, rel_err(o, r)
    assert len({o.data_ptr() for o in out}) == 3  # fresh outputs that never alias


# every kind with the folded input norm; without it (a constexpr that drops the norm) once per form
@pytest.mark.parametrize("bias,qk_norm,rope,head_dim,input_norm",
                         [(*kind, True) for kind in QKV_KINDS] + [(*QKV_KINDS[0], False), (*QKV_KINDS[1], False)])
@pytest.mark.parametrize("form,T", [("decode", 1), ("decode", 3), ("prefill", 5)])
def test_qkv_rope_matches_reference(form, T, bias, qk_norm, rope, head_dim, input_norm):
    args, nw = _qkv_args(T, bias, qk_norm, rope, head_dim, seed=50 + T)
    nw = nw if input_norm else None
    out = triton_qkv_rope.fused_qkv_rope(*args, norm_weight=nw, norm_eps=1e-5, form=form)
    _check_qkv(out, fused_ops.fused_qkv_rope_ref(*args, nw, 1e-5))


@pytest.mark.parametrize("bias,qk_norm,rope,head_dim,T", [
    *[(*kind, 1) for kind in QKV_KINDS], *[pytest.param(*kind, 3, marks=SLOW) for kind in QKV_KINDS[:3]]])
def test_qkv_decode_with_tiny_blocks(bias, qk_norm, rope, head_dim, T):
    # 3 rows in blocks of 2, a full block and a partial one, at positions 7, 0 and 63 (1 row: the one-row form); 4
    # pairs a program (a head split in 3-4 programs; q/k norms after, in the epilogue); K = 40 in chunks of 16
    launch_configs.use_configs({"qkv_decode": {"inf": TINY_QKV}})
    args, nw = _qkv_args(T, bias, qk_norm, rope, head_dim, seed=60)
    out = triton_qkv_rope.fused_qkv_rope(*args, norm_weight=nw, norm_eps=1e-5, form="decode")
    _check_qkv(out, fused_ops.fused_qkv_rope_ref(*args, nw, 1e-5))


def test_the_decode_kernels_take_their_weight_shapes_own_configs(monkeypatch):
    """Each weight-streaming wrapper asks for the config of its weight's shape (rows x columns as
    the model has them, int4's two columns a byte unpacked) and runs what the table holds for
    that shape: here the tiny blocks, over general buckets of the defaults."""
    from compiled_llm.graph import quantized_ops

    given = []
    table_get = launch_configs.get

    def recording_get(kernel, num_tokens, shape=None):
        given.append((kernel, shape, table_get(kernel, num_tokens, shape)))
        return given[-1][2]

    monkeypatch.setattr(launch_configs, "get", recording_get)
    H, I, T, qkv_rows = 40, 56, 1, (6 + 2 * 2) * 24
    defaults = launch_configs.DEFAULT_CONFIGS
    launch_configs.use_configs({
        "norm_mlp_decode": {"inf": defaults["norm_mlp_decode"]["inf"], "shapes": {f"{2 * I}x{H}": {"1": TINY_MLP}}},
        "norm_mlp_down": {"inf": defaults["norm_mlp_down"]["inf"], "shapes": {f"{H}x{I}": {"1": TINY_GEMV}}},
        "qkv_decode": {"inf": defaults["qkv_decode"]["inf"], "shapes": {f"{qkv_rows}x{H}": {"1": TINY_QKV}}},
        "norm_mlp_decode_int4": {"inf": defaults["norm_mlp_decode_int4"]["inf"],
                                 "shapes": {f"{2 * I}x{H}": {"1": TINY_MLP_INT4}}},
        "norm_mlp_down_int4": {"inf": defaults["norm_mlp_down_int4"]["inf"], "shapes": {f"{H}x{I}": {"1": TINY_GEMV_INT4}}},
    })
    x, nw, eps, gate_up, down = mlp_glu_inputs(T, H, I, F32, "cpu", seed=46)
    r = _residual(T, H, 47)
    out = triton_norm_mlp.fused_rms_norm_glu_mlp(x, nw, eps, gate_up, down, residual=r, form="decode")
    assert rel_err(out, fused_ops.fused_rms_norm_glu_mlp_ref(x, nw, eps, gate_up, down, residual=r)) <= TOL
    args = (x, nw, eps, *_int4(gate_up), *_int4(down), r)
    out = triton_norm_mlp.fused_rms_norm_glu_mlp_wq(*args)
    assert rel_err(out, quantized_ops.fused_rms_norm_glu_mlp_wq_ref(*args)) <= TOL
    qkv_args, qkv_nw = _qkv_args(T, False, False, True, 24, seed=48)
    assert qkv_args[1].shape == (qkv_rows, H)
    out = triton_qkv_rope.fused_qkv_rope(*qkv_args, norm_weight=qkv_nw, norm_eps=1e-5, form="decode")
    _check_qkv(out, fused_ops.fused_qkv_rope_ref(*qkv_args, qkv_nw, 1e-5))
    streaming = [g for g in given if g[0].startswith(("norm_mlp_decode", "norm_mlp_down", "qkv_decode"))]
    assert streaming == [("norm_mlp_decode", (2 * I, H), TINY_MLP), ("norm_mlp_down", (H, I), TINY_GEMV),
                         ("norm_mlp_decode_int4", (2 * I, H), TINY_MLP_INT4),
                         ("norm_mlp_down_int4", (H, I), TINY_GEMV_INT4), ("qkv_decode", (qkv_rows, H), TINY_QKV)]


def test_qkv_positional_call_keeps_the_old_meaning():
    args, _ = _qkv_args(2, True, False, True, 24, seed=61)
    _check_qkv(triton_qkv_rope.fused_qkv_rope(*args), fused_ops.fused_qkv_rope_ref(*args))


def test_qkv_form_follows_launch_config():
    limit = launch_configs.DEFAULT_CONFIGS["qkv_dispatch"]["inf"]["MAX_TOKENS"]
    assert triton_qkv_rope.use_decode_form(limit) and not triton_qkv_rope.use_decode_form(limit + 1)
    launch_configs.use_configs({"qkv_dispatch": {"inf": {"MAX_TOKENS": 1}}})
    assert not triton_qkv_rope.use_decode_form(2)
    assert triton_qkv_rope.supports_shape(64, True, True) and not triton_qkv_rope.supports_shape(64, True, False)
    assert not triton_qkv_rope.supports_shape(63, False, False)


# ---------------------------------------------------------------------------------------------
# weight-only int8: the decode kernels with int8 weights equal the ops' dequantizing references
# ---------------------------------------------------------------------------------------------


def _int8(w):
    from compiled_llm.graph.quantized_ops import quantize

    return quantize(w, "int8")


@pytest.mark.parametrize("tiny", [False, True])
@pytest.mark.parametrize("T", [1, 3])
def test_int8_norm_mlps_equal_their_dequantizing_references(T, tiny):
    from compiled_llm.graph import quantized_ops

    if tiny:
        launch_configs.use_configs({"norm_mlp_decode": {"inf": TINY_MLP}, "norm_mlp_down": {"inf": TINY_GEMV}})
    x, nw, eps, gate_up, down = mlp_glu_inputs(T, 40, 56, F32, "cpu", seed=70 + T)
    r = torch.randn(T, 40, generator=torch.Generator().manual_seed(T))
    args = (x, nw, eps, *_int8(gate_up), *_int8(down), r)
    ref = quantized_ops.fused_rms_norm_glu_mlp_wq_ref(*args)
    assert rel_err(triton_norm_mlp.fused_rms_norm_glu_mlp_wq(*args), ref) <= TOL
    x, nw, nb, eps, fc, fb, proj, pb = mlp_gelu_inputs(T, 40, 56, F32, "cpu", seed=80 + T)
    args = (x, nw, nb, eps, *_int8(fc), fb, *_int8(proj), pb, r)
    ref = quantized_ops.fused_layer_norm_gelu_mlp_wq_ref(*args)
    assert rel_err(triton_norm_mlp.fused_layer_norm_gelu_mlp_wq(*args), ref) <= TOL


@pytest.mark.parametrize("bias,qk_norm,rope,head_dim", QKV_KINDS[:3])
@pytest.mark.parametrize("T", [1, 3])
def test_int8_qkv_rope_equals_its_dequantizing_reference(T, bias, qk_norm, rope, head_dim):
    from compiled_llm.graph import quantized_ops

    args, nw = _qkv_args(T, bias, qk_norm, rope, head_dim, seed=90 + T)
    qargs = [args[0], *_int8(args[1]), *args[2:]]
    ref = quantized_ops.fused_qkv_rope_wq_ref(*qargs, norm_weight=nw, norm_eps=1e-6)
    _check_qkv(triton_qkv_rope.fused_qkv_rope_wq(*qargs, norm_weight=nw, norm_eps=1e-6), ref)


# ---------------------------------------------------------------------------------------------
# weight-only int4: the kernels' INT4 forms (which run at every T) equal the ops' dequantizing
# references, at groups of 128 columns and at the narrower groups a K can demand
# ---------------------------------------------------------------------------------------------

# the INT4 forms' tables (K blocks in columns): 32 columns a step (one 16-byte vector a thread),
# so that K = 40 and up still takes several steps
TINY_GEMV_INT4 = {**TINY_GEMV, "BLOCK_K": 32}
TINY_MLP_INT4 = {**TINY_MLP, "BLOCK_H": 32}
TINY_QKV_INT4 = {**TINY_QKV, "BLOCK_K": 32}


def _int4(w):
    from compiled_llm.graph.quantized_ops import quantize

    return quantize(w, "int4")


# K = 256: groups of 128 (a thread's 16 bytes); 40: groups of 8 (4 bytes); 6: groups of 2 (1 byte)
@pytest.mark.parametrize("T,tiny,K", [(1, False, 256), (3, False, 256), (1, True, 40), (3, True, 40), (3, False, 6),
                                      pytest.param(3, True, 256, marks=SLOW)])
def test_int4_gemv_equals_the_linear_of_the_dequantized_weight(T, tiny, K):
    """Weight-only int4: each chunk's codes decoded once for every row of x, the group's scale and
    zero point applied per thread and chunk; the result is the linear of the dequantized weight."""
    from compiled_llm.graph.quantized_ops import dequantize

    if tiny:
        launch_configs.use_configs({"gemv_int4": {"inf": TINY_GEMV_INT4}})
    x, w, b, r = _linear_case(T, 37, K, True, seed=30 + T)
    q, scale, zero = _int4(w)
    deq = dequantize(q, scale, zero, F32)
    assert rel_err(triton_gemv.linear_residual_wq(x, q, scale, zero, b, r), r + F.linear(x, deq, b)) <= TOL
    assert rel_err(triton_gemv.linear_wq(x, q, scale, zero), F.linear(x, deq)) <= TOL


def test_int4_gemv_reads_rows_that_start_at_odd_columns():
    """The INT4 form reads x two columns to a word: rows at odd columns (or an odd stride) are
    copied first, not read misaligned."""
    from compiled_llm.graph.quantized_ops import dequantize

    gen = torch.Generator().manual_seed(5)
    x = _rand(gen, 3, 97)[:, 1:]
    q, scale, zero = _int4(_rand(gen, 37, 96, scale=0.1))
    assert rel_err(triton_gemv.linear_wq(x, q, scale, zero), F.linear(x, dequantize(q, scale, zero, F32))) <= TOL


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_int4_forms_read_16_bit_activations_in_pairs(dtype):
    """bf16/fp16 x (and norm weights) are read as 32-bit words of two values: the GEMV and the
    LayerNorm MLP (norm weight and bias pairs) against the ops' references, which round the
    dequantized weight to the dtype; 2e-2: the unquantized kernels are as far from the bf16
    reference on these MLP inputs (its roundings in a different order)."""
    from compiled_llm.graph import quantized_ops

    x, w, b, r = (t.to(dtype) for t in _linear_case(2, 37, 96, True, seed=40))
    q, scale, zero = _int4(w.float())
    ref = quantized_ops.fused_linear_residual_wq_ref(x, q, scale, zero, b, r)
    assert rel_err(triton_gemv.linear_residual_wq(x, q, scale, zero, b, r), ref) <= 2e-2
    x, nw, nb, eps, fc, fb, proj, pb = mlp_gelu_inputs(1, 40, 56, dtype, "cpu", seed=41)
    args = (x, nw, nb, eps, *_int4(fc.float()), fb, *_int4(proj.float()), pb)
    ref = quantized_ops.fused_layer_norm_gelu_mlp_wq_ref(*args)
    assert rel_err(triton_norm_mlp.fused_layer_norm_gelu_mlp_wq(*args), ref) <= 2e-2


# H = 40, I = 56: groups of 8; H = 96, I = 64: groups of 32 and 64
@pytest.mark.parametrize("T,tiny,H,I", [(1, False, 40, 56), (3, True, 40, 56), (1, False, 96, 64),
                                        pytest.param(3, True, 96, 64, marks=SLOW)])
def test_int4_norm_mlps_equal_their_dequantizing_references(T, tiny, H, I):
    from compiled_llm.graph import quantized_ops

    if tiny:
        launch_configs.use_configs({"norm_mlp_decode_int4": {"inf": TINY_MLP_INT4},
                                    "norm_mlp_down_int4": {"inf": TINY_GEMV_INT4}})
    x, nw, eps, gate_up, down = mlp_glu_inputs(T, H, I, F32, "cpu", seed=100 + T)
    r = torch.randn(T, H, generator=torch.Generator().manual_seed(T))
    args = (x, nw, eps, *_int4(gate_up), *_int4(down), r)
    ref = quantized_ops.fused_rms_norm_glu_mlp_wq_ref(*args)
    assert rel_err(triton_norm_mlp.fused_rms_norm_glu_mlp_wq(*args), ref) <= TOL
    x, nw, nb, eps, fc, fb, proj, pb = mlp_gelu_inputs(T, H, I, F32, "cpu", seed=110 + T)
    args = (x, nw, nb, eps, *_int4(fc), fb, *_int4(proj), pb, r)
    ref = quantized_ops.fused_layer_norm_gelu_mlp_wq_ref(*args)
    assert rel_err(triton_norm_mlp.fused_layer_norm_gelu_mlp_wq(*args), ref) <= TOL


@pytest.mark.parametrize("scheme,T", [("int8", 1), ("int8", 3), ("int4", 3)])
def test_quantized_geglu_mlp_equals_its_dequantizing_reference(scheme, T):
    """Gemma's GeGLU through the quantized decode forms: int8 in the one-row (T = 1) and the
    general kernel, int4 in the INT4 form (int4 groups of 8 columns at H = 40, I = 56), which
    runs at every T, one row or three alike."""
    from compiled_llm.graph import quantized_ops

    quant = _int8 if scheme == "int8" else _int4
    x, nw, eps, gate_up, down = mlp_glu_inputs(T, 40, 56, F32, "cpu", seed=125 + T)
    r = torch.randn(T, 40, generator=torch.Generator().manual_seed(T))
    args = (x, nw, eps, *quant(gate_up), *quant(down), r, "gelu_tanh")
    ref = quantized_ops.fused_rms_norm_glu_mlp_wq_ref(*args)
    assert rel_err(triton_norm_mlp.fused_rms_norm_glu_mlp_wq(*args), ref) <= TOL


def test_int4_and_int8_weights_mix_in_one_mlp():
    """Each weight's scheme is its own: int4 gate/up and an int8 down projection."""
    from compiled_llm.graph import quantized_ops

    x, nw, eps, gate_up, down = mlp_glu_inputs(1, 40, 56, F32, "cpu", seed=120)
    args = (x, nw, eps, *_int4(gate_up), *_int8(down))
    ref = quantized_ops.fused_rms_norm_glu_mlp_wq_ref(*args)
    assert rel_err(triton_norm_mlp.fused_rms_norm_glu_mlp_wq(*args), ref) <= TOL


@pytest.mark.parametrize("T,tiny,kind", [
    (1, False, QKV_KINDS[0]), (2, True, QKV_KINDS[0]),
    *[pytest.param(3, True, kind, marks=SLOW) for kind in QKV_KINDS[1:3]],
])
def test_int4_qkv_rope_equals_its_dequantizing_reference(T, tiny, kind):
    """H = 40: groups of 8, in 2 chunks with the tiny config, which also has 2 rows of x share
    each chunk's codes (with q/k norm a head's pairs are walked 4 at a time)."""
    from compiled_llm.graph import quantized_ops

    if tiny:
        launch_configs.use_configs({"qkv_decode_int4": {"inf": TINY_QKV_INT4}})
    args, nw = _qkv_args(T, *kind, seed=130 + T)
    qargs = [args[0], *_int4(args[1]), *args[2:]]
    ref = quantized_ops.fused_qkv_rope_wq_ref(*qargs, norm_weight=nw, norm_eps=1e-6)
    _check_qkv(triton_qkv_rope.fused_qkv_rope_wq(*qargs, norm_weight=nw, norm_eps=1e-6), ref)


# ---------------------------------------------------------------------------------------------
# weight-only int8 and int4 past the decode forms: the quantized GEMM (triton_gemm_wq), which
# dequantizes weight tiles in registers for tl.dot, alone and inside the ops' prefill forms
# ---------------------------------------------------------------------------------------------

# 16 x 16 output tiles, 16 columns a step, row tiles ordered in pairs: at the shapes below every
# edge tile is partial, an int4 group spans several steps and the row groups are uneven
TINY_GEMM_WQ = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": 2, "num_warps": 1, "num_stages": 1}
GEMM_ROWS = MAX_TOKENS + 37


def _quantized(scheme):
    from compiled_llm.graph.quantized_ops import quantize

    return lambda w: quantize(w, scheme)


@pytest.mark.parametrize("path", ["gemm", "gemm with tiny tiles", "dequantize + matmul"])
@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_quantized_matmul_equals_the_linear_of_the_dequantized_weight(scheme, path):
    """K = 96: int4 groups of 32 columns; rows past the GEMV's MAX_TOKENS, through the GEMM or
    (past the GEMM's own MAX_TOKENS) the dequantized scratch weight and a dense matmul."""
    from compiled_llm.graph.quantized_ops import dequantize

    if path == "gemm with tiny tiles":
        launch_configs.use_configs({"gemm_wq": {"inf": TINY_GEMM_WQ}})
    if path == "dequantize + matmul":
        launch_configs.use_configs({"gemm_wq_dispatch": {"inf": {"MAX_TOKENS": 8}}})
    x, w, b, r = _linear_case(GEMM_ROWS, 37, 96, True, seed=50)
    q, scale, zero = _quantized(scheme)(w)
    deq = dequantize(q, scale, zero, F32)
    assert rel_err(triton_gemv.linear_residual_wq(x, q, scale, zero, b, r), r + F.linear(x, deq, b)) <= TOL
    assert rel_err(triton_gemv.linear_wq(x, q, scale, zero), F.linear(x, deq)) <= TOL


@pytest.mark.parametrize("dtype", [F32, torch.float16])
@pytest.mark.parametrize("scheme,K", [("int8", 40), ("int4", 96), ("int4", 40), ("int4", 6)])
def test_dequantize_kernel_writes_exactly_the_reference_weight(scheme, K, dtype):
    """int4 groups of 32, 8 and 2 columns; K = 6 is narrower than a block. Bit for bit. Not bf16
    here: the interpreter truncates fp32 to bf16 where GPUs round to nearest (test_kernels_gpu.py
    checks bf16)."""
    from compiled_llm.graph.quantized_ops import dequantize
    from compiled_llm.kernels import triton_gemm_wq

    q, scale, zero = _quantized(scheme)(_rand(torch.Generator().manual_seed(K), 37, K))
    out = triton_gemm_wq.dequantize(q, scale, zero, dtype)
    assert out.dtype == dtype and torch.equal(out, dequantize(q, scale, zero, dtype))


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_quantized_norm_mlps_at_prefill_sizes_equal_their_dequantizing_references(scheme):
    """H = 96, I = 64: int4 groups of 32 (gate/up, fc) and 64 (down, proj)."""
    from compiled_llm.graph import quantized_ops

    launch_configs.use_configs({"gemm_wq": {"inf": TINY_GEMM_WQ}})
    quant = _quantized(scheme)
    T = GEMM_ROWS
    x, nw, eps, gate_up, down = mlp_glu_inputs(T, 96, 64, F32, "cpu", seed=140)
    r = torch.randn(T, 96, generator=torch.Generator().manual_seed(141))
    args = (x, nw, eps, *quant(gate_up), *quant(down), r)
    ref = quantized_ops.fused_rms_norm_glu_mlp_wq_ref(*args)
    assert rel_err(triton_norm_mlp.fused_rms_norm_glu_mlp_wq(*args), ref) <= TOL
    geglu = (*args, "gelu_tanh")
    ref = quantized_ops.fused_rms_norm_glu_mlp_wq_ref(*geglu)
    assert rel_err(triton_norm_mlp.fused_rms_norm_glu_mlp_wq(*geglu), ref) <= TOL
    x, nw, nb, eps, fc, fb, proj, pb = mlp_gelu_inputs(T, 96, 64, F32, "cpu", seed=142)
    args = (x, nw, nb, eps, *quant(fc), fb, *quant(proj), pb, r)
    ref = quantized_ops.fused_layer_norm_gelu_mlp_wq_ref(*args)
    assert rel_err(triton_norm_mlp.fused_layer_norm_gelu_mlp_wq(*args), ref) <= TOL


@pytest.mark.parametrize("scheme", ["int8", "int4"])
@pytest.mark.parametrize("kind", QKV_KINDS[:3])
def test_quantized_qkv_rope_at_prefill_sizes_equals_its_dequantizing_reference(scheme, kind):
    """H = 64 (int4 groups of 64), the input norm, then the epilogue's q/k norm and rotation."""
    from compiled_llm.graph import quantized_ops

    launch_configs.use_configs({"gemm_wq": {"inf": TINY_GEMM_WQ}})
    bias, qk_norm, rope, head_dim = kind
    T = GEMM_ROWS
    args = list(qkv_inputs(T, 64, 6, 2, head_dim, F32, "cpu", seed=150, bias=bias, qk_norm=qk_norm, rope=rope,
                           max_pos=64))
    args[5] = torch.arange(T) % 64
    nw = torch.randn(64, generator=torch.Generator().manual_seed(151)) * 0.1 + 1.0
    qargs = [args[0], *_quantized(scheme)(args[1]), *args[2:]]
    ref = quantized_ops.fused_qkv_rope_wq_ref(*qargs, norm_weight=nw, norm_eps=1e-6)
    _check_qkv(triton_qkv_rope.fused_qkv_rope_wq(*qargs, norm_weight=nw, norm_eps=1e-6), ref)


def test_quantized_gemm_multiplies_the_weights_the_reference_rounds_to_16_bits():
    """16-bit x: the tile is dequantized in fp32 and rounded to x's dtype, as the reference's
    weight is; only the accumulation order differs. fp16 only: the interpreter's tl.dot reads
    bf16 operands as integers (triton 3.9); test_kernels_gpu.py covers bf16."""
    dtype = torch.float16
    from compiled_llm.graph import quantized_ops

    launch_configs.use_configs({"gemm_wq": {"inf": TINY_GEMM_WQ}})
    x, w, b, r = (t.to(dtype) for t in _linear_case(GEMM_ROWS, 37, 96, True, seed=52))
    for scheme in ("int8", "int4"):
        q, scale, zero = _quantized(scheme)(w.float())
        ref = quantized_ops.fused_linear_residual_wq_ref(x.float(), q, scale, zero, b.float(), r.float())
        assert rel_err(triton_gemv.linear_residual_wq(x, q, scale, zero, b, r).float(), ref) <= 1e-2
