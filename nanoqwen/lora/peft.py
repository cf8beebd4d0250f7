"""Reading a LoRA adapter as PEFT saves it: adapter_config.json and adapter_model.safetensors.

PEFT's LoRA adds to a linear layer y = W x the product scaling * B (A x), with A [r, in] and B [out, r]; scaling
is lora_alpha / r (lora_alpha / sqrt(r) with use_rslora). Its files name the tensors after the module they
change, under PEFT's wrapper: `base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight`. The config's
fields that matter here:

- r, lora_alpha, use_rslora: the rank and the scaling; rank_pattern and alpha_pattern give some modules their own
  (keys are regular expressions matched, as PEFT does, against the end of the module's name, e.g.
  `model.layers.0.self_attn.q_proj`). The rank is read from the tensors' shapes, which the rank_pattern sets.
- target_modules (short names, a regular expression, or "all-linear") and layers_to_transform: which modules
  have tensors in the file. nanoqwen reads the tensors present, so the two are followed as saved.

Supported targets: the attention projections q/k/v/o_proj, and in dense layers the MLP's gate/up/down_proj.
Refused, with an error naming the field: modules_to_save, embedding or LM-head adapters (their tensors, or
target_modules naming embed_tokens / lm_head), MoE experts or router, DoRA (use_dora), LoRA biases (bias,
lora_bias), trainable_token_indices, layer_replication, target_parameters, fan_in_fan_out,
alora_invocation_tokens.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch
from safetensors.torch import load_file

from nanoqwen.config.model import Qwen3Config
from nanoqwen.errors import InvalidRequestError

# PEFT's short module names nanoqwen applies adapters to, with the block they sit in
ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
SUPPORTED_MODULES = ATTENTION_MODULES + MLP_MODULES

_TENSOR_NAME = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)"
                          r"\.lora_([AB])(?:\.\w+)?\.weight$")
# config fields whose non-empty value changes the model in ways nanoqwen does not apply
_REFUSED_FIELDS = {
    "modules_to_save": "it saves whole modules (an embedding, an LM head or a classifier) beside the adapter",
    "trainable_token_indices": "it trains embedding rows of some tokens",
    "layer_replication": "it stacks copies of base layers",
    "target_parameters": "it targets parameters (MoE experts) rather than linear modules",
    "use_dora": "DoRA's magnitude vector is not applied",
    "lora_bias": "LoRA's B biases are not applied",
    "fan_in_fan_out": "it is for Conv1D (GPT-2) layers, which Qwen3 does not have",
    "alora_invocation_tokens": "activated LoRA applies the adapter from an invocation sequence on",
}


class LoRAWeights(NamedTuple):
    """One module's adapter: A [r, in], B [out, r] (float32) and its scaling."""

    lora_a: torch.Tensor
    lora_b: torch.Tensor
    scaling: float


@dataclass
class LoRAAdapter:
    """A LoRA adapter read from PEFT's files: its weights per (layer index, short module name)."""

    path: Path
    weights: dict[tuple[int, str], LoRAWeights] = field(default_factory=dict)

    @property
    def rank(self) -> int:
        """The largest rank of its modules."""
        return max((w.lora_a.shape[0] for w in self.weights.values()), default=0)


def module_shape(config: Qwen3Config, module: str) -> tuple[int, int]:
    """(in_features, out_features) of a decoder layer's projection, by PEFT's short name."""
    h, d = config.hidden_size, config.head_dim
    q, kv, i = config.num_attention_heads * d, config.num_key_value_heads * d, config.intermediate_size
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}[module]


