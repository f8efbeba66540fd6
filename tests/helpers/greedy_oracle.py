"""Checkpoints whose greedy outputs vary, and transformers' greedy generate as the oracle for
them: what the runtime's and the CLI's token-level tests compare against."""

from __future__ import annotations

import torch

from helpers.hf_checkpoints import make_checkpoint


def lively_checkpoint(family: str, out_dir, max_shard_size: str | None = None):
    """make_checkpoint, with the layers' matrices scaled up 8x: at transformers' small init a
    tied model's greedy output just repeats one token, which would make token-level tests weak.
    Returns the transformers model, which matches the files written."""
    hf = make_checkpoint(family, out_dir)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if p.dim() == 2 and not any(e in name for e in ("embed", "wte", "wpe", "lm_head")):
                p.mul_(8.0)
    for f in out_dir.glob("model*.safetensors*"):
        f.unlink()
    hf.save_pretrained(out_dir, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    return hf


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy generate, ignoring EOS. (min_new_tokens would not do: it bans the
    EOS token instead of letting it through.)"""
    # transformers falls back from generation_config to the model config for EOS: clear both
    # (a multimodal model's is its text config's)
    config = hf.config.get_text_config()
    saved = hf.generation_config.eos_token_id, config.eos_token_id
    hf.generation_config.eos_token_id = config.eos_token_id = None
    ids = torch.tensor([prompt])
    try:
        with torch.no_grad():
            # every prompt token attends (left alone, transformers masks those equal to the pad id)
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False)
    finally:
        hf.generation_config.eos_token_id, config.eos_token_id = saved
    assert out.shape[1] == len(prompt) + n
    return out[0, len(prompt):].tolist()
