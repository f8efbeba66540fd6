"""Where a build writes: which output directories are accepted, the atomic swap, leftovers.

``compiled-llm build -o DIR`` must never delete anything it did not write. So:

- DIR is refused (one-line CompiledLLMError) when it is the current directory, the home
  directory, ``/``, an ancestor of either, a symbolic link, an existing non-directory, or a
  non-empty directory that is not an engine. A directory is an engine only when its
  ``manifest.json`` is a complete manifest of a format version we know, checked as the loader
  checks it (``artifact.read_manifest``, or ``read_older_manifest`` for an engine an earlier
  compiled_llm wrote), and every file it lists is there with its sha256; any other
  ``manifest.json`` (a web app's, or one naming the user's files) makes it "not an engine".
- An engine that holds a file of the user's in ``tokenizer/`` (which the loader reads as a whole
  and so refuses unlisted files in) is refused too, naming the file: a rebuild would carry it
  into an engine that does not load.
- The new engine is written next to DIR and swapped in with renames; the old engine is set aside
  and only the files its manifest lists with their sha256 (and the manifest) are removed from it.
  Anything else the user kept in the old engine directory is moved into the new one.
- Leftovers of a killed build are tidied by the next build of the same DIR, but only when they
  are provably ours.

Everything lives next to DIR (siblings, so every rename stays on one filesystem and is atomic):

    .DIR.building-XXXXXXXX/        work dir of a running build (tempfile.mkdtemp)
        .compiled_llm_build        marker, written first and flock-ed while the build runs
        engine/                    the new engine; renamed to DIR by the swap
    .DIR.old-XXXXXXXX/             the previous engine, set aside during the swap

The new engine is built in a subdirectory of the work dir rather than in the work dir itself so
that the marker never becomes part of the engine (``save_engine`` checksums every file it sees).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import stat
import tempfile
from pathlib import Path, PurePosixPath

from compiled_llm.engine.artifact import (MANIFEST, TOKENIZER_DIR, read_manifest, read_older_manifest, sha256_file,
                                          unlisted_in_folder)
from compiled_llm.errors import CompiledLLMError, EngineError

try:
    import fcntl
except ImportError:  # not POSIX: no locks, a leftover is then judged by its marker alone
    fcntl = None

log = logging.getLogger(__name__)

BUILD_MARKER = ".compiled_llm_build"
ENGINE_SUBDIR = "engine"
BUILDING, OLD = "building", "old"
_RANDOM = r"[a-z0-9_]{8}"  # the random part tempfile.mkdtemp puts in a name

MISSING, EMPTY, ENGINE = "missing", "empty", "engine"

# work dir -> fd of its locked marker, held for the whole build so that a concurrent build of the
# same target does not take the running build's work dir for a leftover
_locks: dict[Path, int] = {}


# ---------------------------------------------------------------------------------------------
# Which output directories are accepted
# ---------------------------------------------------------------------------------------------


_SYMLINK = "it is a symbolic link; name the directory it points to, or a new path"


def _refuse(shown, reason: str) -> CompiledLLMError:
    return CompiledLLMError(f"refusing to build into {shown}: {reason}")


def check_output_path(out_dir: str | Path) -> Path:
    """The absolute, resolved target for ``out_dir``, or a CompiledLLMError when the path itself
    can never be an engine directory (whatever it holds)."""
    given = Path(out_dir)
    # before resolving: resolve() would silently turn the link into its target, and the swap
    # would then replace the target (or the link) behind the user's back
    if given.is_symlink():
        raise _refuse(out_dir, _SYMLINK)
    target = given.resolve()
    cwd = Path.cwd().resolve()
    try:
        home = Path.home().resolve()
    except (RuntimeError, KeyError):  # no HOME and no passwd entry
        home = None
    if target == target.parent:
        raise _refuse(out_dir, "it is the filesystem root")
    if target == cwd:
        raise _refuse(out_dir, "it is the current directory; name a subdirectory such as ./engine")
    if cwd.is_relative_to(target):
        raise _refuse(out_dir, "it is an ancestor of the current directory")
    if home is not None and target == home:
        raise _refuse(out_dir, "it is your home directory")
    if home is not None and home.is_relative_to(target):
        raise _refuse(out_dir, "it is an ancestor of your home directory")
    # the nearest existing ancestor must be a directory, or creating the parents fails later
    for parent in target.parents:
        if parent.exists():
            if not parent.is_dir():
                raise _refuse(out_dir, f"{parent} is not a directory")
            break
    return target


def classify(target: Path, shown=None) -> tuple[str, dict | None]:
    """(MISSING | EMPTY | ENGINE, the engine's manifest or None); a CompiledLLMError for a target
    that must not be replaced. Called before the build and again right before the swap, since the
    directory may change while a long build runs."""
    shown = target if shown is None else shown
    if target.is_symlink():
        raise _refuse(shown, _SYMLINK)
    if not target.exists():
        return MISSING, None
    if not target.is_dir():
        raise _refuse(shown, "it exists and is not a directory")
    if not any(target.iterdir()):
        return EMPTY, None
    try:
        manifest = engine_manifest(target)
    except EngineError as e:
        if os.path.lexists(target / MANIFEST):
            raise _refuse(shown, f"it is not empty and its {MANIFEST} is not a compiled_llm engine manifest "
                                 f"({_reason(e)})") from None
        raise _refuse(shown, "it is not empty and holds no engine") from None
    # the rebuild would carry such a file into the new engine, whose loader refuses it
    foreign = unlisted_in_folder(target, TOKENIZER_DIR, manifest["files"])
    if foreign is not None:
        raise _refuse(shown, f"it holds {foreign}, which the engine does not list, in {TOKENIZER_DIR}/, where an "
                             "engine holds only its own files (the loader would refuse it); move it out of "
                             f"{TOKENIZER_DIR}/ and build again")
    return ENGINE, manifest


def engine_manifest(target: Path) -> dict:
    """The manifest of the engine in ``target``: a complete manifest of a format version this
    compiled_llm knows (the current one, or an older one an earlier compiled_llm wrote), checked
    as the loader checks it, with every file it lists present in ``target`` with its sha256.
    Anything else is an EngineError: then ``target`` is no engine of ours, and nothing in it may
    be replaced."""
    try:
        manifest = read_manifest(target)
    except EngineError as current:
        manifest = read_older_manifest(target)  # its error says what an engine of that format lacks
        if manifest is None:
            raise current from None
    for rel, digest in manifest["files"].items():
        path = _regular_file_inside(target, rel)
        if path is None:
            raise EngineError(f"engine file {rel} is missing")
        if _digest(path) != digest:
            raise EngineError(f"engine file {rel} does not have the sha256 the manifest lists")
    return manifest


# (device, inode, size, mtime, ctime) -> sha256: a build checks the target before it starts and
# again before the swap, and retiring the old engine checks its files once more after renaming it
# aside (renaming the directory keeps its files' inode, mtime and ctime), so each file is hashed
# once per build. Any write to a file moves its ctime, which no tool can set back (mtime it can),
# and the cache is emptied when the build ends.
_digests: dict[tuple, str] = {}


def _digest(path: Path) -> str:
    st = os.stat(path)
    key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    if key not in _digests:
        _digests[key] = sha256_file(path)
    return _digests[key]


def _reason(e: Exception) -> str:
    """An EngineError's message without its advice to rebuild, which a build is about to do."""
    return _why(e).removesuffix("; rebuild the engine")


def prepare_output_dir(out_dir: str | Path) -> Path:
    """Check ``out_dir`` before a build, put back an engine a killed swap left aside, tidy the
    leftovers of killed builds of the same target; returns the resolved target."""
    try:
        target = check_output_path(out_dir)
        recover_interrupted_swap(target)
        state, _ = classify(target, shown=out_dir)
        clean_leftovers(target, target_is_engine=state == ENGINE)
    except (OSError, RuntimeError) as e:  # RuntimeError: a symlink loop, from resolve()
        raise CompiledLLMError(f"cannot use {out_dir} as the engine directory: {_why(e)}") from None
    return target


# ---------------------------------------------------------------------------------------------
# The work dir and the swap
# ---------------------------------------------------------------------------------------------


def make_work_dir(target: Path) -> Path:
    """Create ``.NAME.building-XXXXXXXX/`` next to ``target`` with the marker written (and locked)
    first; returns its ``engine/`` subdirectory, where the build writes the new engine."""
    target.parent.mkdir(parents=True, exist_ok=True)
    box = Path(tempfile.mkdtemp(prefix=f".{target.name}.{BUILDING}-", dir=target.parent))
    fd = None
    try:
        fd = os.open(box / BUILD_MARKER, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        os.write(fd, f"compiled_llm build of {target} (pid {os.getpid()})\n".encode())
        if fcntl is not None:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        work = box / ENGINE_SUBDIR
        work.mkdir()
        work.chmod(0o755)  # the engine dir's final mode (mkdtemp makes 0o700), as before
    except BaseException:
        if fd is not None:
            os.close(fd)
        shutil.rmtree(box, ignore_errors=True)  # just made by us, holds nothing else
        raise
    _locks[work] = fd
    return work


def discard_work_dir(work: Path) -> None:
    """Remove this build's work dir (all of it after a failure; the empty box after the swap).
    Never raises: it runs in a ``finally``."""
    box = work.parent
    try:
        if _is_build_box(box):
            shutil.rmtree(box, ignore_errors=True)
    finally:
        _digests.clear()
        fd = _locks.pop(work, None)
        if fd is not None:
            os.close(fd)  # after the removal, so no other build can see an unlocked box of ours


def swap_into_place(work: Path, target: Path) -> None:
    """Make the finished engine in ``work`` the engine at ``target``. An old engine there is
    renamed aside first and retired only after the new one is in place, so at every instant
    ``target`` is either the complete old engine, missing (recovered by the next build), or the
    complete new engine."""
    state, old_manifest = classify(target)  # again: the target may have changed during the build
    aside = None
    try:
        if state != ENGINE:
            # rename() atomically replaces an empty directory, and fails (losing nothing) if files
            # appeared in it since the check
            os.rename(work, target)
            return
        aside = Path(tempfile.mkdtemp(prefix=f".{target.name}.{OLD}-", dir=target.parent))
        os.rename(target, aside)  # onto the empty dir mkdtemp made: a unique name, atomically
    except OSError as e:
        if aside is not None:
            _rmdir_if_empty(aside)
        raise CompiledLLMError(f"cannot move the new engine into {target}: {_why(e)}") from None
    try:
        os.rename(work, target)
    except OSError as e:
        try:
            os.rename(aside, target)  # put the old engine back; the new build is dropped
        except OSError:  # the next build of the target puts it back
            raise CompiledLLMError(f"cannot move the new engine into {target} ({_why(e)}); the old "
                                   f"engine is at {aside}") from None
        raise CompiledLLMError(f"cannot move the new engine into {target}: {_why(e)}") from None
    try:
        retire_old_engine(aside, target, old_manifest)
    except OSError as e:  # the new engine is in place; the next build retries the tidy-up
        log.warning("could not tidy the old engine set aside at %s (%s); the next build of %s retries",
                    aside, _why(e), target)


def retire_old_engine(aside: Path, target: Path, manifest: dict) -> None:
    """Remove from the set-aside old engine only what the engine wrote (the files its manifest
    lists, then the manifest), move everything else into the new engine at ``target``, and remove
    ``aside`` when nothing is left in it."""
    for path in listed_files(aside, manifest):
        path.unlink(missing_ok=True)
    kept = _carry_over(aside, target, skip={aside / MANIFEST})
    _prune_empty_dirs(aside)  # what the removals and moves emptied (aside keeps its manifest)
    # the manifest goes last: until then an interrupted tidy-up can be redone from it, and after
    # it only what we keep on purpose is left
    manifest_path = aside / MANIFEST
    if _is_regular_file(manifest_path):
        manifest_path.unlink()
    else:
        kept.append(manifest_path)  # a link or directory named manifest.json is not ours
    if not _rmdir_if_empty(aside):
        names = ", ".join(str(p.relative_to(aside)) for p in kept[:5]) + (" ..." if len(kept) > 5 else "")
        log.warning("kept %s: it holds files you had in the old engine directory %s whose paths the "
                    "new engine uses too (%s); look through it and delete it", aside, target, names)


def listed_files(root: Path, manifest: dict) -> list[Path]:
    """The files ``manifest["files"]`` lists that are regular files strictly inside ``root`` and
    hold what the manifest says the engine wrote (their sha256). A listed path that is absolute,
    climbs out with ``..`` or goes through a symbolic link is never followed: an old or edited
    manifest must not make us delete anything outside, nor a file of the user's inside."""
    found = []
    for rel, digest in manifest["files"].items():
        if rel == MANIFEST:  # removed last, by the caller
            continue
        path = _regular_file_inside(root, rel)
        if path is not None and _digest(path) == digest:
            found.append(path)
    return found


def _regular_file_inside(root: Path, rel) -> Path | None:
    """``root / rel`` when that is a regular file reached without leaving ``root`` or passing
    through a link; None otherwise."""
    if not isinstance(rel, str) or not rel or "\0" in rel:
        return None
    pure = PurePosixPath(rel)
    if pure.is_absolute() or ".." in pure.parts or not pure.parts:
        log.warning("ignoring %r listed in the manifest of %s: it points outside it", rel, root)
        return None
    here = root
    for i, part in enumerate(pure.parts):
        here = here / part
        try:
            mode = os.lstat(here).st_mode  # lstat: a link is never followed
        except OSError:
            return None
        if i == len(pure.parts) - 1:
            return here if stat.S_ISREG(mode) else None
        if not stat.S_ISDIR(mode):
            return None
    return None


def _carry_over(src: Path, dst: Path, skip: set[Path]) -> list[Path]:
    """Move what is left in ``src`` into ``dst`` at the same relative paths, merging into
    directories both have; returns what could not move because ``dst`` already uses its path."""
    kept = []
    for entry in sorted(src.iterdir()):
        if entry in skip:
            continue
        dest = dst / entry.name
        if not os.path.lexists(dest):
            os.rename(entry, dest)
        elif _is_real_dir(entry) and _is_real_dir(dest):
            kept += _carry_over(entry, dest, skip)
        else:
            kept.append(entry)
    return kept


# ---------------------------------------------------------------------------------------------
# Leftovers of killed builds
# ---------------------------------------------------------------------------------------------


def leftovers(target: Path, kind: str) -> list[Path]:
    """``.NAME.<kind>-XXXXXXXX`` directories next to ``target`` (kind: BUILDING or OLD)."""
    pattern = re.compile(re.escape(f".{target.name}.{kind}-") + _RANDOM)
    try:
        entries = list(target.parent.iterdir())
    except FileNotFoundError:
        return []
    return sorted(p for p in entries if pattern.fullmatch(p.name) and _is_real_dir(p))


def recover_interrupted_swap(target: Path) -> Path | None:
    """A swap killed between its two renames leaves the old engine aside and ``target`` missing:
    rename the newest complete aside engine back into place. Returns it, or None."""
    if os.path.lexists(target):
        return None
    complete = [p for p in leftovers(target, OLD) if _is_complete_engine(p)]
    if not complete:
        return None
    newest = max(complete, key=lambda p: p.stat().st_mtime)
    os.rename(newest, target)
    log.warning("put back the engine %s from %s, where a killed build had set it aside", target, newest)
    return newest


def clean_leftovers(target: Path, target_is_engine: bool) -> None:
    """Tidy what killed builds of ``target`` left: our marked work dirs (not locked by a build
    still running) are removed; old engines set aside are retired into ``target`` as a finished
    swap would have done. Anything not provably ours is left alone, with a warning."""
    for box in leftovers(target, BUILDING):
        if _is_build_box(box):
            if not _held_by_running_build(box):
                shutil.rmtree(box, ignore_errors=True)
                if os.path.lexists(box):  # a tidy-up that fails must not stop the build
                    log.warning("could not remove %s, the work dir of a killed build", box)
                else:
                    log.info("removed %s, the work dir of a killed build", box)
        elif not _rmdir_if_empty(box):  # killed before its marker was written, or not ours
            log.warning("left %s alone: it looks like a build work dir but has no %s marker, so it may "
                        "not be ours; delete it yourself if it is", box, BUILD_MARKER)
    for aside in leftovers(target, OLD):
        manifest = _known_manifest(aside)  # some of its files may be gone: a tidy-up was killed
        if manifest is not None and target_is_engine:
            try:
                retire_old_engine(aside, target, manifest)
            except OSError as e:  # a tidy-up that fails must not stop the build
                log.warning("could not tidy %s (%s); it is left in place", aside, _why(e))
        elif not _rmdir_if_empty(aside):  # only an empty one (killed right after mkdtemp) goes
            log.warning("left %s alone: it looks like an old engine set aside by a killed build but "
                        "%s; delete it yourself once you have looked through it", aside,
                        f"{target} is no engine to move its other files into" if manifest is not None
                        else "it holds no engine manifest")


# ---------------------------------------------------------------------------------------------
# Small helpers
# ---------------------------------------------------------------------------------------------


def _is_build_box(box: Path) -> bool:
    """A work dir of ours: the mkdtemp-made name and the marker we write first."""
    return (re.fullmatch(r"\..+\." + BUILDING + "-" + _RANDOM, box.name) is not None
            and _is_real_dir(box) and _is_regular_file(box / BUILD_MARKER))


def _held_by_running_build(box: Path) -> bool:
    if fcntl is None:
        return False
    try:
        fd = os.open(box / BUILD_MARKER, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:  # a filesystem without flock: judge by the marker alone
        return False
    finally:
        os.close(fd)  # also releases our probe lock
    return False


def _is_complete_engine(path: Path) -> bool:
    try:
        engine_manifest(path)
    except (EngineError, OSError):
        return False
    return True


def _known_manifest(path: Path) -> dict | None:
    """The manifest of a (possibly partly retired) engine of a known format in ``path``, or None."""
    for read in (read_manifest, read_older_manifest):
        try:
            manifest = read(path)
        except (EngineError, OSError):
            continue
        if manifest is not None:
            return manifest
    return None


def _rmdir_if_empty(path: Path) -> bool:
    try:
        os.rmdir(path)
    except OSError:
        return False
    return True


def _prune_empty_dirs(root: Path) -> bool:
    """Remove the directories under ``root`` (and ``root``) that hold no file, deepest first; a
    directory with anything in it fails rmdir and stays. True when ``root`` is gone."""
    for dirpath, _, _ in os.walk(root, topdown=False):  # does not descend into links
        try:
            os.rmdir(dirpath)
        except OSError:
            pass
    return not os.path.lexists(root)


def _is_real_dir(path: Path) -> bool:
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def _is_regular_file(path: Path) -> bool:
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def _why(e: Exception) -> str:
    """One line for the user: the OS's reason, else the first line of the message."""
    if getattr(e, "strerror", None):
        return e.strerror
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
