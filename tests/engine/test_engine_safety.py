"""Loading an engine runs no code its author planted, and reads nothing outside its directory.

Each test plays the tamperer, who also rewrites the manifest's checksums (whoever writes an engine
writes its manifest, so checksums prove nothing here): a pickle planted in any file the loader
reads is refused with one line and never unpickled; manifest paths that leave the directory or go
through a symlink are refused. Every other tampered field (a manifest value out of range, a
program that does not fit its operators' schemas, a weights header that does not fit the config,
a file too large to read) is one line naming the file and the field; a seeded fuzz over all of
them finds no traceback, no payload run and no memory blow-up.
"""

import json
import os
import pathlib
import pickle
import re
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


# ---------------------------------------------------------------------------------------------
# One validation layer: every tampered field is one line naming the file and the field
# ---------------------------------------------------------------------------------------------


DEEP = "__deep_nesting__"


def write_program(engine_dir, program, deep: int = 0):
    """Write ``program`` (any value equal to DEEP becomes a list nested ``deep`` levels, which
    json.dumps could not write itself) and fresh checksums."""
    text = json.dumps(program)
    if deep:
        text = text.replace(json.dumps(DEEP), "[" * deep + "]" * deep)
    (engine_dir / "program.json").write_text(text)
    rewrite_manifest(engine_dir)


def read_program(engine_dir):
    return json.loads((engine_dir / "program.json").read_text())


def first_call(program, target):
    return next(n for n in program["nodes"] if n.get("target") == target)


def edit_header(engine_dir, edit, rel="weights.safetensors"):
    """Rewrite the safetensors header of ``rel`` through ``edit(header)``, the data untouched."""
    path = engine_dir / rel
    data = path.read_bytes()
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + length])
    edit(header)
    raw = json.dumps(header).encode()
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + data[8 + length:])
    rewrite_manifest(engine_dir)


def edit_model_config(engine_dir, **changes):
    m = json.loads((engine_dir / "manifest.json").read_text())
    rewrite_manifest(engine_dir, model_config={**m["model_config"], **changes})


def run_first_step(engine_dir):
    """Load the engine and run its program once, as the first step of a run does."""
    from compiled_llm.graph.batch import ScheduledSeq, pack_batch
    from compiled_llm.model.spec import kv_cache_shape

    loaded = artifact.load_engine(engine_dir)
    batch = pack_batch([ScheduledSeq([5, 6, 7], 0, [1]), ScheduledSeq([9], 4, [0])], 16)
    return loaded.program(loaded.params, batch, torch.zeros(kv_cache_shape(loaded.config, 3, 16)))


def one_line_refusal_at_first_step(engine_dir) -> str:
    with pytest.raises(EngineError) as info:
        run_first_step(engine_dir)
    message = str(info.value)
    assert message and "\n" not in message
    return message


def nest_args(program, depth):
    first_call(program, "aten::embedding.default")["args"][1] = DEEP
    return depth


def add_lambda_kwarg(program):
    first_call(program, "aten::embedding.default")["kwargs"]["lambda"] = 1


def drop_an_argument(program):
    first_call(program, "cllm::paged_attention.default")["args"].pop()


def copy_logits_to_meta(program):
    nodes = program["nodes"]
    nodes.insert(-1, {"name": "to_meta", "op": "call_function", "target": "aten::_to_copy.default",
                      "args": [{"node": "linear_14"}], "kwargs": {"device": {"device": "meta"}}})
    nodes[-1]["args"] = [{"tuple": [{"node": "to_meta"}]}]


def return_a_scalar(program):
    program["nodes"][-1]["args"] = [{"tuple": [5]}]


def empty_the_node_list(program):
    program["nodes"] = []


PROGRAM_TAMPERS = {
    "nested 100,000 deep": (lambda p: nest_args(p, 100_000), "not valid JSON|cannot read program.json"),
    "arguments nested 900 deep": (lambda p: nest_args(p, 900), "nested deeper"),
    "a kwarg named lambda": (add_lambda_kwarg, "keyword 'lambda'"),
    "a wrong argument count": (drop_an_argument, "without its argument 'scale'"),
    "_to_copy to meta": (copy_logits_to_meta, "argument 'device'"),
    "a scalar output": (return_a_scalar, "not the logits tensor"),
    "an empty node list": (empty_the_node_list, "node list is missing or empty"),
}


