import sys
from pathlib import Path

# tests/ itself: the test modules import what they share as helpers.<module>
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
    from compiled_llm.engine.build import build_engine

    out = tmp_path_factory.mktemp("tiny_engine") / "tiny-qwen2"
    build_engine("tiny-qwen2", out, dtype="float32", device="cpu", progress=False)
    return out


@pytest.fixture
def tiny_engine_copy(tiny_engine, tmp_path):
    """A fresh copy of ``tiny_engine``, at tmp_path/engine, to change or rebuild."""
    import shutil

    return Path(shutil.copytree(tiny_engine, tmp_path / "engine"))


# ---- one local Ray cluster for the modules that need one (helpers.ray_cluster) -------------------

RAY_CLUSTER_CPUS = 4  # logical: the most any one Ray test places at once
_ray_modules: set[str] = set()  # the test modules that use ``ray_cluster``, by path


@pytest.fixture(scope="module")
def ray_cluster():
    """The address of the local Ray cluster the Ray test modules share (a process they start
    joins it as $RAY_ADDRESS); it ends after the last of them."""
    from helpers.ray_cluster import shared_cluster

    return shared_cluster.start(num_cpus=RAY_CLUSTER_CPUS)


def _module_path(item) -> str:
    return item.nodeid.split("::")[0]


def pytest_collection_modifyitems(items):
    """Run the modules that use ``ray_cluster`` one after another, where the first of them was,
    so that one cluster serves them all and ends once they are done; the Triton interpreter
    runs' tests go last (helpers/interpret_child.py says why)."""
    from helpers.interpret_child import checks_last

    checks_last(items)
    _ray_modules.update(_module_path(i) for i in items if "ray_cluster" in getattr(i, "fixturenames", ()))
    if not _ray_modules:
        return
    first = next(n for n, i in enumerate(items) if _module_path(i) in _ray_modules)
    ray_items = [i for i in items if _module_path(i) in _ray_modules]
    others = [i for i in items if _module_path(i) not in _ray_modules]
    items[:] = others[:first] + ray_items + others[first:]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    yield  # the module's own fixtures (a Ray Serve application, say) end first
    if _module_path(item) in _ray_modules and (nextitem is None or _module_path(nextitem) not in _ray_modules):
        from helpers.ray_cluster import shared_cluster

        shared_cluster.stop()


def pytest_addoption(parser):
    parser.addoption("--soak", type=float, default=0.0, metavar="SECONDS",
                     help="run the runtime fuzz test's random draws for this long instead of its fixed count "
                          "(the engine tamper fuzz draws ten engines a second of it)")


@pytest.fixture(scope="session")
def lively_bpe_checkpoint(tmp_path_factory):
    """(directory, transformers model) of ``lively.make_lively_checkpoint``: greedy outputs
    that vary, a BPE tokenizer with tokens of several characters."""
    from helpers.lively import make_lively_checkpoint

    out = tmp_path_factory.mktemp("lively") / "checkpoint"
    return out, make_lively_checkpoint(out)


@pytest.fixture(scope="session")
def lively_hf_tokenizer(lively_bpe_checkpoint):
    import transformers

    return transformers.AutoTokenizer.from_pretrained(lively_bpe_checkpoint[0])


@pytest.fixture(scope="session")
def lively_oracle(lively_bpe_checkpoint, lively_hf_tokenizer):
    """expected(prompt ids, n) -> (greedy token ids, their text) from transformers, run to n tokens."""
    from helpers.lively import greedy_text_oracle

    return greedy_text_oracle(lively_bpe_checkpoint[1], lively_hf_tokenizer)


@pytest.fixture(scope="session")
def lively_bpe_engine(lively_bpe_checkpoint, tmp_path_factory):
    """The lively checkpoint built into a CPU float32 engine."""
    from helpers.lively import build_lively_engine

    return build_lively_engine(lively_bpe_checkpoint[0], tmp_path_factory.mktemp("lively_bpe_engine") / "engine")


@pytest.fixture(scope="session")
def lively_tp2_engine(lively_bpe_checkpoint, tmp_path_factory):
    """The lively checkpoint built into a CPU float32 engine sharded over two tensor-parallel ranks."""
    from helpers.lively import build_lively_engine

    return build_lively_engine(lively_bpe_checkpoint[0], tmp_path_factory.mktemp("lively_tp2_engine") / "engine",
                               tensor_parallel_size=2)


@pytest.fixture(scope="session")
def structured_engine(tmp_path_factory):
    """A CPU float32 engine of ``helpers.structured``'s checkpoint (every byte a token, a chat
    template that renders tools): what structured outputs and tool calling are tested on."""
    from compiled_llm.engine.build import build_engine
    from helpers.structured import make_structured_checkpoint

    checkpoint = tmp_path_factory.mktemp("structured") / "checkpoint"
    make_structured_checkpoint(checkpoint)
    out = tmp_path_factory.mktemp("structured_engine") / "engine"
    build_engine(str(checkpoint), out, dtype="float32", device="cpu", progress=False)
    return out


def pytest_collection_finish(session):
    """The Triton interpreter runs this session will check start now, beside the other tests
    (helpers/interpret_child.py says why)."""
    from helpers.interpret_child import start_child_runs

    start_child_runs(session.items)


def pytest_sessionfinish(session):
    from helpers.interpret_child import stop_child_runs

    stop_child_runs()
