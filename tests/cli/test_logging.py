"""Diagnostics: the ``compiled_llm`` logger writes to stderr at the level of
$COMPILED_LLM_LOGGING_LEVEL (WARNING by default off a terminal), results stay on stdout."""

import logging

import pytest

from compiled_llm.cli.main import configure_logging, main


@pytest.fixture(autouse=True)
def fresh_logger():
    logger = logging.getLogger("compiled_llm")
    saved = logger.level, list(logger.handlers)
    logger.handlers.clear()
    yield logger
    logger.setLevel(saved[0])
    logger.handlers[:] = saved[1]


@pytest.mark.parametrize("value, level", [("debug", logging.DEBUG), ("INFO", logging.INFO), ("", logging.WARNING)])
def test_level_comes_from_the_environment(monkeypatch, fresh_logger, value, level):
    monkeypatch.setenv("COMPILED_LLM_LOGGING_LEVEL", value)
    configure_logging()
    assert fresh_logger.level == level and len(fresh_logger.handlers) == 1
    configure_logging()
    assert len(fresh_logger.handlers) == 1  # configuring twice adds no second handler


def test_a_bad_level_warns_and_falls_back(monkeypatch, fresh_logger, capsys):
    monkeypatch.setenv("COMPILED_LLM_LOGGING_LEVEL", "chatty")
    configure_logging()
    assert fresh_logger.level == logging.WARNING
    assert "CHATTY is not a logging level" in capsys.readouterr().err


def test_info_diagnostics_go_to_stderr_and_results_to_stdout(monkeypatch, tmp_path, capsys):
    # building a source into the engine cache logs "building engine ..." at INFO
    monkeypatch.setenv("COMPILED_LLM_LOGGING_LEVEL", "INFO")
    monkeypatch.setenv("COMPILED_LLM_CACHE_DIR", str(tmp_path))  # so this run builds
    assert main(["run", "tiny-qwen2", "--prompt-ids", "1,2,3", "--max-tokens", "2", "--device", "cpu", "--json"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("{") and "building" not in out
    assert "building" in err
