"""A checkpoint with a NaN or Inf weight is refused where it is loaded, naming the checkpoint's own
tensor: `compiled-llm build` exits 2 with one stderr line, `build_engine` raises WeightLoadError,
and the eager paths (`LLM(enforce_eager=True)`, `run --eager`, `compare`), which share
`load_source_params`, refuse it the same way. A finite weight that overflows the load dtype is
named too. (A clean checkpoint building is covered by tests/cli/test_build_cli.py.)"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from compiled_llm.engine.build import build_engine
from compiled_llm.cli.main import main
from compiled_llm.errors import WeightLoadError
from compiled_llm.model.weights import load_params
from compiled_llm.model.sources import load_source_params, resolve_source
from helpers.hf_checkpoints import make_checkpoint

QWEN_TENSOR = "model.layers.0.mlp.down_proj.weight"
BAD = {"NaN": float("nan"), "Inf": float("inf")}


@pytest.fixture(scope="module")
def clean_ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("clean-qwen2")
    make_checkpoint("qwen2", d)
    return d


def planted(src, dst, name: str, value: float, at=(3, 17)):
    """A copy of checkpoint ``src`` in ``dst`` with ``value`` written into tensor ``name``."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.name != "model.safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(src / "model.safetensors"))
    assert name in tensors, sorted(tensors)
    tensors[name][at] = value
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def one_error_line(capsys, argv) -> str:
    capsys.readouterr()
    rc = main([str(a) for a in argv])
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert rc == 2, err
    assert len(lines) == 1, err
    assert lines[0].startswith("error: ")
    return lines[0]


@pytest.mark.parametrize("kind", list(BAD))
def test_build_cli_refuses_non_finite_weight_naming_the_tensor(clean_ckpt, tmp_path, capsys, kind):
    ckpt = planted(clean_ckpt, tmp_path / "ckpt", QWEN_TENSOR, BAD[kind])
    out = tmp_path / "engine"
    line = one_error_line(capsys, ["build", ckpt, "-o", out, "--quiet"])
    assert repr(QWEN_TENSOR) in line and f"1 {kind} value" in line, line
    assert "layers.0.down" not in line  # the checkpoint's name, not the spec's
    assert not out.exists()


@pytest.mark.parametrize("kind", list(BAD))
def test_build_engine_raises_weight_load_error(clean_ckpt, tmp_path, kind):
    ckpt = planted(clean_ckpt, tmp_path / "ckpt", QWEN_TENSOR, BAD[kind])
    with pytest.raises(WeightLoadError, match=rf"'{QWEN_TENSOR}'.*{kind}"):
        build_engine(str(ckpt), tmp_path / "engine", progress=False)


def test_negative_inf_and_several_values_are_counted(clean_ckpt, tmp_path):
    d = tmp_path / "ckpt"
    planted(clean_ckpt, d, "model.norm.weight", float("-inf"), at=(5,))
    tensors = load_file(str(d / "model.safetensors"))
    tensors["model.norm.weight"][7] = float("nan")
    tensors["model.norm.weight"][9] = float("nan")
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(WeightLoadError, match=r"'model\.norm\.weight'.* has 2 NaN values and 1 Inf value \(of 64 "):
        load_params(resolve_source(str(d)).config, d)


def test_gpt2_split_tensor_uses_checkpoint_name(tmp_path):
    """GPT-2's fused c_attn is split into q/k/v on load; the error still names c_attn."""
    src = tmp_path / "clean"
    make_checkpoint("gpt2", src)
    name = next(k for k in load_file(str(src / "model.safetensors")) if k.endswith("h.1.attn.c_attn.weight"))
    ckpt = planted(src, tmp_path / "ckpt", name, float("nan"), at=(0, 150))  # lands in the v part
    with pytest.raises(WeightLoadError, match=rf"'{name}'.*1 NaN value"):
        load_source_params(resolve_source(str(ckpt)), torch.float32, "cpu")


def test_eager_run_refuses_too(clean_ckpt, tmp_path, capsys):
    """`run --eager` (and LLM(enforce_eager=True), compare) load through load_source_params."""
    ckpt = planted(clean_ckpt, tmp_path / "ckpt", QWEN_TENSOR, float("nan"))
    with pytest.raises(WeightLoadError, match=QWEN_TENSOR):
        load_source_params(resolve_source(str(ckpt)), torch.float32, "cpu")
    line = one_error_line(capsys, ["run", ckpt, "--eager", "--prompt-ids", "1,2", "--max-tokens", "2"])
    assert QWEN_TENSOR in line and "NaN" in line, line


def test_cast_overflow_is_named_with_a_wider_dtype(clean_ckpt, tmp_path):
    """Finite in the file but past float16's range: the message says so instead of 'Inf'."""
    ckpt = planted(clean_ckpt, tmp_path / "ckpt", QWEN_TENSOR, 1e6)
    config = resolve_source(str(ckpt)).config
    assert load_params(config, ckpt, torch.float32)  # fine in float32
    with pytest.raises(WeightLoadError, match=rf"'{QWEN_TENSOR}'.* overflows float16 \(largest magnitude 1e\+06\); "
                                              r"load it with dtype bfloat16 or float32"):
        load_params(config, ckpt, torch.float16)
