"""Checkpoints the hub publishes already quantised: config.json's `quantization_config` with `quant_method` awq
(4-bit GEMM), gptq (4-bit) or fp8 (e4m3 in blocks). Their quantised matrices become nanoqwen's quantised modules
as they are (nanoqwen/ops/hf_quants.py unpacks them; nanoqwen/quantization/prequantized.py holds them), before the
rest of the checkpoint (embedding, norms, the unquantised LM head, biases, the MoE router) loads as usual
(loader.load_weights, which skips the tensors read here).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from nanoqwen.errors import ConfigError, WeightsError
from nanoqwen.model_loader.sharding import COLUMNS, ROWS, rank_share, tp_split_dim
from nanoqwen.models.qwen3 import Qwen3ForCausalLM
from nanoqwen.ops.cpu.memory import release_freed_memory
from nanoqwen.ops.gguf_quants import GroupedWeights
from nanoqwen.ops.hf_quants import unpack_awq, unpack_gptq
from nanoqwen.quantization.prequantized import (
    CheckpointExperts,
    InputOrderLinear,
    concat_parts,
    fp8_linear,
    fused_linear,
)

PREQUANTIZED_METHODS = ("awq", "gptq", "fp8")
# a quantised Linear's tensors in the checkpoint, by method (beside `{prefix}.bias` where it has one)
TENSORS = {"awq": ("qweight", "qzeros", "scales"), "gptq": ("qweight", "qzeros", "scales"),
           "fp8": ("weight", "weight_scale_inv")}
OPTIONAL = {"gptq": ("g_idx",)}
# our fused module -> the checkpoint's projections that fill it, in order
FUSED = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
         "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}
PROJECTIONS = {part: (fused, i) for fused, parts in FUSED.items() for i, part in enumerate(parts)}
PROJECTIONS.update({"self_attn.o_proj": ("self_attn.o_proj", 0), "mlp.down_proj": ("mlp.down_proj", 0)})
EXPERT_PROJECTIONS = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1), "down_proj": ("down_proj", 0)}


def checkpoint_quantization(raw_config: dict[str, Any], where: Path) -> dict[str, Any] | None:
    """config.json's quantization_config if it names a method nanoqwen reads; None for an unquantised checkpoint;
    a ConfigError naming the field for one it does not read."""
    q = raw_config.get("quantization_config")
    if q is None:
        return None
    method = q.get("quant_method") if isinstance(q, dict) else None
    if method not in PREQUANTIZED_METHODS:
        raise ConfigError(f"{where}: quantization_config.quant_method {method!r} is not supported; nanoqwen reads "
                          f"{', '.join(PREQUANTIZED_METHODS)} checkpoints (or GGUF files)")
    bits = q.get("bits", q.get("w_bit", 4))
    if method in ("awq", "gptq") and bits != 4:
        raise ConfigError(f"{where}: quantization_config.bits {bits} is not supported; nanoqwen reads 4-bit "
                          f"{method.upper()} checkpoints")
    if method == "awq" and str(q.get("version", "gemm")).lower() != "gemm":
        raise ConfigError(f"{where}: quantization_config.version {q.get('version')!r} is not supported; nanoqwen "
                          "reads AWQ's GEMM layout (version 'gemm')")
    if method == "awq" and q.get("zero_point", True) is not True:
        raise ConfigError(f"{where}: quantization_config.zero_point false is not supported (AWQ with zero points)")
    if method == "fp8" and str(q.get("fmt", "e4m3")).lower() != "e4m3":
        raise ConfigError(f"{where}: quantization_config.fmt {q.get('fmt')!r} is not supported; nanoqwen reads "
                          "FP8 e4m3 weights")
    if method == "gptq" and q.get("checkpoint_format", "gptq") not in ("gptq", "gptq_v2"):
        raise ConfigError(f"{where}: quantization_config.checkpoint_format {q.get('checkpoint_format')!r} is not "
                          "supported (gptq or gptq_v2)")
    return q


def is_quantized_tensor(name: str, method: str) -> bool:
    """Whether checkpoint tensor `name` is one of a quantised Linear's (read by load_prequantized)."""
    leaf = name.rpartition(".")[2]
    if method == "fp8":
        return leaf == "weight_scale_inv" or (leaf == "weight" and _projection(name) is not None)
    return leaf in (*TENSORS[method], *OPTIONAL.get(method, ()))


