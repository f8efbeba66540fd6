"""The tiny preset of every family, and random inputs to run a captured program on, for tests
that compare a program before and after a rewrite."""

import torch

from compiled_llm.graph.batch import ScheduledSeq, pack_batch
from compiled_llm.model.spec import kv_cache_shape

FAMILIES = ["tiny-qwen2", "tiny-qwen3", "tiny-llama", "tiny-gpt2"]


def mixed_batch(config, seed):
    """(packed batch, KV cache) of random ids and cache values: a 9-token prompt, a 4-token chunk
    after 3 cached tokens and one decode token after 10, over blocks of 8 slots."""
    gen = torch.Generator().manual_seed(seed)
    block = 8
    seqs = [ScheduledSeq(torch.randint(0, config.vocab_size, (n,), generator=gen).tolist(), c, [2 * i, 2 * i + 1])
            for i, (c, n) in enumerate([(0, 9), (3, 4), (10, 1)])]
    kv = torch.randn(kv_cache_shape(config, 8, block), generator=gen)
    return pack_batch(seqs, block), kv
