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