@pytest.mark.parametrize("tamper", list(PROGRAM_TAMPERS))
def test_a_tampered_program_is_one_line_naming_it(tampered, tamper):
    edit, expected = PROGRAM_TAMPERS[tamper]
    program = read_program(tampered)
    deep = edit(program)
    write_program(tampered, program, deep=deep or 0)
    message = one_line_refusal(tampered)
    assert "program.json" in message
    assert re.search(expected, message), message


@pytest.mark.parametrize("shape, when", [([{"node": "sym_size_int_1"}, 65], "first step"),
                                         ([-1, -1], "load"), ([{"node": "sym_size_int_1"}, 0], "load"),
                                         ([{"node": "sym_size_int_1"}, "64"], "load")])
def test_a_bad_view_shape_is_one_line_naming_the_program(tampered, shape, when):
    """A shape no tensor has is refused at load; one that only the weights' sizes refute (64 ->
    65 columns) is refused by the program's first step, which checks the program ran."""
    program = read_program(tampered)
    first_call(program, "aten::view.default")["args"][1] = shape
    write_program(tampered, program)
    message = one_line_refusal(tampered) if when == "load" else one_line_refusal_at_first_step(tampered)
    assert "program.json" in message and ("view" in message or "shape" in message)


def test_weights_whose_dtypes_were_all_changed_are_refused_by_their_header(tampered):
    def to_int32(header):
        for name, entry in header.items():
            if name != "__metadata__":
                entry["dtype"] = "I32"

    edit_header(tampered, to_int32)
    message = one_line_refusal(tampered)
    assert "weights.safetensors" in message and "is int32; the engine's build stores it as float32" in message


def test_a_transposed_embedding_is_refused_by_its_header(tampered):
    edit_header(tampered, lambda h: h["embed.weight"].update(shape=h["embed.weight"]["shape"][::-1]))
    message = one_line_refusal(tampered)
    assert "weights.safetensors" in message and "'embed.weight' has the shape [64, 272]" in message


def test_a_header_whose_byte_ranges_do_not_tile_the_data_is_refused(tampered):
    edit_header(tampered, lambda h: h["embed.weight"]["data_offsets"].__setitem__(1, h["embed.weight"]["data_offsets"][1] - 4))
    assert "weights.safetensors" in one_line_refusal(tampered)


@pytest.mark.parametrize("field, value", [
    ("head_dim", 0), ("head_dim", -16), ("num_layers", 10**9), ("num_kv_heads", 10**6), ("vocab_size", 1.5),
    ("norm_eps", 0), ("architecture", "os.system"), ("rope_theta", -1.0), ("qkv_bias", 1), ("num_layers", 3),
])
def test_a_model_config_out_of_range_is_one_line_naming_the_field(tampered, field, value):
    edit_model_config(tampered, **{field: value})
    message = one_line_refusal(tampered)
    assert "manifest.json" in message or "weights.safetensors" in message
    assert field in message or (field == "num_layers" and "layer 2" in message), message


@pytest.mark.parametrize("field, value", [
    ("attn_softcap", 1e300), ("final_softcap", 0.0), ("query_pre_attn_scalar", 1e-9), ("sliding_window", 0),
    ("layer_types", ["sliding_attention"]), ("layer_types", ["local", "global"]), ("rope_local_theta", -1.0),
])
def test_a_tampered_window_or_cap_is_one_line_naming_the_field(tampered, field, value):
    edit_model_config(tampered, **{field: value})
    message = one_line_refusal(tampered)
    assert "manifest.json" in message and field in message, message


def test_a_manifest_whose_windows_the_program_lacks_is_refused(tampered):
    """Every layer sliding in the manifest, none in the program: the runtime would give back KV
    blocks the program still reads, so the load refuses the engine."""
    edit_model_config(tampered, sliding_window=8, layer_types=["sliding_attention"] * 2)
    message = one_line_refusal(tampered)
    assert "manifest" in message and "sliding windows" in message


def test_a_negative_max_model_len_is_one_line(tampered):
    m = json.loads((tampered / "manifest.json").read_text())
    rewrite_manifest(tampered, build_options={**m["build_options"], "max_model_len": -5})
    message = one_line_refusal(tampered)
    assert "manifest.json" in message and "max_model_len" in message


def test_a_files_key_of_5000_characters_is_one_line(tampered):
    m = json.loads((tampered / "manifest.json").read_text())
    m["files"]["x" * 5000] = "0" * 64
    (tampered / "manifest.json").write_text(json.dumps(m))
    message = one_line_refusal(tampered)
    assert "manifest.json" in message and "'files'" in message and "5000 characters" in message


