"""Configs, split by concern: the checkpoint's (model.py), the engine's options (engine.py), speculative
decoding's (speculative.py), the quantization methods' names (quantization.py), the device and dtype
(device.py), and which task a checkpoint is for (pooling.py)."""

from nanoqwen.config.engine import DEFAULT_MODEL, EngineConfig
from nanoqwen.config.model import GenerationConfig, Qwen3Config
from nanoqwen.config.speculative import SpeculativeConfig

__all__ = ["DEFAULT_MODEL", "EngineConfig", "GenerationConfig", "Qwen3Config", "SpeculativeConfig"]
