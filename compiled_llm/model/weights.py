"""Checkpoint weights (safetensors, single file or sharded) mapped onto the spec's params.

Tensors are read one at a time with ``safe_open``, reshaped, cast and moved to the target
device before the next is read, so a checkpoint never sits in memory twice.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Callable, Iterator

import torch
from safetensors import safe_open
from torch import Tensor

from compiled_llm.errors import WeightLoadError
from compiled_llm.model.spec import derived_params, param_shapes
from compiled_llm.model.config import ModelConfig

# A mapping rule: HF tensor -> list of (spec name, tensor) pairs.
Mapper = Callable[[Tensor], list[tuple[str, Tensor]]]

_LLAMA_RULES: list[tuple[str, str]] = [
    (r"model\.embed_tokens\.weight", "embed.weight"),
    (r"model\.norm\.weight", "final_norm.weight"),
    (r"lm_head\.weight", "lm_head.weight"),
    (r"model\.layers\.(\d+)\.input_layernorm\.weight", "layers.{0}.attn_norm.weight"),
    (r"model\.layers\.(\d+)\.post_attention_layernorm\.weight", "layers.{0}.mlp_norm.weight"),
    (r"model\.layers\.(\d+)\.self_attn\.(q|k|v|o)_proj\.(weight|bias)", "layers.{0}.{1}.{2}"),
    (r"model\.layers\.(\d+)\.self_attn\.(q|k)_norm\.weight", "layers.{0}.{1}_norm.weight"),
    (r"model\.layers\.(\d+)\.mlp\.(gate|up|down)_proj\.weight", "layers.{0}.{1}.weight"),
]

# GPT-2 stores its linears as Conv1D ([in, out]) and q/k/v fused in c_attn.
_GPT2_RULES: list[tuple[str, str]] = [
    (r"wte\.weight", "embed.weight"),
    (r"wpe\.weight", "pos_embed.weight"),
    (r"ln_f\.(weight|bias)", "final_norm.{0}"),
    (r"h\.(\d+)\.ln_1\.(weight|bias)", "layers.{0}.attn_norm.{1}"),
    (r"h\.(\d+)\.ln_2\.(weight|bias)", "layers.{0}.mlp_norm.{1}"),
    (r"h\.(\d+)\.attn\.c_attn\.(weight|bias)", "layers.{0}.qkv.{1}"),
    (r"h\.(\d+)\.attn\.c_proj\.(weight|bias)", "layers.{0}.o.{1}"),
    (r"h\.(\d+)\.mlp\.c_fc\.(weight|bias)", "layers.{0}.fc.{1}"),
    (r"h\.(\d+)\.mlp\.c_proj\.(weight|bias)", "layers.{0}.proj.{1}"),
]
# Buffers some GPT-2 checkpoints carry that are not weights.
_GPT2_IGNORED = re.compile(r"h\.\d+\.attn\.(bias|masked_bias)")


def _spec_name(config: ModelConfig, hf_name: str) -> str | None:
    if config.architecture == "GPT2LMHeadModel":
        name = hf_name.removeprefix("transformer.")
        if name == "lm_head.weight" or _GPT2_IGNORED.fullmatch(name):
            return None
        rules = _GPT2_RULES
    else:
        name = hf_name
        if name == "lm_head.weight" and config.tie_word_embeddings:
            return None  # tied: the embedding serves as lm_head
        rules = _LLAMA_RULES
    for pattern, template in rules:
        m = re.fullmatch(pattern, name)
        if m:
            return template.format(*m.groups())
    return ""


# Spec name -> checkpoint name, for error messages about tensors the checkpoint lacks.
_LLAMA_HF_NAMES: list[tuple[str, str]] = [
    (r"embed\.weight", "model.embed_tokens.weight"),
    (r"final_norm\.weight", "model.norm.weight"),
    (r"lm_head\.weight", "lm_head.weight"),
    (r"layers\.(\d+)\.attn_norm\.weight", "model.layers.{0}.input_layernorm.weight"),
    (r"layers\.(\d+)\.mlp_norm\.weight", "model.layers.{0}.post_attention_layernorm.weight"),
    (r"layers\.(\d+)\.(q|k|v|o)\.(weight|bias)", "model.layers.{0}.self_attn.{1}_proj.{2}"),
    (r"layers\.(\d+)\.(q|k)_norm\.weight", "model.layers.{0}.self_attn.{1}_norm.weight"),
    (r"layers\.(\d+)\.(gate|up|down)\.weight", "model.layers.{0}.mlp.{1}_proj.weight"),
]
_GPT2_HF_NAMES: list[tuple[str, str]] = [
    (r"embed\.weight", "transformer.wte.weight"),
    (r"pos_embed\.weight", "transformer.wpe.weight"),
    (r"final_norm\.(weight|bias)", "transformer.ln_f.{0}"),
    (r"layers\.(\d+)\.attn_norm\.(weight|bias)", "transformer.h.{0}.ln_1.{1}"),
    (r"layers\.(\d+)\.mlp_norm\.(weight|bias)", "transformer.h.{0}.ln_2.{1}"),
    (r"layers\.(\d+)\.(?:q|k|v)\.(weight|bias)", "transformer.h.{0}.attn.c_attn.{1}"),
    (r"layers\.(\d+)\.o\.(weight|bias)", "transformer.h.{0}.attn.c_proj.{1}"),
    (r"layers\.(\d+)\.fc\.(weight|bias)", "transformer.h.{0}.mlp.c_fc.{1}"),
    (r"layers\.(\d+)\.proj\.(weight|bias)", "transformer.h.{0}.mlp.c_proj.{1}"),
]


def checkpoint_name(config: ModelConfig, spec_name: str) -> str:
    """The checkpoint tensor that holds spec param ``spec_name`` (the spec name if none does)."""
    rules = _GPT2_HF_NAMES if config.architecture == "GPT2LMHeadModel" else _LLAMA_HF_NAMES
    for pattern, template in rules:
        m = re.fullmatch(pattern, spec_name)
        if m:
            return template.format(*m.groups())
    return spec_name


def _convert(config: ModelConfig, spec_name: str, t: Tensor) -> list[tuple[str, Tensor]]:
    """HF layout -> spec layout for one tensor."""
    if config.architecture != "GPT2LMHeadModel":
        return [(spec_name, t)]
    is_linear_weight = spec_name.endswith(".weight") and any(
        f".{n}." in spec_name for n in ("qkv", "o", "fc", "proj")
    )
    if is_linear_weight:
        t = t.t()  # Conv1D [in, out] -> linear [out, in]
    if ".qkv." in spec_name:
        h = config.hidden_size
        if t.shape[0] != 3 * h:
            raise WeightLoadError(
                f"tensor for {spec_name} has shape {tuple(t.shape)}; expected first dim {3 * h}"
            )
        return [(spec_name.replace(".qkv.", f".{n}."), part) for n, part in zip("qkv", t.split(h, dim=0))]
    return [(spec_name, t)]


def checkpoint_files(model_dir: Path) -> list[Path]:
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise WeightLoadError(f"{index} is not a valid safetensors index: {e}") from None
        files = sorted({model_dir / f for f in weight_map.values()})
        for f in files:
            if not f.is_file():
                raise WeightLoadError(f"shard {f.name} listed in {index.name} is missing from {model_dir}")
        return files
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    raise WeightLoadError(f"no model.safetensors or model.safetensors.index.json in {model_dir}")


def _iter_checkpoint(files: list[Path]) -> Iterator[tuple[Path, str, Tensor]]:
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as sf:
                for key in sf.keys():
                    yield f, key, sf.get_tensor(key)
        except Exception as e:  # safetensors raises its own error types for corrupt headers
            if isinstance(e, WeightLoadError):
                raise
            raise WeightLoadError(f"cannot read {f}: {e}") from None


def _all_finite(t: Tensor) -> bool:
    """True when ``t`` has no NaN or Inf. One pass, no tensor-sized temporary: ``aminmax``
    propagates NaN, and a +/-Inf shows up as the max/min; a single sync reads both back."""
    if t.numel() == 0 or not t.is_floating_point():
        return True
    return bool(torch.isfinite(torch.stack(torch.aminmax(t))).all())


def _non_finite_error(file: Path, hf_name: str, stored: Tensor, loaded: Tensor) -> WeightLoadError:
    """The error for checkpoint tensor ``hf_name`` whose loaded copy ``loaded`` is not finite
    (only built on failure, so counting the bad values costs nothing in a good build)."""
    if _all_finite(stored):  # finite in the file: the cast to the load dtype overflowed
        peak = stored.detach().abs().max().item()
        wider = "float32" if loaded.dtype == torch.bfloat16 else "bfloat16 or float32"
        return WeightLoadError(
            f"tensor {hf_name!r} in {file} overflows {str(loaded.dtype).removeprefix('torch.')} "
            f"(largest magnitude {peak:.3g}); load it with dtype {wider}"
        )
    nan = int(torch.isnan(stored).sum())
    inf = int(torch.isinf(stored).sum())
    what = " and ".join(f"{n} {kind} value{'s' if n > 1 else ''}" for n, kind in ((nan, "NaN"), (inf, "Inf")) if n)
    return WeightLoadError(
        f"tensor {hf_name!r} in {file} has {what} (of {stored.numel()} elements); weights must be finite"
    )


def load_params(
    config: ModelConfig,
    model_dir: Path,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> dict[str, Tensor]:
    """Read a checkpoint's weights into the spec's params (plus derived ones such as the RoPE
    table). Fails naming the tensor on a missing, unexpected, misshapen or non-finite (NaN/Inf,
    in the file or after the cast to ``dtype``) one; every path that loads a checkpoint (build,
    eager ``LLM``/``run --eager``, ``compare``) comes through here."""
    expected = param_shapes(config)
    params: dict[str, Tensor] = {}
    for file, hf_name, tensor in _iter_checkpoint(checkpoint_files(model_dir)):
        spec_name = _spec_name(config, hf_name)
        if spec_name is None:
            continue
        if spec_name == "" or (spec_name not in expected and ".qkv." not in spec_name):
            raise WeightLoadError(f"unexpected tensor {hf_name!r} in checkpoint (no place for it in {config.architecture})")
        for name, t in _convert(config, spec_name, tensor):
            if name not in expected:
                raise WeightLoadError(f"unexpected tensor {hf_name!r} in checkpoint (no place for it in {config.architecture})")
            if tuple(t.shape) != expected[name]:
                raise WeightLoadError(
                    f"tensor {hf_name!r} has shape {tuple(tensor.shape)}; {config.architecture} with this config expects {expected[name]} for {name}"
                )
            loaded = t.to(device=device, dtype=dtype).contiguous()
            if not _all_finite(loaded):  # checked on the target device, after the cast
                raise _non_finite_error(file, hf_name, tensor, loaded)
            params[name] = loaded
        del tensor
    params.update(derived_params(config, device))
    missing = [n for n in expected if n not in params]
    if missing:
        raise WeightLoadError(
            f"checkpoint in {model_dir} is missing tensor {checkpoint_name(config, missing[0])!r}"
            + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
        )
    return params


def random_params(
    config: ModelConfig,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    seed: int = 0,
) -> dict[str, Tensor]:
    """Random weights at the config's shapes (presets and benchmarks). Norm weights are near 1
    and linears have std 0.02, as transformers initialises them, so activations stay sane."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    params: dict[str, Tensor] = {}
    derived = derived_params(config, device)
    for name, shape in param_shapes(config).items():
        if name in derived:
            continue
        if "norm" in name and name.endswith(".weight"):
            t = 1.0 + 0.02 * torch.randn(shape, generator=gen)
        elif name.endswith(".bias"):
            t = 0.02 * torch.randn(shape, generator=gen)
        else:
            t = 0.02 * torch.randn(shape, generator=gen)
        params[name] = t.to(device=device, dtype=dtype)
    params.update(derived)
    return params
