"""Loading an engine runs no code its author planted, and reads nothing outside its directory.

Each test plays the tamperer, who also rewrites the manifest's checksums (whoever writes an engine
writes its manifest, so checksums prove nothing here): a pickle planted in any file the loader
reads is refused with one line and never unpickled; manifest paths that leave the directory or go
through a symlink are refused.
"""

import json
import os
import pathlib
import pickle
import shutil
import subprocess
import sys

import pytest
import torch

from compiled_llm.engine import artifact
from compiled_llm.engine.build import build_engine
from compiled_llm.errors import EngineError


class Planted:
    """Unpickling this creates the file at ``marker``: the test's proof that code ran."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (pathlib.Path.touch, (pathlib.Path(self.marker),))


@pytest.fixture
def tampered(tiny_engine_copy):
    return tiny_engine_copy


def rewrite_manifest(engine_dir, **changes):
    """What a tamperer does after editing files: fresh checksums and any manifest changes."""
    path = engine_dir / "manifest.json"
    m = json.loads(path.read_text())
    m.update(changes)
    m["files"] = {rel: artifact.sha256_file(engine_dir / rel) if (engine_dir / rel).is_file() else digest
                  for rel, digest in m["files"].items()}
    path.write_text(json.dumps(m))
    return m


def one_line_refusal(engine_dir) -> str:
    with pytest.raises(EngineError) as info:
        artifact.load_engine(engine_dir)
    message = str(info.value)
    assert message and "\n" not in message
    return message


LOADED_FILES = [
    "program.json",
    "weights.safetensors",
    "tokenizer/tokenizer.json",
    "tokenizer/tokenizer_config.json",
    "tokenizer/chat_template.jinja",
    "ir/00_captured.ops.json",
]


@pytest.mark.parametrize("rel", LOADED_FILES)
@pytest.mark.parametrize("how", ["pickle", "torch.save"])
def test_a_planted_pickle_is_refused_and_never_runs(tampered, tmp_path, rel, how):
    marker = tmp_path / "code-ran"
    target = tampered / rel
    assert target.is_file(), f"the engine no longer has {rel}: update the list"
    if how == "pickle":
        target.write_bytes(pickle.dumps(Planted(str(marker))))
    else:
        torch.save({"x": Planted(str(marker))}, target)
    rewrite_manifest(tampered)
    message = one_line_refusal(tampered)
    assert rel in message or "safetensors" in message
    assert not marker.exists()


def test_a_pickled_manifest_is_refused_and_never_runs(tampered, tmp_path):
    marker = tmp_path / "code-ran"
    (tampered / "manifest.json").write_bytes(pickle.dumps(Planted(str(marker))))
    assert "not valid JSON" in one_line_refusal(tampered)
    assert not marker.exists()


def test_an_old_pt2_program_is_refused(tampered, tmp_path):
    """Engines of format 1 stored a .pt2 (whose reader unpickles): even relabelled as the
    current format, such a program is not read."""
    (tampered / "program.pt2").write_bytes(b"PK\x03\x04" + b"\x00" * 64)
    m = json.loads((tampered / "manifest.json").read_text())
    m["files"]["program.pt2"] = ""
    rewrite_manifest(tampered, program={**m["program"], "file": "program.pt2"}, files=m["files"])
    assert "program.pt2 holds a pickle or zip archive" in one_line_refusal(tampered)


def test_a_program_calling_anything_but_operators_is_refused(tampered):
    program = json.loads((tampered / "program.json").read_text())
    node = next(n for n in program["nodes"] if n["op"] == "call_function")
    for target in ("os.system", "builtins.eval", "torch.load", "aten::__import__.default", "prims::x.default"):
        node["target"] = target
        (tampered / "program.json").write_text(json.dumps(program))
        rewrite_manifest(tampered)
        message = one_line_refusal(tampered)
        assert "may not call" in message or "not registered" in message


def test_a_program_cannot_reach_files_through_aten(tampered, tmp_path):
    """aten::from_file maps a file with write-back: a planted call to it, filled in place, would
    overwrite any file the user can write. Only pure tensor ops are callable."""
    victim = tmp_path / "victim.txt"
    victim.write_text("hello")
    program = json.loads((tampered / "program.json").read_text())
    nodes = program["nodes"]
    at = next(i for i, n in enumerate(nodes) if n["op"] == "call_function")
    nodes[at:at] = [
        {"name": "mapped", "op": "call_function", "target": "aten::from_file.default",
         "args": [str(victim), True, 5], "kwargs": {"dtype": {"dtype": "uint8"}}},
        {"name": "filled", "op": "call_function", "target": "aten::fill_.Scalar", "args": [{"node": "mapped"}, 65],
         "kwargs": {}},
    ]
    (tampered / "program.json").write_text(json.dumps(program))
    rewrite_manifest(tampered)
    assert "aten::from_file.default" in one_line_refusal(tampered)
    assert victim.read_text() == "hello"


@pytest.mark.parametrize("disabled", [["fuse_norm_mlp", "fuse_qkv_rope", "fuse_residual", "fuse_add_norm"]])
@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-gpt2"])
def test_every_program_a_build_writes_loads(tmp_path, preset, disabled):
    """Unfused programs use more aten ops than fused ones: each one a build writes must load."""
    out = tmp_path / "e"
    build_engine(preset, out, disabled_passes=disabled, progress=False)
    artifact.load_engine(out)


@pytest.mark.parametrize("bad", ["../outside.json", "../../etc/passwd", "/etc/passwd", "ir/../../x", "C:\\x"])
def test_manifest_paths_outside_the_engine_are_refused(tampered, bad):
    m = json.loads((tampered / "manifest.json").read_text())
    m["files"][bad] = "0" * 64
    (tampered / "manifest.json").write_text(json.dumps(m))
    assert "refusing to load" in one_line_refusal(tampered)


@pytest.mark.parametrize("key", ["program", "tokenizer"])
def test_program_and_tokenizer_paths_outside_the_engine_are_refused(tampered, tmp_path, key):
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    m = json.loads((tampered / "manifest.json").read_text())
    value = {**m["program"], "file": str(outside / "program.json")} if key == "program" else str(outside)
    rewrite_manifest(tampered, **{key: value})
    assert "leaves the engine directory" in one_line_refusal(tampered)


def test_symlinked_files_are_refused(tampered, tmp_path):
    outside = tmp_path / "weights-elsewhere.safetensors"
    shutil.move(tampered / "weights.safetensors", outside)
    os.symlink(outside, tampered / "weights.safetensors")
    assert "goes through a symlink" in one_line_refusal(tampered)


def test_symlinked_directories_are_refused(tampered, tmp_path):
    outside = tmp_path / "tok-elsewhere"
    shutil.move(tampered / "tokenizer", outside)
    os.symlink(outside, tampered / "tokenizer")
    assert "goes through a symlink" in one_line_refusal(tampered)


def test_unlisted_or_linked_tokenizer_files_are_refused(tampered, tmp_path):
    """The tokenizer is read from its directory: a file the manifest does not list (a planted
    template, a link to a file elsewhere) is refused, not read."""
    (tmp_path / "elsewhere.json").write_text("{}")
    os.symlink(tmp_path / "elsewhere.json", tampered / "tokenizer" / "special_tokens_map.json")
    assert "tokenizer/special_tokens_map.json is not one the manifest lists" in one_line_refusal(tampered)
    os.unlink(tampered / "tokenizer" / "special_tokens_map.json")
    (tampered / "tokenizer" / "added_tokens.json").write_text("{}")
    assert "tokenizer/added_tokens.json is not one the manifest lists" in one_line_refusal(tampered)


@pytest.mark.parametrize("field, value", [
    ("source", "a string"), ("kernels", ["a", "list"]), ("model_config", "x"),
    ("build_options", {"device": "cpu"}), ("program", {"file": "program.json"}),
])
def test_malformed_manifest_fields_are_one_line(tampered, field, value):
    rewrite_manifest(tampered, **{field: value})
    assert f"malformed '{field}'" in one_line_refusal(tampered)


def test_run_prints_one_line_and_runs_nothing(tampered, tmp_path):
    marker = tmp_path / "code-ran"
    (tampered / "program.json").write_bytes(pickle.dumps(Planted(str(marker))))
    rewrite_manifest(tampered)
    proc = subprocess.run(
        [sys.executable, "-m", "compiled_llm.cli.main", "run", str(tampered), "--prompt-ids", "1,2", "--max-tokens", "2"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and proc.stderr.startswith("error: engine file program.json")
    assert not marker.exists()


def _kernel_engine(root, children):
    """An engine's kernel directory as a CUDA build leaves it: one Triton cache entry whose group
    index names its files by the build's absolute paths."""
    entry = root / "kernels" / "triton" / "ENTRY"
    entry.mkdir(parents=True)
    (entry / "k.cubin").write_bytes(b"\x7fELF")
    (entry / "k.json").write_text("{}")
    (entry / "__grp__k.json").write_text(json.dumps({"child_paths": children}))
    files = {p.relative_to(root).as_posix(): "0" for p in entry.iterdir()}
    return {"kernel_cache": "kernels/triton", "files": files}


