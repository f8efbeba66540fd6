"""benchmarks/quant_accuracy.py on a tiny model trained on the CPU (tiny-qwen2 shapes, float32):
the unquantized engine agrees with itself, int8 and int4 stay close in agreement and held-out
perplexity, the agreement counts what ``kernel_bench.py agree`` counts (teacher forcing, every
position), and the held-out walks are fresh walks of the training chain."""

import json
import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import quant_accuracy as qa  # noqa: E402
import train_synthetic_lm as tsl  # noqa: E402
from helpers.tiny_trained import train_tiny  # noqa: E402

PROMPTS, TOKENS = 4, 16


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    return train_tiny(tmp_path_factory.mktemp("trained"), num_prompts=6)


@pytest.fixture(scope="module")
def report(trained, tmp_path_factory):
    path = tmp_path_factory.mktemp("report") / "report.json"
    rc = qa.main([str(trained), "--device", "cpu", "--prompts", str(PROMPTS), "--tokens", str(TOKENS),
                  "--ppl-walks", "8", "--json", str(path)])
    report = json.loads(path.read_text())
    assert rc == (0 if report["pass"] else 1)
    return report


def test_report_covers_every_scheme_with_the_requested_sizes(report):
    assert [r["scheme"] for r in report["results"]] == ["none", "int8", "int4"]
    assert report["dtype"] == "float32" and report["prompts"] == PROMPTS and report["tokens"] == TOKENS
    assert report["held_out"] == {"walks": 8, "length": 48, "seed": 1000, "floor_ppl": pytest.approx(math.exp(
        tsl.entropy(torch.tensor(tsl.DEFAULT_PROBS))))}
    for r in report["results"]:
        assert r["steps"] == PROMPTS * TOKENS and r["tokens_scored"] == 8 * 47


def test_unquantized_engine_agrees_with_itself(report):
    base = report["results"][0]
    assert base["agreement"] == 1.0 and base["outside_top_k"] == 0  # fp32: decode and prefill paths agree
    assert base["identical"] == PROMPTS and base["ppl_ratio"] == 1.0 and base["pass"] is None


def test_quantized_engines_stay_close(report):
    base, int8, int4 = report["results"]
    floor = report["held_out"]["floor_ppl"]
    assert floor * 0.95 < base["ppl"] < floor * 1.5  # a trained model, near the chain's entropy
    assert math.isfinite(int8["ppl"]) and abs(int8["ppl_ratio"] - 1) < 0.01
    assert math.isfinite(int4["ppl"]) and abs(int4["ppl_ratio"] - 1) < 0.05
    assert int8["agreement"] >= 0.98 and int4["agreement"] >= 0.90
    assert int8["pass"] and int4["pass"] and report["pass"]
    assert int8["thresholds"] == {"min_agreement": 0.98, "max_ppl_ratio": 1.01}


def test_agreement_counts_each_wrong_pick_once(trained):
    """Teacher forcing: a wrong last token costs exactly its own position."""
    args = qa.parser().parse_args([str(trained), "--device", "cpu", "--dtype", "float32"])
    prompts = json.loads((trained / "prompts.json").read_text())[:PROMPTS]
    llm = qa.load(trained, qa.BASELINE, args)
    generated = qa.greedy(llm, prompts, TOKENS)
    assert qa.teacher_forced(llm, prompts, generated)["agreement"] == 1.0
    chain = json.loads((trained / "training.json").read_text())["chain"]["tokens"]
    wrong = [g[:-1] + [next(t for t in chain if t != g[-1])] for g in generated]
    tf = qa.teacher_forced(llm, prompts, wrong)
    assert (tf["agree"], tf["steps"]) == (PROMPTS * (TOKENS - 1), PROMPTS * TOKENS)
    assert qa.free_running(wrong, generated) == {"identical": 0, "mean_first_divergence": TOKENS - 1}
    nll = qa.perplexity(llm, [prompts[0]])
    assert nll["tokens_scored"] == len(prompts[0]) - 1 and nll["ppl"] > 1.0


def test_held_out_walks_are_fresh_walks_of_the_chain(trained):
    record = json.loads((trained / "training.json").read_text())
    walks = qa.held_out_walks(record, 6, 40, seed=1000)
    assert walks == qa.held_out_walks(record, 6, 40, seed=1000) != qa.held_out_walks(record, 6, 40, seed=1001)
    rank = {t: r for r, t in enumerate(record["chain"]["tokens"])}
    moves = {o % len(rank) for o in record["chain"]["offsets"]}
    for w in walks:
        assert len(w) == 40 and all((rank[b] - rank[a]) % len(rank) in moves for a, b in zip(w, w[1:]))
    prompts = json.loads((trained / "prompts.json").read_text())
    assert not any(w[: len(p)] == p for w in walks for p in prompts)


def test_unknown_scheme_is_refused(trained):
    with pytest.raises(SystemExit, match="unknown"):
        qa.main([str(trained), "--schemes", "int8,fp8", "--device", "cpu"])