def pattern_value(patterns: dict[str, Any], module_name: str, default: Any) -> Any:
    """PEFT's get_pattern_key: the value of the first key (a regular expression) matching the end of
    module_name, else default."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module_name):
            return value
    return default


def read_adapter_config(folder: Path) -> dict[str, Any]:
    """adapter_config.json, checked for what nanoqwen cannot apply (an InvalidRequestError naming the field)."""
    path = folder / "adapter_config.json"
    if not path.is_file():
        raise InvalidRequestError(f"lora_path {folder}: no adapter_config.json (a PEFT LoRA adapter folder holds "
                                  "adapter_config.json and adapter_model.safetensors)", param="lora_path")
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise InvalidRequestError(f"{path}: not readable JSON ({e})", param="lora_path") from e
    if not isinstance(cfg, dict):
        raise InvalidRequestError(f"{path}: expected a JSON object", param="lora_path")
    if cfg.get("peft_type", "LORA") != "LORA":
        raise InvalidRequestError(f"{path}: peft_type {cfg['peft_type']!r} is not supported; only LORA adapters are",
                                  param="lora_path")
    for name, why in _REFUSED_FIELDS.items():
        if cfg.get(name):
            raise InvalidRequestError(f"{path}: {name}={cfg[name]!r} is not supported ({why}); nanoqwen applies "
                                      f"adapters of {', '.join(SUPPORTED_MODULES)} only", param="lora_path")
    if cfg.get("bias", "none") != "none":
        raise InvalidRequestError(f"{path}: bias={cfg['bias']!r} is not supported (it changes the base model's "
                                  "biases); only bias='none' adapters are", param="lora_path")
    targets = cfg.get("target_modules")
    if isinstance(targets, list):
        for name in targets:
            if name not in SUPPORTED_MODULES:
                what = ("embedding and LM-head adapters are not supported" if name in ("embed_tokens", "lm_head")
                        else f"nanoqwen applies adapters to {', '.join(SUPPORTED_MODULES)} only")
                raise InvalidRequestError(f"{path}: target_modules names {name!r}: {what}", param="lora_path")
    for name in ("r", "lora_alpha"):
        value = cfg.get(name, 8)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
            raise InvalidRequestError(f"{path}: {name}={value!r} must be a number > 0", param="lora_path")
    for name in ("rank_pattern", "alpha_pattern"):
        if not isinstance(cfg.get(name) or {}, dict):
            raise InvalidRequestError(f"{path}: {name} must be an object of pattern -> value", param="lora_path")
    return cfg


def load_peft_adapter(path: str | Path, config: Qwen3Config) -> LoRAAdapter:
    """Read the PEFT LoRA adapter in folder `path` for a model of `config` (float32 tensors on the CPU).
    An adapter nanoqwen cannot apply, or whose shapes do not fit the model, is an InvalidRequestError naming
    what is wrong."""
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise InvalidRequestError(f"lora_path {str(path)!r} is not a folder (give the folder PEFT's "
                                  "save_pretrained wrote)", param="lora_path")
    cfg = read_adapter_config(folder)
    file = folder / "adapter_model.safetensors"
    if not file.is_file():
        raise InvalidRequestError(f"lora_path {folder}: no adapter_model.safetensors (save the adapter with "
                                  "safe_serialization=True, PEFT's default)", param="lora_path")
    tensors = load_file(file)
    found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        m = _TENSOR_NAME.match(name)
        if m is None:
            if "embed" in name or "lm_head" in name:
                why = "embedding and LM-head changes are not supported"
            else:
                why = f"nanoqwen applies adapters to {', '.join(SUPPORTED_MODULES)} of the decoder layers only"
            raise InvalidRequestError(f"{file}: tensor {name!r}: {why}", param="lora_path")
        layer, block, module, which = int(m.group(1)), m.group(2), m.group(3), m.group(4)
        if module not in SUPPORTED_MODULES or (block == "self_attn") != (module in ATTENTION_MODULES):
            raise InvalidRequestError(f"{file}: tensor {name!r}: nanoqwen applies adapters to "
                                      f"{', '.join(SUPPORTED_MODULES)} only", param="lora_path")
        if layer >= config.num_hidden_layers:
            raise InvalidRequestError(f"{file}: tensor {name!r}: the model has {config.num_hidden_layers} layers",
                                      param="lora_path")
        if module in MLP_MODULES and config.is_moe_layer(layer):
            raise InvalidRequestError(f"{file}: tensor {name!r}: layer {layer} is a MoE layer; adapters of MoE "
                                      "experts are not supported (attention projections are)", param="lora_path")
        found.setdefault((layer, module), {})[which] = tensor.float()
    adapter = LoRAAdapter(folder)
    alpha, rslora = cfg.get("lora_alpha", 8), bool(cfg.get("use_rslora", False))
    alpha_pattern = cfg.get("alpha_pattern") or {}
    for (layer, module), pair in sorted(found.items()):
        where = f"{file}: layer {layer} {module}"
        if set(pair) != {"A", "B"}:
            raise InvalidRequestError(f"{where}: lora_A and lora_B must both be present", param="lora_path")
        a, b = pair["A"], pair["B"]
        in_features, out_features = module_shape(config, module)
        r = a.shape[0]
        if a.shape != (r, in_features) or b.shape != (out_features, r) or r == 0:
            raise InvalidRequestError(f"{where}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit the "
                                      f"model's [{out_features}, {in_features}] projection (an adapter for another "
                                      "model?)", param="lora_path")
        block = "self_attn" if module in ATTENTION_MODULES else "mlp"
        module_alpha = pattern_value(alpha_pattern, f"model.layers.{layer}.{block}.{module}", alpha)
        scaling = module_alpha / math.sqrt(r) if rslora else module_alpha / r
        adapter.weights[(layer, module)] = LoRAWeights(a, b, float(scaling))
    if not adapter.weights:
        raise InvalidRequestError(f"{file}: no LoRA tensors found", param="lora_path")
    return adapter
