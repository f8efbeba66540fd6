"""One options dataclass for the build: ``BuildConfig``'s fields are

- the flags of ``build``, with the fields' names (or the flag its metadata names, as
  ``--disable-pass``), short aliases (``-q``, ``-tp``), choices, defaults and help;
- the same flags of ``run``, ``serve`` and ``bench``, which build a SOURCE into the engine cache:
  there a flag not given is left to an engine directory (and is the field's default for a
  SOURCE), and ``--max-model-len`` is the engine option (the runtime's limit);
- ``LLM(SOURCE, ...)``'s build keywords;
- a built engine's manifest ``build_options``: the config, resolved, written by ``to_manifest``
  and read back by ``from_manifest``, which still reads what older engines wrote.

A bad value is one InvalidOptionError line naming it, from Python and from the command line.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json

import pytest

from compiled_llm import LLM
from compiled_llm.cli.engine_args import build_config, build_flags, build_options, field_default, field_flag
from compiled_llm.cli.main import main, make_parser
from compiled_llm.engine import artifact
from compiled_llm.engine.build_config import DTYPE_ALIASES, DTYPES, QUANTIZATIONS, BuildConfig
from compiled_llm.engine.cache import engine_path
from compiled_llm.errors import EngineError, InvalidOptionError
from compiled_llm.model.presets import preset_hf_config
from compiled_llm.serve.engine_config import EngineConfig

FIELDS = {f.name: f for f in dataclasses.fields(BuildConfig)}
RUNTIME = {f.name for f in dataclasses.fields(EngineConfig)}
SOURCE_COMMANDS = ("run", "serve", "bench")
# every option set to something else than its default, as flags and as the config they make
ARGV = ["--dtype", "bf16", "--device", "cpu", "--disable-pass", "fuse_add_norm", "--disable-pass", "fuse_residual",
        "--kernel", "paged_attention=reference", "--dump-ir", "-q", "int4", "-tp", "2", "-pp", "2"]
CONFIG = BuildConfig(dtype="bfloat16", device="cpu", disabled_passes=("fuse_add_norm", "fuse_residual"),
                     kernel_prefs={"paged_attention": "reference"}, dump_ir=True, quantization="int4",
                     tensor_parallel_size=2, pipeline_parallel_size=2)
TINY_MAX_LEN = preset_hf_config("tiny-qwen2")["max_position_embeddings"]


def subparser(command: str) -> argparse.ArgumentParser:
    (sub,) = [a for a in make_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return sub.choices[command]


def actions(command: str) -> dict[str, argparse.Action]:
    return {a.dest: a for a in subparser(command)._actions if a.option_strings}


def positional(command: str) -> list[str]:
    return ["SRC", "-o", "ENGINE"] if command == "build" else ["SRC"]


def test_the_config_covers_every_option_the_changed_flags_set():
    """The test's own premise: ARGV sets every build option but max_model_len (the engine's
    in run/serve/bench), load_format (its dummy value excludes a quantization;
    test_dummy_weights.py has its flag) and decode_backend (its megakernel value excludes a
    quantization and parallel builds; test_megakernel_engine.py has its flag), each away from
    its default."""
    changed = {n for n, f in FIELDS.items() if getattr(CONFIG, n) != field_default(f)}
    assert changed == set(FIELDS) - {"max_model_len", "load_format", "decode_backend"}


# --- the flags ---------------------------------------------------------------------------------


def test_build_has_one_flag_per_option_with_its_spelling_default_choices_and_help():
    by_dest = actions("build")
    for name, f in FIELDS.items():
        action = by_dest[name]
        assert action.option_strings[:1 + len(f.metadata.get("aliases", ()))] == [field_flag(f), *f.metadata.get("aliases", ())]
        assert f.metadata["help"] in action.help
        assert action.choices == f.metadata.get("choices")
        if not isinstance(field_default(f), (tuple, dict)):  # repeatable flags start from nothing
            assert action.default == field_default(f), name
    assert field_flag(FIELDS["disabled_passes"]) == "--disable-pass" and field_flag(FIELDS["kernel_prefs"]) == "--kernel"
    assert by_dest["quantization"].choices == QUANTIZATIONS and "-tp" in by_dest["tensor_parallel_size"].option_strings
    args = subparser("build").parse_args(positional("build"))
    assert build_config(args) == BuildConfig()
    args = subparser("build").parse_args(positional("build") + ARGV + ["--max-model-len", "64"])
    assert build_config(args) == dataclasses.replace(CONFIG, max_model_len=64)


@pytest.mark.parametrize("command", SOURCE_COMMANDS)
def test_run_serve_and_bench_take_the_same_build_flags(command):
    build, here = actions("build"), actions(command)
    for name in FIELDS:
        if name in RUNTIME:  # --max-model-len: one flag, the engine option's
            assert EngineConfig.__dataclass_fields__[name].metadata["help"] in here[name].help
            assert sum("--max-model-len" in a.option_strings for a in subparser(command)._actions) == 1
            continue
        mine, theirs = here[name], build[name]
        assert (mine.option_strings, mine.help, mine.choices, mine.metavar, type(mine)) == \
               (theirs.option_strings, theirs.help, theirs.choices, theirs.metavar, type(theirs)), name
        assert mine.default is None  # not given: the engine directory's own, or the field's default
    args = subparser(command).parse_args(["SRC"])
    assert build_options(args, for_source=True) == {}
    assert build_config(args, for_source=True) == BuildConfig()
    args = subparser(command).parse_args(["SRC", *ARGV])
    assert build_config(args, for_source=True) == CONFIG


def test_build_flags_spell_a_config_back_into_the_same_config():
    for config in (BuildConfig(), CONFIG, BuildConfig(dtype="float16", device="cuda:1", max_model_len=512)):
        args = subparser("build").parse_args(positional("build") + build_flags(config))
        assert build_config(args) == config
    assert build_flags(BuildConfig()) == []


def test_each_choice_is_spelled_once():
    """The flags' choices are BuildConfig's; what implements them below the engine layer (the
    quantized ops, the dtype parser) covers exactly those."""
    from compiled_llm.graph.quantized_ops import SCHEMES
    from compiled_llm.model.placement import DTYPES as PARSED_DTYPES

    assert tuple(SCHEMES) == QUANTIZATIONS
    assert set(PARSED_DTYPES) == set(DTYPES) | set(DTYPE_ALIASES)
    assert actions("run")["dtype"].choices == actions("build")["dtype"].choices == ("auto", *DTYPES, *DTYPE_ALIASES)


# --- LLM's keywords ----------------------------------------------------------------------------


def test_llm_takes_each_build_option_but_the_runtime_limit_as_a_keyword():
    params = inspect.signature(LLM).parameters
    build = [n for n, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY]
    assert build == [n for n in FIELDS if n not in RUNTIME]
    assert all(params[n].default is None for n in build)  # None: not given (BuildConfig's default)
    assert params["engine_options"].kind is inspect.Parameter.VAR_KEYWORD


def test_llm_builds_a_source_with_the_config_its_keywords_make(tmp_path, monkeypatch):
    monkeypatch.setenv("COMPILED_LLM_CACHE_DIR", str(tmp_path / "cache"))
    options = dict(dtype="fp32", device="cpu", disabled_passes=["fuse_add_norm"],
                   kernel_prefs={"paged_attention": "reference"})
    llm = LLM("tiny-qwen2", num_blocks=16, **options)
    config = BuildConfig(**options)
    assert llm.model.name == str(engine_path("tiny-qwen2", config))
    assert llm.model.build_config == dataclasses.replace(config, max_model_len=TINY_MAX_LEN)
    assert llm.model.manifest["build_options"] == llm.model.build_config.to_manifest()
    # the engine it built, asked for again with an option it was not built with
    with pytest.raises(InvalidOptionError, match="was built with kernel_prefs paged_attention=reference, not none"):
        LLM(llm.model.name, kernel_prefs={}, device="cpu")
    with pytest.raises(InvalidOptionError, match="unknown dtype 'fp8'"):
        LLM("tiny-qwen2", dtype="fp8")


def test_an_engine_directory_takes_the_options_it_was_built_with(tiny_engine):
    """tiny_engine: tiny-qwen2 built for float32 on the CPU with every other option's default."""
    llm = LLM(str(tiny_engine), dtype="float32", device="cpu", quantization=None, tensor_parallel_size=1,
              disabled_passes=(), dump_ir=False, num_blocks=16)
    assert llm.model.build_config == BuildConfig(dtype="float32", device="cpu", max_model_len=TINY_MAX_LEN)
    for option, value, message in [
        ("quantization", "int8", "was built with quantization none, not int8; build it with "
                                 "'compiled-llm build SOURCE --quantization int8'"),
        ("tensor_parallel_size", 2, "was built with tensor_parallel_size 1, not 2"),
        ("dtype", "bf16", "was built with dtype float32, not bfloat16"),
        ("disabled_passes", ["shard"], "was built with disabled_passes none, not shard; build it with "
                                       "'compiled-llm build SOURCE --disable-pass shard'"),
        ("dump_ir", True, "was built with dump_ir False, not True; build it with 'compiled-llm build SOURCE --dump-ir'"),
    ]:
        with pytest.raises(InvalidOptionError, match=message):
            LLM(str(tiny_engine), device="cpu", **{option: value})


