"""The runtime: paged KV cache with prefix caching, continuous batching, CUDA graphs per decode
bucket, on-device sampling, and the ``LLM`` API (see llm.py)."""
