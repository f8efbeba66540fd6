"""The ``cllm::`` ops and how one is defined, from its reference implementation.

An op is defined once, by ``cllm_op(name, reference)``: the reference is plain torch that runs on
any device, and its annotated signature *is* the op's schema (inferred by
``torch.library.infer_schema``; it is written nowhere else). The op's fake (what tracing sees) is
the reference itself run on fake tensors unless the op names a cheaper one, as the spec's ops
do. ``OPS`` keeps every definition (``OpDef``); kernel providers are made from it
(``OpDef.define``, through ``kernels/registry.register_kernel``), so a provider op has the op's
exact schema and fake.

The ops are opaque to torch.export and FX: the exported graph names them, fusion passes match
them, and kernel providers replace them. The spec's ops are here; the fused ones the passes
rewrite it into are in fused_ops.py; the sampler's ops (``greedy_sample``,
``temperature_sample``, and ``apply_token_bitmask`` for grammar-constrained decoding) are the
ones the runtime calls on the logits, outside any graph.

Numerics follow Hugging Face: norms and softmax accumulate in float32 and cast back.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import struct
from typing import Callable, Optional

import torch
from torch import Tensor

# ---------------------------------------------------------------------------------------------
# Pure reference functions (also used by fused ops' references and by kernel tests)
# ---------------------------------------------------------------------------------------------


def rms_norm_ref(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def layer_norm_ref(x: Tensor, weight: Tensor, bias: Tensor, eps: float) -> Tensor:
    y = torch.nn.functional.layer_norm(x.float(), (x.shape[-1],), weight.float(), bias.float(), eps)
    return y.to(x.dtype)


def rotary_ref(x: Tensor, positions: Tensor, cos_sin: Tensor) -> Tensor:
    """Neox-style rotation (rotate halves) of x[T, H, D] at positions[T]; cos_sin[P, D] holds
    cos in its first half and sin in its second."""
    half = x.shape[-1] // 2
    cs = cos_sin.index_select(0, positions).unsqueeze(1)  # [T, 1, D]
    cos, sin = cs[..., :half], cs[..., half:]
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def rotary_embedding_ref(q: Tensor, k: Tensor, positions: Tensor, cos_sin: Tensor) -> tuple[Tensor, Tensor]:
    return rotary_ref(q, positions, cos_sin), rotary_ref(k, positions, cos_sin)


def kv_store_ref(k: Tensor, v: Tensor, kv_cache: Tensor, slot_mapping: Tensor) -> None:
    """Write k, v [T, Hkv, D] into kv_cache [2, num_blocks, block_size, Hkv, D] at the flat
    slots; rows with slot -1 (padding) write nowhere."""
    flat = kv_cache.view(2, -1, kv_cache.shape[-2], kv_cache.shape[-1])
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    flat[0].index_copy_(0, slots, k[keep].to(kv_cache.dtype))
    flat[1].index_copy_(0, slots, v[keep].to(kv_cache.dtype))


def round_to_dtype(value: float, dtype: torch.dtype) -> float:
    """``value`` rounded to ``dtype`` (to nearest even), as a Python float: a constant that a
    traced graph multiplies by exactly as transformers' ``tensor(value).to(dtype)`` does, with
    no tensor made while tracing."""
    value32 = struct.unpack("<f", struct.pack("<f", value))[0]  # torch.tensor(value) is float32
    if dtype == torch.bfloat16:
        bits = struct.unpack("<I", struct.pack("<f", value32))[0]
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return struct.unpack("<f", struct.pack("<I", bits))[0]
    if dtype == torch.float16:
        return struct.unpack("<e", struct.pack("<e", value32))[0]
    return value32 if dtype == torch.float32 else value


def soft_cap(x: Tensor, cap: float) -> Tensor:
    """Gemma's logit soft-capping, ``cap * tanh(x / cap)``; x itself when cap is 0."""
    return x if not cap else torch.tanh(x / cap) * cap


