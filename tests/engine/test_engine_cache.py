"""The compiled path is the default, and the engine cache makes it cheap after the first use.

- `compiled-llm build` defaults to --device auto / --dtype auto (vLLM's rule): here, without a
  GPU, cpu and float32; on a GPU the checkpoint's float16/bfloat16 (bfloat16 for float32 or an
  unstated dtype).
- `LLM(SOURCE)` and `compiled-llm run SOURCE` build the source once into
  $COMPILED_LLM_CACHE_DIR/engines/<name>-<key16>; a fresh process loads that engine without
  building, and gets the same tokens.
- The key changes with the weights, every build option and the versions; small files are keyed
  by content, large ones by size, mtime and their first and last MiB.
- Two processes asking for the same engine build it once.
- The eager reference is one flag away: `run SOURCE --eager`, `LLM(SOURCE, enforce_eager=True)`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from compiled_llm import LLM, SamplingParams
from compiled_llm.engine import cache as engine_cache
from compiled_llm.engine.artifact import read_manifest
from compiled_llm.engine.build_config import BuildConfig
from compiled_llm.model.placement import auto_dtype, checkpoint_dtype, resolve_device, resolve_dtype
from compiled_llm.cli.main import main, make_parser
from compiled_llm.engine.cache import cached_engine, engine_path, engines_dir
from helpers.greedy_oracle import lively_checkpoint
from helpers.hf_checkpoints import make_checkpoint

REPO = Path(__file__).resolve().parents[2]
PROMPTS = [[5, 77, 130, 2, 250, 31], [9, 8, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the defaults of a machine without CUDA")


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("COMPILED_LLM_CACHE_DIR", str(root))
    return root


def entries() -> list[Path]:
    root = engines_dir()
    return sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else []


def child_env() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
            "OMP_NUM_THREADS": "1"}


def greedy_tokens(llm) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    return [o.token_ids for o in outs]


# --- defaults ----------------------------------------------------------------------------------


def test_auto_dtype_on_a_gpu_is_the_checkpoints_half_dtype_else_bfloat16():
    assert auto_dtype("cuda", "float16") == torch.float16
    assert auto_dtype("cuda", "bfloat16") == torch.bfloat16
    assert auto_dtype("cuda", "float32") == torch.bfloat16
    assert auto_dtype("cuda", None) == torch.bfloat16
    assert auto_dtype("cuda", torch.float16) == torch.float16
    for ckpt in ("float16", "bfloat16", "float32", None):
        assert auto_dtype("cpu", ckpt) == torch.float32


def test_the_checkpoint_dtype_is_read_from_dtype_or_torch_dtype(tmp_path):
    assert checkpoint_dtype({"dtype": "bfloat16"}) == "bfloat16"  # transformers >= 4.56 / 5
    assert checkpoint_dtype({"torch_dtype": "float16"}) == "float16"  # older transformers
    assert checkpoint_dtype({"torch_dtype": None, "dtype": "float16"}) == "float16"
    assert checkpoint_dtype({}) is None
    # a real transformers-written checkpoint, re-labelled float16: "auto" on a GPU follows it
    # (a torch.device("cuda") can be named without a GPU; nothing runs on it here)
    make_checkpoint("qwen2", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert checkpoint_dtype(config) == "float32"
    assert resolve_dtype("auto", torch.device("cuda"), str(tmp_path)) == torch.bfloat16
    config.pop("torch_dtype", None)
    config["dtype"] = "float16"
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert resolve_dtype("auto", torch.device("cuda"), str(tmp_path)) == torch.float16
    assert resolve_dtype("auto", torch.device("cpu"), str(tmp_path)) == torch.float32
    assert resolve_dtype("bfloat16", torch.device("cpu"), str(tmp_path)) == torch.bfloat16
    # presets say nothing: bfloat16 on a GPU
    assert resolve_dtype("auto", torch.device("cuda"), "tiny-qwen2") == torch.bfloat16


@no_gpu
def test_build_defaults_resolve_to_cpu_and_float32_here(tmp_path, capsys):
    assert (BuildConfig().dtype, BuildConfig().device) == ("auto", "auto")
    sub = next(a for a in make_parser()._actions if isinstance(a, argparse._SubParsersAction))
    args = sub.choices["build"].parse_args(["tiny-gpt2", "-o", "x"])
    assert (args.dtype, args.device) == ("auto", "auto")
    assert resolve_device("auto") == torch.device("cpu")

    out = tmp_path / "engine"
    assert main(["build", "tiny-gpt2", "-o", str(out), "--quiet"]) == 0
    assert f"engine written to {out} (cpu, float32" in capsys.readouterr().out
    opts = read_manifest(out)["build_options"]
    assert (opts["device"], opts["dtype"]) == ("cpu", "float32")


# --- LLM(SOURCE): build once, load from the cache afterwards -----------------------------------

CHILD_LLM = r"""
import json, logging, sys
logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
import compiled_llm.engine.build as build

