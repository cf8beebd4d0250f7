"""The CPU decode step in one C++ call, from token ids to logits: a fast path beside the model's forward.

On a CPU without fast bf16 (ops/cpu/matmul.py), a decode step of a few sequences already runs every part of a layer
through nanoqwen's own kernels (ops/cpu/kernels.py): RMSNorm, the projections (bf16, int8 or int4), QK-norm,
RoPE, the KV store, paged attention, SwiGLU. Called from Python one by one they leave gaps: about 20 module
calls a layer, each some microseconds of Python and dispatch (more in a decode step, where the weights streamed
through the caches have pushed Python's own data out of them), and the kernels' threads fall asleep between
them (bench/bench_decode_step.py measures what this buys). `decode_model` in csrc/module.cpp takes the
embedding's rows and the step's cos and sin as RotaryEmbedding gives them, calls, layer after layer, the same
kernels in the same order as `DecoderLayer.forward` does on this path (QK-norm, RoPE and the KV store in one
pass over the rows:
`attention_inputs`; each residual add and the norm after it, the next layer's or the final one, in one:
`add_rms_norm`), then the LM head: so the same logits, to the bit, as the model's forward and compute_logits
(tests/ops/cpu/test_matmul_path.py compares them).

Used by ModelRunner for steps of decode rows only (no prompt chunk), up to the gemv kernels' row count
(cpu.matmul_path().gemv_max_rows), when
`FusedDecoder.supports(model)`: bf16 activations, the "cpu" paged attention backend, dense layers (not MoE),
no attention bias, an LM head, one rank. NANOQWEN_FUSED_DECODE=0 turns it off (the per-module path).

`FusedDecoder.greedy_steps` runs several greedy decode steps in one call (`decode_steps`: the engine's
num_scheduler_steps), each step's argmax fed to the next in C++, so no Python runs between them: the fast path
beside ModelRunner's step-by-step loop, and the same tokens (tests/engine/test_multi_step.py).

Both take one LoRA adapter for every row (LoRAManager.fused_decoder_weights, None: the base model): each adapted
linear adds (x @ A^T) @ B^T to its output as the adapter's forward hook does for a step whose rows all share one
slot (nanoqwen/lora/layers.py), through the same kernels, so the same logits (tests/lora/test_fused_lora.py). A
step whose rows use different adapters, or some none, runs the model's per-module forward.

Both read and write the KV cache in place whatever its kv_cache_dtype: bf16, or quantized (int8 or float8 codes and
their scales, KVCache.k_scale and v_scale, attention/kv_cache.py): attention_inputs stores each new key and value
as quantize_kv would, paged_decode_attention reads the codes with their scales (tests/ops/cpu/test_kv_cache_kernels.py).
"""

from __future__ import annotations

import os

import torch

from nanoqwen.attention.kv_cache import KVCache
from nanoqwen.attention.metadata import AttentionMetadata
from nanoqwen.layers.embedding import VocabParallelEmbedding
from nanoqwen.layers.linear import Linear
from nanoqwen.models.qwen3 import MLP, DecoderLayer, Qwen3ForCausalLM
from nanoqwen.ops.cpu import kernels as cpu_kernels
from nanoqwen.ops.quantize import INT4_BLOCK_ROWS
from nanoqwen.quantization import Int4Linear, Int8Linear, QuantizedLinear
from nanoqwen.quantization.fp8 import Fp8Linear
from nanoqwen.quantization.int8_group import Int8GroupLinear
from nanoqwen.quantization.prequantized import QuantizedEmbedding, StackedLinear

LinearPart = tuple[str, list[torch.Tensor]]  # a matrix as decode_model takes it: its format's name, its tensors


def linear_tensors(linear: Linear) -> LinearPart:
    """What decode_model takes for a linear's matrix: ("bf16", [weight]), ("int8", [weight, scale]), ("int8_group",
    [weight, scale, offset, super_scale, super_offset]) with an empty tensor for each one it lacks, ("int4", [weight,
    scale, offset(, super_scale, super_offset)]), the offset an empty tensor where symmetric, or ("fp8", [weight,
    scale])."""
    none = torch.empty(0)
    if isinstance(linear, Int4Linear):
        return "int4", [linear.weight, linear.scale, none if linear.offset is None else linear.offset,
                        *linear.supers()]
    if isinstance(linear, Int8Linear):
        return "int8", [linear.weight, linear.scale]
    if isinstance(linear, Int8GroupLinear):
        return "int8_group", [none if t is None else t for t in (linear.weight, linear.scale, linear.offset,
                                                                 linear.super_scale, linear.super_offset)]
    if isinstance(linear, Fp8Linear):
        return "fp8", [linear.weight, linear.scale]
    return "bf16", [linear.weight]


def linear_parts(linear: torch.nn.Module) -> list[LinearPart]:
    """What decode_model takes for a linear: its parts' matrices (linear_tensors), one part unless stacked."""
    if isinstance(linear, StackedLinear):
        return [linear_tensors(part) for part in linear.parts]
    return [linear_tensors(linear)]


