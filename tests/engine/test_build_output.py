"""`compiled-llm build -o DIR` never deletes anything it did not write.

- DIR is an engine only when its manifest.json is a complete engine manifest of a known format
  and every file it lists has its sha256; any other non-empty directory (a web app with its own
  manifest.json, a manifest naming the user's files) is refused and left untouched;
- a rebuild refuses an engine holding a file of the user's in tokenizer/ (naming it), since the
  rebuilt engine would not load;
- the current directory, the home directory, / and their ancestors, and symbolic links are
  refused (one-line error, exit 2 from the CLI), whatever they hold;
- a rebuild swaps the new engine in atomically; files the user kept inside the old engine
  directory are carried into the new one; paths an old manifest lists outside it are never
  followed;
- a failed or killed build leaves the old engine intact and loadable, and the next build of the
  same DIR tidies what the killed one left (only what is provably ours).
"""

import json
import logging
import os
import signal
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from compiled_llm.engine import artifact, output_dir as engine_output
from compiled_llm.engine.build import build_engine
from compiled_llm.cli.main import main
from compiled_llm.errors import CompiledLLMError

PRESET = "tiny-qwen2"


def build(out, **kw):
    return build_engine(PRESET, out, device="cpu", progress=False, **kw)


def snapshot(root: Path) -> dict:
    """Every entry under ``root``: file bytes, link targets, directories."""
    entries = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            rel = str(path.relative_to(root))
            if path.is_symlink():
                entries[rel] = ("link", os.readlink(path))
            elif path.is_dir():
                entries[rel] = ("dir",)
            else:
                entries[rel] = ("file", path.read_bytes())
    return entries


def assert_loads(engine_dir: Path) -> dict:
    manifest = artifact.read_manifest(engine_dir)
    artifact.verify_files(engine_dir, manifest)
    return manifest


def leftovers(target: Path) -> list[str]:
    return sorted(p.name for p in target.parent.iterdir() if p.name.startswith(f".{target.name}."))


def refused(out, match):
    with pytest.raises(CompiledLLMError, match=match) as info:
        build(out)
    message = str(info.value)
    assert "\n" not in message and str(out) in message
    return message


@pytest.fixture
def built(tiny_engine):
    """One engine built into a fresh target (shared: do not change it)."""
    return tiny_engine


@pytest.fixture
def engine(tiny_engine, tmp_path):
    """A fresh copy of one built engine, at tmp_path/eng."""
    return Path(shutil.copytree(tiny_engine, tmp_path / "eng"))


def add_user_files(engine_dir: Path) -> dict:
    files = {
        "NOTES.md": b"my notes about this engine\n",
        "results/run1.json": b'{"tok_per_s": 123}\n',
        "ir/my_annotations.txt": b"fusion looks right\n",  # inside a directory the engine uses
    }
    for rel, data in files.items():
        (engine_dir / rel).parent.mkdir(parents=True, exist_ok=True)
        (engine_dir / rel).write_bytes(data)
    return files


# ---------------------------------------------------------------------------------------------
# Which directories are accepted
# ---------------------------------------------------------------------------------------------


def test_fresh_target_gets_an_engine_and_nothing_else(built):
    manifest = assert_loads(built)
    assert engine_output.BUILD_MARKER not in json.dumps(manifest["files"])
    assert not (built / engine_output.BUILD_MARKER).exists()
    assert (built.stat().st_mode & 0o777) == 0o755
    assert leftovers(built) == []


def test_empty_existing_directory_is_fine(tmp_path):
    out = tmp_path / "eng"
    out.mkdir()
    build(out)
    assert_loads(out)
    assert leftovers(out) == []


def test_directory_with_a_foreign_manifest_is_refused_and_untouched(tmp_path):
    webapp = tmp_path / "webapp"
    (webapp / "static").mkdir(parents=True)
    (webapp / "manifest.json").write_text(json.dumps({"name": "webapp"}))
    (webapp / "index.html").write_text("<html></html>")
    (webapp / "static" / "app.js").write_text("console.log(1)")
    before = snapshot(webapp)
    refused(webapp, "not a compiled_llm engine manifest")
    assert snapshot(webapp) == before
    assert leftovers(webapp) == []