def _projection(name: str) -> tuple[int, str, tuple[str, int]] | None:
    """(layer, our module, (its part, index)) for a checkpoint tensor of a quantisable projection, else None;
    experts: (layer, 'experts', (matrix, expert * 2 + half))."""
    parts = name.split(".")
    if len(parts) < 5 or parts[:2] != ["model", "layers"] or not parts[2].isdigit():
        return None
    module = ".".join(parts[3:-1])
    if module in PROJECTIONS:
        fused, index = PROJECTIONS[module]
        return int(parts[2]), fused, (fused, index)
    if len(parts) == 8 and parts[3:5] == ["mlp", "experts"] and parts[6] in EXPERT_PROJECTIONS:
        matrix, half = EXPERT_PROJECTIONS[parts[6]]
        return int(parts[2]), "experts", (matrix, int(parts[5]) * 2 + half)
    return None


def load_prequantized(model: Qwen3ForCausalLM, files: list[Path], q: dict[str, Any]) -> None:
    """Put every quantised projection of the checkpoint in place, as nanoqwen's quantised module holding it."""
    method = q["quant_method"]
    group = int(q.get("group_size", q.get("q_group_size", 128)))
    needed = TENSORS[method]
    pending: dict[str, dict[str, torch.Tensor]] = {}  # checkpoint module -> its tensors read so far
    parts: dict[tuple[int, str], dict[tuple[str, int], Any]] = {}  # (layer, our module) -> its parts read so far
    for f in files:
        with safe_open(f, framework="pt", device="cpu") as st:
            for name in st.keys():
                if not is_quantized_tensor(name, method):
                    continue
                prefix, _, leaf = name.rpartition(".")
                target = _projection(name)
                if target is None:
                    raise WeightsError(f"{f}: quantised tensor {name!r} has no place in a Qwen3 model (nanoqwen "
                                       "reads quantised attention and MLP projections)")
                got = pending.setdefault(prefix, {})
                got[leaf] = st.get_tensor(name)
                if not all(t in got for t in needed):
                    continue
                if method == "gptq" and "g_idx" not in got and q.get("desc_act"):
                    continue  # (its g_idx may come after)
                del pending[prefix]
                layer, module, part = target
                param = f"layers.{layer}." + (f"mlp.experts.{part[0]}" if module == "experts" else f"{module}.weight")
                matrix = _rank_part(model, param, _matrix(method, got, group, q, prefix), prefix)
                parts.setdefault((layer, module), {})[part] = matrix
                if _complete(model, layer, module, parts[(layer, module)]):
                    _place(model, layer, module, parts.pop((layer, module)), method, prefix)
                    release_freed_memory()
    if pending or parts:
        first = next(iter(pending), None) or f"layer {next(iter(parts))[0]}'s {next(iter(parts))[1]}"
        raise WeightsError(f"the checkpoint's quantised tensors are incomplete at {first!r} (each quantised "
                           f"projection needs {', '.join(needed)})")


def _matrix(method: str, got: dict[str, torch.Tensor], group: int, q: dict[str, Any], where: str) -> Any:
    """One projection's matrix: FP8 (weight, its scales one row per weight row [n, K / block]); AWQ and GPTQ
    (GroupedWeights, GPTQ's act order or None)."""
    if method == "fp8":
        weight, scale_inv = got["weight"], got["weight_scale_inv"]
        if weight.dtype != torch.float8_e4m3fn:
            raise WeightsError(f"{where}.weight is {weight.dtype}, expected float8_e4m3fn (quant_method fp8)")
        block_rows = int(q.get("weight_block_size", [128, 128])[0])
        return weight, scale_inv.repeat_interleave(block_rows, 0)[: weight.shape[0]]
    if method == "awq":
        return unpack_awq(got["qweight"], got["qzeros"], got["scales"], group), None
    zeros_minus_one = q.get("checkpoint_format", "gptq") == "gptq"
    return unpack_gptq(got["qweight"], got["qzeros"], got["scales"], got.get("g_idx"), group, zeros_minus_one)


