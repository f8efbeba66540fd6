"""The torchao latency peer of ``bench`` (compiled_llm/cli/bench/torchao_peer.py): an engine
built with ``--quantization`` gets it next to the HF peer; without torchao (or when torchao
cannot quantize here) its row says why and our number stays; with torchao installed, int8
quantizes a tiny HF model on the CPU and times it."""

import importlib.util
import os
import sys

import pytest
import torch

from compiled_llm.cli.bench import hf_child
from compiled_llm.cli.bench import torchao_peer as tp
from compiled_llm.cli.bench import workloads as wl
from compiled_llm.model.presets import preset_hf_config

CPU = torch.device("cpu")


def _has_torchao() -> bool:
    """Installed (found without importing it: an import at collection would load it into every
    test session); the tests that use it import it through pytest.importorskip."""
    return importlib.util.find_spec("torchao") is not None


@pytest.fixture(scope="module")
def int8_engine(tmp_path_factory):
    from compiled_llm.engine.build import build_engine

    out = tmp_path_factory.mktemp("int8_engine") / "engine"
    build_engine("tiny-qwen2", out, dtype="float32", device="cpu", progress=False, quantization="int8")
    return out


@pytest.fixture
def fake_hf_child(monkeypatch):
    """run_hf_child without a child process: records its calls, answers the bf16 HF peer."""
    calls = []

    def fake(hf_config, dtype, device, workload, num_requests=256, quantization=None):
        calls.append((workload, quantization))
        if quantization:
            return wl.Result(workload, tp.system_name(quantization), {"decode_tok_s": 40.0, "ttft_ms": 9.0}, note="fake torchao")
        return wl.Result(workload, "hf static+compile", {"decode_tok_s": 50.0, "ttft_ms": 8.0}, note="fake hf")

    monkeypatch.setattr(hf_child, "run_hf_child", fake)
    return calls


def latency_rows(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("latency") and "decode_tok_s" in line]


def test_table_shows_each_peer_of_a_workload():
    results = [wl.Result("latency", "compiled_llm", {"decode_tok_s": 100.0, "ttft_ms": 3.0}, note="ours"),
               wl.Result("latency", "hf static+compile", {"decode_tok_s": 50.0, "ttft_ms": 6.0}, note="bf16"),
               wl.Result("latency", tp.system_name("int8"), {"decode_tok_s": 80.0, "ttft_ms": 5.0}, note="q"),
               tp.not_run("int4", "torchao is not installed")]
    rows = latency_rows(wl.format_table(results))
    assert len(rows) == 3
    assert "2.00x" in rows[0] and "hf static+compile" in rows[0]
    assert "1.25x" in rows[1] and "hf+torchao int8" in rows[1] and "ours" not in rows[1]
    assert rows[2].split()[3] == "-" and "not run: torchao is not installed" in rows[2]
    assert float(rows[2].split()[2]) == 100.0  # our number stays


def test_bench_on_a_quantized_engine_runs_the_torchao_peer(int8_engine, fake_hf_child, monkeypatch, capsys):
    from compiled_llm.cli.main import main

    monkeypatch.setattr(tp, "missing_reason", lambda: None)  # the fake child stands in for torchao
    assert main(["bench", str(int8_engine), "--workload", "latency", "--device", "cpu"]) == 0
    assert fake_hf_child == [("latency", None), ("latency", "int8")]
    rows = latency_rows(capsys.readouterr().out)
    assert len(rows) == 2 and "hf+torchao int8 static+compile, fake torchao" in rows[1]


def test_bench_on_an_unquantized_engine_has_no_torchao_peer(tiny_engine, fake_hf_child, capsys):
    from compiled_llm.cli.main import main

    assert main(["bench", str(tiny_engine), "--workload", "latency", "--device", "cpu"]) == 0
    assert fake_hf_child == [("latency", None)]
    assert len(latency_rows(capsys.readouterr().out)) == 1


