"""A GGUF file's tensors into the model (the file is read by gguf_file.py): float tensors into the parameters in
the model dtype, quantised ones as nanoqwen's quantised modules holding them as they are
(nanoqwen/quantization/prequantized.py), never quantised a second time."""

from __future__ import annotations

import torch

from nanoqwen.errors import WeightsError
from nanoqwen.layers.linear import Linear
from nanoqwen.model_loader.gguf_file import GGUFCheckpoint
from nanoqwen.model_loader.sharding import model_share
from nanoqwen.models.qwen3 import Qwen3ForCausalLM
from nanoqwen.ops.cpu.memory import release_freed_memory
from nanoqwen.ops.gguf_quants import FLOAT_TYPES, GroupedWeights, unpack
from nanoqwen.quantization.prequantized import (
    CheckpointExperts,
    QuantizedEmbedding,
    concat_parts,
    fused_linear,
    quantized_linear,
)

# a layer's GGUF tensor -> (our module, part of a fused matrix or None)
LAYER_LINEARS = {"attn_q": ("self_attn.qkv_proj", 0), "attn_k": ("self_attn.qkv_proj", 1),
                 "attn_v": ("self_attn.qkv_proj", 2), "attn_output": ("self_attn.o_proj", None),
                 "ffn_gate": ("mlp.gate_up_proj", 0), "ffn_up": ("mlp.gate_up_proj", 1),
                 "ffn_down": ("mlp.down_proj", None), "ffn_gate_inp": ("mlp.gate", None)}
LAYER_VECTORS = {"attn_norm": "input_layernorm.weight", "ffn_norm": "post_attention_layernorm.weight",
                 "attn_q_norm": "self_attn.q_norm.weight", "attn_k_norm": "self_attn.k_norm.weight"}
LAYER_EXPERTS = {"ffn_gate_exps": ("gate_up_proj", 0), "ffn_up_exps": ("gate_up_proj", 1),
                 "ffn_down_exps": ("down_proj", None)}


def load_gguf_weights(model: Qwen3ForCausalLM, ckpt: GGUFCheckpoint) -> None:
    """Fill the model from the file: float tensors copied into the parameters (model dtype), quantised ones as
    nanoqwen's quantised modules in place of the model's Linears, Experts and embedding (the model-dtype
    parameters they replace were never written, so on CPU their memory was never committed). With tensor
    parallelism, this rank's share of each matrix, cut as its parameter's module says (sharding.model_share)."""
    dtype = model.norm.weight.dtype
    seen: set[str] = set()
    layer_parts: dict[tuple[int, str], dict[int | None, torch.Tensor | GroupedWeights]] = {}
    expert_parts: dict[tuple[int, str], dict[int | None, torch.Tensor | GroupedWeights]] = {}

    def copy_into(param: torch.Tensor, value: torch.Tensor, name: str) -> None:
        if tuple(value.shape) != tuple(param.shape):
            raise WeightsError(f"{ckpt.path}: tensor {name!r} has shape {list(value.shape)}, but the file's "
                               f"metadata implies {list(param.shape)}")
        with torch.no_grad():
            param.copy_(value)

    for name in ckpt.tensors:
        seen.add(name)
        parts = name.split(".")
        if name == "token_embd.weight":
            continue  # after the head (a tied head shares it)
        if name == "output_norm.weight":
            copy_into(model.norm.weight, ckpt.matrix(name), name)
        elif name == "output.weight":
            if model.lm_head is not None:
                head = model_share(model, "lm_head.weight", ckpt.matrix(name), name)
                model.lm_head = _linear(model.lm_head, head, name, ckpt)
        elif len(parts) == 4 and parts[0] == "blk" and parts[3] == "weight" and parts[1].isdigit():
            i, kind = int(parts[1]), parts[2]
            if i >= len(model.layers):
                raise WeightsError(f"{ckpt.path}: tensor {name!r} is beyond the file's block_count "
                                   f"({len(model.layers)})")
            layer = model.layers[i]
            if kind in LAYER_VECTORS:
                copy_into(layer.get_parameter(LAYER_VECTORS[kind]), ckpt.matrix(name), name)
            elif kind in LAYER_LINEARS:
                module, part = LAYER_LINEARS[kind]
                layer_parts.setdefault((i, module), {})[part] = model_share(model, f"layers.{i}.{module}.weight",
                                                                         ckpt.matrix(name), name)
                _fill_linear(model, i, module, layer_parts, ckpt)
            elif kind in LAYER_EXPERTS:
                matrix, half = LAYER_EXPERTS[kind]
                expert_parts.setdefault((i, matrix), {})[half] = [
                    model_share(model, f"layers.{i}.mlp.experts.{matrix}", w, name)
                    for w in _expert_matrices(ckpt, name)]
                _fill_experts(model, i, expert_parts, ckpt)
            else:
                raise WeightsError(f"unexpected tensor {name!r} in {ckpt.path}: it has no place in a Qwen3 model")
        else:
            raise WeightsError(f"unexpected tensor {name!r} in {ckpt.path}: it has no place in a Qwen3 model")
        release_freed_memory()
    missing = [*layer_parts, *expert_parts]
    if "token_embd.weight" not in seen:
        raise WeightsError(f"{ckpt.path}: tensor 'token_embd.weight' is missing")
    _fill_embedding(model, ckpt, dtype)
    if missing:
        i, module = missing[0]
        raise WeightsError(f"{ckpt.path}: the tensors of layer {i}'s {module} are incomplete (a part is missing)")
    _check_all_filled(model, ckpt, seen)