@pytest.fixture
def triton_knobs(monkeypatch, tmp_path):
    triton = pytest.importorskip("triton")
    monkeypatch.setenv("COMPILED_LLM_CACHE_DIR", str(tmp_path / "cache"))
    previous = triton.knobs.cache.dir
    yield triton
    triton.knobs.cache.dir = previous


def test_kernel_indexes_are_pointed_at_the_local_copy(tmp_path, triton_knobs):
    from compiled_llm.engine import kernel_cache

    built = "/somewhere/.e.building-x/engine/kernels/triton/ENTRY"
    manifest = _kernel_engine(tmp_path / "e", {"k.cubin": f"{built}/k.cubin", "k.json": f"{built}/k.json"})
    local = kernel_cache.use_engine_kernels(tmp_path / "e", manifest, torch.device("cuda"))
    assert triton_knobs.knobs.cache.dir == str(local)
    children = json.loads((local / "ENTRY" / "__grp__k.json").read_text())["child_paths"]
    assert children == {"k.cubin": str(local / "ENTRY" / "k.cubin"), "k.json": str(local / "ENTRY" / "k.json")}


def test_kernel_indexes_naming_other_files_are_refused(tmp_path, triton_knobs):
    from compiled_llm.engine import kernel_cache

    manifest = _kernel_engine(tmp_path / "e", {"k.cubin": "/etc/passwd"})
    with pytest.raises(EngineError, match="outside its entry"):
        kernel_cache.use_engine_kernels(tmp_path / "e", manifest, torch.device("cuda"))


def test_engines_carry_no_host_code(tmp_path, triton_knobs):
    from compiled_llm.engine import kernel_cache

    manifest = _kernel_engine(tmp_path / "e", {})
    manifest["files"]["kernels/triton/ENTRY/__triton_launcher.so"] = "0"
    with pytest.raises(EngineError, match="engines may not carry host code"):
        kernel_cache.use_engine_kernels(tmp_path / "e", manifest, torch.device("cuda"))
