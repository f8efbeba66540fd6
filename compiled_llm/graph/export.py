"""Capture: torch.export of the spec into a flat FX graph, the first IR of the build.

The spec is exported with every weight as an *input* (no constants), so the program never holds
weights; they are stored once, in the artifact's safetensors. Token, sequence, block-table,
cache-block and block-size counts are dynamic. Example sizes are all >= 2 and pairwise distinct,
because a size-1 example specialises a dimension and two equal example sizes are unified into one
symbol by torch.export's duck sizing.

The flat GraphModule (``ExportedProgram.graph_module``) takes the weights first, in
``param_names`` order, then the 7 batch/cache inputs (``INPUT_NAMES``). Each weight placeholder
carries ``node.meta["cllm_param"] = <param name>`` so passes can find and replace weights.

Note on guards: export's range analysis may emit guards such as "num_seqs >= 2" for the example
sizes; the flat graph module does not check them and its ops are shape-generic, so programs run
for any size (batch-1 decode included). ``ExportedProgram.module()`` would check them; we never
call it.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor
from torch.export import Dim

from compiled_llm.model.config import ModelConfig
from compiled_llm.graph.batch import ScheduledSeq, pack_batch
from compiled_llm.model.spec import BATCH_FIELDS, PackedBatch, SpecModule, is_derived, kv_cache_shape

INPUT_NAMES = (*BATCH_FIELDS, "kv_cache")
PARAM_META = "cllm_param"

# Example sizes: all >= 2 and distinct from each other (see module docstring).
_EXAMPLE_BLOCK_SIZE = 4
_EXAMPLE_NUM_BLOCKS = 13
_EXAMPLE_SEQS = ((4, (0, 1, 2, 3)), (5, (4, 5, 6, 7)))  # (new tokens, 4 blocks each) -> T = 9


@dataclasses.dataclass
class Captured:
    """A flat program: ``gm(*[params[n] for n in param_names], *batch, kv_cache) -> (logits,)``."""

    gm: torch.fx.GraphModule
    param_names: list[str]


def example_inputs(config: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> tuple[PackedBatch, Tensor]:
    seqs = [ScheduledSeq(list(range(1, n + 1)), 0, list(blocks)) for n, blocks in _EXAMPLE_SEQS]
    batch = pack_batch(seqs, _EXAMPLE_BLOCK_SIZE, device)
    kv = torch.zeros(kv_cache_shape(config, _EXAMPLE_NUM_BLOCKS, _EXAMPLE_BLOCK_SIZE), dtype=dtype, device=device)
    return batch, kv


def dynamic_shapes(param_names: list[str]) -> tuple:
    """dynamic_shapes for export(SpecModule-like, (params dict, *batch, kv_cache))."""
    tokens = Dim("num_tokens", min=2)
    seqs = Dim("num_seqs", min=2)
    blocks = Dim("max_blocks", min=2)
    cache_blocks = Dim("num_blocks", min=2)
    block_size = Dim("block_size", min=2)
    return (
        {n: None for n in param_names},
        {0: tokens},  # token_ids
        {0: tokens},  # positions
        {0: seqs + 1},  # query_start_loc
        {0: seqs},  # seq_lens
        {0: seqs, 1: blocks},  # block_tables
        {0: tokens},  # slot_mapping
        {2: cache_blocks, 3: block_size},  # kv_cache [L, 2, NB, BS, Hkv, D]
    )


def export_program(module: torch.nn.Module, params: dict[str, Tensor], batch: PackedBatch, kv: Tensor):
    """torch.export of a module called as module(params, *batch, kv_cache)."""
    names = list(params)
    return torch.export.export(
        module, (params, *batch, kv), dynamic_shapes=dynamic_shapes(names), strict=False
    )


def _tag_params(gm: torch.fx.GraphModule, param_names: list[str]) -> None:
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    expected = len(param_names) + len(INPUT_NAMES)
    if len(placeholders) != expected:
        raise RuntimeError(f"exported graph has {len(placeholders)} inputs; expected {expected}")
    for node, name in zip(placeholders, param_names):
        node.meta[PARAM_META] = name


def flat_graph_module(ep: torch.export.ExportedProgram, param_names: list[str]) -> torch.fx.GraphModule:
    """The exported program's flat graph module with its weight placeholders tagged."""
    gm = ep.graph_module
    _tag_params(gm, param_names)
    return gm


def capture(config: ModelConfig, params: dict[str, Tensor]) -> Captured:
    """Export the spec (weights as inputs) and return its flat graph: IR0 of the build."""
    some = next(t for n, t in params.items() if not is_derived(n))
    batch, kv = example_inputs(config, some.dtype, some.device)
    ep = export_program(SpecModule(config), params, batch, kv)
    names = list(params)
    return Captured(flat_graph_module(ep, names), names)


class FlatProgram(torch.nn.Module):
    """A flat graph module called with a params dict: the shape torch.export saves and the
    runtime calls (``program(params, batch, kv_cache) -> logits``)."""

    def __init__(self, gm: torch.fx.GraphModule, param_names: list[str]):
        super().__init__()
        self.gm = gm
        self.param_names = list(param_names)

    def forward(self, params, token_ids, positions, query_start_loc, seq_lens, block_tables, slot_mapping, kv_cache):
        args = [params[n] for n in self.param_names]
        out = self.gm(*args, token_ids, positions, query_start_loc, seq_lens, block_tables, slot_mapping, kv_cache)
        return out[0] if isinstance(out, (tuple, list)) else out


def param_placeholder_names(gm: torch.fx.GraphModule) -> list[str]:
    """The weight names a flat graph module takes, in order."""
    return [n.meta[PARAM_META] for n in gm.graph.nodes if n.op == "placeholder" and PARAM_META in n.meta]

