"""benchmarks/train_synthetic_lm.py: the synthetic chain is what its docstring says, a few CPU
steps on tiny-qwen2 learn it, and the checkpoint it writes loads in transformers, builds with
compiled_llm and passes the agreement check (``benchmarks/kernel_bench.py agree``) with its
prompts.json."""

import json
import math
import sys
from pathlib import Path

import pytest
import torch

from compiled_llm import LLM, SamplingParams
from compiled_llm.engine.build import build_engine
from compiled_llm.model.presets import ENDOFTEXT_ID, IM_END_ID, IM_START_ID, TINY_VOCAB

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import kernel_bench  # noqa: E402
import train_synthetic_lm as tsl  # noqa: E402

SPECIALS = {ENDOFTEXT_ID, IM_START_ID, IM_END_ID}
NUM_PROMPTS = 5


def test_chain_avoids_specials_and_walks_follow_its_offsets():
    chain = tsl.make_chain(TINY_VOCAB, 100, (0.1, 0.85, 0.05), SPECIALS, seed=3)
    assert chain.probs.tolist() == sorted(chain.probs.tolist(), reverse=True)
    assert len(set(chain.tokens.tolist())) == 100 and not SPECIALS & set(chain.tokens.tolist())
    offsets = chain.offsets.tolist()
    assert len(set(o % 100 for o in offsets)) == 3 and 0 not in offsets
    assert math.gcd(offsets[0], 100) == 1  # the greedy path visits every state
    ranks = tsl.sample_ranks(chain, 64, 50, torch.Generator().manual_seed(0))
    steps = ((ranks[:, 1:] - ranks[:, :-1]) % 100).flatten()
    counts = torch.stack([(steps == o).sum() for o in offsets])
    assert int(counts.sum()) == steps.numel()  # every step is one of the chain's moves
    assert (counts.float() / steps.numel() - chain.probs).abs().max() < 0.02
    with pytest.raises(ValueError):
        tsl.make_chain(TINY_VOCAB, TINY_VOCAB, (0.85, 0.1, 0.05), SPECIALS, seed=0)  # more states than usable ids


def test_lr_schedule_warms_up_then_decays_to_the_floor():
    lrs = [tsl.lr_at(s, 100, 1.0, 10) for s in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:])) and lrs[-1] == pytest.approx(0.1)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("trained")
    rc = tsl.main(["--preset", "tiny-qwen2", "--out", str(out), "--device", "cpu", "--steps", "40", "--batch", "16",
                   "--seq-len", "48", "--states", "32", "--lr", "1e-2", "--log-every", "10",
                   "--num-prompts", str(NUM_PROMPTS)])
    assert rc == 0
    return out, json.loads((out / "training.json").read_text())


def test_training_learns_the_chain(trained):
    _, record = trained
    first, last = record["history"][0], record["history"][-1]
    assert last["loss"] < 0.5 * first["loss"]
    assert last["loss"] < record["entropy"] + 0.5
    assert last["held_out"]["top_successor"] >= 0.95
    assert last["held_out"]["gap_median"] > 1.0 > first["held_out"]["gap_median"]


def test_prompts_are_walks_of_the_chain(trained):
    out, record = trained
    prompts = json.loads((out / "prompts.json").read_text())
    rank = {t: r for r, t in enumerate(record["chain"]["tokens"])}
    moves = {o % len(rank) for o in record["chain"]["offsets"]}
    assert len(prompts) == NUM_PROMPTS
    for p in prompts:
        assert 8 <= len(p) <= 32 and all(t in rank for t in p)
        assert all((rank[b] - rank[a]) % len(rank) in moves for a, b in zip(p, p[1:]))


def test_checkpoint_loads_in_transformers_as_bf16(trained):
    import transformers
    from safetensors import safe_open

    out, _ = trained
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    model, info = transformers.AutoModelForCausalLM.from_pretrained(str(out), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert model.config.vocab_size == TINY_VOCAB


def test_engine_built_from_checkpoint_generates_the_chain(trained, tmp_path):
    out, record = trained
    build_engine(str(out), tmp_path / "engine", dtype="float32", device="cpu", progress=False)
    llm = LLM(str(tmp_path / "engine"), device="cpu")
    prompts = json.loads((out / "prompts.json").read_text())
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), use_tqdm=False)
    tokens = record["chain"]["tokens"]
    rank = {t: r for r, t in enumerate(tokens)}
    best = record["chain"]["offsets"][0]
    pairs = [(a, b) for p, o in zip(prompts, outs) for a, b in zip([p[-1]] + o.token_ids, o.token_ids)]
    follows = sum(a in rank and b == tokens[(rank[a] + best) % len(tokens)] for a, b in pairs)
    assert follows >= 0.9 * len(pairs)


def test_agreement_check_passes_on_cpu_with_the_prompts_file(trained, capsys, monkeypatch):
    from compiled_llm.engine import compare

    out, _ = trained
    monkeypatch.setattr(compare, "random_prompts", lambda *a, **k: pytest.fail("random prompts despite --prompts-file"))
    rc = kernel_bench.main(["agree", "--source", str(out), "--prompts-file", str(out / "prompts.json"),
                            "--dtype", "float32", "--prompts", "2", "--tokens", "4"])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "greedy agreement 100.00% (8/8)" in text and "PASS" in text


def test_agreement_check_refuses_a_short_prompts_file(tmp_path):
    path = tmp_path / "prompts.json"
    path.write_text(json.dumps([[1, 2, 3]]))
    with pytest.raises(SystemExit, match="at least 2 prompts"):
        kernel_bench.main(["agree", "--source", "tiny-qwen2", "--prompts-file", str(path), "--prompts", "2"])
