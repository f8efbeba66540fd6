"""Each pass leaves what the graph computes unchanged (the graph before and after it, run on
random inputs, agree), matches where the spec says it should (norm+MLP once per layer, both
residual adds of every layer into their producers, add+norm only where an add is left (GPT-2's
token + position embedding), q/k/v+RoPE once per layer), shrinks the op count, and stores merged
weights once while dropping the originals. The final Llama/Qwen layer is four kernels and a
view: fused_qkv_rope (input RMSNorm folded in) -> paged_attention -> view -> fused_linear_residual
(o-proj + residual) -> fused_rms_norm_glu_mlp (+ residual)."""

import copy
import json
import operator

import pytest
import torch
import torch.nn.functional as F

from compiled_llm.engine.build import lower, program_kernels
from compiled_llm.errors import CompiledLLMError
from compiled_llm.graph import ops
from compiled_llm.graph.export import FlatProgram, capture, param_placeholder_names
from compiled_llm.graph.serialize import graph_from_json, graph_to_json
from compiled_llm.model.spec import forward
from compiled_llm.model.weights import random_params
from compiled_llm.kernels import registry
from compiled_llm.passes import default_pass_names, get_pass, pipeline
from compiled_llm.passes import fuse_qkv_rope, fuse_residual
from compiled_llm.passes.base import PassContext, aten, cllm, is_call, param_name
from compiled_llm.passes.manager import PassManager, op_histogram, op_name
from compiled_llm.model.presets import preset_config
from helpers.program_inputs import FAMILIES, mixed_batch


def _run(gm, params, config, seed=0):
    batch, kv = mixed_batch(config, seed)
    out = FlatProgram(gm, param_placeholder_names(gm))(params, *batch, kv)
    return out, kv


@pytest.mark.parametrize("family", FAMILIES)
def test_every_pass_preserves_outputs_and_matches_where_expected(family):
    config = preset_config(family)
    params = random_params(config, seed=1)
    cap = capture(config, params)
    ctx = PassContext(config, dict(params), kernel_choice=registry.choose_providers("cpu", torch.float32))
    matches = {}
    for p in pipeline():
        before_gm, before_params = copy.deepcopy(cap.gm), dict(ctx.params)
        matches[p.name] = p.run(cap.gm, ctx)
        want, want_kv = _run(before_gm, before_params, config)
        got, got_kv = _run(cap.gm, ctx.params, config)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"{p.name} changed the logits")
        torch.testing.assert_close(got_kv, want_kv, rtol=1e-5, atol=1e-5, msg=f"{p.name} changed the cache")
    L = config.num_layers
    assert matches["fuse_norm_mlp"] == L
    assert matches["fuse_residual"] == 2 * L  # o-proj + its residual, MLP + its residual
    # every residual add is now an epilogue; GPT-2's embedding sum is the one add left before a norm
    assert matches["fuse_add_norm"] == (1 if family == "tiny-gpt2" else 0)
    assert matches["fuse_qkv_rope"] == L
    assert matches["select_kernels"] > 0


@pytest.mark.parametrize("family", FAMILIES)
def test_fully_fused_program_computes_the_spec(family):
    """The whole pipeline end to end, against the eager spec (not only pass by pass)."""
    config = preset_config(family)
    params = random_params(config, seed=5)
    lowered = lower(config, params, default_pass_names(), "cpu", torch.float32)
    batch, kv = mixed_batch(config, seed=6)
    kv_ref = kv.clone()
    got = FlatProgram(lowered.gm, lowered.param_names)(lowered.params, *batch, kv)
    torch.testing.assert_close(got, forward(config, params, batch, kv_ref), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kv, kv_ref, rtol=0, atol=0)


@pytest.mark.parametrize("family", ["tiny-qwen2", "tiny-gpt2"])
def test_merged_weights_are_stored_once_and_originals_dropped(family):
    config = preset_config(family)
    params = random_params(config, seed=2)
    lowered = lower(config, params, default_pass_names(), "cpu", torch.float32)
    names = set(lowered.param_names)
    assert set(lowered.params) == names
    for layer in range(config.num_layers):
        p = f"layers.{layer}."
        assert p + "qkv.weight" in names and p + "qkv.bias" in names
        assert not {p + "q.weight", p + "k.weight", p + "v.weight", p + "q.bias"} & names
        want = torch.cat([params[p + "q.weight"], params[p + "k.weight"], params[p + "v.weight"]])
        assert torch.equal(lowered.params[p + "qkv.weight"], want)
        if config.mlp_type == "silu_glu":
            assert p + "gate_up.weight" in names and p + "gate.weight" not in names and p + "up.weight" not in names
    # fewer stored tensor elements than the source (merged tensors replace, never duplicate)
    assert sum(t.numel() for t in lowered.params.values()) <= sum(t.numel() for t in params.values())


