"""The Qwen3 decoder (dense and MoE), written from plain tensor operations.

Read top to bottom: RMSNorm -> RoPE -> attention (QK-norm, GQA) -> SwiGLU MLP or sparse MoE (qwen3_moe.py)
block -> decoder layer -> the whole model. It computes what transformers' Qwen3ForCausalLM and
Qwen3MoeForCausalLM compute.

Two layout choices, both made so one batch can mix sequences of different lengths:
- Tokens are flat: a batch of sequences is one [num_tokens, hidden] tensor, so every matmul
  runs once over all tokens with no padding. Only attention needs to know where each
  sequence starts; `AttentionMetadata` (nanoqwen/engine/kv_cache.py) tells it.
- The checkpoint's q/k/v projections are stored as one `qkv_proj` matrix and gate/up as one
  `gate_up_proj` (stacked at load time), so each layer does two big matmuls instead of five.

Shapes: N = tokens in the batch, H = hidden_size, Hq/Hkv = query/key-value heads,
D = head_dim, I = intermediate_size, V = vocab_size; MoE: E = num_experts, K = num_experts_per_tok,
Ie = moe_intermediate_size.

Tensor parallelism (tp_size ranks, nanoqwen/distributed.py): each rank holds Hq/tp query heads and Hkv/tp
key-value heads (qkv_proj split by rows, "column-parallel"), I/tp MLP columns (gate_up_proj by rows), and
the matching input columns of o_proj and down_proj ("row-parallel"): a rank's o_proj/down_proj output is
its part of a sum, and one all_reduce per projection adds the parts. MoE experts are split the same way over
Ie (the router is whole on every rank, so all ranks pick the same experts), with one all_reduce after the
expert sum. The embedding and the LM head are split over the vocabulary. So a layer costs two all_reduce
calls, and they are the only places ranks talk. At tp_size 1 every all_reduce is skipped: the plain model.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from nanoqwen.config import Qwen3Config
from nanoqwen.distributed import all_reduce, check_tensor_parallel_size, gather
from nanoqwen.ops.attention import attention_sdpa, decode_attention, prefill_attention_blocked
from nanoqwen.ops.paged_attention import paged_decode_attention

if TYPE_CHECKING:
    from nanoqwen.engine.kv_cache import AttentionMetadata, KVCache


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight, normalised in float32 like transformers."""
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


