"""Weight-only quantisation: `LLM(..., quantization="int8" | "int4")`, `--quantization int8|int4`.

Made at load from the checkpoint's bf16/fp16/fp32 weights (the checkpoint on disk stays as it is): every
`Linear` of the model (qkv_proj, o_proj, gate_up_proj and down_proj of every layer, and the LM head, a tied
one as its own copy) is swapped for its quantised version as soon as the loader has filled it
(loader.load_model calls quantize_module; quantize_model does it to a loaded model), and each Qwen3-MoE layer's
stacked experts for the format's Experts. The MoE router (KEEP_UNQUANTIZED), the embedding, norms, biases,
activations and the KV cache stay in the model dtype.

Two formats:
- int8 (int8.py: `Int8Linear`, `Int8Experts`): symmetric, one int8 value a weight and one scale per output row.
- int4 (int4.py: `Int4Linear`, `Int4Experts`): asymmetric, two weights a byte with a scale and an offset per
  group of 64 inputs of a row (32 or 16 where 64 does not divide it; 4.5 bits a weight at 64).

A GGUF file's quantised matrices are held in int4 (groups of 32, float32 scales) and in the grouped int8 format of
int8_group.py, repacked from the file without loss (gguf.py).

Each format's module docstring gives its numerics and the kernels that compute with it; base.py holds what
the two share (`QuantizedLinear`, the row blocks of the dequantise paths).
"""

from __future__ import annotations

from torch import nn

from nanoqwen.config.quantization import QUANTIZATION_METHODS, check_quantization
from nanoqwen.layers.experts import Experts
from nanoqwen.layers.linear import Linear
from nanoqwen.ops.cpu.memory import release_freed_memory
from nanoqwen.ops.quantize import int4_group_size
from nanoqwen.quantization.base import QuantizedLinear
from nanoqwen.quantization.int4 import Int4Experts, Int4Linear
from nanoqwen.quantization.int8 import INT8_VERSIONS, Int8Experts, Int8Linear

__all__ = [
    "EXPERTS", "KEEP_UNQUANTIZED", "LINEARS", "QUANTIZABLE_LINEARS", "QUANTIZATION_METHODS", "Int4Experts",
    "Int4Linear", "Int8Experts", "Int8Linear", "QuantizedLinear", "check_quantization", "quantize_model",
    "quantize_module", "weight_bytes",
]

KEEP_UNQUANTIZED = ("gate",)  # Linears left as they are, by attribute name: Qwen3-MoE's router


def quantize_model(model: nn.Module, method: str | None = "int8") -> nn.Module:
    """Swap every Linear of the model for its quantised version (Int8Linear, Int4Linear) and every
    MoE layer's Experts for Int8Experts / Int4Experts, in place; returns the model. (Loading with
    quantization quantises each module as it is filled: loader.load_model.)

    One module at a time, each freed as soon as its quantised version replaces it and its memory handed
    back to the OS (release_freed_memory), so memory peaks near the model-dtype weights plus one
    matrix (one layer's stacked experts for MoE; a tied LM head's matrix stays: it is the
    embedding).
    """
    if check_quantization(method) is None:
        return model
    for name in [name for name, _ in model.named_modules() if name]:  # (named before any swap)
        quantize_module(model, name, method)
    return model


LINEARS: dict[str, type[QuantizedLinear]] = {"int8": Int8Linear, "int4": Int4Linear}
EXPERTS: dict[str, type[Experts]] = {"int8": Int8Experts, "int4": Int4Experts}
# the Linear classes that have quantised versions (the same in both formats: INT4_VERSIONS has these keys too)
QUANTIZABLE_LINEARS: frozenset[type[Linear]] = frozenset(INT8_VERSIONS)


def quantize_module(model: nn.Module, name: str, method: str = "int8") -> None:
    """Swap module `name` for its quantised version if it is a Linear (other than the router) or
    Experts; else leave it. The model-dtype weights are freed here, unless something else still
    holds them (a tied embedding)."""
    parent_name, _, attr = name.rpartition(".")
    parent = model.get_submodule(parent_name)
    module = getattr(parent, attr)
    if type(module) in QUANTIZABLE_LINEARS and attr not in KEEP_UNQUANTIZED:
        if method == "int4":  # (a clear error naming the matrix, before any work)
            int4_group_size(module.weight.shape[1], name)
        quantized = LINEARS[method].from_linear(module)
    elif type(module) is Experts:
        if method == "int4":
            for matrix in ("gate_up_proj", "down_proj"):
                int4_group_size(getattr(module, matrix).shape[-1], f"{name}.{matrix}")
        quantized = EXPERTS[method](module)
    else:
        return
    setattr(parent, attr, quantized)
    del module  # the model-dtype matrices' last reference
    if next(quantized.buffers()).device.type == "cpu":
        release_freed_memory()  # every time (a cheap call): see there


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's weights in memory (parameters and saved buffers; a tensor shared by two
    names once)."""
    tensors = {t.data_ptr(): t.numel() * t.element_size() for t in model.state_dict().values()}
    return sum(tensors.values())
