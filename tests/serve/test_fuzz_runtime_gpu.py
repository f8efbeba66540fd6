"""The runtime fuzz on the GPU: draws with CUDA graphs and async scheduling against the same
engine run eagerly, one request at a time, at Qwen2.5-0.5B shapes.

Random weights at these shapes have top-1/top-2 logit gaps of a few ulps, where any change of
summation order flips a pick, so the checkpoint is ``benchmarks/train_synthetic_lm.py``'s model,
briefly trained to real margins; prompts are walks of its chain. In float32 every output must be
identical. In bfloat16 the kernels are not batch-invariant (a GEMV and a GEMM, or one split of
the attention and several, round differently), so the agreement rate is printed and must stay
high; the draws that differ are printed too.

    python -m pytest -q -s tests/serve/test_fuzz_runtime_gpu.py
"""

from __future__ import annotations

import gc
import json
import random
import sys
import time
from pathlib import Path

import pytest
import torch

from compiled_llm import LLM, SamplingParams
from compiled_llm.engine.loader import load_model
from helpers.lively import Continuation
from helpers.runtime_fuzz import MAX_NEW_TOKENS, run_draw

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

NUM_DRAWS = 100
BF16_MIN_AGREEMENT = 0.9


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import train_synthetic_lm

    out = tmp_path_factory.mktemp("trained")
    assert train_synthetic_lm.main(["--preset", "qwen2.5-0.5b", "--out", str(out), "--steps", "200",
                                    "--num-prompts", "48", "--log-every", "100"]) == 0
    return out


def eager_pool(loaded, prompts):
    """Each prompt's continuation from the engine run eagerly (no CUDA graphs, no async
    scheduling), one request at a time."""
    llm = LLM.from_loaded(loaded, enforce_eager=True, async_scheduling=False, max_num_seqs=1, num_blocks=64)
    params = SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0, ignore_eos=True)
    pool = []
    for p in prompts:
        (out,) = llm.generate({"prompt_token_ids": p}, params, use_tqdm=False)
        pool.append((p, Continuation(tuple(p), tuple(out.token_ids), float("inf"))))
    return pool


def graph_draws(lively) -> tuple[int, list[str], list[str]]:
    """NUM_DRAWS draws with CUDA graphs and async scheduling: (requests compared, outputs that
    differ from eager one-at-a-time, leaked blocks or lost requests)."""
    compared, problems = 0, []
    for seed in range(NUM_DRAWS):
        n, p = run_draw(seed, lively, block_sizes=(4, 8, 16), async_scheduling=True, enforce_eager=False)
        compared, problems = compared + n, problems + p
        gc.collect()
        torch.cuda.empty_cache()
    leaks = [p for p in problems if "blocks still held" in p or "gave no output" in p]
    return compared, [p for p in problems if p not in leaks], leaks


@pytest.fixture(scope="module")
def engines(trained, tmp_path_factory):
    """dtype -> the trained checkpoint's CUDA engine, built on first use."""
    from compiled_llm.engine.build import build_engine

    built = {}

    def get(dtype: str) -> Path:
        if dtype not in built:
            out = tmp_path_factory.mktemp(f"engine_{dtype}") / "engine"
            build_engine(str(trained), out, dtype=dtype, device="cuda", max_model_len=4096, progress=False)
            built[dtype] = out
        return built[dtype]

    return get


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graph_and_async_draws_match_eager_one_at_a_time(trained, engines, dtype):
    loaded = load_model(str(engines(dtype)), device="cuda")
    walks = json.loads((trained / "prompts.json").read_text())
    rng = random.Random(0)
    # shared prefixes too: a walk continued by another walk's tail
    prompts = walks + [w + rng.choice(walks)[: rng.randint(1, 8)] for w in walks[:16]]
    lively = (loaded, loaded.tokenizer, eager_pool(loaded, prompts))

    t0 = time.perf_counter()
    compared, problems, leaks = graph_draws(lively)
    agreement = 1 - len(problems) / max(compared, 1)
    print(f"\n{dtype}: {NUM_DRAWS} draws, {compared} requests in {time.perf_counter() - t0:.0f} s; "
          f"agreement with eager one-at-a-time {agreement:.2%} ({len(problems)} requests differ)")
    for line in (leaks + problems)[:8]:
        print("  " + line[:400])
    assert not leaks
    if dtype == "float32":
        assert not problems
    else:
        assert agreement >= BF16_MIN_AGREEMENT


def test_bf16_runtime_agrees_with_transformers_bf16(trained, engines):
    """The runtime (fused kernels, CUDA graphs, batching) against transformers' own bf16
    generate on a model with real margins: greedy tokens agree at >= 99% of positions."""
    import transformers

    walks = json.loads((trained / "prompts.json").read_text())
    llm = LLM(str(engines("bfloat16")), device="cuda", gpu_memory_utilization=0.3)
    params = SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0, ignore_eos=True)
    ours = [o.token_ids for o in llm.generate([{"prompt_token_ids": w} for w in walks], params, use_tqdm=False)]
    del llm
    model = transformers.AutoModelForCausalLM.from_pretrained(str(trained), dtype=torch.bfloat16).cuda().eval()
    same = total = 0
    for w, mine in zip(walks, ours):
        ids = torch.tensor([w], device="cuda")
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW_TOKENS, do_sample=False,
                             eos_token_id=None, pad_token_id=0)[0, len(w):].tolist()
        same += sum(a == b for a, b in zip(mine, ref))
        total += len(ref)
    print(f"\nbf16 greedy agreement with transformers bf16: {same / total:.2%} ({same}/{total} tokens, {len(walks)} prompts)")
    assert same >= 0.99 * total


def test_bf16_on_random_weights_reports_where_batching_changes_picks(tmp_path_factory):
    """Random weights at Qwen2.5-0.5B shapes, bf16: top-1/top-2 gaps of a few ulps, so the
    kernels' batch-size-dependent rounding flips picks. Reported, not asserted (no leak is)."""
    from compiled_llm.engine.build import build_engine

    out = tmp_path_factory.mktemp("random_bf16") / "engine"
    build_engine("qwen2.5-0.5b", out, dtype="bfloat16", device="cuda", max_model_len=4096, progress=False)
    loaded = load_model(str(out), device="cuda")
    rng = random.Random(0)
    prompts = [[rng.randrange(10_000) for _ in range(rng.randint(8, 32))] for _ in range(64)]
    lively = (loaded, loaded.tokenizer, eager_pool(loaded, prompts))
    compared, differ, leaks = graph_draws(lively)
    by_driver = {}
    for p in differ:
        driver = p.split(", ")[1]
        by_driver[driver] = by_driver.get(driver, 0) + 1
    print(f"\nrandom weights bf16: {compared} requests, {1 - len(differ) / max(compared, 1):.2%} identical to eager "
          f"one-at-a-time; differing by driver {by_driver}")
    for line in differ[:4]:
        print("  " + line[:300])
    assert not leaks