def paged_attention_read_ref(
    q: Tensor,
    kv_cache: Tensor,
    query_start_loc: Tensor,
    seq_lens: Tensor,
    block_tables: Tensor,
    scale: float,
    sliding_window: int = 0,
    softcap: float = 0.0,
) -> Tensor:
    """Causal attention of packed queries q[T, Hq, D] over each sequence's paged context.

    Sequence s owns rows query_start_loc[s]:query_start_loc[s+1] of q; they are the last
    tokens of its context of seq_lens[s] tokens, whose keys/values sit in the blocks listed in
    block_tables[s]. Rows past query_start_loc[-1] (padding) are left zero. With a
    ``sliding_window`` w > 0, the query at position p sees only keys p - w + 1 .. p, and the
    blocks wholly before the first query's window are never read (nor their block-table
    entries: the cache may have given them back). ``softcap`` > 0 caps the scaled scores
    (``soft_cap``) before the softmax.
    """
    out = torch.zeros_like(q)
    num_heads, head_dim = q.shape[1], q.shape[2]
    block_size = kv_cache.shape[2]
    kv_heads = kv_cache.shape[3]
    group = num_heads // kv_heads
    qsl = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for s, ctx_len in enumerate(lens):
        start, end = qsl[s], qsl[s + 1]
        n_q = end - start
        if n_q == 0 or ctx_len == 0:
            continue
        first_block = max(0, ctx_len - n_q - sliding_window + 1) // block_size if sliding_window else 0
        n_blocks = (ctx_len + block_size - 1) // block_size
        blocks = block_tables[s, first_block:n_blocks].long()
        offset = first_block * block_size  # position of the first key read
        k = kv_cache[0].index_select(0, blocks).reshape(-1, kv_heads, head_dim)[:ctx_len - offset]
        v = kv_cache[1].index_select(0, blocks).reshape(-1, kv_heads, head_dim)[:ctx_len - offset]
        k = k.float().repeat_interleave(group, dim=1)  # [L, Hq, D]
        v = v.float().repeat_interleave(group, dim=1)
        qs = q[start:end].float()  # [n, Hq, D]
        scores = soft_cap(torch.einsum("nhd,lhd->hnl", qs, k) * scale, softcap)
        q_pos = torch.arange(ctx_len - n_q, ctx_len, device=q.device)
        k_pos = torch.arange(offset, ctx_len, device=q.device)
        mask = k_pos[None, :] > q_pos[:, None]
        if sliding_window:
            mask |= k_pos[None, :] <= q_pos[:, None] - sliding_window
        scores = scores.masked_fill(mask[None], float("-inf"))
        probs = scores.softmax(-1)
        out[start:end] = torch.einsum("hnl,lhd->nhd", probs, v).to(q.dtype)
    return out


def paged_attention_ref(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    kv_cache: Tensor,
    slot_mapping: Tensor,
    query_start_loc: Tensor,
    seq_lens: Tensor,
    block_tables: Tensor,
    scale: float,
    sliding_window: int = 0,
    softcap: float = 0.0,
) -> Tensor:
    """Write this step's k/v into the layer's cache, then attend (see paged_attention_read_ref)."""
    kv_store_ref(k, v, kv_cache, slot_mapping)
    return paged_attention_read_ref(q, kv_cache, query_start_loc, seq_lens, block_tables, scale, sliding_window,
                                    softcap)


