"""The Qwen3 decoder (dense and MoE), written from plain tensor operations.

Read top to bottom: RMSNorm -> RoPE -> SwiGLU -> attention (QK-norm, GQA) -> MLP or sparse MoE block
-> decoder layer -> the whole model. It computes what transformers' Qwen3ForCausalLM and
Qwen3MoeForCausalLM compute. The building blocks that are not Qwen3's own math live beside it in
nanoqwen/layers/: the linear layers (whole, or cut for tensor parallelism), the embedding table and
the MoE experts computed grouped by expert.

Two layout choices, both made so one batch can mix sequences of different lengths:
- Tokens are flat: a batch of sequences is one [num_tokens, hidden] tensor, so every matmul
  runs once over all tokens with no padding. Only attention needs to know where each
  sequence starts; `AttentionMetadata` (nanoqwen/attention/metadata.py) tells it.
- The checkpoint's q/k/v projections are stored as one `qkv_proj` matrix and gate/up as one
  `gate_up_proj` (stacked at load time), so each layer does two big matmuls instead of five.

Shapes: N = tokens in the batch, H = hidden_size, Hq/Hkv = query/key-value heads,
D = head_dim, I = intermediate_size, V = vocab_size; MoE: E = num_experts, K = num_experts_per_tok,
Ie = moe_intermediate_size.

Tensor parallelism (tp_size ranks, nanoqwen/distributed.py) lives in the layers that are cut
(nanoqwen/layers/linear.py): qkv_proj and gate_up_proj hold 1/tp of their output rows, o_proj and
down_proj the matching 1/tp of their input columns and add the ranks' parts with one all_reduce. MoE
experts are cut the same way over Ie (the router is whole on every rank, so all ranks pick the same
experts), with one all_reduce after the expert sum; the embedding is cut over the vocabulary. So a
layer costs two all_reduce calls, the only places ranks talk; at tp_size 1 every all_reduce is
skipped: the plain model.

`Kernels` names the functions the layers call for their elementwise math and how their matmuls run.
The plain ones of this file are the reference; an engine builds the model with faster versions of
the same functions (nanoqwen/worker/kernel_selection.py), its own choice.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from nanoqwen.attention.attend import attend
from nanoqwen.attention.kv_cache import KVCache
from nanoqwen.attention.metadata import AttentionMetadata
from nanoqwen.config.model import Qwen3Config, check_tensor_parallel_size
from nanoqwen.distributed import all_reduce, gather
from nanoqwen.layers.embedding import VocabParallelEmbedding
from nanoqwen.layers.experts import Experts
from nanoqwen.layers.linear import ColumnParallelLinear, Linear, RowParallelLinear
from nanoqwen.ops.cpu.matmul import TORCH_MATMUL, MatmulPath


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight, normalised in float32 like transformers."""
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, kernels: Kernels) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps, self.kernels = eps, kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.rms_norm(x, self.weight, self.eps)


