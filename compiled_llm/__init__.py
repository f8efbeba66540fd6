"""compiled_llm: a compiler-style LLM inference engine.

``from compiled_llm import LLM, SamplingParams`` loads lazily, so importing the package (and
``compiled-llm --help``) does not pull in torch.
"""

import importlib

__all__ = ["LLM", "SamplingParams", "RequestOutput"]

_LAZY = {
    "LLM": "compiled_llm.serve.llm",
    "SamplingParams": "compiled_llm.serve.sampling_params",
    "RequestOutput": "compiled_llm.serve.outputs",
}


def __getattr__(name):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'compiled_llm' has no attribute {name!r}")
