"""This user's compiled_llm cache directory, shared by the engine cache, the unpacked engine
kernels and the CUDA extensions built on this machine (so it sits beside ``errors.py``, below
every stage that uses it)."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_DIR_ENV = "COMPILED_LLM_CACHE_DIR"


def cache_root() -> Path:
    """``$COMPILED_LLM_CACHE_DIR``, else ``$XDG_CACHE_HOME/compiled_llm``, else ``~/.cache/compiled_llm``."""
    env = os.environ.get(CACHE_DIR_ENV)
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "compiled_llm"