def test_bench_without_torchao_says_so_and_keeps_our_number(int8_engine, monkeypatch, capsys):
    from compiled_llm.cli.main import main

    monkeypatch.setitem(sys.modules, "torchao", None)  # as if not installed: find_spec and import fail
    hf_calls = []
    monkeypatch.setattr(hf_child, "run_hf_child", lambda *a, **k: hf_calls.append(k) or wl.Result("latency", "hf", {}, "x"))
    assert main(["bench", str(int8_engine), "--workload", "latency", "--device", "cpu"]) == 0
    assert hf_calls == [{}]  # the bf16 peer only: no child is started for torchao
    rows = latency_rows(capsys.readouterr().out)
    assert len(rows) == 2 and "not run: torchao is not installed" in rows[1]
    assert float(rows[1].split()[2].replace(",", "")) > 0 and rows[1].split()[3] == "-"


def test_torchao_that_cannot_be_imported_is_a_note(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao", None)
    assert "not installed" in tp.missing_reason()
    res = tp.torchao_latency(preset_hf_config("tiny-qwen2"), torch.float32, CPU, "int8")
    assert res.metrics == {} and res.system == tp.system_name("int8")
    assert res.note.startswith("not run: torchao cannot be imported (")
    assert "no torchao config" in tp.torchao_latency({}, torch.float32, CPU, "fp8").note


def test_child_process_reports_why_torchao_failed(tmp_path, monkeypatch):
    """The child imports torchao itself: a broken install comes back as the row's note."""
    shim = tmp_path / "shim" / "torchao"
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text("raise ImportError('simulated broken torchao')\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(shim.parent), os.environ.get("PYTHONPATH", "")]))
    res = hf_child.run_hf_child(preset_hf_config("tiny-qwen2"), torch.float32, CPU, "latency", quantization="int8")
    assert res.system == tp.system_name("int8") and res.metrics == {}
    assert "not run: torchao cannot be imported (ImportError: simulated broken torchao)" in res.note


@pytest.fixture
def inductor_config_kept():
    """torchao's quantize_ sets inductor options process-wide (set_inductor_config): put them back
    for the tests after this one."""
    import torch._inductor.config as inductor_config

    saved = inductor_config.save_config()
    yield
    inductor_config.load_config(saved)


@pytest.mark.skipif(not _has_torchao(), reason="torchao is not installed")
def test_torchao_int8_quantizes_a_tiny_hf_model(inductor_config_kept):
    pytest.importorskip("torchao")
    model = wl.hf_model(preset_hf_config("tiny-qwen2"), torch.float32, CPU)
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        before = model(ids).logits
    try:
        done, total = tp.quantize_model(model, "int8")
    except Exception as e:  # pragma: no cover - depends on the installed torchao
        pytest.skip(f"torchao cannot quantize int8 on this CPU: {type(e).__name__}: {e}")
    assert done == total == 2 * 7 + 1  # 7 linears per layer and the lm_head
    assert type(model.lm_head.weight) is not torch.nn.Parameter
    assert type(model.model.embed_tokens.weight) is torch.nn.Parameter  # the tied embedding stays
    with torch.no_grad():
        after = model(ids).logits
    assert (after - before).abs().max() < 0.05 * before.abs().max()  # int8 per channel: close


@pytest.mark.skipif(not _has_torchao(), reason="torchao is not installed")
def test_torchao_int8_peer_times_a_tiny_model_in_its_child_process():
    res = hf_child.run_torchao_child(preset_hf_config("tiny-qwen2"), torch.float32, CPU, "int8")
    assert res.system == tp.system_name("int8") and res.metrics.get("decode_tok_s", 0) > 0, res.note
    assert "int8 weight-only on 15 of 15 linears" in res.note


@pytest.mark.skipif(not _has_torchao(), reason="torchao is not installed")
def test_torchao_int4_without_its_kernel_is_a_note(inductor_config_kept):
    """int4 (tinygemm packing) wants bf16 on CUDA: on the CPU in float32 the row says why."""
    pytest.importorskip("torchao")
    res = tp.torchao_latency(preset_hf_config("tiny-qwen2"), torch.float32, CPU, "int4", new_tokens=8, repeats=1)
    assert res.metrics == {} and res.note.startswith("not run: torchao ") and "cannot quantize int4 on cpu" in res.note