def test_op_count_shrinks_and_only_fused_ops_remain():
    config = preset_config("tiny-llama")
    lowered = lower(config, random_params(config), default_pass_names(), "cpu", torch.float32)
    before, after = lowered.histograms["00_captured"], op_histogram(lowered.gm)
    assert sum(after.values()) < sum(before.values())
    assert "aten::silu" in before and "aten::silu" not in after
    assert after["cllm::fused_rms_norm_glu_mlp"] == config.num_layers
    assert after["cllm::fused_qkv_rope"] == config.num_layers
    assert "cllm::rotary_embedding" not in after
    assert program_kernels(lowered.gm)["paged_attention"] == "reference"


def test_pass_manager_dumps_ir_before_and_after_each_pass(tmp_path):
    config = preset_config("tiny-qwen3")
    lower(config, random_params(config), default_pass_names(), "cpu", torch.float32, ir_dir=tmp_path)
    stages = sorted(p.name for p in tmp_path.glob("*.py"))
    assert stages[0] == "00_captured.py" and len(stages) == len(default_pass_names()) + 1
    assert "fused_qkv_rope" in (tmp_path / stages[-1]).read_text()
    assert "fused_qkv_rope" not in (tmp_path / "00_captured.py").read_text()


def test_disabled_pass_is_skipped_and_unknown_one_refused():
    names = [p.name for p in pipeline(disabled=["fuse_add_norm"])]
    assert "fuse_add_norm" not in names and "fuse_norm_mlp" in names
    with pytest.raises(CompiledLLMError, match="unknown pass 'nope'"):
        pipeline(disabled=["nope"])


def _testprov_kernel(x, weight, eps):
    return ops.rms_norm_ref(x, weight, eps)


def test_select_kernels_rewrites_to_the_chosen_provider():
    """A registered provider (same schema, its own op) replaces the semantic op in the graph."""
    registry.register_kernel("rms_norm", "testprov", _testprov_kernel, supports=lambda d, t: d == "cpu", priority=10)
    try:
        assert registry.choose_providers("cpu", torch.float32)["rms_norm"] == "testprov"
        assert registry.choose_providers("cuda", torch.float32)["rms_norm"] != "testprov"  # cpu-only provider
        config = preset_config("tiny-qwen3")  # q/k norms stay inside fused_qkv_rope; final norm is rms_norm
        params = random_params(config)
        lowered = lower(config, params, default_pass_names(), "cpu", torch.float32)
        assert program_kernels(lowered.gm)["rms_norm"] == "testprov"
        want, _ = _run(capture(config, params).gm, params, config)
        got, _ = _run(lowered.gm, lowered.params, config)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        with pytest.raises(CompiledLLMError, match="no provider 'nope'"):
            registry.choose_providers("cpu", torch.float32, prefer={"rms_norm": "nope"})
    finally:
        registry.unregister_provider("rms_norm", "testprov")


# ---------------------------------------------------------------------------------------------
# the final graph, layer by layer
# ---------------------------------------------------------------------------------------------

# ops that launch no kernel: views of a tensor and shape reads
_FREE = {"aten::view", "aten::select", "aten::sym_size"}


def _kernels(gm):
    """The call nodes of the graph that launch work, in order."""
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is not operator.getitem
            and op_name(n.target).split(".")[0] not in _FREE]


def _layers(gm):
    """Each layer's launching nodes, from its fused_qkv_rope through its fused MLP."""
    ops = _kernels(gm)
    names = [op_name(n.target) for n in ops]
    starts = [i for i, name in enumerate(names) if name == "cllm::fused_qkv_rope"]
    return [ops[a:next(j for j in range(a, len(ops)) if names[j].endswith("_mlp")) + 1] for a in starts]


