"""pagecast.runtime: load an engine artifact and serve it (Python API, async engine, HTTP server)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = ["LLM", "AsyncEngine", "CompletionOutput", "LLMEngine", "RequestOutput", "SamplingParams", "__version__"]

if TYPE_CHECKING:
    from pagecast.runtime.async_engine import AsyncEngine
    from pagecast.runtime.engine import LLMEngine
    from pagecast.runtime.llm import LLM
    from pagecast.runtime.outputs import CompletionOutput, RequestOutput
    from pagecast.runtime.sampling_params import SamplingParams

_LAZY = {
    "LLM": "pagecast.runtime.llm",
    "AsyncEngine": "pagecast.runtime.async_engine",
    "LLMEngine": "pagecast.runtime.engine",
    "SamplingParams": "pagecast.runtime.sampling_params",
    "RequestOutput": "pagecast.runtime.outputs",
    "CompletionOutput": "pagecast.runtime.outputs",
}


def __getattr__(name: str) -> Any:
    # Lazy so that `import pagecast.runtime.artifact` (the builder does) does not load the engine.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(name)
