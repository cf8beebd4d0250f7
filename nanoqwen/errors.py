"""Exceptions nanoqwen raises for bad input. Each message names the thing and the fix."""


class NanoQwenError(Exception):
    """Base class of every error nanoqwen raises on purpose."""


class ModelNotFoundError(NanoQwenError):
    """The model folder or hub id could not be found or reached."""


class ConfigError(NanoQwenError):
    """config.json / generation_config.json / tokenizer files are missing or invalid."""


class WeightsError(NanoQwenError):
    """The safetensors files are missing, corrupt, or do not match the config."""


class InvalidRequestError(NanoQwenError, ValueError):
    """A prompt or sampling parameter is invalid (empty, too long, out of range). `param` names the field at
    fault where there is one (the server answers it as OpenAI's error `param`)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class EngineDeadError(NanoQwenError):
    """The engine cannot run any more (a tensor-parallel worker died or failed); make a new one."""