def _expert_matrices(ckpt: GGUFCheckpoint, name: str) -> list[torch.Tensor | GroupedWeights]:
    """A stacked expert tensor [E, rows, cols] as one matrix per expert."""
    t = ckpt.checked(name)
    rows = t.rows()
    if t.ggml_type in FLOAT_TYPES:
        return list(rows)
    return [unpack(r, t.ggml_type, t.shape[-1]) for r in rows]


def _linear(linear: Linear, value: torch.Tensor | GroupedWeights, name: str, ckpt: GGUFCheckpoint
            ) -> torch.nn.Module:
    """`linear` filled with a float matrix, or its quantised version holding a quantised one."""
    shape = tuple(value.q.shape if isinstance(value, GroupedWeights) else value.shape)
    if shape != tuple(linear.weight.shape):
        raise WeightsError(f"{ckpt.path}: tensor {name!r} has shape {list(shape)}, but the file's metadata implies "
                           f"{list(linear.weight.shape)}")
    if isinstance(value, GroupedWeights):
        return quantized_linear(linear, value)
    with torch.no_grad():
        linear.weight.copy_(value)
    return linear


def _fill_linear(model: Qwen3ForCausalLM, i: int, module: str,
                 layer_parts: dict[tuple[int, str], dict], ckpt: GGUFCheckpoint) -> None:
    """Once every part of layer i's `module` has been read: put it in place (one matrix from its parts)."""
    parts = layer_parts[(i, module)]
    expected = {"self_attn.qkv_proj": 3, "mlp.gate_up_proj": 2}.get(module, 1)
    if len(parts) < expected:
        return
    del layer_parts[(i, module)]
    ordered = [parts[k] for k in sorted(parts, key=lambda k: -1 if k is None else k)]
    name = f"blk.{i}.{module}"
    layer = model.layers[i]
    parent_name, _, attr = module.rpartition(".")
    parent = layer.get_submodule(parent_name)
    linear = getattr(parent, attr)
    if len(ordered) > 1 and all(isinstance(p, GroupedWeights) for p in ordered):
        rows = sum(p.q.shape[0] for p in ordered)
        if rows != linear.weight.shape[0] or any(p.q.shape[1] != linear.weight.shape[1] for p in ordered):
            shapes = [list(p.q.shape) for p in ordered]
            raise WeightsError(f"{ckpt.path}: the tensors of {name} have shapes {shapes}, the metadata implies "
                               f"{list(linear.weight.shape)}")
        setattr(parent, attr, fused_linear(linear, ordered))
        return
    if all(isinstance(p, GroupedWeights) for p in ordered):
        value: torch.Tensor | GroupedWeights = ordered[0]
    else:  # float parts, or a mix (dequantised: the float ones set the dtype)
        value = torch.cat([p.dequantize() if isinstance(p, GroupedWeights) else p.float() for p in ordered])
    setattr(parent, attr, _linear(linear, value, name, ckpt))