@pytest.mark.parametrize("rel", ["tokenizer/tokenizer.json", "program.json", "manifest.json"])
def test_a_2_gb_file_is_refused_by_its_size_without_reading_it(tampered, rel):
    """A sparse 2 GB file took 83 s and 10.5 GB of RSS before its refusal: now its size refuses
    it before a byte is read."""
    import resource
    import time

    with open(tampered / rel, "r+b") as f:
        f.truncate(2 << 30)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    message = one_line_refusal(tampered)
    assert time.perf_counter() - start < 5
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 100 * 1024  # KiB
    assert rel in message and "2048.0 MiB" in message


def test_an_untampered_engine_still_loads_and_runs(tiny_engine):
    logits = run_first_step(tiny_engine)
    assert logits.shape == (2, 272) and torch.isfinite(logits).all()


# ---------------------------------------------------------------------------------------------
# The tamper fuzz: seeded mutations of the manifest, program, weights header and tokenizer
# ---------------------------------------------------------------------------------------------


def nasty_values(canary):
    """Values a tamperer puts where a field was."""
    return [0, -1, -5, 1, 2, 3, 10**6, 10**9, 2**63, 2**64 + 1, 10**400, 1.5, -0.0, float("nan"), float("inf"),
            "", "x" * 5000, "../../etc/passwd", "/etc/passwd", "C:\\x", "a\x00b", None, True, False, [], {},
            [1, 2, 3], {"a": 1}, DEEP, "bfloat16", "cuda", "meta", "lambda", f"touch {canary}",
            {"node": "token_ids"}, {"tuple": [1]}, {"dtype": "os"}, {"device": "meta"}, {"float": "1e999"}]


def leaf_paths(value, prefix=()):
    """Every path to a leaf (or empty container) of a JSON value."""
    if isinstance(value, dict) and value:
        return [p for k, v in value.items() for p in leaf_paths(v, (*prefix, k))]
    if isinstance(value, list) and value:
        return [p for i, v in enumerate(value) for p in leaf_paths(v, (*prefix, i))]
    return [prefix]


def set_path(root, path, value):
    for key in path[:-1]:
        root = root[key]
    if value is _DELETE:
        del root[path[-1]]
    else:
        root[path[-1]] = value


_DELETE = object()


def write_json(path, value, deep):
    text = json.dumps(value)
    path.write_text(text.replace(json.dumps(DEEP), "[" * deep + "]" * deep) if deep else text)


def mutate_manifest(rng, engine, canary):
    m = json.loads((engine / "manifest.json").read_text())
    deep = rng.choice([50, 900, 100_000])
    if rng.random() < 0.2:  # a listed path
        rel = rng.choice(sorted(m["files"]))
        bad = rng.choice(["x" * 5000, "../outside", "a/" * 600, "tokenizer/../../x", "/etc/passwd", "ir/\x00",
                          "program.json/x", ""])
        m["files"][bad] = m["files"].pop(rel)
        (engine / "manifest.json").write_text(json.dumps(m))
        return f"manifest files key {rel} -> {bad[:20]!r}"
    path = rng.choice([p for p in leaf_paths(m) if p[0] not in ("files", "passes", "ops_before", "ops_after",
                                                                  "stage_seconds", "versions", "ir_stages")]
                      + [("files",), ("model_config",), ("build_options",), ("program",), ("format_version",)])
    value = _DELETE if rng.random() < 0.1 else rng.choice(nasty_values(canary))
    set_path(m, path, value)
    write_json(engine / "manifest.json", m, deep)
    if path[0] != "files":
        rewrite_checksums(engine)
    return f"manifest {'.'.join(map(str, path))} = {str(value)[:30]!r}"


def rewrite_checksums(engine):
    """The tamperer's last step: checksums that match, when the manifest still has its files."""
    path = engine / "manifest.json"
    try:
        m = json.loads(path.read_text())
        files = m["files"]
        fresh = {rel: artifact.sha256_file(engine / rel) for rel in files if (engine / rel).is_file()}
    except (ValueError, RecursionError, KeyError, TypeError, AttributeError, OSError):
        return
    files.update(fresh)
    path.write_text(json.dumps(m))


