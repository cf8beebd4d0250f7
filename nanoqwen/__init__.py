"""nanoqwen: a small, exact, readable inference engine for Qwen3 models."""

from nanoqwen.entrypoints.llm import LLM
from nanoqwen.errors import (
    ConfigError,
    EngineDeadError,
    InvalidRequestError,
    ModelNotFoundError,
    NanoQwenError,
    WeightsError,
)
from nanoqwen.lora.request import LoRARequest
from nanoqwen.outputs import (
    CompletionOutput,
    EmbeddingRequestOutput,
    PoolingRequestOutput,
    RequestOutput,
    ScoringRequestOutput,
)
from nanoqwen.pooling_params import PoolingParams
from nanoqwen.sampling_params import SamplingParams

__all__ = [
    "LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "PoolingParams",
    "PoolingRequestOutput", "EmbeddingRequestOutput", "ScoringRequestOutput", "NanoQwenError", "ConfigError",
    "ModelNotFoundError", "WeightsError", "InvalidRequestError", "EngineDeadError", "LoRARequest",
]
__version__ = "0.1.0"