# --- the manifest ------------------------------------------------------------------------------


def test_a_built_engine_records_its_resolved_config(tiny_engine):
    recorded = artifact.read_manifest(tiny_engine)["build_options"]
    assert list(recorded) == list(FIELDS)
    config = BuildConfig.from_manifest(recorded)
    assert config == BuildConfig(dtype="float32", device="cpu", max_model_len=TINY_MAX_LEN)
    assert config.is_resolved and config.to_manifest() == recorded


def test_the_build_command_records_what_its_flags_say(tmp_path, capsys):
    out = tmp_path / "engine"
    argv = ["--device", "cpu", "--disable-pass", "fuse_add_norm", "--kernel", "paged_attention=reference",
            "--max-model-len", "64", "--dump-ir", "-q", "int8"]
    assert main(["build", "tiny-qwen2", "-o", str(out), "--quiet", *argv]) == 0
    assert "(cpu, float32, int8 weights)" in capsys.readouterr().out
    assert artifact.build_config(artifact.read_manifest(out)) == BuildConfig(
        dtype="float32", device="cpu", max_model_len=64, disabled_passes=("fuse_add_norm",),
        kernel_prefs={"paged_attention": "reference"}, dump_ir=True, quantization="int8")


OLDER_BUILD_OPTIONS = {
    # format 2 before quantization (and then tensor parallelism) were options
    "format 2, before quantization": {"dtype": "bfloat16", "device": "cuda", "max_model_len": 4096,
                                      "disabled_passes": [], "kernel_prefs": {}, "dump_ir": False},
    "format 2, before tensor parallelism": {"dtype": "float32", "device": "cpu", "max_model_len": 64,
                                            "disabled_passes": ["fuse_add_norm"], "kernel_prefs": {},
                                            "dump_ir": True, "quantization": "int8"},
    # format 1 recorded the compile backend too
    "format 1": {"dtype": "float16", "device": "cuda", "max_model_len": 2048, "disabled_passes": [],
                 "kernel_prefs": {"paged_attention": "triton"}, "backend": "inductor", "dump_ir": False},
}


