"""One options dataclass: ``EngineConfig``'s fields are ``LLM``'s keyword arguments and the
``run`` / ``bench`` flags, with the same names, defaults and help."""

from __future__ import annotations

import argparse
import dataclasses
import inspect

import pytest

from compiled_llm import LLM
from compiled_llm.cli.engine_args import engine_options, flag
from compiled_llm.cli.main import make_parser
from compiled_llm.engine.build_config import BuildConfig
from compiled_llm.errors import InvalidOptionError
from compiled_llm.serve.engine_config import EngineConfig

FIELDS = {f.name: f for f in dataclasses.fields(EngineConfig)}
# bench leaves max_model_len unset on the command line: unset, it bounds the block tables at the
# workloads' needs (4096, or the engine's limit when shorter: a longer one is refused)
COMMAND_DEFAULTS = {"run": {}, "bench": {}}


def subparser(command: str) -> argparse.ArgumentParser:
    parser = make_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return sub.choices[command]


@pytest.mark.parametrize("command", sorted(COMMAND_DEFAULTS))
def test_every_option_is_a_flag_with_the_fields_default_and_help(command):
    p = subparser(command)
    by_dest = {a.dest: a for a in p._actions if a.option_strings and a.help != argparse.SUPPRESS}
    for name, f in FIELDS.items():
        action = by_dest[name]
        assert flag(name) in action.option_strings
        assert action.default == COMMAND_DEFAULTS[command].get(name, f.default), name
        assert f.metadata["help"] in action.help
    args = p.parse_args(["x"])
    assert engine_options(args) == {n: COMMAND_DEFAULTS[command].get(n, f.default) for n, f in FIELDS.items()}


def test_flags_parse_into_the_options_llm_takes():
    args = subparser("run").parse_args(
        ["x", "--max-num-seqs", "8", "--no-enable-prefix-caching", "--enforce-eager", "--gpu-memory-utilization", "0.5",
         "--num-blocks", "40", "--no-async-scheduling"])
    config = EngineConfig.from_options(engine_options(args))
    assert (config.max_num_seqs, config.enable_prefix_caching, config.enforce_eager) == (8, False, True)
    assert (config.gpu_memory_utilization, config.num_blocks, config.async_scheduling) == (0.5, 40, False)
    assert subparser("run").parse_args(["x", "--no-cuda-graphs"]).enforce_eager  # the old name still works


def test_llm_takes_every_option_by_name_and_refuses_others(tiny_engine):
    build = {f.name for f in dataclasses.fields(BuildConfig)} - set(FIELDS)  # max_model_len: the engine's
    assert set(inspect.signature(LLM).parameters) == {"model", *build, "engine_options"}
    llm = LLM(str(tiny_engine), device="cpu", **{n: f.default for n, f in FIELDS.items()})
    assert llm.engine.config == EngineConfig()
    llm = LLM(str(tiny_engine), device="cpu", max_num_seqs=3, enable_prefix_caching=False)
    assert (llm.engine.config.max_num_seqs, llm.engine.block_manager.enable_prefix_caching) == (3, False)
    with pytest.raises(InvalidOptionError, match="unknown engine option 'max_num_seq'; the options are: block_size"):
        LLM(str(tiny_engine), device="cpu", max_num_seq=3)
    with pytest.raises(InvalidOptionError, match="unknown engine option 'use_cuda_graphs'"):
        LLM.from_loaded(llm.model, use_cuda_graphs=False)