def _weight(node):
    return param_name(node) if node is not None else None


@pytest.mark.parametrize("family", ["tiny-qwen2", "tiny-qwen3", "tiny-llama"])
def test_llama_and_qwen_layers_are_four_kernels(family):
    """qkv (input norm folded) -> attention -> o-proj + residual -> norm + MLP + residual."""
    config = preset_config(family)
    gm = lower(config, random_params(config), default_pass_names(), "cpu", torch.float32).gm
    layers = _layers(gm)
    assert len(layers) == config.num_layers
    residual = next(n for n in gm.graph.nodes if is_call(n, aten.embedding.default))
    for i, layer in enumerate(layers):
        assert [op_name(n.target) for n in layer] == [
            "cllm::fused_qkv_rope", "cllm::paged_attention", "cllm::fused_linear_residual",
            "cllm::fused_rms_norm_glu_mlp",
        ]
        qkv, _, o_proj, mlp = layer
        assert qkv.args[0] is residual  # the un-normalised stream: the norm is the op's prologue
        assert _weight(qkv.args[11]) == f"layers.{i}.attn_norm.weight" and qkv.args[12] == config.norm_eps
        assert _weight(o_proj.args[1]) == f"layers.{i}.o.weight" and o_proj.args[2] is None
        assert o_proj.args[3] is residual
        assert mlp.args[0] is o_proj and mlp.args[5] is o_proj  # h + mlp(norm(h))
        residual = mlp
    hist = op_histogram(gm)
    assert "aten::add.Tensor" not in hist and "cllm::fused_add_rms_norm" not in hist
    assert hist["cllm::rms_norm"] == 1  # only the final norm is left on its own


def test_gpt2_layers_keep_layer_norm_out_of_qkv():
    """GPT-2: o-proj (with bias) and the MLP take their residual adds; its LayerNorm is not folded
    into fused_qkv_rope (the op only has an RMSNorm prologue)."""
    config = preset_config("tiny-gpt2")
    gm = lower(config, random_params(config), default_pass_names(), "cpu", torch.float32).gm
    layers = _layers(gm)
    assert len(layers) == config.num_layers
    for i, (qkv, _, o_proj, mlp) in enumerate(layers):
        assert len(qkv.args) == 11  # no norm_weight / norm_eps
        norm = qkv.args[0]
        if i == 0:  # token + position embedding, summed inside the first LayerNorm
            assert is_call(norm, operator.getitem) and is_call(norm.args[0], cllm.fused_add_layer_norm.default)
        else:
            assert is_call(norm, cllm.layer_norm.default) and norm.args[0] is layers[i - 1][3]
        assert op_name(o_proj.target) == "cllm::fused_linear_residual"
        assert _weight(o_proj.args[2]) == f"layers.{i}.o.bias"
        assert op_name(mlp.target) == "cllm::fused_layer_norm_gelu_mlp" and mlp.args[8] is o_proj
    assert "aten::add.Tensor" not in op_histogram(gm)


# ---------------------------------------------------------------------------------------------
# GeGLU (Gemma): the Llama graph with gelu(gate, approximate="tanh") for silu(gate), as the spec
# writes mlp_type "gelu_tanh_glu", fuses onto the same op with activation="gelu_tanh"
# ---------------------------------------------------------------------------------------------


def _with_gate_activation(gm, approximate):
    """``gm`` with each SwiGLU gate's silu replaced by gelu(approximate=...)."""
    for node in gm.graph.nodes:
        if is_call(node, aten.silu.default):
            node.target, node.kwargs = aten.gelu.default, {"approximate": approximate}
    gm.recompile()
    return gm


def _geglu_capture(approximate="tanh", seed=1):
    config = preset_config("tiny-llama")
    params = random_params(config, seed=seed)
    cap = capture(config, params)
    _with_gate_activation(cap.gm, approximate)
    return config, params, cap


