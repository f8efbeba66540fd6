"""The model, written once: a pure function of (params, packed batch, paged KV cache).

One function serves every family (GPT-2, Llama, Qwen2/3, Mistral, Phi-3, Gemma 2/3); they differ
only by ModelConfig fields (how each reads its checkpoint is ``model/families/``). Batches are flat as in vLLM v1, so prefill, decode and mixed steps are the same code
with different shapes:

    token_ids[T], positions[T]       every scheduled token of every sequence, packed
    query_start_loc[S+1]             sequence s owns rows query_start_loc[s]:query_start_loc[s+1]
    seq_lens[S]                      context length of s after this step (cached + new tokens)
    block_tables[S, max_blocks]      the cache blocks of s, in order
    slot_mapping[T]                  flat cache slot (block * block_size + offset) of each row;
                                     -1 for padding rows, which write nowhere
    kv_cache[L, 2, num_blocks, block_size, kv_heads, head_dim]

It returns logits[S, vocab] for the last row of each sequence only (or, given ``logits_rows``,
for those token rows: a prompt's log-probabilities need every position's).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

# the op vocabulary (graph/ops.py) sits a layer below the model; `import ... as` names only
# that module, not the graph package, whose capture and serialization build on this spec
import compiled_llm.graph.ops as ops
from compiled_llm.model.config import ModelConfig

ROPE_PARAM = "rope.cos_sin"
# the sliding layers' table where their RoPE base differs (Gemma 3)
LOCAL_ROPE_PARAM = "rope.local.cos_sin"


class PackedBatch(NamedTuple):
    token_ids: Tensor
    positions: Tensor
    query_start_loc: Tensor
    seq_lens: Tensor
    block_tables: Tensor
    slot_mapping: Tensor


BATCH_FIELDS = PackedBatch._fields


def param_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the spec reads from ``params``, with its shape (derived ones included)."""
    c = config
    h, i = c.hidden_size, c.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {"embed.weight": (c.vocab_size, h)}
    if c.position_type == "learned":
        shapes["pos_embed.weight"] = (c.max_position_embeddings, h)
    else:
        shapes[ROPE_PARAM] = (c.max_position_embeddings, c.head_dim)
        if c.rope_local_theta is not None:
            shapes[LOCAL_ROPE_PARAM] = (c.max_position_embeddings, c.head_dim)
    layer_norm = c.norm_type == "layer"
    norms = ("attn_norm", "post_attn_norm", "mlp_norm", "post_mlp_norm") if c.sandwich_norms else ("attn_norm", "mlp_norm")
    for n in range(c.num_layers):
        p = f"layers.{n}."
        for norm in norms:
            shapes[p + norm + ".weight"] = (h,)
            if layer_norm:
                shapes[p + norm + ".bias"] = (h,)
        shapes[p + "q.weight"] = (c.q_size, h)
        shapes[p + "k.weight"] = (c.kv_size, h)
        shapes[p + "v.weight"] = (c.kv_size, h)
        if c.qkv_bias:
            shapes[p + "q.bias"] = (c.q_size,)
            shapes[p + "k.bias"] = (c.kv_size,)
            shapes[p + "v.bias"] = (c.kv_size,)
        if c.qk_norm:
            shapes[p + "q_norm.weight"] = (c.head_dim,)
            shapes[p + "k_norm.weight"] = (c.head_dim,)
        shapes[p + "o.weight"] = (h, c.q_size)
        if c.o_bias:
            shapes[p + "o.bias"] = (h,)
        if n in c.moe_layers:
            # the experts stacked, as transformers holds them: each expert's gate rows, then its
            # up rows; the loader stacks a checkpoint's per-expert tensors (weights.py)
            shapes[p + "router.weight"] = (c.num_experts, h)
            shapes[p + "experts.gate_up.weight"] = (c.num_experts, 2 * c.moe_intermediate_size, h)
            shapes[p + "experts.down.weight"] = (c.num_experts, h, c.moe_intermediate_size)
        elif c.mlp_type in ("silu_glu", "gelu_tanh_glu"):
            shapes[p + "gate.weight"] = (i, h)
            shapes[p + "up.weight"] = (i, h)
            shapes[p + "down.weight"] = (h, i)
        else:
            shapes[p + "fc.weight"] = (i, h)
            shapes[p + "fc.bias"] = (i,)
            shapes[p + "proj.weight"] = (h, i)
            shapes[p + "proj.bias"] = (h,)
    shapes["final_norm.weight"] = (h,)
    if layer_norm:
        shapes["final_norm.bias"] = (h,)
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, h)
    return shapes


