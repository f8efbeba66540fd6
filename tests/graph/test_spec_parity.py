"""The spec matches transformers' eager logits for every family, over a packed prefill of
sequences of different lengths and 8 decode steps through a non-contiguous paged cache."""

import pytest
import torch

from compiled_llm.model.config import load_config
from compiled_llm.model.families import FAMILIES
from compiled_llm.graph.batch import ScheduledSeq, pack_batch
from compiled_llm.model.spec import forward, kv_cache_shape
from compiled_llm.model.weights import load_params
from helpers.hf_checkpoints import make_checkpoint

BLOCK = 16


@pytest.mark.parametrize("family", [f.name for f in FAMILIES])
def test_prefill_and_decode_match_transformers(family, tmp_path):
    shard = "20KB" if family == "llama" else None  # llama: sharded weights
    hf = make_checkpoint(family, tmp_path, max_shard_size=shard)
    if family == "llama":
        assert (tmp_path / "model.safetensors.index.json").exists()
    config = load_config(tmp_path)
    params = load_params(config, tmp_path, torch.float32, "cpu")
    gen = torch.Generator().manual_seed(1)
    prompt_lens = [5, 23, 40]
    prompts = [torch.randint(0, config.vocab_size, (n,), generator=gen).tolist() for n in prompt_lens]
    # blocks handed out in a scrambled order so no sequence's blocks are contiguous
    num_blocks = 32
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [order[0:8:2], order[1:9:2], order[9:17]]
    kv = torch.zeros(kv_cache_shape(config, num_blocks, BLOCK))

    seqs = [list(p) for p in prompts]
    step = [ScheduledSeq(p, 0, t) for p, t in zip(prompts, tables)]
    for i in range(9):
        logits = forward(config, params, pack_batch(step, BLOCK), kv)
        with torch.no_grad():
            ref = torch.stack([hf(torch.tensor([s])).logits[0, -1] for s in seqs])
        tol = 1e-4 * ref.abs().max()
        assert (logits - ref).abs().max() <= tol, f"step {i}: {(logits - ref).abs().max()} > {tol}"
        nxt = logits.argmax(-1).tolist()
        step = []
        for s, t, tok in zip(seqs, tables, nxt):
            s.append(tok)
            step.append(ScheduledSeq([tok], len(s) - 1, t))