def test_geglu_mlp_fuses_with_its_activation_and_every_pass_preserves_outputs():
    config, params, cap = _geglu_capture()
    ctx = PassContext(config, dict(params), kernel_choice=registry.choose_providers("cpu", torch.float32))
    want, _ = _run(copy.deepcopy(cap.gm), dict(params), config)
    matches = {p.name: p.run(cap.gm, ctx) for p in pipeline()}
    got, _ = _run(cap.gm, ctx.params, config)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    L = config.num_layers
    assert matches["fuse_norm_mlp"] == L and matches["fuse_residual"] == 2 * L
    hist = op_histogram(cap.gm)
    assert "aten::gelu" not in hist and hist["cllm::fused_rms_norm_glu_mlp"] == L
    mlps = [n for n in cap.gm.graph.nodes if is_call(n, cllm.fused_rms_norm_glu_mlp.default)]
    for i, mlp in enumerate(mlps):
        # the residual taken by fuse_residual, the activation kept after it
        assert len(mlp.args) == 7 and mlp.args[5] is mlp.args[0] and mlp.args[6] == "gelu_tanh"
        assert _weight(mlp.args[3]) == f"layers.{i}.gate_up.weight"
    # program.json keeps it (a str argument, checked against the op's schema when loaded)
    loaded = graph_from_json(json.loads(json.dumps(graph_to_json(cap.gm))))
    mlps = [n for n in loaded.graph.nodes if is_call(n, cllm.fused_rms_norm_glu_mlp.default)]
    assert [m.args[6] for m in mlps] == ["gelu_tanh"] * L


def test_swiglu_mlp_leaves_the_activation_at_its_default():
    """Llama/Qwen graphs are what they were before the argument existed (saved engines, builds
    compared byte for byte)."""
    config = preset_config("tiny-llama")
    gm = lower(config, random_params(config), default_pass_names(), "cpu", torch.float32).gm
    mlps = [n for n in gm.graph.nodes if is_call(n, cllm.fused_rms_norm_glu_mlp.default)]
    assert len(mlps) == config.num_layers and all(len(m.args) == 6 and not m.kwargs for m in mlps)


def test_exact_gelu_gate_is_not_fused():
    """gelu without the tanh approximation is not an activation the fused op has."""
    config, params, cap = _geglu_capture("none")
    ctx = PassContext(config, dict(params))
    assert get_pass("fuse_norm_mlp").run(cap.gm, ctx) == 0
    assert op_histogram(cap.gm)["aten::gelu"] == config.num_layers


def test_quantized_geglu_mlp_keeps_its_activation():
    config, params, cap = _geglu_capture(seed=3)
    ctx = PassContext(config, dict(params), quantization="int8")
    for name in ("fuse_norm_mlp", "fuse_residual", "quantize_weights"):
        get_pass(name).run(cap.gm, ctx)
    mlps = [n for n in cap.gm.graph.nodes if is_call(n, cllm.fused_rms_norm_glu_mlp_wq.default)]
    assert len(mlps) == config.num_layers and all(m.args[-1] == "gelu_tanh" for m in mlps)


# ---------------------------------------------------------------------------------------------
# fuse_residual and the qkv input-norm fold on small graphs
# ---------------------------------------------------------------------------------------------


