"""The engine directory is self-describing and its loader refuses a bad one with a one-line
EngineError: a deleted file, a flipped byte, a format version from the future or the past,
another device. A CUDA build ships the Triton kernels its runtime launches."""

import json
import warnings

import pytest
import torch

from compiled_llm.engine import artifact, kernel_cache
from compiled_llm.engine.build import build_engine
from compiled_llm.errors import EngineError
from compiled_llm.graph.batch import ScheduledSeq, pack_batch
from compiled_llm.model.spec import forward, kv_cache_shape
from compiled_llm.model.sources import load_source_params, resolve_source
from compiled_llm.serve import kernel_warmup
from compiled_llm.serve.kernel_warmup import warm_kernels


@pytest.fixture
def engine(tiny_engine):
    return tiny_engine


@pytest.fixture
def copy_of(tiny_engine_copy):
    return tiny_engine_copy


def test_artifact_holds_what_run_needs(engine):
    m = artifact.read_manifest(engine)
    for f in ("weights.safetensors", "program.json", "ir/00_captured.ops.json", "tokenizer/tokenizer.json"):
        assert f in m["files"], f
        assert (engine / f).is_file()
    assert m["format_version"] == artifact.FORMAT_VERSION
    assert m["model_config"]["architecture"] == "Qwen2ForCausalLM"
    assert m["build_options"]["dtype"] == "float32" and m["build_options"]["device"] == "cpu"
    assert m["versions"]["torch"] == torch.__version__
    assert [p["name"] for p in m["passes"]][:4] == ["cleanup_noop", "fuse_moe", "shard", "fuse_norm_mlp"]
    assert m["kernels"]["paged_attention"] == "reference"
    assert m["kernel_cache"] is None  # a CPU engine runs reference ops: no compiled kernels
    assert m["source"]["preset"] == "tiny-qwen2"
    # the program stores no weights: far smaller than the weights file
    assert (engine / "program.json").stat().st_size < (engine / "weights.safetensors").stat().st_size / 4


def test_loaded_engine_computes_the_spec(engine):
    e = artifact.load_engine(engine)
    assert e.device.type == "cpu" and e.dtype == torch.float32
    assert list(e.load_stages) == ["manifest", "weights", "program", "verify", "kernels", "tokenizer"]
    assert e.tokenizer is not None and e.source_dir is None and e.engine_dir == engine
    assert "layers.0.qkv.weight" in e.params and "layers.0.q.weight" not in e.params
    src = resolve_source("tiny-qwen2")
    params = load_source_params(src, torch.float32, "cpu")
    batch = pack_batch([ScheduledSeq([5, 6, 7], 0, [1]), ScheduledSeq([9], 4, [0])], 16)
    kv = torch.randn(kv_cache_shape(e.config, 3, 16))
    kv_ref = kv.clone()
    torch.testing.assert_close(e.program(e.params, batch, kv), forward(src.config, params, batch, kv_ref),
                               rtol=1e-5, atol=1e-5)


def test_saved_program_keeps_the_fused_ops_optional_arguments(engine):
    """program.json round-trips the arguments the fusions add after an op's old ones: a tensor
    (the folded input norm's weight, the MLP's residual) and a float (its eps)."""
    from compiled_llm.graph.export import PARAM_META

    gm = artifact._load_program(engine, artifact.read_manifest(engine))
    eps = artifact.read_manifest(engine)["model_config"]["norm_eps"]

    def calls(op):
        return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is op.default]

    qkvs, mlps = calls(torch.ops.cllm.fused_qkv_rope), calls(torch.ops.cllm.fused_rms_norm_glu_mlp)
    assert len(qkvs) == len(mlps) == len(calls(torch.ops.cllm.fused_linear_residual)) > 0
    for i, qkv in enumerate(qkvs):
        norm_weight, norm_eps = qkv.args[11], qkv.args[12]
        assert norm_weight.meta[PARAM_META] == f"layers.{i}.attn_norm.weight" and norm_eps == eps
    assert all(mlp.args[5] is mlp.args[0] for mlp in mlps)  # h + mlp(norm(h))


