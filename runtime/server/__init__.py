"""The OpenAI-compatible HTTP server behind ``engine-serve``.

from pagecast.runtime.server import create_app
app = create_app({"my-model": AsyncEngine.from_artifact(path)}, api_key=None, max_queue=256)
"""

from __future__ import annotations

from typing import Any

__all__ = ["create_app", "drain"]


def __getattr__(name: str) -> Any:
    # Lazy: engine-serve reads constants from the server's modules before it starts the engine
    # cores, and importing the app (starlette, pydantic, jinja2: ~0.5-1 s) would delay them.
    if name in __all__:
        from pagecast.runtime.server import app

        return getattr(app, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
