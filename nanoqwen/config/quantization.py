"""The weight quantisation methods by name, importable without the methods themselves
(nanoqwen/quantization/ holds them)."""

from __future__ import annotations

from nanoqwen.errors import ConfigError

QUANTIZATION_METHODS = ("int8", "int4")


def check_quantization(method: str | None) -> str | None:
    """The method if it is supported (None: no quantisation), else a ConfigError naming the
    choices."""
    if method is None or method in QUANTIZATION_METHODS:
        return method
    raise ConfigError(f"quantization={method!r} is not supported; use one of: "
                      f"{', '.join(QUANTIZATION_METHODS)} "
                      "(or None for the checkpoint's own weights)")
