"""Checkpoint weights (safetensors, single file or sharded) mapped onto the spec's params, by
the rules of the checkpoint's family (``model/families/``).

Tensors are read one at a time with ``safe_open``, reshaped, cast and moved to the target
device before the next is read, so a checkpoint never sits in memory twice. A mixture's experts,
one tensor per expert and projection in a checkpoint, are copied into the spec's stacked weights
(``layers.N.experts.gate_up.weight`` [E, 2I, H], ``layers.N.experts.down.weight`` [E, H, I]) as
they come.
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
from compiled_llm.model.config import ModelConfig
from compiled_llm.model.families import family_of
from compiled_llm.model.families.base import Family, layer_projection
from compiled_llm.model.spec import derived_params, param_shapes


def _spec_name(family: Family, config: ModelConfig, hf_name: str) -> str | None:
    """The spec param checkpoint tensor ``hf_name`` holds: None for one to skip, "" for one
    with no place in the spec."""
    name = family.spec_name(hf_name)
    if name == "lm_head.weight" and config.tie_word_embeddings:
        return None  # tied: the embedding serves as lm_head
    return name


def checkpoint_name(config: ModelConfig, spec_name: str) -> str:
    """The checkpoint tensor that holds spec param ``spec_name`` (the spec name if none does)."""
    return family_of(config.architecture).checkpoint_name(spec_name)


def _to_spec_layout(
    family: Family, expected: dict[str, tuple[int, ...]], spec_name: str, t: Tensor
) -> list[tuple[str, Tensor]]:
    """A checkpoint tensor in the spec's layout: [out, in] linears, fused ones split into their
    parts by the rows the spec gives each."""
    projection = layer_projection(spec_name)
    if projection in family.transposed and spec_name.endswith(".weight"):
        t = t.t()  # stored [in, out] (GPT-2's Conv1D) -> linear [out, in]
    names = family.spec_params(spec_name)
    if names == (spec_name,):
        return [(spec_name, t)]
    rows = [expected[n][0] for n in names]
    if t.shape[0] != sum(rows):
        raise WeightLoadError(
            f"tensor for {spec_name} has shape {tuple(t.shape)}; expected first dim {sum(rows)}"
        )
    return list(zip(names, t.split(rows, dim=0)))


# the per-expert name a family maps a checkpoint's expert tensor to
_EXPERT = re.compile(r"(?P<layer>layers\.\d+)\.experts\.(?P<expert>\d+)\.(?P<proj>gate|up|down)\.weight")
# the spec's stacked experts of a layer
_STACKED = re.compile(r"(?P<layer>layers\.\d+)\.experts\.(?P<stack>gate_up|down)\.weight")


def expert_slot(spec_name: str, shapes: dict[str, tuple[int, ...]]) -> tuple[str, int, str, tuple[int, ...]] | None:
    """(stacked param, expert, projection, the one expert's shape) of a per-expert name such as
    ``layers.3.experts.7.up.weight``, when ``shapes`` (the spec's) has that expert; else None."""
    m = _EXPERT.fullmatch(spec_name)
    if m is None:
        return None
    proj, expert = m.group("proj"), int(m.group("expert"))
    stacked = f"{m.group('layer')}.experts.{'down' if proj == 'down' else 'gate_up'}.weight"
    shape = shapes.get(stacked)
    if shape is None or expert >= shape[0]:
        return None
    return stacked, expert, proj, tuple(shape[1:]) if proj == "down" else (shape[1] // 2, shape[2])


def expert_rows(expert: int, proj: str, rows: int) -> tuple:
    """The index of one expert's projection in its stacked weight: gate rows first, then up."""
    start = rows if proj == "up" else 0
    return expert, slice(start, start + rows)


class _ExpertStacks:
    """The stacked expert weights being filled, one checkpoint tensor at a time, and which slots
    are filled."""

    def __init__(self, expected: dict[str, tuple[int, ...]], dtype, device):
        self.expected, self.dtype, self.device = expected, dtype, device
        self.stacks: dict[str, Tensor] = {}
        self.filled: set[tuple[str, int, str]] = set()

    def put(self, stacked: str, expert: int, proj: str, t: Tensor) -> None:
        if stacked not in self.stacks:
            self.stacks[stacked] = torch.empty(self.expected[stacked], dtype=self.dtype, device=self.device)
        self.stacks[stacked][expert_rows(expert, proj, t.shape[0])].copy_(t)
        self.filled.add((stacked, expert, proj))

    def first_missing(self) -> str | None:
        """The spec's per-expert name of the first slot no checkpoint tensor filled."""
        for name, shape in self.expected.items():
            m = _STACKED.fullmatch(name)
            if m is None:
                continue
            for expert in range(shape[0]):
                for proj in ("down",) if m.group("stack") == "down" else ("gate", "up"):
                    if (name, expert, proj) not in self.filled:
                        return f"{m.group('layer')}.experts.{expert}.{proj}.weight"
        return None


def _is_norm_weight(spec_name: str) -> bool:
    """A norm's scale (``layers.3.post_attn_norm.weight``, ``final_norm.weight``)."""
    parts = spec_name.split(".")
    return len(parts) >= 2 and parts[-1] == "weight" and parts[-2].endswith("norm")


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


def _loaded(file: Path, hf_name: str, stored: Tensor, t: Tensor, dtype, device) -> Tensor:
    """``t`` (checkpoint tensor ``stored`` in the spec's layout) cast and moved, refused when not
    finite: checked on the target device, after the cast."""
    loaded = t.to(device=device, dtype=dtype).contiguous()
    if not _all_finite(loaded):
        raise _non_finite_error(file, hf_name, stored, loaded)
    return loaded


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
    family = family_of(config.architecture)
    expected = param_shapes(config)
    params: dict[str, Tensor] = {}
    experts = _ExpertStacks(expected, dtype, device)
    for file, hf_name, tensor in _iter_checkpoint(checkpoint_files(model_dir)):
        spec_name = _spec_name(family, config, hf_name)
        if spec_name is None:
            continue
        slot = expert_slot(spec_name, expected)
        if slot is not None:
            stacked, expert, proj, shape = slot
            if tuple(tensor.shape) != shape:
                raise WeightLoadError(f"tensor {hf_name!r} has shape {tuple(tensor.shape)}; {config.architecture} "
                                      f"with this config expects {shape} for {spec_name}")
            experts.put(stacked, expert, proj, _loaded(file, hf_name, tensor, tensor, dtype, device))
            del tensor
            continue
        if spec_name == "" or any(n not in expected for n in family.spec_params(spec_name)):
            raise WeightLoadError(f"unexpected tensor {hf_name!r} in checkpoint (no place for it in {config.architecture})")
        for name, t in _to_spec_layout(family, expected, spec_name, tensor):
            if tuple(t.shape) != expected[name]:
                raise WeightLoadError(
                    f"tensor {hf_name!r} has shape {tuple(tensor.shape)}; {config.architecture} with this config expects {expected[name]} for {name}"
                )
            if family.norm_offset and _is_norm_weight(name):
                t = t.float() + family.norm_offset  # added in float32, as transformers does, then cast
            params[name] = _loaded(file, hf_name, tensor, t, dtype, device)
        del tensor
    params.update(derived_params(config, device))
    missing_expert = experts.first_missing()
    if missing_expert is not None:
        raise WeightLoadError(f"checkpoint in {model_dir} is missing tensor {checkpoint_name(config, missing_expert)!r}")
    params.update(experts.stacks)
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
    uninitialised: Callable[[str, tuple[int, ...]], bool] | None = None,
) -> dict[str, Tensor]:
    """Random weights at the config's shapes (presets and benchmarks). Norm weights are near 1
    and linears have std 0.02, as transformers initialises them, so activations stay sane. The
    params ``uninitialised(name, shape)`` picks are left as uninitialised memory (a dummy
    engine's matrices, which its build never reads)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    params: dict[str, Tensor] = {}
    derived = derived_params(config, device)
    for name, shape in param_shapes(config).items():
        if name in derived:
            continue
        if uninitialised is not None and uninitialised(name, shape):
            params[name] = torch.empty(shape, dtype=dtype, device=device)
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