def runs_fused(linear: torch.nn.Module) -> bool:
    """Whether decode_model has a kernel for this linear's format (bf16, int8, grouped int8, int4, FP8, or a stack
    of those: not a linear that reorders its inputs)."""
    if isinstance(linear, StackedLinear):
        return all(runs_fused(part) for part in linear.parts)
    if isinstance(linear, Int4Linear | Int8Linear | Int8GroupLinear | Fp8Linear):
        return True
    return isinstance(linear, Linear) and not isinstance(linear, QuantizedLinear)


def embedding_tensors(embedding: VocabParallelEmbedding | QuantizedEmbedding) -> LinearPart:
    """What decode_model takes for the embedding table: its bf16 matrix, or a quantised table's tensors."""
    if isinstance(embedding, QuantizedEmbedding):
        return linear_tensors(embedding.table)
    return "bf16", [embedding.weight]


class FusedDecoder:
    """Runs a model's decode steps through decode_model; the model's modules keep their tensors (nothing
    copied)."""

    def __init__(self, model: Qwen3ForCausalLM) -> None:
        layers = [cpu_kernels.decoder_layer_weights(**self._layer_weights(layer)) for layer in model.layers]
        self.weights = cpu_kernels.decoder_model_weights(
            embed=embedding_tensors(model.embed_tokens), cos=model.rotary.cos, sin=model.rotary.sin, layers=layers,
            norm=model.norm.weight, eps=model.norm.eps, lm_head=linear_parts(model.lm_head))

    @staticmethod
    def supports(model: Qwen3ForCausalLM, attention_backend: str | None) -> bool:
        c = model.config
        return (os.environ.get("NANOQWEN_FUSED_DECODE", "1") != "0" and attention_backend == "cpu"
                and model.tp_size == 1 and model.dtype == torch.bfloat16
                and (type(model.embed_tokens) is VocabParallelEmbedding
                     or isinstance(model.embed_tokens, QuantizedEmbedding)
                     and model.embed_tokens.weight.shape[0] % INT4_BLOCK_ROWS == 0)
                and model.lm_head is not None and model.lm_head.bias is None
                and not c.attention_bias and all(isinstance(layer.mlp, MLP) for layer in model.layers)
                and all(linear.bias is None and runs_fused(linear) for layer in model.layers
                        for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                       layer.mlp.gate_up_proj, layer.mlp.down_proj))
                and runs_fused(model.lm_head)
                and cpu_kernels.available())

    @staticmethod
    def _layer_weights(layer: DecoderLayer) -> dict:
        attn, mlp = layer.self_attn, layer.mlp
        return {"input_norm": layer.input_layernorm.weight, "post_norm": layer.post_attention_layernorm.weight,
                "eps": layer.input_layernorm.eps, "qkv_proj": linear_parts(attn.qkv_proj),
                "q_norm": attn.q_norm.weight, "k_norm": attn.k_norm.weight, "o_proj": linear_parts(attn.o_proj),
                "gate_up_proj": linear_parts(mlp.gate_up_proj), "down_proj": linear_parts(mlp.down_proj),
                "num_heads": attn.num_heads}

    def __call__(self, input_ids: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata,
                 lora: object | None = None) -> torch.Tensor:
        """input_ids [B] (one decode token per sequence) -> float32 logits [B, V]: the model's forward and
        compute_logits, with the adapter `lora` on every row (LoRAManager.fused_decoder_weights) or none."""
        paged = meta.paged_decode
        return cpu_kernels.decode_model(self.weights, input_ids, meta.positions, kv_cache.k, kv_cache.v,
                                        meta.slot_mapping, paged.block_tables, paged.context_lens, lora=lora,
                                        k_scales=kv_cache.k_scale, v_scales=kv_cache.v_scale)

    def greedy_steps(self, input_ids: list[int], context_lens: list[int], block_tables: list[list[int]],
                     stop_token_ids: list[set[int]], num_steps: int, kv_cache: KVCache,
                     lora: object | None = None) -> list[list[int]]:
        """Up to num_steps greedy decode steps of M rows in one call: row m feeds input_ids[m] at position
        context_lens[m] - 1 (its context after step 0), then each step's argmax; block_tables must cover the last
        step. Stops early after a step where every row produced one of its stop ids. -> the tokens of each step
        run, [steps][M]. lora: as __call__'s."""
        width = max(map(len, stop_token_ids), default=0)
        stops = [[*sorted(s), *[-1] * (width - len(s))] for s in stop_token_ids]  # [M, S], -1 pads
        tokens = cpu_kernels.decode_steps(
            self.weights, torch.tensor(input_ids), kv_cache.k, kv_cache.v,
            torch.tensor(block_tables, dtype=torch.int32), torch.tensor(context_lens, dtype=torch.int32),
            torch.tensor(stops, dtype=torch.long).view(len(stops), width), num_steps, lora=lora,
            k_scales=kv_cache.k_scale, v_scales=kv_cache.v_scale)  # [steps run, M]
        return tokens.tolist()