def refuse(*args, **kwargs):
    raise AssertionError("the engine was built again")

build.build_engine = refuse
from compiled_llm import LLM, SamplingParams
llm = LLM("tiny-qwen2", device="cpu", num_blocks=64)
outs = llm.generate([{"prompt_token_ids": p} for p in json.loads(sys.argv[1])],
                    SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), use_tqdm=False)
print(json.dumps({"engine": llm.model.name, "is_engine": llm.model.is_engine, "tokens": [o.token_ids for o in outs]}))
"""


def test_llm_on_a_preset_builds_once_and_a_fresh_process_loads_it_without_building(caplog):
    with caplog.at_level(logging.INFO, logger="compiled_llm.engine.cache"):
        llm = LLM("tiny-qwen2", device="cpu", num_blocks=64)
    (entry,) = entries()
    assert entry.name.startswith("tiny-qwen2-") and len(entry.name) == len("tiny-qwen2-") + 16
    assert llm.model.is_engine and Path(llm.model.name) == entry
    assert entry == engine_path("tiny-qwen2", device="cpu")
    built = [r.getMessage() for r in caplog.records if "building engine" in r.getMessage()]
    assert built == [f"building engine for tiny-qwen2 into {entry} (first use; cached for next time)"]
    tokens = greedy_tokens(llm)
    manifest_mtime = (entry / "manifest.json").stat().st_mtime_ns

    r = subprocess.run([sys.executable, "-c", CHILD_LLM, json.dumps(PROMPTS)], capture_output=True, text=True,
                       env=child_env(), timeout=300)
    assert r.returncode == 0, r.stderr
    child = json.loads(r.stdout.strip().splitlines()[-1])
    assert "building engine" not in r.stderr
    assert child == {"engine": str(entry), "is_engine": True, "tokens": tokens}
    assert (entry / "manifest.json").stat().st_mtime_ns == manifest_mtime
    assert entries() == [entry]


def test_llm_dtype_and_device_flow_into_the_cached_engine():
    llm = LLM("tiny-qwen2", device="cpu", dtype="bfloat16", num_blocks=16)
    assert llm.model.dtype == torch.bfloat16 and llm.model.is_engine
    assert Path(llm.model.name) == engine_path("tiny-qwen2", device="cpu", dtype="bfloat16")
    assert Path(llm.model.name) != engine_path("tiny-qwen2", device="cpu")
    assert read_manifest(llm.model.name)["build_options"]["dtype"] == "bfloat16"


def test_llm_enforce_eager_on_a_source_runs_the_eager_spec_and_builds_nothing():
    llm = LLM("tiny-qwen2", device="cpu", num_blocks=16, enforce_eager=True)
    assert not llm.model.is_engine and llm.model.name == "tiny-qwen2"
    assert llm.engine.config.enforce_eager
    assert greedy_tokens(llm)  # it runs
    assert entries() == []


# --- the key -----------------------------------------------------------------------------------


def test_a_changed_weight_file_or_option_gives_a_new_engine(tmp_path):
    ckpt = tmp_path / "ckpt"
    make_checkpoint("qwen2", ckpt)
    first = cached_engine(str(ckpt), device="cpu")
    assert first.name.startswith("ckpt-")
    assert cached_engine(str(ckpt), device="cpu") == first  # unchanged: the same entry, no build

    weights = ckpt / "model.safetensors"
    tensors = load_file(str(weights))
    name = "model.layers.1.mlp.up_proj.weight"
    tensors[name] = tensors[name] * 2  # same shape, new values
    save_file(tensors, str(weights), metadata={"format": "pt"})
    second = cached_engine(str(ckpt), device="cpu")
    assert second != first
    assert read_manifest(second)["files"]["weights.safetensors"] != read_manifest(first)["files"]["weights.safetensors"]

    shorter = cached_engine(str(ckpt), device="cpu", max_model_len=128)
    assert shorter not in (first, second)
    assert read_manifest(shorter)["build_options"]["max_model_len"] == 128
    assert entries() == sorted([first, second, shorter])


def test_every_build_option_and_version_is_in_the_key(monkeypatch):
    base = engine_path("tiny-qwen2", device="cpu")
    # resolved values make the key: auto is float32 here, and no max_model_len is the model's
    assert engine_path("tiny-qwen2", device="cpu", dtype="float32") == base
    assert engine_path("tiny-qwen2", device="cpu", max_model_len=1024) == base
    variants = {
        engine_path("tiny-qwen2", device="cpu", dtype="bfloat16"),
        engine_path("tiny-qwen2", device="cpu", dtype="float16"),
        engine_path("tiny-qwen2", device="cpu", max_model_len=512),
        engine_path("tiny-qwen2", device="cpu", disabled_passes=["fuse_qkv_rope"]),
        engine_path("tiny-qwen2", device="cpu", kernel_prefs={"paged_attention": "reference"}),
        engine_path("tiny-qwen2", device="cpu", load_format="dummy"),
        engine_path("tiny-qwen2", device="cpu", decode_backend="megakernel"),
        engine_path("tiny-qwen3", device="cpu"),
    }
    assert len(variants) == 8 and base not in variants
    real = engine_cache.versions
    for key, value in (("torch", "0.0.0"), ("triton", "0.0.0"), ("compiled_llm", "9.9"), ("gpu_arch", "sm_00")):
        monkeypatch.setattr(engine_cache, "versions", lambda device, k=key, v=value: {**real(device), k: v})
        assert engine_path("tiny-qwen2", device="cpu") != base, key
    assert all(p.parent == engines_dir() for p in variants)


# a value away from its default for each build option but the three the test above resolves
NON_DEFAULT_OPTIONS = {
    "disabled_passes": ["fuse_qkv_rope"], "kernel_prefs": {"paged_attention": "reference"}, "dump_ir": True,
    "quantization": "int8", "tensor_parallel_size": 2, "load_format": "dummy", "pipeline_parallel_size": 2,
    "decode_backend": "megakernel",
}


def test_each_build_option_away_from_its_default_gives_its_own_entry():
    """A new build option must be keyed too (it is listed here or this test fails): an entry
    keyed without it would hand a LLM(SOURCE, option=...) the engine built without it."""
    from compiled_llm.engine.build_config import field_names

    assert set(NON_DEFAULT_OPTIONS) | {"dtype", "device", "max_model_len"} == set(field_names())
    base = engine_path("tiny-qwen2", device="cpu")
    paths = {name: engine_path("tiny-qwen2", device="cpu", **{name: value})
             for name, value in NON_DEFAULT_OPTIONS.items()}
    assert base not in paths.values() and len(set(paths.values())) == len(paths), paths


def test_small_files_are_keyed_by_content_and_large_ones_by_size_mtime_and_ends(tmp_path, monkeypatch):
    make_checkpoint("qwen2", tmp_path)
    weights = tmp_path / "model.safetensors"
    src = str(tmp_path)
    base = engine_path(src, device="cpu")

    def touch():
        st = weights.stat()
        os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))

    touch()
    assert engine_path(src, device="cpu") == base  # same bytes: same engine

    # the weights as a "large" file: never read in full, only their first and last MiB
    monkeypatch.setattr(engine_cache, "FULL_HASH_MAX_BYTES", 1024)
    reads = []
    real_sha = engine_cache._sha256
    monkeypatch.setattr(engine_cache, "_sha256", lambda path, limit=None, tail=False: (
        reads.append((Path(path).name, limit)), real_sha(path, limit, tail))[1])
    large = engine_path(src, device="cpu")
    assert ("model.safetensors", None) not in reads and ("model.safetensors", engine_cache.EDGE_BYTES) in reads
    touch()
    assert engine_path(src, device="cpu") != large  # a large file's mtime counts


CHILD_BUILD = r"""
import logging, sys
logging.basicConfig(level=logging.INFO, format="%(message)s")
from compiled_llm.engine.cache import cached_engine
print(cached_engine(sys.argv[1], device="cpu", progress=False))
"""


def test_two_processes_build_one_engine_and_a_damaged_entry_is_rebuilt(caplog):
    procs = [subprocess.Popen([sys.executable, "-c", CHILD_BUILD, "tiny-gpt2"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=child_env()) for _ in range(2)]
    results = [p.communicate(timeout=300) + (p.returncode,) for p in procs]
    for out, err, rc in results:
        assert rc == 0, err
    (a, _, _), (b, _, _) = results
    assert a.strip() == b.strip()
    assert sum(err.count("building engine for tiny-gpt2") for _, err, _ in results) == 1
    (entry,) = entries()
    assert str(entry) == a.strip()
    read_manifest(entry)
    assert [p.name for p in engines_dir().iterdir()] and not [p for p in engines_dir().iterdir() if ".building-" in p.name]

    (entry / "manifest.json").write_text("{")  # damaged: not an engine any more
    with caplog.at_level(logging.INFO, logger="compiled_llm.engine.cache"):
        assert cached_engine("tiny-gpt2", device="cpu", progress=False) == entry
    assert any("building engine for tiny-gpt2" in r.getMessage() for r in caplog.records)
    read_manifest(entry)


def test_a_cuda_entry_cached_without_kernels_is_rebuilt_once_a_warm_up_is_given(caplog):
    entry = cached_engine("tiny-gpt2", device="cpu", progress=False)
    # what a CUDA build without a warm-up leaves (a caller that gave none): no kernel cache
    manifest = json.loads((entry / "manifest.json").read_text())
    manifest["build_options"]["device"] = "cuda"
    assert manifest["kernel_cache"] is None
    (entry / "manifest.json").write_text(json.dumps(manifest))
    with caplog.at_level(logging.INFO, logger="compiled_llm.engine.cache"):
        assert cached_engine("tiny-gpt2", device="cpu", progress=False) == entry  # no warm-up: kept
        assert not any("building engine" in r.getMessage() for r in caplog.records)
        assert cached_engine("tiny-gpt2", device="cpu", progress=False, warm_up=lambda *a: None) == entry
    assert any("building engine for tiny-gpt2" in r.getMessage() for r in caplog.records)
    assert read_manifest(entry)["build_options"]["device"] == "cpu"


# --- the CLI -----------------------------------------------------------------------------------


def run_json(capsys, *argv) -> list[dict]:
    rc = main(["run", *map(str, argv), "--json", "--device", "cpu"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    return [json.loads(line) for line in out.out.splitlines()]


def test_run_source_eager_is_the_reference_loop_and_the_default_is_the_cached_engine(tmp_path, capsys, monkeypatch):
    import compiled_llm.serve.reference as reference

    lively_checkpoint("qwen2", tmp_path / "ckpt")
    calls = []
    real = reference.generate_reference
    monkeypatch.setattr(reference, "generate_reference", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    argv = [tmp_path / "ckpt", "--prompt-ids", "5,77,130,2,250,31", "--prompt-ids", "9,8,7", "--max-tokens", 16,
            "--ignore-eos"]

    eager = run_json(capsys, *argv, "--eager")
    assert calls and entries() == []  # the reference loop ran; nothing was built
    calls.clear()

    compiled = run_json(capsys, *argv)
    assert not calls
    (entry,) = entries()
    assert entry.name.startswith("ckpt-") and read_manifest(entry)["source"]["model_dir"] == str((tmp_path / "ckpt").resolve())
    assert [r["token_ids"] for r in compiled] == [r["token_ids"] for r in eager]
    assert len(set(compiled[0]["token_ids"])) >= 4  # varied output: every step is compared
    assert compiled == eager

    # the readable header names the cached engine; a second run builds nothing new
    assert main(["run", *map(str, argv), "--device", "cpu"]) == 0
    assert f"compiled runtime, cached engine {entry}" in capsys.readouterr().out
    assert entries() == [entry]


def test_eager_with_an_engine_directory_is_an_error(tmp_path, capsys):
    (tmp_path / "manifest.json").write_text("{}")
    assert main(["run", str(tmp_path), "--eager", "--prompt-ids", "1,2"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error:") and "already compiled" in line and "--enforce-eager" in line


@pytest.mark.parametrize("command", ["run", "bench"])
def test_no_cuda_graphs_is_a_hidden_alias_of_enforce_eager(command):
    sub = next(a for a in make_parser()._actions if isinstance(a, argparse._SubParsersAction))
    parser = sub.choices[command]
    assert parser.parse_args(["x"]).enforce_eager is False
    assert parser.parse_args(["x", "--enforce-eager"]).enforce_eager is True
    assert parser.parse_args(["x", "--no-cuda-graphs"]).enforce_eager is True
    text = parser.format_help()
    assert "--enforce-eager" in text and "--no-cuda-graphs" not in text


def test_compiled_llm_cache_dir_is_the_one_variable_every_cache_follows(tmp_path, monkeypatch):
    """Engines, unpacked engine kernels and the CUDA extensions built on this machine all live
    under $COMPILED_LLM_CACHE_DIR (the CUDA build once read a variable of its own)."""
    import re
    from pathlib import Path

    from compiled_llm.engine import cache, kernel_cache
    from compiled_llm.kernels import cuda_build

    monkeypatch.setenv("COMPILED_LLM_CACHE_DIR", str(tmp_path))
    assert cache.engines_dir() == tmp_path / "engines"
    assert cuda_build.cache_root() == tmp_path
    assert kernel_cache.cache_root() == tmp_path
    package = Path(cache.__file__).parents[1]
    names = {m for f in package.rglob("*.py") for m in re.findall(r"COMPILED_LLM_CACHE\w*", f.read_text())}
    assert names == {"COMPILED_LLM_CACHE_DIR"}
