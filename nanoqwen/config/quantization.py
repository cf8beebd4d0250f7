"""The weight quantisation methods by name, importable without the methods themselves
(nanoqwen/quantization/ holds them)."""

from __future__ import annotations

from nanoqwen.errors import ConfigError

QUANTIZATION_METHODS = ("int8", "int4")  # made at load from a checkpoint's 16/32-bit weights
# a checkpoint's own quantisation, named as vLLM names it: `--quantization awq` with an AWQ checkpoint is allowed (and
# changes nothing), with any other checkpoint an error
CHECKPOINT_METHODS = ("awq", "gptq", "fp8", "gguf")


def check_quantization(method: str | None) -> str | None:
    """The method if nanoqwen makes it at load (None: no quantisation, or the checkpoint's own), else a
    ConfigError naming the choices."""
    if method is None or method in QUANTIZATION_METHODS:
        return method
    if method in CHECKPOINT_METHODS:
        return None
    raise ConfigError(f"quantization={method!r} is not supported; use one of: "
                      f"{', '.join(QUANTIZATION_METHODS)} "
                      f"(or None for the checkpoint's own weights, also for {', '.join(CHECKPOINT_METHODS)} "
                      "checkpoints)")