def rope_cos_sin(head_dim: int, max_positions: int, theta: float, scaling=None) -> Tensor:
    """cos/sin table [max_positions, head_dim] in float32 (cos in the first half of a row, sin in
    the second), with ``scaling``'s frequency scaling when given (a ``RopeScaling``: llama3,
    yarn, linear or longrope)."""
    rope_type = scaling.rope_type if scaling is not None else None
    if rope_type == "longrope":
        return longrope_cos_sin(head_dim, max_positions, theta, scaling)
    if rope_type in ("yarn", "linear"):
        inv_freq, attention_factor = (yarn_inv_freq if rope_type == "yarn" else linear_inv_freq)(
            head_dim, theta, scaling)
        return _cos_sin(torch.arange(max_positions, dtype=torch.float32), inv_freq, attention_factor)
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling is not None:
        old_len = scaling.original_max_position_embeddings
        low_wavelen = old_len / scaling.low_freq_factor
        high_wavelen = old_len / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
        smooth = (old_len / wavelen - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = torch.where(medium, smoothed, scaled)
    inv_freq = inv_freq.float()
    t = torch.arange(max_positions, dtype=torch.float32)
    freqs = torch.outer(t, inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


def yarn_inv_freq(head_dim: int, theta: float, scaling) -> tuple[Tensor, float]:
    """YaRN's inverse frequencies [head_dim / 2] (float32) and the factor its cos/sin are
    scaled by: the dimensions that turn more than beta_fast times over the original context
    keep their frequency, those turning fewer than beta_slow times are divided by ``factor``,
    and a linear ramp joins them (float32, in transformers' order of operations, so that
    tables match to the bit)."""
    def correction_dim(rotations: float) -> float:
        return head_dim * math.log(scaling.original_max_position_embeddings / (rotations * 2 * math.pi)) / (
            2 * math.log(theta))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # a ramp of no width
    ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolated = 1 - ramp
    pos_freqs = theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    inv_freq = (1.0 / (scaling.factor * pos_freqs)) * (1 - extrapolated) + (1.0 / pos_freqs) * extrapolated
    attention_factor = scaling.attention_factor
    if attention_factor is None:
        def mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        if scaling.mscale and scaling.mscale_all_dim:
            attention_factor = mscale(scaling.factor, scaling.mscale) / mscale(scaling.factor, scaling.mscale_all_dim)
        else:
            attention_factor = mscale(scaling.factor)
    return inv_freq, float(attention_factor)


def _cos_sin(positions: Tensor, inv_freq: Tensor, attention_factor: float) -> Tensor:
    """The rows of the cos/sin table at ``positions`` (float32), scaled as transformers scales
    its cos and sin (after the cos and sin, in float32)."""
    freqs = torch.outer(positions, inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1) * attention_factor


def linear_inv_freq(head_dim: int, theta: float, scaling) -> tuple[Tensor, float]:
    """Linear scaling ("position interpolation"; Gemma 3's global layers): every frequency
    divided by ``factor``, which is dividing the positions by it; cos/sin unscaled (float32, in
    transformers' order of operations)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    return inv_freq / scaling.factor, 1.0


def longrope_inv_freq(head_dim: int, theta: float, factors) -> Tensor:
    """LongRoPE's inverse frequencies [head_dim / 2] (float32): each dimension's frequency
    divided by its own factor of ``factors`` (a short_factor or long_factor list), in
    transformers' order of operations, so that tables match to the bit."""
    if len(factors) != head_dim // 2:  # a table of the wrong width would fail far from here
        raise ValueError(f"longrope has {len(factors)} factors; a head_dim of {head_dim} needs {head_dim // 2}")
    ext_factors = torch.tensor(factors, dtype=torch.float32)
    return 1.0 / (ext_factors * theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))


def longrope_attention_factor(scaling) -> float:
    """What LongRoPE scales cos/sin by: ``attention_factor`` when given, else
    sqrt(1 + log(factor) / log(original context)) when the context is extended at all (factor
    is config.json's, or max_position_embeddings / original_max_position_embeddings, as
    ``rope_fields`` reads it), as transformers computes it."""
    if scaling.attention_factor is not None:
        return float(scaling.attention_factor)
    if scaling.factor <= 1.0:
        return 1.0
    return math.sqrt(1 + math.log(scaling.factor) / math.log(scaling.original_max_position_embeddings))


def longrope_cos_sin(head_dim: int, max_positions: int, theta: float, scaling) -> Tensor:
    """LongRoPE's table (Phi-3 128k, Phi-3.5): the positions below original_max_position_embeddings
    rotate at the short factors' frequencies, those at or beyond it at the long factors', both
    scaled by ``longrope_attention_factor``.

    This differs from transformers once a sequence outgrows the original context. transformers
    picks one set of factors for a whole forward: the long ones for every position, the first
    ones included, as soon as the forward reaches past the original context (Phi-3's generate
    even drops its KV cache at that step and recomputes the whole sequence with them). A table
    built once per position cannot do that: here a position's rotation never changes, so the
    keys of positions below the original context stay short-factor keys for the whole
    sequence, as a KV cache that keeps the keys it wrote holds them. Sequences within the
    original context match transformers; past it, the keys and queries of positions below the
    original context differ from transformers', and so may the output."""
    attention_factor = longrope_attention_factor(scaling)
    original = scaling.original_max_position_embeddings
    positions = torch.arange(max_positions, dtype=torch.float32)
    short = _cos_sin(positions[:original], longrope_inv_freq(head_dim, theta, scaling.short_factor), attention_factor)
    long = _cos_sin(positions[original:], longrope_inv_freq(head_dim, theta, scaling.long_factor), attention_factor)
    return torch.cat((short, long))


# ---------------------------------------------------------------------------------------------
# Sampling references (the runtime's sampler, serve/worker/sampler.py, calls the ops below on logits)
# ---------------------------------------------------------------------------------------------


def exponential_race(
    logits: Tensor,
    temperature: Tensor,
    truncate: Optional[Callable[[Tensor], Tensor]] = None,
    noise: Optional[Tensor] = None,
) -> Tensor:
    """Token ids [S] (int64) drawn from softmax(logits / temperature) per row, the argmax where
    the temperature is 0. Exponential race (Gumbel-max): argmax(p / E) with E ~ Exp(1) draws from
    p. ``truncate`` masks the scaled logits first (top-k/top-p); ``noise`` is E, float32 and
    shaped like the logits (default: drawn from torch's default generator)."""
    logits = logits.float()
    argmax_ids = logits.argmax(dim=-1)
    temp = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    scaled = logits / temp[:, None]
    if truncate is not None:
        scaled = truncate(scaled)
    probs = scaled.softmax(dim=-1)
    if noise is None:
        noise = torch.empty_like(probs).exponential_()
    sampled_ids = (probs / noise).argmax(dim=-1)
    return torch.where(temperature > 0, sampled_ids, argmax_ids)


def greedy_sample_ref(logits: Tensor) -> Tensor:
    """Each row's argmax [S] (int64; ties go to the lowest index)."""
    return logits.argmax(dim=-1)


def temperature_sample_ref(logits: Tensor, temperature: Tensor) -> Tensor:
    """Token ids [S] drawn from softmax(logits / temperature) per row (argmax at temperature 0)."""
    return exponential_race(logits, temperature)


def check_token_bitmask(logits: Tensor, bitmask: Tensor) -> None:
    """A clear error for a bitmask ``apply_token_bitmask`` cannot apply to ``logits``."""
    if logits.dim() != 2 or bitmask.dim() != 2 or bitmask.shape[0] != logits.shape[0]:
        raise ValueError(f"token bitmask {tuple(bitmask.shape)} does not match logits {tuple(logits.shape)}: "
                         "want [S, W] for logits [S, V]")
    if bitmask.dtype != torch.int32 or bitmask.device != logits.device:
        raise ValueError(f"token bitmask is {bitmask.dtype} on {bitmask.device}, want torch.int32 on {logits.device}")


def apply_token_bitmask_ref(logits: Tensor, bitmask: Tensor) -> None:
    """Grammar-constrained decoding, in xgrammar's bitmask layout: every logit of logits [S, V]
    whose token the row's mask disallows becomes -inf, in place. ``bitmask`` [S, W] int32: token
    v of row r is allowed iff bit v % 32 of bitmask[r, v // 32] is set. Tokens past the mask
    (v >= 32 W: a model vocabulary padded past the tokenizer's) are disallowed, so a row of all
    -1 words is left unchanged only where the mask covers the logits (W >= V / 32)."""
    check_token_bitmask(logits, bitmask)
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = ((bitmask[:, :, None] >> shifts) & 1).flatten(1)  # [S, 32 W]; & 1 undoes the sign extension
    vocab = min(bits.shape[-1], logits.shape[-1])
    allowed = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device)
    allowed[:, :vocab] = bits[:, :vocab] == 1
    logits.masked_fill_(~allowed, float("-inf"))