def test_non_empty_directory_without_engine_and_existing_file_are_refused(tmp_path):
    photos = tmp_path / "photos"
    photos.mkdir()
    (photos / "cat.jpg").write_bytes(b"\xff\xd8")
    refused(photos, "not empty and holds no engine")
    assert (photos / "cat.jpg").read_bytes() == b"\xff\xd8"
    a_file = tmp_path / "file"
    a_file.write_text("keep me")
    refused(a_file, "not a directory")
    assert a_file.read_text() == "keep me"


def test_current_directory_is_refused_even_with_files_or_an_engine(tmp_path, engine, monkeypatch):
    work = tmp_path / "project"
    work.mkdir()
    (work / "main.py").write_text("print('hi')")
    monkeypatch.chdir(work)
    before = snapshot(work)
    refused(".", "current directory")
    assert snapshot(work) == before
    monkeypatch.chdir(engine)  # an engine, but the directory the user stands in
    before = snapshot(engine)
    refused(".", "current directory")
    refused(str(engine), "current directory")
    assert snapshot(engine) == before


def test_ancestors_of_the_current_directory_and_root_are_refused(engine, monkeypatch):
    monkeypatch.chdir(engine / "ir")
    before = snapshot(engine)
    refused(str(engine), "ancestor of the current directory")
    refused("..", "ancestor of the current directory")
    refused("/", "filesystem root")
    assert snapshot(engine) == before


def test_home_directory_is_refused(tmp_path, engine, monkeypatch):
    home = tmp_path / "home"
    home.mkdir()
    (home / ".bashrc").write_text("export X=1")
    monkeypatch.setenv("HOME", str(home))
    refused(home, "home directory")
    assert (home / ".bashrc").read_text() == "export X=1"
    monkeypatch.setenv("HOME", str(engine))  # even when the home directory holds an engine
    before = snapshot(engine)
    refused(engine, "home directory")
    assert snapshot(engine) == before


@pytest.mark.parametrize("points_to", ["engine", "plain dir", "nowhere"])
def test_symlink_output_is_refused_and_its_target_untouched(tmp_path, engine, points_to):
    target = {"engine": engine, "plain dir": tmp_path / "plain", "nowhere": tmp_path / "missing"}[points_to]
    if points_to == "plain dir":
        target.mkdir()
    link = tmp_path / "link"
    link.symlink_to(target)
    before = snapshot(target) if target.exists() else None
    refused(link, "symbolic link")
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert (snapshot(target) if target.exists() else None) == before
    assert leftovers(link) == [] and leftovers(target) == []