def _fill_experts(model: Qwen3ForCausalLM, i: int, expert_parts: dict, ckpt: GGUFCheckpoint) -> None:
    """Once layer i's three expert tensors have been read: its experts, in place."""
    have = {m for (j, m) in expert_parts if j == i}
    if have != {"gate_up_proj", "down_proj"} or len(expert_parts[(i, "gate_up_proj")]) < 2:
        return
    gate_up, down = expert_parts.pop((i, "gate_up_proj")), expert_parts.pop((i, "down_proj"))
    matrices = {"gate_up_proj": [
        concat_parts([g, u]) if isinstance(g, GroupedWeights) and isinstance(u, GroupedWeights)
        else torch.cat([_as_float(g), _as_float(u)]) for g, u in zip(gate_up[0], gate_up[1], strict=True)],
        "down_proj": down[None]}
    experts = model.layers[i].mlp.experts
    if len(matrices["down_proj"]) != experts.gate_up_proj.shape[0]:
        raise WeightsError(f"{ckpt.path}: layer {i} has {len(matrices['down_proj'])} experts, the metadata "
                           f"says {experts.gate_up_proj.shape[0]}")
    if all(isinstance(w, GroupedWeights) for ws in matrices.values() for w in ws):
        model.layers[i].mlp.experts = CheckpointExperts(matrices, experts.matmul_path)
        return
    for name, ws in matrices.items():
        param = getattr(experts, name)
        value = torch.stack([_as_float(w) for w in ws])
        if value.shape != param.shape:
            raise WeightsError(f"{ckpt.path}: layer {i}'s experts {name} have shape {list(value.shape)}, the "
                               f"metadata implies {list(param.shape)}")
        with torch.no_grad():
            param.copy_(value)


def _as_float(w: torch.Tensor | GroupedWeights) -> torch.Tensor:
    return w.dequantize() if isinstance(w, GroupedWeights) else w.float()


def _fill_embedding(model: Qwen3ForCausalLM, ckpt: GGUFCheckpoint, dtype: torch.dtype) -> None:
    """The embedding table: a float one copied into embed_tokens, a quantised one held as it is (and shared with
    a tied LM head)."""
    value = model_share(model, "embed_tokens.weight", ckpt.matrix("token_embd.weight"), "token_embd.weight")
    tied = model.lm_head is not None and "output.weight" not in ckpt.tensors
    embedding = model.embed_tokens
    if isinstance(value, GroupedWeights):
        if tied:
            template = model.lm_head
        else:
            with torch.device("meta"):  # (only its class and attributes are used)
                template = Linear(value.q.shape[1], value.q.shape[0])
        table = quantized_linear(template, value)
        model.embed_tokens = QuantizedEmbedding(table, dtype, embedding.vocab_start, model.tp_size)
        if tied:
            model.lm_head = table
        return
    if tuple(value.shape) != tuple(embedding.weight.shape):
        raise WeightsError(f"{ckpt.path}: tensor 'token_embd.weight' has shape {list(value.shape)}, the metadata "
                           f"implies {list(embedding.weight.shape)}")
    with torch.no_grad():
        embedding.weight.copy_(value)
    if tied:
        model.lm_head.weight = embedding.weight


def _check_all_filled(model: Qwen3ForCausalLM, ckpt: GGUFCheckpoint, seen: set[str]) -> None:
    """Every layer tensor the model needs was in the file."""
    for i in range(len(model.layers)):
        needed = [*LAYER_VECTORS]
        needed += ["attn_q", "attn_k", "attn_v", "attn_output"]
        needed += ["ffn_gate_inp", *LAYER_EXPERTS] if model.config.is_moe_layer(i) else ["ffn_gate", "ffn_up",
                                                                                      "ffn_down"]
        for kind in needed:
            if f"blk.{i}.{kind}.weight" not in seen:
                raise WeightsError(f"{ckpt.path}: tensor 'blk.{i}.{kind}.weight' is missing")
    if not model.config.tie_word_embeddings and model.lm_head is not None and "output.weight" not in seen:
        raise WeightsError(f"{ckpt.path}: tensor 'output.weight' is missing")