@pytest.mark.parametrize("name", sorted(OLDER_BUILD_OPTIONS))
def test_the_build_options_older_engines_wrote_still_parse(name):
    options = OLDER_BUILD_OPTIONS[name]
    config = BuildConfig.from_manifest(options)
    for key, value in options.items():
        if key != "backend":
            assert config.to_manifest()[key] == value
    assert config.quantization == options.get("quantization") and config.tensor_parallel_size == 1


def test_an_engine_built_before_an_option_existed_still_loads(tiny_engine_copy):
    path = tiny_engine_copy / "manifest.json"
    manifest = json.loads(path.read_text())
    for key in ("quantization", "tensor_parallel_size"):
        del manifest["build_options"][key]
    path.write_text(json.dumps(manifest))
    loaded = artifact.load_engine(tiny_engine_copy)
    assert loaded.build_config.quantization is None and loaded.tp_size == 1


def test_an_engine_of_format_1_is_still_known_for_one(tiny_engine_copy):
    """Format 1 loads no more, but ``build -o`` must recognise it to replace it in place."""
    path = tiny_engine_copy / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest.update(format_version=1, backend={"kind": "inductor"},
                    build_options={**OLDER_BUILD_OPTIONS["format 1"], "device": "cpu"})
    path.write_text(json.dumps(manifest))
    assert artifact.read_older_manifest(tiny_engine_copy) is not None
    manifest["build_options"]["backend"] = 7  # a retired key is dropped, whatever it holds
    manifest["build_options"]["dtype"] = "float8"
    path.write_text(json.dumps(manifest))
    with pytest.raises(EngineError, match=r"malformed 'build_options' entry \(unknown dtype 'float8'"):
        artifact.read_older_manifest(tiny_engine_copy)