def test_cli_prints_one_error_line_and_exits_2(tmp_path, monkeypatch, capsys):
    webapp = tmp_path / "webapp"
    webapp.mkdir()
    (webapp / "manifest.json").write_text('{"name": "webapp"}')
    assert main(["build", PRESET, "-o", str(webapp), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: refusing to build into {webapp}: ") and "\n" not in err
    assert json.loads((webapp / "manifest.json").read_text()) == {"name": "webapp"}
    monkeypatch.chdir(webapp)
    assert main(["build", PRESET, "-o", ".", "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "error: refusing to build into .: it is the current directory; name a subdirectory such as ./engine"


# ---------------------------------------------------------------------------------------------
# Rebuilds: the swap
# ---------------------------------------------------------------------------------------------


def test_rebuild_keeps_the_users_files_and_loads(engine):
    user_files = add_user_files(engine)
    build(engine, max_model_len=64)  # a different engine, to see it replaced the old one
    manifest = assert_loads(engine)
    assert manifest["build_options"]["max_model_len"] == 64
    for rel, data in user_files.items():
        assert (engine / rel).read_bytes() == data
        assert rel not in manifest["files"]
    assert leftovers(engine) == []


def test_user_file_on_a_path_the_new_engine_takes_is_kept_aside_with_a_warning(engine, caplog):
    # the old engine did not list ir/00_captured.py (say an older build), so the file there is the
    # user's; the new engine writes that path too, so the user's copy stays in the aside dir
    manifest = json.loads((engine / "manifest.json").read_text())
    del manifest["files"]["ir/00_captured.py"]
    (engine / "manifest.json").write_text(json.dumps(manifest))
    (engine / "ir" / "00_captured.py").write_text("# my edited copy\n")
    with caplog.at_level(logging.WARNING, logger="compiled_llm.engine.output_dir"):
        build(engine)
    assert_loads(engine)
    [aside] = leftovers(engine)
    assert aside.startswith(".eng.old-")
    assert (engine.parent / aside / "ir" / "00_captured.py").read_text() == "# my edited copy\n"
    assert snapshot(engine.parent / aside).keys() == {"ir", "ir/00_captured.py"}
    assert aside in caplog.text


def test_old_manifest_paths_outside_the_directory_are_never_followed(tmp_path, engine):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "victim.txt").write_text("precious")
    (outside / "linked.txt").write_text("also precious")
    (tmp_path / "sibling.txt").write_text("precious too")
    (engine / "dirlink").symlink_to(outside)
    (engine / "filelink").symlink_to(outside / "linked.txt")
    manifest = json.loads((engine / "manifest.json").read_text())
    manifest["files"].update({
        "../sibling.txt": "0", str(outside / "victim.txt"): "0", "dirlink/victim.txt": "0",
        "filelink": "0", "ir/../../sibling.txt": "0",
    })
    (engine / "manifest.json").write_text(json.dumps(manifest))
    before, before_engine = snapshot(tmp_path / "outside"), snapshot(engine)
    # a manifest naming paths outside its directory is not one a build wrote: the directory is
    # not taken for an engine, so nothing in it (or through it) is touched
    with pytest.raises(CompiledLLMError, match="not a compiled_llm engine manifest"):
        build(engine)
    assert snapshot(tmp_path / "outside") == before
    assert snapshot(engine) == before_engine
    assert (tmp_path / "sibling.txt").read_text() == "precious too"
    assert leftovers(engine) == []


def test_an_unwritable_parent_is_one_line(capsys):
    assert main(["build", PRESET, "-o", "/proc/compiled_llm_test/engine", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1


def as_format_1(engine_dir: Path) -> dict:
    """Make ``engine_dir`` look as format 1 wrote it: its keys (``backend`` among them) and the
    sha256 of every file."""
    manifest = json.loads((engine_dir / "manifest.json").read_text())
    manifest.update(format_version=1, backend="inductor", batch_buckets=[1, 2, 4])
    (engine_dir / "manifest.json").write_text(json.dumps(manifest))
    return manifest


def test_an_engine_of_an_older_format_is_rebuilt_in_place(engine):
    """Engines written before the current format load no more, but a build over one replaces it
    (keeping the user's files) instead of refusing it as foreign."""
    as_format_1(engine)
    user_files = add_user_files(engine)
    build(engine)
    assert_loads(engine)
    for rel, content in user_files.items():
        assert (engine / rel).read_bytes() == content
    assert leftovers(engine) == []


def test_a_manifest_listing_the_users_files_is_no_engine_and_nothing_is_deleted(tmp_path, capsys):
    """The issue's repro: any manifest with format_version 1 and a files dict was taken for an
    older engine, and the files it listed were deleted by the build."""
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "notes.txt").write_text("thesis\n")
    (proj / "data.csv").write_text("a,b\n")
    (proj / "manifest.json").write_text('{"format_version": 1, "files": {"notes.txt": "", "data.csv": ""}}\n')
    before = snapshot(proj)
    assert main(["build", PRESET, "-o", str(proj), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: refusing to build into {proj}: it is not empty and its manifest.json is not a "
                          "compiled_llm engine manifest (") and "\n" not in err
    assert snapshot(proj) == before
    assert leftovers(proj) == []


@pytest.mark.parametrize("change", ["digest of another file", "empty digest", "listed file missing",
                                    "a required key missing", "file edited after the build"])
@pytest.mark.parametrize("version", [1, 2])
def test_a_manifest_that_does_not_match_its_files_is_no_engine(engine, change, version):
    """Only a complete manifest of a known format whose every file has its sha256 makes a
    directory an engine a build may replace; format 1 is held to the same checks."""
    manifest = as_format_1(engine) if version == 1 else json.loads((engine / "manifest.json").read_text())
    files = manifest["files"]
    if change == "digest of another file":
        files["program.json"] = files["weights.safetensors"]
    elif change == "empty digest":
        files["program.json"] = ""
    elif change == "listed file missing":
        files["notes.txt"] = "0" * 64
    elif change == "a required key missing":
        del manifest["model_config"]
    else:
        (engine / "program.json").write_text("{}")
    (engine / "manifest.json").write_text(json.dumps(manifest))
    before = snapshot(engine)
    refused(engine, "not a compiled_llm engine manifest")
    assert snapshot(engine) == before
    assert leftovers(engine) == []


def test_a_rebuild_refuses_a_user_file_in_the_tokenizer_folder_and_names_it(engine, capsys):
    """The issue's repro: a file kept in eng/tokenizer/ survived the rebuild, and the rebuilt
    engine did not load ("engine file tokenizer/NOTES.txt is not one the manifest lists"). The
    tokenizer is read from its folder as a whole, so the rebuild refuses up front, naming the
    file; moved elsewhere in the engine, it is kept and the engine loads."""
    (engine / "tokenizer" / "NOTES.txt").write_text("which tokenizer this is\n")
    before = snapshot(engine)
    assert main(["build", PRESET, "-o", str(engine), "--device", "cpu", "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: refusing to build into {engine}: it holds tokenizer/NOTES.txt, which the engine "
                          "does not list, in tokenizer/") and "\n" not in err
    assert snapshot(engine) == before
    assert leftovers(engine) == []

    (engine / "tokenizer" / "NOTES.txt").rename(engine / "NOTES.txt")
    assert main(["build", PRESET, "-o", str(engine), "--device", "cpu", "--max-model-len", "64", "--quiet"]) == 0
    loaded = artifact.load_engine(engine)
    assert loaded.manifest["build_options"]["max_model_len"] == 64 and loaded.tokenizer is not None
    assert (engine / "NOTES.txt").read_text() == "which tokenizer this is\n"
    assert leftovers(engine) == []


def test_a_rebuild_hashes_each_file_of_the_old_engine_once(engine, monkeypatch):
    """The old engine's files are checked against their sha256 before the build, again before
    the swap and once more when they are retired: each is read once all the same."""
    hashed = []
    real = engine_output.sha256_file
    monkeypatch.setattr(engine_output, "sha256_file", lambda path: hashed.append(Path(path).name) or real(path))
    old_files = json.loads((engine / "manifest.json").read_text())["files"]
    build(engine)
    assert sorted(hashed) == sorted(Path(rel).name for rel in old_files)


def test_a_retired_engine_loses_only_files_that_hold_what_it_wrote(engine, built):
    """A listed file whose content is not what the manifest lists (its sha256 differs) is not
    the engine's to delete: retiring the old engine carries it into the new one."""
    (engine / "ir" / "my_notes.txt").write_text("mine\n")
    manifest = json.loads((engine / "manifest.json").read_text())
    manifest["files"]["ir/my_notes.txt"] = "0" * 64  # listed, but not with this content
    (engine / "manifest.json").write_text(json.dumps(manifest))
    aside = engine.parent / ".eng.old-abcd1234"  # a swap killed before it retired the old engine
    engine.rename(aside)
    shutil.copytree(built, engine)
    build(engine)
    assert_loads(engine)
    assert (engine / "ir" / "my_notes.txt").read_text() == "mine\n"
    assert leftovers(engine) == []


def test_failing_to_move_the_new_engine_in_puts_the_old_one_back(engine, monkeypatch):
    user_files = add_user_files(engine)
    before = snapshot(engine)
    real_rename = os.rename

    def rename(src, dst):
        if Path(src).name == engine_output.ENGINE_SUBDIR:  # the new engine moving into place
            raise OSError(28, "No space left on device")
        return real_rename(src, dst)

    monkeypatch.setattr(engine_output.os, "rename", rename)
    with pytest.raises(CompiledLLMError, match="No space left on device"):
        build(engine)
    assert snapshot(engine) == before
    assert all((engine / rel).read_bytes() == data for rel, data in user_files.items())
    assert_loads(engine)
    assert leftovers(engine) == []


# ---------------------------------------------------------------------------------------------
# Failed and killed builds, and what they leave
# ---------------------------------------------------------------------------------------------


def test_build_interrupted_before_the_swap_leaves_the_old_engine(engine, monkeypatch):
    import compiled_llm.engine.build as build_module

    before = snapshot(engine)

    def interrupted(*args, **kwargs):
        [box] = [n for n in leftovers(engine) if n.startswith(".eng.building-")]
        assert (engine.parent / box / engine_output.BUILD_MARKER).is_file()
        raise KeyboardInterrupt

    monkeypatch.setattr(build_module, "lower", interrupted)
    with pytest.raises(KeyboardInterrupt):
        build(engine)
    assert snapshot(engine) == before
    assert_loads(engine)
    assert leftovers(engine) == []  # an interrupted (not killed) build cleans up after itself


def test_sigkilled_build_leaves_the_old_engine_and_the_next_build_cleans_up(engine):
    user_files = add_user_files(engine)
    before = snapshot(engine)
    proc = subprocess.Popen(
        [sys.executable, "-m", "compiled_llm.cli.main", "build", PRESET, "-o", str(engine),
         "--device", "cpu", "--quiet"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 120
        while not list(engine.parent.glob(f".eng.building-*/{engine_output.BUILD_MARKER}")):
            assert proc.poll() is None, "the build ended before its work dir appeared"
            assert time.monotonic() < deadline, "no work dir appeared"
            time.sleep(0.005)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert snapshot(engine) == before
    assert_loads(engine)
    [box] = leftovers(engine)
    assert box.startswith(".eng.building-")

    build(engine)  # the next build of the same target removes the killed build's work dir
    assert leftovers(engine) == []
    assert_loads(engine)
    assert all((engine / rel).read_bytes() == data for rel, data in user_files.items())


def test_swap_killed_between_its_renames_is_recovered(engine, caplog):
    # the old engine renamed aside, the new one not yet in: the target is missing
    user_files = add_user_files(engine)
    aside = engine.parent / ".eng.old-k1ll3d_x"
    engine.rename(aside)
    with caplog.at_level(logging.WARNING, logger="compiled_llm.engine.output_dir"):
        build(engine)
    assert "put back the engine" in caplog.text
    assert_loads(engine)
    assert all((engine / rel).read_bytes() == data for rel, data in user_files.items())
    assert leftovers(engine) == []


def test_swap_killed_before_the_old_engine_was_retired_is_finished(engine, built):
    # the new engine is in place; the old one, with the user's files, still aside
    user_files = add_user_files(engine)
    aside = engine.parent / ".eng.old-abcd1234"
    engine.rename(aside)
    shutil.copytree(built, engine)
    build(engine)
    assert_loads(engine)
    assert all((engine / rel).read_bytes() == data for rel, data in user_files.items())
    assert leftovers(engine) == []


def test_leftover_lookalikes_that_are_not_ours_are_left_alone(engine, caplog):
    unmarked = engine.parent / ".eng.building-abcd1234"  # no marker: not provably ours
    unmarked.mkdir()
    (unmarked / "data.bin").write_bytes(b"123")
    no_manifest = engine.parent / ".eng.old-abcd1234"  # no engine manifest
    no_manifest.mkdir()
    (no_manifest / "thesis.tex").write_text("chapter 1")
    other_name = engine.parent / ".eng.building-backup"  # not a name mkdtemp makes
    shutil.copytree(engine, other_name)
    (other_name / engine_output.BUILD_MARKER).write_text("")
    before = {p: snapshot(p) for p in (unmarked, no_manifest, other_name)}
    with caplog.at_level(logging.WARNING, logger="compiled_llm.engine.output_dir"):
        build(engine)
    assert {p: snapshot(p) for p in (unmarked, no_manifest, other_name)} == before
    assert str(unmarked) in caplog.text and str(no_manifest) in caplog.text
    assert_loads(engine)


def test_work_dir_of_a_build_still_running_is_not_taken_for_a_leftover(engine):
    work = engine_output.make_work_dir(engine)  # another build of the same target, running
    try:
        engine_output.prepare_output_dir(engine)
        assert work.is_dir() and (work.parent / engine_output.BUILD_MARKER).is_file()
    finally:
        engine_output.discard_work_dir(work)
    assert leftovers(engine) == []
