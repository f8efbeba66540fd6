"""Structured outputs on a CUDA engine with its graphs: outputs match their grammar whether the
step masks before sampling (Triton bitmask kernel) or checks after it, and the mask changes no
greedy token the grammar allows."""

from __future__ import annotations

import json
import re

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
xgrammar = pytest.importorskip("xgrammar")

from compiled_llm import LLM, SamplingParams  # noqa: E402
from compiled_llm.serve.sampling_params import StructuredOutputsParams as Structured  # noqa: E402

SCHEMA = {"type": "object", "properties": {"word": {"type": "string", "maxLength": 6},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 3}},
          "required": ["word", "n", "tags"]}


def follows_schema(value) -> bool:
    """SCHEMA's rules, checked by hand (the GPU machine has no jsonschema)."""
    return (isinstance(value, dict) and set(value) == {"word", "n", "tags"} and isinstance(value["word"], str)
            and len(value["word"]) <= 6 and type(value["n"]) is int and 0 <= value["n"] <= 99
            and isinstance(value["tags"], list) and len(value["tags"]) <= 3 and set(value["tags"]) <= {"x", "y"})


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    from compiled_llm.engine.build import build_engine

    out = tmp_path_factory.mktemp("structured_gpu") / "engine"
    build_engine("tiny-qwen2", out, dtype="bfloat16", device="cuda", progress=False)
    return LLM(str(out), device="cuda", gpu_memory_utilization=0.3, max_num_seqs=32)


@pytest.mark.parametrize("masked_first", [False, True])
def test_schema_outputs_validate_under_graphs(llm, masked_first):
    # top_k makes the step mask before sampling; plain temperature checks after it
    extra = dict(top_k=50) if masked_first else {}
    params = [SamplingParams(temperature=t, max_tokens=120, seed=i, structured_outputs=Structured(json=SCHEMA,
              disable_any_whitespace=True), **extra) for i, t in enumerate([0.0, 1.0] * 12)]
    outs = llm.generate([[5 + i, 7, 9] for i in range(len(params))], params, use_tqdm=False)
    done = [o.outputs[0] for o in outs if o.outputs[0].finish_reason == "stop"]
    assert len(done) >= 20
    for c in done:
        assert follows_schema(json.loads(c.text)), c.text
    assert llm.engine.live_grammar_matchers == 0


def test_regex_outputs_match_with_logprobs_of_the_masked_distribution(llm):
    params = SamplingParams(temperature=1.0, max_tokens=16, seed=3, logprobs=2, n=4,
                            structured_outputs=Structured(regex="[a-c]{3}-[0-9]{2}"))
    (out,) = llm.generate([[3, 4, 5]], params, use_tqdm=False)
    for c in out.outputs:
        assert re.fullmatch("[a-c]{3}-[0-9]{2}", c.text), c.text
        assert all(lp[t].logprob > -30 for lp, t in zip(c.logprobs, c.token_ids))