# ---------------------------------------------------------------------------------------------
# Defining an op
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class OpDef:
    """One ``cllm::`` op: its reference implementation (whose annotations are the schema), the
    fake tracing runs, the arguments it writes in place, and what is derived from those."""

    name: str
    reference: Callable
    fake: Callable
    mutates: tuple[str, ...]
    schema: str  # "(Tensor x, Tensor weight, float eps) -> Tensor", inferred from the reference
    params: tuple[str, ...]  # argument names, in schema order
    required: int  # how many leading arguments have no default

    @property
    def overload(self):
        """The op FX graphs call, ``torch.ops.cllm.<name>.default``."""
        return getattr(torch.ops.cllm, self.name).default

    def define(self, name: str, fn: Callable):
        """Register ``fn`` as ``cllm::<name>`` with this op's schema, mutations and fake: how the
        op itself and each kernel provider of it (``<op>__<provider>``) are made. ``fn`` is
        called with the arguments positionally, in schema order (trailing ones left at their
        defaults may be left out)."""
        torch.library.custom_op(f"cllm::{name}", fn, mutates_args=self.mutates, schema=self.schema).register_fake(
            self.fake
        )
        return getattr(torch.ops.cllm, name).default


OPS: dict[str, OpDef] = {}


def cllm_op(name: str, reference: Callable, *, mutates: tuple[str, ...] = (), fake: Callable | None = None):
    """Define ``cllm::<name>`` from its reference implementation (see the module docstring);
    returns the op's overload, which the spec calls."""
    if name in OPS:
        raise ValueError(f"cllm::{name} is defined twice")
    params = inspect.signature(reference).parameters.values()
    op = OpDef(
        name=name,
        reference=reference,
        fake=fake or reference,
        mutates=tuple(mutates),
        schema=torch.library.infer_schema(reference, mutates_args=mutates),
        params=tuple(p.name for p in params),
        required=sum(p.default is inspect.Parameter.empty for p in params),
    )
    OPS[name] = op
    return op.define(name, reference)


