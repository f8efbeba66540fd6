"""Where a model runs and in which dtype: the one resolver of ``--device`` and ``--dtype`` for
builds, the engine cache, the runtime and the CLI.

``auto`` follows vLLM: the device is cuda when torch sees a GPU, else cpu; the dtype is float32
on a CPU and, on a GPU, the checkpoint's own float16/bfloat16 (bfloat16 when it is float32 or
does not say).
"""

from __future__ import annotations

import json

import torch

from compiled_llm.errors import CompiledLLMError
from compiled_llm.model.presets import preset_hf_config
from compiled_llm.model.sources import ModelSource, resolve_source

DTYPES = {
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16,
}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise CompiledLLMError(f"unsupported dtype {name!r}; choose from float32, bfloat16, float16")
    return DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parse_device(name: str) -> torch.device:
    try:
        device = torch.device(name)
    except RuntimeError:
        raise CompiledLLMError(f"unknown device {name!r}; use cpu or cuda") from None
    if device.type not in ("cpu", "cuda"):
        raise CompiledLLMError(f"unsupported device {name!r}; use cpu or cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise CompiledLLMError("device cuda was asked for but no CUDA GPU is available to torch")
    return device


def resolve_device(name: str | torch.device | None = "auto") -> torch.device:
    """``"auto"`` (or None): cuda when ``torch.cuda.is_available()``, else cpu (as vLLM)."""
    if name is None or name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return parse_device(str(name))


def checkpoint_dtype(hf_config: dict) -> str | None:
    """The dtype a checkpoint's config.json says its weights are in (``dtype`` in newer
    transformers, ``torch_dtype`` in older ones), e.g. "bfloat16"; None when it says nothing."""
    value = hf_config.get("dtype") or hf_config.get("torch_dtype")
    return str(value).removeprefix("torch.") if value else None


def source_checkpoint_dtype(source) -> str | None:
    """``checkpoint_dtype`` of a model source (a ModelSource or a SOURCE string): its
    config.json, or for a preset the HF config the preset stands for."""
    src = source if isinstance(source, ModelSource) else resolve_source(str(source))
    if src.preset is not None:
        return checkpoint_dtype(preset_hf_config(src.preset))
    path = src.model_dir / "config.json"
    try:
        return checkpoint_dtype(json.loads(path.read_text()))
    except (OSError, ValueError, AttributeError):
        return None


def auto_dtype(device_type: str, ckpt_dtype: str | torch.dtype | None) -> torch.dtype:
    """vLLM's ``--dtype auto``: on a GPU the checkpoint's own float16/bfloat16, and bfloat16
    when the checkpoint is float32 or does not say; on a CPU always float32."""
    if device_type != "cuda":
        return torch.float32
    if isinstance(ckpt_dtype, torch.dtype):
        ckpt_dtype = dtype_name(ckpt_dtype)
    return torch.float16 if ckpt_dtype in ("float16", "fp16", "half") else torch.bfloat16


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device | str, source=None) -> torch.dtype:
    """The one place ``dtype`` is resolved for a build or a run: an explicit dtype is parsed;
    ``"auto"`` (or None) is ``auto_dtype`` for ``device`` and the dtype ``source`` (ModelSource or
    SOURCE string; read only on a GPU) was saved in."""
    if dtype is None or dtype == "auto":
        device_type = torch.device(device).type
        ckpt = source_checkpoint_dtype(source) if device_type == "cuda" and source is not None else None
        return auto_dtype(device_type, ckpt)
    return parse_dtype(dtype)