def derived_params(config: ModelConfig, device: torch.device | str) -> dict[str, Tensor]:
    """Params computed from the config rather than read from a checkpoint (kept in float32)."""
    if config.position_type != "rope":
        return {}
    c = config
    tables = {ROPE_PARAM: ops.rope_cos_sin(c.head_dim, c.max_position_embeddings, c.rope_theta, c.rope_scaling)}
    if c.rope_local_theta is not None:
        tables[LOCAL_ROPE_PARAM] = ops.rope_cos_sin(c.head_dim, c.max_position_embeddings, c.rope_local_theta)
    return {name: table.to(device) for name, table in tables.items()}


def is_derived(name: str) -> bool:
    """True for a param ``derived_params`` computes (the RoPE tables, kept in float32)."""
    return name in (ROPE_PARAM, LOCAL_ROPE_PARAM)


def kv_cache_shape(config: ModelConfig, num_blocks: int, block_size: int) -> tuple[int, ...]:
    return (config.num_layers, 2, num_blocks, block_size, config.num_kv_heads, config.head_dim)


def _norm(config: ModelConfig, params: dict[str, Tensor], name: str, x: Tensor) -> Tensor:
    if config.norm_type == "rms":
        return ops.rms_norm(x, params[name + ".weight"], config.norm_eps)
    return ops.layer_norm(x, params[name + ".weight"], params[name + ".bias"], config.norm_eps)


def _linear(params: dict[str, Tensor], name: str, x: Tensor) -> Tensor:
    return F.linear(x, params[name + ".weight"], params.get(name + ".bias"))


def _attention(
    config: ModelConfig,
    params: dict[str, Tensor],
    layer: int,
    x: Tensor,
    batch: PackedBatch,
    kv_cache: Tensor,
) -> Tensor:
    c = config
    p = f"layers.{layer}."
    T = x.shape[0]
    q = _linear(params, p + "q", x).view(T, c.num_heads, c.head_dim)
    k = _linear(params, p + "k", x).view(T, c.num_kv_heads, c.head_dim)
    v = _linear(params, p + "v", x).view(T, c.num_kv_heads, c.head_dim)
    if c.qk_norm:
        q = ops.rms_norm(q, params[p + "q_norm.weight"], c.norm_eps)
        k = ops.rms_norm(k, params[p + "k_norm.weight"], c.norm_eps)
    window = c.layer_window(layer)
    if c.position_type == "rope":
        table = LOCAL_ROPE_PARAM if window and c.rope_local_theta is not None else ROPE_PARAM
        q, k = ops.rotary_embedding(q, k, batch.positions, params[table])
    # a sliding window and soft-capping are the op's trailing arguments, left out where unused
    # so that the other families' graphs are what they were
    variant = (window, c.attn_softcap or 0.0) if window or c.attn_softcap else ()
    out = ops.paged_attention(
        q,
        k,
        v,
        kv_cache[layer],
        batch.slot_mapping,
        batch.query_start_loc,
        batch.seq_lens,
        batch.block_tables,
        c.attn_scale,
        *variant,
    )
    return _linear(params, p + "o", out.view(T, c.q_size))


