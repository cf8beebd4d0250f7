"""An OpenAI-compatible HTTP server for nanoqwen (`nanoqwen serve`): the FastAPI app (api.py) over one engine
driven from a thread of its own (async_engine.py)."""

from nanoqwen.entrypoints.server.api import build_app
from nanoqwen.entrypoints.server.async_engine import AsyncEngine

__all__ = ["AsyncEngine", "build_app"]
