"""nanoqwen: a small, exact, readable inference engine for Qwen3 models."""

from nanoqwen.errors import (
    ConfigError,
    EngineDeadError,
    InvalidRequestError,
    ModelNotFoundError,
    NanoQwenError,
    WeightsError,
)
from nanoqwen.llm import LLM
from nanoqwen.outputs import CompletionOutput, RequestOutput
from nanoqwen.sampling_params import SamplingParams

__all__ = [
    "LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "NanoQwenError", "ConfigError",
    "ModelNotFoundError", "WeightsError", "InvalidRequestError", "EngineDeadError",
]
__version__ = "0.1.0"