def rope_inv_freq(config: Qwen3Config) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [D/2] and the cos/sin scale, for default RoPE or YaRN."""
    dim, base = config.head_dim, config.rope_theta
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    inv_freq = 1.0 / pos_freqs
    if config.rope_scaling is None:
        return inv_freq, 1.0
    # YaRN: interpolate the low frequencies by `factor`, keep the high ones, ramp in between.
    s = config.rope_scaling
    factor, original_len = s["factor"], s["original_max_position_embeddings"]
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return dim * math.log(original_len / (num_rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / max(high - low, 1e-3)).clamp(0, 1)
    inv_freq = inv_freq / factor * ramp + inv_freq * (1 - ramp)
    scale = s.get("attention_factor") or (0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0)
    return inv_freq, float(scale)


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE with cos/sin precomputed for every position up to max_len."""

    def __init__(self, config: Qwen3Config, max_len: int) -> None:
        super().__init__()
        inv_freq, scale = rope_inv_freq(config)
        freqs = torch.arange(max_len, dtype=torch.float32)[:, None] * inv_freq[None, :]  # [L, D/2]
        angles = torch.cat([freqs, freqs], dim=-1)  # [L, D]: both halves use the same angle
        self.register_buffer("cos", angles.cos() * scale, persistent=False)
        self.register_buffer("sin", angles.sin() * scale, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
        # [N, D] each, in the activation dtype as transformers casts them
        return self.cos[positions].to(dtype), self.sin[positions].to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, heads, D]; cos/sin [N, D], shared by every head."""
    return x * cos[:, None, :] + rotate_half(x) * sin[:, None, :]


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up [N, 2I] (gate and up stacked) -> [N, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


@dataclass(frozen=True)
class Kernels:
    """The functions the layers call for their elementwise math, and how their matmuls run (`matmul`:
    nanoqwen/ops/cpu/matmul.py, read by every linear layer, the int8 and int4 ones and prompt attention).
    The defaults, the plain functions above and torch's own matmuls, are the reference. An engine builds
    its model with faster versions of the same functions (nanoqwen/worker/kernel_selection.py:
    torch.compile'd elementwise kernels, nanoqwen's C++ ones, the CPU's measured matmul path), so two
    engines in one process each compute with their own."""

    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor] = rms_norm
    apply_rope: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] = apply_rope
    swiglu: Callable[[torch.Tensor], torch.Tensor] = swiglu
    matmul: MatmulPath = TORCH_MATMUL


PLAIN_KERNELS = Kernels()


def attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
                        ) -> torch.Tensor:
    """Grouped-query attention, the documented reference path.

    q [B, Hq, T, D]; k, v [B, Hkv, S, D]; mask [B or 1, 1, T, S] bool (True = may attend) or None.
    Each group of Hq/Hkv query heads shares one key/value head: the query heads are viewed as
    [B, Hkv, G, T, D] so K/V broadcast over G and are never repeated in memory.
    """
    b, hq, t, d = q.shape
    hkv = k.shape[1]
    qg = q.view(b, hkv, hq // hkv, t, d)
    scores = (qg @ k.unsqueeze(2).transpose(-1, -2)) * d**-0.5  # [B, Hkv, G, T, S]
    if mask is not None:
        scores = scores.masked_fill(~mask.unsqueeze(2), float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return (probs @ v.unsqueeze(2)).view(b, hq, t, d)


class Attention(nn.Module):
    """QK-norm grouped-query attention. With tp_size > 1 this rank's heads: whole GQA groups, so
    each query head finds its key/value head on the same rank."""

    def __init__(self, config: Qwen3Config, layer_idx: int, tp_rank: int = 0, tp_size: int = 1,
                 kernels: Kernels = PLAIN_KERNELS) -> None:
        super().__init__()
        self.layer_idx, self.kernels = layer_idx, kernels
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads // tp_size
        self.num_kv_heads = config.num_key_value_heads // tp_size
        q_size = config.num_attention_heads * self.head_dim
        kv_size = config.num_key_value_heads * self.head_dim
        self.qkv_proj = ColumnParallelLinear(config.hidden_size, [q_size, kv_size, kv_size],
                                             config.attention_bias, tp_size, kernels.matmul)
        self.o_proj = RowParallelLinear(q_size, config.hidden_size, config.attention_bias,
                                        tp_rank, tp_size, kernels.matmul)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, kernels)  # per head, before RoPE
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, kernels)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.qkv_proj.output_sizes, dim=-1)
        q = self.q_norm(q.view(n, self.num_heads, self.head_dim))  # [N, Hq, D]
        k = self.k_norm(k.view(n, self.num_kv_heads, self.head_dim))  # [N, Hkv, D]
        v = v.view(n, self.num_kv_heads, self.head_dim)  # [N, Hkv, D]
        q, k = self.kernels.apply_rope(q, cos, sin), self.kernels.apply_rope(k, cos, sin)
        # [N, Hq, D]: nanoqwen/attention/attend.py
        out = attend(q, k, v, kv_cache, self.layer_idx, meta, self.kernels.matmul)
        return self.o_proj(out.view(n, -1))  # [N, H]


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), with gate and up stacked in one matrix [2I, H].

    With tp_size > 1 a rank holds I/tp of the columns: [gate_r; up_r] rows and the matching
    down_proj columns.
    """

    def __init__(self, config: Qwen3Config, tp_rank: int = 0, tp_size: int = 1,
                 kernels: Kernels = PLAIN_KERNELS) -> None:
        super().__init__()
        i = config.intermediate_size
        self.kernels = kernels
        self.gate_up_proj = ColumnParallelLinear(config.hidden_size, [i, i], tp_size=tp_size,
                                                 matmul=kernels.matmul)
        self.down_proj = RowParallelLinear(i, config.hidden_size, tp_rank=tp_rank, tp_size=tp_size,
                                           matmul=kernels.matmul)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # [N, 2I/tp] -> [N, I/tp] -> [N, H]
        return self.down_proj(self.kernels.swiglu(self.gate_up_proj(x)))


# ---- Qwen3-MoE: a router picks K of E SwiGLU experts per token
# (transformers' Qwen3MoeSparseMoeBlock)


def experts_reference(x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
                      expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The definition, token by token:
    out[n] = sum_k weights[n, k] * expert_{expert_ids[n, k]}(x[n]).

    x [N, H]; gate_up_proj [E, 2Ie, H]; down_proj [E, H, Ie]; expert_ids, weights [N, K] -> [N, H].
    Every token's K experts' matrices are gathered ([N, K, 2Ie, H]): clear, but too big for
    real use.
    """
    # [N, K, Ie] each
    gate, up = torch.einsum("nkjh,nh->nkj", gate_up_proj[expert_ids], x).chunk(2, dim=-1)
    out = torch.einsum("nkhi,nki->nkh", down_proj[expert_ids], F.silu(gate) * up)  # [N, K, H]
    return (out * weights[..., None]).sum(1)


class SparseMoeBlock(nn.Module):
    """Route each token to its top-K of E experts and sum their outputs, weighted by the router."""

    def __init__(self, config: Qwen3Config, tp_size: int = 1, kernels: Kernels = PLAIN_KERNELS) -> None:
        super().__init__()
        self.top_k, self.norm_topk_prob = config.num_experts_per_tok, config.norm_topk_prob
        self.tp_size = tp_size
        # the router, whole on every rank
        self.gate = Linear(config.hidden_size, config.num_experts, matmul=kernels.matmul)
        self.experts = Experts(config, tp_size, kernels.matmul)  # grouped by expert: experts_reference

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, H] -> (expert ids [N, K], weights [N, K] in x's dtype), computed as transformers
        does."""
        probs = torch.softmax(self.gate(x), dim=-1, dtype=torch.float32)  # [N, E]
        weights, expert_ids = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return expert_ids, weights.to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # with tp_size > 1 this rank's part of every expert's sum, as in RowParallelLinear
        out = self.experts(x, *self.route(x))  # [N, H]
        return all_reduce(out) if self.tp_size > 1 else out


class DecoderLayer(nn.Module):
    def __init__(self, config: Qwen3Config, layer_idx: int, tp_rank: int = 0, tp_size: int = 1,
                 kernels: Kernels = PLAIN_KERNELS) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, kernels)
        self.self_attn = Attention(config, layer_idx, tp_rank, tp_size, kernels)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, kernels)
        moe = config.is_moe_layer(layer_idx)
        self.mlp = (SparseMoeBlock(config, tp_size, kernels) if moe
                    else MLP(config, tp_rank, tp_size, kernels))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3ForCausalLM(nn.Module):
    """Embedding -> decoder layers -> final norm; `compute_logits` applies the LM head.

    tp_rank/tp_size: build only this rank's shard of every weight (see the module docstring).
    lm_head=False: no LM head (an embedding model reads the final hidden states only).
    kernels: the functions the layers compute with (the plain ones of this file by default).
    """

    def __init__(self, config: Qwen3Config, max_model_len: int | None = None, tp_rank: int = 0,
                 tp_size: int = 1, lm_head: bool = True, kernels: Kernels = PLAIN_KERNELS) -> None:
        super().__init__()
        check_tensor_parallel_size(config, tp_size)
        self.config, self.tp_rank, self.tp_size, self.kernels = config, tp_rank, tp_size, kernels
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size,
                                                   tp_rank, tp_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i, tp_rank, tp_size, kernels)
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, kernels)
        self.lm_head: Linear | None = None
        if lm_head:
            self.lm_head = ColumnParallelLinear(config.hidden_size, [config.vocab_size],
                                                tp_size=tp_size, matmul=kernels.matmul)  # [V/tp, H]
        if lm_head and config.tie_word_embeddings:
            # a tied head is the embedding matrix itself: one tensor, not a copy
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = RotaryEmbedding(config, max_model_len or config.max_position_embeddings)

    @property
    def dtype(self) -> torch.dtype:
        """The model dtype: activations and the KV cache (the final norm's weight is always in it)."""
        return self.norm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    @property
    def is_tied(self) -> bool:
        return self.lm_head is not None and self.lm_head.weight is self.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions [N] -> final hidden states [N, H]."""
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary(positions, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, kv_cache, meta)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor,
                       dtype: torch.dtype | None = torch.float32) -> torch.Tensor | None:
        """hidden [M, H] -> logits [M, V] in dtype (None: the LM head's own); call it only on the positions
        that get sampled.

        With tp_size > 1 each rank computes its slice of the vocabulary [M, V/tp] and rank 0 gathers
        the slices (the other ranks get None: only rank 0 samples).
        """
        logits = self.lm_head(hidden)
        if self.tp_size > 1:
            logits = gather(logits, dim=-1)
        return logits.to(dtype) if logits is not None and dtype is not None else logits

    @property
    def num_kv_heads(self) -> int:
        """Key/value heads on this rank (what its KV cache holds)."""
        return self.config.num_key_value_heads // self.tp_size