def _moe(config: ModelConfig, params: dict[str, Tensor], layer: int, x: Tensor) -> Tensor:
    """A mixture of SwiGLU experts, written plainly: the router's softmax (float32) over the
    experts, the top num_experts_per_tok of it (renormalised over them when norm_topk_prob) as
    a [T, experts] weight that is 0 for the others, every expert on every token (batched over
    the stacked weights), and each expert's output times its weight, summed in float32. Exact,
    but it reads all experts; the fuse_moe pass makes it one op whose kernels read only the
    chosen ones."""
    c = config
    p = f"layers.{layer}."
    probs = F.linear(x, params[p + "router.weight"]).float().softmax(dim=-1)
    top, chosen = probs.topk(c.num_experts_per_tok, dim=-1)
    if c.norm_topk_prob:
        top = top / top.sum(dim=-1, keepdim=True)
    weights = torch.zeros_like(probs).scatter(1, chosen, top).to(x.dtype)  # [T, E]
    gate, up = torch.matmul(x, params[p + "experts.gate_up.weight"].transpose(1, 2)).chunk(2, dim=-1)
    experts = torch.matmul(F.silu(gate) * up, params[p + "experts.down.weight"].transpose(1, 2))  # [E, T, H]
    return (experts * weights.t().unsqueeze(-1)).float().sum(0).to(x.dtype)


def _mlp(config: ModelConfig, params: dict[str, Tensor], layer: int, x: Tensor) -> Tensor:
    p = f"layers.{layer}."
    if layer in config.moe_layers:
        return _moe(config, params, layer, x)
    if config.mlp_type == "silu_glu":
        gate = _linear(params, p + "gate", x)
        up = _linear(params, p + "up", x)
        return _linear(params, p + "down", F.silu(gate) * up)
    if config.mlp_type == "gelu_tanh_glu":  # Gemma's GeGLU
        gate = _linear(params, p + "gate", x)
        up = _linear(params, p + "up", x)
        return _linear(params, p + "down", F.gelu(gate, approximate="tanh") * up)
    return _linear(params, p + "proj", F.gelu(_linear(params, p + "fc", x), approximate="tanh"))


def forward(
    config: ModelConfig,
    params: dict[str, Tensor],
    batch: PackedBatch,
    kv_cache: Tensor,
    logits_rows: Tensor | None = None,
) -> Tensor:
    """Logits [S, vocab] of the last scheduled token of each sequence, or [len(logits_rows),
    vocab] of the token rows ``logits_rows``; writes the batch's keys/values into kv_cache."""
    c = config
    h = F.embedding(batch.token_ids, params["embed.weight"])
    if c.embed_scale:
        h = h * ops.round_to_dtype(c.hidden_size ** 0.5, h.dtype)
    if c.position_type == "learned":
        h = h + F.embedding(batch.positions, params["pos_embed.weight"])
    for layer in range(c.num_layers):
        p = f"layers.{layer}."
        attn = _attention(c, params, layer, _norm(c, params, p + "attn_norm", h), batch, kv_cache)
        if c.sandwich_norms:
            attn = _norm(c, params, p + "post_attn_norm", attn)
        h = h + attn
        mlp = _mlp(c, params, layer, _norm(c, params, p + "mlp_norm", h))
        if c.sandwich_norms:
            mlp = _norm(c, params, p + "post_mlp_norm", mlp)
        h = h + mlp
    rows = batch.query_start_loc[1:] - 1 if logits_rows is None else logits_rows
    h = _norm(c, params, "final_norm", h.index_select(0, rows))
    lm_head = params["embed.weight"] if c.tie_word_embeddings else params["lm_head.weight"]
    return ops.soft_cap(F.linear(h, lm_head), c.final_softcap or 0.0)


class SpecProgram:
    """``forward`` as the runtime runs a program, eagerly: ``program(params, batch, kv_cache)``,
    and ``program.logits_of_rows(params, batch, kv_cache, rows)``."""

    def __init__(self, config: ModelConfig):
        self.config = config

    def __call__(self, params: dict[str, Tensor], batch: PackedBatch, kv_cache: Tensor) -> Tensor:
        return forward(self.config, params, batch, kv_cache)

    def logits_of_rows(self, params: dict[str, Tensor], batch: PackedBatch, kv_cache: Tensor, rows: Tensor) -> Tensor:
        return forward(self.config, params, batch, kv_cache, logits_rows=rows)


class SpecModule(torch.nn.Module):
    """``forward`` as an nn.Module for torch.export: params and batch tensors are all inputs,
    so the exported program holds no weights."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config

    def forward(self, params, token_ids, positions, query_start_loc, seq_lens, block_tables, slot_mapping, kv_cache):
        batch = PackedBatch(token_ids, positions, query_start_loc, seq_lens, block_tables, slot_mapping)
        return forward(self.config, params, batch, kv_cache)
