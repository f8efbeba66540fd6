import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import pytest


@pytest.fixture(scope="session", autouse=True)
def _engine_cache_dir(tmp_path_factory):
    """Engines that tests build for model sources (`LLM("tiny-qwen2")`, `run SOURCE`) go into a
    cache of this session, never into the user's ~/.cache/compiled_llm."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("COMPILED_LLM_CACHE_DIR", str(tmp_path_factory.mktemp("engine_cache")))
        yield


@pytest.fixture(scope="session")
def tiny_engine(tmp_path_factory):
    """One tiny-qwen2 CPU engine built for the whole session; tests that change an engine take
    ``tiny_engine_copy``."""
    from compiled_llm.build import build_engine

    out = tmp_path_factory.mktemp("tiny_engine") / "tiny-qwen2"
    build_engine("tiny-qwen2", out, progress=False)
    return out


@pytest.fixture
def tiny_engine_copy(tiny_engine, tmp_path):
    """A fresh copy of ``tiny_engine``, at tmp_path/engine, to change or rebuild."""
    import shutil

    return Path(shutil.copytree(tiny_engine, tmp_path / "engine"))