@pytest.mark.parametrize("change, fragment", [
    ({"kv_cache_dtype": "fp8"}, "unknown build option 'kv_cache_dtype'"),
    ({"dtype": "auto"}, "a build records float32/bfloat16/float16 and cpu/cuda"),
    ({"device": "cuda:0"}, "a build records"),
    ({"dtype": "bf16"}, "a build records"),
    ({"max_model_len": None}, "lack the max_model_len"),
    ({"disabled_passes": "fuse_add_norm"}, "disabled_passes must be a list of pass names, got 'fuse_add_norm'"),
    ({"kernel_prefs": ["paged_attention=triton"]}, "kernel_prefs must map ops to providers"),
    ({"quantization": "int3"}, "unknown quantization 'int3'"),
    ({"tensor_parallel_size": 0}, "tensor_parallel_size must be an integer in 1..64, got 0"),
    ({"dump_ir": "yes"}, "dump_ir must be True or False, got 'yes'"),
])
def test_a_manifest_with_bad_build_options_is_refused_in_one_line(tiny_engine_copy, change, fragment):
    path = tiny_engine_copy / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["build_options"].update(change)
    path.write_text(json.dumps(manifest))
    with pytest.raises(EngineError) as info:
        artifact.read_manifest(tiny_engine_copy)
    message = str(info.value)
    assert "\n" not in message and "manifest.json has a malformed 'build_options' entry" in message
    assert fragment in message


# --- bad values --------------------------------------------------------------------------------


@pytest.mark.parametrize("options, fragment", [
    ({"dtype": "fp8"}, "unknown dtype 'fp8'; the choices are: auto, float32, bfloat16, float16, fp32, bf16, fp16"),
    ({"dtype": None}, "unknown dtype None"),
    ({"device": "tpu"}, "unknown device 'tpu'; the choices are: auto, cpu, cuda, cuda:N"),
    ({"max_model_len": 1}, "max_model_len must be an integer >= 2, got 1"),
    ({"max_model_len": 2.5}, "max_model_len must be an integer >= 2, got 2.5"),
    ({"disabled_passes": "fuse_add_norm"}, "must be a list of pass names, got 'fuse_add_norm'"),
    ({"disabled_passes": [""]}, "names a pass ''"),
    ({"kernel_prefs": ["paged_attention"]}, "entry 'paged_attention' is not OP=PROVIDER"),
    ({"kernel_prefs": {"paged_attention": 3}}, "entry 'paged_attention': 3 does not name"),
    ({"dump_ir": 1}, "dump_ir must be True or False, got 1"),
    ({"quantization": "int3"}, "unknown quantization 'int3'; the choices are: int8, int4"),
    ({"tensor_parallel_size": 0}, "tensor_parallel_size must be an integer in 1..64, got 0"),
    ({"tensor_parallel_size": True}, "got True"),
    ({"tensor_parallel_size": "2"}, "got '2'"),
    ({"max_model_len": "x" * 500}, "got 'xxxxxxxxxxxxxxxx"),
    ({"dtype_": "float32"}, "unknown build option 'dtype_'; the options are: dtype, device, max_model_len"),
])
def test_a_bad_value_is_one_line_naming_it(options, fragment):
    with pytest.raises(InvalidOptionError) as info:
        BuildConfig.from_options(options)
    message = str(info.value)
    # (256: the unknown-option message lists every option's name)
    assert fragment in message and "\n" not in message and len(message) < 256


@pytest.mark.parametrize("command", ["build", *SOURCE_COMMANDS])
@pytest.mark.parametrize("flags, fragment", [
    (["--device", "tpu"], "error: unknown device 'tpu'"),
    (["--kernel", "paged_attention"], "error: kernel_prefs (--kernel) entry 'paged_attention' is not OP=PROVIDER"),
    (["-tp", "0"], "error: tensor_parallel_size must be an integer in 1..64, got 0"),
])
def test_a_bad_flag_is_one_line_before_anything_is_built(command, flags, fragment, tmp_path, capsys):
    argv = [command, "tiny-qwen2", *(["-o", str(tmp_path / "e")] if command == "build" else []), *flags]
    assert main(argv) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(fragment)
    assert not (tmp_path / "e").exists()


def test_a_config_is_frozen_and_spells_a_dtype_one_way():
    config = BuildConfig(dtype="bf16", disabled_passes=["a"], kernel_prefs=["op=p"])
    assert (config.dtype, config.disabled_passes, config.kernel_prefs) == ("bfloat16", ("a",), {"op": "p"})
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.dtype = "float32"
    with pytest.raises(ValueError, match="only a resolved config"):
        config.to_manifest()

