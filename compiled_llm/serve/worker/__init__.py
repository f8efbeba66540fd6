"""The device worker: runs one scheduled step on the engine's program and weights. The model
runner packs the step's inputs (step inputs, request rows, token history), replays the CUDA graph
of the step's bucket (cuda graphs), keeps the paged KV cache (kv cache) and samples on the device
(sampler). Every tensor-parallel rank runs one of these; only rank 0 samples."""
