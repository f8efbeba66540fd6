"""`compiled-llm run SOURCE --eager`, the reference path: same tokens as transformers' greedy
generate for every family (and so does the default compiled path, through the engine cache),
text prompts through HF and sentencepiece tokenizers, --chat, presets, the engine-directory
hand-off, and help for every option."""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

from compiled_llm.cli import run as cli_run
from compiled_llm.cli.main import main, make_parser
from compiled_llm.model.tokenizer import DEFAULT_SYSTEM_PROMPT, plain_chat_prompt
from helpers.greedy_oracle import hf_greedy, lively_checkpoint
from helpers.hf_checkpoints import make_checkpoint
from helpers.trained_tokenizers import chat_ids_from_transformers, train_hf_tokenizer, train_sentencepiece

PROMPT_IDS = [5, 77, 130, 2, 250, 31, 64, 9, 180, 11, 42]
MAX_TOKENS = 32


def run_json(capsys, *argv, eager: bool = True) -> list[dict]:
    """`run ... --json` records; on the reference path (--eager) unless ``eager=False``."""
    argv = [str(a) for a in argv]
    device = [] if "--device" in argv else ["--device", "cpu"]
    rc = main(["run", *argv, "--json", *device, *(["--eager"] if eager else [])])
    out = capsys.readouterr()
    assert rc == 0, out.err
    return [json.loads(line) for line in out.out.splitlines()]


@pytest.mark.parametrize("path", ["eager", "compiled"])
@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama", "gpt2"])
def test_greedy_tokens_match_transformers(family, path, tmp_path, capsys):
    # llama: untied, llama3 rope scaling, and sharded weights
    hf = lively_checkpoint(family, tmp_path, max_shard_size="20KB" if family == "llama" else None)
    if family == "llama":
        assert (tmp_path / "model.safetensors.index.json").is_file()
        assert not hf.config.tie_word_embeddings
    if family == "qwen3":
        assert hf.config.head_dim != hf.config.hidden_size // hf.config.num_attention_heads
    prompt_b = PROMPT_IDS[::-1][:6]
    records = run_json(
        capsys, tmp_path, "--prompt-ids", ",".join(map(str, PROMPT_IDS)), "--prompt-ids", ",".join(map(str, prompt_b)),
        "--max-tokens", MAX_TOKENS, "--ignore-eos", "--dtype", "float32", eager=path == "eager",
    )
    assert len(records) == 2
    for rec, prompt in zip(records, [PROMPT_IDS, prompt_b]):
        assert set(rec) == {"prompt_token_ids", "token_ids", "text", "finish_reason"}
        assert rec["prompt_token_ids"] == prompt
        assert rec["token_ids"] == hf_greedy(hf, prompt, MAX_TOKENS)
        assert len(set(rec["token_ids"])) >= 5  # varied output, so every decode step is checked
        assert rec["finish_reason"] == "length"
        assert rec["text"] == ""  # no tokenizer in the checkpoint


ROOT = Path(__file__).resolve().parents[2]


def _declared_entry_point() -> tuple[str, str]:
    """(module, function) of the compiled-llm console script pyproject.toml declares."""
    found = re.search(r'^compiled-llm\s*=\s*"([\w.]+):(\w+)"', (ROOT / "pyproject.toml").read_text(), re.M)
    assert found, "pyproject.toml declares no compiled-llm console script"
    return found.group(1), found.group(2)


def _write_launcher(bin_dir: Path) -> Path:
    """What pip installs for the declared entry point: import it, exit with what it returns. A
    shell script, so no shebang limit on the interpreter's path applies."""
    module, func = _declared_entry_point()
    code = f'import sys; from {module} import {func}; sys.argv[0] = "compiled-llm"; sys.exit({func}())'
    launcher = bin_dir / "compiled-llm"
    launcher.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -c {shlex.quote(code)} "$@"\n')
    launcher.chmod(0o755)
    return bin_dir


