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

from compiled_llm import artifact
from compiled_llm.build import build_engine
from compiled_llm.errors import EngineError


class Planted:
    """Unpickling this creates the file at ``marker``: the test's proof that code ran."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (pathlib.Path.touch, (pathlib.Path(self.marker),))


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    out = tmp_path_factory.mktemp("safety") / "tiny-qwen2"
    build_engine("tiny-qwen2", out, progress=False)
    return out


@pytest.fixture
def tampered(engine, tmp_path):
    dst = tmp_path / "engine"
    shutil.copytree(engine, dst)
    return dst


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