class _Fn(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


def _fuse_residual(fn, *args):
    """(matches, graph after fuse_residual) of fn exported at args; asserts the output is
    bitwise unchanged."""
    gm = torch.export.export(_Fn(fn), args).graph_module
    want = gm(*args)
    matches = fuse_residual.run(gm, PassContext(preset_config("tiny-llama"), {}))
    got = gm(*args)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    return matches, op_histogram(gm)


def _rand(*shape, dtype=torch.float32):
    return torch.randn(shape, generator=torch.Generator().manual_seed(sum(shape)), dtype=dtype)


@pytest.mark.parametrize("order", ["residual_first", "linear_first"])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_plus_residual_becomes_fused_linear_residual(order, bias):
    x, w, b, r = _rand(3, 8), _rand(6, 8), _rand(6), _rand(3, 6)

    def fn(x, w, b, r):
        y = F.linear(x, w, b if bias else None)
        return r + y if order == "residual_first" else y + r

    matches, hist = _fuse_residual(fn, x, w, b, r)
    assert matches == 1
    assert hist == {"cllm::fused_linear_residual": 1}


@pytest.mark.parametrize("case", ["broadcast", "promote", "alpha", "linear_read_twice"])
def test_adds_that_are_not_a_plain_residual_stay(case):
    x, w, r = _rand(3, 8), _rand(6, 8), _rand(3, 6)
    fns = {
        "broadcast": (lambda x, w, r: F.linear(x, w) + r[0], (x, w, r)),  # [3, 6] + [6]
        "promote": (lambda x, w, r: F.linear(x, w) + r, (x, w, r.double())),
        "alpha": (lambda x, w, r: r.add(F.linear(x, w), alpha=2), (x, w, r)),
        "linear_read_twice": (lambda x, w, r: (lambda y: (r + y, y.relu()))(F.linear(x, w)), (x, w, r)),
    }
    fn, args = fns[case]
    matches, hist = _fuse_residual(fn, *args)
    assert matches == 0
    assert "cllm::fused_linear_residual" not in hist and hist["aten::add.Tensor"] == 1


def test_mlp_plus_residual_takes_the_residual_once():
    """h + mlp(h) -> mlp(h, residual=h); an MLP that already adds a residual is left alone."""
    x, nw, gu, dw = _rand(3, 8), _rand(8), _rand(12, 8), _rand(8, 6)
    glu = torch.ops.cllm.fused_rms_norm_glu_mlp

    matches, hist = _fuse_residual(lambda x, nw, gu, dw: x + glu(x, nw, 1e-6, gu, dw), x, nw, gu, dw)
    assert matches == 1 and hist == {"cllm::fused_rms_norm_glu_mlp": 1}

    matches, hist = _fuse_residual(lambda x, nw, gu, dw: x + glu(x, nw, 1e-6, gu, dw, x), x, nw, gu, dw)
    assert matches == 0 and hist["aten::add.Tensor"] == 1

    # GeGLU: the residual goes in its place, the activation after it stays (outputs bitwise equal)
    matches, hist = _fuse_residual(lambda x, nw, gu, dw: x + glu(x, nw, 1e-6, gu, dw, None, "gelu_tanh"),
                                   x, nw, gu, dw)
    assert matches == 1 and hist == {"cllm::fused_rms_norm_glu_mlp": 1}


def test_residual_add_after_an_all_reduce_rides_it_and_the_linear_becomes_the_engines():
    """A sharded program's ``r + all_reduce(linear(x, W, b))``: the all-reduce adds r (one
    reduction, no add left), and the row-parallel linear runs the engine's GEMV (cllm::linear)."""
    x, w, b, r = _rand(3, 8), _rand(6, 8), _rand(6), _rand(3, 6)
    all_reduce = torch.ops.cllm.all_reduce

    matches, hist = _fuse_residual(lambda x, w, b, r: r + all_reduce(F.linear(x, w, b)), x, w, b, r)
    assert matches == 1 and hist == {"cllm::all_reduce": 1, "cllm::linear": 1}

    # a partial read elsewhere stays the plain linear; the add still rides the all-reduce
    matches, hist = _fuse_residual(lambda x, w, r: (lambda y: (r + all_reduce(y), y.relu()))(F.linear(x, w)), x, w, r)
    assert matches == 1 and hist == {"cllm::all_reduce": 1, "aten::linear": 1, "aten::relu": 1}


def test_input_norm_read_elsewhere_is_not_folded_into_qkv():
    config = preset_config("tiny-llama")
    params = random_params(config, seed=4)
    cap = capture(config, params)
    ctx = PassContext(config, dict(params), kernel_choice=registry.choose_providers("cpu", torch.float32))
    for name in ("cleanup_noop", "fuse_norm_mlp", "fuse_residual", "fuse_add_norm"):
        get_pass(name).run(cap.gm, ctx)
    first_norm = next(n for n in cap.gm.graph.nodes if is_call(n, cllm.rms_norm.default))
    with cap.gm.graph.inserting_after(first_norm):  # another reader of layer 0's input norm
        cap.gm.graph.call_function(aten.clone.default, (first_norm,))
    want, _ = _run(copy.deepcopy(cap.gm), dict(ctx.params), config)
    assert fuse_qkv_rope.run(cap.gm, ctx) == config.num_layers
    qkvs = [n for n in cap.gm.graph.nodes if is_call(n, cllm.fused_qkv_rope.default)]
    assert qkvs[0].args[0] is first_norm and len(qkvs[0].args) == 11
    assert all(len(q.args) == 13 for q in qkvs[1:])  # the other layers' norms are folded
    got, _ = _run(cap.gm, ctx.params, config)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