# ---------------------------------------------------------------------------------------------
# The cllm:: ops of the spec, and the sampler's
# ---------------------------------------------------------------------------------------------

def _like_first(x: Tensor, *_) -> Tensor:
    return torch.empty_like(x)


def _like_first_two(q: Tensor, k: Tensor, *_) -> tuple[Tensor, Tensor]:
    return torch.empty_like(q), torch.empty_like(k)


def _returns_nothing(*_) -> None:
    return None


# The spec's ops name their fakes: export runs each once per layer, and an empty tensor is much
# cheaper than the reference on fake tensors (paged attention's reference reads tensor data,
# which fake tensors do not have).
rms_norm = cllm_op("rms_norm", rms_norm_ref, fake=_like_first)
layer_norm = cllm_op("layer_norm", layer_norm_ref, fake=_like_first)
rotary_embedding = cllm_op("rotary_embedding", rotary_embedding_ref, fake=_like_first_two)
paged_attention = cllm_op("paged_attention", paged_attention_ref, mutates=("kv_cache",), fake=_like_first)
greedy_sample = cllm_op("greedy_sample", greedy_sample_ref)
temperature_sample = cllm_op("temperature_sample", temperature_sample_ref)
apply_token_bitmask = cllm_op("apply_token_bitmask", apply_token_bitmask_ref, mutates=("logits",),
                              fake=_returns_nothing)
