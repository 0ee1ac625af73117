"""The OpenAI-compatible HTTP server behind ``engine-serve``.

from pagecast.runtime.server import create_app
app = create_app({"my-model": AsyncEngine.from_artifact(path)}, api_key=None, max_queue=256)
"""

from pagecast.runtime.server.app import create_app, drain

__all__ = ["create_app", "drain"]