class Linear(nn.Module):
    """y = x @ weight.T + bias; weight [out, in], filled by the loader (int8 swaps in nanoqwen/quantization.py)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.rms_norm(x, self.weight, self.eps)


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

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
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


class Kernels:
    """The elementwise functions the layers call. nanoqwen/compilation.py may swap in torch.compile'd
    versions of the same functions (one fused kernel each); these plain ones stay the reference."""

    rms_norm = staticmethod(rms_norm)
    apply_rope = staticmethod(apply_rope)
    swiglu = staticmethod(swiglu)


kernels = Kernels()


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
    def __init__(self, config: Qwen3Config, layer_idx: int, tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__()
        self.layer_idx, self.tp_size = layer_idx, tp_size
        # this rank's heads: whole GQA groups, so each query head finds its key/value head on the same rank
        self.num_heads, self.num_kv_heads, self.head_dim = (
            config.num_attention_heads // tp_size, config.num_key_value_heads // tp_size, config.head_dim)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.split_sizes = [q_size, kv_size, kv_size]
        self.qkv_proj = Linear(config.hidden_size, q_size + 2 * kv_size, bias=config.attention_bias)
        # Row-parallel: the bias must be added once to the sum over ranks, so only rank 0 has it (as in vLLM).
        self.o_proj = Linear(q_size, config.hidden_size, bias=config.attention_bias and tp_rank == 0)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)  # per head, before RoPE
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.split_sizes, dim=-1)
        q = kernels.apply_rope(self.q_norm(q.view(n, self.num_heads, self.head_dim)), cos, sin)  # [N, Hq, D]
        k = kernels.apply_rope(self.k_norm(k.view(n, self.num_kv_heads, self.head_dim)), cos, sin)  # [N, Hkv, D]
        v = v.view(n, self.num_kv_heads, self.head_dim)
        kv_cache.store(self.layer_idx, k, v, meta)
        out = torch.empty_like(q)  # [N, Hq, D]
        if meta.paged_decode is not None:
            # GPU: all decode tokens (one query per sequence) in one call reading the cache blocks in place.
            p, rows = meta.paged_decode, slice(0, meta.num_decode_tokens)
            paged_decode_attention(q[rows], kv_cache.k[self.layer_idx], kv_cache.v[self.layer_idx], p.block_tables,
                                   p.context_lens, self.head_dim**-0.5, p.backend, out=out[rows])
        else:
            # CPU: decode tokens are batched, a group of similar lengths per attention call, their blocks gathered.
            for group in meta.decode_groups:
                k_ctx, v_ctx = kv_cache.decode_context(self.layer_idx, group)  # [B, Hkv, S, D]
                rows = slice(group.start, group.end)
                out[rows] = decode_attention(q[rows], k_ctx, v_ctx, group.mask)
        # Prompt chunks attend causally to their own tokens and to what the cache already held.
        for chunk in meta.prefills:
            k_ctx, v_ctx = kv_cache.sequence_context(self.layer_idx, chunk)  # [1, Hkv, S, D]
            rows = slice(chunk.query_start, chunk.query_start + chunk.query_len)
            qp = q[rows].transpose(0, 1)  # [Hq, T, D]
            if q.device.type == "cpu" and q.dtype != torch.float32:
                o = prefill_attention_blocked(qp, k_ctx[0], v_ctx[0], chunk.context_len - chunk.query_len)
            else:
                causal = chunk.context_len == chunk.query_len  # nothing cached before: the plain causal mask
                o = attention_sdpa(qp[None], k_ctx, v_ctx, None if causal else chunk.causal_mask,
                                  causal=causal)[0]
            out[rows] = o.transpose(0, 1)
        out = self.o_proj(out.view(n, -1))  # [N, H]; with tp_size > 1 only this rank's heads' share
        return all_reduce(out) if self.tp_size > 1 else out


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), with gate and up stacked in one matrix [2I, H].

    With tp_size > 1 a rank holds I/tp of the columns: [gate_r; up_r] rows and the matching down_proj columns.
    """

    def __init__(self, config: Qwen3Config, tp_size: int = 1) -> None:
        super().__init__()
        self.tp_size = tp_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size // tp_size)
        self.down_proj = Linear(config.intermediate_size // tp_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.down_proj(kernels.swiglu(self.gate_up_proj(x)))  # [N, H]; with tp_size > 1 this rank's share
        return all_reduce(out) if self.tp_size > 1 else out


class DecoderLayer(nn.Module):
    def __init__(self, config: Qwen3Config, layer_idx: int, tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_idx, tp_rank, tp_size)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if config.is_moe_layer(layer_idx):
            from nanoqwen.models.qwen3_moe import SparseMoeBlock  # builds on Linear above: imported once it exists

            self.mlp: nn.Module = SparseMoeBlock(config, tp_size)
        else:
            self.mlp = MLP(config, tp_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class VocabParallelEmbedding(nn.Module):
    """The embedding table; with tp_size > 1 only rows [vocab_start, vocab_end) of it, on this rank."""

    def __init__(self, vocab_size: int, hidden_size: int, tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__()
        rows = vocab_size // tp_size
        self.tp_size, self.vocab_start, self.vocab_end = tp_size, tp_rank * rows, (tp_rank + 1) * rows
        self.weight = nn.Parameter(torch.empty(rows, hidden_size), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        # Each rank looks up the ids in its range and gives zeros for the others: the sum is every id's row.
        mine = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        x = F.embedding(torch.where(mine, input_ids - self.vocab_start, 0), self.weight)
        return all_reduce(x.masked_fill_(~mine[:, None], 0))


class Qwen3ForCausalLM(nn.Module):
    """Embedding -> decoder layers -> final norm; `compute_logits` applies the LM head.

    tp_rank/tp_size: build only this rank's shard of every weight (see the module docstring).
    """

    def __init__(self, config: Qwen3Config, max_model_len: int | None = None, tp_rank: int = 0,
                 tp_size: int = 1) -> None:
        super().__init__()
        check_tensor_parallel_size(config, tp_size)
        self.config, self.tp_rank, self.tp_size = config, tp_rank, tp_size
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp_rank, tp_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i, tp_rank, tp_size) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = Linear(config.hidden_size, config.vocab_size // tp_size)  # this rank's vocabulary rows
        if config.tie_word_embeddings:  # a tied head is the embedding matrix itself: one tensor, not a copy
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = RotaryEmbedding(config, max_model_len or config.max_position_embeddings)

    @property
    def is_tied(self) -> bool:
        return self.lm_head.weight is self.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions [N] -> final hidden states [N, H]."""
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary(positions, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, kv_cache, meta)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """hidden [M, H] -> float32 logits [M, V]; call it only on the positions that get sampled.

        With tp_size > 1 each rank computes its slice of the vocabulary [M, V/tp] and rank 0 gathers the
        slices (the other ranks get None: only rank 0 samples).
        """
        logits = self.lm_head(hidden)
        if self.tp_size > 1:
            logits = gather(logits, dim=-1)
        return logits.float() if logits is not None else None

    @property
    def num_kv_heads(self) -> int:
        """Key/value heads on this rank (what its KV cache holds)."""
        return self.config.num_key_value_heads // self.tp_size