def mutate_program(rng, engine, canary):
    program = read_program(engine)
    nodes = program["nodes"]
    calls = [n for n in nodes if n["op"] == "call_function"]
    node = rng.choice(calls)
    what = rng.choice(["target", "drop arg", "add arg", "replace arg", "kwarg", "name", "op", "delete node",
                       "duplicate node", "swap nodes", "output", "empty", "deep", "view shape", "payload"])
    deep = 0
    if what == "target":
        node["target"] = rng.choice(["os.system", "builtins.exec", "builtins.eval", "torch.load",
                                     "aten::from_file.default", "aten::fill_.Scalar", "aten::view.default",
                                     "aten::linear.default", "cllm::paged_attention.default", "operator.getitem",
                                     "operator.neg", "aten::nonexistent.default", "cllm::nope.default", 5, None,
                                     "aten::_to_copy.default", "aten::embedding.default", "operator.truediv"])
    elif what == "drop arg" and node["args"]:
        node["args"].pop(rng.randrange(len(node["args"])))
    elif what == "add arg":
        node["args"].append(rng.choice(nasty_values(canary)))
    elif what == "replace arg" and node["args"]:
        node["args"][rng.randrange(len(node["args"]))] = rng.choice(nasty_values(canary))
    elif what == "kwarg":
        key = rng.choice(["lambda", "class", "x y", "__import__", "self", "dtype", "device", "weight", "out", ""])
        node["kwargs"][key] = rng.choice(nasty_values(canary))
    elif what == "name":
        node["name"] = rng.choice(["x; import os", "lambda", "a" * 300, "", "1abc", "token_ids", "output", 7])
    elif what == "op":
        node["op"] = rng.choice(["call_module", "get_attr", "call_method", "placeholder", "output", None])
    elif what == "delete node":
        nodes.remove(node)
    elif what == "duplicate node":
        nodes.insert(rng.randrange(len(nodes)), dict(node))
    elif what == "swap nodes":
        i, j = rng.randrange(len(nodes)), rng.randrange(len(nodes))
        nodes[i], nodes[j] = nodes[j], nodes[i]
    elif what == "output":
        nodes[-1]["args"] = [rng.choice(nasty_values(canary))]
    elif what == "empty":
        program["nodes"] = []
    elif what == "deep":
        node["args"].append(DEEP)
        deep = rng.choice([50, 900, 5000, 100_000])
    elif what == "view shape":
        view = first_call(program, "aten::view.default")
        view["args"][1][rng.randrange(2)] = rng.choice([65, 32, 0, -2, -1, 10**12, "a", 1.5, {"node": "token_ids"}])
    else:  # a call that would run code or write a file, if anything called it
        nodes.insert(-1, {"name": "payload", "op": "call_function", "target": rng.choice(["os.system", "builtins.exec"]),
                          "args": [f"open({str(canary)!r}, 'w')" if rng.random() < 0.5 else f"touch {canary}"],
                          "kwargs": {}})
    write_json(engine / "program.json", program, deep)
    rewrite_checksums(engine)
    return f"program {what} at {node.get('name')}"


def mutate_header(rng, engine, canary):
    what = rng.choice(["all dtypes", "one dtype", "transpose", "shape", "offsets", "remove", "add", "rename",
                       "length", "garbage", "metadata"])
    path = engine / "weights.safetensors"
    if what in ("length", "garbage"):
        data = bytearray(path.read_bytes())
        if what == "length":
            data[:8] = rng.choice([2**63, 2**40, 0, 7, len(data), len(data) - 8]).to_bytes(8, "little")
        else:
            length = int.from_bytes(data[:8], "little")
            for _ in range(rng.randint(1, 8)):
                data[8 + rng.randrange(length)] = rng.randrange(256)
        path.write_bytes(bytes(data))
        rewrite_checksums(engine)
        return f"header {what}"
    names = [n for n in json.loads(path.read_bytes()[8:8 + int.from_bytes(path.read_bytes()[:8], "little")])
             if n != "__metadata__"]
    name = rng.choice(names)
    dtype = rng.choice(["I32", "F16", "BF16", "I64", "U8", "I8", "F64", "BOOL", "F31", 5, None])

    def edit(h):
        entry = h[name]
        if what == "all dtypes":
            for n in names:
                h[n]["dtype"] = dtype
        elif what == "one dtype":
            entry["dtype"] = dtype
        elif what == "transpose":
            entry["shape"] = entry["shape"][::-1]
        elif what == "shape":
            entry["shape"] = rng.choice([[], [0], [-1, 64], [10**12], [1.5], "64", entry["shape"] + [1],
                                         [d + 1 for d in entry["shape"]]])
        elif what == "offsets":
            begin, end = entry["data_offsets"]
            entry["data_offsets"] = rng.choice([[begin, end - 4], [begin + 4, end + 4], [end, begin], [0, end - begin],
                                                [begin, 2**62], [-8, end]])
        elif what == "remove":
            del h[name]
        elif what == "add":
            h["payload.weight"] = {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]}
        elif what == "rename":
            h["layers.99.q.weight"] = h.pop(name)
        else:
            h["__metadata__"] = rng.choice([{"format": 5}, [], "pt", {"format": "pickle"}])

    edit_header(engine, edit)
    return f"header {what} of {name}"


