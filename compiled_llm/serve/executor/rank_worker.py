"""``RankWorker``: a tensor-parallel rank other than 0, what rank 0's executor drives.

It holds the rank's weights (``load_engine(rank=...)``), KV cache and ``ModelRunner``, and runs
what rank 0 sends, in order: the KV-sizing step, making the runner, graph captures and the
device part of every step (``ModelRunner.replay_step``). It samples nothing and keeps no request
state: every step's inputs arrive filled.
"""

from __future__ import annotations

from typing import Any

import torch

from compiled_llm.engine.loaded_model import LoadedModel
from compiled_llm.model.spec import PackedBatch
from compiled_llm.serve.worker import kv_cache as kvc
from compiled_llm.serve.worker.model_runner import ModelRunner, profile_step


class RankWorker:
    def __init__(self, model: LoadedModel):
        self.model = model
        self.runner: ModelRunner | None = None

    def profile_step(self, num_tokens: int, num_seqs: int, block_size: int) -> None:
        m = self.model
        profile_step(m.config, m.params, m.program, num_tokens=num_tokens, num_seqs=num_seqs,
                     block_size=block_size, dtype=m.dtype, device=m.device)

    def make_runner(self, num_blocks: int, block_size: int, runner_options: dict[str, Any],
                    decode_buckets_up_to: int, prefill_graph_tokens: int | None) -> None:
        """The runner rank 0 made, on this rank's weights (``LLMEngine``'s arguments)."""
        m = self.model
        kv_cache = kvc.allocate(m.config, num_blocks, block_size, m.dtype, m.device)
        self.runner = ModelRunner(m.config, m.params, m.program, kv_cache, block_size=block_size,
                                  device=m.device, tp_size=m.tp_size, **runner_options)
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

    # ---- compare: this rank's side of a sharded program's steps ------------------------------------

    def use_rebuilt_program(self, pass_names: list[str]) -> None:
        """Compare's bisection: this rank's program rebuilt from the source with ``pass_names``."""
        from compiled_llm.engine.compare import rebuilt_program

        m = self.model
        self._compare_program = rebuilt_program(m.manifest, pass_names, m.dtype, m.device, m.tp_rank)

    @torch.inference_mode()
    def compare_step(self, batch: tuple, kv_shape: tuple, fresh: bool) -> None:
        m = self.model
        if fresh:
            self._compare_kv = torch.zeros(kv_shape, dtype=m.dtype, device=m.device)
        program, params = getattr(self, "_compare_program", None) or (m.program, m.params)
        program(params, PackedBatch(*(torch.from_numpy(a).to(m.device) for a in batch)), self._compare_kv)

    def synchronize(self) -> None:
        if self.model.device.type == "cuda":
            torch.cuda.synchronize(self.model.device)