def test_deleted_file_is_refused(copy_of):
    (copy_of / "program.json").unlink()
    with pytest.raises(EngineError, match=r"engine file program.json is missing"):
        artifact.load_engine(copy_of)


def test_deleted_manifest_is_refused(copy_of):
    (copy_of / "manifest.json").unlink()
    with pytest.raises(EngineError, match="manifest.json is missing"):
        artifact.load_engine(copy_of)


def test_flipped_byte_is_refused(copy_of):
    path = copy_of / "weights.safetensors"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(EngineError, match="weights.safetensors fails its checksum"):
        artifact.load_engine(copy_of)


def test_future_format_version_is_refused(copy_of):
    path = copy_of / "manifest.json"
    m = json.loads(path.read_text())
    m["format_version"] = artifact.FORMAT_VERSION + 1
    path.write_text(json.dumps(m))
    with pytest.raises(EngineError, match=f"format version {artifact.FORMAT_VERSION + 1} is newer"):
        artifact.load_engine(copy_of)


def test_engine_for_another_device_is_refused(engine):
    with pytest.raises(EngineError, match="built for cpu but cuda was asked for"):
        artifact.load_engine(engine, device="cuda")


def test_errors_are_one_line(copy_of):
    (copy_of / "weights.safetensors").unlink()
    with pytest.raises(EngineError) as info:
        artifact.load_engine(copy_of)
    assert "\n" not in str(info.value)


def test_engine_of_an_older_format_is_refused(copy_of):
    path = copy_of / "manifest.json"
    m = json.loads(path.read_text())
    m["format_version"] = 1
    path.write_text(json.dumps(m))
    with pytest.raises(EngineError, match="format version 1 is older .* rebuild the engine"):
        artifact.load_engine(copy_of)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_build_ships_its_kernels_and_a_load_compiles_none(tmp_path, monkeypatch):
    import triton

    monkeypatch.setenv("COMPILED_LLM_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "eng"
    m = build_engine("tiny-qwen2", out, dtype="bfloat16", device="cuda", progress=False, warm_up=warm_kernels)
    kernels = [f for f in m["files"] if f.startswith(m["kernel_cache"] + "/")]
    assert m["kernel_cache"] == kernel_cache.KERNELS_DIR and any(f.endswith(".cubin") for f in kernels)
    e = artifact.load_engine(out)
    cache_dir = triton.knobs.cache.dir
    assert cache_dir.startswith(str(tmp_path / "cache"))
    cubins = sorted(p.name for p in __import__("pathlib").Path(cache_dir).rglob("*.cubin"))
    assert cubins == sorted(f.rsplit("/", 1)[-1] for f in kernels if f.endswith(".cubin"))
    batch = pack_batch([ScheduledSeq([5, 6, 7], 0, [1])], 16, "cuda")
    kv = torch.zeros(kv_cache_shape(e.config, 3, 16), dtype=torch.bfloat16, device="cuda")
    assert torch.isfinite(e.program(e.params, batch, kv).float()).all()


def test_kernel_warm_up_starts_no_more_processes_than_fit_on_the_gpu(monkeypatch):
    """Each warm-up process holds the weights: on a 16-core host with 130 GB free, a 1 GB engine
    gets 8 processes, an 8B one (16 GB) 6, and a model that barely fits still gets one."""
    monkeypatch.setattr(kernel_warmup.os, "cpu_count", lambda: 16)
    gib = 1 << 30
    assert kernel_warmup.warm_workers() == 8
    assert kernel_warmup.warm_workers(1 * gib, 130 * gib) == 8
    assert kernel_warmup.warm_workers(16 * gib, 130 * gib) == 6
    assert kernel_warmup.warm_workers(100 * gib, 90 * gib) == 1