def mutate_tokenizer(rng, engine, canary):
    tok = engine / "tokenizer"
    what = rng.choice(["truncate", "flip bytes", "pickle", "model type", "vocab", "template payload",
                       "template file payload", "auto_map", "tokenizer_class", "unlisted file", "added tokens"])
    if what in ("truncate", "flip bytes"):
        rel = rng.choice(["tokenizer.json", "tokenizer_config.json", "chat_template.jinja"])
        data = bytearray((tok / rel).read_bytes())
        if what == "truncate":
            data = data[:rng.randrange(len(data))]
        else:
            for _ in range(rng.randint(1, 16)):
                data[rng.randrange(len(data))] = rng.randrange(256)
        (tok / rel).write_bytes(bytes(data))
    elif what == "pickle":
        rel = rng.choice(["tokenizer.json", "tokenizer_config.json", "chat_template.jinja"])
        (tok / rel).write_bytes(pickle.dumps(Planted(str(canary))))
    elif what in ("model type", "vocab", "added tokens"):
        t = json.loads((tok / "tokenizer.json").read_text())
        if what == "model type":
            t["model"]["type"] = rng.choice(["Python", "Pickle", "", 5, None])
        elif what == "vocab":
            vocab = t["model"].get("vocab") or {}
            key = rng.choice(sorted(vocab)) if vocab else "a"
            vocab[key] = rng.choice([-1, 10**12, "x", None, 2**64])
        else:
            t["added_tokens"] = rng.choice([[{"id": -1, "content": "x"}], "x", [None], [{"id": 10**12}]])
        (tok / "tokenizer.json").write_text(json.dumps(t))
    elif what in ("template payload", "template file payload"):
        payload = rng.choice([
            f"{{{{ cycler.__init__.__globals__.os.system('touch {canary}') }}}}",
            f"{{{{ self.__init__.__globals__.__builtins__.open('{canary}', 'w') }}}}",
            "{{ ''.__class__.__mro__[1].__subclasses__() }}",
            "{% for x in range(10**9) %}{% endfor %}",
            "{{ messages[0].content * 10**9 }}",
            "{% macro m() %}{{ m() }}{% endmacro %}{{ m() }}",
            "{{ unclosed",
        ])
        if what == "template payload":
            config = json.loads((tok / "tokenizer_config.json").read_text())
            config["chat_template"] = payload
            (tok / "tokenizer_config.json").write_text(json.dumps(config))
        else:
            (tok / "chat_template.jinja").write_text(payload)
    elif what in ("auto_map", "tokenizer_class"):
        config = json.loads((tok / "tokenizer_config.json").read_text())
        if what == "auto_map":
            config["auto_map"] = {"AutoTokenizer": ["evil.EvilTokenizer", None]}
        else:
            config["tokenizer_class"] = rng.choice(["EvilTokenizer", "", 5, "LlamaTokenizer", "GPT2Tokenizer"])
        (tok / "tokenizer_config.json").write_text(json.dumps(config))
    else:
        (tok / rng.choice(["special_tokens_map.json", "added_tokens.json", "tokenizer.model"])).write_bytes(
            pickle.dumps(Planted(str(canary))))
        return f"tokenizer {what}"
    rewrite_checksums(engine)
    return f"tokenizer {what}"


def mutate_size(rng, engine, canary):
    """A file just above its cap (sparse): refused by its size, never read."""
    from compiled_llm.engine import limits

    rel, cap = rng.choice([("manifest.json", limits.MAX_MANIFEST_BYTES), ("program.json", limits.MAX_PROGRAM_BYTES),
                           ("tokenizer/tokenizer.json", limits.MAX_TOKENIZER_FILE_BYTES),
                           ("ir/00_captured.ops.json", limits.MAX_IR_FILE_BYTES)])
    with open(engine / rel, "r+b") as f:
        f.truncate(cap + 1)
    return f"size of {rel}"


