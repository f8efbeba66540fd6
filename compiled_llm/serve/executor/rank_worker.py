"""``RankWorker``: a tensor-parallel rank or pipeline stage other than rank 0, what rank 0's
executor drives (a stage's cache holds only its layers).

It holds the rank's weights (``load_engine(rank=...)``), KV cache and ``ModelRunner``, and runs
what rank 0 sends, in order: the KV-sizing step (and what its decode lanes will hold), making
the runner, graph captures and the device part of every step (``ModelRunner.replay_step``);
it reports its graphs when asked. It samples nothing and keeps no request
state: every step's inputs arrive filled. Tools that drive the ranks themselves (``compare``) send
plain functions instead (``run``), which see the rank's model and a state of their own.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from compiled_llm.engine.loaded_model import LoadedModel
from compiled_llm.serve.worker import kv_cache as kvc
from compiled_llm.serve.worker import pipeline_lanes
from compiled_llm.serve.worker.model_runner import ModelRunner, RankGraphs, profile_step


class RankWorker:
    def __init__(self, model: LoadedModel):
        self.model = model
        self.runner: ModelRunner | None = None
        # what functions sent through ``run_on_ranks`` keep between calls on this rank
        self.state: dict[str, Any] = {}

    def profile_step(self, num_tokens: int, num_seqs: int, block_size: int) -> None:
        m = self.model
        profile_step(m.config, m.params, m.program, num_tokens=num_tokens, num_seqs=num_seqs,
                     block_size=block_size, dtype=m.dtype, device=m.device, kv_layers=m.kv_layers)

    def lane_bytes(self, max_rows: int, width: int, graphs: bool) -> int:
        """What this stage's decode lanes will hold (``pipeline_lanes.lane_bytes``), asked by
        rank 0 after the KV-sizing step, before it sizes the cache of every rank."""
        return pipeline_lanes.lane_bytes(self.model.program, max_rows, width, graphs)

    def graph_report(self) -> RankGraphs:
        return self.runner.graph_report()

    def make_runner(self, num_blocks: int, block_size: int, runner_options: dict[str, Any],
                    decode_buckets_up_to: int | None, prefill_graph_tokens: int | None) -> None:
        """The runner rank 0 made, on this rank's weights (``LLMEngine``'s arguments)."""
        m = self.model
        kv_cache = kvc.allocate(m.config, num_blocks, block_size, m.dtype, m.device, m.kv_layers)
        self.runner = ModelRunner(m.config, m.params, m.program, kv_cache, block_size=block_size,
                                  device=m.device, tp_size=m.world_size, **runner_options)
        if decode_buckets_up_to is not None:  # None: steps run at their own sizes (a CPU)
            self.runner.set_decode_buckets(decode_buckets_up_to)
        if prefill_graph_tokens is not None:
            self.runner.prepare_graphs(prefill_graph_tokens)

    def release_graphs(self) -> None:
        if self.runner is not None:
            self.runner.release_graphs()

    def capture_all_graphs(self, part: int, parts: int) -> None:
        self.runner.capture_all_graphs(part, parts)

    def replay_step(self, step, host) -> None:
        self.runner.replay_step(step, host)

    def run(self, fn: Callable[..., Any], *args) -> Any:
        """``fn(model, state, *args)`` on this rank (the executor's ``run_on_ranks``): ``state``
        is a dict the rank keeps for such functions from one call to the next."""
        return fn(self.model, self.state, *args)

    def synchronize(self) -> None:
        if self.model.device.type == "cuda":
            torch.cuda.synchronize(self.model.device)
