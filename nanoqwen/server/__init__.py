"""An OpenAI-compatible HTTP server for nanoqwen (`nanoqwen serve`)."""

from __future__ import annotations

from typing import Any

__all__ = ["AsyncEngine", "build_app"]


def __getattr__(name: str) -> Any:
    # Lazy, so `nanoqwen chat` (whose parser imports nanoqwen.server.run) never loads FastAPI.
    if name == "build_app":
        from nanoqwen.server.api import build_app

        return build_app
    if name == "AsyncEngine":
        from nanoqwen.server.async_engine import AsyncEngine

        return AsyncEngine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
