"""Reasoning output: a chat reply's ``<think>`` block returned as ``reasoning_content``
(``compiled-llm serve --reasoning-parser``), as vLLM's reasoning parsers do."""