MUTATIONS = [(mutate_manifest, 3), (mutate_program, 4), (mutate_header, 3), (mutate_tokenizer, 3), (mutate_size, 1)]
# where a one-line refusal says the problem is
ENGINE_PARTS = ("manifest", "program", "weights", "tokenizer", "chat template", "engine file", "ir/", "engine format",
                "built for")


def tamper_draws(request) -> int:
    soak = request.config.getoption("--soak")
    return int(os.environ.get("COMPILED_LLM_TAMPER_DRAWS", 0)) or (int(soak * 10) if soak else 240)


def load_in_child(engines, tmp_path):
    listing = tmp_path / f"engines-{len(engines)}.json"
    listing.write_text(json.dumps([str(e) for e in engines]))
    child = pathlib.Path(__file__).parents[1] / "helpers" / "engine_load_child.py"
    proc = subprocess.run([sys.executable, str(child), str(listing)], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_seeded_tamper_fuzz_gives_one_line_refusals_runs_no_payload_and_stays_within_memory(tiny_engine, tmp_path,
                                                                                         request):
    """At least 200 seeded mutations of the manifest, program, weights header and tokenizer
    (the tamperer rewriting checksums after each): every engine either loads and runs, or is
    refused with one line naming the part of the engine at fault; none gives a traceback, none
    runs its payload (the canary file stays absent), and the process that loads all of them
    peaks below twice the memory of one that loads the clean engine."""
    import random

    canary = tmp_path / "canary" / "code-ran"
    canary.parent.mkdir()
    draws = tamper_draws(request)
    engines, labels = [], {}
    families = [f for f, weight in MUTATIONS for _ in range(weight)]
    for seed in range(draws):
        rng = random.Random(seed)
        engine = pathlib.Path(shutil.copytree(tiny_engine, tmp_path / f"e{seed}"))
        labels[str(engine)] = f"seed {seed}: " + rng.choice(families)(rng, engine, canary)
        engines.append(engine)

    clean = load_in_child([tiny_engine], tmp_path)
    assert clean["outcomes"][0]["outcome"] == "ran", clean["outcomes"][0]
    fuzzed = load_in_child(engines, tmp_path)

    tracebacks = [(labels[o["engine"]], o["message"]) for o in fuzzed["outcomes"] if o["outcome"] == "traceback"]
    assert tracebacks == [], "\n".join(f"{label}: {message}" for label, message in tracebacks)
    refused = [o for o in fuzzed["outcomes"] if o["outcome"] == "refused"]
    vague = [(labels[o["engine"]], o["message"]) for o in refused
             if "\n" in o["message"] or not any(part in o["message"] for part in ENGINE_PARTS)]
    assert vague == [], "\n".join(f"{label}: {message}" for label, message in vague)
    assert len(refused) >= draws // 2, "most mutations break the engine: a fuzz that refuses few checks little"
    assert not canary.exists() and list(canary.parent.iterdir()) == []
    assert fuzzed["peak_rss_kib"] < 2 * clean["peak_rss_kib"], (fuzzed["peak_rss_kib"], clean["peak_rss_kib"])


def test_every_manifest_field_set_to_every_nasty_value_is_read_or_refused_in_one_line(tiny_engine, tmp_path):
    """The manifest's own checks, exhaustively: each field the loader reads, set to each value a
    tamperer tries (or removed), is accepted or refused with one line naming manifest.json."""
    original = json.loads((tiny_engine / "manifest.json").read_text())
    engine = pathlib.Path(shutil.copytree(tiny_engine, tmp_path / "engine"))
    paths = [p for p in leaf_paths(original) if p[0] in ("model_config", "build_options", "program", "kernels",
                                                          "tokenizer", "kernel_cache", "source", "generation_config")
             and p[:2] != ("program", "param_names")]
    paths += [("program", "param_names"), ("format_version",), ("files",), ("model_config", "rope_scaling")]
    tracebacks, vague = [], []
    for path in paths:
        for value in [*nasty_values(tmp_path / "canary"), {"node": [1]}, {"float": [1]}, 10**300, -(10**300), _DELETE]:
            m = json.loads(json.dumps(original))
            set_path(m, path, value)
            write_json(engine / "manifest.json", m, 50)
            try:
                artifact.read_manifest(engine)
            except EngineError as e:
                if "\n" in str(e) or "manifest" not in str(e):
                    vague.append((path, value, str(e)))
            except Exception as e:
                tracebacks.append((path, repr(value)[:40], f"{type(e).__name__}: {e}"))
    assert tracebacks == [] and vague == [], (tracebacks[:5], vague[:5])