@pytest.fixture(scope="module")
def console_script_env(tmp_path_factory):
    """An environment with `compiled-llm` first on PATH: the script pip installed for this
    interpreter, or, where the tree runs without pip (the GPU machine, through PYTHONPATH), the
    same launcher written here. Not shutil.which: a compiled-llm of another environment may come
    first on PATH. PYTHONPATH puts this tree first, so the command runs the code under test even
    where an editable install points at another checkout."""
    scripts = Path(sysconfig.get_path("scripts"))
    if not (scripts / "compiled-llm").is_file():
        scripts = _write_launcher(tmp_path_factory.mktemp("bin"))
    return {**os.environ, "OMP_NUM_THREADS": "1",
            "PATH": os.pathsep.join([str(scripts), os.environ.get("PATH", "")]),
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


def test_console_script_matches_transformers(tmp_path, console_script_env):
    hf = lively_checkpoint("qwen2", tmp_path)
    r = subprocess.run(
        ["compiled-llm", "run", str(tmp_path), "--prompt-ids", ",".join(map(str, PROMPT_IDS)), "--max-tokens",
         str(MAX_TOKENS), "--ignore-eos", "--dtype", "float32", "--device", "cpu", "--json"],
        capture_output=True, text=True, timeout=300, env=console_script_env,  # found on the env's PATH
    )
    assert r.returncode == 0, r.stderr
    (rec,) = [json.loads(line) for line in r.stdout.splitlines()]
    assert rec["token_ids"] == hf_greedy(hf, PROMPT_IDS, MAX_TOKENS)


def test_eos_ends_generation_unless_ignored(tmp_path, capsys):
    hf = lively_checkpoint("qwen2", tmp_path)
    free = hf_greedy(hf, PROMPT_IDS, 12)
    eos = free[4]
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    ids = ",".join(map(str, PROMPT_IDS))
    (rec,) = run_json(capsys, tmp_path, "--prompt-ids", ids, "--max-tokens", 12)
    assert rec["token_ids"] == free[: free.index(eos) + 1] and rec["finish_reason"] == "stop"
    (rec,) = run_json(capsys, tmp_path, "--prompt-ids", ids, "--max-tokens", 12, "--ignore-eos")
    assert rec["token_ids"] == free and rec["finish_reason"] == "length"


def test_sampling_options_are_seeded(tmp_path, capsys):
    make_checkpoint("qwen2", tmp_path)
    args = [tmp_path, "--prompt-ids", "1,2,3", "--max-tokens", 16, "--ignore-eos", "--temperature", 1.0,
            "--top-k", 50, "--top-p", 0.9]
    a = run_json(capsys, *args, "--seed", 1)[0]["token_ids"]
    b = run_json(capsys, *args, "--seed", 1)[0]["token_ids"]
    c = run_json(capsys, *args, "--seed", 2)[0]["token_ids"]
    assert a == b and a != c


# --- text prompts --------------------------------------------------------------------------------


def test_text_prompt_with_tokenizers_library_tokenizer(tmp_path, capsys):
    make_checkpoint("qwen2", tmp_path)  # vocab 256
    raw, hf_tok = train_hf_tokenizer(vocab_size=200, all_bytes=False)
    assert len(hf_tok) <= 256
    hf_tok.save_pretrained(str(tmp_path))
    text = "the quick brown fox jumps"
    (rec,) = run_json(capsys, tmp_path, "--prompt", text, "--max-tokens", 8, "--ignore-eos")
    assert rec["prompt_token_ids"] == raw.encode(text).ids
    assert rec["text"] == hf_tok.decode(rec["token_ids"], skip_special_tokens=True)

    (chat,) = run_json(capsys, tmp_path, "--prompt", text, "--chat", "--max-tokens", 4, "--ignore-eos")
    assert chat["prompt_token_ids"] == chat_ids_from_transformers(hf_tok, text, DEFAULT_SYSTEM_PROMPT)
    assert chat["prompt_token_ids"][0] == raw.token_to_id("<|im_start|>")

    (sys_chat,) = run_json(capsys, tmp_path, "--prompt", text, "--chat", "--system-prompt", "be brief",
                           "--max-tokens", 4, "--ignore-eos")
    assert sys_chat["prompt_token_ids"] == chat_ids_from_transformers(hf_tok, text, "be brief")


def test_text_prompt_with_sentencepiece_model(tmp_path, capsys):
    import sentencepiece

    make_checkpoint("llama", tmp_path)  # vocab 256 >= the sentencepiece vocab of 200
    sp = sentencepiece.SentencePieceProcessor(model_file=str(train_sentencepiece(tmp_path / "tokenizer.model")))
    text = "the lazy dog runs fast"
    (rec,) = run_json(capsys, tmp_path, "--prompt", text, "--max-tokens", 8, "--ignore-eos")
    assert rec["prompt_token_ids"] == [sp.bos_id()] + sp.encode(text)
    known = [t for t in rec["token_ids"] if t < sp.get_piece_size() and not sp.is_control(t)]
    assert rec["text"] == sp.decode(known)

    # no chat template in a sentencepiece model: --chat uses the plain transcript
    (chat,) = run_json(capsys, tmp_path, "--prompt", text, "--chat", "--max-tokens", 2, "--ignore-eos")
    assert chat["prompt_token_ids"] == [sp.bos_id()] + sp.encode(plain_chat_prompt(text, DEFAULT_SYSTEM_PROMPT))


def test_text_prompts_run_before_id_prompts(tmp_path, capsys):
    make_checkpoint("qwen2", tmp_path)
    _, hf_tok = train_hf_tokenizer(all_bytes=False)
    hf_tok.save_pretrained(str(tmp_path))
    recs = run_json(capsys, tmp_path, "--prompt-ids", "9,8,7", "--prompt", "the fox", "--max-tokens", 2)
    assert [r["prompt_token_ids"] for r in recs] == [hf_tok.encode("the fox"), [9, 8, 7]]


# --- presets and readable output ---------------------------------------------------------------


@pytest.mark.parametrize("preset", ["tiny-qwen2", "tiny-qwen3", "tiny-llama", "tiny-gpt2"])
def test_tiny_presets_generate_from_text(preset, capsys):
    (rec,) = run_json(capsys, preset, "--prompt", "Hello, world", "--chat", "--max-tokens", 6, "--ignore-eos")
    assert rec["prompt_token_ids"][0] == 257  # <|im_start|>
    assert len(rec["token_ids"]) == 6
    assert rec["finish_reason"] == "length"


def test_readable_output_has_text_and_perf_summary(capsys):
    rc = main(["run", "tiny-qwen2", "--prompt", "Hello there", "--max-tokens", "5", "--ignore-eos", "--device", "cpu",
               "--eager"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "tiny-qwen2 on cpu, float32, reference (eager) path" in out
    assert "=== prompt 0 (11 tokens) ===" in out and "Hello there" in out
    assert "--- output (5 tokens, finish: length) ---" in out
    for row in ("load", "prefill", "decode", "total"):
        assert any(line.strip().startswith(row) for line in out.splitlines()), row
    assert "4 tokens" in out and "tok/s" in out  # decode row: 5 new tokens, the first came from prefill


# --- engine directories ------------------------------------------------------------------------


def test_engine_directory_is_handed_to_the_runtime(tmp_path, monkeypatch, capsys):
    (tmp_path / "manifest.json").write_text("{}")
    seen = {}

    def run_engine(args):
        seen["source"] = args.source
        return 0

    monkeypatch.setattr(cli_run, "run_engine", run_engine)
    assert main(["run", str(tmp_path), "--prompt", "hi"]) == 0
    assert seen == {"source": str(tmp_path)}


# --- help ----------------------------------------------------------------------------------------


def _run_parser() -> argparse.ArgumentParser:
    sub = next(a for a in make_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["run"]


def test_every_run_option_has_help():
    actions = [a for a in _run_parser()._actions if not isinstance(a, argparse._HelpAction)]
    expected = {"--prompt", "--prompt-ids", "--max-tokens", "--temperature", "--top-k", "--top-p", "--seed",
                "--ignore-eos", "--dtype", "--device", "--chat", "--json", "--eager", "--enforce-eager"}
    assert expected <= {s for a in actions for s in a.option_strings}
    # the one hidden option: --no-cuda-graphs, the old name of --enforce-eager, kept for old scripts
    (hidden,) = [a for a in actions if a.help == argparse.SUPPRESS]
    assert hidden.option_strings == ["--no-cuda-graphs"] and hidden.dest == "enforce_eager"
    for a in actions:
        if a is not hidden:
            assert a.help and a.help.strip(), a.dest


def test_help_commands_exit_cleanly():
    for argv in (["--help"], ["run", "--help"]):
        r = subprocess.run([sys.executable, "-m", "compiled_llm.cli.main", *argv], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        assert "run" in r.stdout
    r = subprocess.run([sys.executable, "-m", "compiled_llm.cli.main", "run", "--help"], capture_output=True, text=True)
    r.stdout = re.sub(r"-\n\s+", "-", r.stdout)  # argparse may wrap "tiny-qwen2" after its hyphen
    for opt in ("--prompt-ids", "--max-tokens", "--temperature", "--top-k", "--top-p", "--seed", "--ignore-eos",
                "--dtype", "--device", "--chat", "--json", "tiny-qwen2", "--eager", "--enforce-eager"):
        assert opt in r.stdout, opt
    assert "--no-cuda-graphs" not in r.stdout


# --- GPU (run by the lead on the device machine) -----------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("family", ["qwen3", "gpt2"])
def test_cuda_float32_matches_transformers(family, tmp_path, capsys):
    torch.backends.cuda.matmul.allow_tf32 = False
    hf = lively_checkpoint(family, tmp_path)
    (rec,) = run_json(capsys, tmp_path, "--prompt-ids", ",".join(map(str, PROMPT_IDS)), "--max-tokens", 16,
                      "--ignore-eos", "--dtype", "float32", "--device", "cuda")
    assert rec["token_ids"] == hf_greedy(hf, PROMPT_IDS, 16)


@pytest.mark.gpu
@needs_cuda
def test_cuda_bfloat16_real_shaped_preset(capsys):
    rc = main(["run", "qwen2.5-0.5b", "--prompt", "Hello", "--chat", "--max-tokens", "24", "--ignore-eos",
               "--device", "cuda", "--dtype", "bfloat16", "--eager"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "--- output (24 tokens, finish: length) ---" in out
    assert "qwen2.5-0.5b on cuda, bfloat16" in out
    with capsys.disabled():
        print(out)  # the perf summary, for the device log


@pytest.mark.parametrize("argv, named", [
    (["run", "tiny-qwen2", "--prompt-ids", "1,2", "--data-parallel-size", "2", "--profile", "prof"],
     "--profile traces the engine in this process"),
    (["bench", "tiny-qwen2", "--data-parallel-size", "2", "--workload", "coldstart"],
     "--workload coldstart measures one engine; with --data-parallel-size 2 choose latency, throughput or prefill"),
    (["bench", "tiny-qwen2", "--data-parallel-size", "2"],
     "--workload all includes coldstart and structured, which measure one engine"),
])
def test_what_measures_one_engine_refuses_replicas_in_one_line_before_loading(argv, named, monkeypatch, capsys):
    monkeypatch.setattr(cli_run, "build_llm", lambda args: pytest.fail("nothing may load"))
    monkeypatch.setattr("compiled_llm.engine.cache.cached_engine", lambda *a, **k: pytest.fail("nothing may build"))
    assert main([*argv, "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert named in err and err.count("\n") == 1