def _rank_part(model: Qwen3ForCausalLM, param: str, matrix: Any, where: str) -> Any:
    """This tensor-parallel rank's share of one projection's matrix (_matrix's form) for our parameter `param`, cut
    as its module says (sharding.tp_split_dim): its 1/tp of the output rows where the module is column-parallel
    (qkv_proj, gate_up_proj: each part cut on its own), of the input columns where it is row-parallel (o_proj,
    down_proj). A cut inside a group of scales is a ConfigError."""
    rank, size = model.tp_rank, model.tp_size
    dim = tp_split_dim(model, param, 2) if size > 1 else None
    if dim is None:
        return matrix
    weights, extra = matrix
    if isinstance(weights, GroupedWeights):  # AWQ, GPTQ
        if extra is not None and dim == COLUMNS:
            raise ConfigError(f"{where}: a GPTQ checkpoint with act order (desc_act: true) cannot be cut over "
                              f"tensor_parallel_size {size} ranks (its groups run over all inputs in another "
                              "order); use tensor_parallel_size 1, or a checkpoint without desc_act")
        return rank_share(weights, dim, rank, size, where), extra
    # FP8: its scales one row per weight row, one column per block of inputs
    if dim == ROWS:
        return rank_share(weights, ROWS, rank, size, where), rank_share(extra, ROWS, rank, size, where)
    n = weights.shape[1]
    block = -(-n // extra.shape[1])
    if (n // size) % block:
        raise ConfigError(f"{where}: tensor_parallel_size {size} cuts its {n} inputs into {n // size} a rank, not a "
                          f"multiple of the FP8 scales' block of {block}; use a tensor_parallel_size that divides "
                          f"{n // block}")
    return (rank_share(weights, COLUMNS, rank, size, where).contiguous(),
            rank_share(extra, COLUMNS, rank, size, where).contiguous())


def _complete(model: Qwen3ForCausalLM, layer: int, module: str, got: dict) -> bool:
    if module == "experts":
        return len(got) == 3 * model.layers[layer].mlp.experts.gate_up_proj.shape[0]
    return len(got) == len(FUSED.get(module, (module,)))


def _place(model: Qwen3ForCausalLM, layer: int, module: str, got: dict, method: str, where: str) -> None:
    """Swap layer `layer`'s module for its quantised version holding the parts read."""
    block = model.layers[layer]
    if module == "experts":
        experts = block.mlp.experts
        count = experts.gate_up_proj.shape[0]
        gate_up = [concat_parts([got[("gate_up_proj", 2 * e)][0], got[("gate_up_proj", 2 * e + 1)][0]])
                   for e in range(count)]
        matrices = {"gate_up_proj": gate_up, "down_proj": [got[("down_proj", 2 * e)][0] for e in range(count)]}
        if method == "fp8" or any(got[key][1] is not None for key in got):
            raise WeightsError(f"{where}: quantised MoE experts are read from AWQ and GPTQ checkpoints without act "
                               "order only")
        block.mlp.experts = CheckpointExperts(matrices, experts.matmul_path)
        return
    parent_name, _, attr = module.rpartition(".")
    parent = block.get_submodule(parent_name)
    linear = getattr(parent, attr)
    ordered = [got[key] for key in sorted(got, key=lambda k: k[1])]
    if method == "fp8":
        new = fp8_linear(linear, ordered)
    else:
        orders = [order for _, order in ordered]
        if any(o is not None for o in orders) and not all(o is not None and torch.equal(o, orders[0])
                                                          for o in orders):
            raise WeightsError(f"{where}: the act-order g_idx of the projections that share this input differ; "
                               "nanoqwen needs them equal (as GPTQ makes them from one input)")
        new = fused_linear(linear, [w for w, _ in ordered])
        if orders[0] is not None:
            new = InputOrderLinear(new, orders[0])
    rows = sum(w.q.shape[0] for w, _ in ordered) if method != "fp8" else sum(w.shape[0] for w, _ in ordered)
    if rows != linear.weight.shape[0]:
        raise WeightsError(f"{where}: the quantised projections hold {rows} output rows, config.json implies "
                           f"{linear.weight.shape[0]}")
    if linear.bias is not None:  # (read with the rest of the checkpoint, into the same Parameter)
        (new.inner if isinstance(new, InputOrderLinear) else new).bias = linear.bias
    setattr(parent, attr, new)
