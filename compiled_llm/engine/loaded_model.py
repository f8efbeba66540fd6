"""LoadedModel: what the runtime runs, from a built engine or (``enforce_eager``) from a model
source run through the eager spec."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable

import torch

from compiled_llm.engine.build_config import BuildConfig
from compiled_llm.model.config import ModelConfig
from compiled_llm.model.tokenizer import Tokenizer


@dataclasses.dataclass
class LoadedModel:
    name: str
    config: ModelConfig
    params: dict[str, torch.Tensor]  # an engine's post-pass names, on ``device``
    program: Callable  # program(params, batch: PackedBatch, kv_cache) -> logits[S, V]
    tokenizer: Tokenizer | None
    eos_token_ids: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    manifest: dict | None = None  # engines only
    engine_dir: Path | None = None  # engines only
    source_dir: Path | None = None  # the checkpoint directory, when it is on this machine
    # SamplingParams field -> default, from the checkpoint's generation_config.json (an engine
    # carries them in its manifest); what ``LLM.get_default_sampling_params`` applies
    generation_defaults: dict[str, int | float] = dataclasses.field(default_factory=dict)
    load_stages: dict[str, float] = dataclasses.field(default_factory=dict)  # seconds, in load order
    # a tensor-parallel engine's rank this process loaded, of how many; ``config`` is that rank's
    tp_rank: int = 0
    tp_size: int = 1
    # a pipelined engine's stage this process runs, of how many, and how many layers its KV
    # cache holds (None: all of them)
    pp_rank: int = 0
    pp_size: int = 1
    kv_layers: int | None = None
    load_s: float = 0.0

    @property
    def world_size(self) -> int:
        """Processes the engine runs on: one per (pipeline stage, tensor-parallel rank)."""
        return self.tp_size * self.pp_size

    @property
    def is_engine(self) -> bool:
        return self.manifest is not None

    @property
    def max_model_len(self) -> int | None:
        """An engine's build-time limit (None for a model source)."""
        build = self.build_config
        return None if build is None else build.max_model_len

    @property
    def build_config(self) -> BuildConfig | None:
        """The config an engine was built with (None for a model source)."""
        return None if self.manifest is None else BuildConfig.from_manifest(self.manifest["build_options"])
