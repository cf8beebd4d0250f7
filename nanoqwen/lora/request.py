"""LoRARequest: which LoRA adapter a request runs with, named as vLLM names it."""

from __future__ import annotations

from dataclasses import dataclass

from nanoqwen.errors import InvalidRequestError


@dataclass(frozen=True)
class LoRARequest:
    """A LoRA adapter for a request, as vLLM's `LoRARequest(lora_name, lora_int_id, lora_path)`.

    lora_name: the adapter's name (the server's `model` field chooses an adapter by it).
    lora_int_id: its id, unique per adapter and >= 1 (the engine keeps one loaded adapter per id).
    lora_path: the folder holding PEFT's adapter_config.json and adapter_model.safetensors.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise InvalidRequestError(f"lora_name={self.lora_name!r} must be a non-empty string", param="lora_name")
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise InvalidRequestError(f"lora_int_id={self.lora_int_id!r} must be an integer >= 1 "
                                      "(0 is the base model)", param="lora_int_id")
        object.__setattr__(self, "lora_path", str(self.lora_path))
