"""LoRA adapters over one base model, applied from outside the model: PEFT's files read into an adapter
(peft.py), a slot pool of adapters on the device that the base model's projections add their A/B products from,
row group by row group (layers.py), and the registry and slot pool an engine owns (manager.py)."""

from nanoqwen.lora.layers import LoRALayer, LoRAStep
from nanoqwen.lora.manager import LoRAManager
from nanoqwen.lora.peft import LoRAAdapter, LoRAWeights, load_peft_adapter
from nanoqwen.lora.request import LoRARequest

__all__ = ["LoRARequest", "LoRAAdapter", "LoRAWeights", "load_peft_adapter", "LoRALayer", "LoRAStep",
           "LoRAManager"]
